"""A lowered model run by ONNX Runtime: weights injected from memory, step inputs, the KV cache and the
LoRA tables bound zero-copy, this step's K/V rows scattered into the cache after the run."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import torch

from kiln.backends.base import BackendError, Executable, KVCache, Logits
from kiln.backends.onnx import WeightBinding, materialize
from kiln.ir import KV_CACHE_INPUT, StepInputs
from kiln.ir.host_arrays import as_torch
from kiln.ir.step import StepSignature, fill_absent

_NUMPY = {
    torch.float32: np.float32,
    torch.float16: np.float16,
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.uint8: np.uint8,
    torch.int8: np.int8,
}
_PLACEHOLDER = "kiln-weights-bound-at-load"  # never read: ONNX Runtime takes the data from memory


def _as_initializers(model: onnx.ModelProto, names: set[str]) -> onnx.ModelProto:
    """The model with the weight inputs turned into external initializers that `load` supplies.

    The file declares weights as graph inputs (so it holds no weight bytes and checks as is); ONNX
    Runtime only constant-folds and pre-packs initializers, so in memory they become initializers
    whose data comes from SessionOptions.add_external_initializers."""
    result = onnx.ModelProto()
    result.CopyFrom(model)
    kept = [i for i in result.graph.input if i.name not in names]
    for info in result.graph.input:
        if info.name not in names:
            continue
        tensor = onnx.TensorProto(name=info.name, data_type=info.type.tensor_type.elem_type)
        tensor.dims.extend(d.dim_value for d in info.type.tensor_type.shape.dim)
        tensor.data_location = onnx.TensorProto.EXTERNAL
        tensor.external_data.add(key="location", value=_PLACEHOLDER)
        result.graph.initializer.append(tensor)
    del result.graph.input[:]
    result.graph.input.extend(kept)
    return result


def ort_value(tensor: torch.Tensor) -> ort.OrtValue:
    """A view of a contiguous CPU tensor's memory (no copy); the tensor must outlive it."""
    return ort.OrtValue.ortvalue_from_numpy(tensor.numpy())


class OnnxRuntimeExecutable(Executable):
    def __init__(
        self,
        model: onnx.ModelProto,
        meta: dict[str, Any],
        weights: dict[str, torch.Tensor],
        options: ort.SessionOptions,
        providers: list[tuple[str, dict[str, str]]],
        signature: StepSignature,
    ) -> None:
        bindings = [WeightBinding.from_json(b) for b in meta["bindings"]]
        self._bound = {b.name: materialize(b, weights) for b in bindings}  # kept alive: ORT reads them
        names = list(self._bound)
        options.add_external_initializers(names, [ort_value(self._bound[n]) for n in names])
        in_memory = _as_initializers(model, set(names))
        try:
            self.session = ort.InferenceSession(in_memory.SerializeToString(), options, providers=providers)
        except Exception as error:  # onnxruntime raises its own untyped exceptions
            raise BackendError(f"ONNX Runtime cannot load the model: {error}") from None
        self.signature = signature
        on_gpu = any(name == "CUDAExecutionProvider" for name, _ in providers)
        self.kv_cache_device = "cuda" if on_gpu else "cpu"  # where the cache is bound: no copies a step
        (self._logits_name,) = meta["outputs"]
        self._kv_output = meta.get("kv_output")
        self._num_kv_layers = len(meta.get("kv_layers", []))
        outputs = {o.name: o for o in self.session.get_outputs()}
        vocab = outputs[self._logits_name].shape[-1]
        if not isinstance(vocab, int):
            raise BackendError(f"the logits output {self._logits_name} has no fixed vocabulary size")
        self._vocab = vocab
        self._logits_dtype = torch.float16 if "float16" in outputs[self._logits_name].type else torch.float32

    @staticmethod
    def _bind_input(binding: ort.IOBinding, name: str, tensor: torch.Tensor) -> None:
        """Bound where the tensor lives (ONNX Runtime copies to the EP's device when they differ)."""
        device, index = tensor.device.type, tensor.device.index or 0
        binding.bind_input(name, device, index, _NUMPY[tensor.dtype], list(tensor.shape), tensor.data_ptr())

    @staticmethod
    def _bind_output(binding: ort.IOBinding, name: str, tensor: torch.Tensor) -> None:
        device, index = tensor.device.type, tensor.device.index or 0
        binding.bind_output(name, device, index, _NUMPY[tensor.dtype], list(tensor.shape), tensor.data_ptr())

    def step(self, inputs: StepInputs, kv_cache: KVCache) -> Logits:
        if isinstance(kv_cache, np.ndarray):  # the host's cache, shared as a tensor
            kv_cache = as_torch(kv_cache)
        if not kv_cache.is_contiguous():
            raise BackendError("the KV cache must be contiguous to be bound zero-copy")
        binding = self.session.io_binding()
        # a step given no LoRA tables binds one zero slot of rank 1 where the cache lives (fill_absent; no
        # slot matches -1: every row on the base model), not empty ones: no GEMM over zero columns for an
        # EP to special-case. The runtime's tables are bound where it keeps them (written in place
        # between steps: never copied here; ONNX Runtime copies host ones to the EP's device in the run).
        given: dict[str, torch.Tensor] = {}
        for name, array in fill_absent(inputs, self.signature, self.kv_cache_device).as_dict().items():
            if self.signature.runtime_owned(name):
                given[name] = self._table(name, array)
            else:
                given[name] = torch.from_numpy(array).to(kv_cache.device)
        for name, tensor in given.items():
            self._bind_input(binding, name, tensor)
        self._bind_input(binding, KV_CACHE_INPUT, kv_cache)
        num_tokens, num_rows = given["token_ids"].shape[0], given["logits_indices"].shape[0]
        logits = torch.empty((num_rows, self._vocab), dtype=self._logits_dtype, device=kv_cache.device)
        if num_rows:
            self._bind_output(binding, self._logits_name, logits)
        else:  # nothing to bind an empty buffer to: let ONNX Runtime allocate (and drop) it
            binding.bind_output(self._logits_name, kv_cache.device.type)
        new_kv = None
        if self._kv_output is not None:
            spec = self.kv_cache_spec
            shape = (self._num_kv_layers, 2, num_tokens, spec.num_kv_heads, spec.head_dim)
            new_kv = torch.empty(shape, dtype=kv_cache.dtype, device=kv_cache.device)
            self._bind_output(binding, self._kv_output, new_kv)
        self.session.run_with_iobinding(binding)
        if new_kv is not None:
            self._write_cache(kv_cache, new_kv, given["slot_mapping"])
        return logits.to("cpu", torch.float32).numpy()

    @staticmethod
    def _table(name: str, table: Any) -> torch.Tensor:
        tensor = as_torch(table) if isinstance(table, np.ndarray) else table
        if not tensor.is_contiguous():
            raise BackendError(f"the LoRA table {name} must be contiguous to be bound zero-copy")
        return tensor

    @staticmethod
    def _write_cache(kv_cache: torch.Tensor, new_kv: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """kv_cache[:, :, slot] = this step's rows, for every token with a slot (>= 0)."""
        layers, _, num_blocks, block_size, kv_heads, head_dim = kv_cache.shape
        flat = kv_cache.view(layers, 2, num_blocks * block_size, kv_heads, head_dim)
        written = slot_mapping >= 0
        if bool(written.all()):
            flat[:, :, slot_mapping] = new_kv
        else:
            flat[:, :, slot_mapping[written]] = new_kv[:, :, written]
