"""`kiln serve --kv-offload-dir`: a restarted server loads a long system prompt's blocks back from the
folder instead of recomputing them, with the same greedy answer; a server killed while writing, a
corrupt block file, a read-only folder and a full one (a real read-only bind mount and a real 1 MiB
tmpfs, in a mount namespace of the server's own) all leave a server that answers the same."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import ServerProcess

SYSTEM = " ".join(
    f"Rule {i}: answer in the voice of a careful librarian who likes the number {i}." for i in range(40)
)
OTHER_SYSTEM = " ".join(f"Note {i}: the lighthouse keeper counts {i} ships before dawn." for i in range(30))
FLAGS = ("--max-model-len", "2048")
DISK = "{tier=disk}"


def _ask(server: ServerProcess, system: str, question: str = "Which rule comes first?") -> str:
    reply = server.client().chat.completions.create(
        model=server.model,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        max_tokens=12,
        temperature=0,
    )
    return reply.choices[0].message.content or ""


def _offload_flags(folder: Path) -> tuple[str, ...]:
    return (*FLAGS, "--kv-offload-dir", str(folder))


@pytest.fixture(scope="module")
def stored(
    start_server: Callable[..., ServerProcess], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, str]:
    """A folder with the system prompt's blocks, and the answer computed without them."""
    folder = tmp_path_factory.mktemp("kv-offload")
    server = start_server(*_offload_flags(folder))
    answer = _ask(server, SYSTEM)
    assert server.metrics()[f"kiln:kv_offload_hit_blocks_total{DISK}"] == 0
    assert server.stop() == 0  # after the blocks queued are written
    assert len(list(folder.rglob("*.kvb"))) >= 30
    return folder, answer


def _copy(stored: tuple[Path, str], tmp_path: Path) -> tuple[Path, str]:
    """A copy of the stored folder of this test's own, and the answer."""
    folder = tmp_path / "kv"
    shutil.copytree(stored[0], folder)
    return folder, stored[1]


def test_a_restarted_server_loads_the_prefix_back(
    start_server: Callable[..., ServerProcess], stored: tuple[Path, str], tmp_path: Path
) -> None:
    folder, answer = _copy(stored, tmp_path)
    server = start_server(*_offload_flags(folder))
    assert _ask(server, SYSTEM) == answer
    samples = server.metrics()
    assert samples[f"kiln:kv_offload_hit_blocks_total{DISK}"] >= 30
    assert samples["kiln:prefix_cache_hits_total"] >= 30 * 16
    # killed while it writes a new prompt's blocks, and every block file damaged meanwhile
    other = _ask(server, OTHER_SYSTEM)
    killed = server.process.pid
    server.process.kill()
    server.process.wait()
    for path in folder.rglob("*.kvb"):
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    server = start_server(*_offload_flags(folder))
    assert _ask(server, SYSTEM) == answer and _ask(server, OTHER_SYSTEM) == other
    samples = server.metrics()
    assert samples["kiln:kv_offload_failures_total{reason=corrupt}{tier=disk}"] >= 1
    assert not list(folder.rglob(f"*.{killed}.*.tmp"))  # what the killed server was writing is gone


def _namespace_wrapper(script: str, folder: Path) -> tuple[str, ...]:
    """Run the server in a mount namespace of its own where `script` (sh, $0 the folder) has mounted."""
    wrapper = ("unshare", "-r", "-m", "sh", "-c", f'{script} && shift && exec "$@"', str(folder))
    probe = subprocess.run([*wrapper, "true"], capture_output=True, text=True)
    if shutil.which("unshare") is None or probe.returncode != 0:
        pytest.skip(f"cannot mount in a namespace of our own here (unshare -r -m: {probe.stderr.strip()})")
    return (*wrapper, str(folder))


def test_a_read_only_folder_is_read_and_never_written(
    start_server: Callable[..., ServerProcess], stored: tuple[Path, str], tmp_path: Path
) -> None:
    folder, answer = _copy(stored, tmp_path)
    wrapper = _namespace_wrapper('mount --bind -o ro "$0" "$0"', folder)
    server = start_server(*_offload_flags(folder), wrapper=wrapper)
    assert _ask(server, SYSTEM) == answer
    assert _ask(server, SYSTEM, "Which rule comes last, and which number does it like best?")  # new blocks
    samples = server.wait_for_metrics(lambda m: m["kiln:kv_offload_writing"] == 0)
    assert samples[f"kiln:kv_offload_hit_blocks_total{DISK}"] >= 30
    assert samples["kiln:kv_offload_failures_total{reason=write}{tier=disk}"] == 1
    assert samples["kiln:kv_offload_writing"] == 0
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200


def test_a_full_folder_stops_offloading_not_serving(
    start_server: Callable[..., ServerProcess], stored: tuple[Path, str], tmp_path: Path
) -> None:
    _, answer = stored
    folder = tmp_path / "full"
    folder.mkdir()
    wrapper = _namespace_wrapper('mount -t tmpfs -o size=1m tmpfs "$0"', folder)
    server = start_server(*_offload_flags(folder), "--kv-offload-size", "64MiB", wrapper=wrapper)
    assert _ask(server, SYSTEM) == answer
    assert _ask(server, OTHER_SYSTEM)
    samples = server.wait_for_metrics(lambda m: m["kiln:kv_offload_writing"] == 0)
    assert samples["kiln:kv_offload_writing"] == 0
    assert samples["kiln:kv_offload_failures_total{reason=write}{tier=disk}"] == 1
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    assert _ask(server, SYSTEM) == answer
