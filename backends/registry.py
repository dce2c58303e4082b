"""The backends by name, imported on first use (each pulls in its own compiler or runtime)."""

from __future__ import annotations

import importlib

from kiln.backends.base import Backend, BackendError

_BACKENDS = {
    "reference": "kiln.backends.reference.backend:ReferenceBackend",
    "tvm": "kiln.backends.tvm.backend:TVMBackend",
    "onnxruntime": "kiln.backends.onnxruntime.backend:OnnxRuntimeBackend",
    "tensorrt": "kiln.backends.tensorrt.backend:TensorRTBackend",
}
BACKEND_NAMES = tuple(_BACKENDS)
_loaded: dict[str, Backend] = {}


def get_backend(name: str) -> Backend:
    if name in _loaded:
        return _loaded[name]
    where = _BACKENDS.get(name)
    if where is None:
        raise BackendError(f"unknown backend {name!r}", hint=f"choose one of {', '.join(BACKEND_NAMES)}")
    module_name, _, class_name = where.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise BackendError(
            f"backend {name} cannot be imported here ({error})",
            hint="install kiln with its dependencies (`make setup`)",
        ) from None
    backend: Backend = getattr(module, class_name)()
    _loaded[name] = backend
    return backend
