"""The reference backend: the oracle that runs IR with the ops' torch references."""

from kiln.backends.reference.executable import ReferenceExecutable

__all__ = ["ReferenceExecutable"]
