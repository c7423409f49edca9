/* One record of int4_matmul.pack's layout (16 output rows x 32 inputs: the codes, then d and m of the 16 rows in
 * float16) as bf16 pair words, for the kernels that #include it: the 16-row dequantizer (int4_avx2.c) transposes
 * them into rows, the AMX tile kernel (int4_amx.c) stores them as they are, one B tile. */
#ifndef CPLLM_INT4_RECORD_H
#define CPLLM_INT4_RECORD_H
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#include <stdint.h>

#include "transpose16.h"

/* words[j], lane r: row r's inputs 2j and 2j + 1 as one bf16 pair word, w = d q + m (an FMA: d q is exact, so one
 * rounding) rounded to nearest even once. The 16 rows at once, one register per input, so d and m are one vector
 * each and nothing is unpacked per row: piece i's 32-bit lane r holds row r's codes of inputs 4i..4i+3 (low
 * nibbles) and 16+4i.. (high). w is never a float32 subnormal, which vcvtne2ps2bf16 would flush. */
static inline void record_pair_words(const uint8_t *record, __m512i words[16]) {
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(record + 256)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(record + 288)));
    const __m512i nibbles = _mm512_set1_epi32(0x0F0F0F0F), byte = _mm512_set1_epi32(0xFF);
    for (int i = 0; i < 4; i++) {
        const __m512i piece = _mm512_loadu_si512((const void *)(record + 64 * i));
        for (int half = 0; half < 2; half++) {
            const __m512i codes = _mm512_and_si512(half ? _mm512_srli_epi32(piece, 4) : piece, nibbles);
            __m512 w[4];
            for (int b = 0; b < 4; b++)
                w[b] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(codes, 8 * b), byte)),
                                       m);
            const int j = 8 * half + 2 * i;  /* inputs 16 half + 4 i + (0, 1) and (2, 3) */
            words[j] = bf16_pair_words(w[0], w[1]);
            words[j + 1] = bf16_pair_words(w[2], w[3]);
        }
    }
}
#endif
#endif
