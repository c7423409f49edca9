/* bfloat16 <-> float32 as torch converts: widening is exact, narrowing rounds to nearest even and keeps NaN a
 * NaN; one value at a time, and 16 at once on AVX-512. Shared by the kernels that #include it. */
#ifndef CPLLM_BF16_H
#define CPLLM_BF16_H
#include <stdint.h>
#include <string.h>

static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  /* NaN stays NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float from_bf16(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* from_bf16 on 16 lanes. */
static inline __m512 bf16x16_to_f32(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* to_bf16 on 16 lanes: the same bits (nearest even, NaN kept a NaN, subnormals rounded, not flushed). */
static inline __m256i f32x16_to_bf16(__m512 f) {
#if defined(__AVX512BF16__)
    /* The instruction rounds as to_bf16 does but flushes subnormal inputs to zero: those lanes take the integer
     * way below (one class test; they are rare, and the integer way is four times the instructions). */
    if (!_mm512_fpclass_ps_mask(f, 0x20)) return (__m256i)_mm512_cvtneps_pbh(f);
#endif
    const __m512i u = _mm512_castps_si512(f);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
    return _mm512_cvtepi32_epi16(r);
}
#endif
#endif
