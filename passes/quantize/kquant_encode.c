/* llama.cpp's K-quant blocks (Q4_K, Q5_K, Q6_K) from float32 rows, as its reference quantizers make them
 * without an importance matrix (the blocks `llama-quantize` writes): the same search for each group's
 * scale and min, the same float32 arithmetic in the same order. The searches run LANES groups side by
 * side (loops over lanes inside the loops over a group's values), which the compiler turns into vector
 * code without changing any lane's result. Built by gguf_encode.py with -O3 -ffp-contract=off: a fused
 * multiply-add would round differently from ggml's own build.
 *
 * Block layouts (little-endian halves):
 *   Q4_K 144 bytes: d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of 4-bit values
 *   Q5_K 176 bytes: d, dmin, 12 bytes of scales and mins, 32 bytes of 5th bits, 128 bytes of low nibbles
 *   Q6_K 210 bytes: 128 bytes of low nibbles, 64 bytes of high 2-bit pairs, 16 int8 scales, d
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define VALUES 256
#define TINY 1e-15f

/* to the nearest integer, halves to even, as ggml's nearest_int (|value| < 2^22): the add rounds */
static int round_to_int(float value) { return (int)((value + 12582912.f) - 12582912.f); }

static int clamp(int value, int low, int high) { return value < low ? low : (value > high ? high : value); }

static uint16_t half_of(float value) { /* IEEE binary16, rounded to nearest even */
    uint32_t bits;
    memcpy(&bits, &value, 4);
    uint16_t sign = (uint16_t)((bits >> 16) & 0x8000u);
    uint32_t magnitude = bits & 0x7fffffffu;
    if (magnitude > 0x7f800000u) return sign | 0x7e00u;
    if (magnitude >= 0x477ff000u) return sign | 0x7c00u;
    if (magnitude < 0x38800000u) return sign | (uint16_t)rintf(fabsf(value) * 16777216.0f);
    uint32_t rounded = magnitude + 0xfffu + ((magnitude >> 13) & 1u);
    return sign | (uint16_t)((rounded - 0x38000000u) >> 13);
}

static float float_of(uint16_t half) {
    uint32_t exponent = (half >> 10) & 0x1fu, mantissa = half & 0x3ffu;
    float magnitude;
    if (exponent == 0) {
        magnitude = ldexpf((float)mantissa, -24);
    } else {
        uint32_t bits = ((exponent + 112u) << 23) | (mantissa << 13);
        memcpy(&magnitude, &bits, 4);
    }
    return (half & 0x8000u) ? -magnitude : magnitude;
}

static void put_half(uint8_t *out, uint16_t half) {
    out[0] = (uint8_t)(half & 0xff);
    out[1] = (uint8_t)(half >> 8);
}

#define LANES 16 /* groups fitted together: the loops over lanes are independent, so they may run as vectors */

/* Each lane's group of 32: its scale and min (value ~ scale * q - min, q in 0..levels) by weighted least
 * squares over the grids that map [min, max] onto levels + offset levels, offset = first_offset + 0.1 *
 * step; the best grid's q. Every lane's float32 operations are the ones of its group fitted alone, in the
 * same order (lanes only run side by side). */
static void fit_scale_and_min(const float x[32][LANES], const float weight[32][LANES], int levels,
                              float first_offset, int steps, uint8_t q[32][LANES], float scale_out[LANES],
                              float offset_out[LANES]) {
    float low[LANES], high[LANES], first_low[LANES], sum_w[LANES], sum_x[LANES], scale[LANES], best[LANES];
    float inverse[LANES], sum_l[LANES], sum_l2[LANES], sum_xl[LANES], this_scale[LANES], this_low[LANES];
    float error[LANES];
    int better[LANES];
    uint8_t trial[32][LANES];
    for (int l = 0; l < LANES; ++l) {
        low[l] = high[l] = x[0][l];
        sum_w[l] = weight[0][l];
        sum_x[l] = sum_w[l] * x[0][l];
    }
    for (int i = 1; i < 32; ++i) {
        for (int l = 0; l < LANES; ++l) {
            low[l] = x[i][l] < low[l] ? x[i][l] : low[l];
            high[l] = x[i][l] > high[l] ? x[i][l] : high[l];
            sum_w[l] += weight[i][l];
            sum_x[l] += weight[i][l] * x[i][l];
        }
    }
    for (int l = 0; l < LANES; ++l) {
        low[l] = low[l] > 0 ? 0 : low[l];
        first_low[l] = low[l];
        inverse[l] = levels / (high[l] - low[l]);
        scale[l] = 1 / inverse[l];
        best[l] = 0;
    }
    for (int i = 0; i < 32; ++i) {
        for (int l = 0; l < LANES; ++l) {
            int level = clamp(round_to_int(inverse[l] * (x[i][l] - low[l])), 0, levels);
            q[i][l] = (uint8_t)level;
            float diff = scale[l] * level + low[l] - x[i][l];
            best[l] += weight[i][l] * (diff * diff);
        }
    }
    for (int step = 0; step <= steps; ++step) {
        for (int l = 0; l < LANES; ++l) {
            inverse[l] = (first_offset + 0.1f * step + levels) / (high[l] - low[l]);
            sum_l[l] = sum_l2[l] = sum_xl[l] = error[l] = 0;
        }
        for (int i = 0; i < 32; ++i) {
            for (int l = 0; l < LANES; ++l) {
                int level = clamp(round_to_int(inverse[l] * (x[i][l] - low[l])), 0, levels);
                trial[i][l] = (uint8_t)level;
                float weighted = weight[i][l] * level;
                sum_l[l] += weighted;
                sum_l2[l] += weighted * level;
                sum_xl[l] += weighted * x[i][l];
            }
        }
        for (int l = 0; l < LANES; ++l) {
            float determinant = sum_w[l] * sum_l2[l] - sum_l[l] * sum_l[l];
            better[l] = determinant > 0; /* else this grid is skipped */
            float fitted_scale = (sum_w[l] * sum_xl[l] - sum_x[l] * sum_l[l]) / determinant;
            float fitted_low = (sum_l2[l] * sum_x[l] - sum_l[l] * sum_xl[l]) / determinant;
            this_low[l] = fitted_low > 0 ? 0 : fitted_low;
            this_scale[l] = fitted_low > 0 ? sum_xl[l] / sum_l2[l] : fitted_scale;
        }
        for (int i = 0; i < 32; ++i) {
            for (int l = 0; l < LANES; ++l) {
                float diff = this_scale[l] * trial[i][l] + this_low[l] - x[i][l];
                error[l] += weight[i][l] * (diff * diff);
            }
        }
        for (int l = 0; l < LANES; ++l) {
            better[l] = better[l] && error[l] < best[l];
            best[l] = better[l] ? error[l] : best[l];
            scale[l] = better[l] ? this_scale[l] : scale[l];
            low[l] = better[l] ? this_low[l] : low[l];
        }
        for (int i = 0; i < 32; ++i) {
            for (int l = 0; l < LANES; ++l) q[i][l] = better[l] ? trial[i][l] : q[i][l];
        }
    }
    for (int l = 0; l < LANES; ++l) {
        int flat = high[l] == first_low[l]; /* one value (or all at most 0 and equal): q 0, scale 0 */
        scale_out[l] = flat ? 0.f : scale[l];
        offset_out[l] = flat ? -first_low[l] : -low[l];
        for (int i = 0; i < 32; ++i) q[i][l] = flat ? 0 : q[i][l];
    }
}

/* Super-block `x` of Q4_K (levels 15) or Q5_K (levels 31) from its 8 groups' fitted scales and offsets:
 * its q (0..levels) in `q`, d, dmin and the packed 6-bit scales and mins in `head` (4 + 12 bytes). */
static void finish_block(const float *x, int levels, const float *scales, const float *offsets, uint8_t *q,
                         uint8_t *head) {
    uint8_t scale_levels[8], offset_levels[8];
    float max_scale = 0, max_offset = 0;
    for (int j = 0; j < 8; ++j) {
        if (scales[j] > max_scale) max_scale = scales[j];
        if (offsets[j] > max_offset) max_offset = offsets[j];
    }
    float inverse_scale = max_scale > 0 ? 63.f / max_scale : 0.f;
    float inverse_offset = max_offset > 0 ? 63.f / max_offset : 0.f;
    uint8_t *packed = head + 4;
    for (int j = 0; j < 8; ++j) {
        uint8_t s = (uint8_t)round_to_int(inverse_scale * scales[j]);
        uint8_t m = (uint8_t)round_to_int(inverse_offset * offsets[j]);
        scale_levels[j] = s > 63 ? 63 : s;
        offset_levels[j] = m > 63 ? 63 : m;
    }
    for (int j = 0; j < 4; ++j) {
        packed[j] = (uint8_t)(scale_levels[j] | ((scale_levels[j + 4] >> 4) << 6));
        packed[j + 4] = (uint8_t)(offset_levels[j] | ((offset_levels[j + 4] >> 4) << 6));
        packed[j + 8] = (uint8_t)((scale_levels[j + 4] & 0xf) | ((offset_levels[j + 4] & 0xf) << 4));
    }
    uint16_t d = half_of(max_scale / 63.f), dmin = half_of(max_offset / 63.f);
    put_half(head, d);
    put_half(head + 2, dmin);
    float d_value = float_of(d), dmin_value = float_of(dmin);
    for (int j = 0; j < 8; ++j) {
        float group_scale = d_value * scale_levels[j];
        if (group_scale == 0) continue;
        float group_offset = dmin_value * offset_levels[j];
        for (int i = 0; i < 32; ++i) {
            q[32 * j + i] = (uint8_t)clamp(round_to_int((x[32 * j + i] + group_offset) / group_scale), 0, levels);
        }
    }
}

/* Q4_K or Q5_K blocks, two super-blocks (16 groups) fitted at once; `pack` writes a block's values. */
static void scale_min_blocks(const float *x, uint8_t *out, int64_t blocks, int levels, float first_offset,
                             int steps, int block_bytes, void (*pack)(const uint8_t *q, uint8_t *block)) {
    static const int per_round = LANES / 8;
    float values[32][LANES], weight[32][LANES], scales[LANES], offsets[LANES];
    uint8_t fitted[32][LANES], q[VALUES];
    for (int64_t b = 0; b < blocks; b += per_round) {
        int count = blocks - b < per_round ? (int)(blocks - b) : per_round;
        for (int g = 0; g < LANES; ++g) {
            const float *group = x + VALUES * b + 32 * g;
            if (g >= 8 * count) { /* past the last block: a zero group, fitted and dropped */
                for (int i = 0; i < 32; ++i) values[i][g] = weight[i][g] = 0;
                continue;
            }
            float sum_x2 = 0;
            for (int i = 0; i < 32; ++i) sum_x2 += group[i] * group[i];
            float mean = sqrtf(sum_x2 / 32);
            for (int i = 0; i < 32; ++i) {
                values[i][g] = group[i];
                weight[i][g] = mean + fabsf(group[i]);
            }
        }
        fit_scale_and_min(values, weight, levels, first_offset, steps, fitted, scales, offsets);
        for (int k = 0; k < count; ++k) {
            for (int g = 0; g < 8; ++g) {
                for (int i = 0; i < 32; ++i) q[32 * g + i] = fitted[i][8 * k + g];
            }
            uint8_t *block = out + (b + k) * block_bytes;
            finish_block(x + VALUES * (b + k), levels, scales + 8 * k, offsets + 8 * k, q, block);
            pack(q, block);
        }
    }
}

static void pack_q4_k(const uint8_t *q, uint8_t *block) {
    uint8_t *nibbles = block + 16;
    for (int chunk = 0; chunk < 4; ++chunk) {
        for (int i = 0; i < 32; ++i) {
            nibbles[32 * chunk + i] = (uint8_t)(q[64 * chunk + i] | (q[64 * chunk + 32 + i] << 4));
        }
    }
}

static void pack_q5_k(const uint8_t *q, uint8_t *block) {
    uint8_t *fifth_bits = block + 16, *nibbles = block + 48;
    memset(fifth_bits, 0, 32);
    for (int chunk = 0; chunk < 4; ++chunk) {
        for (int i = 0; i < 32; ++i) {
            uint8_t first = q[64 * chunk + i], second = q[64 * chunk + 32 + i];
            fifth_bits[i] |= (uint8_t)(((first >> 4) << (2 * chunk)) | ((second >> 4) << (2 * chunk + 1)));
            nibbles[32 * chunk + i] = (uint8_t)((first & 0xf) | ((second & 0xf) << 4));
        }
    }
}

void encode_q4_k(const float *x, uint8_t *out, int64_t blocks) {
    scale_min_blocks(x, out, blocks, 15, -1.f, 20, 144, pack_q4_k);
}

void encode_q5_k(const float *x, uint8_t *out, int64_t blocks) {
    scale_min_blocks(x, out, blocks, 31, -0.5f, 15, 176, pack_q5_k);
}

/* Each lane's levels (q + levels, q in -levels..levels-1) on the grid through `extreme` scaled to `span`
 * levels, and their x^2-weighted sums of x * q and q * q. */
static void fit_grid(const float x[16][LANES], const float extreme[LANES], float span, int levels,
                     int8_t q[16][LANES], float sum_lx[LANES], float sum_l2[LANES]) {
    float inverse[LANES];
    for (int l = 0; l < LANES; ++l) {
        inverse[l] = -span / extreme[l];
        sum_lx[l] = sum_l2[l] = 0;
    }
    for (int i = 0; i < 16; ++i) {
        for (int l = 0; l < LANES; ++l) {
            int level = clamp(round_to_int(inverse[l] * x[i][l]), -levels, levels - 1);
            q[i][l] = (int8_t)(level + levels);
            float weight = x[i][l] * x[i][l];
            sum_lx[l] += weight * x[i][l] * level;
            sum_l2[l] += weight * level * level;
        }
    }
}

/* Each lane's group of 16 for Q6_K: the scale whose grid (q in -32..31) fits best by x^2-weighted least
 * squares, among the grid through the largest magnitude and 18 grids around it; q + 32 in `q` (0 for a
 * group of zeros). Lane by lane the operations of one group alone, in the same order. */
static void fit_symmetric(const float x[16][LANES], int8_t q[16][LANES], float scale_out[LANES]) {
    const int levels = 32;
    float extreme[LANES], largest[LANES], sum_lx[LANES], sum_l2[LANES], scale[LANES];
    float best[LANES];
    int better[LANES];
    int8_t trial[16][LANES];
    for (int l = 0; l < LANES; ++l) extreme[l] = largest[l] = 0;
    for (int i = 0; i < 16; ++i) {
        for (int l = 0; l < LANES; ++l) {
            float magnitude = fabsf(x[i][l]);
            int larger = magnitude > largest[l];
            largest[l] = larger ? magnitude : largest[l];
            extreme[l] = larger ? x[i][l] : extreme[l];
        }
    }
    fit_grid(x, extreme, (float)levels, levels, q, sum_lx, sum_l2);
    for (int l = 0; l < LANES; ++l) {
        scale[l] = sum_l2[l] != 0 ? sum_lx[l] / sum_l2[l] : 0.0f;
        best[l] = scale[l] * sum_lx[l];
    }
    for (int step = -9; step <= 9; ++step) {
        if (step == 0) continue;
        fit_grid(x, extreme, levels + 0.1f * step, levels, trial, sum_lx, sum_l2);
        for (int l = 0; l < LANES; ++l) {
            better[l] = sum_l2[l] > 0 && sum_lx[l] * sum_lx[l] > best[l] * sum_l2[l];
            float fitted = sum_lx[l] / sum_l2[l];
            scale[l] = better[l] ? fitted : scale[l];
            best[l] = better[l] ? fitted * sum_lx[l] : best[l];
        }
        for (int i = 0; i < 16; ++i) {
            for (int l = 0; l < LANES; ++l) q[i][l] = better[l] ? trial[i][l] : q[i][l];
        }
    }
    for (int l = 0; l < LANES; ++l) {
        int zero = largest[l] < TINY;
        scale_out[l] = zero ? 0.f : scale[l];
        for (int i = 0; i < 16; ++i) q[i][l] = zero ? 0 : q[i][l];
    }
}

void encode_q6_k(const float *x, uint8_t *out, int64_t blocks) {
    int8_t q[VALUES], fitted[16][LANES];
    float scales[16], groups[16][LANES];
    for (int64_t b = 0; b < blocks; ++b, x += VALUES, out += 210) {
        for (int g = 0; g < 16; ++g) {
            for (int i = 0; i < 16; ++i) groups[i][g] = x[16 * g + i];
        }
        fit_symmetric(groups, fitted, scales);
        for (int g = 0; g < 16; ++g) {
            for (int i = 0; i < 16; ++i) q[16 * g + i] = fitted[i][g];
        }
        float max_scale = 0, max_magnitude = 0;
        for (int g = 0; g < 16; ++g) {
            float magnitude = fabsf(scales[g]);
            if (magnitude > max_magnitude) {
                max_magnitude = magnitude;
                max_scale = scales[g];
            }
        }
        memset(out, 0, 210);
        if (max_magnitude < TINY) continue; /* all zero, d = +0 */
        float inverse = -128.f / max_scale;
        uint16_t d = half_of(1 / inverse);
        put_half(out + 208, d);
        int8_t *group_scales = (int8_t *)(out + 192);
        for (int g = 0; g < 16; ++g) {
            int level = round_to_int(inverse * scales[g]);
            group_scales[g] = (int8_t)(level < 127 ? level : 127);
        }
        float d_value = float_of(d);
        for (int g = 0; g < 16; ++g) {
            float group_scale = d_value * group_scales[g];
            if (group_scale == 0) continue;
            for (int i = 0; i < 16; ++i) {
                q[16 * g + i] = (int8_t)(clamp(round_to_int(x[16 * g + i] / group_scale), -32, 31) + 32);
            }
        }
        uint8_t *low = out, *high = out + 128;
        for (int half = 0; half < 2; ++half, low += 64, high += 32) {
            const int8_t *values = q + 128 * half;
            for (int i = 0; i < 32; ++i) {
                low[i] = (uint8_t)((values[i] & 0xf) | ((values[i + 64] & 0xf) << 4));
                low[i + 32] = (uint8_t)((values[i + 32] & 0xf) | ((values[i + 96] & 0xf) << 4));
                high[i] = (uint8_t)((values[i] >> 4) | ((values[i + 32] >> 4) << 2) | ((values[i + 64] >> 4) << 4) |
                                    ((values[i + 96] >> 4) << 6));
            }
        }
    }
}
