/* llama.cpp's K-quant blocks (Q4_K, Q5_K, Q6_K) from float32 rows, as its reference quantizers make them
 * without an importance matrix (the blocks `llama-quantize` writes): the same search for each group's
 * scale and min, the same float32 arithmetic in the same order. Built by gguf_encode.py with
 * -ffp-contract=off: a fused multiply-add would round differently from ggml's own build.
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

static int round_to_int(float value) { return (int)rintf(value); } /* halves to even, as ggml's */

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

/* A group's scale and min (value ~ scale * q - min, q in 0..levels): weighted least squares over the grids
 * that map [min, max] onto levels + offset levels, offset = first_offset + 0.1 * step; the best-fitting
 * grid's q in `q`. Returns the scale; the min (as a positive offset) goes to `offset_out`. */
static float fit_scale_and_min(const float *x, const float *weight, int levels, float first_offset, int steps,
                               uint8_t *q, uint8_t *trial, float *offset_out) {
    const int n = 32;
    float low = x[0], high = x[0];
    float sum_w = weight[0];
    float sum_x = sum_w * x[0];
    for (int i = 1; i < n; ++i) {
        if (x[i] < low) low = x[i];
        if (x[i] > high) high = x[i];
        sum_w += weight[i];
        sum_x += weight[i] * x[i];
    }
    if (low > 0) low = 0;
    if (high == low) {
        memset(q, 0, (size_t)n);
        *offset_out = -low;
        return 0.f;
    }
    float inverse = levels / (high - low);
    float scale = 1 / inverse;
    float best_error = 0;
    for (int i = 0; i < n; ++i) {
        q[i] = (uint8_t)clamp(round_to_int(inverse * (x[i] - low)), 0, levels);
        float diff = scale * q[i] + low - x[i];
        best_error += weight[i] * (diff * diff);
    }
    for (int step = 0; step <= steps; ++step) {
        inverse = (first_offset + 0.1f * step + levels) / (high - low);
        float sum_l = 0, sum_l2 = 0, sum_xl = 0;
        for (int i = 0; i < n; ++i) {
            int level = clamp(round_to_int(inverse * (x[i] - low)), 0, levels);
            trial[i] = (uint8_t)level;
            float weighted = weight[i] * level;
            sum_l += weighted;
            sum_l2 += weighted * level;
            sum_xl += weighted * x[i];
        }
        float determinant = sum_w * sum_l2 - sum_l * sum_l;
        if (!(determinant > 0)) continue;
        float this_scale = (sum_w * sum_xl - sum_x * sum_l) / determinant;
        float this_low = (sum_l2 * sum_x - sum_l * sum_xl) / determinant;
        if (this_low > 0) {
            this_low = 0;
            this_scale = sum_xl / sum_l2;
        }
        float error = 0;
        for (int i = 0; i < n; ++i) {
            float diff = this_scale * trial[i] + this_low - x[i];
            error += weight[i] * (diff * diff);
        }
        if (error < best_error) {
            memcpy(q, trial, (size_t)n);
            best_error = error;
            scale = this_scale;
            low = this_low;
        }
    }
    *offset_out = -low;
    return scale;
}

/* One super-block of Q4_K (levels 15) or Q5_K (levels 31): its q (0..levels) in `q`, d, dmin and the
 * packed 6-bit scales and mins in `head` (4 + 12 bytes). */
static void scale_min_block(const float *x, int levels, float first_offset, int steps, uint8_t *q, uint8_t *head) {
    float scales[8], offsets[8], weight[32];
    uint8_t trial[32], scale_levels[8], offset_levels[8];
    float max_scale = 0, max_offset = 0;
    for (int j = 0; j < 8; ++j) {
        const float *group = x + 32 * j;
        float sum_x2 = 0;
        for (int i = 0; i < 32; ++i) sum_x2 += group[i] * group[i];
        float mean = sqrtf(sum_x2 / 32);
        for (int i = 0; i < 32; ++i) weight[i] = mean + fabsf(group[i]);
        scales[j] = fit_scale_and_min(group, weight, levels, first_offset, steps, q + 32 * j, trial, &offsets[j]);
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

void encode_q4_k(const float *x, uint8_t *out, int64_t blocks) {
    uint8_t q[VALUES];
    for (int64_t b = 0; b < blocks; ++b, x += VALUES, out += 144) {
        scale_min_block(x, 15, -1.f, 20, q, out);
        uint8_t *nibbles = out + 16;
        for (int chunk = 0; chunk < 4; ++chunk) {
            for (int i = 0; i < 32; ++i) {
                nibbles[32 * chunk + i] = (uint8_t)(q[64 * chunk + i] | (q[64 * chunk + 32 + i] << 4));
            }
        }
    }
}

void encode_q5_k(const float *x, uint8_t *out, int64_t blocks) {
    uint8_t q[VALUES];
    for (int64_t b = 0; b < blocks; ++b, x += VALUES, out += 176) {
        scale_min_block(x, 31, -0.5f, 15, q, out);
        uint8_t *fifth_bits = out + 16, *nibbles = out + 48;
        memset(fifth_bits, 0, 32);
        for (int chunk = 0; chunk < 4; ++chunk) {
            for (int i = 0; i < 32; ++i) {
                uint8_t first = q[64 * chunk + i], second = q[64 * chunk + 32 + i];
                fifth_bits[i] |= (uint8_t)(((first >> 4) << (2 * chunk)) | ((second >> 4) << (2 * chunk + 1)));
                nibbles[32 * chunk + i] = (uint8_t)((first & 0xf) | ((second & 0xf) << 4));
            }
        }
    }
}

/* A group of 16 for Q6_K: the scale whose grid (q in -32..31) fits best by x^2-weighted least squares,
 * among the grid through the largest magnitude and 18 grids around it; q + 32 in `q`. */
static float fit_symmetric(const float *x, int8_t *q) {
    const int n = 16, levels = 32;
    float extreme = 0, largest = 0;
    for (int i = 0; i < n; ++i) {
        float magnitude = fabsf(x[i]);
        if (magnitude > largest) {
            largest = magnitude;
            extreme = x[i];
        }
    }
    if (largest < TINY) {
        memset(q, 0, (size_t)n);
        return 0.f;
    }
    float inverse = -levels / extreme;
    float sum_lx = 0, sum_l2 = 0;
    for (int i = 0; i < n; ++i) {
        int level = clamp(round_to_int(inverse * x[i]), -levels, levels - 1);
        q[i] = (int8_t)(level + levels);
        float weight = x[i] * x[i];
        sum_lx += weight * x[i] * level;
        sum_l2 += weight * level * level;
    }
    float scale = sum_l2 ? sum_lx / sum_l2 : 0.0f;
    float best = scale * sum_lx;
    for (int step = -9; step <= 9; ++step) {
        if (step == 0) continue;
        inverse = -(levels + 0.1f * step) / extreme;
        sum_lx = sum_l2 = 0;
        for (int i = 0; i < n; ++i) {
            int level = clamp(round_to_int(inverse * x[i]), -levels, levels - 1);
            float weight = x[i] * x[i];
            sum_lx += weight * x[i] * level;
            sum_l2 += weight * level * level;
        }
        if (sum_l2 > 0 && sum_lx * sum_lx > best * sum_l2) {
            for (int i = 0; i < n; ++i) {
                q[i] = (int8_t)(levels + clamp(round_to_int(inverse * x[i]), -levels, levels - 1));
            }
            scale = sum_lx / sum_l2;
            best = scale * sum_lx;
        }
    }
    return scale;
}

void encode_q6_k(const float *x, uint8_t *out, int64_t blocks) {
    int8_t q[VALUES];
    float scales[16];
    for (int64_t b = 0; b < blocks; ++b, x += VALUES, out += 210) {
        float max_scale = 0, max_magnitude = 0;
        for (int g = 0; g < 16; ++g) {
            scales[g] = fit_symmetric(x + 16 * g, q + 16 * g);
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
