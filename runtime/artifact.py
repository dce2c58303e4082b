"""The artifact format: a folder that runs without the original model.

    DIR/manifest.json            schema version, kiln version, model config, tokenizer fields, pass
                                 pipeline and options, limits, per-target entries, sha256 of every file
    DIR/tokenizer.json           the `tokenizers` tokenizer
    DIR/chat_template.jinja      the chat template (when the model has one)
    DIR/weights/<hash>.safetensors   weights as the compiled code reads them (laid out for its kernels,
                                 64-byte aligned, mapped at load: runtime/weights_file.py), stored
                                 once however many targets share them
    DIR/<target>/...             one folder per target: the backend's compiled code, probe logits
    DIR/<target>/encoder/...     a vision-language model's image encoder (`encode_image`), whose
                                 weights are a file of their own; the manifest's `vision` says how an
                                 image becomes its inputs and where its rows go (runtime/vision.py)

Loading checks, in order, and refuses with the cause named: the manifest parses, its schema version
is known, every listed file is present with its sha256, a target fits this machine (GPU arch), and
the backend's version equals the one the artifact was built with.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import mmap
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load_file

from kiln.backends.base import Executable, Logits, allocate_kv_cache
from kiln.backends.registry import get_backend
from kiln.backends.targets import Target, TargetError, mismatch
from kiln.digests import sha256_file
from kiln.errors import KilnError
from kiln.ir.vision import VisionSpec
from kiln.runtime.pooling import PoolingType
from kiln.runtime.tensor_parallel import CompiledRanks, TensorParallelExecutable, run_worker, torchrun_rank
from kiln.runtime.tokenizer import Tokenizer
from kiln.runtime.vision import VisionModel
from kiln.runtime.weights_file import Entry, WeightsFileError, read_weights_file, write_weights_file

SCHEMA_VERSION = 2  # 2: weights stored as the compiled code reads them (runtime/weights_file.py)
MANIFEST = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
PROBE_FILE = "probe.safetensors"


class ArtifactError(KilnError):
    """An artifact folder that is missing, corrupt, of another version or for another machine."""


def is_artifact(path: Path) -> bool:
    return path.is_dir() and (path / MANIFEST).is_file()


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def write_weights(root: Path, entries: list[Entry]) -> tuple[str, str]:
    """Write weights under root/weights/ (runtime/weights_file.py: one tensor at a time), named by their
    bytes (so targets sharing them share the file); (the path relative to root, its sha256)."""
    (root / "weights").mkdir(parents=True, exist_ok=True)
    scratch = root / "weights" / "incoming.tmp"
    digest = write_weights_file(scratch, entries)
    name = f"weights/{digest[:16]}.safetensors"
    target = root / name
    if target.exists():
        scratch.unlink()
    else:
        scratch.rename(target)
    return name, digest


def write_tokenizer(folder: Path, tokenizer: Tokenizer) -> dict[str, Any]:
    """Write tokenizer.json (and the chat template); the remaining fields go in the manifest."""
    fields = tokenizer.to_dict()
    (folder / TOKENIZER_FILE).write_text(fields.pop("tokenizer_json"))
    template = fields.pop("chat_template")
    if template is not None:
        (folder / CHAT_TEMPLATE_FILE).write_text(template)
    return fields


def seal(folder: Path, manifest: dict[str, Any], known: dict[str, str] | None = None) -> dict[str, Any]:
    """Record the sha256 of every file in the folder (`known`: those already hashed while written, by
    relative path) and write manifest.json."""
    known = known or {}
    files = sorted(
        p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST
    )
    manifest = {
        **manifest,
        "schema_version": SCHEMA_VERSION,
        "files": {name: known.get(name) or sha256_file(folder / name) for name in files},
    }
    write_json(folder / MANIFEST, manifest)
    return manifest


@dataclass
class LoadedArtifact:
    path: Path
    manifest: dict[str, Any]
    target: Target
    executable: Executable
    tokenizer: Tokenizer
    vision: VisionModel | None = None  # a vision-language model's images → rows (its encoder)

    @property
    def model_name(self) -> str:
        return str(self.manifest["model"]["name"])

    @property
    def model_id(self) -> str:
        return str(self.manifest["model"]["model_id"])

    @property
    def max_model_len(self) -> int:
        return int(self.manifest["limits"]["max_model_len"])

    @property
    def vocab_size(self) -> int:
        """The LM head's rows: the width of the logits."""
        return int(self.manifest["model"]["config"]["vocab_size"])

    @property
    def pooling(self) -> PoolingType | None:
        """An embedding model's own pooling (None: a generative model's artifact, or one from before)."""
        return self.manifest["model"]["config"].get("pooling")

    @property
    def target_entry(self) -> dict[str, Any]:
        return self.manifest["targets"][self.target.name]


def safetensors_bytes_by_dtype(path: Path) -> dict[str, int]:
    """The bytes a safetensors file holds in tensors of each dtype (U8, F32, ...), most first, read from
    its header alone."""
    with path.open("rb") as file:
        (header_size,) = struct.unpack("<Q", file.read(8))
        header = json.loads(file.read(header_size))
    totals: dict[str, int] = {}
    for name, entry in header.items():
        if name != "__metadata__":
            start, end = entry["data_offsets"]
            totals[entry["dtype"]] = totals.get(entry["dtype"], 0) + end - start
    return dict(sorted(totals.items(), key=lambda item: -item[1]))


def read_manifest(folder: Path) -> dict[str, Any]:
    path = folder / MANIFEST
    if not folder.is_dir():
        raise ArtifactError(f"{folder}: no such artifact folder", hint="compile one with `kiln compile`")
    if not path.is_file():
        raise ArtifactError(f"{folder}: no {MANIFEST}", hint="this is not a kiln artifact folder")
    try:
        manifest = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ArtifactError(
            f"{path}: not valid JSON ({error}); the manifest is truncated or corrupt", hint="compile it again"
        ) from None
    if not isinstance(manifest, dict):
        raise ArtifactError(f"{path}: not a manifest object", hint="compile it again")
    version = manifest.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ArtifactError(
            f"{path}: unknown schema version {version!r} (this kiln reads {SCHEMA_VERSION})",
            hint="compile the model again with this version of kiln",
        )
    return manifest


def _file_state(path: Path) -> list[int]:
    """What changes whenever a file's bytes do: size, mtime, ctime (which no user can set), inode."""
    stat = path.stat()
    return [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino, stat.st_dev]


def check_files(folder: Path, manifest: dict[str, Any], verdicts: Path | None = None) -> None:
    """Every listed file is present with its sha256. With `verdicts` (a folder), a file whose sha256 was
    checked before and whose size, mtime, ctime and inode are unchanged since is not hashed again; the
    verdicts are kept there per artifact folder."""
    record = None
    if verdicts is not None:
        record = verdicts / f"{hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:32]}.json"
    known = _read_verdicts(record)
    checked: dict[str, list[Any]] = {}
    for name, digest in manifest.get("files", {}).items():
        path = folder / name
        if not path.is_file():
            raise ArtifactError(f"{folder}: file {name} is missing", hint="copy the whole artifact folder")
        verdict = [digest, *_file_state(path)]
        if known.get(name) != verdict and sha256_file(path) != digest:
            raise ArtifactError(
                f"{folder}: checksum mismatch for {name} (the file was changed or damaged)",
                hint="copy or compile the artifact again",
            )
        checked[name] = verdict
    if record is not None and checked != known:
        _write_verdicts(record, checked)


def _read_verdicts(record: Path | None) -> dict[str, Any]:
    if record is None:
        return {}
    try:
        data = json.loads(record.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_verdicts(record: Path, checked: dict[str, list[Any]]) -> None:
    """Best effort: a cache that cannot be written only costs hashing again next time."""
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        scratch = record.with_name(f"{record.name}.{os.getpid()}.tmp")
        scratch.write_text(json.dumps(checked, sort_keys=True))
        scratch.replace(record)
    except OSError:
        pass


def choose_target(manifest: dict[str, Any], wanted: str | None) -> Target:
    targets = manifest.get("targets") or {}
    if wanted is not None:
        if wanted not in targets:
            raise ArtifactError(f"the artifact has no target {wanted}", hint=f"it has {', '.join(targets)}")
        names = [wanted]
    else:
        names = list(targets)
    reasons = []
    for name in names:
        try:
            target = Target.parse(name)
        except TargetError as error:
            reasons.append(str(error))
            continue
        reason = mismatch(target)
        if reason is None:
            return target
        reasons.append(reason)
    raise ArtifactError(
        "; ".join(reasons) or "the artifact has no targets", hint="compile it for this machine"
    )


def runnable_target(manifest: dict[str, Any], wanted: str | None) -> Target | None:
    """The target `load_artifact` would pick on this machine, or None where none fits it."""
    try:
        return choose_target(manifest, wanted)
    except ArtifactError:
        return None


def check_structure(folder: Path, wanted: str | None = None) -> tuple[list[str], list[str]]:
    """The checks that need no device, for every target (or `wanted`): manifest, checksums, backend
    version, the backend's check of its compiled files. (lines passed, why each target cannot run here);
    raises ArtifactError / BackendError on a failed check."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    check_files(folder, manifest)
    targets = manifest.get("targets") or {}
    if wanted is not None and wanted not in targets:
        raise ArtifactError(f"the artifact has no target {wanted}", hint=f"it has {', '.join(targets)}")
    lines = [f"manifest schema {SCHEMA_VERSION}; {len(manifest.get('files', {}))} files match their sha256"]
    reasons = []
    for name in [wanted] if wanted is not None else list(targets):
        entry, target = targets[name], Target.parse(name)
        backend = get_backend(entry["backend"])
        if backend.version() != entry["backend_version"]:
            raise ArtifactError(
                f"{folder}: {name} was built with {entry['backend']} {entry['backend_version']}, this "
                f"machine has {backend.version()}",
                hint="compile the model again here, or install the backend version it was built with",
            )
        ranks = rank_entries(entry)
        for rank in ranks:
            where = name if len(ranks) == 1 else f"{name} {rank['folder']}"
            lines += [f"{where}: {line}" for line in backend.check_structure(folder / rank["folder"], target)]
        reason = mismatch(target)
        if reason is not None:
            reasons.append(f"{name}: {reason}")
    return lines, reasons


def tensor_parallel_size_of(manifest: dict[str, Any]) -> int:
    return int(manifest["compile"].get("tensor_parallel_size", 1))


def rank_entries(entry: dict[str, Any]) -> list[dict[str, str]]:
    """A target entry's ranks: code folder and weights file of each (one, where it is not sharded)."""
    return entry.get("ranks") or [{"folder": entry["folder"], "weights": entry["weights"]}]


def _compiled_ranks(backend: str, target: Target, root: Path, ranks: list[dict[str, str]]) -> CompiledRanks:
    folders = tuple(str(root / rank["folder"]) for rank in ranks)
    return CompiledRanks(backend, target.name, folders, tuple(str(root / rank["weights"]) for rank in ranks))


def load_ranks(backend: str, target: Target, root: Path, ranks: list[dict[str, str]]) -> Executable:
    """The executable of an artifact's target: one rank's as it is; several ranks' joined by
    runtime/tensor_parallel.py (rank 0 in this process, the others in spawned workers or torchrun's)."""
    if len(ranks) > 1:
        return TensorParallelExecutable(_compiled_ranks(backend, target, root, ranks), len(ranks))
    path = root / ranks[0]["weights"]
    try:
        weights = read_weights_file(path)
    except (OSError, WeightsFileError) as error:
        raise ArtifactError(f"{path}: cannot read the weights ({error})") from None
    loading = get_backend(backend)
    executable = loading.load(root / ranks[0]["folder"], weights, target)
    if loading.copies_weights:
        release_pages(weights.values())
    return executable


def run_artifact_rank(folder: Path, target: str | None = None) -> None:
    """This process's rank (1.. of a torchrun launch) of the tensor-parallel artifact at `folder`,
    stepping with rank 0 until it stops; checked as `load_artifact` checks."""
    launch = torchrun_rank()
    assert launch is not None and launch[0] > 0, "run_artifact_rank is for torchrun's ranks 1.."
    folder = Path(folder)
    if not is_artifact(folder):
        raise ArtifactError(
            f"{folder}: under torchrun, ranks run an artifact folder",
            hint="compile it first: kiln compile MODEL --tensor-parallel-size N -o DIR; give every node DIR",
        )
    manifest = read_manifest(folder)
    check_files(folder, manifest)
    world = tensor_parallel_size_of(manifest)
    if world != launch[1]:
        raise ArtifactError(
            f"{folder}: compiled for tensor-parallel size {world}; torchrun started {launch[1]} processes",
            hint=f"launch torchrun with {world} processes in all (nnodes x nproc-per-node)",
        )
    chosen = choose_target(manifest, target)
    entry = manifest["targets"][chosen.name]
    run_worker(_compiled_ranks(entry["backend"], chosen, folder, rank_entries(entry)))


def load_artifact(
    folder: Path,
    target: str | None = None,
    verdicts: Path | None = None,
    tensor_parallel_size: int | None = None,
) -> LoadedArtifact:
    """Load an artifact after checking it (see the module doc); `verdicts`: see `check_files`;
    `tensor_parallel_size`: refused unless the artifact was compiled for it (None: as compiled)."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    check_files(folder, manifest, verdicts)
    chosen = choose_target(manifest, target)
    entry = manifest["targets"][chosen.name]
    backend = get_backend(entry["backend"])
    if backend.version() != entry["backend_version"]:
        raise ArtifactError(
            f"{folder}: built with {entry['backend']} {entry['backend_version']}, this machine has "
            f"{backend.version()}",
            hint="compile the model again here, or install the backend version it was built with",
        )
    world = tensor_parallel_size_of(manifest)
    if tensor_parallel_size is not None and tensor_parallel_size != world:
        raise ArtifactError(
            f"{folder}: compiled for tensor-parallel size {world}, asked to run at {tensor_parallel_size}",
            hint=f"run it at --tensor-parallel-size {world} (or leave the flag out), or compile the model "
            f"again with --tensor-parallel-size {tensor_parallel_size}",
        )
    executable = load_ranks(entry["backend"], chosen, folder, rank_entries(entry))
    fields = dict(manifest["tokenizer"])
    fields["tokenizer_json"] = (folder / TOKENIZER_FILE).read_text()
    template = folder / CHAT_TEMPLATE_FILE
    fields["chat_template"] = template.read_text() if template.is_file() else None
    tokenizer = Tokenizer.from_dict(fields)
    vision = _load_vision(folder, manifest, chosen, tokenizer)
    return LoadedArtifact(folder, manifest, chosen, executable, tokenizer, vision)


def _load_vision(
    folder: Path, manifest: dict[str, Any], target: Target, tokenizer: Tokenizer
) -> VisionModel | None:
    """The image encoder of a vision-language model's artifact for `target`; None for a text-only one."""
    entry = manifest["targets"][target.name]
    encoder = entry.get("encoder")
    if encoder is None or "vision" not in manifest:
        return None
    path = folder / encoder["weights"]
    try:
        weights = read_weights_file(path)
    except (OSError, WeightsFileError) as error:
        raise ArtifactError(f"{path}: cannot read the image encoder's weights ({error})") from None
    loaded = get_backend(entry["backend"]).load_encoder(folder / encoder["folder"], weights, target)
    return VisionModel(VisionSpec.from_dict(manifest["vision"]), loaded, tokenizer)


_MADV_PAGEOUT = 21  # Linux 5.4+: reclaim these pages now; their contents stay (re-read on next use)


def release_pages(arrays: Iterable[np.ndarray]) -> None:
    """Hand back the resident pages of the weights file once a backend that copies its weights (ONNX
    Runtime, TensorRT: `Backend.copies_weights`) has loaded from it. Best effort: nothing happens where
    the kernel does not know MADV_PAGEOUT."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return
    page = mmap.PAGESIZE
    for array in arrays:
        start = array.ctypes.data
        end = start + array.nbytes
        first, last = -(-start // page) * page, end // page * page
        if last > first:
            libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_PAGEOUT)


def probe_logits(artifact: LoadedArtifact) -> tuple[Logits, Logits | None]:
    """(logits now, logits recorded at compile time) for the artifact's probe prompt."""
    from kiln.ir.step import SequenceSlice, build_step_inputs

    probe = artifact.target_entry["probe"]
    token_ids = probe["token_ids"]
    block_size = 16
    blocks = list(range(1, -(-len(token_ids) // block_size) + 1))
    cache = allocate_kv_cache(artifact.executable, len(blocks) + 1, block_size)
    inputs = build_step_inputs([SequenceSlice(token_ids, 0, blocks)], block_size)
    now = artifact.executable.step(inputs, cache)[0]
    if probe["logits_file"] is None:  # compiled where this target could not run: nothing recorded
        return now, None
    recorded = load_file(str(artifact.path / probe["logits_file"]))["logits"]
    return now, recorded
