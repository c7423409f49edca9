/* y = x W^T for W in 4-bit groups of 32 inputs (w = d q + m), on CPUs with AVX2, FMA and F16C but no AVX-512 VNNI.
 *
 * Same weight layout as int4_matmul.c (packed once at load by int4_matmul.pack: blocks of 16 output rows, per block
 * and group a record of 320 bytes: bytes [64 i + 4 r + b] hold code(r, 4 i + b) | code(r, 16 + 4 i + b) << 4, then
 * d and m of the 16 rows in float16), so the int4 bytes per rank are those of the VNNI kernel, and the same
 * arithmetic: each activation row is quantized per group to xq (step s = max|x| / 127) and the remainder xr (step
 * s / 254), and a group's dot product is taken in integers,
 *     sum_k w_k x_k ~= d (s / 254) sum_k q_k (254 xq_k + xr_k) + m sum_k x_k.
 * AVX2 has no vpdpbusd: vpmaddubsw multiplies the unsigned codes by the signed activations and adds pairs into
 * int16, and the 8 products of a group (4 inputs x low and high nibbles) add up in int16 before one vpmaddwd
 * widens them (|sum| <= 8 * 2 * 15 * 128 < 2^15, so nothing saturates). A 32-byte load is 8 rows x 4 inputs, one
 * 32-bit lane per row, so the results stay in one register per 8 rows and no horizontal sum is needed.
 *
 * `cpllm_int4_avx2_dequantize` writes a range of blocks as float32 or bfloat16 rows [16 per block, K]: the prefill
 * path (int4_gemm.py) multiplies those by torch's GEMMs, faster than integer dot products for many rows (float32
 * here, bfloat16 where the CPU has bf16 dot products or tiles: int4_choice.py measures which).
 *
 * A row's result does not depend on the other rows of x: every batch composition computes a token alike.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define CPLLM_INT4_AVX2 1
#include <immintrin.h>
#endif

enum { GROUP = 32, BLOCK_ROWS = 16, RECORD_BYTES = 320, TILE_M = 4, CHUNK_M = 64, RESIDUAL = 254 };

int cpllm_int4_avx2_available(void) {
#ifdef CPLLM_INT4_AVX2
    return 1;
#else
    return 0;
#endif
}

#ifdef CPLLM_INT4_AVX2

static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* 32 int32 (four registers of 8, in order) -> 32 int8 with signed saturation, in order. */
static inline void store_int8(int8_t *out, const __m256i q[4]) {
    const __m256i p01 = _mm256_packs_epi32(q[0], q[1]), p23 = _mm256_packs_epi32(q[2], q[3]);
    /* packs work per 128-bit lane: the bytes come out as 4-element pieces in the order 0 2 4 6 1 3 5 7 */
    const __m256i p = _mm256_packs_epi16(p01, p23);
    _mm256_storeu_si256((__m256i *)out, _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

/* One row of x [K] -> xq, xr (x ~= s xq + (s / RESIDUAL) xr), and per group the step s and the float32 sum. The
 * float arithmetic is int4_matmul.c's, so both kernels quantize a row alike. */
static void quantize_row(const float *x, int K, int8_t *xq, int8_t *xr, float *xs, float *xsum) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int g = 0; g < K / GROUP; g++) {
        __m256 v[4], vmax = _mm256_setzero_ps(), vsum = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) {
            v[j] = _mm256_loadu_ps(x + g * GROUP + 8 * j);
            vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, v[j]));
            vsum = _mm256_add_ps(vsum, v[j]);
        }
        const float amax = hmax8(vmax);
        const float step = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        const __m256 vinv = _mm256_set1_ps(inv), vstep = _mm256_set1_ps(step), rinv = _mm256_set1_ps(inv * RESIDUAL);
        __m256i q[4], r[4];
        for (int j = 0; j < 4; j++) {
            /* round to nearest (even) under the default rounding mode; |x inv| <= 127 */
            q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], vinv));
            const __m256 rest = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(q[j]), vstep, v[j]);
            r[j] = _mm256_cvtps_epi32(_mm256_mul_ps(rest, rinv));
        }
        store_int8(xq + g * GROUP, q);
        store_int8(xr + g * GROUP, r);
        xs[g] = step;
        xsum[g] = hsum8(vsum);
    }
}

static inline __m256i broadcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return _mm256_set1_epi32(v);
}

/* Rows m0 .. m0 + mt - 1 of y against half `h` (8 rows) of one block of 16 output rows, `valid` of them real. */
static inline __attribute__((always_inline)) void half_tile(const uint8_t *block, int G, int h, const int8_t *xq,
                                                            const int8_t *xr, const float *xs, const float *xsum,
                                                            int mt, float *y, int64_t ldy, int valid) {
    const int K = G * GROUP;
    const __m256i low_nibbles = _mm256_set1_epi8(0x0F), residual = _mm256_set1_epi16(RESIDUAL);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 out[TILE_M];
    for (int t = 0; t < mt; t++) out[t] = _mm256_setzero_ps();
    for (int g = 0; g < G; g++) {
        const uint8_t *record = block + (int64_t)g * RECORD_BYTES;
        __m256i dot[TILE_M], rdot[TILE_M];
        for (int t = 0; t < mt; t++) dot[t] = rdot[t] = _mm256_setzero_si256();
        for (int i = 0; i < 4; i++) {
            const __m256i codes = _mm256_loadu_si256((const __m256i *)(record + 64 * i + 32 * h));
            const __m256i lo = _mm256_and_si256(codes, low_nibbles);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(codes, 4), low_nibbles);
            for (int t = 0; t < mt; t++) {
                const int8_t *xg = xq + (int64_t)t * K + g * GROUP, *rg = xr + (int64_t)t * K + g * GROUP;
                dot[t] = _mm256_add_epi16(dot[t], _mm256_maddubs_epi16(lo, broadcast4(xg + 4 * i)));
                dot[t] = _mm256_add_epi16(dot[t], _mm256_maddubs_epi16(hi, broadcast4(xg + 16 + 4 * i)));
                rdot[t] = _mm256_add_epi16(rdot[t], _mm256_maddubs_epi16(lo, broadcast4(rg + 4 * i)));
                rdot[t] = _mm256_add_epi16(rdot[t], _mm256_maddubs_epi16(hi, broadcast4(rg + 16 + 4 * i)));
            }
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(record + 256 + 16 * h)));
        const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(record + 288 + 16 * h)));
        for (int t = 0; t < mt; t++) {
            /* RESIDUAL dot + rdot per row, exact in int32 and (< 2^24) in its float conversion */
            const __m256i both = _mm256_add_epi32(_mm256_madd_epi16(dot[t], residual), _mm256_madd_epi16(rdot[t], ones));
            const __m256 step = _mm256_mul_ps(d, _mm256_set1_ps(xs[(int64_t)t * G + g] / RESIDUAL));
            out[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(both), step, out[t]);
            out[t] = _mm256_fmadd_ps(m, _mm256_set1_ps(xsum[(int64_t)t * G + g]), out[t]);
        }
    }
    const int keep = valid - 8 * h;
    for (int t = 0; t < mt; t++) {
        if (keep >= 8) {
            _mm256_storeu_ps(y + (int64_t)t * ldy + 8 * h, out[t]);
        } else {
            float lanes[8];
            _mm256_storeu_ps(lanes, out[t]);
            memcpy(y + (int64_t)t * ldy + 8 * h, lanes, sizeof(float) * (size_t)keep);
        }
    }
}

/* All `rows` rows against one block: tiles of TILE_M rows share each unpacked load of codes. */
static void block_rows(const uint8_t *block, int G, const int8_t *xq, const int8_t *xr, const float *xs,
                       const float *xsum, int64_t rows, float *y, int64_t ldy, int valid) {
    const int K = G * GROUP;
    for (int h = 0; h < 2 && 8 * h < valid; h++) {
        int64_t r = 0;
        for (; r + TILE_M <= rows; r += TILE_M)
            half_tile(block, G, h, xq + r * K, xr + r * K, xs + r * G, xsum + r * G, TILE_M, y + r * ldy, ldy, valid);
#define REST(MT) half_tile(block, G, h, xq + r * K, xr + r * K, xs + r * G, xsum + r * G, MT, y + r * ldy, ldy, valid)
        switch (rows - r) {
            case 3: REST(3); break;
            case 2: REST(2); break;
            case 1: REST(1); break;
            default: break;
        }
#undef REST
    }
}

/* The 32 codes of row r of one group's record, in input order, as bytes 0..15 into codes[32]. */
static inline void row_codes(const uint8_t *record, int r, uint8_t codes[GROUP]) {
    int32_t piece[4];
    for (int i = 0; i < 4; i++) memcpy(&piece[i], record + 64 * i + 4 * r, sizeof(int32_t));
    const __m128i packed = _mm_setr_epi32(piece[0], piece[1], piece[2], piece[3]);
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(packed, mask), hi = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);
    _mm_storeu_si128((__m128i *)codes, lo);
    _mm_storeu_si128((__m128i *)(codes + 16), hi);
}
#endif

/* x [M, K] float32 (rows contiguous), packed weight of N output rows -> y [M, N]. Returns 0, or -1 when the kernel
 * is not built for this CPU or its scratch could not be allocated. */
int cpllm_int4_avx2_matmul(const float *x, int64_t M, int K, const uint8_t *packed, int N, float *y, int threads) {
#ifdef CPLLM_INT4_AVX2
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
    const int64_t chunks = (M + CHUNK_M - 1) / CHUNK_M, blocks = (N + BLOCK_ROWS - 1) / BLOCK_ROWS;
#pragma omp parallel for collapse(2) num_threads(threads) schedule(static)
    for (int64_t c = 0; c < chunks; c++)
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t r0 = c * CHUNK_M, rows = M - r0 < CHUNK_M ? M - r0 : CHUNK_M;
            const int valid = N - b * BLOCK_ROWS < BLOCK_ROWS ? (int)(N - b * BLOCK_ROWS) : BLOCK_ROWS;
            block_rows(packed + b * (int64_t)G * RECORD_BYTES, G, xq + r0 * K, xr + r0 * K, xs + r0 * G,
                       xsum + r0 * G, rows, y + r0 * N + b * BLOCK_ROWS, N, valid);
        }
    free(xq), free(xs), free(xsum);
    return 0;
#else
    (void)x, (void)M, (void)K, (void)packed, (void)N, (void)y, (void)threads;
    return -1;
#endif
}

#ifdef CPLLM_INT4_AVX2
/* Row r of one block's group as 4 x 8 float32 w = d q + m (d, m from float16). */
static inline void group_row(const uint8_t *record, int r, __m256 w[4]) {
    uint16_t d16, m16;
    memcpy(&d16, record + 256 + 2 * r, sizeof d16);
    memcpy(&m16, record + 288 + 2 * r, sizeof m16);
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(d16)), m = _mm256_set1_ps(_cvtsh_ss(m16));
    uint8_t codes[GROUP];
    row_codes(record, r, codes);
    for (int j = 0; j < 4; j++) {
        const __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(codes + 8 * j)));
        /* d q is exact in float32 (11 + 4 bits); one rounding for the + m, as d * q + m in torch */
        w[j] = _mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(q)), m);
    }
}

/* 8 float32 -> their bfloat16 bits (round to nearest even, as torch's .to(bfloat16)) in the low 16 of each lane. */
static inline __m256i bf16_bits(__m256 w) {
    const __m256i u = _mm256_castps_si256(w);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    return _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
}

static inline void store_row(const __m256 w[4], float *dst) {
    for (int j = 0; j < 4; j++) _mm256_storeu_ps(dst + 8 * j, w[j]);
}

static inline void store_row_bf16(const __m256 w[4], uint16_t *dst) {
    for (int j = 0; j < 4; j += 2) {  /* packus interleaves 128-bit lanes: permute them back in order */
        const __m256i both = _mm256_packus_epi32(bf16_bits(w[j]), bf16_bits(w[j + 1]));
        _mm256_storeu_si256((__m256i *)(dst + 8 * j), _mm256_permute4x64_epi64(both, 0xD8));
    }
}
#endif

#if defined(CPLLM_INT4_AVX2) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define CPLLM_DEQUANT_AVX512 1
#include "int4_record.h"

/* One group's record as bfloat16 rows on AVX-512: its pair words (int4_record.h) transposed 16 x 16 into the rows'
 * 64 bytes. The bits of the AVX2 way, 1.7x as fast on SmolLM2's layers. */
static void record_rows_bf16(const uint8_t *record, int valid, uint16_t *out, int64_t K) {
    __m512i words[16];  /* words[j]: inputs 2j, 2j + 1 of the 16 rows */
    record_pair_words(record, words);
    transpose16(words);
    for (int r = 0; r < valid; r++) _mm512_storeu_si512((void *)(out + r * K), words[r]);
}
#endif

/* Output rows [16 b0, min(16 b1, N)) of the packed weight as w = d q + m (d, m from float16) into out [rows, K],
 * row-major: float32 (`bf16` 0), or bfloat16 (w rounded to nearest even once): 16 rows at a time where the CPU has
 * AVX-512 BF16 (`bf16` 1), row by row on AVX2 (`bf16` 2, or 1 elsewhere; the tests run both). Returns 0, or -1 when
 * the kernel is not built for this CPU. */
int cpllm_int4_avx2_dequantize(const uint8_t *packed, int K, int N, int64_t b0, int64_t b1, void *out, int bf16,
                               int threads) {
#ifdef CPLLM_INT4_AVX2
    const int G = K / GROUP;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = b0; b < b1; b++) {
        const int valid = N - b * BLOCK_ROWS < BLOCK_ROWS ? (int)(N - b * BLOCK_ROWS) : BLOCK_ROWS;
        for (int g = 0; g < G; g++) {
            const uint8_t *record = packed + (b * G + g) * (int64_t)RECORD_BYTES;
#ifdef CPLLM_DEQUANT_AVX512
            if (bf16 == 1) {
                record_rows_bf16(record, valid, (uint16_t *)out + (b - b0) * BLOCK_ROWS * (int64_t)K + g * GROUP, K);
                continue;
            }
#endif
            for (int r = 0; r < valid; r++) {
                __m256 w[4];
                group_row(record, r, w);
                const int64_t at = ((b - b0) * BLOCK_ROWS + r) * (int64_t)K + g * GROUP;
                if (bf16)
                    store_row_bf16(w, (uint16_t *)out + at);
                else
                    store_row(w, (float *)out + at);
            }
        }
    }
    return 0;
#else
    (void)packed, (void)K, (void)N, (void)b0, (void)b1, (void)out, (void)bf16, (void)threads;
    return -1;
#endif
}
