"""The reference backend: the oracle that interprets IR with torch ops."""

from kiln.backends.reference.executable import ReferenceExecutable, interpret

__all__ = ["ReferenceExecutable", "interpret"]
