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

    amx      tdpbsud tiles     16 rows x 16 columns x a block of k (AMX-INT8), rows 16 at a time;
                               the other rows as vnni512 ("AMX (Isa.tiles)" below)
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
from tvm.tirx import Buffer

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
    tiles: bool = False  # AMX: blocks of 16 rows through tile registers (tdpbsud), the rest as vnni512

    @property
    def bytes(self) -> int:
        return self.lanes * 4


ISAS = {
    "amx": Isa("amx", 16, 4, True, tiles=True),  # AMX-INT8 beside AVX-512 VNNI (Sapphire Rapids on)
    "vnni512": Isa("vnni512", 16, 4, True),  # 32 zmm registers
    "vnni256": Isa("vnni256", 8, 2, True),  # 16 ymm registers
    "avx2": Isa("avx2", 8, 2, False, word_dot=True),
    "neon_dot": Isa("neon_dot", 4, 4, False),  # 32 q registers; sdot is signed x signed
    "neon_i8mm": Isa("neon_i8mm", 4, 4, True),  # usdot: unsigned x signed, as VNNI
}


def choose_isa(features: set[str]) -> Isa | None:
    """The variant for an LLVM target's features (`llvm_get_cpu_features` names), None for none."""
    if {"amx-tile", "amx-int8", "avx512vnni", "avx512bw", "avx512f"} <= features:
        return ISAS["amx"]
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

    if isa.name in ("amx", "vnni512", "vnni256"):
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


@dataclass(frozen=True)
class IntDotPlan:
    """One int-dot kernel's design, fixed at compile time (module docstring): the strips and the row
    passes over them (tile choice), the activations' blocks, the weight plane (load), the dot
    instructions (inner product) and the scales' form (epilogue)."""

    k: int
    n: int
    spec: QuantSpec
    has_bias: bool
    isa: Isa
    plane: Plane
    tile: int  # columns a strip
    activation_bits: int = 16
    scale_per: int = 0  # > 0: factored scales, an int8 a group times a float16 a run of this many groups
    experts: int = 0  # > 0: the mixture-of-experts form; its rows are slots, top_k a token
    top_k: int = 1
    slot_input: bool = False  # experts: a slot's input row is the slot itself, not its token

    @classmethod
    def choose(
        cls,
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
    ) -> IntDotPlan:
        tile = int_dot_tile(n, spec, isa)
        assert tile is not None, (n, spec, isa)
        assert activation_block(spec.group_size) is not None
        plane = plane or weight_plane(spec)
        assert plane is not None
        return cls(
            k, n, spec, has_bias, isa, plane, tile, activation_bits, scale_per, experts, top_k, slot_input
        )

    # Tile choice: strips of `tile` columns in parallel, passes of rows over each.

    @property
    def lanes(self) -> int:  # int32 columns a vector
        return self.isa.lanes

    @property
    def width(self) -> int:  # bytes a weight vector
        return self.isa.bytes

    @property
    def vectors(self) -> int:  # vectors of columns a strip
        return self.tile // self.lanes

    @property
    def tiles(self) -> bool:  # AMX passes: strips of an even number of vectors (tile_vectors a pass)
        return self.isa.tiles and self.vectors % self.tile_vectors == 0

    @property
    def tile_vectors(self) -> int:  # AMX: vectors of columns a pass of tiles (a C tile and B tile each)
        return 2

    @property
    def strips(self) -> int:
        return self.n // self.tile

    @property
    def weight_strips(self) -> int:  # experts: every expert's strips, stacked
        return self.strips * max(self.experts, 1)

    @property
    def row_block(self) -> int:  # rows a pass over the whole strip keeps in registers (x vectors x 2)
        return 4 // self.accumulators

    @property
    def narrow_rows(self) -> int:
        """Rows of a pass over one vector of columns (many rows): a weight vector unpacked once feeds
        them all, with as many accumulators as a pass over the whole strip."""
        return self.row_block * self.vectors

    # Activations: quantized a block of `block` values at a time, `halves` int8 dots (or one of words).

    @property
    def group(self) -> int:
        return self.spec.group_size

    @property
    def groups(self) -> int:
        return self.k // self.group

    @property
    def block(self) -> int:
        block = activation_block(self.group)
        assert block is not None
        return block

    @property
    def blocks(self) -> int:
        return self.k // self.block

    @property
    def per_group(self) -> int:  # activation blocks a weight group
        return self.group // self.block

    @property
    def block_pairs(self) -> int:  # rows of 8 k a block
        return self.block // 8

    @property
    def words(self) -> bool:
        """AVX2, int8 weights, 16-bit activations: int16 activations times the weights widened to int16,
        two accumulators a vector (columns 0-3 and 4-7, a lane pair a column), as many registers as two
        int8 halves."""
        return self.isa.word_dot and self.activation_bits == 16 and not self.nibbles

    @property
    def halves(self) -> int:  # int16 activations v = 255 * high + low: two int8 dots
        return 1 if self.words else self.activation_bits // 8

    @property
    def levels(self) -> int:  # |high|, |low| <= 127 (vpsignb negates them)
        return {8: 127, 16: 255 * 127}[self.activation_bits]

    @property
    def xq_dtype(self) -> str:
        return "int16" if self.words else "int8"

    # Load: the weights as unsigned bytes u = q + offset, nibbles (8 k a row of bytes) or bytes (4 k).

    @property
    def nibbles(self) -> bool:
        return self.plane.nibbles

    @property
    def weight_dtype(self) -> str:
        return "uint8" if self.nibbles else "int8"

    @property
    def steps(self) -> int:  # rows of weight bytes
        return self.k // (8 if self.nibbles else 4)

    @property
    def high_pairs(self) -> int:
        return self.plane.pairs_a_high_row

    @property
    def high_shift(self) -> int:  # bits above the nibble
        return self.plane.bits - 4

    @property
    def offset(self) -> int:
        """The dot is of u = q + offset: it subtracts offset * sum(xq), except where AVX2 takes int8
        weights signed."""
        return self.plane.offset if self.nibbles or self.isa.unsigned_int8 or self.words else 0

    # Inner product: `dot_pair` every 8 k, or AVX2 nibble planes' int16 sums of `short_pairs` rows of 8 k.

    @property
    def dot_pair(self) -> DotPair:
        return _dot_pair(self.isa, self.nibbles)

    @property
    def short_pairs(self) -> int:
        """AVX2, nibble planes: vpmaddubsw's int16 lanes hold the sums of this many rows of 8 k (a whole
        block for 4-bit values, half of one for 5-bit), so they widen to int32 that often, not every 8 k."""
        return _short_pairs(self.block_pairs, self.plane) if self.isa.name == "avx2" and self.nibbles else 1

    @property
    def short_sums(self) -> bool:
        return self.short_pairs > 1

    @property
    def accumulators(self) -> int:  # int32 vectors a row and vector of columns
        return 2 if self.words else self.halves

    # Epilogue: the float32 sums times the weight groups' scales, and zeros or mins.

    @property
    def factored(self) -> bool:
        return self.scale_per > 0

    @property
    def sub_dtype(self) -> str:  # of the scales a group (factored: their int8 factors)
        return "int8" if self.factored else DTYPE_NAMES[self.spec.scale_dtype]

    @property
    def super_dtype(self) -> str:  # of the float16 a run of groups (else the scales again, unread)
        return "float16" if self.factored else DTYPE_NAMES[self.spec.scale_dtype]

    @property
    def super_shape(self) -> tuple[int, int, int]:
        runs = self.groups // self.scale_per if self.factored else self.groups
        return (self.weight_strips, runs, self.tile)


# The TIR macros below are module-level: each captures the module's globals defined above it when it
# is defined, so helpers come before the macros that use them.


# Rows and blocks: where a pass row's activations and outputs are, which activation block and row of
# 8 k.


def _in_row(plan: IntDotPlan, rows_in: Buffer, row0: Expr, r: Expr) -> Expr:  # pass row r's activations
    return rows_in[r] if plan.experts else row0 + r


def _out_row(plan: IntDotPlan, rows_out: Buffer, row0: Expr, r: Expr) -> Expr:
    return rows_out[r] if plan.experts else row0 + r


def _input_of(plan: IntDotPlan, slot: Expr) -> Expr:  # experts: a slot's activation row
    return slot if plan.slot_input else slot // plan.top_k


def _block_index(plan: IntDotPlan, g: Expr, bi: Expr) -> Expr:  # activation block bi of group g
    return g * plan.per_group + bi


def _pair_of(plan: IntDotPlan, g: Expr, bi: Expr, p: Expr) -> Expr:  # the row of 8 k values (a nibble row)
    return _block_index(plan, g, bi) * plan.block_pairs + p


# Activations: each row quantized once per call, before the strips.


@T.macro
def _quantize_row(
    plan: IntDotPlan, x: Buffer, row: Expr, xq: Buffer, x_scales: Buffer, xq_sums: Buffer, x_sums: Buffer
):
    # activation row `row` in int8 (or int16) blocks with a scale each, the blocks' sums of xq and
    # (zeros, mins) the groups' sums of x
    amax = T.sblock_alloc_buffer((1,), "float32")
    total = T.sblock_alloc_buffer((1,), "int32")
    value = T.sblock_alloc_buffer((1,), "int32")
    for b in T.serial(plan.blocks):
        amax[0] = T.float32(0)
        for i in T.serial(plan.block):
            amax[0] = T.max(amax[0], T.fabs(x[row, b * plan.block + i]))
        x_scales[row, b] = amax[0] / T.float32(plan.levels)
        total[0] = 0
        for i in T.serial(plan.block):
            value[0] = T.Cast(
                "int32",
                T.round(
                    x[row, b * plan.block + i]
                    * T.if_then_else(amax[0] > T.float32(0), T.float32(plan.levels) / amax[0], T.float32(0))
                ),
            )
            total[0] = total[0] + value[0]
            if plan.halves == 2:
                xq[0, row, b * plan.block + i] = T.Cast("int8", T.floordiv(value[0] + 127, 255))
                xq[1, row, b * plan.block + i] = T.Cast(
                    "int8", value[0] - 255 * T.floordiv(value[0] + 127, 255)
                )
            else:
                xq[0, row, b * plan.block + i] = T.Cast(plan.xq_dtype, value[0])
        xq_sums[row, b] = total[0]
    if plan.spec.scheme != "symmetric":
        for g in T.serial(plan.groups):
            x_sums[row, g] = T.float32(0)
            for i in T.serial(plan.group):
                x_sums[row, g] = x_sums[row, g] + x[row, g * plan.group + i]


# Load: a row of 8 k of the strip's weights, unpacked to unsigned bytes (or int16 words).


def _every_byte(plan: IntDotPlan, value: int) -> Expr:
    return T.broadcast(T.uint8(value), plan.width)


def _high_mask(plan: IntDotPlan) -> Expr:  # the bits above the nibble, in place
    return _every_byte(plan, (1 << plan.high_shift) - 1 if plan.nibbles else 0)


def _weight_row(plan: IntDotPlan, w: Buffer, wj: Expr, row: Expr, vector: Expr, dtype: str = "uint8") -> Expr:
    """Weight strip wj's bytes of `row`, vector of columns `vector`."""
    return w.vload([wj, row, vector * plan.width], f"{dtype}x{plan.width}")


def _high_bits(plan: IntDotPlan, w_high: Buffer, wj: Expr, pair: Expr, vector: Expr, shift: Expr) -> Expr:
    """Planes 5 and 6: the bits above the nibbles of `pair`, `shift` bits up in their row of the high
    plane, moved above the nibble."""
    high_row = _weight_row(plan, w_high, wj, pair // plan.high_pairs, vector)
    return ((high_row >> _every_byte(plan, shift)) & _high_mask(plan)) << _every_byte(plan, 4)


def _word_weights(w: Buffer, wj: Expr, pair: Expr, column_byte: Expr, half: int) -> Expr:
    """Words: 4 columns' weights u = q + 128 from `column_byte`, k 8 pair + 4 half + 0..3 each."""
    row_bytes = w.vload([wj, pair * 2 + half, column_byte], "int8x16")
    return T.Cast("int16x16", T.reinterpret(row_bytes, dtype="uint8x16"))


@T.macro
def _load_pair_weights(
    plan: IntDotPlan,
    w: Buffer,
    w_high: Buffer,
    wj: Expr,
    pair: Expr,
    p: Expr,
    v0: Expr,
    nv: int,
    low: Buffer,
    high: Buffer,
    low_words: Buffer,
    high_words: Buffer,
):
    # the weights of `pair` (8 k), nv vectors of columns from v0 of weight strip wj, as unsigned bytes:
    # k 0..3 in low, 4..7 in high; words: as int16, two vectors of 4 columns each
    for v in T.unroll(nv):
        if plan.words:
            for h in T.unroll(2):
                low_words[v * 2 + h, T.ramp(0, 1, 16)] = _word_weights(
                    w, wj, pair, (v0 + v) * plan.width + h * 16, 0
                )
                high_words[v * 2 + h, T.ramp(0, 1, 16)] = _word_weights(
                    w, wj, pair, (v0 + v) * plan.width + h * 16, 1
                )
        elif plan.nibbles and plan.high_shift > 0:
            low[v, T.ramp(0, 1, plan.width)] = (
                _weight_row(plan, w, wj, pair, v0 + v) & _every_byte(plan, 15)
            ) | _high_bits(plan, w_high, wj, pair, v0 + v, plan.high_shift * 2 * (p % plan.high_pairs))
            high[v, T.ramp(0, 1, plan.width)] = (
                _weight_row(plan, w, wj, pair, v0 + v) >> _every_byte(plan, 4)
            ) | _high_bits(plan, w_high, wj, pair, v0 + v, plan.high_shift * (2 * (p % plan.high_pairs) + 1))
        elif plan.nibbles:
            low[v, T.ramp(0, 1, plan.width)] = _weight_row(plan, w, wj, pair, v0 + v) & _every_byte(plan, 15)
            high[v, T.ramp(0, 1, plan.width)] = (
                _weight_row(plan, w, wj, pair, v0 + v) >> _every_byte(plan, 4)
            ) & _every_byte(plan, 15)
        else:
            low[v, T.ramp(0, 1, plan.width)] = T.reinterpret(
                _weight_row(plan, w, wj, pair * 2, v0 + v, "int8"), dtype=f"uint8x{plan.width}"
            )
            high[v, T.ramp(0, 1, plan.width)] = T.reinterpret(
                _weight_row(plan, w, wj, pair * 2 + 1, v0 + v, "int8"), dtype=f"uint8x{plan.width}"
            )


# Inner product: an activation block's int32 dots with the unpacked weights, per instruction set.


def _x4(xq: Buffer, half: int, row: Expr, index: Expr) -> Expr:  # xq[half, row, 4 index : 4 index + 4]
    return T.reinterpret(xq.vload([half, row, index * 4], "int8x4"), dtype="int32")


def _x_words(xq: Buffer, row: Expr, index: Expr) -> Expr:  # xq[0, row, 4 index : 4 index + 4] x 4
    four_words = T.reinterpret(xq.vload([0, row, index * 4], "int16x4"), dtype="int64")
    return T.reinterpret(T.broadcast(four_words, 4), dtype="int16x16")


def _word_dots(xq: Buffer, row: Expr, pair: Expr, low: Buffer, high: Buffer, half: Expr) -> Expr:
    # words: low[half] holds k 8 pair + 0..3 of 4 columns, high k + 4..7; lane pairs a column
    return _word_products(low.vload([half, 0], "int16x16"), _x_words(xq, row, pair * 2)) + _word_products(
        high.vload([half, 0], "int16x16"), _x_words(xq, row, pair * 2 + 1)
    )


@T.macro
def _dot_step(
    plan: IntDotPlan,
    dots: Buffer,
    half: int,
    row0: Expr,
    count: int,
    nv: int,
    pair: Expr,
    xq: Buffer,
    low: Buffer,
    high: Buffer,
    rows_in: Buffer,
):
    # dots[r, v] += the 8 k of `pair`, activation half `half`, rows row0.., nv vectors
    for r in T.unroll(count):
        for v in T.unroll(nv):
            dots[r, T.ramp(v * plan.lanes, 1, plan.lanes)] = plan.dot_pair(
                dots.vload([r, v * plan.lanes], f"int32x{plan.lanes}"),
                low.vload([v, 0], f"uint8x{plan.width}"),
                _x4(xq, half, _in_row(plan, rows_in, row0, r), pair * 2),
                high.vload([v, 0], f"uint8x{plan.width}"),
                _x4(xq, half, _in_row(plan, rows_in, row0, r), pair * 2 + 1),
            )


@T.macro
def _short_step(
    plan: IntDotPlan,
    sums: Buffer,
    half: int,
    row0: Expr,
    count: int,
    nv: int,
    pair: Expr,
    xq: Buffer,
    low: Buffer,
    high: Buffer,
    rows_in: Buffer,
):
    # sums[r, v] (int16 lanes, two a column) += the 8 k of `pair`, activation half `half`
    for r in T.unroll(count):
        for v in T.unroll(nv):
            sums[r, T.ramp(v * 16, 1, 16)] = (
                sums.vload([r, v * 16], "int16x16")
                + _byte_products(
                    low.vload([v, 0], f"uint8x{plan.width}"),
                    _in_every_lane(_x4(xq, half, _in_row(plan, rows_in, row0, r), pair * 2), plan.isa),
                )
                + _byte_products(
                    high.vload([v, 0], f"uint8x{plan.width}"),
                    _in_every_lane(_x4(xq, half, _in_row(plan, rows_in, row0, r), pair * 2 + 1), plan.isa),
                )
            )


@T.macro
def _word_dot_step(
    plan: IntDotPlan,
    dots: Buffer,
    dots_high: Buffer,
    row0: Expr,
    count: int,
    nv: int,
    pair: Expr,
    xq: Buffer,
    low: Buffer,
    high: Buffer,
    rows_in: Buffer,
):
    # dots: columns 0-3 of each vector v (words low[2 v], high[2 v]), dots_high: 4-7 (2 v + 1)
    for r in T.unroll(count):
        for v in T.unroll(nv):
            dots[r, T.ramp(v * plan.lanes, 1, plan.lanes)] = dots.vload(
                [r, v * plan.lanes], f"int32x{plan.lanes}"
            ) + _word_dots(xq, _in_row(plan, rows_in, row0, r), pair, low, high, v * 2)
            dots_high[r, T.ramp(v * plan.lanes, 1, plan.lanes)] = dots_high.vload(
                [r, v * plan.lanes], f"int32x{plan.lanes}"
            ) + _word_dots(xq, _in_row(plan, rows_in, row0, r), pair, low, high, v * 2 + 1)


@T.macro
def _widen_short_sums(plan: IntDotPlan, count: int, nv: int, dots: Buffer, short: Buffer, short_low: Buffer):
    # the int16 sums into the int32 dots
    for r in T.unroll(count):
        for v in T.unroll(nv):
            if plan.halves == 2:  # 255 * high + low, the sums' bound times 255 fits int32
                dots[r, T.ramp(v * plan.lanes, 1, plan.lanes)] = (
                    dots.vload([r, v * plan.lanes], f"int32x{plan.lanes}")
                    + _widen(short.vload([r, v * 16], "int16x16"), 255)
                    + _widen(short_low.vload([r, v * 16], "int16x16"))
                )
            else:
                dots[r, T.ramp(v * plan.lanes, 1, plan.lanes)] = dots.vload(
                    [r, v * plan.lanes], f"int32x{plan.lanes}"
                ) + _widen(short.vload([r, v * 16], "int16x16"))


@T.macro
def _block_dots(
    plan: IntDotPlan,
    wj: Expr,
    g: Expr,
    bi: Expr,
    row0: Expr,
    count: int,
    v0: Expr,
    nv: int,
    weights: tuple,
    xq: Buffer,
    rows_in: Buffer,
    registers: tuple,
):
    # dots[r, :] = the int32 dots of activation block bi of group g with the columns' weights
    w, w_high = weights
    dots, dots_low, low, high, low_words, high_words, short, short_low = registers
    for r in T.unroll(count):
        for lane in T.vectorized(nv * plan.lanes):
            dots[r, lane] = 0
            if plan.accumulators == 2:
                dots_low[r, lane] = 0
    for p in T.unroll(plan.block_pairs):  # 8 k values: one nibble row of bytes, two byte rows
        if plan.short_sums and p % plan.short_pairs == 0:
            for r in T.unroll(count):
                for lane in T.vectorized(nv * 16):
                    short[r, lane] = T.int16(0)
                    if plan.halves == 2:
                        short_low[r, lane] = T.int16(0)
        _load_pair_weights(
            plan, w, w_high, wj, _pair_of(plan, g, bi, p), p, v0, nv, low, high, low_words, high_words
        )
        if plan.words:
            pair = _pair_of(plan, g, bi, p)  # an int32 local in the TIR; the other branches inline it
            _word_dot_step(plan, dots, dots_low, row0, count, nv, pair, xq, low_words, high_words, rows_in)
        elif plan.short_sums:
            _short_step(plan, short, 0, row0, count, nv, _pair_of(plan, g, bi, p), xq, low, high, rows_in)
            if plan.halves == 2:
                _short_step(
                    plan, short_low, 1, row0, count, nv, _pair_of(plan, g, bi, p), xq, low, high, rows_in
                )
        else:
            _dot_step(plan, dots, 0, row0, count, nv, _pair_of(plan, g, bi, p), xq, low, high, rows_in)
            if plan.halves == 2:
                _dot_step(
                    plan, dots_low, 1, row0, count, nv, _pair_of(plan, g, bi, p), xq, low, high, rows_in
                )
        if plan.short_sums and p % plan.short_pairs == plan.short_pairs - 1:
            _widen_short_sums(plan, count, nv, dots, short, short_low)
    if plan.words:
        for r in T.unroll(count):
            for v in T.unroll(nv):
                dots[r, T.ramp(v * plan.lanes, 1, plan.lanes)] = _word_columns(
                    dots.vload([r, v * plan.lanes], f"int32x{plan.lanes}"),
                    dots_low.vload([r, v * plan.lanes], f"int32x{plan.lanes}"),
                )


# Epilogue: a block's dots into float32 (activation scale, offset), a group's into the row's sums
# (weight scales, zeros or mins), the sums (and bias) stored.


def _scale_of(plan: IntDotPlan, sub: Buffer, above: Buffer, wj: Expr, g: Expr, lane: Expr) -> Expr:
    """Group g's float32 scale (or zero) of column `lane` in weight strip wj."""
    if plan.factored:
        return T.Cast("float32", above[wj, g // plan.scale_per, lane]) * T.Cast("float32", sub[wj, g, lane])
    return T.Cast("float32", sub[wj, g, lane])


@T.macro
def _block_into_part(
    plan: IntDotPlan,
    g: Expr,
    bi: Expr,
    row0: Expr,
    count: int,
    nv: int,
    dots: Buffer,
    dots_low: Buffer,
    part: Buffer,
    activations: tuple,
    rows_in: Buffer,
):
    # part[r, :] (+)= the block's activation scale times its dots, less offset * sum(xq)
    x_scales, xq_sums = activations
    for r in T.unroll(count):
        for lane in T.vectorized(nv * plan.lanes):
            if plan.halves == 2 and not plan.short_sums:
                dots[r, lane] = dots[r, lane] * 255 + dots_low[r, lane]
            if plan.offset != 0:
                dots[r, lane] = (
                    dots[r, lane]
                    - plan.offset * xq_sums[_in_row(plan, rows_in, row0, r), _block_index(plan, g, bi)]
                )
            if plan.per_group == 1:
                part[r, lane] = x_scales[_in_row(plan, rows_in, row0, r), _block_index(plan, g, bi)] * T.Cast(
                    "float32", dots[r, lane]
                )
            else:
                part[r, lane] = part[r, lane] + x_scales[
                    _in_row(plan, rows_in, row0, r), _block_index(plan, g, bi)
                ] * T.Cast("float32", dots[r, lane])


@T.macro
def _group_into_acc(
    plan: IntDotPlan,
    wj: Expr,
    g: Expr,
    row0: Expr,
    count: int,
    v0: Expr,
    nv: int,
    acc: Buffer,
    part: Buffer,
    scale_buffers: tuple,
    x_sums: Buffer,
    rows_in: Buffer,
):
    # acc[r, :] += group g's scales times part (symmetric), and the min or zero times the sum of x
    scales, scales_super, zeros, zeros_super = scale_buffers
    for r in T.unroll(count):
        for lane in T.vectorized(nv * plan.lanes):
            if plan.spec.scheme == "symmetric":
                acc[r, lane] = (
                    acc[r, lane]
                    + _scale_of(plan, scales, scales_super, wj, g, v0 * plan.lanes + lane) * part[r, lane]
                )
            elif plan.spec.scheme == "min":
                acc[r, lane] = (
                    acc[r, lane]
                    + _scale_of(plan, scales, scales_super, wj, g, v0 * plan.lanes + lane) * part[r, lane]
                    + _scale_of(plan, zeros, zeros_super, wj, g, v0 * plan.lanes + lane)
                    * x_sums[_in_row(plan, rows_in, row0, r), g]
                )
            else:
                acc[r, lane] = acc[r, lane] + _scale_of(
                    plan, scales, scales_super, wj, g, v0 * plan.lanes + lane
                ) * (
                    part[r, lane]
                    - _scale_of(plan, zeros, zeros_super, wj, g, v0 * plan.lanes + lane)
                    * x_sums[_in_row(plan, rows_in, row0, r), g]
                )


@T.macro
def _store_rows(
    plan: IntDotPlan,
    jo: Expr,
    row0: Expr,
    count: int,
    v0: Expr,
    nv: int,
    acc: Buffer,
    bias: Buffer,
    y_rows: Buffer,
    rows_out: Buffer,
):
    for r in T.unroll(count):
        for lane in T.vectorized(nv * plan.lanes):
            if plan.has_bias:
                y_rows[_out_row(plan, rows_out, row0, r), jo * plan.tile + v0 * plan.lanes + lane] = (
                    acc[r, lane] + bias[jo * plan.tile + v0 * plan.lanes + lane]
                )
            else:
                y_rows[_out_row(plan, rows_out, row0, r), jo * plan.tile + v0 * plan.lanes + lane] = acc[
                    r, lane
                ]


# The kernel: a pass's rows over a strip, a strip's passes, the functions.


@T.macro
def _rows_of_strip(
    plan: IntDotPlan,
    jo: Expr,
    wj: Expr,
    row0: Expr,
    count: int,
    v0: Expr,
    nv: int,
    operands: tuple,
    scratch: tuple,
):
    # `count` rows from row0 by `nv` vectors of columns from vector v0, strip jo (weights: strip wj);
    # experts: row0 is a position in `order`. These unpackings name the buffers in the TIR.
    w, w_high, xq, x_scales, xq_sums, x_sums, scales, scales_super, zeros, zeros_super = operands[:10]
    bias, y_rows, order = operands[10:]
    acc, part, dots, dots_low, low, high, rows_in, rows_out = scratch[:8]
    low_words, high_words, short, short_low = scratch[8:]
    if plan.experts > 0:
        for r in T.unroll(count):
            rows_out[r] = order[row0 + r]
            rows_in[r] = _input_of(plan, order[row0 + r])
    for r in T.unroll(count):
        for lane in T.vectorized(nv * plan.lanes):
            acc[r, lane] = T.float32(0)
    for g in T.serial(plan.groups):
        if plan.per_group > 1:
            for r in T.unroll(count):
                for lane in T.vectorized(nv * plan.lanes):
                    part[r, lane] = T.float32(0)
        for bi in T.serial(plan.per_group):
            _block_dots(
                plan,
                wj,
                g,
                bi,
                row0,
                count,
                v0,
                nv,
                (w, w_high),
                xq,
                rows_in,
                (dots, dots_low, low, high, low_words, high_words, short, short_low),
            )
            _block_into_part(plan, g, bi, row0, count, nv, dots, dots_low, part, (x_scales, xq_sums), rows_in)
        _group_into_acc(
            plan,
            wj,
            g,
            row0,
            count,
            v0,
            nv,
            acc,
            part,
            (scales, scales_super, zeros, zeros_super),
            x_sums,
            rows_in,
        )
    _store_rows(plan, jo, row0, count, v0, nv, acc, bias, y_rows, rows_out)


def _pass_scratch(plan: IntDotPlan, rows: int, vectors: int) -> tuple[Buffer, ...]:
    """A pass's registers over `rows` rows by `vectors` vectors of columns, as _rows_of_strip unpacks
    them: accumulators and dots, unpacked weights, the experts' rows, word weights, int16 sums."""
    columns = vectors * plan.lanes
    words_shape = (vectors * 2, 16) if plan.words else (1, 16)  # weights as words: 2 x 4 columns a vector
    short_shape = (rows, vectors * 16) if plan.short_sums else (1, 16)  # int16 sums: 16 lanes a vector
    return (
        T.sblock_alloc_buffer((rows, columns), "float32"),
        T.sblock_alloc_buffer((rows, columns), "float32"),
        T.sblock_alloc_buffer((rows, columns), "int32"),
        T.sblock_alloc_buffer((rows, columns), "int32"),
        T.sblock_alloc_buffer((vectors, plan.width), "uint8"),
        T.sblock_alloc_buffer((vectors, plan.width), "uint8"),
        T.sblock_alloc_buffer((rows,), "int32"),
        T.sblock_alloc_buffer((rows,), "int32"),
        T.sblock_alloc_buffer(words_shape, "int16"),
        T.sblock_alloc_buffer(words_shape, "int16"),
        T.sblock_alloc_buffer(short_shape, "int16"),
        T.sblock_alloc_buffer(short_shape, "int16"),
    )


@T.macro
def _strip_passes(plan: IntDotPlan, jo: Expr, wj: Expr, base: Expr, rows: Expr, operands: tuple):
    # rows base .. base + rows of strip jo: passes of narrow_rows over one vector of columns at a time,
    # then of row_block rows over the whole strip, then single rows. Scratch in the default scope, each
    # under 1 KiB: TVM keeps those on the stack (so in registers after LLVM's SROA); it sends "local"
    # ones to the heap workspace
    wide = _pass_scratch(plan, plan.row_block, plan.vectors)
    narrow = _pass_scratch(plan, plan.narrow_rows, 1)
    for a in T.serial(rows // plan.narrow_rows):
        for vector in T.serial(plan.vectors):
            _rows_of_strip(
                plan, jo, wj, base + a * plan.narrow_rows, plan.narrow_rows, vector, 1, operands, narrow
            )
    for a in T.serial(rows % plan.narrow_rows // plan.row_block):
        _rows_of_strip(
            plan,
            jo,
            wj,
            base + rows - rows % plan.narrow_rows + a * plan.row_block,
            plan.row_block,
            0,
            plan.vectors,
            operands,
            wide,
        )
    for r in T.serial(rows % plan.row_block):
        _rows_of_strip(
            plan, jo, wj, base + rows - rows % plan.row_block + r, 1, 0, plan.vectors, operands, wide
        )


# AMX (Isa.tiles): blocks of TILE_ROWS rows by two vectors of columns through tile registers. Per
# activation block, tdpbsud multiplies the rows' int8 activations (signed: tile A) by the unsigned weight
# bytes (tile B, the layout's rows of 4 k by 16 columns as they are) into int32 dots (tile C), one C
# per activation half and vector; the dots go to memory and through the same epilogue as the VNNI
# passes'. Nibble planes are unpacked once a strip into rows of bytes for tile B.

TILE_ROWS = 16  # rows of a C tile (and of the activations' A tile)
# tile registers: C (dots) half * 2 + vector, A (activations) 4 + half, B (weights) 6 + vector


def _tile_op(name: str, *args: Expr) -> Expr:
    return T.call_llvm_intrin("void", T.llvm_lookup_intrinsic_id(f"llvm.x86.{name}"), *args)


@T.macro
def _configure_tiles(plan: IntDotPlan, config: Buffer):
    # palette 1; C tiles 16 rows of 16 int32, A 16 rows of a block's bytes, B a block's rows of 4 k
    for i in T.serial(64):
        config[i] = T.uint8(0)
    config[0] = T.uint8(1)
    for t in T.unroll(8):
        config[16 + 2 * t] = T.if_then_else(t // 2 == 2, T.uint8(plan.block), T.uint8(64))
        config[48 + t] = T.if_then_else(t >= 6, T.uint8(plan.block // 4), T.uint8(TILE_ROWS))
    T.evaluate(_tile_op("ldtilecfg", T.address_of(config[0])))


@T.macro
def _unpack_strip(plan: IntDotPlan, w: Buffer, w_high: Buffer, wj: Expr, unpacked: Buffer, scratch: tuple):
    # nibble planes: the strip's weights as rows of 4 k of unsigned bytes, the byte plane's layout
    low, high, low_words, high_words = scratch[4], scratch[5], scratch[8], scratch[9]
    for pair in T.serial(plan.k // 8):
        _load_pair_weights(plan, w, w_high, wj, pair, pair, 0, plan.vectors, low, high, low_words, high_words)
        for v in T.unroll(plan.vectors):
            unpacked[pair * 2, T.ramp(v * plan.width, 1, plan.width)] = low.vload(
                [v, 0], f"uint8x{plan.width}"
            )
            unpacked[pair * 2 + 1, T.ramp(v * plan.width, 1, plan.width)] = high.vload(
                [v, 0], f"uint8x{plan.width}"
            )


def _weight_tile_row(
    plan: IntDotPlan, w: Buffer, unpacked: Buffer, wj: Expr, row: Expr, vector: Expr
) -> Expr:
    if plan.nibbles:
        return T.address_of(unpacked[row, vector * plan.width])
    return T.address_of(w[wj, row, vector * plan.width])


@T.macro
def _tile_block_dots(
    plan: IntDotPlan,
    wj: Expr,
    g: Expr,
    bi: Expr,
    row0: Expr,
    v0: Expr,
    w: Buffer,
    unpacked: Buffer,
    xq: Buffer,
    dots: Buffer,
    dots_low: Buffer,
):
    # dots (high half), dots_low: TILE_ROWS rows by vectors v0, v0 + 1 of activation block bi of group g
    for h in T.unroll(plan.halves):
        T.evaluate(
            _tile_op(
                "tileloadd64",
                T.int8(4 + h),
                T.address_of(xq[h, row0, _block_index(plan, g, bi) * plan.block]),
                T.int64(plan.k),
            )
        )
    for v in T.unroll(plan.tile_vectors):
        T.evaluate(
            _tile_op(
                "tileloadd64",
                T.int8(6 + v),
                _weight_tile_row(
                    plan, w, unpacked, wj, _block_index(plan, g, bi) * (plan.block // 4), v0 + v
                ),
                T.int64(plan.tile * 4),
            )
        )
    for c in T.unroll(plan.halves * 2):
        T.evaluate(_tile_op("tilezero", T.int8(c)))
    for h in T.unroll(plan.halves):
        for v in T.unroll(plan.tile_vectors):
            T.evaluate(_tile_op("tdpbsud", T.int8(h * 2 + v), T.int8(4 + h), T.int8(6 + v)))
    for v in T.unroll(plan.tile_vectors):
        T.evaluate(
            _tile_op(
                "tilestored64",
                T.int8(v),
                T.address_of(dots[0, v * plan.lanes]),
                T.int64(plan.tile_vectors * plan.width),
            )
        )
        if plan.halves == 2:
            T.evaluate(
                _tile_op(
                    "tilestored64",
                    T.int8(2 + v),
                    T.address_of(dots_low[0, v * plan.lanes]),
                    T.int64(plan.tile_vectors * plan.width),
                )
            )


def _tile_dot(
    plan: IntDotPlan, dots: Buffer, dots_low: Buffer, xq_sums: Buffer, row: Expr, b: Expr, r: Expr, lane: Expr
) -> Expr:
    """The float32 dot of block b, row r, lane: the halves combined, less offset * sum(xq)."""
    dot = dots[r, lane] * 255 + dots_low[r, lane] if plan.halves == 2 else dots[r, lane]
    if plan.offset != 0:
        dot = dot - plan.offset * xq_sums[row, b]
    return T.Cast("float32", dot)


@T.macro
def _tile_block_into_acc(
    plan: IntDotPlan,
    wj: Expr,
    g: Expr,
    row0: Expr,
    v0: Expr,
    dots: Buffer,
    dots_low: Buffer,
    acc: Buffer,
    activations: tuple,
    scale_buffers: tuple,
):
    # a group of one activation block: acc[r, :] += its scales times the block's dots (and mins or zeros
    # times the sum of x), without the part buffer
    x_scales, xq_sums, x_sums = activations
    scales, scales_super, zeros, zeros_super = scale_buffers
    for r in T.unroll(TILE_ROWS):
        for lane in T.vectorized(plan.tile_vectors * plan.lanes):
            if plan.spec.scheme == "symmetric":
                acc[r, lane] = acc[r, lane] + _scale_of(
                    plan, scales, scales_super, wj, g, v0 * plan.lanes + lane
                ) * (x_scales[row0 + r, g] * _tile_dot(plan, dots, dots_low, xq_sums, row0 + r, g, r, lane))
            elif plan.spec.scheme == "min":
                acc[r, lane] = (
                    acc[r, lane]
                    + _scale_of(plan, scales, scales_super, wj, g, v0 * plan.lanes + lane)
                    * (x_scales[row0 + r, g] * _tile_dot(plan, dots, dots_low, xq_sums, row0 + r, g, r, lane))
                    + _scale_of(plan, zeros, zeros_super, wj, g, v0 * plan.lanes + lane) * x_sums[row0 + r, g]
                )
            else:
                acc[r, lane] = acc[r, lane] + _scale_of(
                    plan, scales, scales_super, wj, g, v0 * plan.lanes + lane
                ) * (
                    x_scales[row0 + r, g] * _tile_dot(plan, dots, dots_low, xq_sums, row0 + r, g, r, lane)
                    - _scale_of(plan, zeros, zeros_super, wj, g, v0 * plan.lanes + lane) * x_sums[row0 + r, g]
                )


@T.macro
def _tile_rows_of_strip(
    plan: IntDotPlan,
    jo: Expr,
    wj: Expr,
    row0: Expr,
    v0: Expr,
    operands: tuple,
    scratch: tuple,
    unpacked: Buffer,
):
    # TILE_ROWS rows from row0 by vectors v0, v0 + 1 of strip jo: _rows_of_strip with tiles for the dots
    w, _, xq, x_scales, xq_sums, x_sums, scales, scales_super, zeros, zeros_super = operands[:10]
    bias, y_rows = operands[10:12]
    acc, part, dots, dots_low, rows_in, rows_out = (
        scratch[0],
        scratch[1],
        scratch[2],
        scratch[3],
        scratch[6],
        scratch[7],
    )
    for r in T.unroll(TILE_ROWS):
        for lane in T.vectorized(plan.tile_vectors * plan.lanes):
            acc[r, lane] = T.float32(0)
    for g in T.serial(plan.groups):
        if plan.per_group == 1:
            _tile_block_dots(plan, wj, g, 0, row0, v0, w, unpacked, xq, dots, dots_low)
            _tile_block_into_acc(
                plan,
                wj,
                g,
                row0,
                v0,
                dots,
                dots_low,
                acc,
                (x_scales, xq_sums, x_sums),
                (scales, scales_super, zeros, zeros_super),
            )
        else:
            for r in T.unroll(TILE_ROWS):
                for lane in T.vectorized(plan.tile_vectors * plan.lanes):
                    part[r, lane] = T.float32(0)
            for bi in T.serial(plan.per_group):
                _tile_block_dots(plan, wj, g, bi, row0, v0, w, unpacked, xq, dots, dots_low)
                _block_into_part(
                    plan,
                    g,
                    bi,
                    row0,
                    TILE_ROWS,
                    plan.tile_vectors,
                    dots,
                    dots_low,
                    part,
                    (x_scales, xq_sums),
                    rows_in,
                )
            _group_into_acc(
                plan,
                wj,
                g,
                row0,
                TILE_ROWS,
                v0,
                plan.tile_vectors,
                acc,
                part,
                (scales, scales_super, zeros, zeros_super),
                x_sums,
                rows_in,
            )
    _store_rows(plan, jo, row0, TILE_ROWS, v0, plan.tile_vectors, acc, bias, y_rows, rows_out)


@T.macro
def _tile_strip_passes(plan: IntDotPlan, jo: Expr, wj: Expr, rows: Expr, operands: tuple):
    # the strip's first rows // TILE_ROWS blocks of rows through the tiles, then the rest as vnni512
    w, w_high = operands[0], operands[1]
    if rows >= TILE_ROWS:  # decode's few rows allocate and unpack nothing
        config = T.sblock_alloc_buffer((64,), "uint8")
        unpacked = T.sblock_alloc_buffer((plan.k // 4 if plan.nibbles else 1, plan.tile * 4), "uint8")
        scratch = _pass_scratch(plan, TILE_ROWS, plan.tile_vectors)
        wide = _pass_scratch(plan, 1, plan.vectors)
        _configure_tiles(plan, config)
        if plan.nibbles:
            _unpack_strip(plan, w, w_high, wj, unpacked, wide)
        for a in T.serial(rows // TILE_ROWS):
            for vs in T.serial(plan.vectors // plan.tile_vectors):
                _tile_rows_of_strip(
                    plan, jo, wj, a * TILE_ROWS, vs * plan.tile_vectors, operands, scratch, unpacked
                )
        T.evaluate(_tile_op("tilerelease"))
    _strip_passes(plan, jo, wj, rows - rows % TILE_ROWS, rows % TILE_ROWS, operands)


def _gemm_kernel(plan: IntDotPlan) -> tirx.PrimFunc:
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
        x3 = T.match_buffer(x_handle, (q, 4, plan.k), "float32")
        w = T.match_buffer(w_handle, (plan.strips, plan.steps, plan.tile * 4), plan.weight_dtype)
        w_high = T.match_buffer(  # plane 5 and 6: the bits above the nibbles (else w again, unread)
            high_handle, (plan.strips, plan.steps // plan.high_pairs, plan.tile * 4), plan.weight_dtype
        )
        scales = T.match_buffer(s_handle, (plan.strips, plan.groups, plan.tile), plan.sub_dtype)
        zeros = T.match_buffer(z_handle, (plan.strips, plan.groups, plan.tile), plan.sub_dtype)
        scales_super = T.match_buffer(  # factored: the float16 a run of groups (else scales again, unread)
            s_super_handle, plan.super_shape, plan.super_dtype
        )
        zeros_super = T.match_buffer(z_super_handle, plan.super_shape, plan.super_dtype)
        bias = T.match_buffer(bias_handle, (bias_len,), "float32")
        counts = T.match_buffer(counts_handle, (2,), "int64")  # real token rows, real logits rows
        y = T.match_buffer(y_handle, (q, 4, plan.n), "float32")
        x = T.decl_buffer((q * 4, plan.k), "float32", data=x3.data)
        y_rows = T.decl_buffer((q * 4, plan.n), "float32", data=y.data)
        xq = T.sblock_alloc_buffer((plan.halves, q * 4, plan.k), plan.xq_dtype)
        x_scales = T.sblock_alloc_buffer((q * 4, plan.blocks), "float32")
        xq_sums = T.sblock_alloc_buffer((q * 4, plan.blocks), "int32")
        x_sums = T.sblock_alloc_buffer((q * 4, plan.groups), "float32")
        rows = T.min(counts[which], q * 4)
        for row in T.parallel(rows):
            with T.sblock("quantize"):
                T.reads()
                T.writes()
                _quantize_row(plan, x, row, xq, x_scales, xq_sums, x_sums)
        for jo in T.parallel(plan.strips):
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
                if plan.tiles:
                    _tile_strip_passes(plan, jo, jo, rows, operands)
                else:
                    _strip_passes(plan, jo, jo, 0, rows, operands)
        _zero_padding_rows(plan, y_rows, rows, q * 4)

    return int_dot_gemm


@T.macro
def _zero_padding_rows(plan: IntDotPlan, y_rows: Buffer, first: Expr, total: Expr):
    # the rows after the real ones (the executable's padding: 3 of decode's 4): zeros, not what the
    # memory held before, which the row-wise kernels after this one read; left as they were, they were
    # often denormal floats (integer data), and SwiGLU's exponential of those ran 36x slower
    for r in T.serial(first, total):
        for v in T.serial(plan.n // plan.lanes):
            for lane in T.vectorized(plan.lanes):
                y_rows[r, v * plan.lanes + lane] = T.float32(0)


def _experts_kernel(plan: IntDotPlan) -> tirx.PrimFunc:
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
        x3 = T.match_buffer(x_handle, (q, 4, plan.k), "float32")
        w = T.match_buffer(w_handle, (plan.weight_strips, plan.steps, plan.tile * 4), plan.weight_dtype)
        w_high = T.match_buffer(
            high_handle, (plan.weight_strips, plan.steps // plan.high_pairs, plan.tile * 4), plan.weight_dtype
        )
        scales = T.match_buffer(s_handle, (plan.weight_strips, plan.groups, plan.tile), plan.sub_dtype)
        zeros = T.match_buffer(z_handle, (plan.weight_strips, plan.groups, plan.tile), plan.sub_dtype)
        scales_super = T.match_buffer(s_super_handle, plan.super_shape, plan.super_dtype)
        zeros_super = T.match_buffer(z_super_handle, plan.super_shape, plan.super_dtype)
        counts = T.match_buffer(counts_handle, (2,), "int64")
        order = T.match_buffer(order_handle, (qs * 4,), "int32")
        offsets = T.match_buffer(offsets_handle, (max(plan.experts, 1) + 1,), "int32")
        y = T.match_buffer(y_handle, (qs, 4, plan.n), "float32")
        x = T.decl_buffer((q * 4, plan.k), "float32", data=x3.data)
        y_rows = T.decl_buffer((qs * 4, plan.n), "float32", data=y.data)
        xq = T.sblock_alloc_buffer((plan.halves, q * 4, plan.k), plan.xq_dtype)
        x_scales = T.sblock_alloc_buffer((q * 4, plan.blocks), "float32")
        xq_sums = T.sblock_alloc_buffer((q * 4, plan.blocks), "int32")
        x_sums = T.sblock_alloc_buffer((q * 4, plan.groups), "float32")
        rows = T.min(counts[which] * (plan.top_k if plan.slot_input else 1), q * 4)
        for row in T.parallel(rows):
            # "quantize_1": this form's block has had that name in the TIR since the two forms shared
            # one quantizing macro (a macro's second expansion suffixes its blocks' names)
            with T.sblock("quantize_1"):
                T.reads()
                T.writes()
                _quantize_row(plan, x, row, xq, x_scales, xq_sums, x_sums)
        for jo in T.parallel(plan.strips):
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
                for e in T.serial(plan.experts):
                    _strip_passes(
                        plan, jo, e * plan.strips + jo, offsets[e], offsets[e + 1] - offsets[e], operands
                    )

    return int_dot_experts


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
    plan = IntDotPlan.choose(
        k, n, spec, has_bias, isa, plane, activation_bits, scale_per, experts, top_k, slot_input
    )
    return _experts_kernel(plan) if experts else _gemm_kernel(plan)
