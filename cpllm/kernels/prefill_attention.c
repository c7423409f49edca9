/* Prefill attention: many query positions against a run of keys, causal or not, float32, with the log-sum-exp.
 *
 * q[i, h, :] sits at q + i * q_stride + h * d (heads contiguous inside a row), k/v[j, g, :] at k + j * kv_stride +
 * g * d; query head h reads KV head h / (hq / hkv). With causal_offset c >= 0, query i sees keys j <= i + c (c = 0:
 * top-left aligned, as PyTorch's flash kernel's flag; c = n_k - n_q: bottom-right, a run of queries after c earlier
 * keys seeing those and itself causally, in one call and one online softmax); c < 0: every key. With row_offsets
 * (and c >= 0), query i sees keys j <= i + row_offsets[i]: runs of queries at different places in one key order,
 * as a PCP rank's head and tail chunks of a prompt, in one call whose output needs no merge.
 * out [n_q, hq, d] and lse [n_q, hq] are contiguous.
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

#include "bf16.h"
#include "vector_exp.h"

#if defined(__AVX512F__)
#include <immintrin.h>

/* GCC would fold a vector reused by four FMAs into each of them as a memory operand: four loads where one does,
 * and loads, not FMAs, would bound the loop. An empty asm that "changes" the register keeps the one load. */
#define IN_REGISTER(x) __asm__("" : "+v"(x))

#include "transpose16.h"

enum { ROWS = 64, VECS = ROWS / 16, BLOCK_KEYS = 128, MAX_D = 256 };
/* bytes of the bf16 variant's per-thread pairs (PairTile): q pairs and probability pairs */
enum { PAIR_TILE_BYTES = (MAX_D / 2 + BLOCK_KEYS / 2) * ROWS * 4 };

typedef struct {
    const float *q, *k, *v;
    int64_t q_stride, kv_stride;
    int n_q, n_k, hq, hkv, d, causal_offset;
    const int32_t *row_offsets;  /* NULL, or query i's own causal offset (causal_offset must then be >= 0) */
    float scale;
    float *out, *lse;
    int out_bf16;  /* out holds bfloat16, rounded as torch rounds the float32 output (1), or float32 (0) */
} Problem;

typedef struct {
    float qt[MAX_D][ROWS];          /* scale * q, transposed: [d][row] */
    float st[BLOCK_KEYS][ROWS];     /* one block's scores, then its probabilities: [key][row] */
    float ot[MAX_D][ROWS];          /* unnormalised output, transposed */
    float m[ROWS], l[ROWS];         /* running max and sum of exp per row */
    int32_t pos[ROWS];              /* last key each row may see (causal), at most n_k - 1 */
} Tile __attribute__((aligned(64)));

/* Row r of a tile of KV head g: query position r / group, head g * group + r % group; its q row, or NULL past the
 * last row (padding: sees key 0 only, its output is never written). Sets the row's last visible key. */
static const float *tile_row(const Problem *p, int g, int row, Tile *t, int r) {
    const int group = p->hq / p->hkv;
    if (row >= p->n_q * group) {
        t->pos[r] = 0;
        return NULL;
    }
    const int i = row / group, h = g * group + row % group;
    const int64_t offset = p->row_offsets != NULL ? p->row_offsets[i] : p->causal_offset;
    const int64_t last = p->causal_offset >= 0 ? (int64_t)i + offset : p->n_k - 1;
    t->pos[r] = last < p->n_k - 1 ? (int32_t)last : p->n_k - 1;
    return p->q + i * p->q_stride + (int64_t)h * p->d;
}

static void reset_rows(const Problem *p, Tile *t) {
    for (int r = 0; r < ROWS; r++) {
        t->m[r] = -INFINITY;
        t->l[r] = 0.0f;
    }
    memset(t->ot, 0, sizeof(float) * ROWS * p->d);
}

/* Rows [r0, r0 + ROWS) of KV head g, scale * q transposed into qt. */
static void load_tile(const Problem *p, int g, int r0, Tile *t) {
    for (int r = 0; r < ROWS; r++) {
        const float *src = tile_row(p, g, r0 + r, t, r);
        for (int c = 0; c < p->d; c++) t->qt[c][r] = src != NULL ? src[c] * p->scale : 0.0f;
    }
    reset_rows(p, t);
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

/* The lanes whose rows see key `key` (every lane where the block needs no mask). */
static inline __mmask16 seen_by(int masked, int key, __m512i last) {
    return masked ? _mm512_cmple_epi32_mask(_mm512_set1_epi32(key), last) : 0xFFFF;
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
            const __mmask16 seen = seen_by(masked, k0 + j, last);
            m_new = _mm512_mask_max_ps(m_new, seen, m_new, _mm512_load_ps(&t->st[j][16 * b]));
        }
        /* Every row sees key 0 (its own position at least), so m_new is finite after the first block. */
        const __m512 alpha = exp16_nonpositive(_mm512_sub_ps(m_old, m_new));
        __m512 sum = _mm512_setzero_ps();
        for (int j = 0; j < count; j++) {
            const __mmask16 seen = seen_by(masked, k0 + j, last);
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
        /* No lane's max moved: the factor is exp(0) = 1 exactly in every lane, and the output stays as it is. */
        if (_mm512_cmp_ps_mask(m_old, m_new, _CMP_EQ_OQ) == 0xFFFF) continue;
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

/* Row r's outputs c .. c + 15 (x: already divided by the sum) at element `at` of out, in out's dtype. */
static inline void store_outputs(const Problem *p, int64_t at, __m512 x) {
    if (p->out_bf16) _mm256_storeu_si256((__m256i *)((uint16_t *)p->out + at), f32x16_to_bf16(x));
    else _mm512_storeu_ps(p->out + at, x);
}

static void store_tile(const Problem *p, int g, int r0, const Tile *t) {
    const int group = p->hq / p->hkv, rows_total = p->n_q * group;
    const int rows = rows_total - r0 < ROWS ? rows_total - r0 : ROWS;
    int64_t dst[ROWS];  /* row r's first output element */
    float inv[ROWS];
    for (int r = 0; r < rows; r++) {
        const int i = (r0 + r) / group, h = g * group + (r0 + r) % group;
        dst[r] = ((int64_t)i * p->hq + h) * p->d;
        inv[r] = 1.0f / t->l[r];
        p->lse[(int64_t)i * p->hq + h] = t->m[r] + logf(t->l[r]);
    }
    const int whole = p->d / 16 * 16;  /* ot^T in blocks of 16 x 16, the rest of d word by word */
    for (int rb = 0; rb < rows; rb += 16)
        for (int c = 0; c < whole; c += 16) {
            __m512i block[16];
            for (int a = 0; a < 16; a++) block[a] = _mm512_castps_si512(_mm512_load_ps(&t->ot[c + a][rb]));
            transpose16(block);  /* block[r]: row rb + r's outputs c .. c + 15 */
            for (int r = 0; r < 16 && rb + r < rows; r++)
                store_outputs(p, dst[rb + r] + c,
                              _mm512_mul_ps(_mm512_castsi512_ps(block[r]), _mm512_set1_ps(inv[rb + r])));
        }
    for (int r = 0; r < rows; r++)
        for (int c = whole; c < p->d; c++) {
            const float x = t->ot[c][r] * inv[r];
            if (p->out_bf16) ((uint16_t *)p->out)[dst[r] + c] = to_bf16(x);
            else p->out[dst[r] + c] = x;
        }
}

/* The keys a loaded tile reads: [0, *end), and the lowest last visible key of its rows (blocks past it mask). */
static void tile_keys(const Problem *p, int r0, const Tile *t, int *end, int *lowest) {
    int low = INT32_MAX, highest = 0;
    for (int r = 0; r < ROWS; r++) {
        if (r0 + r >= p->n_q * (p->hq / p->hkv)) break;
        low = t->pos[r] < low ? t->pos[r] : low;
        highest = t->pos[r] > highest ? t->pos[r] : highest;
    }
    *end = highest + 1 < p->n_k ? highest + 1 : p->n_k;
    *lowest = low;
}

static void run_tile(const Problem *p, int g, int r0, Tile *t) {
    load_tile(p, g, r0, t);
    int end, lowest;
    tile_keys(p, r0, t, &end, &lowest);
    for (int k0 = 0; k0 < end; k0 += BLOCK_KEYS) {
        const int count = end - k0 < BLOCK_KEYS ? end - k0 : BLOCK_KEYS;
        block_scores(p, g, k0, count, t);
        block_softmax(p, k0, count, k0 + count - 1 > lowest, t);
        block_values(p, g, k0, count, t);
    }
    store_tile(p, g, r0, t);
}

/* The bfloat16 packing of K and V (bf16 variant only): kb [hkv][n_k][d] bf16 keys, vp [hkv][ceil(n_k / 2)][d]
 * pairs (v_{2j}[c], v_{2j+1}[c]) of bf16 values in one 32-bit word, the odd tail's partner 0. NULL: fp32 kernel. */
typedef struct {
    uint16_t *kb;
    uint32_t *vp;
} Packed;

typedef void (*TileRun)(const Problem *, const Packed *, int g, int r0, Tile *);

static void run_tile_f32(const Problem *p, const Packed *packed, int g, int r0, Tile *t) {
    (void)packed;
    run_tile(p, g, r0, t);
}

/* Every (KV head, tile of ROWS rows) item over `threads`, the causal tiles that see the most keys first. */
static int run_items(const Problem *p, const Packed *packed, TileRun run, int threads) {
    int failed = 0;
    const int tiles_per_head = (p->n_q * (p->hq / p->hkv) + ROWS - 1) / ROWS, items = tiles_per_head * p->hkv;
#pragma omp parallel num_threads(threads)
    {
        /* room for the bf16 variant's PairTile behind the tile (run_tile_bf16) */
        Tile *tile = aligned_alloc(64, ((sizeof(Tile) + 63) / 64) * 64 + PAIR_TILE_BYTES);
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < items; item++) {
            const int t = tiles_per_head - 1 - item / p->hkv, g = item % p->hkv;
            if (tile != NULL) run(p, packed, g, t * ROWS, tile);
        }
        if (tile == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        free(tile);
    }
    return failed ? 3 : 0;
}

static Problem make_problem(const float *q, int64_t q_stride, const float *k, const float *v, int64_t kv_stride,
                            int n_q, int n_k, int hq, int hkv, int d, float scale, int causal_offset,
                            const int32_t *row_offsets, float *out, float *lse, int out_bf16) {
    const Problem p = {.q = q, .k = k, .v = v, .q_stride = q_stride, .kv_stride = kv_stride, .n_q = n_q,
                       .n_k = n_k, .hq = hq, .hkv = hkv, .d = d, .causal_offset = causal_offset,
                       .row_offsets = row_offsets,
                       .scale = scale, .out = out, .lse = lse, .out_bf16 = out_bf16};
    return p;
}

int cpllm_prefill_attention(const float *q, int64_t q_stride, const float *k, const float *v, int64_t kv_stride,
                            int n_q, int n_k, int hq, int hkv, int d, float scale, int causal_offset,
                            const int32_t *row_offsets, int threads, float *out, float *lse, int out_bf16) {
    if (d > MAX_D || d % 4 || hq % hkv || n_k <= 0) return 1;
    const Problem p =
        make_problem(q, q_stride, k, v, kv_stride, n_q, n_k, hq, hkv, d, scale, causal_offset, row_offsets, out,
                     lse, out_bf16);
    return run_items(&p, NULL, run_tile_f32, threads);
}

#if defined(__AVX512BF16__)
/* The bfloat16 variant: the same tiles, online softmax, float32 output and log-sum-exp, but both products on
 * vdpbf16ps (two bf16 products summed into each float32 lane per instruction, float32 accumulation). q (scaled),
 * K, V and the probabilities are rounded to bf16 to nearest even; scores, the softmax and the output stay float32.
 * Scores pair q's dimensions (qp: [d / 2][row] words, a key's pair broadcast); values pair consecutive keys (pp:
 * [key / 2][row] words of probabilities, a value pair of the packed V broadcast). */
typedef struct {
    uint32_t qp[MAX_D / 2][ROWS];
    uint32_t pp[BLOCK_KEYS / 2][ROWS];
} PairTile __attribute__((aligned(64)));
_Static_assert(sizeof(PairTile) <= PAIR_TILE_BYTES, "the tiles' allocation holds a PairTile");

static inline uint32_t bf16_of(float x) {  /* round to nearest even; finite inputs */
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
}

/* 16 floats (masked) -> their bf16 in the low halves of 16 words. */
static inline __m512i bf16_words(__mmask16 mask, const float *src) {
    return _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, src)));
}

static void pack_kv(const Problem *p, Packed *packed, int threads) {
    const int pairs = (p->n_k + 1) / 2, d = p->d;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t item = 0; item < (int64_t)p->hkv * pairs; item++) {
        const int g = (int)(item / pairs), j2 = (int)(item % pairs), j = 2 * j2;
        const float *k0 = p->k + (int64_t)j * p->kv_stride + (int64_t)g * d;
        const float *v0 = p->v + (int64_t)j * p->kv_stride + (int64_t)g * d;
        const int partner = j + 1 < p->n_k;
        uint16_t *kb = packed->kb + ((int64_t)g * p->n_k + j) * d;
        uint32_t *vp = packed->vp + ((int64_t)g * pairs + j2) * d;
        for (int c = 0; c < d; c += 16) {
            const __mmask16 mask = d - c >= 16 ? 0xFFFF : (__mmask16)((1u << (d - c)) - 1);
            const __m512i lo = bf16_words(mask, v0 + c);
            const __m512i hi = partner ? bf16_words(mask, v0 + p->kv_stride + c) : _mm512_setzero_si512();
            _mm512_mask_storeu_epi32(vp + c, mask, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
        for (int row = 0; row <= partner; row++)
            for (int c = 0; c < d; c++) kb[row * d + c] = (uint16_t)bf16_of(k0[row * p->kv_stride + c]);
    }
}

static void load_tile_bf16(const Problem *p, int g, int r0, Tile *t, PairTile *pt) {
    const float *src[ROWS];
    for (int r = 0; r < ROWS; r++) src[r] = tile_row(p, g, r0 + r, t, r);
    const int whole = p->d / 32 * 16;  /* pairs in blocks of 16 pairs x 16 rows, the rest pair by pair */
    const __m512 scale = _mm512_set1_ps(p->scale);
    for (int rb = 0; rb < ROWS; rb += 16)
        for (int c = 0; c < whole; c += 16) {
            __m512i block[16];  /* block[r]: row rb + r's 16 pairs from c (32 values, in order, as bf16) */
            for (int r = 0; r < 16; r++) {
                const float *x = src[rb + r];
                block[r] = x == NULL ? _mm512_setzero_si512()
                                     : (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_loadu_ps(x + 2 * c + 16), scale),
                                                                    _mm512_mul_ps(_mm512_loadu_ps(x + 2 * c), scale));
            }
            transpose16(block);
            for (int a = 0; a < 16; a++) _mm512_store_si512((void *)&pt->qp[c + a][rb], block[a]);
        }
    for (int r = 0; r < ROWS; r++)
        for (int c = whole; c < p->d / 2; c++)
            pt->qp[c][r] = src[r] == NULL ? 0u : bf16_of(src[r][2 * c] * p->scale)
                                                     | bf16_of(src[r][2 * c + 1] * p->scale) << 16;
    reset_rows(p, t);
}

/* st[j][row] = k_{k0 + j} . q_row for j < count, from the bf16 pairs. */
static void block_scores_bf16(const Problem *p, const uint16_t *kb, int k0, int count, const PairTile *pt,
                              Tile *t) {
    const int half = p->d / 2;
    int j = 0;
    for (; j + 4 <= count; j += 4) {
        __m512 acc[4][VECS];
        for (int a = 0; a < 4; a++)
            for (int b = 0; b < VECS; b++) acc[a][b] = _mm512_setzero_ps();
        const uint32_t *k_rows[4];
        for (int a = 0; a < 4; a++) k_rows[a] = (const uint32_t *)(kb + (int64_t)(k0 + j + a) * p->d);
        for (int c = 0; c < half; c++) {
            __m512i qv[VECS];
            for (int b = 0; b < VECS; b++) {
                qv[b] = _mm512_load_si512((const void *)&pt->qp[c][16 * b]);
                IN_REGISTER(qv[b]);
            }
            for (int a = 0; a < 4; a++) {
                const __m512bh kc = (__m512bh)_mm512_set1_epi32((int)k_rows[a][c]);
                for (int b = 0; b < VECS; b++) acc[a][b] = _mm512_dpbf16_ps(acc[a][b], kc, (__m512bh)qv[b]);
            }
        }
        for (int a = 0; a < 4; a++)
            for (int b = 0; b < VECS; b++) _mm512_store_ps(&t->st[j + a][16 * b], acc[a][b]);
    }
    for (; j < count; j++) {
        __m512 acc[VECS];
        for (int b = 0; b < VECS; b++) acc[b] = _mm512_setzero_ps();
        const uint32_t *kr = (const uint32_t *)(kb + (int64_t)(k0 + j) * p->d);
        for (int c = 0; c < half; c++) {
            const __m512bh kc = (__m512bh)_mm512_set1_epi32((int)kr[c]);
            for (int b = 0; b < VECS; b++)
                acc[b] = _mm512_dpbf16_ps(acc[b], kc, (__m512bh)_mm512_load_si512((const void *)&pt->qp[c][16 * b]));
        }
        for (int b = 0; b < VECS; b++) _mm512_store_ps(&t->st[j][16 * b], acc[b]);
    }
}

/* pp[j2][row] = the bf16 probabilities of keys 2 j2 and 2 j2 + 1 (0 past count). */
static void pack_probabilities(int count, const Tile *t, PairTile *pt) {
    for (int j2 = 0; 2 * j2 < count; j2++)
        for (int b = 0; b < VECS; b++) {
            const __m512i lo = bf16_words(0xFFFF, &t->st[2 * j2][16 * b]);
            const __m512i hi = 2 * j2 + 1 < count ? bf16_words(0xFFFF, &t->st[2 * j2 + 1][16 * b])
                                                  : _mm512_setzero_si512();
            _mm512_store_si512((void *)&pt->pp[j2][16 * b], _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
}

/* ot[c][row] += sum_j v_{k0 + j}[c] p[j][row] over key pairs, four output dimensions at a time (k0 is even). */
static void block_values_bf16(const Problem *p, const uint32_t *vp, int k0, int count, const PairTile *pt,
                              Tile *t) {
    const int pairs = (count + 1) / 2;
    const uint32_t *vbase = vp + (int64_t)(k0 / 2) * p->d;
    for (int c = 0; c < p->d; c += 4) {
        __m512 acc[4][VECS];
        for (int a = 0; a < 4; a++)
            for (int b = 0; b < VECS; b++) acc[a][b] = _mm512_load_ps(&t->ot[c + a][16 * b]);
        for (int j2 = 0; j2 < pairs; j2++) {
            const uint32_t *vr = vbase + (int64_t)j2 * p->d + c;
            __m512i pv[VECS];
            for (int b = 0; b < VECS; b++) {
                pv[b] = _mm512_load_si512((const void *)&pt->pp[j2][16 * b]);
                IN_REGISTER(pv[b]);
            }
            for (int a = 0; a < 4; a++) {
                const __m512bh vc = (__m512bh)_mm512_set1_epi32((int)vr[a]);
                for (int b = 0; b < VECS; b++) acc[a][b] = _mm512_dpbf16_ps(acc[a][b], vc, (__m512bh)pv[b]);
            }
        }
        for (int a = 0; a < 4; a++)
            for (int b = 0; b < VECS; b++) _mm512_store_ps(&t->ot[c + a][16 * b], acc[a][b]);
    }
}

static void run_tile_bf16(const Problem *p, const Packed *packed, int g, int r0, Tile *t) {
    PairTile *pt = (PairTile *)((char *)t + ((sizeof(Tile) + 63) / 64) * 64);  /* allocated behind the tile */
    load_tile_bf16(p, g, r0, t, pt);
    int end, lowest;
    tile_keys(p, r0, t, &end, &lowest);
    const uint16_t *kb = packed->kb + (int64_t)g * p->n_k * p->d;
    const uint32_t *vp = packed->vp + (int64_t)g * ((p->n_k + 1) / 2) * p->d;
    for (int k0 = 0; k0 < end; k0 += BLOCK_KEYS) {
        const int count = end - k0 < BLOCK_KEYS ? end - k0 : BLOCK_KEYS;
        block_scores_bf16(p, kb, k0, count, pt, t);
        block_softmax(p, k0, count, k0 + count - 1 > lowest, t);
        pack_probabilities(count, t, pt);
        block_values_bf16(p, vp, k0, count, pt, t);
    }
    store_tile(p, g, r0, t);
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include "amx_tiles.h"

/* The AMX variant: the bf16 variant's tiles, pairs and online softmax, with both products on AMX tiles
 * (tdpbf16ps: a 16 x 16 float32 tile += a 16 x 32 bf16 tile times a 32 x 16 one, float32 accumulation).
 * The bf16 variant's transposed layout is what the tiles want: scores^T [key][row] = K [key][d] times the q pairs
 * [d / 2][row] (AMX's B operand holds consecutive pairs of its inner dimension in one 32-bit word), and out^T
 * [d][row] += V^T [d][key] times the probability pairs [key / 2][row]. Every tile is 16 rows of 64 bytes. K is
 * packed as the bf16 variant's kb and V transposed (vt [hkv][d][keys]), both padded with zeros to a whole block of
 * keys so that a tile never reads past them; the head size must be a multiple of 32 (one A tile's width). The
 * scores and probability pairs are held grouped by 16 rows (st_at, pp_at). With the products on tiles (at the
 * machine's bf16 matmul rate) the softmax is the largest part left, so it has its own form here: e raised through
 * 2^x (exp2_16_masked: a degree-4 polynomial, the causal mask in its scalef), the probabilities converted straight
 * into their pairs, and a running max that moves only by more than LAZY_MAX (with the 2 x 2 blocking below, 1.24x /
 * 1.33x the first AMX form at 2K / 8K tokens). */
enum { TILE_KEYS = 16, STEP_KEYS = 32 };
enum { MXCSR_FTZ_DAZ = 0x8040 };  /* flush-to-zero (bit 15) and denormals-are-zero (bit 6) */

static void configure_tiles(void) {
    TileConfig config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int i = 0; i < 8; i++) {
        config.colsb[i] = 64;
        config.rows[i] = 16;
    }
    _tile_loadconfig(&config);
}

/* The AMX variant keeps a block's scores (st) and probability pairs (pp) grouped by 16 rows, [VECS][keys][16], not
 * [keys][ROWS]: the softmax of one row group then walks 8 KB of contiguous memory where it took every fourth line of
 * 32 KB, and each tile is 1 KB in one piece (0.95x the kernel's time at 8K tokens, the same bits). */
static inline float *st_at(Tile *t, int j, int b) { return &t->st[0][0] + ((int64_t)b * BLOCK_KEYS + j) * 16; }
static inline uint32_t *pp_at(PairTile *pt, int j2, int b) {
    return &pt->pp[0][0] + ((int64_t)b * (BLOCK_KEYS / 2) + j2) * 16;
}

static int64_t padded_keys(int n_k) { return ((int64_t)n_k + BLOCK_KEYS - 1) / BLOCK_KEYS * BLOCK_KEYS; }

/* kb [hkv][padded][d] and vt [hkv][d][padded], bf16, zeros past n_k; items of BLOCK_KEYS keys of one KV head. V^T
 * is written as the transpose of V's key-pair words (the bf16 variant's vp): row c of vt, read as 32-bit words, is
 * column c of those words (d is a multiple of 32 here). */
static void pack_kv_amx(const Problem *p, uint16_t *kb, uint16_t *vt, int threads) {
    const int64_t padded = padded_keys(p->n_k), blocks = padded / BLOCK_KEYS;
    const int d = p->d;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t item = 0; item < (int64_t)p->hkv * blocks; item++) {
        const int g = (int)(item / blocks), j0 = (int)(item % blocks) * BLOCK_KEYS;
        for (int j = j0; j < j0 + BLOCK_KEYS; j++) {
            const float *k_row = p->k + (int64_t)j * p->kv_stride + (int64_t)g * d;
            uint16_t *kb_row = kb + ((int64_t)g * padded + j) * d;
            for (int c = 0; c < d; c += 16)
                _mm256_storeu_si256((__m256i *)(kb_row + c), j < p->n_k ? (__m256i)_mm512_cvtneps_pbh(
                                                                              _mm512_loadu_ps(k_row + c))
                                                                        : _mm256_setzero_si256());
        }
        uint32_t *vt_words = (uint32_t *)(vt + (int64_t)g * d * padded);
        for (int j2 = j0 / 2; j2 < (j0 + BLOCK_KEYS) / 2; j2 += 16)
            for (int c = 0; c < d; c += 16) {
                __m512i block[16];  /* block[i]: key pair j2 + i's words (v[2 j], v[2 j + 1]) of dims c .. c + 15 */
                for (int i = 0; i < 16; i++) {
                    const int j = 2 * (j2 + i);
                    const float *v_row = p->v + (int64_t)j * p->kv_stride + (int64_t)g * d + c;
                    const __m512i lo = j < p->n_k ? bf16_words(0xFFFF, v_row) : _mm512_setzero_si512();
                    const __m512i hi = j + 1 < p->n_k ? bf16_words(0xFFFF, v_row + p->kv_stride)
                                                      : _mm512_setzero_si512();
                    block[i] = _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
                }
                transpose16(block);
                for (int a = 0; a < 16; a++)
                    _mm512_storeu_si512((void *)(vt_words + (c + a) * padded / 2 + j2), block[a]);
            }
    }
}

/* Both products run 2 x 2 blocks of tiles: accumulators 0-3 are C[a][b] (a: the A operand's tile 4 + a, b: the B
 * operand's tile 6 + b), so each loaded tile feeds two products and no tile is reloaded while a product still
 * reads it (the tile registers are not renamed). */
static inline void dp_2x2(void) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
}

/* st_at(j, row group) = k_{k0 + j} . q_row for j < count rounded up to 32 keys (extra keys' scores go unread): per step
 * 32 keys (tiles 4, 5) times 32 rows (q pairs in tiles 6, 7). */
static void block_scores_amx(const Problem *p, const uint16_t *kb, int k0, int count, const PairTile *pt, Tile *t) {
    for (int j = 0; j < count; j += 2 * TILE_KEYS)
        for (int r = 0; r < ROWS; r += 32) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int c = 0; c < p->d / 32; c++) {
                _tile_loadd(4, kb + (int64_t)(k0 + j) * p->d + 32 * c, p->d * 2);
                _tile_loadd(6, &pt->qp[16 * c][r], ROWS * 4);
                _tile_loadd(5, kb + (int64_t)(k0 + j + TILE_KEYS) * p->d + 32 * c, p->d * 2);
                _tile_loadd(7, &pt->qp[16 * c][r + 16], ROWS * 4);
                dp_2x2();
            }
            _tile_stored(0, st_at(t, j, r / 16), 64);
            _tile_stored(1, st_at(t, j, r / 16 + 1), 64);
            _tile_stored(2, st_at(t, j + TILE_KEYS, r / 16), 64);
            _tile_stored(3, st_at(t, j + TILE_KEYS, r / 16 + 1), 64);
        }
}

/* ot[c][row] += sum_j v_{k0 + j}[c] p[j][row] (pairs at pp_at), STEP_KEYS keys per product: per step 32 output
 * dimensions (V^T in tiles 4, 5) times 32 rows (probability pairs in tiles 6, 7); pairs past count are zeroed first
 * (the padded keys' values are zeros, the real ones past count must meet a zero probability). */
static void block_values_amx(const Problem *p, const uint16_t *vt, int k0, int count, PairTile *pt, Tile *t) {
    const int steps = (count + STEP_KEYS - 1) / STEP_KEYS;
    const int64_t padded = padded_keys(p->n_k);
    for (int b = 0; b < VECS; b++)
        for (int j2 = (count + 1) / 2; j2 < steps * STEP_KEYS / 2; j2++) memset(pp_at(pt, j2, b), 0, 64);
    for (int c = 0; c < p->d; c += 32)
        for (int r = 0; r < ROWS; r += 32) {
            _tile_loadd(0, &t->ot[c][r], ROWS * 4);
            _tile_loadd(1, &t->ot[c][r + 16], ROWS * 4);
            _tile_loadd(2, &t->ot[c + 16][r], ROWS * 4);
            _tile_loadd(3, &t->ot[c + 16][r + 16], ROWS * 4);
            for (int s = 0; s < steps; s++) {
                const int pair = s * STEP_KEYS / 2;
                const uint16_t *v_cols = vt + (int64_t)c * padded + k0 + s * STEP_KEYS;
                _tile_loadd(4, v_cols, padded * 2);
                _tile_loadd(6, pp_at(pt, pair, r / 16), 64);
                _tile_loadd(5, v_cols + 16 * padded, padded * 2);
                _tile_loadd(7, pp_at(pt, pair, r / 16 + 1), 64);
                dp_2x2();
            }
            _tile_stored(0, &t->ot[c][r], ROWS * 4);
            _tile_stored(1, &t->ot[c][r + 16], ROWS * 4);
            _tile_stored(2, &t->ot[c + 16][r], ROWS * 4);
            _tile_stored(3, &t->ot[c + 16][r + 16], ROWS * 4);
        }
}

/* The running max moves only where a block's max passes it by more than this: the terms are then at most
 * e^5.5 = 2^8, far inside float32 and bf16's range, and most blocks leave the output unscaled (the final division
 * by the sum is exact whichever max the terms were taken against). */
#define LAZY_MAX 5.55f
#define LOG2E 1.44269504f

/* e^(s - m) = 2^(s log2(e) - m log2(e)) in the lanes `seen`, 0 elsewhere: one fused multiply-subtract, then
 * exp2_16_masked (scores and the max are finite: no clamp). */
static inline __m512 exp_from(__mmask16 seen, const float *scores, __m512 m_log2) {
    return exp2_16_masked(seen, _mm512_fmsub_ps(_mm512_load_ps(scores), _mm512_set1_ps(LOG2E), m_log2));
}

/* block_softmax for the AMX variant: a lazily moved max, e raised through 2^x, the probabilities written straight
 * into their bf16 pairs pp (never back to st). */
static void block_softmax_amx(const Problem *p, int k0, int count, int masked, Tile *t, PairTile *pt) {
    const int pairs = (count + 1) / 2;
    for (int b = 0; b < VECS; b++) {
        const __m512i last = _mm512_load_si512((const void *)&t->pos[16 * b]);
        const __m512 m_old = _mm512_load_ps(&t->m[16 * b]);
        /* four running maxima: one would chain every key's max behind the previous one's latency */
        __m512 tops[4];
        for (int a = 0; a < 4; a++) tops[a] = _mm512_set1_ps(-INFINITY);
        for (int j = 0; j < count; j += 4)
            for (int a = 0; a < 4 && j + a < count; a++) {
                const __mmask16 seen = seen_by(masked, k0 + j + a, last);
                tops[a] = _mm512_mask_max_ps(tops[a], seen, tops[a], _mm512_load_ps(st_at(t, j + a, b)));
            }
        const __m512 top = _mm512_max_ps(_mm512_max_ps(tops[0], tops[1]), _mm512_max_ps(tops[2], tops[3]));
        /* Every row sees key 0, so the first block moves every lane (m_old + LAZY_MAX is -inf there). */
        const __mmask16 moved =
            _mm512_cmp_ps_mask(top, _mm512_add_ps(m_old, _mm512_set1_ps(LAZY_MAX)), _CMP_GT_OQ);
        const __m512 m_new = _mm512_mask_blend_ps(moved, m_old, top);
        const __m512 m_log2 = _mm512_mul_ps(m_new, _mm512_set1_ps(LOG2E));
        __m512 sum = _mm512_setzero_ps();
        for (int j2 = 0; j2 < pairs; j2++) {
            const int j = 2 * j2;
            const __mmask16 seen0 = seen_by(masked, k0 + j, last);
            const __mmask16 seen1 = j + 1 < count ? seen_by(masked, k0 + j + 1, last) : 0;
            const __m512 e0 = exp_from(seen0, st_at(t, j, b), m_log2);
            const __m512 e1 = exp_from(seen1, st_at(t, j + 1, b), m_log2);
            sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));
            _mm512_store_si512((void *)pp_at(pt, j2, b), bf16_pair_words(e0, e1));
        }
        /* 1 exactly where the max did not move (2^0 through the polynomial); 0 on the first block */
        const __m512 alpha =
            exp2_16_nonpositive(_mm512_mul_ps(_mm512_sub_ps(m_old, m_new), _mm512_set1_ps(LOG2E)));
        const __m512 zero_first = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(m_old, _mm512_set1_ps(-INFINITY),
                                                                          _CMP_EQ_OQ),
                                                       alpha, _mm512_setzero_ps());
        _mm512_store_ps(&t->l[16 * b], _mm512_fmadd_ps(_mm512_load_ps(&t->l[16 * b]), zero_first, sum));
        _mm512_store_ps(&t->m[16 * b], m_new);
        if (moved == 0) continue;
        for (int c = 0; c < p->d; c++)
            _mm512_store_ps(&t->ot[c][16 * b], _mm512_mul_ps(_mm512_load_ps(&t->ot[c][16 * b]), zero_first));
    }
}

/* Packed.kb is the padded kb and Packed.vp holds vt (bf16) for this variant. */
static void run_tile_amx(const Problem *p, const Packed *packed, int g, int r0, Tile *t) {
    PairTile *pt = (PairTile *)((char *)t + ((sizeof(Tile) + 63) / 64) * 64);
    const int64_t padded = padded_keys(p->n_k);
    configure_tiles();  /* per thread: OpenMP's threads each hold their own tile state */
    load_tile_bf16(p, g, r0, t, pt);
    int end, lowest;
    tile_keys(p, r0, t, &end, &lowest);
    const uint16_t *kb = packed->kb + (int64_t)g * padded * p->d;
    const uint16_t *vt = (const uint16_t *)packed->vp + (int64_t)g * p->d * padded;
    /* Subnormals flushed to zero while the blocks run: a key more than 87 below its row's max gives e^(s - m) under
     * 2^-126, and each vector instruction with such a result otherwise takes a microcode assist (30x the softmax's
     * time where scores spread that far). The tiles already read bf16 subnormals as zero, and the sum cannot see
     * terms that small. */
    const unsigned int csr = _mm_getcsr();
    _mm_setcsr(csr | MXCSR_FTZ_DAZ);
    for (int k0 = 0; k0 < end; k0 += BLOCK_KEYS) {
        const int count = end - k0 < BLOCK_KEYS ? end - k0 : BLOCK_KEYS;
        block_scores_amx(p, kb, k0, count, pt, t);
        block_softmax_amx(p, k0, count, k0 + count - 1 > lowest, t, pt);
        block_values_amx(p, vt, k0, count, pt, t);
    }
    _mm_setcsr(csr);
    _tile_release();
    store_tile(p, g, r0, t);
}

static int prefill_attention_amx(const Problem *p, int threads) {
    const int64_t padded = padded_keys(p->n_k);
    const size_t bytes = ((size_t)p->hkv * padded * p->d * sizeof(uint16_t) + 63) / 64 * 64;
    Packed packed = {.kb = aligned_alloc(64, bytes), .vp = aligned_alloc(64, bytes)};
    int status = 3;
    if (packed.kb != NULL && packed.vp != NULL) {
        pack_kv_amx(p, packed.kb, (uint16_t *)packed.vp, threads);
        status = run_items(p, &packed, run_tile_amx, threads);
    }
    free(packed.kb);
    free(packed.vp);
    return status;
}
#endif
#endif

/* As cpllm_prefill_attention, on bf16 dot products (see above); 2 where not built with AVX-512 BF16. */
int cpllm_prefill_attention_bf16(const float *q, int64_t q_stride, const float *k, const float *v, int64_t kv_stride,
                                 int n_q, int n_k, int hq, int hkv, int d, float scale, int causal_offset,
                                 const int32_t *row_offsets, int threads, float *out, float *lse, int out_bf16) {
#if defined(__AVX512BF16__)
    if (d > MAX_D || d % 4 || hq % hkv || n_k <= 0) return 1;
    const Problem p =
        make_problem(q, q_stride, k, v, kv_stride, n_q, n_k, hq, hkv, d, scale, causal_offset, row_offsets, out,
                     lse, out_bf16);
    const int64_t pairs = (n_k + 1) / 2;
    Packed packed = {.kb = aligned_alloc(64, ((size_t)hkv * n_k * d * sizeof(uint16_t) + 63) / 64 * 64),
                     .vp = aligned_alloc(64, ((size_t)hkv * pairs * d * sizeof(uint32_t) + 63) / 64 * 64)};
    int status = 3;
    if (packed.kb != NULL && packed.vp != NULL) {
        pack_kv(&p, &packed, threads);
        status = run_items(&p, &packed, run_tile_bf16, threads);
    }
    free(packed.kb);
    free(packed.vp);
    return status;
#else
    (void)q, (void)q_stride, (void)k, (void)v, (void)kv_stride, (void)n_q, (void)n_k, (void)hq, (void)hkv, (void)d;
    (void)scale, (void)causal_offset, (void)row_offsets, (void)threads, (void)out, (void)lse, (void)out_bf16;
    return 2;
#endif
}

/* As cpllm_prefill_attention_bf16, both products on AMX tiles; 2 where it does not apply: not built with AMX,
 * the OS refused the tile state, or a head size that is no multiple of 32. */
int cpllm_prefill_attention_amx(const float *q, int64_t q_stride, const float *k, const float *v, int64_t kv_stride,
                                int n_q, int n_k, int hq, int hkv, int d, float scale, int causal_offset,
                                const int32_t *row_offsets, int threads, float *out, float *lse, int out_bf16) {
#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (d > MAX_D || d % 4 || hq % hkv || n_k <= 0) return 1;
    if (d % 32 || !amx_permitted()) return 2;
    const Problem p =
        make_problem(q, q_stride, k, v, kv_stride, n_q, n_k, hq, hkv, d, scale, causal_offset, row_offsets, out,
                     lse, out_bf16);
    return prefill_attention_amx(&p, threads);
#else
    (void)q, (void)q_stride, (void)k, (void)v, (void)kv_stride, (void)n_q, (void)n_k, (void)hq, (void)hkv, (void)d;
    (void)scale, (void)causal_offset, (void)row_offsets, (void)threads, (void)out, (void)lse, (void)out_bf16;
    return 2;
#endif
}

#else
int cpllm_prefill_attention_bf16(const float *q, int64_t q_stride, const float *k, const float *v, int64_t kv_stride,
                                 int n_q, int n_k, int hq, int hkv, int d, float scale, int causal_offset,
                                 const int32_t *row_offsets, int threads, float *out, float *lse, int out_bf16) {
    return 2;  /* no AVX-512 on this machine: the caller runs its torch path */
}

int cpllm_prefill_attention(const float *q, int64_t q_stride, const float *k, const float *v, int64_t kv_stride,
                            int n_q, int n_k, int hq, int hkv, int d, float scale, int causal_offset,
                            const int32_t *row_offsets, int threads, float *out, float *lse, int out_bf16) {
    return 2;  /* no AVX-512 on this machine: the caller runs its torch path */
}

int cpllm_prefill_attention_amx(const float *q, int64_t q_stride, const float *k, const float *v, int64_t kv_stride,
                                int n_q, int n_k, int hq, int hkv, int d, float scale, int causal_offset,
                                const int32_t *row_offsets, int threads, float *out, float *lse, int out_bf16) {
    return 2;
}
#endif
