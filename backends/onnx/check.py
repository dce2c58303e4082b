"""Structural checks of a lowered model: the ONNX checker (full) and strict shape inference."""

from __future__ import annotations

import onnx

from kiln.backends.base import BackendError


def check_model(model: onnx.ModelProto) -> list[str]:
    """One line per check passed; a BackendError for the first that fails."""
    try:
        onnx.checker.check_model(model, full_check=True)
    except onnx.checker.ValidationError as error:
        raise BackendError(
            f"the lowered ONNX model fails the checker: {error}", hint="a bug in backends/onnx/"
        ) from None
    try:
        inferred = onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True, data_prop=True)
    except onnx.shape_inference.InferenceError as error:
        raise BackendError(
            f"the lowered ONNX model fails shape inference: {error}", hint="a bug in backends/onnx/"
        ) from None
    opsets = ", ".join(f"{o.domain or 'ai.onnx'} {o.version}" for o in model.opset_import)
    return [
        f"onnx.checker.check_model(full_check=True) passes ({len(model.graph.node)} nodes; opsets {opsets})",
        f"strict shape inference passes ({len(inferred.graph.value_info)} intermediate values typed)",
    ]
