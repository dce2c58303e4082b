"""Run a TensorRT engine for the step contract.

NOT EXERCISED: written without a GPU or the tensorrt package on the development machine. Same I/O as
the ONNX Runtime executable: inputs and the KV cache by device pointer, this step's K/V rows written
into the cache at slot_mapping after the engine ran.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kiln.backends.base import BackendError, Executable, Logits, check_kv_cache_device
from kiln.ir import KV_CACHE_INPUT, StepInputs
from kiln.ir.step import StepSignature, fill_absent


class TensorRTExecutable(Executable):
    def __init__(self, engine_file: Path, meta: dict[str, Any], signature: StepSignature) -> None:
        try:
            import tensorrt as trt
        except ImportError as error:
            raise BackendError(f"tensorrt is not importable here ({error})") from None
        runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self.engine = runtime.deserialize_cuda_engine(engine_file.read_bytes())
        if self.engine is None:
            raise BackendError(f"{engine_file}: TensorRT cannot deserialize the engine")
        self.context = self.engine.create_execution_context()
        self.signature = signature
        self.kv_cache_device = "cuda"
        (self._logits,) = meta["outputs"]
        self._kv_output = meta.get("kv_output")
        self._num_kv_layers = len(meta.get("kv_layers", []))
        self._vocab = int(self.engine.get_tensor_shape(self._logits)[-1])
        self._profile = meta.get("engine", {}).get("profile", {})  # each symbolic dim's (min, opt, max)

    def step(self, inputs: StepInputs, kv_cache: torch.Tensor) -> Logits:
        check_kv_cache_device(kv_cache, self.kv_cache_device)
        device = kv_cache.device
        filled = fill_absent(inputs, self.signature).as_dict()
        given = {name: torch.from_numpy(a).to(device) for name, a in filled.items()}
        given[KV_CACHE_INPUT] = kv_cache
        for name, tensor in given.items():
            if not self.context.set_input_shape(name, tuple(tensor.shape)):
                raise BackendError(
                    f"TensorRT refused input {name} of shape {list(tensor.shape)}: outside the engine's "
                    f"optimisation profile {self._profile}",
                    hint="compile again with larger --max-model-len / --max-num-seqs, or use fewer KV blocks",
                )
            self.context.set_tensor_address(name, tensor.data_ptr())
        num_tokens, num_rows = given["token_ids"].shape[0], given["logits_indices"].shape[0]
        logits = torch.empty((num_rows, self._vocab), dtype=torch.float32, device=device)
        self.context.set_tensor_address(self._logits, logits.data_ptr())
        spec = self.kv_cache_spec
        new_kv = torch.empty(
            (self._num_kv_layers, 2, num_tokens, spec.num_kv_heads, spec.head_dim),
            dtype=kv_cache.dtype,
            device=device,
        )
        if self._kv_output is not None:
            self.context.set_tensor_address(self._kv_output, new_kv.data_ptr())
        stream = torch.cuda.current_stream(device)
        if not self.context.execute_async_v3(stream.cuda_stream):
            raise BackendError("TensorRT failed to run the step")
        if self._kv_output is not None:
            layers, _, blocks, block_size, kv_heads, head_dim = kv_cache.shape
            flat = kv_cache.view(layers, 2, blocks * block_size, kv_heads, head_dim)
            slots = given["slot_mapping"]
            written = slots >= 0
            flat[:, :, slots[written]] = new_kv[:, :, written]
        return logits.to("cpu", torch.float32).numpy()
