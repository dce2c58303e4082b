"""The TVM backend: IR → Relax → a shared library per target, run by the TVM runtime alone.

<target>/step.so     the compiled `step` and, on the CPU, `decode` (Relax VM executable and its kernels;
                     no weights)
<target>/step.json   the weight parameters and their layouts, target details, the step's signature
                     (ir/step.py StepSignature: its inputs in order, the KV cache's among them, and
                     the functions in step.so) and how many of the params `embed` takes (the first)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.backends.base import (
    BackendError,
    Capabilities,
    CompiledCode,
    CompileSettings,
    Executable,
    Hardware,
    ImageEncoder,
    Refusal,
    StoredWeight,
    integer_dot_refusal,
    leave_cores_to_compiled_code,
)
from kiln.backends.signature_record import read_signature, signature_record
from kiln.backends.targets import TRIPLES, Target, cross_compiler, host_machine
from kiln.backends.tvm.cpu_features import missing_features
from kiln.backends.tvm.executable import (
    STEP_ABI,
    TVMExecutable,
    set_threads,
    tvm_version,
)

if TYPE_CHECKING:
    import torch

    from kiln.ir import Program

LIBRARY = "step.so"
DESCRIPTION = "step.json"
ELF_MACHINES = {62: "x86_64", 183: "aarch64"}  # ELF e_machine


def elf_machine(library: Path) -> str | None:
    """The machine of a shared library's code (`ELF_MACHINES`), None for another machine or no ELF."""
    header = library.read_bytes()[:20] if library.is_file() else b""
    if header[:4] != b"\x7fELF":
        return None
    return ELF_MACHINES.get(int.from_bytes(header[18:20], "little"))


class TVMBackend:
    name = "tvm"
    copies_weights = False  # the artifact stores weights as its kernels read them: used where mapped

    def version(self) -> str:
        return f"tvm-{tvm_version()}"

    def capabilities(self, target: Target) -> Capabilities:
        """Every quantization and dtype the hardware computes in; a KV cache in any of those dtypes, and
        float8 where it converts float8; 8-bit activations and tensor-parallel ranks on CPUs."""
        hardware = Hardware.of(target)
        unavailable = self._unavailable(target)
        on_cpu = target.kind == "cpu"
        return Capabilities(
            unavailable=Refusal(unavailable) if unavailable is not None else None,
            dtypes=hardware.dtypes,
            kv_cache_dtypes=hardware.kv_cache_dtypes,
            activation_bits=frozenset({16, 8} if on_cpu else {16}),
            tensor_parallel=on_cpu,
            why_not={
                **hardware.why_not,
                "activation_bits": integer_dot_refusal(f"target {target.name}"),
                "tensor_parallel_size": Refusal(
                    f"tensor parallelism runs on CPU ranks over gloo so far, not on {target.name}",
                    "tensor_parallel_size",
                    hint="use --target cpu, or --tensor-parallel-size 1 on the GPU",
                ),
            },
        )

    def _unavailable(self, target: Target) -> str | None:
        """Why this machine cannot build `target` at all (an unknown CPU, no cross linker, no nvcc for
        the arch), or None."""
        if target.kind == "cpu" and target.detail is not None:
            from kiln.backends.tvm.cpu import is_valid_mcpu

            if not is_valid_mcpu(target.detail, target.triple):
                return f"LLVM does not know the {target.machine} CPU {target.detail!r} (target {target.name})"
        compiler = cross_compiler(target)
        if compiler is not None and shutil.which(compiler) is None:
            return (
                f"{target.name}'s host code is for {target.machine}, linked by {compiler}, which this "
                f"machine does not have (on Debian/Ubuntu: apt-get install gcc-{target.machine}-linux-gnu)"
            )
        if target.kind == "cuda":
            from kiln.backends.tvm.cuda import unsupported_arch

            try:
                reason = unsupported_arch(str(target.gpu_arch))
            except BackendError as error:
                return f"{error} (target {target.name})"
            if reason is not None:
                return f"{reason} (target {target.name})"
        return None

    def compile(
        self, program: Program, target: Target, folder: Path, settings: CompileSettings
    ) -> CompiledCode:
        folder.mkdir(parents=True, exist_ok=True)
        if target.kind == "cuda":
            from kiln.backends.tvm.cuda import compile_cuda

            return compile_cuda(program, target, folder, settings)
        from kiln.backends.tvm import cpu
        from kiln.backends.tvm.lowering import lower_graph
        from kiln.backends.tvm.tuning import TuningLogs

        llvm = cpu.llvm_target(target, settings.num_threads)
        tuned = TuningLogs(settings.tuning_logs, llvm)
        lowered = lower_graph(
            program.graph,
            "cpu",
            cpu.schedule_cpu,
            decode=True,
            decode_kernels=tuned,
            int_dot_isa=cpu.int_dot_isa(llvm),
            activation_bits=settings.activation_bits,
        )
        origins = dict(lowered.kernel_origins)
        executable = cpu.build_cpu(lowered.module, llvm)
        cpu.export(executable, str(folder / LIBRARY), target)
        description = {
            "abi": STEP_ABI,
            "device": "cpu",
            "host_triple": target.triple,
            "mcpu": cpu.target_mcpu(target),
            "cpu_features": cpu.required_features(llvm),
            "num_threads": settings.num_threads,
            "params": [spec.to_dict() for spec in lowered.params],
            "embed_params": lowered.embed_params,
            **signature_record(program.graph, lowered.functions, lowered.embed_width),
        }
        (folder / DESCRIPTION).write_text(json.dumps(description, indent=1, sort_keys=True) + "\n")
        from kiln.backends.tvm.layouts import stored_weights

        return CompiledCode(
            [LIBRARY, DESCRIPTION],
            origins,
            {"mcpu": description["mcpu"], "num_threads": settings.num_threads, "host_triple": target.triple},
            stored_weights(description["params"]),
        )

    def _description(self, folder: Path) -> dict[str, Any]:
        try:
            description = json.loads((folder / DESCRIPTION).read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise BackendError(f"{folder / DESCRIPTION}: cannot read it ({error})") from None
        if description.get("abi") != STEP_ABI:
            raise BackendError(
                f"{folder}: compiled for step calling convention {description.get('abi')}, this kiln "
                f"calls convention {STEP_ABI}",
                hint="compile the model again with this version of kiln",
            )
        return description

    def stored_weights(self, folder: Path) -> list[StoredWeight] | None:
        from kiln.backends.tvm.layouts import stored_weights

        return stored_weights(self._description(folder)["params"])

    def load(self, folder: Path, weights: dict[str, torch.Tensor], target: Target) -> Executable:
        description = self._description(folder)
        here = TRIPLES.get(host_machine(), host_machine())
        built_for = description.get("host_triple", TRIPLES["x86_64"])  # before the field: x86-64 only
        if built_for != here:
            raise BackendError(
                f"{folder}: its host code is for {built_for}, this machine is {here}",
                hint=f"run it on a {built_for.split('-')[0]} machine, or compile for this one (--target cpu)",
            )
        if description["device"] == "cpu":
            missing = missing_features(description.get("cpu_features", []))
            if missing:
                raise BackendError(
                    f"{folder}: compiled for CPU {description['mcpu']} ({built_for}), which has "
                    f"{', '.join(missing)}; this CPU ({here}) does not",
                    hint="compile for this machine (--target cpu) or an older CPU (--target "
                    + ("cpu:x86-64-v3)" if built_for.startswith("x86_64") else "cpu@aarch64)"),
                )
            set_threads(description.get("num_threads"))
            leave_cores_to_compiled_code()
        return TVMExecutable(
            folder / LIBRARY,
            description["params"],
            weights,
            read_signature(description, folder),
            description["device"],
            cuda_graphs=description.get("cuda_graph", {}).get("enabled", False),
            embed_params=description.get("embed_params"),
        )

    def compile_encoder(
        self, program: Program, target: Target, folder: Path, settings: CompileSettings
    ) -> CompiledCode:
        from kiln.backends.tvm.encoder import compile_encoder

        return compile_encoder(program.graph, target, folder, settings.num_threads)

    def load_encoder(self, folder: Path, weights: dict[str, torch.Tensor], target: Target) -> ImageEncoder:
        from kiln.backends.tvm.encoder import TVMImageEncoder

        return TVMImageEncoder(folder, weights)

    def check_structure(self, folder: Path, target: Target) -> list[str]:
        description = self._description(folder)
        library = folder / LIBRARY
        if not library.is_file() or library.read_bytes()[:4] != b"\x7fELF":
            raise BackendError(f"{library}: not a shared library")
        machine = elf_machine(library) or "an unknown machine"
        built_for = description.get("host_triple", TRIPLES["x86_64"])
        if not built_for.startswith(machine):
            raise BackendError(f"{library}: an ELF for {machine}, but {DESCRIPTION} says {built_for}")
        lines = [f"{LIBRARY} is an ELF shared library for {machine} ({library.stat().st_size:,} bytes)"]
        lines.append(f"{DESCRIPTION}: {len(description['params'])} weight parameters")
        if target.kind == "cuda":
            from kiln.backends.tvm.cuda import check_cuda_library

            lines += check_cuda_library(library, target)
        return lines
