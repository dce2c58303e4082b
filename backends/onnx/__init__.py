"""Lowering of kiln IR to ONNX, shared by the onnxruntime and tensorrt backends."""

from kiln.backends.onnx.check import check_model
from kiln.backends.onnx.context import LoweringOptions
from kiln.backends.onnx.files import META_FILE, MODEL_FILE, read_lowered, write_lowered
from kiln.backends.onnx.lower import KV_OUTPUT, LoweredModel, check_lowerable, lower_program
from kiln.backends.onnx.weights import WeightBinding, materialize

__all__ = [
    "KV_OUTPUT",
    "META_FILE",
    "MODEL_FILE",
    "LoweredModel",
    "LoweringOptions",
    "WeightBinding",
    "check_lowerable",
    "check_model",
    "lower_program",
    "materialize",
    "read_lowered",
    "write_lowered",
]
