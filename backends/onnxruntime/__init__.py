"""The ONNX Runtime backend."""
