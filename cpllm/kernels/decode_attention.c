/* Single-token (decode) attention read in place from a paged K/V pool.
 *
 * Pool layout (one layer): [num_slots, Hkv, D], float32, float16 or bfloat16. Request b's context is the slots
 * slots[b * slot_stride + 0 .. lengths[b] - 1]. Query head j reads KV head j / (Hq / Hkv).
 *
 * Work is split into units (request, run of consecutive context positions); each unit reads every KV head of
 * its slots once (one contiguous [Hkv, D] row per slot), keeps its scores for all query heads in a small buffer,
 * and leaves a partial output with its log-sum-exp. Partials of a request are merged exactly afterwards
 * (log-sum-exp weights; docs/context_parallel.md, "Exact merge"). Accumulation is float32 throughout.
 *
 * Consecutive rows whose contexts are prefixes of one another's (the same slots: a verify chunk of speculative
 * decoding run as single-token rows, each seeing one position more) form one group, and a unit then serves every
 * row of its group: each K/V row is read once for all of them, where row by row it was read once per row (at
 * SmolLM2's shapes and context 1.3K, 58 MB per row). Each row still computes exactly what it computes alone with
 * the same units: its own positions, in the same order.
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

/* A thread's scratch for the AVX-512 unit: a transposed key tile (16 positions, head_dim <= 128), then the staged
 * pool rows (STAGED_ROWS rows of Hkv * D floats). */
enum { KEY_TILE_FLOATS = 16 * 128, STAGED_ROWS = 64 };

/* Rows a group takes for the group unit; fewer run the row unit each (measured, SmolLM2's K/V at 1.3K positions from
 * memory, one thread, 30 layers: 2 rows 3.3 ms row by row against 4.2 as a group, 3 rows 4.7 against 5.1, 4 rows
 * 5.9 against 5.4, 9 rows 12.4 against 8.3). */
enum { GROUP_UNIT_ROWS = 4 };

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

/* unit_softmax on 16 positions at a time (the tail masked), query head j's `count` scores at scores + j * stride. */
static inline void softmax_avx512(float *restrict scores, int count, int64_t stride, int hq, float *max_out,
                                  float *sum_out) {
    for (int j = 0; j < hq; j++) {
        float *s = scores + j * stride;
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

/* Ask for the pool row `ahead` positions on (if there is one): the slots are indirect (blocks scattered over the
 * pool), so the hardware prefetcher cannot see where the next block starts. Into L2 (T1), not L1: an L1 prefetch
 * holds one of the core's few line-fill buffers until its line arrives, which kept one thread near 9 GB/s; L2's
 * miss queue is deeper (measured, float32 K/V of SmolLM2's shapes at context 2,048 and 8,192, one thread: 9 to
 * 16-18 GB/s). */
#define PREFETCH_AHEAD 32
static inline __attribute__((always_inline)) void prefetch_row(const void *pool, const int64_t *slots, int t,
                                                              int ahead, int count, int row_bytes) {
    if (t + ahead < count) {
        const char *p = (const char *)pool + slots[t + ahead] * row_bytes;
        for (int b = 0; b < row_bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T1);
    }
}

/* r[i] lane l <- r[l] lane i: a 16 x 16 block of floats transposed in registers. */
static inline __attribute__((always_inline)) void transpose16(__m512 *r) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xDD);
        t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xDD);
    }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
    }
}

/* Pool rows slots[0 .. n) as float32 into stage [n, row_len], each row read whole and the rows in order, row t + ahead
 * asked for meanwhile (below `count`): every KV head's pass then reads them from L1 or L2. */
static inline __attribute__((always_inline)) void stage_rows(const void *pool, const int dtype, const int64_t *slots,
                                                            int n, int ahead, int count, int row_len,
                                                            float *restrict stage) {
    const int elem = dtype == KV_F32 ? 4 : 2;
    for (int t = 0; t < n; t++) {
        prefetch_row(pool, slots, t, ahead, count, row_len * elem);
        for (int e = 0; e < row_len; e += 16)
            _mm512_store_ps(stage + (int64_t)t * row_len + e, load16(pool, dtype, slots[t] * (int64_t)row_len + e));
    }
}

/* The keys of `nt` <= 16 staged positions (stage [nt, row_len]) of one KV head (element `head` of each row),
 * transposed: kt[c * 16 + lane] = element c of position lane's key (lanes past nt zero). */
static inline __attribute__((always_inline)) void key_tile(const float *stage, int nt, int row_len, int head,
                                                          const int vecs, float *restrict kt) {
    for (int cb = 0; cb < vecs; cb++) {
        __m512 r[16];
        for (int t = 0; t < 16; t++)
            r[t] = t < nt ? _mm512_load_ps(stage + (int64_t)t * row_len + head + cb * 16) : _mm512_setzero_ps();
        transpose16(r);
        for (int i = 0; i < 16; i++) _mm512_store_ps(kt + (cb * 16 + i) * 16, r[i]);
    }
}

enum { SCORE_QUERIES = 6, VALUE_REGISTERS = 24, VALUE_SPAN = STAGED_ROWS };

/* scale * q . k of NQ queries (qs[i]) at a tile's positions (kt, from key_tile), the `live` lanes into ss[i]: each
 * score sums its d products in order, one lane per position. */
static inline __attribute__((always_inline)) void tile_scores(const float *restrict kt, const float *const *qs,
                                                             float *const *ss, const int NQ, const int d, float scale,
                                                             __mmask16 live) {
    __m512 acc[SCORE_QUERIES];
    for (int i = 0; i < NQ; i++) acc[i] = _mm512_setzero_ps();
    for (int c = 0; c < d; c++) {
        const __m512 kc = _mm512_load_ps(kt + c * 16);
        for (int i = 0; i < NQ; i++) acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(qs[i][c]), kc, acc[i]);
    }
    for (int i = 0; i < NQ; i++) _mm512_mask_storeu_ps(ss[i], live, _mm512_mul_ps(acc[i], _mm512_set1_ps(scale)));
}

/* os[i] (+)= sum over positions t < span of ps[i][t] v_t for NQ queries of one KV head (element `head` of each
 * staged V row, stage [span, row_len]), in position order, the sums held in registers, then stored (`add` 0) or
 * added to os. */
static inline __attribute__((always_inline)) void head_values(const float *stage, int span, int row_len, int head,
                                                             const int vecs, const float *const *ps, float *const *os,
                                                             const int NQ, int add) {
    __m512 acc[VALUE_REGISTERS];
    for (int i = 0; i < NQ * vecs; i++) acc[i] = _mm512_setzero_ps();
    for (int t = 0; t < span; t++) {
        __m512 v[MAX_VECS];
        load_head(stage, KV_F32, (int64_t)t * row_len + head, vecs, v);
        for (int i = 0; i < NQ; i++) {
            const __m512 p = _mm512_set1_ps(ps[i][t]);
            for (int c = 0; c < vecs; c++) acc[i * vecs + c] = _mm512_fmadd_ps(p, v[c], acc[i * vecs + c]);
        }
    }
    for (int i = 0; i < NQ; i++)
        for (int c = 0; c < vecs; c++)
            _mm512_storeu_ps(os[i] + c * 16, add ? _mm512_add_ps(_mm512_loadu_ps(os[i] + c * 16), acc[i * vecs + c])
                                                 : acc[i * vecs + c]);
}

/* The unit of one row (a decode row, or each row of a group under GROUP_UNIT_ROWS): scores one position at a time,
 * each KV head's row loaded once for the query heads that share it, a horizontal sum per score. The group unit
 * below sums in another order (so a group's rows round differently from rows alone); at one row this one keeps the
 * memory busier while it computes (1.7 against 3.3 ms, at the shapes of GROUP_UNIT_ROWS). */
static inline __attribute__((always_inline)) void row_unit_avx512(
        const float *restrict q, const void *k_pool, const void *v_pool, const int dtype, const int64_t *slots,
        int count, int hq, int hkv, const int d, float scale, float *restrict scores, float *restrict stats,
        float *restrict out, float *restrict lse) {
    const int group = hq / hkv, vecs = d / 16, row_len = hkv * d;
    const int row_bytes = row_len * (dtype == KV_F32 ? 4 : 2);
    for (int t = 0; t < count; t++) {
        const int64_t row = slots[t] * row_len;
        prefetch_row(k_pool, slots, t, PREFETCH_AHEAD, count, row_bytes);
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
    softmax_avx512(scores, count, count, hq, stats, stats + hq);
    for (int j = 0; j < hq * vecs; j++) _mm512_storeu_ps(out + j * 16, _mm512_setzero_ps());
    for (int t = 0; t < count; t++) {
        const int64_t row = slots[t] * row_len;
        prefetch_row(v_pool, slots, t, PREFETCH_AHEAD, count, row_bytes);
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


/* One unit for the `rows` rows of a group: row r (query q + r * hq * d) reads the first counts[r] positions of
 * `slots` (counts non-decreasing, the last the most), its scores at scores + r * hq * count. Per KV head, the keys
 * of 16 positions at a time are transposed once for every query that reads them (a query per position per lane:
 * no horizontal sums), then each value row is read once per block of queries whose sums stay in registers. A row
 * scores the group's later positions too, which its softmax leaves out (weight 0: they add exact zeros to its
 * sums), so each row's results are the bits of a unit of its own. `work`: a thread's scratch (KEY_TILE_FLOATS, then
 * STAGED_ROWS pool rows), 64-byte aligned. */
static inline __attribute__((always_inline)) void unit_avx512(
        const float *restrict q, const void *k_pool, const void *v_pool, const int dtype, const int64_t *slots,
        const int *counts, int rows, int hq, int hkv, const int d, float scale, float *restrict scores,
        float *restrict stats, float *const *outs, float *const *lses, float *restrict work) {
    const int group = hq / hkv, vecs = d / 16, row_len = hkv * d, count = counts[rows - 1];
    float *kt = work, *stage = work + KEY_TILE_FLOATS;
    int first = 0;
    while (counts[first] <= 0) first++;  /* rows first.. read this unit (a suffix: counts are sorted) */
    const int queries = (rows - first) * group;  /* per KV head: row first + i / group, head h * group + i % group */
#define QUERY(i) ((first + (i) / group) * hq + h * group + (i) % group)
    for (int t0 = 0; t0 < count; t0 += 16) {
        const int nt = count - t0 < 16 ? count - t0 : 16;
        stage_rows(k_pool, dtype, slots + t0, nt, PREFETCH_AHEAD, count - t0, row_len, stage);
        for (int h = 0; h < hkv; h++) {
            key_tile(stage, nt, row_len, h * d, vecs, kt);
            for (int i0 = 0; i0 < queries; i0 += SCORE_QUERIES) {
                const float *qs[SCORE_QUERIES];
                float *ss[SCORE_QUERIES];
                const int nq = queries - i0 < SCORE_QUERIES ? queries - i0 : SCORE_QUERIES;
                for (int i = 0; i < nq; i++) {
                    qs[i] = q + (int64_t)QUERY(i0 + i) * d;
                    ss[i] = scores + (int64_t)QUERY(i0 + i) * count + t0;
                }
                switch (nq) {
#define SCORES(N) case N: tile_scores(kt, qs, ss, N, d, scale, tail_mask(nt)); break;
                    SCORES(1) SCORES(2) SCORES(3) SCORES(4) SCORES(5) SCORES(6)
#undef SCORES
                }
            }
        }
    }
    for (int r = first; r < rows; r++) {
        float *sr = scores + (int64_t)r * hq * count;
        softmax_avx512(sr, counts[r], count, hq, stats + 2 * r * hq, stats + (2 * r + 1) * hq);
        for (int j = 0; j < hq; j++) memset(sr + (int64_t)j * count + counts[r], 0, sizeof(float) * (count - counts[r]));
    }
    const int block = VALUE_REGISTERS / vecs;  /* queries whose sums fit the registers */
    for (int s0 = 0; s0 < count; s0 += VALUE_SPAN) {  /* a span's V rows staged, then read by every head's passes */
        const int span = count - s0 < VALUE_SPAN ? count - s0 : VALUE_SPAN;
        stage_rows(v_pool, dtype, slots + s0, span, PREFETCH_AHEAD, count - s0, row_len, stage);
        for (int h = 0; h < hkv; h++)
            for (int i0 = 0; i0 < queries; i0 += block) {
                const float *ps[VALUE_REGISTERS];
                float *os[VALUE_REGISTERS];
                const int nq = queries - i0 < block ? queries - i0 : block;
                for (int i = 0; i < nq; i++) {
                    const int at = QUERY(i0 + i);
                    ps[i] = scores + (int64_t)at * count + s0;
                    os[i] = outs[at / hq] + (at % hq) * d;
                }
                switch (nq) {
#define VALUES(N) case N: head_values(stage, span, row_len, h * d, vecs, ps, os, N, s0 > 0); break;
                    VALUES(1) VALUES(2) VALUES(3) VALUES(4) VALUES(5) VALUES(6)
#undef VALUES
                }
            }
    }
#undef QUERY
    for (int r = first; r < rows; r++) {
        const float *st = stats + 2 * r * hq;
        for (int j = 0; j < hq; j++) {
            const __m512 inv = _mm512_set1_ps(1.0f / st[hq + j]);
            for (int c = 0; c < vecs; c++)
                _mm512_storeu_ps(outs[r] + j * d + c * 16, _mm512_mul_ps(inv, _mm512_loadu_ps(outs[r] + j * d + c * 16)));
            lses[r][j] = st[j] + logf(st[hq + j]);
        }
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

enum { MAX_GROUP_ROWS = 64, MIN_GROUP_UNIT = 128 };

/* Splits rows [0, batch) into groups of consecutive rows, each row's context a prefix of the next one's (a length
 * no shorter, the same slots up to it), at most MAX_GROUP_ROWS a group: group i is rows starts[i] .. starts[i + 1]
 * - 1 (starts [batch + 1]). Returns the number of groups. Comparing the slots costs a pass over a row's slot
 * table, small against the K/V rows it saves reading. */
static int context_groups(const int64_t *slots, int64_t slot_stride, const int64_t *lengths, int batch, int *starts) {
    int groups = 0;
    for (int b = 0; b < batch; b++) {
        const int extends = b > 0 && b - starts[groups - 1] < MAX_GROUP_ROWS && lengths[b] >= lengths[b - 1]
            && memcmp(slots + (int64_t)b * slot_stride, slots + (int64_t)(b - 1) * slot_stride,
                      sizeof(int64_t) * lengths[b - 1]) == 0;
        if (!extends) starts[groups++] = b;
    }
    starts[groups] = batch;
    return groups;
}

/* Unit i of the group of rows b0 .. b0 + rows - 1 (its positions [i chunk, (i + 1) chunk) of the longest context):
 * each row's partial out and lse; a row that reads none of these positions, or all rows where a slot is outside
 * the pool (returns 1 then, nothing read), get (0, -inf). */
static int group_unit(const float *q, const void *k_pool, const void *v_pool, int dtype, int64_t num_slots,
                      const int64_t *slots, const int64_t *lengths, int b0, int rows, int64_t i, int hq, int hkv,
                      int d, float scale, int chunk, float *const *outs, float *const *lses, float *scores,
                      float *stats, float *row_buf, float *key_buf) {
    int counts[MAX_GROUP_ROWS];
    for (int r = 0; r < rows; r++) {
        const int64_t left = lengths[b0 + r] - i * chunk;
        counts[r] = left <= 0 ? 0 : left < chunk ? (int)left : chunk;
    }
    const int count = counts[rows - 1];
    const int64_t *s = slots + i * chunk;
    const int outside = count > 0 && cpllm_any_outside(s, count, num_slots);
    for (int r = 0; r < rows; r++)
        if (counts[r] <= 0 || outside) {
            memset(outs[r], 0, sizeof(float) * (size_t)hq * d);
            for (int j = 0; j < hq; j++) lses[r][j] = -INFINITY;
        }
    if (count <= 0 || outside) return outside;
    const float *qb = q + (size_t)b0 * hq * d;
#if defined(__AVX512F__)
    if (d == 64 || d == 128) {  /* constants at each call: the row stays in registers */
#define ROW(DT, D, r) row_unit_avx512(qb + (size_t)(r) * hq * d, k_pool, v_pool, DT, s, counts[r], hq, hkv, D, scale, \
                                      scores, stats, outs[r], lses[r])
#define UNIT(DT, D) rows >= GROUP_UNIT_ROWS \
    ? unit_avx512(qb, k_pool, v_pool, DT, s, counts, rows, hq, hkv, D, scale, scores, stats, outs, lses, key_buf) \
    : (void)({ for (int r = 0; r < rows; r++) if (counts[r] > 0) ROW(DT, D, r); })
        if (dtype == KV_F32) d == 64 ? UNIT(KV_F32, 64) : UNIT(KV_F32, 128);
        else if (dtype == KV_F16) d == 64 ? UNIT(KV_F16, 64) : UNIT(KV_F16, 128);
        else d == 64 ? UNIT(KV_BF16, 64) : UNIT(KV_BF16, 128);
#undef UNIT
#undef ROW
        return 0;
    }
#endif
    for (int r = 0; r < rows; r++) {  /* the plain C path: row by row */
        if (counts[r] <= 0) continue;
        const float *qr = qb + (size_t)r * hq * d;
        unit_scores(qr, k_pool, dtype, s, counts[r], hq, hkv, d, scale, scores, row_buf);
        unit_softmax(scores, counts[r], hq, stats, stats + hq);
        unit_values(scores, v_pool, dtype, s, counts[r], hq, hkv, d, stats, stats + hq, outs[r], lses[r], row_buf);
    }
    return 0;
}

/* q [B, Hq, D] float32; k_pool/v_pool [num_slots, Hkv, D] of `dtype`; slots [B, slot_stride] int64; lengths [B]
 * int64; out [B, Hq, D] float32; lse [B, Hq] float32. `chunk`: positions per unit (where rows share contexts, and so
 * units, with threads > 1, smaller, down to MIN_GROUP_UNIT: about four units a thread still). Returns 0;
 * CPLLM_NO_MEMORY; CPLLM_LENGTH_OUT_OF_RANGE (a length outside [0, slot_stride], before any work);
 * CPLLM_SLOT_OUT_OF_RANGE (a slot of a request's context outside [0, num_slots): each unit checks its slots as it
 * starts, and one with a bad slot reads no row, leaving (0, -inf)). */
int cpllm_paged_decode_attention(const float *q, const void *k_pool, const void *v_pool, int dtype, int64_t num_slots,
                                 const int64_t *slots, int64_t slot_stride, const int64_t *lengths, int batch,
                                 int hq, int hkv, int d, float scale, int chunk, int threads, float *out,
                                 float *lse) {
    for (int b = 0; b < batch; b++)
        if (lengths[b] < 0 || lengths[b] > slot_stride) return CPLLM_LENGTH_OUT_OF_RANGE;
    int *starts = malloc(sizeof(int) * (batch + 1));
    int64_t *first_unit = malloc(sizeof(int64_t) * (batch + 1)), *first_part = malloc(sizeof(int64_t) * (batch + 1));
    if (!starts || !first_unit || !first_part) {
        free(starts), free(first_unit), free(first_part);
        return CPLLM_NO_MEMORY;
    }
    const int groups = context_groups(slots, slot_stride, lengths, batch, starts);
    int max_rows = 1;
    int64_t positions = 0;
    for (int g = 0; g < groups; g++) {
        max_rows = starts[g + 1] - starts[g] > max_rows ? starts[g + 1] - starts[g] : max_rows;
        positions += lengths[starts[g + 1] - 1];
    }
    if (groups < batch && threads > 1) {
        int64_t per_unit = (positions + 4 * threads - 1) / (4 * threads);
        if (per_unit < MIN_GROUP_UNIT) per_unit = MIN_GROUP_UNIT;
        if (per_unit < chunk) chunk = (int)per_unit;
    }
    /* units of group g: first_unit[g] ..; row b's partials: first_part[b] .. (one per unit of its group) */
    first_unit[0] = first_part[0] = 0;
    for (int g = 0; g < groups; g++) {
        const int64_t units = (lengths[starts[g + 1] - 1] + chunk - 1) / chunk;
        first_unit[g + 1] = first_unit[g] + (units > 0 ? units : 1);
        for (int b = starts[g]; b < starts[g + 1]; b++) first_part[b + 1] = first_part[b] + first_unit[g + 1] - first_unit[g];
    }
    const int64_t total_units = first_unit[groups], total_parts = first_part[batch];
    float *part_out = malloc(sizeof(float) * (size_t)total_parts * hq * d);
    float *part_lse = malloc(sizeof(float) * (size_t)total_parts * hq);
    int failed = part_out == NULL || part_lse == NULL, bad_slot = 0;
    if (!failed) {
#pragma omp parallel num_threads(threads)
        {
            float *scores = malloc(sizeof(float) * (size_t)hq * chunk * max_rows);
            float *row_buf = malloc(sizeof(float) * (size_t)hkv * d);
            float *key_buf = aligned_alloc(64, sizeof(float) * (KEY_TILE_FLOATS + (size_t)STAGED_ROWS * hkv * d));
            float *stats = malloc(sizeof(float) * 2 * (size_t)hq * max_rows);
            if (!scores || !row_buf || !stats || !key_buf) {
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
                    int g = 0;
                    while (first_unit[g + 1] <= u) g++;
                    const int b0 = starts[g], rows = starts[g + 1] - b0;
                    const int64_t i = u - first_unit[g];
                    float *outs[MAX_GROUP_ROWS], *lses[MAX_GROUP_ROWS];
                    for (int r = 0; r < rows; r++) {
                        outs[r] = part_out + (size_t)(first_part[b0 + r] + i) * hq * d;
                        lses[r] = part_lse + (size_t)(first_part[b0 + r] + i) * hq;
                    }
                    const int64_t *s = slots + (int64_t)(b0 + rows - 1) * slot_stride;  /* the longest context */
                    if (group_unit(q, k_pool, v_pool, dtype, num_slots, s, lengths, b0, rows, i, hq, hkv, d, scale,
                                   chunk, outs, lses, scores, stats, row_buf, key_buf)) {
#pragma omp atomic write
                        bad_slot = 1;
                    }
                }
            }
            free(scores);
            free(row_buf);
            free(key_buf);
            free(stats);
        }
    }
    if (!failed) {
        for (int b = 0; b < batch; b++) {
            const int64_t u = first_part[b];
            merge_partials(part_out + (size_t)u * hq * d, part_lse + (size_t)u * hq, (int)(first_part[b + 1] - u),
                           hq, d, out + (size_t)b * hq * d, lse + (size_t)b * hq);
        }
    }
    free(starts);
    free(first_unit);
    free(first_part);
    free(part_out);
    free(part_lse);
    return failed ? CPLLM_NO_MEMORY : bad_slot ? CPLLM_SLOT_OUT_OF_RANGE : CPLLM_OK;
}
