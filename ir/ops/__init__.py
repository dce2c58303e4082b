"""The registered ops. Importing this package registers every op once."""

from kiln.ir.ops import attention, basic, collective, fused, lora, moe, quant
from kiln.ir.ops.registry import REGISTRY, OpDef, ShapeError, get_op

__all__ = [
    "REGISTRY",
    "OpDef",
    "ShapeError",
    "attention",
    "basic",
    "collective",
    "fused",
    "get_op",
    "lora",
    "moe",
    "quant",
]
