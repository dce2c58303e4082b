"""Quantized linear with integer dot products (x86-64 and aarch64), one kernel for every block type.

The activation rows are quantized once per call to int8 blocks of `block` values (a scale, as
llama.cpp's Q8_1): xq = round(x / d), d = max|x| / 127. Then, for each strip of `tile` output
columns (parallel across cores), each weight group g and each row:

    dot[j]  = sum over the group's k of q[k, j] * xq[k]           (exact, int32)
    y[j]   += scale[g, j] * d * dot[j]                              symmetric
            + min[g, j] * sum_k x[k]                                min       (GGUF Q4_K, Q4_1, Q5_K ...)
    y[j]   += scale[g, j] * (d * dot[j] - zero[g, j] * sum_k x[k])  zero_point

The weights q are the IR's integers: 4-bit values 0..15, or int8. The dot product is one
instruction sequence per target, chosen at compile time from the CPU's features (`Isa`):

    vnni512  vpdpbusd zmm      16 columns x 4 k per instruction (AVX-512 VNNI)
    vnni256  vpdpbusd ymm       8 x 4 (AVX-VNNI, or AVX-512 VNNI with 256-bit vectors)
    avx2     vpmaddubsw + vpmaddwd, 8 x 4
    neon_dot  sdot (aarch64 dotprod: Cortex-A76/A78, Neoverse N1, Orin's A78AE), 4 x 4, signed x signed
    neon_i8mm usdot (aarch64 i8mm: Neoverse V1/N2/V2, Cortex-X2/A710 on), 4 x 4, unsigned x signed

The x86 ones multiply unsigned bytes (the weights) by signed bytes (the activations). 4-bit values are
unsigned already. An int8 weight is stored as q + 128 (`q ^ 0x80`): VNNI takes it as it is and
subtracts 128 * sum(xq) per block; AVX2 takes |q| times xq with q's sign, as vpmaddubsw would
saturate on 255 * 127 * 2. NEON's sdot takes q = u ^ 0x80 as signed bytes, exactly; 4- to 6-bit
values u <= 63 are signed bytes as they are. usdot (i8mm) takes u as VNNI does. i8mm's smmla (2 x 8
by 8 x 2 tiles) is not used: it wants two activation rows interleaved, another layout.

AVX2, int8 weights, 16-bit activations ("words"): the weight bytes u = q + 128 are widened to int16
and multiplied by the int16 activations with vpmaddwd, one instruction per 2 k instead of two int8
halves through vpmaddubsw and vpsignb (1.5-1.7x faster on Zen 3). A vector's 8 columns take two
accumulators, columns 0-3 and 4-7 with two lanes (k pairs) a column; vphaddd and a shuffle add the
lanes at the end of each block. The integers are the same as the halves', so the results are too.

AVX2, nibble planes: vpmaddubsw's int16 lanes add up as many rows of 8 k as fit (each puts 4
products of at most u_max x 127 in a lane) and widen to int32 only then, by vpmaddwd with 255 for the
high half and 1 for the low one, instead of a vpmaddwd and a vpaddd every 8 k: 4-bit values a whole
block of 32 (30480 at most; 1.1-1.3x faster on Zen 3), 5-bit (Q5_0, Q5_1, Q5_K) half a block (31496;
1.1x at 4 to 64 rows, 1.4x at one), 6-bit every 8 k as before. The integers are the same.

Weight layout (`dot_tiled`, layouts.py): per strip, per step of 4 k (8 k for 4-bit), `tile` columns
of 4 bytes; a 4-bit byte holds k (low nibble) and k + 4 (high nibble). So one vector load feeds
`lanes` columns x 4 k, and a 4-bit load feeds two dot instructions.

Row passes over a strip keep their accumulators in registers: with many rows, one vector of
columns for `vectors x 2` rows (AVX-512: 8), so each weight vector is unpacked once for 8 rows;
the rest two rows over the whole strip, then one. The order of the float sums per output is the
same in every pass, so a row's result does not depend on how many rows come with it.

Mixture of experts (`experts` > 0): the weights are E experts' strips stacked ([E * strips, ...]);
`order` lists the (token, slot) rows grouped by expert and `offsets[e]..offsets[e + 1]` are expert e's,
so each strip pass runs over each expert's rows with that expert's weights, and an expert no row
chose is never read. An output row is a slot t * top_k + j; its input row is the token t (gate, up)
or the slot itself (down: `slot_input`).

Rounding: the activation quantization adds an error of up to d / 2 per value (a relative error
about 1/254 of the block's largest value), as in llama.cpp; tests state the tolerance.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tvm import tirx
from tvm.script import tirx as T

from kiln.backends.tvm.kernels.linear import DTYPE_NAMES, QuantSpec

Expr = Any  # a TIR expression
MAX_BLOCK = 32  # activation values per int8 block (one scale)


@dataclass(frozen=True)
class Isa:
    name: str
    lanes: int  # int32 columns per vector
    vectors: int  # vectors of columns per strip: 4 rows x vectors accumulators stay in registers
    unsigned_int8: bool  # True: int8 weights as q + 128 then a -128 * sum(xq) correction (VNNI)
    word_dot: bool = False  # 16-bit activations as int16 words against int16 weights (vpmaddwd)

    @property
    def bytes(self) -> int:
        return self.lanes * 4


ISAS = {
    "vnni512": Isa("vnni512", 16, 4, True),  # 32 zmm registers
    "vnni256": Isa("vnni256", 8, 2, True),  # 16 ymm registers
    "avx2": Isa("avx2", 8, 2, False, word_dot=True),
    "neon_dot": Isa("neon_dot", 4, 4, False),  # 32 q registers; sdot is signed x signed
    "neon_i8mm": Isa("neon_i8mm", 4, 4, True),  # usdot: unsigned x signed, as VNNI
}


def choose_isa(features: set[str]) -> Isa | None:
    """The variant for an LLVM target's features (`llvm_get_cpu_features` names), None for none."""
    if {"avx512vnni", "avx512bw", "avx512f"} <= features:
        return ISAS["vnni512"]
    if "avxvnni" in features or {"avx512vnni", "avx512vl"} <= features:
        return ISAS["vnni256"]
    if "avx2" in features:
        return ISAS["avx2"]
    if "i8mm" in features:
        return ISAS["neon_i8mm"]
    if "dotprod" in features:
        return ISAS["neon_dot"]
    return None


@dataclass(frozen=True)
class Plane:
    """How the weights are stored for the kernel: unsigned values u = q + offset, as `bits`-bit
    values: 8 a byte each; 4 as nibbles; 5 and 6 as nibbles plus a plane of the bits above."""

    bits: int
    offset: int

    @property
    def nibbles(self) -> bool:
        return self.bits < 8

    @property
    def pairs_a_high_row(self) -> int:  # nibble rows (8 k each) whose high bits share a row of bytes
        return {5: 4, 6: 2}.get(self.bits, 1)


def weight_plane(spec: QuantSpec, value_bits: int | None = None) -> Plane | None:
    """The tightest plane for the spec's values (`value_bits`: the IR's hint), None: no kernel."""
    if (spec.bits, spec.scheme) not in ((4, "min"), (4, "zero_point"), (8, "symmetric"), (8, "min")):
        return None
    block = activation_block(spec.group_size)
    if block is None or block % 8:
        return None
    if spec.bits == 4:
        return Plane(4, 0)
    bits = value_bits or 8
    offset = 1 << (bits - 1) if spec.scheme == "symmetric" else 0
    if bits <= 4:
        return Plane(4, offset)
    if bits <= 6 and (block // 8) % Plane(bits, 0).pairs_a_high_row == 0:
        return Plane(bits, offset)
    return Plane(8, 128)  # int8 q as q + 128 (q ^ 0x80)


def int_dot_tile(n: int, spec: QuantSpec, isa: Isa) -> int | None:
    """Columns per strip for N outputs, or None when the kernel does not apply."""
    if weight_plane(spec) is None:
        return None
    for vectors in range(isa.vectors, 0, -1):
        if n % (isa.lanes * vectors) == 0:
            return isa.lanes * vectors
    return None


def activation_block(group: int) -> int | None:
    """Values per activation scale: the weight group, or 32 when it divides a larger group."""
    if group <= MAX_BLOCK:
        return group
    return MAX_BLOCK if group % MAX_BLOCK == 0 else None


DotPair = Callable[[Expr, Expr, Expr, Expr, Expr], Expr]


def _dot_pair(isa: Isa, nibbles: bool) -> DotPair:
    """acc (int32 x lanes) + the 4-byte dots of two weight vectors (u8 x 4 lanes) with two 4-byte
    activation groups (each one int32, broadcast to every lane)."""
    lanes, width = isa.lanes, isa.bytes

    if isa.name in ("vnni512", "vnni256"):
        name = f"llvm.x86.avx512.vpdpbusd.{32 * lanes}"

        def vnni(acc: Expr, weights: Expr, x4: Expr) -> Expr:
            return T.call_llvm_pure_intrin(
                T.llvm_lookup_intrinsic_id(name),
                acc,
                weights,
                _in_every_lane(x4, isa),
                dtype=f"int32x{lanes}",
            )

        return lambda acc, w0, x0, w1, x1: vnni(vnni(acc, w0, x0), w1, x1)

    if isa.name in ("neon_dot", "neon_i8mm"):
        # usdot takes u as it is (the kernel subtracts 128 * sum(xq) for int8); sdot takes int8 weights
        # as q = u ^ 0x80, and nibble planes' u <= 63 as they are
        name = "usdot" if isa.unsigned_int8 else "sdot"
        signed = not isa.unsigned_int8 and not nibbles

        def dot(acc: Expr, weights: Expr, x4: Expr) -> Expr:
            values = weights ^ T.broadcast(T.uint8(128), width) if signed else weights
            return T.call_llvm_pure_intrin(
                T.llvm_lookup_intrinsic_id(f"llvm.aarch64.neon.{name}.v4i32.v16i8"),
                acc,
                T.reinterpret(values, dtype=f"int8x{width}"),
                _in_every_lane(x4, isa),
                dtype=f"int32x{lanes}",
            )

        return lambda acc, w0, x0, w1, x1: dot(dot(acc, w0, x0), w1, x1)

    if nibbles:  # u <= 63: 2 * (63 * 127 * 2) fits int16: add the two products before widening
        return lambda acc, w0, x0, w1, x1: (
            acc
            + _widen(
                _byte_products(w0, _in_every_lane(x0, isa)) + _byte_products(w1, _in_every_lane(x1, isa))
            )
        )

    def signed(weights: Expr, x4: Expr) -> Expr:  # |q| times xq with q's sign: no saturation
        q = T.reinterpret(weights ^ T.broadcast(T.uint8(128), width), dtype=f"int8x{width}")
        magnitude = T.reinterpret(T.max(q, T.broadcast(T.int8(0), width) - q), dtype=f"uint8x{width}")
        signs = T.call_llvm_pure_intrin(
            T.llvm_lookup_intrinsic_id("llvm.x86.avx2.psign.b"),
            _in_every_lane(x4, isa),
            q,
            dtype=f"int8x{width}",
        )
        return _widen(_byte_products(magnitude, signs))

    return lambda acc, w0, x0, w1, x1: acc + signed(w0, x0) + signed(w1, x1)


def _short_pairs(block_pairs: int, plane: Plane) -> int:
    """Pairs (8 k) whose vpmaddubsw products an int16 lane can add up: a pair puts 4 products of at
    most u_max x 127 in a lane; the largest divisor of the block's pairs that fits (4-bit: the block)."""
    fits = 32767 // (4 * ((1 << plane.bits) - 1) * 127)
    return max(p for p in range(1, block_pairs + 1) if block_pairs % p == 0 and p <= max(fits, 1))


def _in_every_lane(x4: Expr, isa: Isa) -> Expr:
    """4 activation bytes (one int32) repeated in every int32 lane: isa.bytes int8 values."""
    return T.reinterpret(T.broadcast(x4, isa.lanes), dtype=f"int8x{isa.bytes}")


def _byte_products(unsigned: Expr, signed: Expr) -> Expr:
    """vpmaddubsw: int16 lane j = u[2j] * s[2j] + u[2j + 1] * s[2j + 1] (saturating; uint8/int8 x 32)."""
    return T.call_llvm_pure_intrin(
        T.llvm_lookup_intrinsic_id("llvm.x86.avx2.pmadd.ub.sw"), unsigned, signed, dtype="int16x16"
    )


def _widen(words: Expr, by: int = 1) -> Expr:
    """Adjacent int16 pairs summed into int32, times `by` (vpmaddwd)."""
    return T.call_llvm_pure_intrin(
        T.llvm_lookup_intrinsic_id("llvm.x86.avx2.pmadd.wd"),
        words,
        T.broadcast(T.int16(by), 16),
        dtype="int32x8",
    )


def _word_products(weights: Expr, x4: Expr) -> Expr:
    """vpmaddwd: int32 lane j = weights[2j] * x[2j] + weights[2j + 1] * x[2j + 1] (int16x16 each)."""
    return T.call_llvm_pure_intrin(
        T.llvm_lookup_intrinsic_id("llvm.x86.avx2.pmadd.wd"), weights, x4, dtype="int32x8"
    )


def _word_columns(cols_0_3: Expr, cols_4_7: Expr) -> Expr:
    """8 columns' int32 sums from two word-dot accumulators, each lane pair (2j, 2j + 1) one column:
    vphaddd adds the pairs per 128-bit lane (columns 0 1 4 5 | 2 3 6 7), a shuffle restores the order."""
    pairs = T.call_llvm_pure_intrin(
        T.llvm_lookup_intrinsic_id("llvm.x86.avx2.phadd.d"), cols_0_3, cols_4_7, dtype="int32x8"
    )
    return T.Shuffle([pairs], [0, 1, 4, 5, 2, 3, 6, 7])


def int_dot_gemm_kernel(
    k: int,
    n: int,
    spec: QuantSpec,
    has_bias: bool,
    isa: Isa,
    plane: Plane | None = None,
    activation_bits: int = 16,
    scale_per: int = 0,
    experts: int = 0,
    top_k: int = 1,
    slot_input: bool = False,
) -> tirx.PrimFunc:
    """`scale_per` > 0: scales (and zeros) come factored, an int8 a group times a float32 a run of
    `scale_per` groups (layouts.py `factored_*`; GGUF K-quants: d * sc), else as they are.
    `experts` > 0: the mixture-of-experts form (module docstring); it takes `order` and `offsets`
    after `which`, and its rows are slots (top_k a token)."""
    tile = int_dot_tile(n, spec, isa)
    assert tile is not None, (n, spec, isa)
    lanes, width = isa.lanes, isa.bytes
    vectors = tile // lanes
    group = spec.group_size
    groups = k // group
    block = activation_block(group)
    assert block is not None
    blocks = k // block
    per_group = group // block
    plane = plane or weight_plane(spec)
    assert plane is not None
    nibbles = plane.nibbles
    steps = k // (8 if nibbles else 4)  # rows of weight bytes: 8 k values a nibble row, 4 a byte row
    high_pairs = plane.pairs_a_high_row
    high_shift = plane.bits - 4  # bits above the nibble
    high_mask = T.broadcast(T.uint8((1 << high_shift) - 1 if nibbles else 0), width)
    block_pairs = block // 8
    strips = n // tile
    stored = DTYPE_NAMES[spec.scale_dtype]
    scheme = {"symmetric": 0, "min": 1, "zero_point": 2}[spec.scheme]
    # the dot is of u = q + offset: subtract offset * sum(xq), except where AVX2 takes int8 signed
    # word dots: int16 activations times the weights widened to int16, two accumulators a vector
    # (columns 0-3 and 4-7, each column's lanes a pair), so as many registers as two int8 halves
    words = isa.word_dot and activation_bits == 16 and not nibbles
    offset = plane.offset if nibbles or isa.unsigned_int8 or words else 0
    halves = 1 if words else activation_bits // 8  # int16 activations v = 255 * high + low, two int8 dots
    levels = {8: 127, 16: 255 * 127}[activation_bits]  # |high|, |low| <= 127 (vpsignb negates them)
    # AVX2, nibble planes: vpmaddubsw's int16 lanes hold the sums of `short_pairs` rows of 8 k (a whole
    # block for 4-bit values, half of one for 5-bit), so they widen to int32 that often, not every 8 k
    short_pairs = _short_pairs(block_pairs, plane) if isa.name == "avx2" and nibbles else 1
    short_sums = short_pairs > 1
    accumulators = 2 if words else halves  # int32 vectors a row and vector of columns
    row_block = 4 // accumulators  # rows a strip pass keeps in registers: row_block x vectors x 2
    xq_dtype = "int16" if words else "int8"
    # many rows: one vector of columns at a time, so that a weight vector unpacked once feeds
    # `narrow_rows` rows (as many accumulators as a full-width pass)
    narrow_rows = row_block * vectors
    dot_pair = _dot_pair(isa, nibbles)
    nibble = T.broadcast(T.uint8(15), width)
    four = T.broadcast(T.uint8(4), width)

    factored = scale_per > 0
    weight_strips = strips * max(experts, 1)
    super_shape = (weight_strips, groups // scale_per, tile) if factored else (weight_strips, groups, tile)
    sub_dtype = "int8" if factored else stored
    super_dtype = "float32" if factored else stored

    def scale_of(sub: Any, above: Any, jo: Expr, g: Expr, lane: Expr) -> Expr:  # group g's float32
        if factored:
            return above[jo, g // scale_per, lane] * T.Cast("float32", sub[jo, g, lane])
        return T.Cast("float32", sub[jo, g, lane])

    def x4(xq: Any, half: int, row: Expr, index: Expr) -> Expr:  # xq[half, row, 4 index : 4 index + 4]
        return T.reinterpret(xq.vload([half, row, index * 4], "int8x4"), dtype="int32")

    def word_weights(w: Any, wj: Expr, pair: Expr, column_byte: Expr, half: int) -> Expr:
        """Words: 4 columns' weights u = q + 128 from `column_byte`, k 8 pair + 4 half + 0..3 each."""
        row_bytes = w.vload([wj, pair * 2 + half, column_byte], "int8x16")
        return T.Cast("int16x16", T.reinterpret(row_bytes, dtype="uint8x16"))

    def x_words(xq: Any, row: Expr, index: Expr) -> Expr:  # xq[0, row, 4 index : 4 index + 4] x 4
        four_words = T.reinterpret(xq.vload([0, row, index * 4], "int16x4"), dtype="int64")
        return T.reinterpret(T.broadcast(four_words, 4), dtype="int16x16")

    def in_row(rows_in: Any, row0: Expr, r: Expr) -> Expr:  # the activation row of pass row r
        return rows_in[r] if experts else row0 + r

    def out_row(rows_out: Any, row0: Expr, r: Expr) -> Expr:
        return rows_out[r] if experts else row0 + r

    def input_of(slot: Expr) -> Expr:  # experts: a slot's activation row
        return slot if slot_input else slot // top_k

    def block_index(g: Expr, bi: Expr) -> Expr:  # activation block bi of group g
        return g * per_group + bi

    def pair_of(g: Expr, bi: Expr, p: Expr) -> Expr:  # the row of 8 k values (a nibble row)
        return block_index(g, bi) * block_pairs + p

    @T.macro
    def dot_step(dots, half, row0, count, nv, pair, xq, low, high, rows_in):
        # dots[r, v] += the 8 k of `pair`, activation half `half`, rows row0.., nv vectors
        for r in T.unroll(count):
            for v in T.unroll(nv):
                dots[r, T.ramp(v * lanes, 1, lanes)] = dot_pair(
                    dots.vload([r, v * lanes], f"int32x{lanes}"),
                    low.vload([v, 0], f"uint8x{width}"),
                    x4(xq, half, in_row(rows_in, row0, r), pair * 2),
                    high.vload([v, 0], f"uint8x{width}"),
                    x4(xq, half, in_row(rows_in, row0, r), pair * 2 + 1),
                )

    @T.macro
    def short_step(sums, half, row0, count, nv, pair, xq, low, high, rows_in):
        # sums[r, v] (int16 lanes, two a column) += the 8 k of `pair`, activation half `half`
        for r in T.unroll(count):
            for v in T.unroll(nv):
                sums[r, T.ramp(v * 16, 1, 16)] = (
                    sums.vload([r, v * 16], "int16x16")
                    + _byte_products(
                        low.vload([v, 0], f"uint8x{width}"),
                        _in_every_lane(x4(xq, half, in_row(rows_in, row0, r), pair * 2), isa),
                    )
                    + _byte_products(
                        high.vload([v, 0], f"uint8x{width}"),
                        _in_every_lane(x4(xq, half, in_row(rows_in, row0, r), pair * 2 + 1), isa),
                    )
                )

    def word_dots(xq: Any, row: Expr, pair: Expr, low: Any, high: Any, half: Expr) -> Expr:
        # words: low[half] holds k 8 pair + 0..3 of 4 columns, high k + 4..7; lane pairs a column
        return _word_products(low.vload([half, 0], "int16x16"), x_words(xq, row, pair * 2)) + _word_products(
            high.vload([half, 0], "int16x16"), x_words(xq, row, pair * 2 + 1)
        )

    @T.macro
    def word_dot_step(dots, dots_high, row0, count, nv, pair, xq, low, high, rows_in):
        # dots: columns 0-3 of each vector v (words low[2 v], high[2 v]), dots_high: 4-7 (2 v + 1)
        for r in T.unroll(count):
            for v in T.unroll(nv):
                dots[r, T.ramp(v * lanes, 1, lanes)] = dots.vload(
                    [r, v * lanes], f"int32x{lanes}"
                ) + word_dots(xq, in_row(rows_in, row0, r), pair, low, high, v * 2)
                dots_high[r, T.ramp(v * lanes, 1, lanes)] = dots_high.vload(
                    [r, v * lanes], f"int32x{lanes}"
                ) + word_dots(xq, in_row(rows_in, row0, r), pair, low, high, v * 2 + 1)

    @T.macro
    def rows_of_strip(jo, wj, row0, count, v0, nv, buffers):
        w, w_high, xq, x_scales, xq_sums, x_sums, scales, scales_super, zeros, zeros_super = buffers[:10]
        bias, y_rows, order, acc, part, dots, dots_low, low, high, rows_in, rows_out = buffers[10:21]
        low_words, high_words, short, short_low = buffers[21:]
        # `count` rows from row0 by `nv` vectors of columns from vector v0, strip jo (weights: strip wj);
        # experts: row0 is a position in `order`
        if experts > 0:
            for r in T.unroll(count):
                rows_out[r] = order[row0 + r]
                rows_in[r] = input_of(order[row0 + r])
        for r in T.unroll(count):
            for lane in T.vectorized(nv * lanes):
                acc[r, lane] = T.float32(0)
        for g in T.serial(groups):
            if per_group > 1:
                for r in T.unroll(count):
                    for lane in T.vectorized(nv * lanes):
                        part[r, lane] = T.float32(0)
            for bi in T.serial(per_group):
                for r in T.unroll(count):
                    for lane in T.vectorized(nv * lanes):
                        dots[r, lane] = 0
                        if accumulators == 2:
                            dots_low[r, lane] = 0
                for p in T.unroll(block_pairs):  # 8 k values: one nibble row of bytes, two byte rows
                    if short_sums and p % short_pairs == 0:
                        for r in T.unroll(count):
                            for lane in T.vectorized(nv * 16):
                                short[r, lane] = T.int16(0)
                                if halves == 2:
                                    short_low[r, lane] = T.int16(0)
                    for v in T.unroll(nv):
                        if words:
                            for h in T.unroll(2):
                                low_words[v * 2 + h, T.ramp(0, 1, 16)] = word_weights(
                                    w, wj, pair_of(g, bi, p), (v0 + v) * width + h * 16, 0
                                )
                                high_words[v * 2 + h, T.ramp(0, 1, 16)] = word_weights(
                                    w, wj, pair_of(g, bi, p), (v0 + v) * width + h * 16, 1
                                )
                        elif nibbles and high_shift > 0:
                            low[v, T.ramp(0, 1, width)] = (
                                w.vload([wj, pair_of(g, bi, p), (v0 + v) * width], f"uint8x{width}") & nibble
                            ) | (
                                (
                                    w_high.vload(
                                        [wj, pair_of(g, bi, p) // high_pairs, (v0 + v) * width],
                                        f"uint8x{width}",
                                    )
                                    >> T.broadcast(T.uint8(high_shift * 2 * (p % high_pairs)), width)
                                )
                                & high_mask
                            ) << four
                            high[v, T.ramp(0, 1, width)] = (
                                w.vload([wj, pair_of(g, bi, p), (v0 + v) * width], f"uint8x{width}") >> four
                            ) | (
                                (
                                    w_high.vload(
                                        [wj, pair_of(g, bi, p) // high_pairs, (v0 + v) * width],
                                        f"uint8x{width}",
                                    )
                                    >> T.broadcast(T.uint8(high_shift * (2 * (p % high_pairs) + 1)), width)
                                )
                                & high_mask
                            ) << four
                        elif nibbles:
                            low[v, T.ramp(0, 1, width)] = (
                                w.vload([wj, pair_of(g, bi, p), (v0 + v) * width], f"uint8x{width}") & nibble
                            )
                            high[v, T.ramp(0, 1, width)] = (
                                w.vload([wj, pair_of(g, bi, p), (v0 + v) * width], f"uint8x{width}") >> four
                            ) & nibble
                        else:
                            low[v, T.ramp(0, 1, width)] = T.reinterpret(
                                w.vload([wj, pair_of(g, bi, p) * 2, (v0 + v) * width], f"int8x{width}"),
                                dtype=f"uint8x{width}",
                            )
                            high[v, T.ramp(0, 1, width)] = T.reinterpret(
                                w.vload([wj, pair_of(g, bi, p) * 2 + 1, (v0 + v) * width], f"int8x{width}"),
                                dtype=f"uint8x{width}",
                            )
                    if words:
                        pair = pair_of(g, bi, p)
                        word_dot_step(
                            dots, dots_low, row0, count, nv, pair, xq, low_words, high_words, rows_in
                        )
                    elif short_sums:
                        short_step(short, 0, row0, count, nv, pair_of(g, bi, p), xq, low, high, rows_in)
                        if halves == 2:
                            short_step(
                                short_low, 1, row0, count, nv, pair_of(g, bi, p), xq, low, high, rows_in
                            )
                    else:
                        dot_step(dots, 0, row0, count, nv, pair_of(g, bi, p), xq, low, high, rows_in)
                        if halves == 2:
                            dot_step(dots_low, 1, row0, count, nv, pair_of(g, bi, p), xq, low, high, rows_in)
                    if short_sums and p % short_pairs == short_pairs - 1:
                        for r in T.unroll(count):
                            for v in T.unroll(nv):
                                if halves == 2:  # 255 * high + low, the sums' bound times 255 fits int32
                                    dots[r, T.ramp(v * lanes, 1, lanes)] = (
                                        dots.vload([r, v * lanes], f"int32x{lanes}")
                                        + _widen(short.vload([r, v * 16], "int16x16"), 255)
                                        + _widen(short_low.vload([r, v * 16], "int16x16"))
                                    )
                                else:
                                    dots[r, T.ramp(v * lanes, 1, lanes)] = dots.vload(
                                        [r, v * lanes], f"int32x{lanes}"
                                    ) + _widen(short.vload([r, v * 16], "int16x16"))
                if words:
                    for r in T.unroll(count):
                        for v in T.unroll(nv):
                            dots[r, T.ramp(v * lanes, 1, lanes)] = _word_columns(
                                dots.vload([r, v * lanes], f"int32x{lanes}"),
                                dots_low.vload([r, v * lanes], f"int32x{lanes}"),
                            )
                for r in T.unroll(count):
                    for lane in T.vectorized(nv * lanes):
                        if halves == 2 and not short_sums:
                            dots[r, lane] = dots[r, lane] * 255 + dots_low[r, lane]
                        if offset != 0:
                            dots[r, lane] = (
                                dots[r, lane] - offset * xq_sums[in_row(rows_in, row0, r), block_index(g, bi)]
                            )
                        if per_group == 1:
                            part[r, lane] = x_scales[in_row(rows_in, row0, r), block_index(g, bi)] * T.Cast(
                                "float32", dots[r, lane]
                            )
                        else:
                            part[r, lane] = part[r, lane] + x_scales[
                                in_row(rows_in, row0, r), block_index(g, bi)
                            ] * T.Cast("float32", dots[r, lane])
            for r in T.unroll(count):
                for lane in T.vectorized(nv * lanes):
                    if scheme == 0:
                        acc[r, lane] = (
                            acc[r, lane]
                            + scale_of(scales, scales_super, wj, g, v0 * lanes + lane) * part[r, lane]
                        )
                    elif scheme == 1:
                        acc[r, lane] = (
                            acc[r, lane]
                            + scale_of(scales, scales_super, wj, g, v0 * lanes + lane) * part[r, lane]
                            + scale_of(zeros, zeros_super, wj, g, v0 * lanes + lane)
                            * x_sums[in_row(rows_in, row0, r), g]
                        )
                    else:
                        acc[r, lane] = acc[r, lane] + scale_of(
                            scales, scales_super, wj, g, v0 * lanes + lane
                        ) * (
                            part[r, lane]
                            - scale_of(zeros, zeros_super, wj, g, v0 * lanes + lane)
                            * x_sums[in_row(rows_in, row0, r), g]
                        )
        for r in T.unroll(count):
            for lane in T.vectorized(nv * lanes):
                if has_bias:
                    y_rows[out_row(rows_out, row0, r), jo * tile + v0 * lanes + lane] = (
                        acc[r, lane] + bias[jo * tile + v0 * lanes + lane]
                    )
                else:
                    y_rows[out_row(rows_out, row0, r), jo * tile + v0 * lanes + lane] = acc[r, lane]

    @T.macro
    def quantize_rows(x, rows, xq, x_scales, xq_sums, x_sums):
        for row in T.parallel(rows):
            with T.sblock("quantize"):
                T.reads()
                T.writes()
                amax = T.sblock_alloc_buffer((1,), "float32")
                total = T.sblock_alloc_buffer((1,), "int32")
                value = T.sblock_alloc_buffer((1,), "int32")
                for b in T.serial(blocks):
                    amax[0] = T.float32(0)
                    for i in T.serial(block):
                        amax[0] = T.max(amax[0], T.fabs(x[row, b * block + i]))
                    x_scales[row, b] = amax[0] / T.float32(levels)
                    total[0] = 0
                    for i in T.serial(block):
                        value[0] = T.Cast(
                            "int32",
                            T.round(
                                x[row, b * block + i]
                                * T.if_then_else(
                                    amax[0] > T.float32(0), T.float32(levels) / amax[0], T.float32(0)
                                )
                            ),
                        )
                        total[0] = total[0] + value[0]
                        if halves == 2:
                            xq[0, row, b * block + i] = T.Cast("int8", T.floordiv(value[0] + 127, 255))
                            xq[1, row, b * block + i] = T.Cast(
                                "int8", value[0] - 255 * T.floordiv(value[0] + 127, 255)
                            )
                        else:
                            xq[0, row, b * block + i] = T.Cast(xq_dtype, value[0])
                    xq_sums[row, b] = total[0]
                if scheme != 0:
                    for g in T.serial(groups):
                        x_sums[row, g] = T.float32(0)
                        for i in T.serial(group):
                            x_sums[row, g] = x_sums[row, g] + x[row, g * group + i]

    def words_shape(vectors: int) -> tuple[int, int]:  # weights as words: 2 x 4 columns a vector
        return (vectors * 2, 16) if words else (1, 16)

    def short_shape(rows: int, vectors: int) -> tuple[int, int]:  # int16 sums: 16 lanes a vector
        return (rows, vectors * 16) if short_sums else (1, 16)

    @T.macro
    def strip_passes(jo, wj, base, rows, operands):
        # scratch in the default scope, each under 1 KiB: TVM keeps those on the stack (so in
        # registers after LLVM's SROA); it sends "local" ones to the heap workspace
        wide = (  # accumulators and unpacked weights of a pass over the whole strip; experts' rows
            T.sblock_alloc_buffer((row_block, tile), "float32"),
            T.sblock_alloc_buffer((row_block, tile), "float32"),
            T.sblock_alloc_buffer((row_block, tile), "int32"),
            T.sblock_alloc_buffer((row_block, tile), "int32"),
            T.sblock_alloc_buffer((vectors, width), "uint8"),
            T.sblock_alloc_buffer((vectors, width), "uint8"),
            T.sblock_alloc_buffer((row_block,), "int32"),
            T.sblock_alloc_buffer((row_block,), "int32"),
            T.sblock_alloc_buffer(words_shape(vectors), "int16"),
            T.sblock_alloc_buffer(words_shape(vectors), "int16"),
            T.sblock_alloc_buffer(short_shape(row_block, vectors), "int16"),
            T.sblock_alloc_buffer(short_shape(row_block, vectors), "int16"),
        )
        narrow = (  # ... of a pass over one vector of columns
            T.sblock_alloc_buffer((narrow_rows, lanes), "float32"),
            T.sblock_alloc_buffer((narrow_rows, lanes), "float32"),
            T.sblock_alloc_buffer((narrow_rows, lanes), "int32"),
            T.sblock_alloc_buffer((narrow_rows, lanes), "int32"),
            T.sblock_alloc_buffer((1, width), "uint8"),
            T.sblock_alloc_buffer((1, width), "uint8"),
            T.sblock_alloc_buffer((narrow_rows,), "int32"),
            T.sblock_alloc_buffer((narrow_rows,), "int32"),
            T.sblock_alloc_buffer(words_shape(1), "int16"),
            T.sblock_alloc_buffer(words_shape(1), "int16"),
            T.sblock_alloc_buffer(short_shape(narrow_rows, 1), "int16"),
            T.sblock_alloc_buffer(short_shape(narrow_rows, 1), "int16"),
        )
        for a in T.serial(rows // narrow_rows):
            for vector in T.serial(vectors):
                rows_of_strip(jo, wj, base + a * narrow_rows, narrow_rows, vector, 1, operands + narrow)
        for a in T.serial(rows % narrow_rows // row_block):
            rows_of_strip(
                jo,
                wj,
                base + rows - rows % narrow_rows + a * row_block,
                row_block,
                0,
                vectors,
                operands + wide,
            )
        for r in T.serial(rows % row_block):
            rows_of_strip(jo, wj, base + rows - rows % row_block + r, 1, 0, vectors, operands + wide)

    weight_dtype = "uint8" if nibbles else "int8"

    @T.prim_func(s_tir=True)
    def int_dot_gemm(
        x_handle: T.handle,
        w_handle: T.handle,
        high_handle: T.handle,
        s_handle: T.handle,
        s_super_handle: T.handle,
        z_handle: T.handle,
        z_super_handle: T.handle,
        bias_handle: T.handle,
        counts_handle: T.handle,
        which: T.int64,
        y_handle: T.handle,
    ):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        q = T.int64()
        bias_len = T.int64()  # n with a bias; 1 (never read) without
        x3 = T.match_buffer(x_handle, (q, 4, k), "float32")
        w = T.match_buffer(w_handle, (strips, steps, tile * 4), weight_dtype)
        w_high = T.match_buffer(  # plane 5 and 6: the bits above the nibbles (else w again, unread)
            high_handle, (strips, steps // high_pairs, tile * 4), weight_dtype
        )
        scales = T.match_buffer(s_handle, (strips, groups, tile), sub_dtype)
        zeros = T.match_buffer(z_handle, (strips, groups, tile), sub_dtype)
        scales_super = T.match_buffer(  # factored: the float32 a run of groups (else scales again, unread)
            s_super_handle, super_shape, super_dtype
        )
        zeros_super = T.match_buffer(z_super_handle, super_shape, super_dtype)
        bias = T.match_buffer(bias_handle, (bias_len,), "float32")
        counts = T.match_buffer(counts_handle, (2,), "int64")  # real token rows, real logits rows
        y = T.match_buffer(y_handle, (q, 4, n), "float32")
        x = T.decl_buffer((q * 4, k), "float32", data=x3.data)
        y_rows = T.decl_buffer((q * 4, n), "float32", data=y.data)
        xq = T.sblock_alloc_buffer((halves, q * 4, k), xq_dtype)
        x_scales = T.sblock_alloc_buffer((q * 4, blocks), "float32")
        xq_sums = T.sblock_alloc_buffer((q * 4, blocks), "int32")
        x_sums = T.sblock_alloc_buffer((q * 4, groups), "float32")
        rows = T.min(counts[which], q * 4)
        quantize_rows(x, rows, xq, x_scales, xq_sums, x_sums)
        for jo in T.parallel(strips):
            with T.sblock("strip"):
                T.reads()
                T.writes()
                operands = (
                    w,
                    w_high,
                    xq,
                    x_scales,
                    xq_sums,
                    x_sums,
                    scales,
                    scales_super,
                    zeros,
                    zeros_super,
                    bias,
                    y_rows,
                    counts,  # `order` in the experts' form, unread here
                )
                strip_passes(jo, jo, 0, rows, operands)

    @T.prim_func(s_tir=True)
    def int_dot_experts(
        x_handle: T.handle,
        w_handle: T.handle,
        high_handle: T.handle,
        s_handle: T.handle,
        s_super_handle: T.handle,
        z_handle: T.handle,
        z_super_handle: T.handle,
        counts_handle: T.handle,
        which: T.int64,
        order_handle: T.handle,
        offsets_handle: T.handle,
        y_handle: T.handle,
    ):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        q = T.int64()  # blocks of 4 input rows: tokens, or slots with `slot_input`
        qs = T.int64()  # blocks of 4 slots
        x3 = T.match_buffer(x_handle, (q, 4, k), "float32")
        w = T.match_buffer(w_handle, (weight_strips, steps, tile * 4), weight_dtype)
        w_high = T.match_buffer(high_handle, (weight_strips, steps // high_pairs, tile * 4), weight_dtype)
        scales = T.match_buffer(s_handle, (weight_strips, groups, tile), sub_dtype)
        zeros = T.match_buffer(z_handle, (weight_strips, groups, tile), sub_dtype)
        scales_super = T.match_buffer(s_super_handle, super_shape, super_dtype)
        zeros_super = T.match_buffer(z_super_handle, super_shape, super_dtype)
        counts = T.match_buffer(counts_handle, (2,), "int64")
        order = T.match_buffer(order_handle, (qs * 4,), "int32")
        offsets = T.match_buffer(offsets_handle, (max(experts, 1) + 1,), "int32")
        y = T.match_buffer(y_handle, (qs, 4, n), "float32")
        x = T.decl_buffer((q * 4, k), "float32", data=x3.data)
        y_rows = T.decl_buffer((qs * 4, n), "float32", data=y.data)
        xq = T.sblock_alloc_buffer((halves, q * 4, k), xq_dtype)
        x_scales = T.sblock_alloc_buffer((q * 4, blocks), "float32")
        xq_sums = T.sblock_alloc_buffer((q * 4, blocks), "int32")
        x_sums = T.sblock_alloc_buffer((q * 4, groups), "float32")
        rows = T.min(counts[which] * (top_k if slot_input else 1), q * 4)
        quantize_rows(x, rows, xq, x_scales, xq_sums, x_sums)
        for jo in T.parallel(strips):
            with T.sblock("strip"):
                T.reads()
                T.writes()
                operands = (
                    w,
                    w_high,
                    xq,
                    x_scales,
                    xq_sums,
                    x_sums,
                    scales,
                    scales_super,
                    zeros,
                    zeros_super,
                    counts,  # no bias: unread
                    y_rows,
                    order,
                )
                for e in T.serial(experts):
                    strip_passes(jo, e * strips + jo, offsets[e], offsets[e + 1] - offsets[e], operands)

    return int_dot_experts if experts else int_dot_gemm
