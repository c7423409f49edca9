/* The lightning indexer's scores of DeepSeek sparse attention (cpllm/layers/sparse_mla/indexer.py), read in place
 * from the paged index pool:
 *
 *     out[l, t] = -inf                                                 where key_pos[t] > query_pos[l]
 *               = sum_h w[l, h] * max(0, (q[l, h, :] . pool[slots[t], :]) * scale)   otherwise
 *
 * q[l, h, d] at q + l * q_stride + h * d_width (float32), w [L, heads] float32 contiguous, the pool [num_slots,
 * d_width] float32, float16 or bfloat16 (pool_stride elements from one slot to the next), out [L, T] float32.
 * The torch form gathers every key into a float32 copy and materializes [rows, heads, T] products; this reads each
 * key once per row, where it lies, and skips the keys a row may not see (half the work of a causal prompt).
 *
 * Heads run in the 16 lanes of a vector: q of one row is transposed once, qt[d][head] (heads padded with zero
 * queries of weight zero to a multiple of 16), and four keys at a time accumulate `heads` dot products each as
 * FMAs of a broadcast key element with the rows of qt. A key's score is summed in the same order whichever
 * block, rank or call it falls in, so every rank of a KV-shard group scores a key alike (the top-k's candidates
 * are then the one-rank scores, bit for bit).
 *
 * Returns CPLLM_OK; CPLLM_SLOT_OUT_OF_RANGE (nothing written) for a slot outside the pool; CPLLM_NO_MEMORY; 2 when
 * built without AVX-512 (the caller runs the torch form).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernel_status.h"

enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2 };

#if defined(__AVX512F__)
#include <immintrin.h>

enum { KEYS = 4, MAX_VECS = 4, KEY_CHUNK = 256 };
/* KEYS keys share each load of qt; up to MAX_VECS vectors of heads (64) at once, wider head counts in several
 * passes; KEY_CHUNK keys of one row are a work item. */

typedef struct {
    const float *q, *w;
    const void *pool;
    const int64_t *slots, *key_pos, *query_pos;
    int64_t q_stride, pool_stride, n_keys;
    int n_rows, heads, width, dtype, vecs;
    float scale;
    float *qt;   /* [n_rows][width][vecs * 16] */
    float *wp;   /* [n_rows][vecs * 16] */
    float *out;
} Problem;

static inline void key_to_float(const Problem *p, int64_t slot, float *dst) {
    const int64_t at = slot * p->pool_stride;
    if (p->dtype == KV_F32) {
        memcpy(dst, (const float *)p->pool + at, sizeof(float) * p->width);
    } else if (p->dtype == KV_BF16) {
        const uint16_t *src = (const uint16_t *)p->pool + at;
        for (int d = 0; d < p->width; d++) {
            const uint32_t bits = (uint32_t)src[d] << 16;
            memcpy(dst + d, &bits, sizeof(float));
        }
    } else {
        const _Float16 *src = (const _Float16 *)p->pool + at;
        for (int d = 0; d < p->width; d++) dst[d] = (float)src[d];
    }
}

/* One pass over NV (a constant once inlined: the accumulators stay in registers) vectors of heads starting at
 * lane 16 * v0: total[j] += sum over those heads of w * max(0, scale * q . k[j]). */
static inline __attribute__((always_inline)) void heads_pass(const Problem *p, const float *qt, const float *wp,
                                                            int v0, const int NV, float k[KEYS][512],
                                                            __m512 total[KEYS]) {
    const __m512 scale = _mm512_set1_ps(p->scale), zero = _mm512_setzero_ps();
    __m512 acc[KEYS][MAX_VECS];
    for (int j = 0; j < KEYS; j++)
        for (int v = 0; v < NV; v++) acc[j][v] = zero;
    const int64_t lanes = (int64_t)p->vecs * 16;
    for (int d = 0; d < p->width; d++) {
        const float *row = qt + d * lanes + v0 * 16;
        for (int v = 0; v < NV; v++) {
            const __m512 qv = _mm512_loadu_ps(row + v * 16);
            for (int j = 0; j < KEYS; j++) acc[j][v] = _mm512_fmadd_ps(_mm512_set1_ps(k[j][d]), qv, acc[j][v]);
        }
    }
    for (int v = 0; v < NV; v++) {
        const __m512 wv = _mm512_loadu_ps(wp + (v0 + v) * 16);
        for (int j = 0; j < KEYS; j++)
            total[j] = _mm512_fmadd_ps(wv, _mm512_max_ps(_mm512_mul_ps(acc[j][v], scale), zero), total[j]);
    }
}

/* Scores of `count` (<= KEYS) keys, whose float32 rows are k[j], for row l. */
static void score_keys(const Problem *p, int l, float k[KEYS][512], int count, float *scores) {
    const float *qt = p->qt + (int64_t)l * p->width * p->vecs * 16;
    const float *wp = p->wp + (int64_t)l * p->vecs * 16;
    __m512 total[KEYS];
    for (int j = 0; j < KEYS; j++) total[j] = _mm512_setzero_ps();
    for (int v0 = 0; v0 < p->vecs; v0 += MAX_VECS) {
        switch (p->vecs - v0 < MAX_VECS ? p->vecs - v0 : MAX_VECS) {
            case 1: heads_pass(p, qt, wp, v0, 1, k, total); break;
            case 2: heads_pass(p, qt, wp, v0, 2, k, total); break;
            case 3: heads_pass(p, qt, wp, v0, 3, k, total); break;
            default: heads_pass(p, qt, wp, v0, 4, k, total); break;
        }
    }
    for (int j = 0; j < count; j++) scores[j] = _mm512_reduce_add_ps(total[j]);
}

/* Keys [t0, t1) of row l. */
static void score_chunk(const Problem *p, int l, int64_t t0, int64_t t1) {
    float k[KEYS][512] __attribute__((aligned(64)));
    float *out = p->out + (int64_t)l * p->n_keys;
    const int64_t qpos = p->query_pos[l];
    for (int64_t t = t0; t < t1; t += KEYS) {
        const int count = t1 - t < KEYS ? (int)(t1 - t) : KEYS;
        int seen = 0;
        for (int j = 0; j < KEYS; j++) {
            const int real = j < count && p->key_pos[t + j] <= qpos;
            seen |= real;
            if (real) key_to_float(p, p->slots[t + j], k[j]);
            else memset(k[j], 0, sizeof(float) * p->width);
        }
        float scores[KEYS];
        if (seen) score_keys(p, l, k, count, scores);
        for (int j = 0; j < count; j++) out[t + j] = (seen && p->key_pos[t + j] <= qpos) ? scores[j] : -INFINITY;
    }
}

static void transpose_row(const Problem *p, int l) {
    const int lanes = p->vecs * 16;
    float *qt = p->qt + (int64_t)l * p->width * lanes, *wp = p->wp + (int64_t)l * lanes;
    const float *q = p->q + l * p->q_stride;
    memset(qt, 0, sizeof(float) * p->width * lanes);
    memset(wp, 0, sizeof(float) * lanes);
    for (int h = 0; h < p->heads; h++) {
        wp[h] = p->w[(int64_t)l * p->heads + h];
        for (int d = 0; d < p->width; d++) qt[(int64_t)d * lanes + h] = q[(int64_t)h * p->width + d];
    }
}

int cpllm_index_scores(const float *q, int64_t q_stride, const float *w, int n_rows, int heads, int width,
                       const void *pool, int dtype, int64_t pool_stride, int64_t num_slots, const int64_t *slots,
                       const int64_t *key_pos, int64_t n_keys, const int64_t *query_pos, float scale, int threads,
                       float *out) {
    if (width > 512 || width < 1 || heads < 1) return CPLLM_UNSUPPORTED_SHAPE;
    if (cpllm_any_outside(slots, n_keys, num_slots)) return CPLLM_SLOT_OUT_OF_RANGE;
    Problem p = {.q = q, .w = w, .pool = pool, .slots = slots, .key_pos = key_pos, .query_pos = query_pos,
                 .q_stride = q_stride, .pool_stride = pool_stride, .n_keys = n_keys, .n_rows = n_rows,
                 .heads = heads, .width = width, .dtype = dtype, .vecs = (heads + 15) / 16, .scale = scale,
                 .out = out};
    const int64_t lanes = p.vecs * 16;
    p.qt = aligned_alloc(64, ((sizeof(float) * n_rows * width * lanes) + 63) / 64 * 64);
    p.wp = aligned_alloc(64, ((sizeof(float) * n_rows * lanes) + 63) / 64 * 64);
    if (p.qt == NULL || p.wp == NULL) {
        free(p.qt);
        free(p.wp);
        return CPLLM_NO_MEMORY;
    }
    const int64_t chunks = (n_keys + KEY_CHUNK - 1) / KEY_CHUNK, items = chunks * n_rows;
#pragma omp parallel num_threads(threads) if (items > 1)
    {
#pragma omp for schedule(static)
        for (int l = 0; l < n_rows; l++) transpose_row(&p, l);
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            const int l = (int)(item / chunks);
            const int64_t t0 = (item % chunks) * KEY_CHUNK;
            score_chunk(&p, l, t0, t0 + KEY_CHUNK < n_keys ? t0 + KEY_CHUNK : n_keys);
        }
    }
    free(p.qt);
    free(p.wp);
    return CPLLM_OK;
}

#else

int cpllm_index_scores(const float *q, int64_t q_stride, const float *w, int n_rows, int heads, int width,
                       const void *pool, int dtype, int64_t pool_stride, int64_t num_slots, const int64_t *slots,
                       const int64_t *key_pos, int64_t n_keys, const int64_t *query_pos, float scale, int threads,
                       float *out) {
    return 2;
}

#endif
