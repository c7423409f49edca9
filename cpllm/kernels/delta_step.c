/* The recurrent step of the delta rules (gated DeltaNet, Kimi delta attention) for one token per request, one pass
 * over each head's state in memory.
 *
 * Per head r of rows = B * H, with the state S [dk, dv] (keys in, values out), q, k [dk], v [dv], beta, and a log
 * decay g <= 0 that is one scalar per head (gated DeltaNet: g [rows]) or one per key channel (KDA: g [rows, dk]):
 *   S <- diag(exp(g)) S;  delta = beta (v - S^T k);  S <- S + k delta^T;  out = S^T q
 * in that order, as cpllm/layers/*_delta/rule.py `recurrent_step` computes it. The first sweep reads S and
 * accumulates S^T k over the decayed rows; the second re-reads S (64 KiB for 128 x 128: from L2), writes the new
 * rows and accumulates S^T q from them, so memory sees one read and one write of the state. state_out may be
 * state_in (in place). With AVX-512 the columns go in panels of 128 (8 vectors, masked at a ragged edge; every
 * column is its own: a panel's two sweeps need nothing from the others), S^T k, delta and S'^T q in registers;
 * otherwise loops the compiler vectorizes. OpenMP splits the rows.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

enum { MAX_DV = 1024 };

#if defined(__AVX512F__)
enum { PANEL = 8 };  /* vectors of 16 columns per panel */

static void step_row(const float *restrict q, const float *restrict k, const float *restrict v, const float *g,
                     int64_t g_stride, float beta, const float *s_in, float *s_out, float *restrict out, int64_t dk,
                     int64_t dv) {
    for (int64_t j0 = 0; j0 < dv; j0 += 16 * PANEL) {
        __mmask16 m[PANEL];
        for (int u = 0; u < PANEL; u++) {
            const int64_t left = dv - j0 - 16 * u;
            m[u] = left >= 16 ? (__mmask16)0xFFFF : left > 0 ? (__mmask16)((1u << left) - 1) : (__mmask16)0;
        }
        __m512 acc[PANEL], o[PANEL];
        for (int u = 0; u < PANEL; u++) acc[u] = _mm512_setzero_ps();
        for (int64_t c = 0; c < dk; c++) {  /* remembered = (decayed S)^T k */
            const __m512 e = _mm512_set1_ps(expf(g[c * g_stride])), kc = _mm512_set1_ps(k[c]);
            const float *row = s_in + c * dv + j0;
            for (int u = 0; u < PANEL; u++)
                acc[u] = _mm512_fmadd_ps(kc, _mm512_mul_ps(_mm512_maskz_loadu_ps(m[u], row + 16 * u), e), acc[u]);
        }
        const __m512 b = _mm512_set1_ps(beta);
        for (int u = 0; u < PANEL; u++) {  /* delta */
            acc[u] = _mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m[u], v + j0 + 16 * u), acc[u]), b);
            o[u] = _mm512_setzero_ps();
        }
        for (int64_t c = 0; c < dk; c++) {  /* S' = decayed S + k delta^T; out = S'^T q */
            const __m512 e = _mm512_set1_ps(expf(g[c * g_stride])), kc = _mm512_set1_ps(k[c]);
            const __m512 qc = _mm512_set1_ps(q[c]);
            const float *row = s_in + c * dv + j0;
            float *new_row = s_out + c * dv + j0;
            for (int u = 0; u < PANEL; u++) {
                const __m512 decayed = _mm512_mul_ps(_mm512_maskz_loadu_ps(m[u], row + 16 * u), e);
                const __m512 sv = _mm512_fmadd_ps(kc, acc[u], decayed);
                _mm512_mask_storeu_ps(new_row + 16 * u, m[u], sv);
                o[u] = _mm512_fmadd_ps(qc, sv, o[u]);
            }
        }
        for (int u = 0; u < PANEL; u++) _mm512_mask_storeu_ps(out + j0 + 16 * u, m[u], o[u]);
    }
}
#else
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
#endif

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
