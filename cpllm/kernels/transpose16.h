/* AVX-512 layout helpers shared by the kernels that #include them: a 16 x 16 transpose of 32-bit words, and
 * (with AVX-512 BF16) two float vectors as their bf16 pair words. */
#ifndef CPLLM_TRANSPOSE16_H
#define CPLLM_TRANSPOSE16_H
#if defined(__AVX512F__)
#include <immintrin.h>

/* r[0..15], the rows of a 16 x 16 matrix of 32-bit words, become its columns: words within 128-bit lanes, then
 * pairs of words, then the lanes themselves. The kernels' layout changes (q into pairs, V into V^T, the output
 * back into rows) run through it: element by element they took a fifth of a 2K-token call on AMX. */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {  /* r[i + k] lane L: column 4 L + k of rows i .. i + 3 */
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int k = 0; k < 4; k++) {
        const __m512i u0 = _mm512_shuffle_i32x4(r[k], r[4 + k], 0x44), u1 = _mm512_shuffle_i32x4(r[k], r[4 + k], 0xEE);
        const __m512i u2 = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0x44);
        const __m512i u3 = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0xEE);
        t[k] = _mm512_shuffle_i32x4(u0, u2, 0x88);
        t[4 + k] = _mm512_shuffle_i32x4(u0, u2, 0xDD);
        t[8 + k] = _mm512_shuffle_i32x4(u1, u3, 0x88);
        t[12 + k] = _mm512_shuffle_i32x4(u1, u3, 0xDD);
    }
    for (int i = 0; i < 16; i++) r[i] = t[i];
}

#if defined(__AVX512BF16__)
/* The 16 words (bf16 of lo[r], bf16 of hi[r] << 16), rounded to nearest even, from one conversion and a shuffle. */
static inline __m512i bf16_pair_words(__m512 lo, __m512 hi) {
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                                22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}
#endif
#endif
#endif
