"""The TensorRT backend (engine build and run need an NVIDIA GPU of the target's arch)."""
