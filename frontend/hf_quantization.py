"""Pre-quantized HF checkpoints: which `quantization_config`s load, and each quantized linear's weight as
the float values its format defines.

Loaded: compressed-tensors (llm-compressor's format) `float-quantized` FP8 weights (tensor, channel and
block scales; older tools saved them `naive-quantized`), `pack-quantized`, `naive-quantized` and
`int-quantized` integer weights (4 or 8 bits, channel or group scales, symmetric or with zero points,
with or without an activation order), the fine-grained `fp8` method (`weight_block_size`,
`weight_scale_inv`), GPTQ (auto-gptq / gptqmodel: `qweight`, `qzeros`, `scales`, `g_idx`; 2, 4 or 8
bits, with or without `desc_act`, the `gptq` and `gptq_v2` checkpoint formats, also from an older
folder's quantize_config.json) and AWQ's `gemm` layout (also from quant_config.json). Each weight is
dequantized when the artifact writer asks for it (a `Deferred`), exactly as the format defines its
value (float32). Quantized activations (an A8 scheme) are not reproduced: Kiln computes activations in
the artifact's float dtype.

Anything else that names a quantization (bitsandbytes, HQQ, NVFP4, MXFP4, 3-bit GPTQ, AWQ's other
layouts, sparsity, rotations, a KV-cache scheme, a variant of a loaded method) is refused before a
weight is read: a checkpoint's quantized tensors must never be cast and served as if they were float
weights.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kiln.errors import ModelLoadError
from kiln.frontend.config import QUANTIZATION_SIDE_FILES
from kiln.ir.deferred import Deferred, Weight, materialize
from kiln.ir.gguf_blocks import QuantizedTensor

HINT = "use the checkpoint's bf16/fp16 original or a GGUF of it"
GPTQ_FORMATS = ("gptq", "gptq_v2")  # v1 stores each zero point minus one
GPTQ_BITS = (2, 4, 8)  # 3-bit GPTQ packs values across words
# AWQ's gemm layout: the k-th 4 bits of a word hold column 8j + AWQ_ORDER[k] of its 8
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
LAYOUT_NAMES = {"gptq": "GPTQ", "gptq_v2": "GPTQ v2", "awq": "AWQ gemm"}
COMPRESSED_TENSORS_FORMATS = ("float-quantized", "pack-quantized", "naive-quantized", "int-quantized")
# the per-module tensors each format stores beside (or instead of) `weight`
AUXILIARY = (
    "weight_scale",
    "weight_zero_point",
    "weight_shape",
    "weight_g_idx",
    "input_scale",
    "weight_scale_inv",
)
PACKED_PARTS = ("qweight", "qzeros", "scales", "g_idx")  # GPTQ's and AWQ's, instead of `weight`
BLOCK = 32  # inputs a Q4_0 / Q8_0 block
BLOCK_TYPES = {4: "Q4_0", 8: "Q8_0"}  # symmetric integers of these bits, kept as these GGUF blocks


@dataclass(frozen=True)
class WeightFormat:
    """How one linear's weight is stored: `float8` (e4m3 values times scales) or `int` (`bits`-bit
    integers minus zero points, times scales); scales per `strategy` ("tensor", "channel", "group" of
    `group_size` inputs, "block" of `block` rows × columns)."""

    kind: str
    bits: int
    strategy: str
    symmetric: bool = True
    group_size: int | None = None
    block: tuple[int, int] | None = None
    packed: bool = False  # int values packed into int32 words (compressed-tensors pack-quantized)
    layout: str = "compressed-tensors"  # or "gptq", "gptq_v2", "awq": the tool's own tensors and packing
    ordered: bool = False  # GPTQ's desc_act: the inputs' groups follow g_idx, not their order

    def describe(self) -> str:
        size = {
            "group": f" {self.group_size}",
            "block": f" {self.block[0]}x{self.block[1]}" if self.block else "",
        }
        kind = "float8 e4m3" if self.kind == "float8" else f"int{self.bits}"
        if self.layout in LAYOUT_NAMES:
            kind = f"{LAYOUT_NAMES[self.layout]} {kind}"
        zero = "" if self.symmetric else ", zero points"
        return f"{kind}, {self.strategy}{size.get(self.strategy, '')} scales{zero}"


@dataclass(frozen=True)
class CheckpointQuantization:
    """A loaded `quantization_config`: the method, and the format of each linear it quantizes."""

    method: str
    description: str
    formats: tuple[tuple[tuple[str, ...], WeightFormat], ...]  # (targets, format), in the config's order
    ignore: tuple[str, ...] = ()

    def format_of(self, module: str) -> WeightFormat | None:
        """The format of `module`'s weight (None: not quantized)."""
        if any(_matches(target, module) for target in self.ignore):
            return None
        named = [
            fmt for targets, fmt in self.formats if any(_names(t) and _matches(t, module) for t in targets)
        ]
        if named:
            return named[0]
        return next((fmt for targets, fmt in self.formats if any(not _names(t) for t in targets)), None)


def read_quantization(config: Mapping[str, Any], folder: Path) -> CheckpointQuantization | None:
    """The checkpoint's quantization, None for a float checkpoint; a method or variant this runtime does
    not load is refused, named, before any weight is read."""
    where = folder / "config.json"
    raw = config.get("quantization_config")
    if raw is None:
        side = _side_config(folder)
        if side is None:
            return None
        raw, where = side
    if not isinstance(raw, Mapping):
        raise ModelLoadError(f"{where}: quantization_config is not an object", hint="the config is corrupt")
    method = str(raw.get("quant_method", "unknown")).lower()
    if method == "compressed-tensors":
        return _compressed_tensors(raw, where)
    if method == "fp8":
        return _fine_grained_fp8(raw, where)
    if method == "gptq":
        return _gptq(raw, where)
    if method == "awq":
        return _awq(raw, where)
    _refuse(where, f"quantization {method!r}{_variant(method, raw)}")
    raise AssertionError  # unreachable: _refuse raises


def checkpoint_weights(
    weights: Mapping[str, Weight], quantization: CheckpointQuantization, where: Path
) -> dict[str, Weight | QuantizedTensor]:
    """The checkpoint's tensors with each quantized linear's parts made one `weight`: GGUF blocks that
    hold its values exactly where there are such (symmetric 4- and 8-bit integers in runs of 32 inputs
    under one float16 or bfloat16 scale: Q4_0, Q8_0), else its float32 values."""
    modules: dict[str, dict[str, Weight]] = {}
    for name, tensor in weights.items():
        module, _, part = name.rpartition(".")
        modules.setdefault(module, {})[part] = tensor
    result: dict[str, Weight | QuantizedTensor] = {}
    for module, parts in modules.items():
        fmt = quantization.format_of(module)
        stored = any(
            part in parts for part in ("weight_packed", "weight_scale", "weight_scale_inv", "qweight")
        )
        if fmt is None or not stored:
            if stored or (
                fmt is not None and parts.get("weight") is not None and _is_quantized(parts["weight"])
            ):
                raise ModelLoadError(
                    f"{where}: {module}'s stored weight does not match the quantization_config "
                    f"({'quantized' if stored else 'float'} tensors where the config says "
                    f"{'not quantized' if fmt is None else fmt.describe()})",
                    hint="the checkpoint is inconsistent; " + HINT,
                )
            result.update({f"{module}.{part}": tensor for part, tensor in parts.items()})
            continue
        rest = {
            part: tensor
            for part, tensor in parts.items()
            if part not in AUXILIARY and part not in PACKED_PARTS and part != "weight_packed"
        }
        result.update({f"{module}.{part}": tensor for part, tensor in rest.items() if part != "weight"})
        result[f"{module}.weight"] = _dequantized(parts, fmt, f"{where}: {module}", quantization.method)
    return result


def refuse_unlabelled_quantization(weights: Mapping[str, Weight], where: Path) -> None:
    """A checkpoint without a quantization_config whose tensors are quantized (float8 values, scales,
    packed words) is refused: cast to float, they would serve noise."""
    for name, weight in weights.items():
        part = name.rpartition(".")[2]
        packed_part = part in ("weight_packed", "qweight", "qzeros", "g_idx")
        if weight.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) or part in AUXILIARY or packed_part:
            raise ModelLoadError(
                f"{where}: no quantization_config, but {name} is stored quantized ({weight.dtype})",
                hint="the config.json is not the checkpoint's own; " + HINT,
            )


def _is_quantized(weight: Weight) -> bool:
    return weight.dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8, torch.int32, torch.uint8)


# -- compressed-tensors ---------------------------------------------------------------------------------


def _compressed_tensors(raw: Mapping[str, Any], where: Path) -> CheckpointQuantization:
    for key, what in (
        ("sparsity_config", "sparsity"),
        ("transform_config", "transforms (rotations)"),
        ("kv_cache_scheme", "a KV-cache scheme"),
    ):
        if raw.get(key):
            _refuse(where, f"compressed-tensors with {what} ({key})")
    groups = raw.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        _refuse(where, "compressed-tensors without config_groups")
    top_format = raw.get("format")
    formats: list[tuple[tuple[str, ...], WeightFormat]] = []
    described: list[str] = []
    for group_name, group in groups.items():
        if not isinstance(group, Mapping):
            raise ModelLoadError(
                f"{where}: config group {group_name!r} is not an object", hint="corrupt config"
            )
        layout = group.get("format") or top_format
        label = f"compressed-tensors {layout} ({group_name})"
        if layout not in COMPRESSED_TENSORS_FORMATS:
            _refuse(where, f"compressed-tensors format {layout!r} ({group_name})")
        if group.get("output_activations"):
            _refuse(where, f"{label} with output activations quantized")
        fmt = _compressed_tensors_weights(group.get("weights"), layout, label, where)
        _check_activations(group.get("input_activations"), label, where)
        targets = group.get("targets") or []
        if not isinstance(targets, list) or not targets:
            _refuse(where, f"{label} without targets")
        formats.append((tuple(str(t) for t in targets), fmt))
        described.append(f"{layout}: {fmt.describe()}")
    ignore = raw.get("ignore") or []
    return CheckpointQuantization(
        method="compressed-tensors",
        description="compressed-tensors " + "; ".join(dict.fromkeys(described)),
        formats=tuple(formats),
        ignore=tuple(str(name) for name in ignore),
    )


def _compressed_tensors_weights(args: Any, layout: str, label: str, where: Path) -> WeightFormat:
    if not isinstance(args, Mapping):
        _refuse(where, f"{label} without quantized weights")
    kind, bits = args.get("type"), args.get("num_bits")
    strategy, symmetric = args.get("strategy"), bool(args.get("symmetric", True))
    variant = f"{label}: {kind} {bits}-bit weights, {strategy} strategy"
    if args.get("dynamic"):
        _refuse(where, f"{variant}, dynamic")
    if kind == "float" and layout in ("float-quantized", "naive-quantized"):
        if bits != 8 or strategy not in ("tensor", "channel", "block") or not symmetric:
            _refuse(where, variant)
        block = args.get("block_structure")
        return WeightFormat(
            kind="float8",
            bits=8,
            strategy=strategy,
            block=tuple(int(n) for n in block) if strategy == "block" and block else None,
        )
    if (
        kind != "int"
        or layout == "float-quantized"
        or bits not in (4, 8)
        or strategy not in ("channel", "group")
    ):
        _refuse(where, variant)
    if args.get("actorder") not in (None, "group", "static", "weight", False):
        _refuse(where, f"{variant}, actorder {args.get('actorder')!r}")
    group_size = args.get("group_size")
    if strategy == "group" and not (isinstance(group_size, int) and group_size > 0):
        _refuse(where, f"{variant} without a group size")
    return WeightFormat(
        kind="int",
        bits=int(bits),
        strategy=strategy,
        symmetric=symmetric,
        group_size=int(group_size) if strategy == "group" else None,
        packed=layout == "pack-quantized",
    )


def _check_activations(args: Any, label: str, where: Path) -> None:
    """Quantized input activations are computed in float; any form a checkpoint may name is accepted
    except those whose values change the weights' meaning (none today) or that are not 8-bit."""
    if args is None:
        return
    if not isinstance(args, Mapping) or args.get("num_bits") != 8 or args.get("type") not in ("float", "int"):
        _refuse(where, f"{label} with {args.get('type') if isinstance(args, Mapping) else args} activations")


# -- fine-grained FP8 (quant_method: fp8) ------------------------------------------------------------------


def _fine_grained_fp8(raw: Mapping[str, Any], where: Path) -> CheckpointQuantization:
    block = raw.get("weight_block_size")
    fmt_name = str(raw.get("fmt", "e4m3")).lower()
    if fmt_name != "e4m3":
        _refuse(where, f"quantization 'fp8' ({fmt_name})")
    if raw.get("activation_scheme", "dynamic") not in ("dynamic", "static"):
        _refuse(where, f"quantization 'fp8' (activation scheme {raw.get('activation_scheme')!r})")
    if block is None:
        fmt = WeightFormat(kind="float8", bits=8, strategy="tensor")
    elif isinstance(block, list) and len(block) == 2 and all(isinstance(n, int) and n > 0 for n in block):
        fmt = WeightFormat(kind="float8", bits=8, strategy="block", block=(block[0], block[1]))
    else:
        raise ModelLoadError(
            f"{where}: weight_block_size {block!r} is not [rows, columns]", hint="corrupt config"
        )
    return _every_linear("fp8", fmt, f"fp8 ({fmt.describe()})", raw.get("modules_to_not_convert"))


# -- GPTQ and AWQ -----------------------------------------------------------------------------------------


def _side_config(folder: Path) -> tuple[Mapping[str, Any], Path] | None:
    """An older GPTQ or AWQ folder's quantize_config.json / quant_config.json (no quantization_config in
    config.json), as a quantization_config."""
    for side_file, method in QUANTIZATION_SIDE_FILES.items():
        path = folder / side_file
        if path.is_file():
            try:
                raw = json.loads(path.read_text())
            except (OSError, ValueError) as error:
                raise ModelLoadError(f"{path}: not JSON ({error})", hint="the file is corrupt") from None
            if not isinstance(raw, Mapping):
                raise ModelLoadError(f"{path}: not a JSON object", hint="the file is corrupt")
            renamed = {"w_bit": "bits", "q_group_size": "group_size"}  # AutoAWQ's older names
            return {"quant_method": method, **{renamed.get(k, k): v for k, v in raw.items()}}, path
    return None


def _gptq(raw: Mapping[str, Any], where: Path) -> CheckpointQuantization:
    bits, group_size = raw.get("bits"), raw.get("group_size", 128)
    layout = str(raw.get("checkpoint_format") or raw.get("format") or "gptq").lower()
    if layout not in GPTQ_FORMATS or raw.get("is_marlin_format"):
        _refuse(
            where,
            f"quantization 'gptq' in the {'marlin' if raw.get('is_marlin_format') else layout!r} format",
        )
    if bits not in GPTQ_BITS:
        _refuse(where, f"quantization 'gptq' ({bits}-bit)")
    if raw.get("dynamic"):
        _refuse(where, "quantization 'gptq' with per-module overrides (dynamic)")
    if not isinstance(group_size, int) or (group_size <= 0 and group_size != -1):
        raise ModelLoadError(f"{where}: group_size {group_size!r} is not a size or -1", hint="corrupt config")
    fmt = WeightFormat(
        kind="int",
        bits=int(bits),
        strategy="channel" if group_size == -1 else "group",
        symmetric=bool(raw.get("sym", True)),
        group_size=None if group_size == -1 else group_size,
        layout=layout,
        ordered=bool(raw.get("desc_act")),
    )
    order = ", activation order" if raw.get("desc_act") else ""
    return _every_linear("gptq", fmt, f"gptq ({fmt.describe()}{order})")


def _awq(raw: Mapping[str, Any], where: Path) -> CheckpointQuantization:
    bits, group_size = raw.get("bits"), raw.get("group_size", 128)
    version = str(raw.get("version", "gemm")).lower()
    if version != "gemm":
        _refuse(where, f"quantization 'awq' ({version})")
    if bits != 4:
        _refuse(where, f"quantization 'awq' ({bits}-bit)")
    if not raw.get("zero_point", True):
        _refuse(where, "quantization 'awq' without zero points")
    if not isinstance(group_size, int) or group_size <= 0:
        raise ModelLoadError(f"{where}: group_size {group_size!r} is not a size", hint="corrupt config")
    fmt = WeightFormat(
        kind="int", bits=4, strategy="group", symmetric=False, group_size=group_size, layout="awq"
    )
    return _every_linear("awq", fmt, f"awq ({fmt.describe()})", raw.get("modules_to_not_convert"))


def _every_linear(
    method: str, fmt: WeightFormat, description: str, skipped: list[str] | None = None
) -> CheckpointQuantization:
    """One format for every linear of the checkpoint but the `skipped` modules."""
    return CheckpointQuantization(
        method=method,
        description=description,
        formats=((("Linear",), fmt),),
        ignore=tuple(str(name) for name in skipped or []),
    )


# -- dequantization -------------------------------------------------------------------------------------


def _dequantized(
    parts: Mapping[str, Weight], fmt: WeightFormat, where: str, method: str
) -> Deferred | QuantizedTensor:
    def need(part: str) -> Weight:
        if part not in parts:
            raise ModelLoadError(
                f"{where}: no {part} (its format: {fmt.describe()})", hint="the checkpoint is incomplete"
            )
        return parts[part]

    if fmt.layout != "compressed-tensors":
        shape, scale, groups = _packed_groups(need, parts, fmt, where)
    else:
        scale = parts.get("weight_scale_inv", parts.get("weight_scale"))
        if scale is None:
            need("weight_scale")
        if fmt.kind == "float8":
            stored = need("weight")
            make = lambda: _float8_values(stored, scale, fmt, where)  # noqa: E731
            return Deferred(tuple(stored.shape), torch.float32, make, f"{method}: {fmt.describe()}")
        shape, groups = _compressed_groups(need, parts, scale, fmt, where)
    kind = _block_type(fmt, scale, shape, ordered=fmt.ordered or "weight_g_idx" in parts)
    if kind is not None:
        origin = f"{method}: {fmt.describe()}"
        return QuantizedTensor(kind, shape, lambda: _blocks(groups(), kind, where), origin=origin)
    return Deferred(shape, torch.float32, lambda: groups().floats(), f"{method}: {fmt.describe()}")


@dataclass(frozen=True)
class IntGroups:
    """An integer weight as its format defines it: each value minus its zero point, [out, in]; a scale
    for each output and group, [out, groups]; each input's group."""

    values: torch.Tensor  # int32
    scales: torch.Tensor  # float32
    group_of_input: torch.Tensor  # int64 [in]

    def floats(self) -> torch.Tensor:
        return self.values.to(torch.float32) * self.scales[:, self.group_of_input]


def _block_type(fmt: WeightFormat, scale: Weight, shape: tuple[int, ...], *, ordered: bool) -> str | None:
    """The GGUF block type that holds the weight's values as they are (None: none does): symmetric 4-
    and 8-bit integers, groups of whole 32-input blocks in input order, float16 or bfloat16 scales."""
    columns = shape[-1]
    group = fmt.group_size if fmt.strategy == "group" else columns
    fits = (
        fmt.kind == "int"
        and fmt.symmetric
        and fmt.bits in BLOCK_TYPES
        and not ordered
        and scale.dtype in (torch.float16, torch.bfloat16)
        and group is not None
        and group % BLOCK == 0
        and columns % BLOCK == 0
    )
    return BLOCK_TYPES[fmt.bits] if fits else None


def _blocks(groups: IntGroups, kind: str, where: str) -> np.ndarray:
    """The weight as llama.cpp's `kind` blocks, one row of blocks an output: a float16 scale, then 32
    values (Q8_0: int8; Q4_0: value + 8 in nibbles, input j low and j + 16 high). A bfloat16 scale is
    the same float16 within float16's range; one below it is rounded to float16's subnormals."""
    rows = groups.values.shape[0]
    runs = groups.group_of_input.reshape(-1, BLOCK)
    if not bool((runs == runs[:, :1]).all()):
        raise ModelLoadError(
            f"{where}: its groups are not runs of whole {BLOCK}-input blocks (g_idx), though the config "
            "says the inputs are in order",
            hint="the checkpoint is inconsistent",
        )
    low, high = (-8, 7) if kind == "Q4_0" else (-128, 127)
    values = groups.values.reshape(rows, -1, BLOCK)
    if int(values.min()) < low or int(values.max()) > high:
        raise ModelLoadError(
            f"{where}: values outside {low}..{high} for a symmetric {kind[1]}-bit weight (zero points "
            "other than the midpoint?)",
            hint="the checkpoint is inconsistent",
        )
    scales = groups.scales[:, runs[:, 0]].to(torch.float16).contiguous()  # [rows, blocks]
    if not bool(torch.isfinite(scales).all()):
        raise ModelLoadError(
            f"{where}: a scale beyond float16's range ({float(groups.scales.abs().max()):.3g})",
            hint="the checkpoint's weights are too large for llama.cpp's blocks; " + HINT,
        )
    scale_bytes = scales.view(torch.uint8).reshape(rows, -1, 2)
    if kind == "Q4_0":
        nibbles = (values + 8).to(torch.uint8)
        payload = nibbles[..., : BLOCK // 2] | (nibbles[..., BLOCK // 2 :] << 4)
    else:
        payload = values.to(torch.int8).view(torch.uint8)
    return torch.cat((scale_bytes, payload), dim=-1).reshape(rows, -1).numpy()


def _packed_groups(
    need: Callable[[str], Weight], parts: Mapping[str, Weight], fmt: WeightFormat, where: str
) -> tuple[tuple[int, int], Weight, Callable[[], IntGroups]]:
    """A GPTQ or AWQ linear: (shape, its scales, its integers when asked); the input features run down
    `qweight`'s words (GPTQ) or along its rows (AWQ)."""
    words, zeros, scales = need("qweight"), need("qzeros"), need("scales")
    order = parts.get("g_idx")
    per_word = 32 // fmt.bits
    if fmt.layout == "awq":
        shape = (words.shape[1] * per_word, words.shape[0])
    else:
        shape = (words.shape[1], words.shape[0] * per_word)
    return shape, scales, lambda: _packed_values(words, zeros, scales, order, shape, fmt, where)


def _packed_values(
    words: Weight,
    zeros: Weight,
    scales: Weight,
    order: Weight | None,
    shape: tuple[int, int],
    fmt: WeightFormat,
    where: str,
) -> IntGroups:
    """q − zero point and the scales, as the tool's own dequantizer reads them (GPTQ's v1 format adds
    one to each stored zero point after masking, as auto-gptq does)."""
    rows, columns = shape
    scale = materialize(scales).to(torch.float32)  # [groups, out_features]
    for name, tensor in (("qweight", words), ("qzeros", zeros)):
        if tensor.dtype != torch.int32:
            raise ModelLoadError(f"{where}: {name} is {tensor.dtype}, not int32", hint="corrupt checkpoint")
    if fmt.layout == "awq":
        ints = _unpacked_words(materialize(words), fmt.bits, interleaved=True)  # [in, out]
        points = _unpacked_words(materialize(zeros), fmt.bits, interleaved=True)  # [groups, out]
    else:
        ints = _unpacked_words(materialize(words).t(), fmt.bits, interleaved=False).t()  # [in, out]
        points = _unpacked_words(materialize(zeros), fmt.bits, interleaved=False)
        if fmt.layout == "gptq":
            points = points + 1
    groups = scale.shape[0]
    if order is not None:
        group_of_input = materialize(order).to(torch.int64)
    else:
        group_of_input = torch.arange(columns) // (fmt.group_size or columns)
    if (
        scale.shape[1] != rows
        or points.shape[:1] != scale.shape[:1]
        or points.shape[1] < rows
        or group_of_input.shape != (columns,)
        or int(group_of_input.max()) >= groups
        or int(group_of_input.min()) < 0
    ):
        raise ModelLoadError(
            f"{where}: qweight {list(words.shape)}, qzeros {list(zeros.shape)} and scales "
            f"{list(scales.shape)} do not fit one {fmt.describe()} weight of {rows}x{columns}",
            hint="the checkpoint is corrupt",
        )
    values = (ints - points[:, :rows][group_of_input]).t().contiguous()
    return IntGroups(values, scale.t().contiguous(), group_of_input)


def _unpacked_words(words: torch.Tensor, bits: int, *, interleaved: bool) -> torch.Tensor:
    """The unsigned `bits`-bit values of int32 words along each row, lowest bits first (AWQ: each word's
    values in AWQ_ORDER)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    values = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [rows, words, values a word]
    if interleaved:
        values = values[..., list(AWQ_ORDER.index(column) for column in range(len(AWQ_ORDER)))]
    return values.reshape(words.shape[0], -1)


def _float8_values(stored: Weight, scale: Weight, fmt: WeightFormat, where: str) -> torch.Tensor:
    values = materialize(stored)
    if values.dtype != torch.float8_e4m3fn:
        raise ModelLoadError(f"{where}: weight is {values.dtype}, not float8 e4m3", hint="corrupt checkpoint")
    return values.to(torch.float32) * _expanded(
        materialize(scale).to(torch.float32), values.shape, fmt, where
    )


def _compressed_groups(
    need: Callable[[str], Weight], parts: Mapping[str, Weight], scale: Weight, fmt: WeightFormat, where: str
) -> tuple[tuple[int, ...], Callable[[], IntGroups]]:
    """A compressed-tensors integer linear: (shape, its integers when asked)."""
    if fmt.packed:
        stored, shape_tensor = need("weight_packed"), need("weight_shape")
        shape = tuple(int(n) for n in materialize(shape_tensor).tolist())
    else:
        stored = need("weight")
        shape = tuple(stored.shape)
    zero = parts.get("weight_zero_point")
    if not fmt.symmetric and zero is None:
        need("weight_zero_point")
    order = parts.get("weight_g_idx")
    return shape, lambda: _int_values(stored, scale, zero, order, shape, fmt, where)


def _int_values(
    stored: Weight,
    scale: Weight,
    zero: Weight | None,
    order: Weight | None,
    shape: tuple[int, ...],
    fmt: WeightFormat,
    where: str,
) -> IntGroups:
    rows, columns = shape
    values = materialize(stored)
    if fmt.packed:
        ints = _unpacked(values, fmt.bits, columns, where)
    else:
        if values.dtype != torch.int8:
            raise ModelLoadError(f"{where}: weight is {values.dtype}, not int8", hint="corrupt checkpoint")
        ints = values.to(torch.int32)
    scales = materialize(scale).to(torch.float32)
    groups = scales.shape[-1]
    zeros = torch.zeros(scales.shape, dtype=torch.int32)
    if zero is not None and not fmt.symmetric:
        points = materialize(zero)
        if points.dtype == torch.int32 and points.shape[0] != rows:  # packed along the rows
            points = _unpacked(points.t().contiguous(), fmt.bits, rows, where).t()
        zeros = points.to(torch.int32).reshape(scales.shape)
    if order is not None:
        group_of_column = materialize(order).to(torch.int64)
    elif fmt.strategy == "group":
        group_of_column = torch.arange(columns) // int(fmt.group_size or columns)
    else:
        group_of_column = torch.zeros(columns, dtype=torch.int64)
    if int(group_of_column.max()) >= groups or group_of_column.shape != (columns,):
        raise ModelLoadError(
            f"{where}: scales {list(scales.shape)} do not cover {columns} columns", hint="corrupt"
        )
    return IntGroups(ints - zeros[:, group_of_column], scales.reshape(rows, groups), group_of_column)


def _unpacked(words: torch.Tensor, bits: int, columns: int, where: str) -> torch.Tensor:
    """Signed `bits`-bit integers from int32 words holding 32 / bits each, lowest bits first, each
    stored plus 2^(bits-1) (compressed-tensors' pack_to_int32)."""
    if words.dtype != torch.int32:
        raise ModelLoadError(f"{where}: packed weight is {words.dtype}, not int32", hint="corrupt checkpoint")
    data = _unpacked_words(words, bits, interleaved=False)
    if data.shape[-1] < columns:
        raise ModelLoadError(
            f"{where}: packed weight holds fewer than {columns} columns", hint="corrupt checkpoint"
        )
    return data[:, :columns].to(torch.int32) - (1 << (bits - 1))


def _expanded(scale: torch.Tensor, shape: torch.Size, fmt: WeightFormat, where: str) -> torch.Tensor:
    """Scales broadcast over the weight: one, one a row, or one a block (the last blocks may be cut)."""
    rows, columns = shape
    if fmt.strategy == "block":
        if fmt.block is None:
            raise ModelLoadError(f"{where}: block scales without a block size", hint="the config is corrupt")
        block_rows, block_columns = fmt.block
        if scale.shape != (-(-rows // block_rows), -(-columns // block_columns)):
            raise ModelLoadError(
                f"{where}: block scales {list(scale.shape)} do not fit {list(shape)}", hint="corrupt"
            )
        return scale.repeat_interleave(block_rows, 0)[:rows].repeat_interleave(block_columns, 1)[:, :columns]
    if scale.numel() == 1:
        return scale.reshape(1, 1)
    if scale.numel() == rows:
        return scale.reshape(rows, 1)
    raise ModelLoadError(
        f"{where}: scales {list(scale.shape)} do not fit {list(shape)}", hint="corrupt checkpoint"
    )


# -- refusal ----------------------------------------------------------------------------------------------


def _variant(method: str, raw: Mapping[str, Any]) -> str:
    """What a refused config says of itself, as a user would name it ("4-bit nf4")."""
    if method == "bitsandbytes":
        if raw.get("load_in_4bit"):
            return f" (4-bit {raw.get('bnb_4bit_quant_type', 'fp4')})"
        if raw.get("load_in_8bit"):
            return " (8-bit)"
    bits = raw.get("bits") or raw.get("w_bit") or raw.get("nbits")
    return f" ({bits}-bit)" if bits else ""


def _refuse(where: Path, what: str) -> None:
    raise ModelLoadError(f"{where}: {what} is not supported", hint=HINT)


def _names(target: str) -> bool:
    """Whether a compressed-tensors target names modules (a regex or a dotted name), not a class."""
    return target.startswith("re:") or "." in target


def _matches(target: str, module: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return module == target or module.endswith("." + target) or (target == "lm_head" and module == "lm_head")
