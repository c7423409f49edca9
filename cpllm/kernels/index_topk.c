/* The top-k of the lightning indexer's scores (cpllm/layers/sparse_mla/topk.py), per row, by its tie rule: a higher
 * score first; between equal scores, the lower position first; between equal scores and positions, the lower
 * column first (what the torch form's two stable sorts give). The selection is bit for bit the torch form's.
 *
 * scores [rows, n] float32 (score_stride floats from one row to the next), positions [n] (pos_stride 0) or
 * [rows, n], int64 (pos_dtype 0) or int32 (1) -> out_scores [rows, kk] and out_pos [rows, kk] of the positions'
 * dtype, contiguous, best first, kk = min(k, n).
 *
 * Each (score, position) becomes one 64-bit key whose unsigned order is the rule's: the score's bits mapped so
 * that unsigned order is float order (-0 read as +0, every NaN above +inf, as torch's sort has them), then the
 * position reversed (lower is better). A radix select on the key's 11-bit digits, from the top, narrows the
 * candidates to the bucket holding the k-th key (a few passes over a shrinking list instead of sorting n keys);
 * a scan in column order then takes every key above the threshold and the first of those equal to it, and a
 * stable LSD radix sort puts the kk taken best first (equal keys keep their column order).
 *
 * Returns CPLLM_OK; CPLLM_UNSUPPORTED_SHAPE (nothing written) for a position outside [-2**31, 2**31), which the
 * key cannot hold (the caller runs the torch form); CPLLM_NO_MEMORY.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernel_status.h"

enum { DIGIT = 11, BINS = 1 << DIGIT, SORT_DIGIT = 8, SORT_BINS = 1 << SORT_DIGIT };

static inline uint64_t rank_key(float score, int64_t pos) {
    uint32_t bits;
    memcpy(&bits, &score, sizeof bits);
    if (bits == 0x80000000u) bits = 0;  /* -0 ties with +0 */
    uint32_t order = (bits & 0x80000000u) ? ~bits : bits | 0x80000000u;
    if ((bits & 0x7fffffffu) > 0x7f800000u) order = 0xffffffffu;  /* NaN: above every number, NaNs tie */
    const uint32_t pos_order = 0xffffffffu - (uint32_t)(pos + ((int64_t)1 << 31));
    return ((uint64_t)order << 32) | pos_order;
}

typedef struct {
    uint64_t *keys;    /* [n] the row's keys */
    uint32_t *cand;    /* [n] columns still in the threshold's bucket */
    uint64_t *sel[2];  /* [kk] taken keys, ping-pong for the sort */
    uint32_t *col[2];  /* [kk] their columns */
} Scratch;

/* The threshold: a key is taken if (key >> shift) > prefix, or if it equals prefix and it is among the first
 * `equal_taken` such keys in column order. */
typedef struct {
    uint64_t prefix;
    int shift;
    int64_t equal_taken;
} Threshold;

static Threshold radix_select(const uint64_t *keys, uint32_t *cand, int64_t n, int64_t k) {
    static const int FIRST_SHIFT = 64 - DIGIT;
    uint32_t hist[BINS];
    int64_t count = n, need = k;
    uint64_t prefix = 0;
    int shift = FIRST_SHIFT;
    for (;;) {
        const int width = shift > 0 ? DIGIT : DIGIT + shift;  /* the last digit holds the bits left */
        const int low = shift > 0 ? shift : 0;
        const uint64_t mask = ((uint64_t)1 << width) - 1;
        memset(hist, 0, sizeof hist);
        if (count == n && shift == FIRST_SHIFT) {
            for (int64_t i = 0; i < n; i++) hist[keys[i] >> low]++;
        } else {
            for (int64_t i = 0; i < count; i++) hist[(keys[cand[i]] >> low) & mask]++;
        }
        int64_t above = 0;
        int bin = (int)mask;
        while (above + hist[bin] < need) above += hist[bin--];
        need -= above;
        prefix = (prefix << width) | (uint64_t)bin;
        if (hist[bin] == need || low == 0) return (Threshold){prefix, low, need};
        /* keep the bucket's columns, in column order */
        int64_t kept = 0;
        if (count == n && shift == FIRST_SHIFT) {
            for (int64_t i = 0; i < n; i++)
                if ((keys[i] >> low) == prefix) cand[kept++] = (uint32_t)i;
        } else if (hist[bin] != count) {
            for (int64_t i = 0; i < count; i++)
                if (((keys[cand[i]] >> low) & mask) == (uint64_t)bin) cand[kept++] = cand[i];
        } else {
            kept = count;
        }
        count = kept;
        shift -= DIGIT;
    }
}

/* Stable LSD radix sort of (key, column) pairs by key, descending; the result ends in buffer 0 or 1, returned. */
static int sort_descending(Scratch *s, int64_t m) {
    uint32_t hist[SORT_BINS];
    int from = 0;
    for (int low = 0; low < 64; low += SORT_DIGIT) {
        memset(hist, 0, sizeof hist);
        const uint64_t *keys = s->sel[from];
        for (int64_t i = 0; i < m; i++) hist[(~keys[i] >> low) & (SORT_BINS - 1)]++;
        int single = 0;
        for (int b = 0; b < SORT_BINS; b++) single |= hist[b] == (uint32_t)m;
        if (single) continue;  /* every key has this digit: the pass would not move anything */
        uint32_t at = 0;
        for (int b = 0; b < SORT_BINS; b++) {
            const uint32_t h = hist[b];
            hist[b] = at;
            at += h;
        }
        const uint32_t *cols = s->col[from];
        uint64_t *to_keys = s->sel[1 - from];
        uint32_t *to_cols = s->col[1 - from];
        for (int64_t i = 0; i < m; i++) {
            const uint32_t dst = hist[(~keys[i] >> low) & (SORT_BINS - 1)]++;
            to_keys[dst] = keys[i];
            to_cols[dst] = cols[i];
        }
        from = 1 - from;
    }
    return from;
}

static void row_top_k(const float *scores, const void *pos, int pos_dtype, int64_t n, int64_t kk, Scratch *s,
                      float *out_scores, void *out_pos) {
    const int64_t *pos64 = (const int64_t *)pos;
    const int32_t *pos32 = (const int32_t *)pos;
    for (int64_t i = 0; i < n; i++) s->keys[i] = rank_key(scores[i], pos_dtype ? pos32[i] : pos64[i]);
    int64_t m = 0;
    if (kk == n) {
        for (int64_t i = 0; i < n; i++) {
            s->sel[0][i] = s->keys[i];
            s->col[0][i] = (uint32_t)i;
        }
        m = n;
    } else {
        Threshold t = radix_select(s->keys, s->cand, n, kk);
        for (int64_t i = 0; i < n && m < kk; i++) {
            const uint64_t top = s->keys[i] >> t.shift;
            if (top > t.prefix || (top == t.prefix && t.equal_taken-- > 0)) {
                s->sel[0][m] = s->keys[i];
                s->col[0][m++] = (uint32_t)i;
            }
        }
    }
    const int sorted = sort_descending(s, m);
    const uint32_t *cols = s->col[sorted];
    for (int64_t j = 0; j < m; j++) {
        out_scores[j] = scores[cols[j]];
        if (pos_dtype) ((int32_t *)out_pos)[j] = pos32[cols[j]];
        else ((int64_t *)out_pos)[j] = pos64[cols[j]];
    }
}

static int positions_fit(const void *pos, int pos_dtype, int64_t rows, int64_t pos_stride, int64_t n) {
    if (pos_dtype) return 1;
    const int64_t lo = -((int64_t)1 << 31), hi = ((int64_t)1 << 31) - 1;
    const int64_t rows_read = pos_stride == 0 ? 1 : rows;
    int outside = 0;
    for (int64_t r = 0; r < rows_read; r++) {
        const int64_t *p = (const int64_t *)pos + r * pos_stride;
#pragma omp simd reduction(| : outside)
        for (int64_t i = 0; i < n; i++) outside |= (p[i] < lo) | (p[i] > hi);
    }
    return !outside;
}

int cpllm_index_topk(const float *scores, int64_t score_stride, const void *pos, int pos_dtype, int64_t pos_stride,
                     int64_t rows, int64_t n, int64_t k, int threads, float *out_scores, void *out_pos) {
    if (k < 1 || n < 1 || n > (int64_t)UINT32_MAX || !positions_fit(pos, pos_dtype, rows, pos_stride, n))
        return CPLLM_UNSUPPORTED_SHAPE;
    const int64_t kk = k < n ? k : n;
    const size_t pos_size = pos_dtype ? sizeof(int32_t) : sizeof(int64_t);
    int failed = 0;
#pragma omp parallel num_threads(threads) if (rows > 1)
    {
        Scratch s;
        s.keys = malloc(sizeof(uint64_t) * n);
        s.cand = malloc(sizeof(uint32_t) * n);
        s.sel[0] = malloc(sizeof(uint64_t) * kk);
        s.sel[1] = malloc(sizeof(uint64_t) * kk);
        s.col[0] = malloc(sizeof(uint32_t) * kk);
        s.col[1] = malloc(sizeof(uint32_t) * kk);
        const int ok = s.keys && s.cand && s.sel[0] && s.sel[1] && s.col[0] && s.col[1];
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < rows; r++) {
            if (!ok) continue;
            row_top_k(scores + r * score_stride, (const char *)pos + r * pos_stride * pos_size, pos_dtype, n, kk,
                      &s, out_scores + r * kk, (char *)out_pos + r * kk * pos_size);
        }
        free(s.keys);
        free(s.cand);
        free(s.sel[0]);
        free(s.sel[1]);
        free(s.col[0]);
        free(s.col[1]);
    }
    return failed ? CPLLM_NO_MEMORY : CPLLM_OK;
}
