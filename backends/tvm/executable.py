"""Run a TVM artifact with the TVM runtime only (libtvm_runtime through tvm_ffi, no compiler library).

The step's token rows and logits rows are padded to multiples of 4 here (padding tokens write no K/V
and belong to no sequence); tensors cross into TVM by DLPack, without copies, and the KV cache is
written in place. A step whose padded token rows and logits rows are one block of 4 each (a decode of
up to 4 sequences) runs the `decode` function when the artifact has one (CPU; CUDA, with its split-K
GEMV linears), `step` otherwise.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from kiln.backends.base import BackendError, Executable, Hidden, KVCache, Logits, check_kv_cache_device
from kiln.backends.tvm.abi import ALIGNMENT, stored_name
from kiln.backends.tvm.collectives import register_collectives
from kiln.ir.host_arrays import as_numpy, as_torch, exportable, ir_dtype_of
from kiln.ir.step import (
    DECODE,
    EMBED,
    KV_CACHE_INPUT,
    LORA_A_PREFIX,
    STEP,
    IndexArray,
    StepInputs,
    StepSignature,
    fill_absent,
    zeros,
)

if TYPE_CHECKING:
    import torch

    from kiln.ir.deferred import Weight

ROW_BLOCK = 4
LORA_MAX_RANK_CUDA = 256  # kernels/lora.py MAX_RANK (not imported: that module needs the TVM compiler)
# The calling convention of the compiled functions; an artifact of another one is refused at load.
# 2: (*inputs, row_counts[2], *weights): the step signature's inputs in its order (ir/step.py
#     StepSignature; token and logits rows passed as [row blocks, 4]), then the real token and logits
#     row counts (lowering.py)
STEP_ABI = 2
_DEVICE_TYPES = {"cpu": 1, "cuda": 2}
_runtime_loaded = False
_cuda_runtime_loaded = False


def tvm_library_dir() -> Path:
    """$KILN_TVM_LIBRARY_DIR (a deploy bundle's lib/, see docs/deploy.md), else apache-tvm's lib/."""
    bundled = os.environ.get("KILN_TVM_LIBRARY_DIR")
    if bundled:
        return Path(bundled)
    spec = importlib.util.find_spec("tvm")
    if spec is None or not spec.submodule_search_locations:
        raise BackendError(
            "the TVM runtime is not installed", hint="pip install apache-tvm (see docs/tvm.md)"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "lib"


TVM_VERSION_FILE = "apache-tvm.version"  # in a deploy bundle's lib/, written by kiln bundle


def tvm_version() -> str:
    """The version of the TVM runtime kiln loads: the bundle's record beside libtvm_runtime.so where
    $KILN_TVM_LIBRARY_DIR names one, else apache-tvm's package metadata."""
    recorded = Path(os.environ.get("KILN_TVM_LIBRARY_DIR", "")) / TVM_VERSION_FILE
    if os.environ.get("KILN_TVM_LIBRARY_DIR") and recorded.is_file():
        return recorded.read_text().strip()
    try:
        return metadata.version("apache-tvm")
    except metadata.PackageNotFoundError:
        raise BackendError(
            f"the TVM runtime's version is unknown: apache-tvm is not installed, {recorded} does not exist",
            hint="pip install apache-tvm, or set KILN_TVM_LIBRARY_DIR to a kiln bundle's lib/",
        ) from None


def load_runtime() -> Any:
    """tvm_ffi with libtvm_runtime's VM registered; never loads libtvm_compiler.

    tvm_ffi imports torch, where it is installed, for its torch interop; kiln hands tensors over by
    DLPack and needs none of it. In a process that has not imported torch (a CPU server: numpy only),
    tvm_ffi is imported with torch hidden, which keeps ~210 MiB of torch out of the process."""
    global _runtime_loaded
    if "torch" in sys.modules or "tvm_ffi" in sys.modules:
        import tvm_ffi
    else:
        sys.modules["torch"] = None  # type: ignore[assignment]  # tvm_ffi's optional import fails
        try:
            import tvm_ffi
        finally:
            del sys.modules["torch"]

    if not _runtime_loaded:
        ctypes.CDLL(str(tvm_library_dir() / "libtvm_runtime.so"), ctypes.RTLD_GLOBAL)
        _runtime_loaded = True
    return tvm_ffi


def load_cuda_runtime() -> None:
    """TVM's CUDA plugin (device API, loader of the fatbin in step.so); needs libcudart.so.13 and the
    driver's libcuda.so.1 on the library path."""
    global _cuda_runtime_loaded
    load_runtime()
    if _cuda_runtime_loaded:
        return
    try:
        ctypes.CDLL(str(tvm_library_dir() / "libtvm_runtime_cuda.so"), ctypes.RTLD_GLOBAL)
    except OSError as error:
        raise BackendError(
            f"TVM's CUDA runtime cannot load ({error})",
            hint="a CUDA artifact needs an NVIDIA driver (libcuda.so.1) and the CUDA 13 runtime "
            "(libcudart.so.13, e.g. pip install nvidia-cuda-runtime) on LD_LIBRARY_PATH; see docs/tvm.md",
        ) from None
    _cuda_runtime_loaded = True


def aligned(tensor: torch.Tensor) -> torch.Tensor:
    """The compiled kernels assume 64-byte aligned data (aligned vector loads); torch's allocator
    gives that, but a view into a bigger buffer (weights read from one file) may not have it."""
    tensor = tensor.contiguous()
    if tensor.data_ptr() % ALIGNMENT:
        tensor = tensor.clone()
    return tensor


def _aligned_empty(shape: tuple[int, ...], dtype: np.dtype[Any]) -> npt.NDArray[Any]:
    """An uninitialised array at a 64-byte aligned address (numpy's allocator aligns to 16)."""
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = np.empty(nbytes + ALIGNMENT, dtype=np.uint8)
    start = -raw.ctypes.data % ALIGNMENT
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def host_aligned(array: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """`array` contiguous at a 64-byte aligned address, copied if it is not. An empty array is always
    copied: numpy may give it zero strides, which TVM's compact-array check refuses."""
    if array.size and array.flags.c_contiguous and array.ctypes.data % ALIGNMENT == 0:
        return array
    copy = _aligned_empty(array.shape, array.dtype)
    copy[...] = array
    return copy


def step_tensors(inputs: StepInputs, signature: StepSignature) -> list[IndexArray]:
    """The compiled function's host index inputs (rows padded), in the order it takes them, then
    `row_counts`, in arrays of their own (HostStepBuffers reuses its arrays from step to step). `inputs`
    must hold every input `signature` takes (ir.step.fill_absent)."""
    return HostStepBuffers(signature).tensors(inputs)


def index_inputs(signature: StepSignature) -> list[str]:
    """The inputs passed as host index arrays (the contract's and the per-step optional int64 ones), in
    the order the function takes them; the KV cache, runtime-owned tables and float rows go apart."""
    return [
        name
        for name, tensor_type in signature.inputs
        if name != KV_CACHE_INPUT and tensor_type.dtype == "i64" and not signature.runtime_owned(name)
    ]


class HostStepBuffers:
    """`step_tensors`' arrays written into aligned buffers kept from step to step, one an input, grown
    when a step needs more: no allocation on the decode loop's critical path. A CPU step finishes
    before the next is built, so each buffer is free again when the next step fills it."""

    def __init__(self, signature: StepSignature) -> None:
        self.names = index_inputs(signature)
        self.row_fills = signature.row_fills
        self._buffers: list[IndexArray | None] = [None] * (len(self.names) + 1)

    def tensors(self, inputs: StepInputs) -> list[IndexArray]:
        given = inputs.as_dict()
        arrays = []
        for index, name in enumerate(self.names):
            if name in self.row_fills:
                arrays.append(self._rows(index, given[name], self.row_fills[name]))
            else:
                arrays.append(self._copy(index, given[name]))
        counts = np.array([inputs.token_ids.shape[0], inputs.logits_indices.shape[0]], dtype=np.int64)
        return [*arrays, self._copy(len(self.names), counts)]

    def _take(self, index: int, size: int) -> IndexArray:
        buffer = self._buffers[index]
        if buffer is None or buffer.shape[0] < size:
            buffer = self._buffers[index] = _aligned_empty((max(size, 64),), np.dtype(np.int64))
        return buffer[:size]

    def _rows(self, index: int, array: IndexArray, fill: int) -> IndexArray:
        rows = max(ROW_BLOCK, -(-array.shape[0] // ROW_BLOCK) * ROW_BLOCK)
        padded = self._take(index, rows)
        padded[: array.shape[0]] = array
        padded[array.shape[0] :] = fill
        return padded.reshape(-1, ROW_BLOCK)

    def _copy(self, index: int, array: IndexArray) -> IndexArray:
        copy = self._take(index, array.size).reshape(array.shape)
        copy[...] = array
        return copy


class TVMExecutable(Executable):
    def __init__(
        self,
        library: Path,
        params: list[dict[str, Any]],
        weights: dict[str, torch.Tensor],
        signature: StepSignature,
        device: str = "cpu",
        cuda_graphs: bool = False,
        embed_params: int | None = None,
    ) -> None:
        """`signature`: what the library's functions take, in order, and which it has (`decode`: one
        block of rows; `embed`, which takes the first `embed_params` of the weights)."""
        if device == "cuda":
            import torch  # noqa: F401  # before tvm_ffi, which then sets up its torch streams (CUDA graphs)

            load_cuda_runtime()
        ffi = load_runtime()
        register_collectives(ffi)
        self.ffi = ffi
        self.signature = signature
        self.device = device
        self.kv_cache_device = device
        try:
            module = ffi.load_module(str(library))
        except Exception as error:
            raise BackendError(f"{library}: the TVM runtime cannot load it ({error})") from None
        self.vm = module["vm_load_executable"]()
        device_type = _DEVICE_TYPES[device]
        if device == "cpu":
            self.vm["vm_initialization"](device_type, 0, 2)
        else:
            self.vm["vm_initialization"](device_type, 0, 2, _DEVICE_TYPES["cpu"], 0, 2)
        self.function = self.vm[STEP]
        self._index_names = index_inputs(signature)
        self._host_buffers = HostStepBuffers(signature)
        self.decode_function = self.vm[DECODE] if signature.has(DECODE) else None
        has_embed = signature.has(EMBED) and embed_params is not None
        self.embed_function = self.vm[EMBED] if has_embed else None
        if not has_embed:
            self.signature = signature.with_entry_points(
                [e for e in signature.entry_points if e != EMBED], None
            )
        self.embed_params = embed_params or 0
        self._weights = [self._param(spec, weights) for spec in params]  # host arrays, or device tensors
        self._held_weight_bytes: dict[str, int] = {}
        for spec, weight in zip(params, self._weights, strict=True):
            size = int(weight.nbytes)
            self._held_weight_bytes[spec["source"]] = self._held_weight_bytes.get(spec["source"], 0) + size
        self._weight_args = [self._tvm_tensor(w) for w in self._weights]
        self._cache_arg: tuple[KVCache, Any] | None = None  # the last cache and its TVM view
        # the TVM views of the runtime-owned inputs (LoRA tables) the last step passed, by name with the
        # array they view: remade only for another array (the runtime writes its tables in place)
        self._owned_views: dict[str, tuple[Any, Any]] = {}
        self.graphs = None
        self.staging: Any = None  # a GPU's input staging (staging.py)
        if device == "cuda":
            from kiln.backends.tvm.cuda_graphs import DecodeGraphs, cuda_graphs_enabled
            from kiln.backends.tvm.staging import InputStaging

            self.graphs = DecodeGraphs() if cuda_graphs and cuda_graphs_enabled() else None
            self.staging = InputStaging(device)

    @property
    def held_weight_bytes(self) -> dict[str, int]:
        return self._held_weight_bytes

    def _param(self, spec: dict[str, Any], weights: Mapping[str, Any]) -> Any:
        """The weight as the kernels read it: stored so in the artifact (mapped, used as it is), or laid
        out here from the program's weights (a program run without an artifact). A host array on the
        CPU; a tensor on the GPU."""
        weight = weights.get(stored_name(spec["source"], spec["transform"]))
        if weight is None:
            weight = self._laid_out(spec, weights)
        on_host = isinstance(weight, np.ndarray)
        dtype = weight.dtype.name if on_host else str(weight.dtype).removeprefix("torch.")
        if list(weight.shape) != spec["shape"] or dtype != spec["dtype"]:
            raise BackendError(
                f"weight {spec['source']} ({spec['transform']}) is {dtype} {list(weight.shape)}, "
                f"the compiled code wants {spec['dtype']} {spec['shape']}"
            )
        if not on_host:
            from kiln.ir.deferred import materialize

            weight = materialize(weight)
        if self.device == "cpu":
            return host_aligned(weight if on_host else as_numpy(weight))
        tensor = as_torch(weight) if on_host else weight
        return aligned(tensor.to(self.device))

    def _tvm_tensor(self, weight: Any) -> Any:
        if not isinstance(weight, np.ndarray):
            return self.ffi.from_dlpack(weight)
        array, view_as = exportable(weight)
        tensor = self.ffi.from_dlpack(array)
        if view_as is None:
            return tensor
        return self.ffi.get_global_func("runtime.TVMTensorCreateView")(
            tensor, self.ffi.Shape(weight.shape), self.ffi.dtype(view_as), 0
        )

    @staticmethod
    def _laid_out(spec: dict[str, Any], weights: Mapping[str, Weight]) -> torch.Tensor:
        source = weights.get(spec["source"])
        if source is None:
            raise BackendError(f"the artifact's weights have no {spec['source']}")
        from kiln.backends.tvm.layouts import apply_layout
        from kiln.ir.deferred import materialize

        try:
            return apply_layout(spec["transform"], materialize(source))
        except ValueError as error:
            raise BackendError(
                f"weight {spec['source']}: cannot lay it out as {spec['transform']} ({error})",
                hint="compile it with --quantization int4 or int8, or --backend onnxruntime",
            ) from None

    def filled(self, inputs: StepInputs) -> StepInputs:
        """`inputs` with every input the step takes (ir.step.fill_absent), its runtime-owned ones made
        the ones `call` passes from now on."""
        inputs = fill_absent(inputs, self.signature, self.device)
        owned = {name: a for name, a in inputs.optional.items() if self.signature.runtime_owned(name)}
        if any(self._owned_views.get(name, (None,))[0] is not array for name, array in owned.items()):
            if self.lora_spec is not None:
                self._check_lora_tables(inputs.lora_tables)
            self._owned_views = {name: (array, self._table_view(array)) for name, array in owned.items()}
        if self.lora_spec is not None:
            self._check_lora_slots(inputs)
        return inputs

    def _check_lora_slots(self, inputs: StepInputs) -> None:
        slots = inputs.lora_slots
        assert slots is not None
        tables = int(next(iter(inputs.lora_tables.values())).shape[1])  # the tables' LS
        if slots.size:
            low, high = int(slots.min()), int(slots.max())
            if low < -1 or high >= tables:
                raise BackendError(f"lora_slots from {low} to {high}: the tables hold {tables} (-1: none)")

    def _check_lora_tables(self, tables: dict[str, Any]) -> None:
        assert self.lora_spec is not None
        first = tables[LORA_A_PREFIX + self.lora_spec.modules[0].name]
        slots, rank = int(first.shape[1]), int(first.shape[2])
        expected = self.lora_spec.table_shapes(slots, rank)
        for name, array in tables.items():
            numpy = isinstance(array, np.ndarray)
            where = "cpu" if numpy else str(array.device.type)
            if where != self.device:
                raise BackendError(f"LoRA table {name} is on {where}, the artifact runs on {self.device}")
            if tuple(array.shape) != expected[name] or ir_dtype_of(array) != self.lora_spec.dtype:
                raise BackendError(
                    f"LoRA table {name} is {ir_dtype_of(array)} {list(array.shape)}, the step wants "
                    f"{self.lora_spec.dtype} {list(expected[name])} (LoRASpec.allocate makes them)"
                )
            if not (array.flags.c_contiguous if numpy else array.is_contiguous()):
                raise BackendError(f"LoRA table {name} must be contiguous")
        if self.device != "cpu" and rank > LORA_MAX_RANK_CUDA:
            raise BackendError(
                f"LoRA tables of rank {rank}: the CUDA kernel computes ranks up to {LORA_MAX_RANK_CUDA}",
                hint=f"allocate the tables with a rank of {LORA_MAX_RANK_CUDA} or less",
            )

    def _table_view(self, array: Any) -> Any:
        """A table as the kernels take it, sharing its memory. An empty one (no slots) as a view of
        one element: DLPack gives empty arrays strides that TVM's compact-array check refuses."""
        if int(np.prod(array.shape)) > 0:
            return self._tvm_tensor(array)
        if isinstance(array, np.ndarray):
            base = self._tvm_tensor(_aligned_empty((1,), array.dtype))
            dtype = exportable(array)[1] or array.dtype.name
        else:
            import torch

            base = self.ffi.from_dlpack(torch.zeros(1, dtype=array.dtype, device=array.device))
            dtype = str(array.dtype).removeprefix("torch.")
        return self.ffi.get_global_func("runtime.TVMTensorCreateView")(
            base, self.ffi.Shape(tuple(array.shape)), self.ffi.dtype(dtype), 0
        )

    def step_tensors(self, inputs: StepInputs) -> list[IndexArray]:
        return step_tensors(inputs, self.signature)

    def upload(self, arrays: list[IndexArray]) -> list[torch.Tensor]:
        """`step_tensors`' host arrays on the executable's device, in one copy (staging.py)."""
        return self.staging.upload(arrays)

    def release_kv_cache(self) -> None:
        """Let go of the views of the last KV cache (and the CUDA graphs captured on it), so that a cache
        the engine drops is freed (backends.base.release_kv_cache)."""
        self._cache_arg = None
        if self.graphs is not None:
            self.graphs.captured.clear()

    def call(
        self,
        tensors: list[Any],
        kv_cache: KVCache,
        rows: Mapping[str, Any] | None = None,
        embed: bool = False,
    ) -> Any:
        """Run `decode` (one row block) or `step` (or with `embed`, `embed`) on `step_tensors`' arrays
        (host) or their uploads, binding each input the function takes by name: the index arrays, the
        KV cache, the runtime-owned inputs the last `filled` step gave, and the float row inputs in
        `rows` (host arrays on a CPU, uploaded for a GPU; None: a decode step's, which has none)."""
        ffi = self.ffi
        *index_arrays, row_counts = tensors
        if self._cache_arg is None or self._cache_arg[0] is not kv_cache:
            self._cache_arg = (kv_cache, self._tvm_tensor(kv_cache))
        by_name = dict(zip(self._index_names, index_arrays, strict=True))
        packed = []
        for name, tensor_type in self.signature.inputs:
            if name == KV_CACHE_INPUT:
                packed.append(self._cache_arg[1])
            elif name in by_name:
                packed.append(ffi.from_dlpack(by_name[name]))
            elif name in self._owned_views:
                packed.append(self._owned_views[name][1])
            else:
                given = (rows or {}).get(name)
                if given is None:  # a decode step: no rows (ir.step.fill_absent's value for none)
                    given = self._no_rows(name, tensor_type)
                packed.append(ffi.from_dlpack(host_aligned(given) if self.device == "cpu" else given))
        packed.append(ffi.from_dlpack(row_counts))
        if embed:
            return self.embed_function(*packed, *self._weight_args[: self.embed_params])
        one_block = index_arrays[0].shape[0] == 1 and by_name["logits_indices"].shape[0] == 1
        function = self.decode_function if one_block and self.decode_function is not None else self.function
        return function(*packed, *self._weight_args)

    def _no_rows(self, name: str, tensor_type: Any) -> Any:
        rows = zeros(tensor_type, {d: 0 for d in tensor_type.shape if isinstance(d, str)})
        if self.device == "cpu":
            return rows
        import torch

        return torch.from_numpy(rows).to(self.device)

    def _rows(self, inputs: StepInputs) -> dict[str, Any]:
        """The step's float row inputs (image_rows), on the device."""
        rows = {
            name: array
            for name, array in inputs.optional.items()
            if name not in self._index_names and not self.signature.runtime_owned(name)
        }
        if self.device == "cpu":
            return rows
        import torch

        return {name: torch.from_numpy(array).to(self.device) for name, array in rows.items()}

    def embed(self, inputs: StepInputs, kv_cache: KVCache) -> Hidden:
        """The final hidden states of the `logits_indices` rows."""
        if self.embed_function is None:
            return super().embed(inputs, kv_cache)
        self._check_cache(kv_cache)
        num_rows = inputs.logits_indices.shape[0]
        inputs = self.filled(inputs)
        if self.device == "cuda":
            import torch

            tensors = self.upload(self.step_tensors(inputs))
            hidden = torch.from_dlpack(self.call(tensors, kv_cache, self._rows(inputs), embed=True))
            return hidden[:num_rows].to("cpu", torch.float32).numpy()
        tensors = self._host_buffers.tensors(inputs)
        hidden = np.from_dlpack(self.call(tensors, kv_cache, self._rows(inputs), embed=True))[:num_rows]
        return hidden.astype(np.float32)

    def _check_cache(self, kv_cache: KVCache) -> None:
        check_kv_cache_device(kv_cache, self.device)
        if ir_dtype_of(kv_cache) != self.kv_cache_spec.dtype:
            raise BackendError(
                f"kv_cache is {ir_dtype_of(kv_cache)}, the artifact wants {self.kv_cache_spec.dtype}"
            )
        on_host = isinstance(kv_cache, np.ndarray)
        address = kv_cache.ctypes.data if on_host else kv_cache.data_ptr()
        if address % ALIGNMENT or not (kv_cache.flags.c_contiguous if on_host else kv_cache.is_contiguous()):
            raise BackendError(
                "kv_cache must be contiguous and 64-byte aligned (allocate it with kv_cache_spec.allocate)"
            )

    def step(self, inputs: StepInputs, kv_cache: KVCache) -> Logits:
        self._check_cache(kv_cache)
        num_logits = inputs.logits_indices.shape[0]
        has_rows = inputs.image_rows is not None
        inputs = self.filled(inputs)
        if self.device == "cuda":
            import torch

            if self.graphs is not None and not has_rows:
                replayed = self.graphs.run(self, inputs, kv_cache)
                if replayed is not None:
                    return replayed.to("cpu", torch.float32).numpy()
            tensors = self.upload(self.step_tensors(inputs))
            logits = torch.from_dlpack(self.call(tensors, kv_cache, self._rows(inputs)))
            return logits[:num_logits].to("cpu", torch.float32).numpy()
        tensors = self._host_buffers.tensors(inputs)
        logits = np.from_dlpack(self.call(tensors, kv_cache, self._rows(inputs)))[:num_logits]
        return logits.astype(np.float32, copy=False)


def set_threads(num_threads: int | None) -> None:
    """The TVM thread pool reads TVM_NUM_THREADS when it starts; a user's setting wins, then the
    artifact's count, then every CPU this process may run on. Left unset, TVM guesses from the core
    topology, and on a 2-vCPU VM it ran one thread (decode 110 instead of 175 tok/s)."""
    os.environ.setdefault("TVM_NUM_THREADS", str(num_threads or len(os.sched_getaffinity(0))))
