/* exp(x) for x <= 0, scalar and on 16 AVX-512 lanes, shared by the kernels that #include it. */
#ifndef CPLLM_VECTOR_EXP_H
#define CPLLM_VECTOR_EXP_H
#include <stdint.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

/* exp(x) for x <= 0 (scores minus their maximum), written so the loop around it vectorizes: 2^n * p(r) with
 * r = x - n ln2 in [-ln2/2, ln2/2] and a degree-6 Taylor polynomial (relative error below 2e-7). */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = __builtin_floorf(x * 1.44269504f + 0.5f);
    const float r = x - n * 0.693145752f - n * 1.42860677e-6f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { uint32_t u; float f; } scale = { .u = (uint32_t)((int32_t)n + 127) << 23 };
    return p * scale.f;
}

#if defined(__AVX512F__)
/* exp_nonpositive on 16 lanes. */
static inline __m512 exp16_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

/* 2^x on 16 lanes for finite x (an infinity gives NaN), 0 in the lanes outside `keep`: 2^floor(x) (scalef, which
 * also applies the mask) times a degree-4 polynomial fitted to 2^f on f = x - floor(x) in [0, 1) (vreduceps: one
 * instruction), its constant term 1 so that 2^0 is exactly 1. Relative error below 3e-6 (for prefill_attention.c's
 * AMX way, which rounds the result to bf16: 4e-3). Six instructions where rounding to nearest, a degree-5
 * polynomial and a separate mask took ten: that way's softmax is bound by them. */
static inline __m512 exp2_16_masked(__mmask16 keep, __m512 x) {
    const __m512 f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 e = _mm512_set1_ps(1.34266848e-2f);
    e = _mm512_fmadd_ps(e, f, _mm512_set1_ps(5.22424728e-2f));
    e = _mm512_fmadd_ps(e, f, _mm512_set1_ps(2.41280198e-1f));
    e = _mm512_fmadd_ps(e, f, _mm512_set1_ps(6.93044841e-1f));
    e = _mm512_fmadd_ps(e, f, _mm512_set1_ps(1.0f));
    return _mm512_maskz_scalef_ps(keep, e, x);
}

/* exp2_16_masked on every lane for x <= 0, -infinity included (clamped first: 2^-126 for it, not NaN). */
static inline __m512 exp2_16_nonpositive(__m512 x) {
    return exp2_16_masked(0xFFFF, _mm512_max_ps(x, _mm512_set1_ps(-126.0f)));
}

#endif
#endif
