/* The small per-layer steps of a decode step on float32 rows, one C call each instead of two to six torch ops:
 * rotary embedding of q and k in place, storing the new K/V rows into their pool slots, and silu(gate) * up.
 *
 * Rotary: x * cos + swap_halves(x) * sin with the step's tables (cpllm/model/rope.py: cos = (c, c), sin = (-s, s)),
 * each product rounded before the sum as torch computes it (fp-contract off: no fused multiply-add), so the
 * results are the bits torch's ops give.
 */
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "kernel_status.h"
#include "vector_exp.h"

enum { POOL_F32 = 0, POOL_F16 = 1, POOL_BF16 = 2 };

__attribute__((optimize("fp-contract=off")))
static void rotate_heads(float *restrict x, int heads, int head_dim, const float *restrict cos,
                         const float *restrict sin) {
    const int half = head_dim / 2;
    float rotated[512];
    for (int h = 0; h < heads; h++) {
        float *row = x + (int64_t)h * head_dim;
        for (int i = 0; i < half; i++) {
            rotated[i] = row[i] * cos[i] + row[i + half] * sin[i];
            rotated[i + half] = row[i + half] * cos[i + half] + row[i] * sin[i + half];
        }
        memcpy(row, rotated, sizeof(float) * head_dim);
    }
}

/* Token t's q_heads heads of head_dim at q + t * q_stride (contiguous), its k_heads at k + t * k_stride;
 * cos, sin [tokens, head_dim]. Returns CPLLM_UNSUPPORTED_SHAPE for an odd head_dim or one over 512. */
int cpllm_rope_qk(float *q, int q_heads, int64_t q_stride, float *k, int k_heads, int64_t k_stride, int64_t tokens,
                  int head_dim, const float *cos, const float *sin) {
    if (head_dim > 512 || head_dim % 2) return CPLLM_UNSUPPORTED_SHAPE;
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos + t * head_dim, *s = sin + t * head_dim;
        rotate_heads(q + t * q_stride, q_heads, head_dim, c, s);
        rotate_heads(k + t * k_stride, k_heads, head_dim, c, s);
    }
    return 0;
}

#if defined(__AVX512F__)
/* rotate_heads on a bf16 row's heads, widened on the way into out (half a multiple of 16): each lane's products and
 * sum as rotate_heads rounds them (fp-contract off), so the same bits in registers instead of through a copy. */
__attribute__((optimize("fp-contract=off")))
static void widen_rotate_heads16(const uint16_t *restrict src, float *restrict out, int heads, int head_dim,
                                 const float *restrict cos, const float *restrict sin) {
    const int half = head_dim / 2;
    for (int h = 0; h < heads; h++) {
        const uint16_t *x = src + (int64_t)h * head_dim;
        float *y = out + (int64_t)h * head_dim;
        for (int i = 0; i < half; i += 16) {
            const __m512 lo = bf16x16_to_f32(x + i), hi = bf16x16_to_f32(x + half + i);
            _mm512_storeu_ps(y + i, _mm512_add_ps(_mm512_mul_ps(lo, _mm512_loadu_ps(cos + i)),
                                                  _mm512_mul_ps(hi, _mm512_loadu_ps(sin + i))));
            _mm512_storeu_ps(y + half + i, _mm512_add_ps(_mm512_mul_ps(hi, _mm512_loadu_ps(cos + half + i)),
                                                         _mm512_mul_ps(lo, _mm512_loadu_ps(sin + half + i))));
        }
    }
}
#endif

/* One token's row of cpllm_widen_rope_qkv. */
static void widen_rope_row(const uint16_t *src, int q_heads, int k_heads, int64_t width, int head_dim,
                           const float *cos, const float *sin, float *row) {
    const int64_t rotated = (int64_t)(q_heads + k_heads) * head_dim;
#if defined(__AVX512F__)
    if (head_dim % 32 == 0) {
        widen_rotate_heads16(src, row, q_heads + k_heads, head_dim, cos, sin);
        for (int64_t j = rotated; j < width; j += 16) _mm512_storeu_ps(row + j, bf16x16_to_f32(src + j));
        return;
    }
#endif
    for (int64_t j = 0; j < width; j++) row[j] = from_bf16(src[j]);
    rotate_heads(row, q_heads, head_dim, cos, sin);
    rotate_heads(row + (int64_t)q_heads * head_dim, k_heads, head_dim, cos, sin);
}

/* cpllm_rope_qk on a bf16 GEMM's q|k|v rows [tokens, (q_heads + k_heads + v_heads) * head_dim]: out (the same shape,
 * float32, contiguous) = the rows widened (exact), q's and k's heads then rotated, each row while it is in cache: the
 * bits of torch's widening copy followed by cpllm_rope_qk, in one pass over memory instead of three. */
int cpllm_widen_rope_qkv(const uint16_t *qkv, int q_heads, int k_heads, int v_heads, int64_t tokens, int head_dim,
                         const float *cos, const float *sin, float *out, int threads) {
    if (head_dim > 512 || head_dim % 2) return CPLLM_UNSUPPORTED_SHAPE;
    const int64_t width = (int64_t)(q_heads + k_heads + v_heads) * head_dim;
#pragma omp parallel for num_threads(threads) schedule(static) if (tokens * width >= 65536)
    for (int64_t t = 0; t < tokens; t++)
        widen_rope_row(qkv + t * width, q_heads, k_heads, width, head_dim, cos + t * head_dim, sin + t * head_dim,
                       out + t * width);
    return 0;
}

/* rows[i] of src (row_elems floats at src + rows[i] * src_stride, rows[i] < src_rows) into slot slots[i] of the pool
 * [num_slots, row_elems]. Every index is checked before the first write: CPLLM_ROW_OUT_OF_RANGE or
 * CPLLM_SLOT_OUT_OF_RANGE, and nothing written. */
int cpllm_store_rows(const float *src, int64_t src_stride, int64_t src_rows, const int64_t *rows,
                     const int64_t *slots, int64_t n, int64_t row_elems, void *pool, int64_t num_slots,
                     int pool_dtype) {
    if (cpllm_any_outside(rows, n, src_rows)) return CPLLM_ROW_OUT_OF_RANGE;
    if (cpllm_any_outside(slots, n, num_slots)) return CPLLM_SLOT_OUT_OF_RANGE;
    for (int64_t i = 0; i < n; i++) {
        const float *s = src + rows[i] * src_stride;
        if (pool_dtype == POOL_F32) {
            memcpy((float *)pool + slots[i] * row_elems, s, sizeof(float) * row_elems);
        } else if (pool_dtype == POOL_F16) {
            _Float16 *d = (_Float16 *)pool + slots[i] * row_elems;
            for (int64_t j = 0; j < row_elems; j++) d[j] = (_Float16)s[j];
        } else {
            uint16_t *d = (uint16_t *)pool + slots[i] * row_elems;
            int64_t j = 0;
#if defined(__AVX512F__)
            for (; j + 16 <= row_elems; j += 16)
                _mm256_storeu_si256((__m256i *)(d + j), f32x16_to_bf16(_mm512_loadu_ps(s + j)));
#endif
            for (; j < row_elems; j++) d[j] = to_bf16(s[j]);
        }
    }
    return CPLLM_OK;
}

/* silu(g) = g * sigmoid(g), sigmoid from e = exp(-|g|): 1 / (1 + e) for g >= 0, e / (1 + e) below (no overflow).
 * Within about 3e-7 of torch's g / (1 + exp(-g)) (relative); what matters here is that the eager MLP and the fused
 * decode layer both run this one function. */
static inline float silu(float g) {
    const float e = exp_nonpositive(g < 0.0f ? g : -g);
    return g * ((g >= 0.0f ? 1.0f : e) / (1.0f + e));
}

#if defined(__AVX512F__)
static inline __m512 silu16(__m512 g) {
    const __m512 e = exp16_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
    const __mmask16 positive = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_GE_OQ);
    const __m512 numerator = _mm512_mask_blend_ps(positive, e, _mm512_set1_ps(1.0f));
    return _mm512_mul_ps(g, _mm512_div_ps(numerator, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
}
#endif

/* gate_up [batch, 2 * inter] (gate | up) -> out [batch, inter] = silu(gate) * up, rows over `threads`. */
void cpllm_silu_mul(const float *gate_up, int64_t batch, int64_t inter, float *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (batch * inter >= 65536)
    for (int64_t b = 0; b < batch; b++) {
        const float *g = gate_up + b * 2 * inter, *u = g + inter;
        float *o = out + b * inter;
        int64_t i = 0;
#if defined(__AVX512F__)
        for (; i + 16 <= inter; i += 16)
            _mm512_storeu_ps(o + i, _mm512_mul_ps(silu16(_mm512_loadu_ps(g + i)), _mm512_loadu_ps(u + i)));
#endif
        for (; i < inter; i++) o[i] = silu(g[i]) * u[i];
    }
}

/* cpllm_silu_mul on bfloat16 gate | up rows (a bf16 GEMM's output, widened exactly), out in float32 or, with
 * out_bf16, rounded to bfloat16 as torch rounds: the bits the float32 kernel followed by torch's cast give. */
void cpllm_silu_mul_bf16(const uint16_t *gate_up, int64_t batch, int64_t inter, void *out, int out_bf16,
                         int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (batch * inter >= 65536)
    for (int64_t b = 0; b < batch; b++) {
        const uint16_t *g = gate_up + b * 2 * inter, *u = g + inter;
        float *o32 = (float *)out + b * inter;
        uint16_t *o16 = (uint16_t *)out + b * inter;
        int64_t i = 0;
#if defined(__AVX512F__)
        for (; i + 16 <= inter; i += 16) {
            const __m512 y = _mm512_mul_ps(silu16(bf16x16_to_f32(g + i)), bf16x16_to_f32(u + i));
            if (out_bf16) _mm256_storeu_si256((__m256i *)(o16 + i), f32x16_to_bf16(y));
            else _mm512_storeu_ps(o32 + i, y);
        }
#endif
        for (; i < inter; i++) {
            const float y = silu(from_bf16(g[i])) * from_bf16(u[i]);
            if (out_bf16) o16[i] = to_bf16(y);
            else o32[i] = y;
        }
    }
}
