"""The collectives a tensor-parallel TVM step calls: packed functions the runtime registers under
`kiln.all_reduce` and `kiln.all_gather`, which the compiled code calls destination-passing style
(the VM allocates the output). They run the process group's collective (torch.distributed: gloo on
the CPU, NCCL on GPUs) on the step's own tensors, taken without copies through DLPack."""

from __future__ import annotations

from typing import Any

_registered = False


def register_collectives(ffi: Any) -> None:
    """Register the packed functions with `ffi` (tvm_ffi) once per process."""
    global _registered
    if _registered:
        return

    @ffi.register_global_func("kiln.all_reduce", override=True)
    def _all_reduce(x: Any, world: int, out: Any) -> None:
        import torch

        from kiln.ir.ops.collective import all_reduce

        torch.from_dlpack(out).copy_(all_reduce(torch.from_dlpack(x), world=int(world)))

    @ffi.register_global_func("kiln.all_gather", override=True)
    def _all_gather(x: Any, world: int, dim: int, out: Any) -> None:
        import torch

        from kiln.ir.ops.collective import all_gather

        torch.from_dlpack(out).copy_(all_gather(torch.from_dlpack(x), world=int(world), dim=int(dim)))

    _registered = True
