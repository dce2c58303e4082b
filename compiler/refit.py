"""New weights for a served artifact: the same compiled code, other weights (runtime/live_weights.py).

Weights are run-time inputs of every executable (`Backend.load(folder, weights, target)`), so new weights
need no compile: float weights by their HF names go through the artifact's own pipeline (capture and
passes with the manifest's compile options: the same fusions, the same int8/int4 quantizers, the same
GGUF block types), are laid out as the artifact's code reads them (`Backend.stored_weights`), and load
into a new executable of the same compiled files. The engine swaps it in between requests.

GGUF-blocks artifacts (a GGUF's own blocks, or a llama.cpp mix such as q4_k_m): a GGUF file of the same
block types gives its blocks as they are; float weights are quantized to each tensor's block type as
llama-quantize quantizes them (passes/quantize/gguf_encode.py: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K,
Q6_K); another type (Q2_K, Q3_K, ...) is refused, named: kiln has no quantizer identical to llama.cpp's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from kiln.backends.base import Executable
from kiln.backends.registry import get_backend
from kiln.compiler.build import optimize
from kiln.compiler.codegen import stored_weights, weight_maker
from kiln.compiler.options import PipelineOptions
from kiln.errors import KilnError
from kiln.frontend.config import ModelConfig
from kiln.frontend.hf_loader import load_hf_weights
from kiln.frontend.load import load_model
from kiln.frontend.models import adapt_hf_weights
from kiln.frontend.source import Weight, float32
from kiln.ir.gguf_blocks import QuantizedTensor
from kiln.passes.base import pass_quantization
from kiln.passes.quantize.gguf_encode import ENCODABLE, EncodedTensor
from kiln.runtime.artifact import LoadedArtifact, load_ranks, rank_entries
from kiln.runtime.live_weights import StagedWeights, WeightUpdateError, check_refittable
from kiln.runtime.tensor_parallel import StagedRanks, TensorParallelExecutable

FLOAT_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class Refitter:
    """Makes executables of `artifact`'s compiled code for its target with new weights (a WeightSource)."""

    def __init__(self, artifact: LoadedArtifact) -> None:
        self.manifest = manifest = artifact.manifest
        self.folder = artifact.path
        self.target = artifact.target
        self.entry = artifact.target_entry
        self.ranks = rank_entries(self.entry)
        self.served = artifact.executable  # a tensor-parallel model's ranks take new shards in place
        self.config = ModelConfig.from_dict(manifest["model"]["config"])
        compiled = manifest["compile"]
        names = {f.name for f in dataclasses.fields(PipelineOptions)} - {"context_len"}
        self.options = PipelineOptions(
            **{name: compiled[name] for name in names if name in compiled},
            context_len=int(manifest["limits"]["max_model_len"]),
        )
        self.gguf_types: dict[str, str] | None = manifest["model"].get("gguf_types")
        self._keeps_blocks = pass_quantization(self.options.quantization) == "gguf"
        self._shapes: dict[str, tuple[int, ...]] | None = None

    # -- WeightSource ----------------------------------------------------------------------------------

    def from_path(self, path: str) -> Executable | StagedWeights:
        self._refuse_what_cannot_refit()
        try:
            config, weights = self._read(path)
        except KilnError as error:
            raise WeightUpdateError(f"{path}: {error}", hint=error.hint) from None
        if config.architecture != self.config.architecture:
            raise WeightUpdateError(
                f"{path}: a {config.architecture} model; this server serves {self.config.architecture}",
                hint="give weights of the served model (same architecture, names and shapes)",
            )
        self._check(weights, f"{path}: ")
        given = {name: w for name, w in weights.items() if isinstance(w, QuantizedTensor)}
        blocks = self._blocks(weights, given, f"{path}: ") if self._keeps_blocks else {}
        return self._executable({name: float32(w) for name, w in weights.items()}, blocks)

    @staticmethod
    def _read(path: str) -> tuple[ModelConfig, dict[str, Weight]]:
        """An HF checkpoint folder (its tokenizer not needed) or a GGUF: config and weights."""
        if (Path(path) / "config.json").is_file():
            return load_hf_weights(Path(path))
        source = load_model(path)
        if source.vision is not None:
            raise WeightUpdateError(f"{path}: a vision-language model; this server serves a text model")
        return source.config, source.weights

    def from_tensors(self, tensors: dict[str, torch.Tensor]) -> Executable | StagedWeights:
        self._refuse_what_cannot_refit()
        weights = self.adapted(tensors)
        self._check(weights, "")
        blocks = self._blocks(weights, {}, "") if self._keeps_blocks else {}
        return self._executable({name: float32(w) for name, w in weights.items()}, blocks)

    def from_artifact(self) -> Executable:
        return load_ranks(self.entry["backend"], self.target, self.folder, self.ranks)

    def check_tensor(self, name: str, dtype: str, shape: list[int]) -> None:
        if dtype not in FLOAT_DTYPES:
            raise WeightUpdateError(
                f"tensor {name}: dtype {dtype}; new weights are floats ({', '.join(FLOAT_DTYPES)})",
                hint="send the trainer's float parameters; the server quantizes them as the artifact was",
            )
        adapted = self.adapted({name: torch.empty(shape, dtype=FLOAT_DTYPES[dtype], device="meta")})
        expected = self.shapes()
        for adapted_name, tensor in adapted.items():
            want = expected.get(adapted_name)
            if want is None:
                raise WeightUpdateError(
                    f"tensor {name}: the model has no weight of that name",
                    hint=f"names are the HF model's, e.g. {next(iter(expected))}",
                )
            if tuple(tensor.shape) != want:
                raise WeightUpdateError(
                    f"tensor {name}: shape {list(shape)}, the model's is {list(want)}",
                    hint="send weights of the served model's shapes",
                )

    # -- the pipeline ----------------------------------------------------------------------------------

    def adapted(self, tensors: Mapping[str, Any]) -> dict[str, Any]:
        """HF-named tensors as the model definition names them (as the HF loader does)."""
        weights = adapt_hf_weights(self.config, dict(tensors))
        if self.config.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        return weights

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every weight of the model, by name, and its shape."""
        if self._shapes is None:
            with torch.device("meta"):
                from kiln.frontend.models import model_class

                model = model_class(self.config)(self.config)
            self._shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
        return self._shapes

    def _refuse_what_cannot_refit(self) -> None:
        check_refittable(self.manifest, self.entry)

    def _check(self, weights: Mapping[str, Weight], where: str) -> None:
        expected = self.shapes()
        unknown = sorted(set(weights) - set(expected))
        if unknown:
            raise WeightUpdateError(
                f"{where}tensor {unknown[0]}: the model has no weight of that name"
                + (f" ({len(unknown)} such tensors)" if len(unknown) > 1 else ""),
                hint=f"names are the HF model's, e.g. {next(iter(expected))}",
            )
        missing = sorted(set(expected) - set(weights))
        if missing:
            raise WeightUpdateError(
                f"{where}tensor {missing[0]} is missing ({len(missing)} of the model's {len(expected)} "
                "weights are); an update replaces every weight",
                hint="send all of the model's parameters",
            )
        for name, weight in weights.items():
            if tuple(weight.shape) != expected[name]:
                raise WeightUpdateError(
                    f"{where}tensor {name}: shape {list(weight.shape)}, the model's is "
                    f"{list(expected[name])}",
                    hint="send weights of the served model's shapes",
                )
            dtype = weight.dtype if isinstance(weight, torch.Tensor) else torch.float32
            if not dtype.is_floating_point:
                raise WeightUpdateError(f"{where}tensor {name}: dtype {dtype} is no float")

    def _blocks(
        self, weights: Mapping[str, Weight], given: dict[str, QuantizedTensor], where: str
    ) -> dict[str, QuantizedTensor]:
        """The GGUF blocks of every weight the artifact keeps as blocks: `given` ones where they are of the
        artifact's type, float ones quantized to it."""
        if self.gguf_types is None:
            raise WeightUpdateError(
                "this GGUF-blocks artifact was compiled before kiln recorded its block types",
                hint="compile the model again with this version of kiln",
            )
        blocks = {}
        for name, ggml_type in self.gguf_types.items():
            weight = weights[name]
            block = given.get(name)
            if block is not None:
                if block.ggml_type != ggml_type:
                    raise WeightUpdateError(
                        f"{where}tensor {name}: {block.ggml_type} blocks, the artifact's are {ggml_type}",
                        hint="quantize the new weights as the served GGUF was, or send float weights",
                    )
                blocks[name] = block
                continue
            if ggml_type not in ENCODABLE:
                raise WeightUpdateError(
                    f"{where}tensor {name}: the artifact keeps it as {ggml_type} blocks, and kiln has no "
                    f"{ggml_type} quantizer identical to llama.cpp's (it has "
                    f"{', '.join(sorted(ENCODABLE))})",
                    hint="send a GGUF quantized by llama.cpp (POST /update_weights_from_disk), or serve an "
                    "artifact compiled with --quantization int8, int4 or none",
                )
            blocks[name] = EncodedTensor(ggml_type, float32(weight))
        return blocks

    def _executable(
        self, weights: dict[str, Any], blocks: dict[str, QuantizedTensor]
    ) -> Executable | StagedWeights:
        """Rank 0's executable of the new weights; for a tensor-parallel artifact, staged with each
        other rank's shard (its own program: the same pipeline at its rank)."""
        backend = get_backend(self.entry["backend"])
        stored = []
        for rank, entry in enumerate(self.ranks):
            options = dataclasses.replace(self.options, rank=rank)
            program = optimize(self.config, weights, options, gguf=blocks).program
            made = weight_maker(program)
            code = self.folder / entry["folder"]
            stored.append({w.name: made(w) for w in stored_weights(program, [backend.stored_weights(code)])})
        rank0 = backend.load(self.folder / self.ranks[0]["folder"], stored[0], self.target)
        if len(self.ranks) == 1:
            return rank0
        assert isinstance(self.served, TensorParallelExecutable)
        return StagedRanks(self.served, rank0, stored[1:])
