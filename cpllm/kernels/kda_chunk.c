/* Kimi delta attention's chunked form for one request's prompt chunk, per head over its blocks in C: the same WY
 * form as cpllm/layers/kimi_delta/rule.py `chunked_kda_torch` (see its module docstring), the decay one per key
 * channel; the solve and the state update are delta_block.h's, shared with the gated delta rule (delta_chunk.c).
 *
 * Per head and block of c <= CHUNK tokens (no padding), G [c, dk] = cumsum(g) per channel inside the block. The
 * pairwise products A[i, j] = sum_d beta_i k_id k_jd exp(G_id - G_jd) (j < i) and P[i, j] = the same with q_i
 * (j <= i) go by sub-blocks of SUB rows about their first token r, as `_pairwise` does: rows decayed by
 * exp(G_i - G_r) against earlier columns decayed by exp(G_r - G_j) (both <= 1) in one GEMM, the pairs inside a
 * sub-block with the explicit exp(G_i - G_j) per channel. Then (I + A) [u | w] = [beta v | beta k exp(G)],
 * v' = u - w S, out = (q exp(G)) S + P v', S <- diag(exp(G_c)) S + (k exp(G_c - G))^T v'.
 * q, k, g [T, H, dk], v [T, H, dv], beta [T, H], out [T, H, dv], state_in, state_out [H, dk, dv], contiguous
 * float32 (state_out may be state_in). OpenMP splits the heads.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "delta_block.h"

enum { CHUNK = DELTA_CHUNK, SUB = 16, LANES = 16 };

/* Floats of one thread's scratch. */
static int64_t scratch_floats(int64_t dk, int64_t dv) {
    return CHUNK * dk * 5 + 2 * SUB * dk + 2 * CHUNK * CHUNK + CHUNK * (dv + dk) + 2 * CHUNK * dv + 2 * dk;
}

static void head_block(const float *q, const float *k, const float *v, const float *g, const float *beta, float *out,
                       float *s, int64_t t0, int64_t c, int64_t h, int64_t dk, int64_t dv, float *scratch) {
    const int64_t ldq = h * dk, ldv = h * dv, wide = dv + dk;
    float *cum = scratch, *kb = cum + CHUNK * dk, *colt = kb + CHUNK * dk, *qd = colt + dk * CHUNK;
    float *kdt = qd + CHUNK * dk, *rowk = kdt + dk * CHUNK, *rowq = rowk + SUB * dk, *a = rowq + SUB * dk;
    float *p = a + CHUNK * CHUNK, *x = p + CHUNK * CHUNK, *ws = x + CHUNK * wide, *vn = ws + CHUNK * dv;
    float *row_decay = vn + CHUNK * dv, *e = row_decay + dk;
    const float *qb = q + t0 * ldq, *kin = k + t0 * ldq, *vb = v + t0 * ldv, *gb = g + t0 * ldq;
    for (int64_t d = 0; d < dk; d++) cum[d] = gb[d];
    for (int64_t i = 1; i < c; i++)
        for (int64_t d = 0; d < dk; d++) cum[i * dk + d] = cum[(i - 1) * dk + d] + gb[i * ldq + d];
    for (int64_t i = 0; i < c; i++) {
        const float bi = beta[(t0 + i) * h];
        for (int64_t d = 0; d < dk; d++) kb[i * dk + d] = kin[i * ldq + d] * bi;  /* k beta */
    }
    for (int64_t a0 = 0; a0 < c; a0 += SUB) {
        const int64_t rows = c - a0 < SUB ? c - a0 : SUB;
        const float *ref = cum + a0 * dk;
        for (int64_t i = 0; i < rows; i++) {
            exp_diff(cum + (a0 + i) * dk, ref, e, dk);
            for (int64_t d = 0; d < dk; d++) {
                rowk[i * dk + d] = kb[(a0 + i) * dk + d] * e[d];
                rowq[i * dk + d] = qb[(a0 + i) * ldq + d] * e[d];
            }
        }
        if (a0 > 0) {
            for (int64_t j = 0; j < a0; j++) {
                exp_diff(ref, cum + j * dk, e, dk);
                for (int64_t d = 0; d < dk; d++) colt[d * CHUNK + j] = kin[j * ldq + d] * e[d];
            }
            delta_gemm(rows, a0, dk, rowk, dk, colt, CHUNK, a + a0 * CHUNK, CHUNK, 0);
            delta_gemm(rows, a0, dk, rowq, dk, colt, CHUNK, p + a0 * CHUNK, CHUNK, 0);
        }
        for (int64_t i = a0; i < a0 + rows; i++) {  /* the pairs inside the sub-block */
            const float *gi = cum + i * dk, *ki = kb + i * dk, *qi = qb + i * ldq;
            for (int64_t j = a0; j <= i; j++) {
                const float *gj = cum + j * dk, *kj = kin + j * ldq;
                exp_diff(gi, gj, e, dk);
                float la[LANES] = {0}, lp[LANES] = {0};  /* 16 lanes: the loop vectorizes (no float reduction) */
                int64_t d = 0;
                for (; d + LANES <= dk; d += LANES)
                    for (int l = 0; l < LANES; l++) {
                        la[l] += ki[d + l] * kj[d + l] * e[d + l];
                        lp[l] += qi[d + l] * kj[d + l] * e[d + l];
                    }
                float sa = 0.0f, sp = 0.0f;
                for (int l = 0; l < LANES; l++) sa += la[l], sp += lp[l];
                for (; d < dk; d++) {
                    sa += ki[d] * kj[d] * e[d];
                    sp += qi[d] * kj[d] * e[d];
                }
                a[i * CHUNK + j] = sa;
                p[i * CHUNK + j] = sp;
            }
            for (int64_t j = i + 1; j < c; j++) p[i * CHUNK + j] = 0.0f;
        }
    }
    for (int64_t i = 0; i < c; i++) {
        const float bi = beta[(t0 + i) * h];
        float *xi = x + i * wide;
        exp_diff(cum + i * dk, NULL, e, dk);
        for (int64_t d = 0; d < dv; d++) xi[d] = vb[i * ldv + d] * bi;
        for (int64_t d = 0; d < dk; d++) xi[dv + d] = kb[i * dk + d] * e[d];
        for (int64_t d = 0; d < dk; d++) qd[i * dk + d] = qb[i * ldq + d] * e[d];
    }
    delta_solve(a, x, c, wide);
    const float *last = cum + (c - 1) * dk;
    exp_diff(last, NULL, row_decay, dk);
    for (int64_t i = 0; i < c; i++) {
        exp_diff(last, cum + i * dk, e, dk);
        for (int64_t d = 0; d < dk; d++) kdt[d * CHUNK + i] = kin[i * ldq + d] * e[d];
    }
    delta_block_tail(x, qd, p, kdt, row_decay, s, ws, vn, out + t0 * ldv, ldv, c, dk, dv);
}

/* Returns 0, or -1 where the scratch could not be allocated (nothing written). */
int cpllm_kda_chunk(const float *q, const float *k, const float *v, const float *g, const float *beta,
                    const float *state_in, float *state_out, float *out, int64_t t, int64_t h, int64_t dk,
                    int64_t dv, int threads) {
    return run_blocks(head_block, scratch_floats(dk, dv), dk, q, k, v, g, beta, state_in, state_out, out, t, h, dk,
                      dv, threads);
}
