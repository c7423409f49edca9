/* y = x W for a float32 weight stored [in, out] (the float path's layout), for the few rows of a decode step.
 *
 * Each thread takes a contiguous range of output columns (multiples of 16). One row streams its part of every
 * weight row in order, accumulating into the output row (in L1) with fused multiply-adds in input order; measured
 * on SmolLM2's 30 layers at batch 1 (425 MB of weights): as fast as MKL's sgemv through torch (about 16 GB/s on
 * one thread and on two, this machine's memory speed), once each line is prefetched as it is read (without,
 * 11 GB/s). Several rows (up to 16 a block: a verify step's, or a small batch) keep their sums in registers: tiles
 * of rows x 16-64 columns over blocks of 64 inputs whose weights stay in L2, so the weights stream once per block
 * of rows. Every output sums the same products in the same order either way, so a row's result does not depend
 * on the others (measured, 30 layers' 576 x 3072 from memory, one thread: 9 rows in 15 ms against 41 for the
 * blocks of 4 rows this replaces and 24 for MKL's GEMM; 1 row 6 ms, as before).
 */
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

enum { F32_BLOCK_ROWS = 16, F32_COLUMN_ALIGN = 16, F32_CHUNK_COLUMNS = 512, F32_K_BLOCK = 64 };

#if defined(__AVX512F__)
/* y [c0:c1) = x w for one row: each weight row streamed in order, the outputs (in L1) updated in place, the line
 * after the one read prefetched (measured: 10.9 -> 16 GB/s on one thread). The same sums, in the same order, as
 * f32_accumulate's. */
static void f32_stream(const float *x, const float *w, int64_t K, int64_t N, int64_t c0, int64_t c1, float *y) {
    memset(y + c0, 0, sizeof(float) * (c1 - c0));
    const __mmask16 tail = (__mmask16)((1u << ((c1 - c0) % 16)) - 1);
    const int64_t body = c1 - (c1 - c0) % 16;
    for (int64_t k = 0; k < K; k++) {
        const float *wk = w + k * N;
        const __m512 xk = _mm512_set1_ps(x[k]);
        for (int64_t c = c0; c < body; c += 16) {
            _mm_prefetch((const char *)(wk + c) + 64, _MM_HINT_T0);
            _mm512_storeu_ps(y + c, _mm512_fmadd_ps(xk, _mm512_loadu_ps(wk + c), _mm512_loadu_ps(y + c)));
        }
        if (tail)
            _mm512_mask_storeu_ps(y + body, tail, _mm512_fmadd_ps(xk, _mm512_maskz_loadu_ps(tail, wk + body),
                                                                  _mm512_maskz_loadu_ps(tail, y + body)));
    }
}
#endif

#if defined(__AVX512F__)
/* The live lanes of the 16 columns at c of a range ending at c1. */
static inline __mmask16 f32_lanes(int64_t c, int64_t c1) {
    return c1 - c >= 16 ? (__mmask16)0xFFFF : c1 <= c ? (__mmask16)0 : (__mmask16)((1u << (c1 - c)) - 1);
}

/* y [rows, c0:c1) (+)= x [rows, k0:k1) w [k0:k1, c0:c1) for `rows` rows, TV registers of 16 columns per tile: each
 * tile's rows x TV sums stay in registers over the inputs k0 .. k1 - 1 (taken in order, one fused multiply-add
 * each), started from 0 for k0 = 0, else from y; the weight rows of the next input block are prefetched meanwhile. */
static inline __attribute__((always_inline)) void f32_block(const float *x, int64_t ldx, const int rows, const int TV,
                                                            const float *w, int64_t K, int64_t N, int64_t k0,
                                                            int64_t k1, int64_t c0, int64_t c1, float *y,
                                                            int64_t ldy) {
    for (int64_t c = c0; c < c1; c += 16 * TV) {
        __mmask16 lanes[4];
        __m512 acc[16];  /* rows * TV <= 16 */
        for (int v = 0; v < TV; v++) lanes[v] = f32_lanes(c + 16 * v, c1);
        for (int r = 0; r < rows; r++)
            for (int v = 0; v < TV; v++)
                acc[r * TV + v] = k0 == 0 ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(lanes[v], y + r * ldy + c + 16 * v);
        for (int64_t k = k0; k < k1; k++) {
            const float *wk = w + k * N + c;
            if (k + F32_K_BLOCK < K)
                for (int v = 0; v < TV; v++) _mm_prefetch((const char *)(wk + F32_K_BLOCK * N + 16 * v), _MM_HINT_T1);
            __m512 wv[4];
            for (int v = 0; v < TV; v++) wv[v] = _mm512_maskz_loadu_ps(lanes[v], wk + 16 * v);
            for (int r = 0; r < rows; r++) {
                const __m512 xr = _mm512_set1_ps(x[r * ldx + k]);
                for (int v = 0; v < TV; v++) acc[r * TV + v] = _mm512_fmadd_ps(xr, wv[v], acc[r * TV + v]);
            }
        }
        for (int r = 0; r < rows; r++)
            for (int v = 0; v < TV; v++) _mm512_mask_storeu_ps(y + r * ldy + c + 16 * v, lanes[v], acc[r * TV + v]);
    }
}

/* y [rows, c0:c1) = x w for `rows` <= 16 rows: columns in chunks of F32_CHUNK_COLUMNS, inputs in blocks of
 * F32_K_BLOCK (a chunk's block of weights, 128 KB, stays in L2 while its tiles pass), 16 sums in registers. */
static inline __attribute__((always_inline)) void f32_accumulate(const float *x, int64_t ldx, const int rows,
                                                                 const float *w, int64_t K, int64_t N, int64_t c0,
                                                                 int64_t c1, float *y, int64_t ldy) {
    const int TV = rows <= 4 ? 4 : rows <= 8 ? 2 : 1;
    for (int64_t c = c0; c < c1; c += F32_CHUNK_COLUMNS) {
        const int64_t end = c + F32_CHUNK_COLUMNS < c1 ? c + F32_CHUNK_COLUMNS : c1;
        for (int64_t k0 = 0; k0 < K; k0 += F32_K_BLOCK) {
            const int64_t k1 = k0 + F32_K_BLOCK < K ? k0 + F32_K_BLOCK : K;
            f32_block(x, ldx, rows, TV, w, K, N, k0, k1, c, end, y, ldy);
        }
    }
}
#endif

int cpllm_f32_available(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

/* x [M, K] float32, w [K, N] float32 row-major; output columns [c0, c1) only (c0 a multiple of 16), into
 * y [M, ldy] at their own columns (a decode team splits a layer's outputs this way; each column sums in input
 * order whatever the range). Returns 0, or -1 without AVX-512. */
int cpllm_f32_matmul_cols(const float *x, int64_t M, int64_t K, const float *w, int64_t N, int64_t c0, int64_t c1,
                          float *y, int64_t ldy, int threads) {
#if defined(__AVX512F__)
    if (c1 <= c0) return 0;
    const int64_t units = (c1 - c0 + F32_COLUMN_ALIGN - 1) / F32_COLUMN_ALIGN;
    const int parts = threads < units ? threads : (int)units;
#pragma omp parallel for num_threads(parts) schedule(static)
    for (int p = 0; p < parts; p++) {
        const int64_t lo = c0 + units * p / parts * F32_COLUMN_ALIGN;
        const int64_t hi = c0 + units * (p + 1) / parts * F32_COLUMN_ALIGN, end = hi < c1 ? hi : c1;
        for (int64_t r = 0; r < M; r += F32_BLOCK_ROWS) {
            const int64_t rows = M - r < F32_BLOCK_ROWS ? M - r : F32_BLOCK_ROWS;
            switch (rows) {
#define ROWS(R) case R: f32_accumulate(x + r * K, K, R, w, K, N, lo, end, y + r * ldy, ldy); break;
                ROWS(16) ROWS(15) ROWS(14) ROWS(13) ROWS(12) ROWS(11) ROWS(10) ROWS(9)
                ROWS(8) ROWS(7) ROWS(6) ROWS(5) ROWS(4) ROWS(3) ROWS(2)
#undef ROWS
                default: f32_stream(x + r * K, w, K, N, lo, end, y + r * ldy); break;
            }
        }
    }
    return 0;
#else
    (void)x, (void)M, (void)K, (void)w, (void)N, (void)c0, (void)c1, (void)y, (void)ldy, (void)threads;
    return -1;
#endif
}

/* y [M, N] = x W for all N columns. */
int cpllm_f32_matmul(const float *x, int64_t M, int64_t K, const float *w, int64_t N, float *y, int threads) {
    return cpllm_f32_matmul_cols(x, M, K, w, N, 0, N, y, N, threads);
}
