/* The steps one block of the delta rules' chunked form shares between the gated delta rule (delta_chunk.c) and
 * Kimi delta attention (kda_chunk.c), after each has its pairwise products and decays:
 * `delta_solve` the WY system by forward substitution, `delta_block_tail` the block's outputs and state update;
 * and the vectorized exps of decay differences both take.
 */
#ifndef CPLLM_DELTA_BLOCK_H
#define CPLLM_DELTA_BLOCK_H

#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "delta_gemm.h"
#include "vector_exp.h"

/* e[d] = exp(x[d] - y[d]) for d < n, every difference <= 0 (y NULL: exp(x[d])); 16 lanes at a time with AVX-512
 * (vector_exp.h's polynomial: GCC does not vectorize its scalar form), the same polynomial scalar otherwise. */
static void exp_diff(const float *x, const float *y, float *e, int64_t n) {
    int64_t d = 0;
#if defined(__AVX512F__)
    for (; d < n; d += 16) {
        const __mmask16 m = n - d >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - d)) - 1);
        __m512 diff = _mm512_maskz_loadu_ps(m, x + d);
        if (y != NULL) diff = _mm512_sub_ps(diff, _mm512_maskz_loadu_ps(m, y + d));
        _mm512_mask_storeu_ps(e + d, m, exp16_nonpositive(diff));
    }
#endif
    for (; d < n; d++) e[d] = exp_nonpositive(y != NULL ? x[d] - y[d] : x[d]);
}

/* e[j] = exp(x - y[j]) for j < n, every difference <= 0: exp_diff with x broadcast. */
static void exp_sub(float x, const float *y, float *e, int64_t n) {
    int64_t j = 0;
#if defined(__AVX512F__)
    for (; j < n; j += 16) {
        const __mmask16 m = n - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - j)) - 1);
        const __m512 diff = _mm512_sub_ps(_mm512_set1_ps(x), _mm512_maskz_loadu_ps(m, y + j));
        _mm512_mask_storeu_ps(e + j, m, exp16_nonpositive(diff));
    }
#endif
    for (; j < n; j++) e[j] = exp_nonpositive(x - y[j]);
}

enum { DELTA_CHUNK = 64, DELTA_SOLVE = 16 };

/* c[m, n] (+)= a[m, m] b[m, n] for a lower triangular a (zero above its diagonal): a slab of DELTA_SOLVE rows
 * reads only the columns of a (rows of b) up to its last row. */
static void delta_gemm_lower(int64_t m, int64_t n, const float *a, int64_t lda, const float *b, int64_t ldb, float *c,
                             int64_t ldc, int accumulate) {
    for (int64_t i0 = 0; i0 < m; i0 += DELTA_SOLVE) {
        const int64_t rows = m - i0 < DELTA_SOLVE ? m - i0 : DELTA_SOLVE;
        delta_gemm(rows, n, i0 + rows, a + i0 * lda, lda, b, ldb, c + i0 * ldc, ldc, accumulate);
    }
}

/* The lower part of c[m, m] = a[m, k] bt[k, m]: a slab of DELTA_SOLVE rows computes the columns up to its last row
 * (those right of the diagonal inside the slab too; the caller ignores or zeroes them, and the columns past). */
static void delta_gemm_to_lower(int64_t m, int64_t k, const float *a, int64_t lda, const float *bt, int64_t ldb,
                                float *c, int64_t ldc) {
    for (int64_t i0 = 0; i0 < m; i0 += DELTA_SOLVE) {
        const int64_t rows = m - i0 < DELTA_SOLVE ? m - i0 : DELTA_SOLVE;
        delta_gemm(rows, i0 + rows, k, a + i0 * lda, lda, bt, ldb, c + i0 * ldc, ldc, 0);
    }
}

/* x [c, wide] <- (I + A)^-1 x, A strictly lower in a [c, DELTA_CHUNK] (its diagonal and upper part are not read):
 * rows DELTA_SOLVE at a time, their products with the rows already solved one GEMM. a is negated in place. */
static void delta_solve(float *a, float *x, int64_t c, int64_t wide) {
    for (int64_t i = 0; i < c; i++)
        for (int64_t j = 0; j < i; j++) a[i * DELTA_CHUNK + j] = -a[i * DELTA_CHUNK + j];
    for (int64_t b0 = 0; b0 < c; b0 += DELTA_SOLVE) {
        const int64_t rows = c - b0 < DELTA_SOLVE ? c - b0 : DELTA_SOLVE;
        delta_gemm(rows, wide, b0, a + b0 * DELTA_CHUNK, DELTA_CHUNK, x, wide, x + b0 * wide, wide, 1);
        for (int64_t i = b0; i < b0 + rows; i++)
            for (int64_t j = b0; j < i; j++) {
                const float aij = a[i * DELTA_CHUNK + j];
                const float *restrict xj = x + j * wide;
                float *restrict xr = x + i * wide;
                for (int64_t d = 0; d < wide; d++) xr[d] += aij * xj[d];
            }
    }
}

/* With x [c, dv + dk] = [u | w] solved, qd [c, dk] the decayed queries, p [c, DELTA_CHUNK] the intra-block scores
 * (lower with the diagonal, zero above), kdt [dk, DELTA_CHUNK] the keys decayed to the block's end, transposed, and
 * row_decay [dk] the state's decay over the block: v' = u - w S (in vn [c, dv], ws [c, dv] scratch);
 * out [c, dv] (rows ldo apart) = qd S + p v'; S [dk, dv] <- diag(row_decay) S + kdt v'. */
static void delta_block_tail(const float *x, const float *qd, const float *p, const float *kdt,
                             const float *row_decay, float *s, float *ws, float *vn, float *out, int64_t ldo,
                             int64_t c, int64_t dk, int64_t dv) {
    const int64_t wide = dv + dk;
    delta_gemm(c, dv, dk, x + dv, wide, s, dv, ws, dv, 0);  /* w S */
    for (int64_t i = 0; i < c; i++)
        for (int64_t d = 0; d < dv; d++) vn[i * dv + d] = x[i * wide + d] - ws[i * dv + d];
    delta_gemm(c, dv, dk, qd, dk, s, dv, out, ldo, 0);       /* qd S */
    delta_gemm_lower(c, dv, p, DELTA_CHUNK, vn, dv, out, ldo, 1);  /* + p v' */
    for (int64_t r = 0; r < dk; r++)
        for (int64_t d = 0; d < dv; d++) s[r * dv + d] *= row_decay[r];
    delta_gemm(dk, dv, c, kdt, DELTA_CHUNK, vn, dv, s, dv, 1);  /* + kdt v' */
}

/* One block of one head's chunked rule: rows [t0, t0 + c) of the head's q, k, v, decay g and beta (rows h heads
 * apart), its state s updated in place, its output rows written; `scratch` is the thread's own. */
typedef void (*HeadBlock)(const float *q, const float *k, const float *v, const float *g, const float *beta,
                          float *out, float *s, int64_t t0, int64_t c, int64_t h, int64_t dk, int64_t dv,
                          float *scratch);

/* Every head over every DELTA_CHUNK-token block, `g_width` decay values per head and token (1: gated DeltaNet's
 * scalar, dk: KDA's per channel). Blocks outer, each thread's heads inner: a block's rows of all heads are read
 * while their pages are hot (heads outer would stride every input by H * d floats per token, one page per row); a
 * static schedule gives a thread the same heads, so the same states, at every block. Returns 0, or -1 where the
 * scratch (`per_thread` floats a thread) could not be allocated (nothing written). */
static int run_blocks(HeadBlock block, int64_t per_thread, int64_t g_width, const float *q, const float *k,
                      const float *v, const float *g, const float *beta, const float *state_in, float *state_out,
                      float *out, int64_t t, int64_t h, int64_t dk, int64_t dv, int threads) {
    if (threads < 1) threads = 1;
    float *scratch = malloc((size_t)(per_thread * threads) * sizeof(float));
    if (scratch == NULL) return -1;
    if (state_out != state_in) memcpy(state_out, state_in, (size_t)(h * dk * dv) * sizeof(float));
#pragma omp parallel num_threads(threads) if (h > 1)
    {
        float *mine = scratch + per_thread * omp_get_thread_num();
        for (int64_t t0 = 0; t0 < t; t0 += DELTA_CHUNK) {
            const int64_t c = t - t0 < DELTA_CHUNK ? t - t0 : DELTA_CHUNK;
#pragma omp for schedule(static) nowait
            for (int64_t head = 0; head < h; head++)
                block(q + head * dk, k + head * dk, v + head * dv, g + head * g_width, beta + head, out + head * dv,
                      state_out + head * dk * dv, t0, c, h, dk, dv, mine);
        }
    }
    free(scratch);
    return 0;
}

#endif
