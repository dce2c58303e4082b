"""kiln's GGUF block encoder (passes/quantize/gguf_encode.py) against llama.cpp's own reference quantizers:
ggml-quants.c from the llama.cpp source `make test` unpacks, compiled here as llama.cpp builds its ggml-base
library (-O3, the baseline instruction set), called as llama-quantize calls them without an importance
matrix. Every block of every type must be byte-identical, on inputs chosen to reach each branch: all-zero
groups, constant groups (positive, negative), lone outliers, a group with one value, exact halves that
round to even, values of a bf16 checkpoint, tiny and large magnitudes.

(The blocks `llama-quantize` itself writes for whole checkpoints are compared by bench/quantize_parity.py,
which needs a llama.cpp build.)"""

from __future__ import annotations

import ctypes
import hashlib
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from kiln.frontend.pull import kiln_home
from kiln.passes.quantize.gguf_encode import ENCODABLE, EncodedTensor, encode, row_bytes

# ggml-quants.c calls these only on paths the reference quantizers without an imatrix do not take (their
# return value is not read here)
STUBS = """
#include <stddef.h>
#include <stdlib.h>
void ggml_abort(const char *file, int line, const char *fmt, ...) { (void)file; (void)line; (void)fmt;
    abort(); }
size_t ggml_row_size(int type, long long ne) { (void)type; (void)ne; return 0; }
size_t ggml_type_size(int type) { (void)type; return 0; }
const char *ggml_type_name(int type) { (void)type; return "?"; }
"""


@pytest.fixture(scope="module")
def ggml_quants(llama_cpp_source: Path) -> ctypes.CDLL:
    """llama.cpp's ggml-quants.c as a shared library (cached by its source's hash)."""
    source = llama_cpp_source / "ggml" / "src" / "ggml-quants.c"
    if not source.is_file():
        pytest.skip(f"no {source}: run `bash scripts/llama_cpp_source.sh '' --python-only`")
    compiler = shutil.which("cc") or shutil.which("gcc")
    assert compiler is not None, "a C compiler (gcc) is needed to build llama.cpp's reference quantizers"
    digest = hashlib.sha256(source.read_bytes() + STUBS.encode()).hexdigest()[:12]
    library = kiln_home() / "native" / f"ggml-quants-{digest}.so"
    if not library.is_file():
        library.parent.mkdir(parents=True, exist_ok=True)
        stubs = library.with_suffix(".stubs.c")
        stubs.write_text(STUBS)
        scratch = library.with_suffix(".tmp")
        include = [f"-I{llama_cpp_source / 'ggml' / part}" for part in ("include", "src")]
        command = [compiler, "-O3", "-std=gnu11", "-fPIC", "-shared", *include, str(source), str(stubs)]
        result = subprocess.run([*command, "-o", str(scratch), "-lm"], capture_output=True, text=True)
        assert result.returncode == 0, result.stderr[-2000:]
        scratch.rename(library)
    return ctypes.CDLL(str(library))


def llama_cpp_blocks(library: ctypes.CDLL, values: np.ndarray, ggml_type: str) -> np.ndarray:
    """`values` [rows, k] quantized by ggml's quantize_<type>(src, dst, rows, k, imatrix=NULL)."""
    rows, k = values.shape
    out = np.zeros((rows, row_bytes(ggml_type, k)), dtype=np.uint8)
    function = getattr(library, "quantize_" + ggml_type[0].lower() + ggml_type[1:])  # quantize_q4_K
    function.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    function.restype = ctypes.c_size_t
    source = np.ascontiguousarray(values, dtype=np.float32)
    function(source.ctypes.data, out.ctypes.data, rows, k, None)
    return out


def hard_rows(seed: int) -> np.ndarray:
    """48 rows of 1024 values (4 super-blocks each), every row a case the quantizers branch on."""
    generator = np.random.default_rng(seed)
    rows = generator.normal(0, 0.05, size=(48, 1024)).astype(np.float32)
    rows[0] = 0  # all zero
    rows[1, :64] = 0.25  # constant positive groups
    rows[2, :64] = -0.125  # constant negative groups
    rows[3, 10] = 40.0  # a lone outlier
    rows[4] = 0
    rows[4, ::32] = 0.3  # one value a group
    rows[5] = generator.integers(-8, 8, size=1024) * 0.5  # exact halves: ties round to even
    rows[6] = torch.from_numpy(rows[6]).to(torch.bfloat16).float().numpy()  # a bf16 checkpoint's values
    rows[7] *= 1e-6  # tiny
    rows[8] *= 200  # large
    rows[9] = np.abs(rows[9])  # all positive: the min clamps to 0
    rows[10] = -np.abs(rows[10])  # all negative
    rows[11, 256:512] = 1e-30  # a super-block of near-zero values
    rows[12] = generator.standard_t(2, size=1024) * 0.02  # heavy tails
    return rows


@pytest.mark.parametrize("ggml_type", sorted(ENCODABLE))
def test_blocks_are_llama_cpps_byte_for_byte(ggml_quants: ctypes.CDLL, ggml_type: str) -> None:
    for seed in (0, 1):
        values = hard_rows(seed)
        ours, theirs = encode(values, ggml_type), llama_cpp_blocks(ggml_quants, values, ggml_type)
        differing = np.nonzero((ours != theirs).any(axis=1))[0]
        assert differing.size == 0, f"{ggml_type}: rows {differing.tolist()} differ from ggml's (seed {seed})"


def test_an_encoded_tensor_reads_rows_and_columns_as_the_whole_does() -> None:
    weight = torch.from_numpy(hard_rows(2)[:16])
    whole = EncodedTensor("Q4_K", weight)
    assert np.array_equal(whole.rows(3, 9).read(), whole.read()[3:9])
    assert np.array_equal(whole.columns(256, 768).read(), whole.read()[:, 144:432])
    assert whole.dequantize().shape == (16, 1024)
    with pytest.raises(ValueError, match="256-element blocks"):
        whole.columns(0, 128)
