/* y = x W^T for W in 4-bit groups of 32 inputs (w = d q + m), x in bfloat16, on AVX-512 BF16 dot products
 * (vdpbf16ps): the int4 layers' prefill GEMM on CPUs with bf16 dot products and no AMX tiles (AMD Zen 4), with the
 * weight dequantized straight from its records into the operand layout, for the row counts where that beats
 * dequantizing a whole weight for oneDNN's GEMM (int4_choice.py measures where).
 *
 * The weight is int4_matmul.pack's layout: blocks of 16 output rows, per block and group of 32 inputs a record of
 * 320 bytes. A record's 16 bf16 pair words (int4_record.h) are 16 registers whose lane c holds inputs 2j and 2j + 1
 * of output column c: the B operand of vdpbf16ps as it is, so the record is stored as is, 1 KB, and each pair of
 * x's inputs broadcast as one 32-bit word multiplies it. w is rounded to bf16 once, as the other bf16 ways round it.
 *
 * Work is split in panels of output blocks (`PANEL_BYTES` of dequantized records, in L2): each thread dequantizes a
 * panel once, then runs every ROWS rows of x against it, COLS blocks (48 output columns) at a time: ROWS x COLS
 * float32 accumulators in registers, each B register loaded once for ROWS products and each x pair broadcast
 * straight from memory into COLS. The accumulation is float32, pair after pair in input order, each output rounded
 * to bf16 at the end (to nearest even). A row's result depends on that row alone: a tail of fewer than ROWS rows
 * repeats the last row in the spare accumulators and does not store them.
 *
 * Output: bf16 (`out` 1) or those bf16 values widened to float32 (`out` 2), row stride `y_stride` elements. Returns
 * 0; 1 for shapes it does not take (K not a multiple of 32, no rows); 2 where it does not run (not built with
 * AVX-512 BF16); 3 where its scratch could not be allocated.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { GROUP = 32, BLOCK_ROWS = 16, RECORD_BYTES = 320, RECORD_WORDS = 512, PANEL_BYTES = 512 << 10, ROWS = 8,
       COLS = 3 };

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

#include "int4_record.h"

/* One record's 16 pair words, in order, at `words` (1 KB, 64-byte aligned). */
static void record_words(const uint8_t *record, uint16_t *words) {
    __m512i pairs[16];
    record_pair_words(record, pairs);
    for (int j = 0; j < 16; j++) _mm512_store_si512((void *)(words + 32 * j), pairs[j]);
}

/* x's inputs 2p and 2p + 1 of one row as the 32-bit word vdpbf16ps broadcasts. */
static inline __m512bh pair_of(const uint16_t *row, int p) {
    int32_t word;
    memcpy(&word, row + 2 * p, sizeof word);
    return (__m512bh)_mm512_set1_epi32(word);
}

/* The accumulators of `nb` (1..COLS, a constant where it is inlined) blocks, `rows` real rows of x from `a`, into
 * y's columns [n0, n0 + 16 nb) (fewer where N ends): bf16 or widened to float32. */
static inline __attribute__((always_inline)) void store_results(__m512 acc[ROWS][COLS], int rows, int nb, int n0,
                                                                int N, char *y, int64_t y_stride, int out) {
    for (int k = 0; k < nb; k++) {
        const int cols = N - n0 - 16 * k < 16 ? N - n0 - 16 * k : 16;
        const __mmask16 keep = (__mmask16)((1u << cols) - 1);
        for (int r = 0; r < rows; r++) {
            const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(acc[r][k]);
            char *at = y + (r * y_stride + n0 + 16 * k) * (out == 1 ? 2 : 4);
            if (out == 1)
                _mm256_mask_storeu_epi16(at, keep, rounded);
            else
                _mm512_mask_storeu_ps(at, keep,
                                      _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(rounded), 16)));
        }
    }
}

/* ROWS rows of x (row r at a[r]) against `nb` blocks of dequantized records from `words` (block k at
 * words + k G RECORD_WORDS), all G groups; the results of the first `rows` rows stored. */
static inline __attribute__((always_inline)) void rows_against_blocks(const uint16_t *const a[ROWS],
                                                                      const uint16_t *words, int G, int nb, int rows,
                                                                      int n0, int N, char *y, int64_t y_stride,
                                                                      int out) {
    __m512 acc[ROWS][COLS];
    for (int r = 0; r < ROWS; r++)
        for (int k = 0; k < COLS; k++) acc[r][k] = _mm512_setzero_ps();
    const int64_t block_words = (int64_t)G * RECORD_WORDS;
    for (int g = 0; g < G; g++) {
        const uint16_t *record = words + (int64_t)g * RECORD_WORDS;
        for (int j = 0; j < 16; j++) {
            __m512bh b[COLS];
            for (int k = 0; k < nb; k++)
                b[k] = (__m512bh)_mm512_load_si512((const void *)(record + k * block_words + 32 * j));
            for (int r = 0; r < ROWS; r++) {
                const __m512bh pair = pair_of(a[r], 16 * g + j);
                for (int k = 0; k < nb; k++) acc[r][k] = _mm512_dpbf16_ps(acc[r][k], pair, b[k]);
            }
        }
    }
    store_results(acc, rows, nb, n0, N, y, y_stride, out);
}

/* Rows [m0, m0 + ROWS) of x (the last row repeated past M) against blocks [lb, lb + nb) of the panel. */
static void rows_against_panel(const uint16_t *x, int64_t x_stride, int M, int m0, const uint16_t *words, int G,
                               int nb, int n0, int N, char *y, int64_t y_stride, int out) {
    const uint16_t *a[ROWS];
    for (int r = 0; r < ROWS; r++) a[r] = x + (int64_t)(m0 + r < M ? m0 + r : M - 1) * x_stride;
    const int rows = M - m0 < ROWS ? M - m0 : ROWS;
    char *y0 = y + (int64_t)m0 * y_stride * (out == 1 ? 2 : 4);
    switch (nb) {  /* a constant block count, so the accumulators stay in registers */
    case 3: rows_against_blocks(a, words, G, 3, rows, n0, N, y0, y_stride, out); break;
    case 2: rows_against_blocks(a, words, G, 2, rows, n0, N, y0, y_stride, out); break;
    default: rows_against_blocks(a, words, G, 1, rows, n0, N, y0, y_stride, out); break;
    }
}

/* Output blocks per panel: a multiple of COLS whose records fit PANEL_BYTES, at most the weight's, and small
 * enough that every thread gets a panel or more. */
static int panel_blocks(int G, int NB, int threads) {
    int blocks = PANEL_BYTES / (G * RECORD_WORDS * 2) / COLS * COLS;
    const int share = ((NB + threads - 1) / threads + COLS - 1) / COLS * COLS;
    blocks = blocks > share ? share : blocks;
    blocks = blocks < COLS ? COLS : blocks;
    return blocks > NB ? NB : blocks;
}
#endif

int cpllm_int4_dpbf16_matmul(const uint16_t *x, int64_t x_stride, int M, const uint8_t *packed, int K, int N,
                             void *y, int64_t y_stride, int out, int threads) {
    if (K <= 0 || K % GROUP || M <= 0 || N <= 0 || (out != 1 && out != 2)) return 1;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    const int G = K / GROUP, NB = (N + BLOCK_ROWS - 1) / BLOCK_ROWS, PB = panel_blocks(G, NB, threads);
    const int panels = (NB + PB - 1) / PB;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        uint16_t *words = aligned_alloc(64, (size_t)G * PB * RECORD_WORDS * 2);
        if (words == NULL) {
#pragma omp atomic write
            failed = 1;
        } else {
#pragma omp for schedule(dynamic, 1)
            for (int panel = 0; panel < panels; panel++) {
                const int b0 = panel * PB, nb = NB - b0 < PB ? NB - b0 : PB;
                for (int lb = 0; lb < nb; lb++)  /* records [block][group] */
                    for (int g = 0; g < G; g++)
                        record_words(packed + ((int64_t)(b0 + lb) * G + g) * RECORD_BYTES,
                                     words + ((int64_t)lb * G + g) * RECORD_WORDS);
                for (int m0 = 0; m0 < M; m0 += ROWS)
                    for (int lb = 0; lb < nb; lb += COLS)
                        rows_against_panel(x, x_stride, M, m0, words + (int64_t)lb * G * RECORD_WORDS, G,
                                           nb - lb < COLS ? nb - lb : COLS, (b0 + lb) * BLOCK_ROWS, N, (char *)y,
                                           y_stride, out);
            }
        }
        free(words);
    }
    return failed ? 3 : 0;
#else
    (void)x, (void)x_stride, (void)packed, (void)y, (void)y_stride, (void)threads;
    return 2;
#endif
}

/* 1 where this library was built with AVX-512 BF16. */
int cpllm_int4_dpbf16_available(void) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    return 1;
#else
    return 0;
#endif
}
