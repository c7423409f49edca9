/* y = x W^T for W in 4-bit groups of 32 inputs (w = d q + m, q in 0..15), with AVX-512 VNNI.
 *
 * Each row of x is quantized per group of 32 inputs to two int8 codes: xq with step s = max|x| / 127 (the
 * scheme llama.cpp uses for the activations of its 4-bit matmuls) and xr, the remainder x - s xq quantized with
 * step s / 254. Together they hold x to about 2^-15 of the group's largest value, finer than bfloat16 (2^-9 of
 * each value), and a group's dot product stays integer:
 *     sum_k w_k x_k ~= d (s / 254) sum_k q_k (254 xq_k + xr_k) + m sum_k x_k
 * (the sum of x is taken in float32 from the unquantized row). vpdpbusd multiplies 64 unsigned codes by 64
 * signed activations per instruction: at batch 1 the weights stream at memory speed on one core; the second
 * code costs prefill about half its matmul speed against one code (still 2x aten's int4 kernel).
 *
 * Weight layout (packed once at load, see int4_matmul.py): output rows in blocks of 16; per block and group a
 * record of 320 bytes:
 *     bytes [64 i + 4 r + b], i, b in 0..3, r in 0..15: code(r, 4 i + b) | code(r, 16 + 4 i + b) << 4
 *     then d of the 16 rows (float16), then m of the 16 rows (float16).
 * One 64-byte load thus gives, in its low nibbles, the 4 consecutive codes of inputs 4i..4i+3 of each of the
 * 16 rows (one 32-bit lane per row, what vpdpbusd wants) and in its high nibbles those of inputs 16+4i...
 *
 * A row's result does not depend on the other rows of x (no batch-size-dependent path): every layout and
 * batch composition computes a token's outputs alike.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define CPLLM_INT4_VNNI 1
#include <immintrin.h>
#endif

enum { GROUP = 32, BLOCK_ROWS = 16, RECORD_BYTES = 320, TILE_M = 4, CHUNK_M = 64, RESIDUAL = 254 };

int cpllm_int4_available(void) {
#ifdef CPLLM_INT4_VNNI
    return 1;
#else
    return 0;
#endif
}

#ifdef CPLLM_INT4_VNNI

/* One row of x [K] -> two int8 codes per input and, per group, the step s and the float32 sum of the group:
 * x ~= s xq + (s / RESIDUAL) xr, where xr quantizes what s xq leaves (|x - s xq| <= s / 2). */
static void quantize_row(const float *x, int K, int8_t *xq, int8_t *xr, float *xs, float *xsum) {
    for (int g = 0; g < K / GROUP; g++) {
        const __m512 v0 = _mm512_loadu_ps(x + g * GROUP), v1 = _mm512_loadu_ps(x + g * GROUP + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        const float step = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        const __m512 vinv = _mm512_set1_ps(inv), vstep = _mm512_set1_ps(step);
        const __m512 rinv = _mm512_set1_ps(inv * RESIDUAL);
        const __m512 vv[2] = {v0, v1};
        for (int h = 0; h < 2; h++) {
            /* round to nearest (even) under the default rounding mode; |x inv| <= 127, so nothing saturates */
            const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(vv[h], vinv));
            const __m512 rest = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(q), vstep, vv[h]);
            const __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(rest, rinv));
            _mm_storeu_si128((__m128i *)(xq + g * GROUP + 16 * h), _mm512_cvtsepi32_epi8(q));
            _mm_storeu_si128((__m128i *)(xr + g * GROUP + 16 * h), _mm512_cvtsepi32_epi8(r));
        }
        xs[g] = step;
        xsum[g] = _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
    }
}

static inline __m512i broadcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return _mm512_set1_epi32(v);
}

/* Ask for the record of group g of the block `ahead` (NULL: none) into L2. With more rows than one tile a block is
 * computed in several passes from L1, and the hardware prefetcher alone then fell behind the weights' stream:
 * measured at 5 rows on the 49K x 1152 int8 LM head (35 MB, from memory), 3.7 ms without, 1.9 with (4 rows: 1.4). */
static inline __attribute__((always_inline)) void prefetch_record(const uint8_t *ahead, int g) {
    if (!ahead) return;
    const char *p = (const char *)ahead + (int64_t)g * RECORD_BYTES;
    for (int b = 0; b < RECORD_BYTES; b += 64) _mm_prefetch(p + b, _MM_HINT_T1);
    _mm_prefetch(p + RECORD_BYTES - 1, _MM_HINT_T1);
}

/* Rows m0 .. m0 + mt - 1 of y against one block of 16 output rows (`valid` of them real); `ahead`, the block to
 * prefetch meanwhile (or NULL). */
static inline __attribute__((always_inline)) void tile(const uint8_t *block, int G, const int8_t *xq,
                                                       const int8_t *xr, const float *xs, const float *xsum, int mt,
                                                       float *y, int64_t ldy, int valid, const uint8_t *ahead) {
    const int K = G * GROUP;
    const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
    __m512 out[TILE_M];
    for (int t = 0; t < mt; t++) out[t] = _mm512_setzero_ps();
    for (int g = 0; g < G; g++) {
        const uint8_t *record = block + (int64_t)g * RECORD_BYTES;
        prefetch_record(ahead, g);
        __m512i dot[TILE_M], rdot[TILE_M];
        for (int t = 0; t < mt; t++) dot[t] = rdot[t] = _mm512_setzero_si512();
        for (int i = 0; i < 4; i++) {
            const __m512i codes = _mm512_loadu_si512(record + 64 * i);
            const __m512i lo = _mm512_and_si512(codes, low_nibbles);
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(codes, 4), low_nibbles);
            for (int t = 0; t < mt; t++) {
                const int8_t *xg = xq + (int64_t)t * K + g * GROUP, *rg = xr + (int64_t)t * K + g * GROUP;
                dot[t] = _mm512_dpbusd_epi32(dot[t], lo, broadcast4(xg + 4 * i));
                dot[t] = _mm512_dpbusd_epi32(dot[t], hi, broadcast4(xg + 16 + 4 * i));
                rdot[t] = _mm512_dpbusd_epi32(rdot[t], lo, broadcast4(rg + 4 * i));
                rdot[t] = _mm512_dpbusd_epi32(rdot[t], hi, broadcast4(rg + 16 + 4 * i));
            }
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(record + 256)));
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(record + 288)));
        for (int t = 0; t < mt; t++) {
            /* |RESIDUAL dot + rdot| < 32 * 15 * 127 * 255 < 2^24: exact in int32 and in its float conversion */
            const __m512i both = _mm512_add_epi32(_mm512_mullo_epi32(dot[t], _mm512_set1_epi32(RESIDUAL)), rdot[t]);
            const __m512 step = _mm512_mul_ps(d, _mm512_set1_ps(xs[(int64_t)t * G + g] / RESIDUAL));
            out[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(both), step, out[t]);
            out[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[(int64_t)t * G + g]), out[t]);
        }
    }
    const __mmask16 keep = (__mmask16)((1u << valid) - 1u);
    for (int t = 0; t < mt; t++) _mm512_mask_storeu_ps(y + (int64_t)t * ldy, keep, out[t]);
}

/* All `rows` rows against one block; `ahead` (or NULL) is prefetched during the first tile. */
static void block_rows(const uint8_t *block, int G, const int8_t *xq, const int8_t *xr, const float *xs,
                       const float *xsum, int64_t rows, float *y, int64_t ldy, int valid, const uint8_t *ahead) {
    const int K = G * GROUP;
    int64_t r = 0;
    for (; r + TILE_M <= rows; r += TILE_M, ahead = NULL)
        tile(block, G, xq + r * K, xr + r * K, xs + r * G, xsum + r * G, TILE_M, y + r * ldy, ldy, valid, ahead);
#define REST(MT) tile(block, G, xq + r * K, xr + r * K, xs + r * G, xsum + r * G, MT, y + r * ldy, ldy, valid, ahead)
    switch (rows - r) {
        case 3: REST(3); break;
        case 2: REST(2); break;
        case 1: REST(1); break;
        default: break;
    }
#undef REST
}
#endif

/* x [M, K] float32 (rows contiguous), packed weight of N output rows; computes the output columns of blocks
 * [b0, b1) of 16 rows only, into y [M, ldy] at their own columns (a decode team splits a layer's outputs this
 * way; each column's value does not depend on the range). Returns 0, or -1 when the kernel is not built for this
 * CPU or its scratch could not be allocated. */
int cpllm_int4_matmul_blocks(const float *x, int64_t M, int K, const uint8_t *packed, int N, int64_t b0, int64_t b1,
                             float *y, int64_t ldy, int threads) {
#ifdef CPLLM_INT4_VNNI
    const int G = K / GROUP;
    int8_t *xq = malloc(2 * (size_t)M * K), *xr = xq + (size_t)M * K;
    float *xs = malloc(sizeof(float) * (size_t)M * G), *xsum = malloc(sizeof(float) * (size_t)M * G);
    if (!xq || !xs || !xsum) {
        free(xq), free(xs), free(xsum);
        return -1;
    }
#pragma omp parallel for num_threads(threads) schedule(static) if (M > 1)
    for (int64_t r = 0; r < M; r++) quantize_row(x + r * K, K, xq + r * K, xr + r * K, xs + r * G, xsum + r * G);
    /* chunks of CHUNK_M rows keep their quantized rows in cache while every block of weights passes */
    const int64_t chunks = (M + CHUNK_M - 1) / CHUNK_M, blocks = b1 - b0;
#pragma omp parallel for collapse(2) num_threads(threads) schedule(static)
    for (int64_t c = 0; c < chunks; c++)
        for (int64_t i = 0; i < blocks; i++) {
            const int64_t b = b0 + i, r0 = c * CHUNK_M, rows = M - r0 < CHUNK_M ? M - r0 : CHUNK_M;
            const int valid = N - b * BLOCK_ROWS < BLOCK_ROWS ? (int)(N - b * BLOCK_ROWS) : BLOCK_ROWS;
            const uint8_t *block = packed + b * (int64_t)G * RECORD_BYTES;
            /* the next block, at every row count (1 row of the 35 MB LM head from memory: 0.67 against 0.90 ms) */
            const uint8_t *ahead = i + 1 < blocks ? block + (int64_t)G * RECORD_BYTES : NULL;
            block_rows(block, G, xq + r0 * K, xr + r0 * K, xs + r0 * G, xsum + r0 * G, rows,
                       y + r0 * ldy + b * BLOCK_ROWS, ldy, valid, ahead);
        }
    free(xq), free(xs), free(xsum);
    return 0;
#else
    (void)x, (void)M, (void)K, (void)packed, (void)N, (void)b0, (void)b1, (void)y, (void)ldy, (void)threads;
    return -1;
#endif
}

/* y [M, N] = x W^T for all N output rows. */
int cpllm_int4_matmul(const float *x, int64_t M, int K, const uint8_t *packed, int N, float *y, int threads) {
    return cpllm_int4_matmul_blocks(x, M, K, packed, N, 0, (N + BLOCK_ROWS - 1) / BLOCK_ROWS, y, N, threads);
}
