/* RMSNorm of float32 rows: out = w * (x / sqrt(mean(x^2) + eps)), the order transformers computes it in.
 *
 * torch's CPU rms_norm is a composite of six ops (about 20 us on one decode row of SmolLM2's width); this is one
 * pass over the row. The sum of squares runs in 16 float32 lanes, as torch's vectorized reductions do, so results
 * differ from torch's only by the order of that sum (a few units in the last place of the scale).
 */
#include <math.h>
#include <stdint.h>

#include "bf16.h"

enum { LANES = 16 };

/* 1 / sqrt(mean(x^2) + eps), not inlined: every entry point below gets the same bits for the same row (the sum's
 * contraction into fused multiply-adds is decided once, here). */
__attribute__((noinline)) static float row_scale(const float *restrict x, float eps, int64_t width) {
    float lanes[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= width; i += LANES)
        for (int l = 0; l < LANES; l++) lanes[l] += x[i + l] * x[i + l];
    float sum = 0.0f;
    for (int l = 0; l < LANES; l++) sum += lanes[l];
    for (; i < width; i++) sum += x[i] * x[i];
    return 1.0f / sqrtf(sum / (float)width + eps);
}

static void norm_row(const float *restrict x, const float *restrict w, float eps, int64_t width,
                     float *restrict out) {
    const float scale = row_scale(x, eps, width);
    for (int64_t j = 0; j < width; j++) out[j] = w[j] * (x[j] * scale);
}

/* Row r of x starts at (r / groups) * stride + (r % groups) * width: groups = 1, stride = width for contiguous
 * rows; groups = heads for per-head norms of q or k still inside the fused q|k|v rows (no copy out first). */
void cpllm_rms_norm(const float *x, const float *w, float eps, int64_t rows, int64_t width, int64_t groups,
                    int64_t stride, float *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows > 64)
    for (int64_t r = 0; r < rows; r++)
        norm_row(x + (r / groups) * stride + (r % groups) * width, w, eps, width, out + r * width);
}

/* sr = xr + delta's row (float32, or bf16 widened exactly): 16 lanes at a time where the CPU has AVX-512. */
static void add_row(const float *restrict xr, const void *delta_row, int delta_bf16, int64_t width,
                    float *restrict sr) {
    int64_t j = 0;
    if (delta_bf16) {
        const uint16_t *dr = (const uint16_t *)delta_row;
#if defined(__AVX512F__)
        for (; j + LANES <= width; j += LANES)
            _mm512_storeu_ps(sr + j, _mm512_add_ps(_mm512_loadu_ps(xr + j), bf16x16_to_f32(dr + j)));
#endif
        for (; j < width; j++) sr[j] = xr[j] + from_bf16(dr[j]);
    } else {
        const float *dr = (const float *)delta_row;
        for (; j < width; j++) sr[j] = xr[j] + dr[j];
    }
}

/* o = w * (x * scale) rounded to bf16 as to_bf16 rounds; 16 lanes at a time where the CPU has AVX-512 (the
 * compiler's own vectorization of this loop took 256-bit vectors and the integer rounding). */
static void scale_row_bf16(const float *restrict x, const float *restrict w, float scale, int64_t width,
                           uint16_t *restrict o) {
    int64_t j = 0;
#if defined(__AVX512F__)
    const __m512 vscale = _mm512_set1_ps(scale);
    for (; j + LANES <= width; j += LANES) {
        const __m512 y = _mm512_mul_ps(_mm512_loadu_ps(w + j), _mm512_mul_ps(_mm512_loadu_ps(x + j), vscale));
        _mm256_storeu_si256((__m256i *)(o + j), f32x16_to_bf16(y));
    }
#endif
    for (; j < width; j++) o[j] = to_bf16(w[j] * (x[j] * scale));
}

/* The residual add and the next norm in one pass over contiguous rows [rows, width]: sum = x + delta (delta float32,
 * or bf16 with delta_bf16: a bf16 GEMM's output, widened exactly; NULL: sum is x and is not written), then
 * out = w * (sum / sqrt(mean(sum^2) + eps)) in float32, or rounded to bf16 with out_bf16 (as torch rounds): the
 * bits of torch's add, cpllm_rms_norm and torch's cast, without the two intermediates. */
void cpllm_add_rms_norm(const float *x, const void *delta, int delta_bf16, const float *w, float eps, int64_t rows,
                        int64_t width, float *sum, void *out, int out_bf16, int threads) {
    const int64_t delta_bytes = delta_bf16 ? 2 : 4;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows > 64)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * width;
        if (delta != NULL) {
            add_row(xr, (const char *)delta + r * width * delta_bytes, delta_bf16, width, sum + r * width);
            xr = sum + r * width;
        }
        const float scale = row_scale(xr, eps, width);
        if (out_bf16) {
            scale_row_bf16(xr, w, scale, width, (uint16_t *)out + r * width);
        } else {
            float *o = (float *)out + r * width;
            for (int64_t j = 0; j < width; j++) o[j] = w[j] * (xr[j] * scale);
        }
    }
}

/* sum = x + delta over contiguous rows, delta bf16 (a bf16 GEMM's output, widened exactly): the residual add
 * without widening delta into a float32 copy first; the bits of torch's add. */
void cpllm_add_bf16_rows(const float *x, const uint16_t *delta, int64_t elements, float *sum, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (elements > 65536)
    for (int64_t i = 0; i < elements; i++) sum[i] = x[i] + from_bf16(delta[i]);
}
