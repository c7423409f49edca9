/* A small float32 GEMM for the delta rules' chunked kernel (delta_chunk.c): c[m, n] = (accumulate ? c : 0) +
 * a[m, k] b[k, n], row-major with leading dimensions, sized for one block of a head (m, k, n <= a few hundred, all
 * in L1/L2). With AVX-512: tiles of 4 rows x 64 columns in 16 accumulators, a row of a broadcast against 4 vectors
 * of b per k, masked vectors at a ragged column edge. Otherwise a plain loop the compiler vectorizes.
 */
#ifndef CPLLM_DELTA_GEMM_H
#define CPLLM_DELTA_GEMM_H

#include <stdint.h>

#if defined(__AVX512F__)
#include <immintrin.h>

/* rows x (vectors of 16 columns, the last masked by `tail`) of c at one tile. */
static inline __attribute__((always_inline)) void gemm_tile(int rows, int vecs, __mmask16 tail, int64_t k,
                                                            const float *a, int64_t lda, const float *b, int64_t ldb,
                                                            float *c, int64_t ldc, int accumulate) {
    __m512 acc[4][4];
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < vecs; v++) {
            const __mmask16 m = v == vecs - 1 ? tail : 0xFFFF;
            acc[r][v] = accumulate ? _mm512_maskz_loadu_ps(m, c + r * ldc + 16 * v) : _mm512_setzero_ps();
        }
    for (int64_t p = 0; p < k; p++) {
        __m512 bv[4];
        for (int v = 0; v < vecs; v++)
            bv[v] = _mm512_maskz_loadu_ps(v == vecs - 1 ? tail : 0xFFFF, b + p * ldb + 16 * v);
        for (int r = 0; r < rows; r++) {
            const __m512 av = _mm512_set1_ps(a[r * lda + p]);
            for (int v = 0; v < vecs; v++) acc[r][v] = _mm512_fmadd_ps(av, bv[v], acc[r][v]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < vecs; v++)
            _mm512_mask_storeu_ps(c + r * ldc + 16 * v, v == vecs - 1 ? tail : 0xFFFF, acc[r][v]);
}

#define GEMM_TILE_ROWS(R)                                                                                        \
    switch (vecs) {                                                                                              \
    case 4: gemm_tile(R, 4, tail, k, a + i * lda, lda, b + j, ldb, c + i * ldc + j, ldc, accumulate); break;    \
    case 3: gemm_tile(R, 3, tail, k, a + i * lda, lda, b + j, ldb, c + i * ldc + j, ldc, accumulate); break;    \
    case 2: gemm_tile(R, 2, tail, k, a + i * lda, lda, b + j, ldb, c + i * ldc + j, ldc, accumulate); break;    \
    default: gemm_tile(R, 1, tail, k, a + i * lda, lda, b + j, ldb, c + i * ldc + j, ldc, accumulate); break;   \
    }

static void delta_gemm(int64_t m, int64_t n, int64_t k, const float *a, int64_t lda, const float *b, int64_t ldb,
                       float *c, int64_t ldc, int accumulate) {
    for (int64_t j = 0; j < n; j += 64) {
        const int64_t cols = n - j < 64 ? n - j : 64;
        const int vecs = (int)((cols + 15) / 16);
        const int rest = (int)(cols - 16 * (vecs - 1));
        const __mmask16 tail = (__mmask16)(rest == 16 ? 0xFFFF : (1u << rest) - 1);
        int64_t i = 0;
        for (; i + 4 <= m; i += 4) GEMM_TILE_ROWS(4)
        for (; i < m; i++) GEMM_TILE_ROWS(1)
    }
}
#undef GEMM_TILE_ROWS

#else

static void delta_gemm(int64_t m, int64_t n, int64_t k, const float *a, int64_t lda, const float *b, int64_t ldb,
                       float *c, int64_t ldc, int accumulate) {
    for (int64_t i = 0; i < m; i++) {
        float *restrict row = c + i * ldc;
        if (!accumulate)
            for (int64_t j = 0; j < n; j++) row[j] = 0.0f;
        for (int64_t p = 0; p < k; p++) {
            const float x = a[i * lda + p];
            const float *restrict brow = b + p * ldb;
            for (int64_t j = 0; j < n; j++) row[j] += x * brow[j];
        }
    }
}

#endif
#endif
