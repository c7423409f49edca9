/* Single-token (decode) attention read in place from a paged K/V pool.
 *
 * Pool layout (one layer): [num_slots, Hkv, D], float32, float16 or bfloat16. Request b's context is the slots
 * slots[b * slot_stride + 0 .. lengths[b] - 1]. Query head j reads KV head j / (Hq / Hkv).
 *
 * Work is split into units (request, run of consecutive context positions); each unit reads every KV head of
 * its slots once (one contiguous [Hkv, D] row per slot), keeps its scores for all query heads in a small buffer,
 * and leaves a partial output with its log-sum-exp. Partials of a request are merged exactly afterwards
 * (log-sum-exp weights; docs/context_parallel.md, "Exact merge"). Accumulation is float32 throughout.
 */
#include <math.h>
#include <stdint.h>
#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <stdlib.h>
#include <string.h>

#include "kernel_status.h"
#include "vector_exp.h"

enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2 };

/* One pool row [n] as float32 into dst (a no-op copy for float32 pools is avoided by the caller). */
static inline void row_to_f32(const void *src, int dtype, int n, float *restrict dst) {
    if (dtype == KV_F16) {
        const uint16_t *s = (const uint16_t *)src;
        int i = 0;
#if defined(__F16C__)
        for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i))));
#endif
        for (; i < n; i++) dst[i] = (float)((const _Float16 *)s)[i];
    } else {
        const uint16_t *s = (const uint16_t *)src;
        for (int i = 0; i < n; i++) {
            union { uint32_t u; float f; } v = { .u = (uint32_t)s[i] << 16 };
            dst[i] = v.f;
        }
    }
}

static inline const float *pool_row(const void *pool, int dtype, int64_t slot, int row_len, float *buf) {
    if (dtype == KV_F32) return (const float *)pool + slot * row_len;
    const int elem = 2;
    row_to_f32((const char *)pool + slot * row_len * elem, dtype, row_len, buf);
    return buf;
}

/* scores[j][t] = scale * q_j . k_t for positions t of one unit, all query heads j. */
static inline void unit_scores(const float *restrict q, const void *k_pool, int dtype, const int64_t *slots,
                               int count, int hq, int hkv, int d, float scale, float *restrict scores,
                               float *restrict row_buf) {
    const int group = hq / hkv, row_len = hkv * d;
    for (int t = 0; t < count; t++) {
        const float *k = pool_row(k_pool, dtype, slots[t], row_len, row_buf);
        for (int j = 0; j < hq; j++) {
            const float *kh = k + (j / group) * d, *qj = q + j * d;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int i = 0; i < d; i++) dot += qj[i] * kh[i];
            scores[j * count + t] = dot * scale;
        }
    }
}

/* Softmax numerators in place; max_out[j] and sum_out[j] per query head. */
static inline void unit_softmax(float *restrict scores, int count, int hq, float *max_out, float *sum_out) {
    for (int j = 0; j < hq; j++) {
        float *s = scores + j * count, m = -INFINITY, total = 0.0f;
#pragma omp simd reduction(max : m)
        for (int t = 0; t < count; t++) m = s[t] > m ? s[t] : m;
#pragma omp simd reduction(+ : total)
        for (int t = 0; t < count; t++) {
            s[t] = exp_nonpositive(s[t] - m);
            total += s[t];
        }
        max_out[j] = m;
        sum_out[j] = total;
    }
}

/* out[j] = sum_t p[j][t] v_t / sum_j, lse[j] = max + log(sum). */
static inline void unit_values(const float *restrict probs, const void *v_pool, int dtype, const int64_t *slots,
                               int count, int hq, int hkv, int d, const float *max_in, const float *sum_in,
                               float *restrict out, float *restrict lse, float *restrict row_buf) {
    const int group = hq / hkv, row_len = hkv * d;
    memset(out, 0, sizeof(float) * (size_t)hq * d);
    for (int t = 0; t < count; t++) {
        const float *v = pool_row(v_pool, dtype, slots[t], row_len, row_buf);
        for (int j = 0; j < hq; j++) {
            const float p = probs[j * count + t], *vh = v + (j / group) * d;
            float *o = out + j * d;
            for (int i = 0; i < d; i++) o[i] += p * vh[i];
        }
    }
    for (int j = 0; j < hq; j++) {
        const float inv = 1.0f / sum_in[j];
        for (int i = 0; i < d; i++) out[j * d + i] *= inv;
        lse[j] = max_in[j] + logf(sum_in[j]);
    }
}

#if defined(__AVX512F__)
/* The same unit with AVX-512, for head_dim 64 or 128: 16 floats per register, the K/V row
 * widened straight from the pool, one horizontal sum per (position, query head). `dtype` is a constant at each
 * call site, so every branch on it folds away. */
#define MAX_VECS 8

static inline __attribute__((always_inline)) __m512 load16(const void *base, int dtype, int64_t at) {
    if (dtype == KV_F32) return _mm512_loadu_ps((const float *)base + at);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + at));
    if (dtype == KV_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* One KV head's row of `vecs` 16-float registers, widened from the pool's dtype. */
static inline __attribute__((always_inline)) void load_head(const void *pool, int dtype, int64_t at, int vecs,
                                                           __m512 *dst) {
    for (int c = 0; c < vecs; c++) dst[c] = load16(pool, dtype, at + c * 16);
}

/* The lanes of a 16-position step that still hold positions (`left` of them). */
static inline __mmask16 tail_mask(int left) {
    return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
}

/* unit_softmax on 16 positions at a time (the tail masked). */
static inline void softmax_avx512(float *restrict scores, int count, int hq, float *max_out, float *sum_out) {
    for (int j = 0; j < hq; j++) {
        float *s = scores + j * count;
        __m512 m = _mm512_set1_ps(-INFINITY), total = _mm512_setzero_ps();
        for (int t = 0; t < count; t += 16) {
            const __mmask16 live = tail_mask(count - t);
            m = _mm512_mask_max_ps(m, live, m, _mm512_maskz_loadu_ps(live, s + t));
        }
        const float peak = _mm512_reduce_max_ps(m);
        const __m512 shift = _mm512_set1_ps(peak);
        for (int t = 0; t < count; t += 16) {
            const __mmask16 live = tail_mask(count - t);
            const __m512 e = exp16_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, s + t), shift));
            _mm512_mask_storeu_ps(s + t, live, e);
            total = _mm512_mask_add_ps(total, live, total, e);
        }
        max_out[j] = peak;
        sum_out[j] = _mm512_reduce_add_ps(total);
    }
}

/* Ask for pool row `ahead` positions on: the slots are indirect (blocks scattered over the pool), so the hardware
 * prefetcher cannot see where the next block starts. Into L2 (T1), not L1: an L1 prefetch holds one of the core's
 * few line-fill buffers until its line arrives, which kept one thread near 9 GB/s; L2's miss queue is deeper
 * (measured, float32 K/V of SmolLM2's shapes at context 2,048 and 8,192, one thread: 9 to 16-18 GB/s). */
#define PREFETCH_AHEAD 32
static inline __attribute__((always_inline)) void prefetch_row(const void *pool, const int64_t *slots, int t,
                                                              int count, int row_bytes) {
    if (t + PREFETCH_AHEAD < count) {
        const char *p = (const char *)pool + slots[t + PREFETCH_AHEAD] * row_bytes;
        for (int b = 0; b < row_bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T1);
    }
}

static inline __attribute__((always_inline)) void unit_avx512(
        const float *restrict q, const void *k_pool, const void *v_pool, const int dtype, const int64_t *slots,
        int count, int hq, int hkv, const int d, float scale, float *restrict scores, float *restrict stats,
        float *restrict out, float *restrict lse) {
    const int group = hq / hkv, vecs = d / 16, row_len = hkv * d;
    const int row_bytes = row_len * (dtype == KV_F32 ? 4 : 2);
    for (int t = 0; t < count; t++) {
        const int64_t row = slots[t] * row_len;
        prefetch_row(k_pool, slots, t, count, row_bytes);
        for (int h = 0; h < hkv; h++) {
            __m512 k[MAX_VECS];
            load_head(k_pool, dtype, row + h * d, vecs, k);
            for (int g = 0; g < group; g++) {
                const int j = h * group + g;
                __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(q + j * d), k[0]);
                for (int c = 1; c < vecs; c++) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + j * d + c * 16), k[c], acc);
                scores[j * count + t] = _mm512_reduce_add_ps(acc) * scale;
            }
        }
    }
    softmax_avx512(scores, count, hq, stats, stats + hq);
    for (int j = 0; j < hq * vecs; j++) _mm512_storeu_ps(out + j * 16, _mm512_setzero_ps());
    for (int t = 0; t < count; t++) {
        const int64_t row = slots[t] * row_len;
        prefetch_row(v_pool, slots, t, count, row_bytes);
        for (int h = 0; h < hkv; h++) {
            __m512 v[MAX_VECS];
            load_head(v_pool, dtype, row + h * d, vecs, v);
            for (int g = 0; g < group; g++) {
                const int j = h * group + g;
                const __m512 p = _mm512_set1_ps(scores[j * count + t]);
                for (int c = 0; c < vecs; c++) {
                    float *o = out + j * d + c * 16;
                    _mm512_storeu_ps(o, _mm512_fmadd_ps(p, v[c], _mm512_loadu_ps(o)));
                }
            }
        }
    }
    for (int j = 0; j < hq; j++) {
        const __m512 inv = _mm512_set1_ps(1.0f / stats[hq + j]);
        for (int c = 0; c < vecs; c++) _mm512_storeu_ps(out + j * d + c * 16, _mm512_mul_ps(inv, _mm512_loadu_ps(out + j * d + c * 16)));
        lse[j] = stats[j] + logf(stats[hq + j]);
    }
}
#endif

/* Merge the partials (out [P, Hq, D], lse [P, Hq]) of one request into out_b [Hq, D], lse_b [Hq]. */
static void merge_partials(const float *outs, const float *lses, int parts, int hq, int d, float *out_b,
                           float *lse_b) {
    for (int j = 0; j < hq; j++) {
        float m = -INFINITY;
        for (int p = 0; p < parts; p++) m = lses[p * hq + j] > m ? lses[p * hq + j] : m;
        float *o = out_b + j * d;
        memset(o, 0, sizeof(float) * d);
        if (m == -INFINITY) {  /* no key at all: out 0, lse -inf */
            lse_b[j] = -INFINITY;
            continue;
        }
        float total = 0.0f;
        for (int p = 0; p < parts; p++) {
            const float w = expf(lses[p * hq + j] - m);
            total += w;
            const float *src = outs + ((size_t)p * hq + j) * d;
            for (int i = 0; i < d; i++) o[i] += w * src[i];
        }
        for (int i = 0; i < d; i++) o[i] /= total;
        lse_b[j] = m + logf(total);
    }
}

/* q [B, Hq, D] float32; k_pool/v_pool [num_slots, Hkv, D] of `dtype`; slots [B, slot_stride] int64; lengths [B]
 * int64; out [B, Hq, D] float32; lse [B, Hq] float32. `chunk`: positions per unit. Returns 0; CPLLM_NO_MEMORY;
 * CPLLM_LENGTH_OUT_OF_RANGE (a length outside [0, slot_stride], before any work); CPLLM_SLOT_OUT_OF_RANGE (a slot of
 * a request's context outside [0, num_slots): each unit checks its slots as it starts, and one with a bad slot reads
 * no row, leaving (0, -inf)). */
int cpllm_paged_decode_attention(const float *q, const void *k_pool, const void *v_pool, int dtype, int64_t num_slots,
                                 const int64_t *slots, int64_t slot_stride, const int64_t *lengths, int batch,
                                 int hq, int hkv, int d, float scale, int chunk, int threads, float *out,
                                 float *lse) {
    for (int b = 0; b < batch; b++)
        if (lengths[b] < 0 || lengths[b] > slot_stride) return CPLLM_LENGTH_OUT_OF_RANGE;
    int64_t *first_unit = malloc(sizeof(int64_t) * (batch + 1));
    if (!first_unit) return CPLLM_NO_MEMORY;
    first_unit[0] = 0;
    for (int b = 0; b < batch; b++) {
        const int64_t units = (lengths[b] + chunk - 1) / chunk;
        first_unit[b + 1] = first_unit[b] + (units > 0 ? units : 1);
    }
    const int64_t total_units = first_unit[batch];
    float *part_out = malloc(sizeof(float) * (size_t)total_units * hq * d);
    float *part_lse = malloc(sizeof(float) * (size_t)total_units * hq);
    int failed = part_out == NULL || part_lse == NULL, bad_slot = 0;
    if (!failed) {
#pragma omp parallel num_threads(threads)
        {
            float *scores = malloc(sizeof(float) * (size_t)hq * chunk);
            float *row_buf = malloc(sizeof(float) * (size_t)hkv * d);
            float *stats = malloc(sizeof(float) * 2 * (size_t)hq);
            if (!scores || !row_buf || !stats) {
#pragma omp atomic write
                failed = 1;
            }
#pragma omp barrier
            int team_failed;
#pragma omp atomic read
            team_failed = failed;
            if (!team_failed) { /* every thread takes the same branch: the loop below is shared work */
#pragma omp for schedule(dynamic, 1)
                for (int64_t u = 0; u < total_units; u++) {
                    int b = 0;
                    while (first_unit[b + 1] <= u) b++;
                    const int64_t start = (u - first_unit[b]) * chunk;
                    const int64_t left = lengths[b] - start;
                    const int count = left < chunk ? (int)left : chunk;
                    float *o = part_out + (size_t)u * hq * d, *l = part_lse + (size_t)u * hq;
                    const int64_t *s = slots + b * slot_stride + start;
                    const int outside = count > 0 && cpllm_any_outside(s, count, num_slots);
                    if (outside) {
#pragma omp atomic write
                        bad_slot = 1;
                    }
                    if (count <= 0 || outside) {
                        memset(o, 0, sizeof(float) * (size_t)hq * d);
                        for (int j = 0; j < hq; j++) l[j] = -INFINITY;
                        continue;
                    }
                    const float *qb = q + (size_t)b * hq * d;
#if defined(__AVX512F__)
                    if (d == 64 || d == 128) {  /* constants at each call: the row stays in registers */
#define UNIT(DT, D) unit_avx512(qb, k_pool, v_pool, DT, s, count, hq, hkv, D, scale, scores, stats, o, l)
                        if (dtype == KV_F32) d == 64 ? UNIT(KV_F32, 64) : UNIT(KV_F32, 128);
                        else if (dtype == KV_F16) d == 64 ? UNIT(KV_F16, 64) : UNIT(KV_F16, 128);
                        else d == 64 ? UNIT(KV_BF16, 64) : UNIT(KV_BF16, 128);
#undef UNIT
                        continue;
                    }
#endif
                    unit_scores(qb, k_pool, dtype, s, count, hq, hkv, d, scale, scores, row_buf);
                    unit_softmax(scores, count, hq, stats, stats + hq);
                    unit_values(scores, v_pool, dtype, s, count, hq, hkv, d, stats, stats + hq, o, l, row_buf);
                }
            }
            free(scores);
            free(row_buf);
            free(stats);
        }
    }
    if (!failed) {
        for (int b = 0; b < batch; b++) {
            const int64_t u = first_unit[b];
            merge_partials(part_out + (size_t)u * hq * d, part_lse + (size_t)u * hq, (int)(first_unit[b + 1] - u),
                           hq, d, out + (size_t)b * hq * d, lse + (size_t)b * hq);
        }
    }
    free(first_unit);
    free(part_out);
    free(part_lse);
    return failed ? CPLLM_NO_MEMORY : bad_slot ? CPLLM_SLOT_OUT_OF_RANGE : CPLLM_OK;
}
