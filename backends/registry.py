"""The backends by name. Names listed without a backend are planned and refused with a clear reason."""

from __future__ import annotations

from kiln.backends.base import Backend, BackendError
from kiln.backends.reference.backend import ReferenceBackend

BACKEND_NAMES = ("reference", "tvm", "onnxruntime", "tensorrt")
_AVAILABLE: dict[str, Backend] = {"reference": ReferenceBackend()}


def get_backend(name: str) -> Backend:
    backend = _AVAILABLE.get(name)
    if backend is not None:
        return backend
    if name in BACKEND_NAMES:
        raise BackendError(
            f"backend {name} is not built yet in this version of kiln",
            hint=f"available backends: {', '.join(_AVAILABLE)}",
        )
    raise BackendError(f"unknown backend {name!r}", hint=f"choose one of {', '.join(BACKEND_NAMES)}")
