"""Passes that make TVM's output the same from one compile to the next, so that compiling a model twice
with the same options gives byte-identical step.so files (docs/ci.md).

TVM's VMShapeLower (src/relax/backend/vm/vm_shape_lower.cc) writes each `shape_func` as one store per
symbolic shape expression that the newly matched variables make computable, in the order its
`PopulateSlotInfo` walks `slot_map_`: a std::unordered_map keyed by `ffi::StructuralHash` of the
expressions. StructuralHash hashes a free variable (`tq`, `n`, ...) by its address, so that order, and with
it the order of the stores, the code LLVM schedules from them and the library's build-id, changes with
where the allocator put the variables (a new process, another allocation before). Every store of one
shape_func writes a slot of a compound expression from slots of plain variables only (VMShapeLower
substitutes variables, never other expressions), so the stores are independent and any order computes the
same heap: `sort_shape_func_stores` puts them in slot order."""

from __future__ import annotations

import tvm
from tvm import relax, tirx


def _slot(stmt: tirx.Stmt) -> int | None:
    """The heap slot a shape_func statement stores to; None if it is not `H[constant] = value`."""
    if not isinstance(stmt, tirx.BufferStore) or len(stmt.indices) != 1:
        return None
    index = stmt.indices[0]
    return int(index.value) if isinstance(index, tvm.tirx.IntImm) else None


@tvm.transform.module_pass(opt_level=0, name="kiln.SortShapeFuncStores")
def sort_shape_func_stores(module: tvm.IRModule, _context: tvm.transform.PassContext) -> tvm.IRModule:
    """Each of VMShapeLower's `shape_func`s with its stores in heap-slot order (run after VMShapeLower)."""
    updates = {}
    for gvar, func in module.functions.items():
        if not isinstance(func, tirx.PrimFunc) or not gvar.name_hint.startswith("shape_func"):
            continue
        if not isinstance(func.body, tirx.SeqStmt):
            continue  # one store (or a form VMShapeLower does not write): nothing to order
        stores = list(func.body.seq)
        slots = [_slot(stmt) for stmt in stores]
        if any(slot is None for slot in slots) or len(set(slots)) != len(slots):
            continue  # not VMShapeLower's independent stores: leave it as it is
        ordered = [stmt for _, stmt in sorted(zip(slots, stores, strict=True), key=lambda pair: pair[0])]
        updates[gvar] = func.with_body(tirx.SeqStmt(ordered))
    if not updates:
        return module
    module = module.clone()
    for gvar, func in updates.items():
        module.update_func(gvar, func)
    return module


def default_relax_pipeline() -> tvm.transform.Pass:
    """tvm.compile's default Relax pipeline for a CPU target, then `sort_shape_func_stores`."""
    return tvm.transform.Sequential([relax.get_pipeline("default"), sort_shape_func_stores])
