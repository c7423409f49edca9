/* The recurrent step of the delta rules (gated DeltaNet, Kimi delta attention) for one token per request, one pass
 * over each head's state in memory.
 *
 * Per head r of rows = B * H, with the state S [dk, dv] (keys in, values out), q, k [dk], v [dv], beta, and a log
 * decay g <= 0 that is one scalar per head (gated DeltaNet: g [rows]) or one per key channel (KDA: g [rows, dk]):
 *   S <- diag(exp(g)) S;  delta = beta (v - S^T k);  S <- S + k delta^T;  out = S^T q
 * in that order, as cpllm/layers/*_delta/rule.py `recurrent_step` computes it. The first sweep reads S and
 * accumulates S^T k over the decayed rows; the second re-reads S (64 KiB for 128 x 128: from L2), writes the new
 * rows and accumulates S^T q from them, so memory sees one read and one write of the state. state_out may be
 * state_in (in place). The dv loops are written for the compiler to vectorize (16 lanes with AVX-512, 8 with
 * AVX2, scalar otherwise); OpenMP splits the rows.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

enum { MAX_DV = 1024 };

static void step_row(const float *restrict q, const float *restrict k, const float *restrict v, const float *g,
                     int64_t g_stride, float beta, const float *s_in, float *s_out, float *restrict out, int64_t dk,
                     int64_t dv) {
    float acc[MAX_DV];
    for (int64_t j = 0; j < dv; j++) acc[j] = 0.0f;
    for (int64_t c = 0; c < dk; c++) {  /* remembered = (decayed S)^T k */
        const float e = expf(g[c * g_stride]), kc = k[c];
        const float *restrict row = s_in + c * dv;
        for (int64_t j = 0; j < dv; j++) acc[j] += kc * (row[j] * e);
    }
    for (int64_t j = 0; j < dv; j++) acc[j] = (v[j] - acc[j]) * beta;  /* delta */
    for (int64_t j = 0; j < dv; j++) out[j] = 0.0f;
    for (int64_t c = 0; c < dk; c++) {  /* S' = decayed S + k delta^T; out = S'^T q */
        const float e = expf(g[c * g_stride]), kc = k[c], qc = q[c];
        const float *row = s_in + c * dv;
        float *new_row = s_out + c * dv;
        for (int64_t j = 0; j < dv; j++) {
            const float s = row[j] * e + kc * acc[j];
            new_row[j] = s;
            out[j] += qc * s;
        }
    }
}

/* q, k [rows, dk], v [rows, dv], g [rows] (per_channel = 0) or [rows, dk] (per_channel = 1), beta [rows],
 * state_in, state_out [rows, dk, dv], out [rows, dv], all contiguous float32. Returns 0, or -1 where dv > MAX_DV
 * (nothing written). */
int cpllm_delta_step(const float *q, const float *k, const float *v, const float *g, int per_channel,
                     const float *beta, const float *state_in, float *state_out, float *out, int64_t rows,
                     int64_t dk, int64_t dv, int threads) {
    if (dv > MAX_DV) return -1;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++)
        step_row(q + r * dk, k + r * dk, v + r * dv, per_channel ? g + r * dk : g + r, per_channel ? 1 : 0, beta[r],
                 state_in + r * dk * dv, state_out + r * dk * dv, out + r * dv, dk, dv);
    return 0;
}
