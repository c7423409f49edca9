/* The gated delta rule's chunked form for one request's prompt chunk, per head over its blocks in C: the same WY
 * form as cpllm/layers/gated_delta/rule.py `chunked_delta_rule_torch` (see its module docstring), with every
 * block's products done in L1/L2 by delta_gemm.h (delta_block.h: the solve and the state update) instead of
 * torch's batched ops and layout copies.
 *
 * Per head h and block of c <= CHUNK tokens (the last one may be short; no padding), with G = cumsum(g) inside
 * the block and the state S [dk, dv]:
 *   A = beta_i k_i . k_j exp(G_i - G_j) (j < i),  P = q_i . k_j exp(G_i - G_j) (j <= i)    [c, c]
 *   (I + A) [u | w] = [beta v | beta exp(G) k]   (forward substitution)                    [c, dv + dk]
 *   v' = u - w S;  out = (exp(G) q) S + P v';  S <- exp(G_c) S + (exp(G_c - G) k)^T v'
 * q, k [T, H, dk], v [T, H, dv], g, beta [T, H], out [T, H, dv], state_in, state_out [H, dk, dv], all contiguous
 * float32 (state_out may be state_in). OpenMP splits the heads.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "delta_block.h"

enum { CHUNK = DELTA_CHUNK };

/* One head's block of c tokens from t0 (q, k, v, g, beta, out at the head's first column); scratch holds
 * (4 dk + 2 CHUNK + 3 dv) * CHUNK + 2 CHUNK + dk floats. */
static void head_block(const float *q, const float *k, const float *v, const float *g, const float *beta, float *out,
                       float *s, int64_t t0, int64_t c, int64_t h, int64_t dk, int64_t dv, float *scratch) {
    const int64_t ldq = h * dk, ldv = h * dv, wide = dv + dk;
    float *kt = scratch, *qd = kt + dk * CHUNK, *a = qd + CHUNK * dk, *p = a + CHUNK * CHUNK;
    float *x = p + CHUNK * CHUNK, *ws = x + CHUNK * wide, *vn = ws + CHUNK * dv, *kdt = vn + CHUNK * dv;
    float *cum = kdt + dk * CHUNK, *row_decay = cum + CHUNK, *decay = row_decay + dk;
    const float *qb = q + t0 * ldq, *kb = k + t0 * ldq, *vb = v + t0 * ldv;
    float running = 0.0f;
    for (int64_t i = 0; i < c; i++) cum[i] = running += g[(t0 + i) * h];
    for (int64_t i = 0; i < c; i++)
        for (int64_t d = 0; d < dk; d++) kt[d * CHUNK + i] = kb[i * ldq + d];
    delta_gemm_to_lower(c, dk, kb, ldq, kt, CHUNK, a, CHUNK);  /* k k^T, its lower part */
    delta_gemm_to_lower(c, dk, qb, ldq, kt, CHUNK, p, CHUNK);  /* q k^T */
    for (int64_t i = 0; i < c; i++) {
        const float bi = beta[(t0 + i) * h], ei = expf(cum[i]);
        exp_sub(cum[i], cum, decay, i + 1);  /* exp(G_i - G_j), j <= i */
        for (int64_t j = 0; j <= i; j++) {
            a[i * CHUNK + j] = bi * a[i * CHUNK + j] * decay[j];
            p[i * CHUNK + j] *= decay[j];
        }
        for (int64_t j = i + 1; j < c; j++) p[i * CHUNK + j] = 0.0f;
        float *xi = x + i * wide;
        for (int64_t d = 0; d < dv; d++) xi[d] = vb[i * ldv + d] * bi;
        for (int64_t d = 0; d < dk; d++) xi[dv + d] = kb[i * ldq + d] * bi * ei;
        for (int64_t d = 0; d < dk; d++) qd[i * dk + d] = qb[i * ldq + d] * ei;
    }
    delta_solve(a, x, c, wide);
    const float last = cum[c - 1], block_decay = expf(last);
    for (int64_t i = 0; i < c; i++) cum[i] = expf(last - cum[i]);  /* cum is not read again in this block */
    for (int64_t d = 0; d < dk; d++)
        for (int64_t i = 0; i < c; i++) kdt[d * CHUNK + i] = kt[d * CHUNK + i] * cum[i];
    for (int64_t d = 0; d < dk; d++) row_decay[d] = block_decay;
    delta_block_tail(x, qd, p, kdt, row_decay, s, ws, vn, out + t0 * ldv, ldv, c, dk, dv);
}

/* Returns 0, or -1 where the scratch could not be allocated (nothing written). */
int cpllm_delta_chunk(const float *q, const float *k, const float *v, const float *g, const float *beta,
                      const float *state_in, float *state_out, float *out, int64_t t, int64_t h, int64_t dk,
                      int64_t dv, int threads) {
    return run_blocks(head_block, (4 * dk + 2 * CHUNK + 3 * dv) * CHUNK + 2 * CHUNK + dk, 1, q, k, v, g, beta,
                      state_in, state_out, out, t, h, dk, dv, threads);
}
