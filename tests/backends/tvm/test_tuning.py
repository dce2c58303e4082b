"""`kiln tune` pieces on a tiny Llama: tune one decode kernel with a few MetaSchedule trials, compile
with the logs (the kernel is reported tuned, logits still match the reference, `decode` is the
function a one-token step runs), and logs of another layout version or a corrupt database are skipped
with a warning."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest

from kiln.backends.base import CompileSettings
from kiln.backends.reference import ReferenceExecutable
from kiln.backends.targets import Target
from kiln.backends.tvm import cpu, tuning
from kiln.backends.tvm.backend import TVMBackend
from kiln.ir import Program
from kiln.ir.step import SequenceSlice, build_step_inputs

TOLERANCE = 1e-4
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def tuned_logs(tiny_llama_program: Program, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """Logs with one tuned kernel (the plain RMSNorm, 4 trials, kept even if slower); its folder name."""
    logs = tmp_path_factory.mktemp("tuning_logs")
    workloads = tuning.decode_workloads(tiny_llama_program.graph)
    assert {w.kind for w in workloads} == {"rms_norm", "linear", "rope"}
    assert len({w.digest for w in workloads}) == len(workloads)
    workload = next(w for w in workloads if w.kind == "rms_norm")
    llvm = cpu.llvm_target(Target("cpu"))
    meta = tuning.tune_workload(workload, llvm, logs, trials=4, keep_slower=True)
    assert meta["kept"] and meta["tuned_us"] > 0 and meta["templated_us"] > 0
    return logs, workload.digest[:16]


def _compile(program: Program, folder: Path, logs: Path | None):
    backend = TVMBackend()
    code = backend.compile(program, Target("cpu"), folder, CompileSettings(tuning_logs=logs))
    return code, backend.load(folder, program.weights, Target("cpu"))


def _decode_and_prefill_errors(program: Program, executable) -> list[float]:
    reference = ReferenceExecutable(program.graph, program.weights)
    prompt = list(range(2, 23))
    steps = [
        build_step_inputs([SequenceSlice(prompt[:20], 0, [3, 1])], BLOCK_SIZE),  # prefill: `step`
        build_step_inputs([SequenceSlice(prompt[20:], 20, [3, 1])], BLOCK_SIZE),  # one token: `decode`
    ]
    errors = []
    ours_cache, theirs_cache = (e.kv_cache_spec.allocate(4, BLOCK_SIZE) for e in (executable, reference))
    for inputs in steps:
        ours, theirs = executable.step(inputs, ours_cache), reference.step(inputs, theirs_cache)
        errors.append(float(np.abs(ours - theirs).max() / np.abs(theirs).max()))
    return errors


def _folder(logs: Path, digest: str) -> Path:
    return logs / tuning.target_folder(cpu.llvm_target(Target("cpu"))) / digest


def test_tuned_kernel_is_used_by_decode(tiny_llama_program: Program, tuned_logs, tmp_path: Path) -> None:
    logs, digest = tuned_logs
    folder = _folder(logs, digest)
    assert sorted(p.name for p in folder.iterdir()) == sorted([tuning.META, *tuning.DATABASE_FILES])
    meta = json.loads((folder / tuning.META).read_text())
    assert meta["layout_version"] == tuning.LAYOUT_VERSION and meta["kind"] == "rms_norm"
    assert meta["workload_sha256"].startswith(digest) and meta["trials"] == 4
    with warnings.catch_warnings():
        warnings.simplefilter("error", tuning.TuningLogWarning)
        code, executable = _compile(tiny_llama_program, tmp_path / "tvm", logs)
    tuned = [name for name, origin in code.kernels.items() if origin == "tuned"]
    assert len(tuned) == 1 and tuned[0].startswith("rms_norm_decode")
    recorded = json.loads((tmp_path / "tvm" / "step.json").read_text())["signature"]
    assert recorded["entry_points"] == ["step", "decode", "embed"]
    assert executable.decode_function is not None
    assert max(_decode_and_prefill_errors(tiny_llama_program, executable)) < TOLERANCE


def test_no_logs_shares_generic_kernels(tiny_llama_program: Program, tmp_path: Path) -> None:
    code, executable = _compile(tiny_llama_program, tmp_path / "tvm", None)
    assert "tuned" not in code.kernels.values()
    assert not any("decode" in name for name in code.kernels)  # decode calls the step's kernels
    assert max(_decode_and_prefill_errors(tiny_llama_program, executable)) < TOLERANCE


@pytest.mark.parametrize("damage", ["layout_version", "tvm_version", "corrupt_database"])
def test_unusable_logs_are_skipped_with_a_warning(
    tiny_llama_program: Program, tuned_logs, tmp_path: Path, damage: str
) -> None:
    logs, digest = tuned_logs
    copy = tmp_path / "logs"
    shutil.copytree(logs, copy)
    folder = _folder(copy, digest)
    meta = json.loads((folder / tuning.META).read_text())
    if damage == "corrupt_database":
        (folder / tuning.DATABASE_FILES[1]).write_text('[0, ["not a trace"\n')
        expected = "cannot use the database"
    else:
        meta[damage] = 999 if damage == "layout_version" else "0.0.1"
        (folder / tuning.META).write_text(json.dumps(meta))
        expected = "layout version 999" if damage == "layout_version" else "tuned with TVM 0.0.1"
    with pytest.warns(tuning.TuningLogWarning, match=expected):
        code, _ = _compile(tiny_llama_program, tmp_path / "tvm", copy)
    assert "tuned" not in code.kernels.values()


def test_committed_logs_match_their_layout() -> None:
    """Every committed meta.json is readable at this layout version, with a database when kept."""
    root = Path(__file__).resolve().parents[3] / "tuning_logs"
    metas = sorted(root.glob("*/*/" + tuning.META))
    assert metas, f"{root} holds no tuning records (the repo commits some: see its README)"
    for path in metas:
        meta = json.loads(path.read_text())
        assert meta["layout_version"] == tuning.LAYOUT_VERSION, path
        assert path.parent.name == meta["workload_sha256"][:16], path
        assert all((path.parent / name).is_file() for name in tuning.DATABASE_FILES) == meta["kept"], path
