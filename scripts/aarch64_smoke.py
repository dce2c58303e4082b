"""Cross-compiles a TIR vector add and a Relax VM program for aarch64 here, runs them with the TVM
runtime under qemu-aarch64 (the sysroot of scripts/aarch64_python.sh) and checks the results against
numpy and the same program compiled for this machine.

    .venv/bin/python scripts/aarch64_smoke.py [SYSROOT]
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import tvm
from tvm import relax, te, tirx
from tvm.support import cc

AARCH64 = tvm.target.Target({"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "cortex-a76"})
CROSS_CC = "aarch64-linux-gnu-gcc"
ELF_MACHINE_AARCH64 = 183

GUEST = """
import ctypes
import sys
from pathlib import Path

import numpy as np
import tvm_ffi

ctypes.CDLL(str(Path(tvm_ffi.__file__).parents[1] / "tvm/lib/libtvm_runtime.so"), ctypes.RTLD_GLOBAL)
work = Path(sys.argv[1])
data = np.load(work / "inputs.npz")
total = np.empty_like(data["a"])
add = tvm_ffi.load_module(str(work / "add.so"))["add"]
add(*(tvm_ffi.from_dlpack(array) for array in (data["a"], data["b"], total)))
vm = tvm_ffi.load_module(str(work / "mlp.so"))["vm_load_executable"]()
vm["vm_initialization"](1, 0, 2)  # CPU device 0, pooled allocator
logits = vm["main"](tvm_ffi.from_dlpack(data["x"]), tvm_ffi.from_dlpack(data["w"]))
np.savez(work / "outputs.npz", add=total, mlp=np.from_dlpack(logits))
"""


def vector_add() -> tvm.IRModule:
    n = te.var("n")
    a = te.placeholder((n,), "float32", name="a")
    b = te.placeholder((n,), "float32", name="b")
    total = te.compute((n,), lambda i: a[i] + b[i], name="total")
    return tvm.IRModule({"add": te.create_prim_func([a, b, total]).with_attr("global_symbol", "add")})


def mlp() -> tvm.IRModule:
    """main(x: (n, 64), w: (64, 32)) = silu(x @ w)."""
    builder = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([tirx.Var("n", "int64"), 64], "float32"))
    w = relax.Var("w", relax.TensorType([64, 32], "float32"))
    with builder.function("main", [x, w]):
        with builder.dataflow():
            out = builder.emit_output(relax.op.nn.silu(relax.op.matmul(x, w)))
        builder.emit_func_output(out)
    return builder.get()


def compile_relax(module: tvm.IRModule, target: tvm.target.Target) -> relax.VMExecutable:
    with target:
        return tvm.compile(relax.transform.LegalizeOps()(module), target=target)


def export_aarch64(executable: tvm.runtime.Executable, path: Path) -> None:
    executable.export_library(str(path), fcompile=cc.cross_compiler(CROSS_CC))
    machine = int.from_bytes(path.read_bytes()[18:20], "little")
    assert machine == ELF_MACHINE_AARCH64, f"{path}: ELF machine {machine}, not aarch64"


def x86_mlp(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    vm = relax.VirtualMachine(compile_relax(mlp(), tvm.target.Target("llvm")), tvm.cpu())
    return vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(w)).numpy()


def main(sysroot: Path) -> None:
    rng = np.random.default_rng(0)
    inputs = {
        "a": rng.standard_normal(1000, dtype=np.float32),
        "b": rng.standard_normal(1000, dtype=np.float32),
        "x": rng.standard_normal((5, 64), dtype=np.float32),
        "w": rng.standard_normal((64, 32), dtype=np.float32) / 8,
    }
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        start = time.perf_counter()
        export_aarch64(tvm.compile(vector_add(), target=AARCH64), work / "add.so")
        export_aarch64(compile_relax(mlp(), AARCH64), work / "mlp.so")
        print(f"cross-compiled add.so, mlp.so (aarch64 ELF) in {time.perf_counter() - start:.1f}s")
        np.savez(work / "inputs.npz", **inputs)
        (work / "guest.py").write_text(GUEST)
        start = time.perf_counter()
        subprocess.run([str(sysroot / "run"), str(work / "guest.py"), str(work)], check=True)
        print(f"ran them under qemu-aarch64 in {time.perf_counter() - start:.1f}s")
        outputs = dict(np.load(work / "outputs.npz"))

    np.testing.assert_array_equal(outputs["add"], inputs["a"] + inputs["b"])
    expected = x86_mlp(inputs["x"], inputs["w"])
    np.testing.assert_allclose(outputs["mlp"], expected, rtol=1e-5, atol=1e-6)
    difference = float(np.abs(outputs["mlp"] - expected).max())
    print(f"ok: add exact; mlp {outputs['mlp'].shape} matches x86 (max |difference| {difference:.2e})")


if __name__ == "__main__":
    kiln_home = Path(os.environ.get("KILN_HOME", Path.home() / ".cache" / "kiln"))
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else kiln_home / "aarch64-python")
