"""The mixture-of-experts kernels around the experts' matmuls, for the CPU and NVIDIA GPUs.

route:    router logits [t, E] -> each token's top-k experts and weights (softmax in float32, top-k by
          repeated arg-max, lowest index first on ties; renormalised if asked), then the (token, slot)
          rows grouped by expert: `order` [t * top_k] lists slots t * top_k + j, expert e's from
          offsets[e] to offsets[e + 1] (a counting sort, in slot order within an expert). Padding
          rows (past the real count) get no slot.
grouped:  float32 experts: y[slot] = W[expert of slot] @ x[input row of slot], over each expert's
          slots only, so an expert no token chose is never read. Weights: each expert's
          [N, K] as strips of `tile` columns, stacked ([E * N / tile, K, tile], layouts.py `tiled`).
combine:  out[t] = sum_j weight[t, j] * y[t * top_k + j]; zeros for padding rows.

The quantized experts' matmul is the integer-dot kernel's experts form (int_dot.py).
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

GPU_THREADS = 256


def route_kernel(experts: int, top_k: int, normalize: bool, target_kind: str) -> tirx.PrimFunc:
    """(logits[t, E] f32, counts[2] i64, which) -> ids[t, k] i32, weights[t, k] f32, order[t * k] i32,
    offsets[E + 1] i32. One thread: the work is t * E, small beside any matmul."""
    scope = "local" if target_kind == "cuda" else "global"
    gpu = target_kind == "cuda"

    @T.macro
    def body(logits, counts, which, ids, weights, order, offsets, t):
        best = T.sblock_alloc_buffer((1,), "int32", scope=scope)
        taken = T.sblock_alloc_buffer((1,), "int32", scope=scope)
        total = T.sblock_alloc_buffer((2,), "float32", scope=scope)  # the softmax's sum, the top-k's
        rows = T.min(counts[which], t)
        for row in T.serial(rows):
            for j in T.serial(top_k):
                best[0] = -1
                for e in T.serial(experts):
                    taken[0] = 0
                    for i in T.serial(j):
                        if ids[row, i] == e:
                            taken[0] = 1
                    if taken[0] == 0:
                        if best[0] < 0:
                            best[0] = T.Cast("int32", e)
                        else:
                            if logits[row, e] > logits[row, best[0]]:
                                best[0] = T.Cast("int32", e)
                ids[row, j] = best[0]
            total[0] = T.float32(0)
            for e in T.serial(experts):
                total[0] = total[0] + T.exp(logits[row, e] - logits[row, ids[row, 0]])
            total[1] = T.float32(0)
            for j in T.serial(top_k):
                weights[row, j] = T.exp(logits[row, ids[row, j]] - logits[row, ids[row, 0]]) / total[0]
                total[1] = total[1] + weights[row, j]
            if normalize:
                for j in T.serial(top_k):
                    weights[row, j] = weights[row, j] / total[1]
        for e in T.serial(experts + 1):
            offsets[e] = 0
        for row in T.serial(rows):
            for j in T.serial(top_k):
                offsets[ids[row, j] + 1] = offsets[ids[row, j] + 1] + 1
        for e in T.serial(experts):
            offsets[e + 1] = offsets[e + 1] + offsets[e]
        for row in T.serial(rows):  # offsets[e] counts up as a cursor ...
            for j in T.serial(top_k):
                order[offsets[ids[row, j]]] = T.Cast("int32", row * top_k + j)
                offsets[ids[row, j]] = offsets[ids[row, j]] + 1
        for e in T.serial(experts):  # ... to expert e's end, expert e + 1's start
            offsets[experts - e] = offsets[experts - e - 1]
        offsets[0] = 0

    @T.prim_func(s_tir=True)
    def moe_route(
        logits_handle: T.handle,
        counts_handle: T.handle,
        which: T.int64,
        ids_handle: T.handle,
        weights_handle: T.handle,
        order_handle: T.handle,
        offsets_handle: T.handle,
    ):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        t = T.int64()
        logits = T.match_buffer(logits_handle, (t, experts), "float32")
        counts = T.match_buffer(counts_handle, (2,), "int64")
        ids = T.match_buffer(ids_handle, (t, top_k), "int32")
        weights = T.match_buffer(weights_handle, (t, top_k), "float32")
        order = T.match_buffer(order_handle, (t * top_k,), "int32")
        offsets = T.match_buffer(offsets_handle, (experts + 1,), "int32")
        if gpu:
            for _block in T.thread_binding(1, thread="blockIdx.x"):
                for _thread in T.thread_binding(1, thread="threadIdx.x"):
                    with T.sblock("route"):
                        T.reads()
                        T.writes()
                        body(logits, counts, which, ids, weights, order, offsets, t)
        else:
            with T.sblock("route"):
                T.reads()
                T.writes()
                body(logits, counts, which, ids, weights, order, offsets, t)

    return moe_route


def grouped_kernel(k: int, n: int, tile: int, experts: int, top_k: int, slot_input: bool, target_kind: str):
    """(x[rows, K] f32, w[E * N / tile, K, tile] f32, order, offsets) -> y[t * top_k, N]; x's rows are
    tokens (gate, up: a slot's row is slot // top_k) or slots (down: `slot_input`)."""
    strips = n // tile

    def input_of(slot: tirx.PrimExpr) -> tirx.PrimExpr:
        return slot if slot_input else slot // top_k

    if target_kind == "cuda":

        @T.prim_func(s_tir=True)
        def moe_grouped_gpu(
            x_handle: T.handle,
            w_handle: T.handle,
            order_handle: T.handle,
            offsets_handle: T.handle,
            y_handle: T.handle,
        ):
            T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
            rows = T.int64()
            slots = T.int64()
            x = T.match_buffer(x_handle, (rows, k), "float32")
            w = T.match_buffer(w_handle, (experts * strips, k, tile), "float32")
            order = T.match_buffer(order_handle, (slots,), "int32")
            offsets = T.match_buffer(offsets_handle, (experts + 1,), "int32")
            y = T.match_buffer(y_handle, (slots, n), "float32")
            for jo in T.thread_binding(strips, thread="blockIdx.x"):
                for lane in T.thread_binding(tile, thread="threadIdx.x"):
                    with T.sblock("expert_columns"):
                        T.reads()
                        T.writes()
                        acc = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        for e in T.serial(experts):
                            for i in T.serial(offsets[e + 1] - offsets[e]):
                                acc[0] = T.float32(0)
                                for kk in T.serial(k):
                                    acc[0] = (
                                        acc[0]
                                        + x[input_of(order[offsets[e] + i]), kk]
                                        * w[e * strips + jo, kk, lane]
                                    )
                                y[order[offsets[e] + i], jo * tile + lane] = acc[0]

        return moe_grouped_gpu

    @T.prim_func(s_tir=True)
    def moe_grouped(
        x_handle: T.handle,
        w_handle: T.handle,
        order_handle: T.handle,
        offsets_handle: T.handle,
        y_handle: T.handle,
    ):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        rows = T.int64()
        slots = T.int64()
        x = T.match_buffer(x_handle, (rows, k), "float32")
        w = T.match_buffer(w_handle, (experts * strips, k, tile), "float32")
        order = T.match_buffer(order_handle, (slots,), "int32")
        offsets = T.match_buffer(offsets_handle, (experts + 1,), "int32")
        y = T.match_buffer(y_handle, (slots, n), "float32")
        for jo in T.parallel(strips):
            with T.sblock("strip"):
                T.reads()
                T.writes()
                acc = T.sblock_alloc_buffer((tile,), "float32")  # default scope, < 1 KiB: the stack
                for e in T.serial(experts):
                    for i in T.serial(offsets[e + 1] - offsets[e]):
                        for lane in T.vectorized(tile):
                            acc[lane] = T.float32(0)
                        for kk in T.serial(k):
                            for lane in T.vectorized(tile):
                                acc[lane] = (
                                    acc[lane]
                                    + x[input_of(order[offsets[e] + i]), kk] * w[e * strips + jo, kk, lane]
                                )
                        for lane in T.vectorized(tile):
                            y[order[offsets[e] + i], jo * tile + lane] = acc[lane]

    return moe_grouped


def combine_kernel(hidden: int, top_k: int, target_kind: str) -> tirx.PrimFunc:
    """(y[t * top_k, H], weights[t, top_k], counts, which) -> out[t, H]."""
    threads = min(GPU_THREADS, hidden)
    steps = -(-hidden // threads)

    if target_kind == "cuda":

        @T.prim_func(s_tir=True)
        def moe_combine_gpu(
            y_handle: T.handle,
            weights_handle: T.handle,
            counts_handle: T.handle,
            which: T.int64,
            out_handle: T.handle,
        ):
            T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
            t = T.int64()
            y = T.match_buffer(y_handle, (t * top_k, hidden), "float32")
            weights = T.match_buffer(weights_handle, (t, top_k), "float32")
            counts = T.match_buffer(counts_handle, (2,), "int64")
            out = T.match_buffer(out_handle, (t, hidden), "float32")
            for row in T.thread_binding(t, thread="blockIdx.x"):
                for tx in T.thread_binding(threads, thread="threadIdx.x"):
                    with T.sblock("combine"):
                        T.reads()
                        T.writes()
                        acc = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        for step in T.serial(steps):
                            if step * threads + tx < hidden:
                                acc[0] = T.float32(0)
                                if row < counts[which]:
                                    for j in T.serial(top_k):
                                        acc[0] = (
                                            acc[0] + weights[row, j] * y[row * top_k + j, step * threads + tx]
                                        )
                                out[row, step * threads + tx] = acc[0]

        return moe_combine_gpu

    @T.prim_func(s_tir=True)
    def moe_combine(
        y_handle: T.handle,
        weights_handle: T.handle,
        counts_handle: T.handle,
        which: T.int64,
        out_handle: T.handle,
    ):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        t = T.int64()
        y = T.match_buffer(y_handle, (t * top_k, hidden), "float32")
        weights = T.match_buffer(weights_handle, (t, top_k), "float32")
        counts = T.match_buffer(counts_handle, (2,), "int64")
        out = T.match_buffer(out_handle, (t, hidden), "float32")
        for row in T.parallel(t):
            for h in T.serial(hidden):
                out[row, h] = T.float32(0)
            if row < counts[which]:
                for j in T.serial(top_k):
                    for h in T.serial(hidden):
                        out[row, h] = out[row, h] + weights[row, j] * y[row * top_k + j, h]

    return moe_combine
