/* Prefill attention: many query positions against a run of keys, causal or not, float32, with the log-sum-exp.
 *
 * q[i, h, :] sits at q + i * q_stride + h * d (heads contiguous inside a row), k/v[j, g, :] at k + j * kv_stride +
 * g * d; query head h reads KV head h / (hq / hkv). Causal (top-left aligned, as PyTorch's flash kernel's flag): query
 * i sees keys j <= i; otherwise it sees every key. out [n_q, hq, d] and lse [n_q, hq] are contiguous.
 *
 * Work item: one KV head and 64 "rows", a row being one (query position, query head of the group) pair; the rows
 * of the group's heads at neighbouring positions share every key they read. Everything runs transposed, rows in
 * the 16 lanes of a vector: scores^T [key][row] are FMAs of a broadcast key element with a row of q^T [d][row],
 * so the online softmax's max, exp and sum run lane-wise with no horizontal reduction, and out^T [d][row] gathers
 * broadcast value elements times a row of probabilities. Keys and values are read in place (no packing).
 * Accumulation is float32; softmax is online over blocks of BLOCK_KEYS keys (flash attention), exact up to
 * float32 rounding.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vector_exp.h"

#if defined(__AVX512F__)
#include <immintrin.h>

/* GCC would fold a vector reused by four FMAs into each of them as a memory operand: four loads where one does,
 * and loads, not FMAs, would bound the loop. An empty asm that "changes" the register keeps the one load. */
#define IN_REGISTER(x) __asm__("" : "+v"(x))

enum { ROWS = 64, VECS = ROWS / 16, BLOCK_KEYS = 64, MAX_D = 256 };

typedef struct {
    const float *q, *k, *v;
    int64_t q_stride, kv_stride;
    int n_q, n_k, hq, hkv, d, causal;
    float scale;
    float *out, *lse;
} Problem;

typedef struct {
    float qt[MAX_D][ROWS];          /* scale * q, transposed: [d][row] */
    float st[BLOCK_KEYS][ROWS];     /* one block's scores, then its probabilities: [key][row] */
    float ot[MAX_D][ROWS];          /* unnormalised output, transposed */
    float m[ROWS], l[ROWS];         /* running max and sum of exp per row */
    int32_t pos[ROWS];              /* last key each row may see (causal), or n_k - 1 */
} Tile __attribute__((aligned(64)));

/* Rows [r0, r0 + ROWS) of KV head g: row r is query position r / group, head g * group + r % group. */
static void load_tile(const Problem *p, int g, int r0, Tile *t) {
    const int group = p->hq / p->hkv, rows_total = p->n_q * group;
    for (int r = 0; r < ROWS; r++) {
        const int row = r0 + r;
        if (row < rows_total) {
            const int i = row / group, h = g * group + row % group;
            const float *src = p->q + i * p->q_stride + (int64_t)h * p->d;
            for (int c = 0; c < p->d; c++) t->qt[c][r] = src[c] * p->scale;
            t->pos[r] = p->causal ? i : p->n_k - 1;
        } else {  /* padding: sees key 0 only, its output is never written */
            for (int c = 0; c < p->d; c++) t->qt[c][r] = 0.0f;
            t->pos[r] = 0;
        }
        t->m[r] = -INFINITY;
        t->l[r] = 0.0f;
    }
    memset(t->ot, 0, sizeof(float) * ROWS * p->d);
}

/* st[j][row] = k_{k0 + j} . qt[:, row] for j < count (a multiple of 4 or the block's tail). */
static void block_scores(const Problem *p, int g, int k0, int count, Tile *t) {
    const float *kbase = p->k + (int64_t)g * p->d;
    int j = 0;
    for (; j + 4 <= count; j += 4) {
        __m512 acc[4][VECS];
        for (int a = 0; a < 4; a++)
            for (int b = 0; b < VECS; b++) acc[a][b] = _mm512_setzero_ps();
        const float *k_rows[4];
        for (int a = 0; a < 4; a++) k_rows[a] = kbase + (int64_t)(k0 + j + a) * p->kv_stride;
        for (int c = 0; c < p->d; c++) {
            __m512 qv[VECS];
            for (int b = 0; b < VECS; b++) {
                qv[b] = _mm512_load_ps(&t->qt[c][16 * b]);
                IN_REGISTER(qv[b]);
            }
            for (int a = 0; a < 4; a++) {
                const __m512 kc = _mm512_set1_ps(k_rows[a][c]);
                for (int b = 0; b < VECS; b++) acc[a][b] = _mm512_fmadd_ps(kc, qv[b], acc[a][b]);
            }
        }
        for (int a = 0; a < 4; a++)
            for (int b = 0; b < VECS; b++) _mm512_store_ps(&t->st[j + a][16 * b], acc[a][b]);
    }
    for (; j < count; j++) {
        __m512 acc[VECS];
        for (int b = 0; b < VECS; b++) acc[b] = _mm512_setzero_ps();
        const float *kr = kbase + (int64_t)(k0 + j) * p->kv_stride;
        for (int c = 0; c < p->d; c++) {
            const __m512 kc = _mm512_set1_ps(kr[c]);
            for (int b = 0; b < VECS; b++) acc[b] = _mm512_fmadd_ps(kc, _mm512_load_ps(&t->qt[c][16 * b]), acc[b]);
        }
        for (int b = 0; b < VECS; b++) _mm512_store_ps(&t->st[j][16 * b], acc[b]);
    }
}

/* Online softmax over one block: masks keys past each row's last position, turns st into probabilities against
 * the new running max, rescales the sum and the output accumulated so far. */
static void block_softmax(const Problem *p, int k0, int count, int masked, Tile *t) {
    const int d = p->d;
    for (int b = 0; b < VECS; b++) {
        const __m512i last = _mm512_load_si512((const void *)&t->pos[16 * b]);
        const __m512 m_old = _mm512_load_ps(&t->m[16 * b]);
        __m512 m_new = m_old;
        for (int j = 0; j < count; j++) {
            const __mmask16 seen = masked ? _mm512_cmple_epi32_mask(_mm512_set1_epi32(k0 + j), last) : 0xFFFF;
            m_new = _mm512_mask_max_ps(m_new, seen, m_new, _mm512_load_ps(&t->st[j][16 * b]));
        }
        /* Every row sees key 0 (its own position at least), so m_new is finite after the first block. */
        const __m512 alpha = exp16_nonpositive(_mm512_sub_ps(m_old, m_new));
        __m512 sum = _mm512_setzero_ps();
        for (int j = 0; j < count; j++) {
            const __mmask16 seen = masked ? _mm512_cmple_epi32_mask(_mm512_set1_epi32(k0 + j), last) : 0xFFFF;
            const __m512 e = _mm512_maskz_mov_ps(
                seen, exp16_nonpositive(_mm512_sub_ps(_mm512_load_ps(&t->st[j][16 * b]), m_new)));
            _mm512_store_ps(&t->st[j][16 * b], e);  /* exactly 0 for a key the row does not see */
            sum = _mm512_add_ps(sum, e);
        }
        /* The first block has no earlier sum or output to rescale (and exp(-inf) is clamped, not 0). */
        const __m512 zero_first = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(m_old, _mm512_set1_ps(-INFINITY),
                                                                          _CMP_EQ_OQ),
                                                       alpha, _mm512_setzero_ps());
        _mm512_store_ps(&t->l[16 * b], _mm512_fmadd_ps(_mm512_load_ps(&t->l[16 * b]), zero_first, sum));
        _mm512_store_ps(&t->m[16 * b], m_new);
        for (int c = 0; c < d; c++)
            _mm512_store_ps(&t->ot[c][16 * b], _mm512_mul_ps(_mm512_load_ps(&t->ot[c][16 * b]), zero_first));
    }
}

/* ot[c][row] += sum_j v_{k0 + j}[c] * st[j][row], four output dimensions at a time. */
static void block_values(const Problem *p, int g, int k0, int count, Tile *t) {
    const float *vbase = p->v + (int64_t)g * p->d + (int64_t)k0 * p->kv_stride;
    for (int c = 0; c < p->d; c += 4) {
        __m512 acc[4][VECS];
        for (int a = 0; a < 4; a++)
            for (int b = 0; b < VECS; b++) acc[a][b] = _mm512_load_ps(&t->ot[c + a][16 * b]);
        for (int j = 0; j < count; j++) {
            const float *vr = vbase + (int64_t)j * p->kv_stride + c;
            __m512 pv[VECS];
            for (int b = 0; b < VECS; b++) {
                pv[b] = _mm512_load_ps(&t->st[j][16 * b]);
                IN_REGISTER(pv[b]);
            }
            for (int a = 0; a < 4; a++) {
                const __m512 vc = _mm512_set1_ps(vr[a]);
                for (int b = 0; b < VECS; b++) acc[a][b] = _mm512_fmadd_ps(vc, pv[b], acc[a][b]);
            }
        }
        for (int a = 0; a < 4; a++)
            for (int b = 0; b < VECS; b++) _mm512_store_ps(&t->ot[c + a][16 * b], acc[a][b]);
    }
}

static void store_tile(const Problem *p, int g, int r0, const Tile *t) {
    const int group = p->hq / p->hkv, rows_total = p->n_q * group;
    for (int r = 0; r < ROWS && r0 + r < rows_total; r++) {
        const int i = (r0 + r) / group, h = g * group + (r0 + r) % group;
        float *dst = p->out + ((int64_t)i * p->hq + h) * p->d;
        const float inv = 1.0f / t->l[r];
        for (int c = 0; c < p->d; c++) dst[c] = t->ot[c][r] * inv;
        p->lse[(int64_t)i * p->hq + h] = t->m[r] + logf(t->l[r]);
    }
}

static void run_tile(const Problem *p, int g, int r0, Tile *t) {
    load_tile(p, g, r0, t);
    int lowest = INT32_MAX, highest = 0;  /* the rows' last visible keys */
    for (int r = 0; r < ROWS; r++) {
        if (r0 + r >= p->n_q * (p->hq / p->hkv)) break;
        lowest = t->pos[r] < lowest ? t->pos[r] : lowest;
        highest = t->pos[r] > highest ? t->pos[r] : highest;
    }
    const int end = highest + 1 < p->n_k ? highest + 1 : p->n_k;
    for (int k0 = 0; k0 < end; k0 += BLOCK_KEYS) {
        const int count = end - k0 < BLOCK_KEYS ? end - k0 : BLOCK_KEYS;
        block_scores(p, g, k0, count, t);
        block_softmax(p, k0, count, k0 + count - 1 > lowest, t);
        block_values(p, g, k0, count, t);
    }
    store_tile(p, g, r0, t);
}

int cpllm_prefill_attention(const float *q, int64_t q_stride, const float *k, const float *v, int64_t kv_stride,
                            int n_q, int n_k, int hq, int hkv, int d, float scale, int causal,
                            int threads, float *out, float *lse) {
    if (d > MAX_D || d % 4 || hq % hkv || n_k <= 0) return 1;
    const Problem p = {.q = q, .k = k, .v = v, .q_stride = q_stride, .kv_stride = kv_stride, .n_q = n_q,
                       .n_k = n_k, .hq = hq, .hkv = hkv, .d = d, .causal = causal,
                       .scale = scale, .out = out, .lse = lse};
    int failed = 0;
    const int tiles_per_head = (n_q * (hq / hkv) + ROWS - 1) / ROWS, items = tiles_per_head * hkv;
#pragma omp parallel num_threads(threads)
    {
        Tile *tile = aligned_alloc(64, sizeof(Tile));
        /* Causal tiles near the end see the most keys: hand those out first. */
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < items; item++) {
            const int t = tiles_per_head - 1 - item / hkv, g = item % hkv;
            if (tile != NULL) run_tile(&p, g, t * ROWS, tile);
        }
        if (tile == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        free(tile);
    }
    return failed ? 3 : 0;
}

#else
int cpllm_prefill_attention(const float *q, int64_t q_stride, const float *k, const float *v, int64_t kv_stride,
                            int n_q, int n_k, int hq, int hkv, int d, float scale, int causal,
                            int threads, float *out, float *lse) {
    return 2;  /* no AVX-512 on this machine: the caller runs its torch path */
}
#endif
