/* y = x W^T for W in 4-bit groups of 32 inputs (w = d q + m), x in bfloat16, on AMX tiles: the prefill GEMM of the
 * int4 layers with the weight dequantized straight into the tiles' layout, for the row counts where that beats
 * dequantizing a whole weight for oneDNN's GEMM (int4_choice.py measures where).
 *
 * The weight is int4_matmul.pack's layout: blocks of 16 output rows, per block and group of 32 inputs a record of
 * 320 bytes (the codes, then d and m of the 16 rows in float16). One record is exactly one AMX B operand: a tile of
 * 16 rows of 64 bytes whose row j holds inputs 2j and 2j + 1 (a bf16 pair) of the 16 output columns. So a record
 * becomes a tile with no transpose (the dequantizer's 16-row way of int4_avx2.c, less its transpose), w rounded to
 * bf16 once, as the other bf16 ways round it.
 *
 * Work is split in panels of output blocks (`PANEL_BYTES` of tiles, in L2): each thread dequantizes a panel once,
 * then runs every 32 rows of x against it, 32 output columns at a time: 2 x 2 tiles of float32 accumulators
 * (tdpbf16ps: 16 x 16 += 16 x 32 times 32 x 16), each loaded A and B tile feeding two products. The accumulation is
 * float32, group after group in input order, each output rounded to bf16 at the end (to nearest even), which on a
 * Sapphire Rapids core gave the bits of oneDNN's AMX GEMM at 1,024 and 2,048 rows. A row's result depends on that
 * row alone, not on how many rows the call holds.
 *
 * Output: bf16 (`out` 1) or those bf16 values widened to float32 (`out` 2), row stride `y_stride` elements. Returns
 * 0; 1 for shapes it does not take (K not a multiple of 32, no rows); 2 where it does not run (not built with AMX
 * and AVX-512 BF16, or the OS refused the tile state); 3 where its scratch could not be allocated.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { GROUP = 32, BLOCK_ROWS = 16, RECORD_BYTES = 320, TILE_WORDS = 512, PANEL_BYTES = 512 << 10 };

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

#include "amx_tiles.h"
#include "int4_record.h"

/* Tiles 0-3: accumulators C[a][b] (a: rows 0-15 or 16-31 of the 32, b: the first or second 16 columns); 4, 5: the
 * A tiles of those rows; 6, 7: the B tiles of those columns. `rows0` / `rows1` rows in each half (a tail of x). */
static void configure_tiles(int rows0, int rows1) {
    TileConfig config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int i = 0; i < 8; i++) config.colsb[i] = 64;
    config.rows[0] = config.rows[1] = config.rows[4] = (uint8_t)rows0;
    config.rows[2] = config.rows[3] = config.rows[5] = (uint8_t)rows1;
    config.rows[6] = config.rows[7] = BLOCK_ROWS;
    _tile_loadconfig(&config);
}

/* One record (16 output rows x 32 inputs) as a B tile: row j = the bf16 pair words of inputs 2j, 2j + 1
 * (int4_record.h: the 16-row dequantizer's bf16 weights). */
static void record_tile(const uint8_t *record, uint16_t *tile) {
    __m512i words[16];
    record_pair_words(record, words);
    for (int j = 0; j < 16; j++) _mm512_store_si512((void *)(tile + 32 * j), words[j]);
}

/* Accumulator `c`'s `rows` x `cols` results into y (row stride y_stride elements), through a 1 KB stage: bf16
 * (out 1) or bf16 widened to float32 (out 2). */
static void store_accumulator(int c, float *stage, int rows, int cols, char *y, int64_t y_stride, int out) {
    switch (c) {  /* the tile register is an immediate */
    case 0: _tile_stored(0, stage, 64); break;
    case 1: _tile_stored(1, stage, 64); break;
    case 2: _tile_stored(2, stage, 64); break;
    default: _tile_stored(3, stage, 64); break;
    }
    const __mmask16 keep = (__mmask16)((1u << cols) - 1);
    for (int r = 0; r < rows; r++) {
        const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(stage + 16 * r));
        if (out == 1)
            _mm256_mask_storeu_epi16(y + r * y_stride * 2, keep, rounded);
        else
            _mm512_mask_storeu_ps(y + r * y_stride * 4, keep,
                                  _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(rounded), 16)));
    }
}

/* Rows [m0, m0 + 32) of x (fewer at its end) against the tiles of output blocks lb, lb + 1 of the panel (lb + 1
 * where `two`), all G groups, and the results stored. */
static void rows_against_pair(const uint16_t *x, int64_t x_stride, int M, int m0, const uint16_t *t0, int two, int G,
                              int n0, int N, char *y, int64_t y_stride, int out, float *stage) {
    const int rows = M - m0 < 32 ? M - m0 : 32, r0 = rows < 16 ? rows : 16, r1 = rows - r0;
    if (rows != 32) configure_tiles(r0, r1 ? r1 : 16);
    const uint16_t *a0 = x + (int64_t)m0 * x_stride, *a1 = a0 + 16 * x_stride, *t1 = t0 + (int64_t)G * TILE_WORDS;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    if (two && r1) {
        for (int g = 0; g < G; g++) {
            _tile_loadd(4, a0 + GROUP * g, x_stride * 2);
            _tile_loadd(6, t0 + TILE_WORDS * g, 64);
            _tile_loadd(5, a1 + GROUP * g, x_stride * 2);
            _tile_loadd(7, t1 + TILE_WORDS * g, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    } else {
        for (int g = 0; g < G; g++) {
            _tile_loadd(4, a0 + GROUP * g, x_stride * 2);
            _tile_loadd(6, t0 + TILE_WORDS * g, 64);
            _tile_dpbf16ps(0, 4, 6);
            if (two) {
                _tile_loadd(7, t1 + TILE_WORDS * g, 64);
                _tile_dpbf16ps(1, 4, 7);
            }
            if (r1) {
                _tile_loadd(5, a1 + GROUP * g, x_stride * 2);
                _tile_dpbf16ps(2, 5, 6);
                if (two) _tile_dpbf16ps(3, 5, 7);
            }
        }
    }
    const int esize = out == 1 ? 2 : 4, c0 = N - n0 < 16 ? N - n0 : 16, c1 = N - n0 - 16 < 16 ? N - n0 - 16 : 16;
    char *row0 = y + ((int64_t)m0 * y_stride + n0) * esize, *row16 = row0 + 16 * y_stride * esize;
    store_accumulator(0, stage, r0, c0, row0, y_stride, out);
    if (r1) store_accumulator(2, stage, r1, c0, row16, y_stride, out);
    if (two) {
        store_accumulator(1, stage, r0, c1, row0 + 16 * esize, y_stride, out);
        if (r1) store_accumulator(3, stage, r1, c1, row16 + 16 * esize, y_stride, out);
    }
    if (rows != 32) configure_tiles(16, 16);
}

/* Output blocks per panel: an even count whose tiles fit PANEL_BYTES, at most the weight's, and small enough that
 * every thread gets a panel or more. */
static int panel_blocks(int G, int NB, int threads) {
    int blocks = (PANEL_BYTES / (G * TILE_WORDS * 2)) & ~1;
    const int share = ((NB + threads - 1) / threads + 1) & ~1;
    blocks = blocks > share ? share : blocks;
    blocks = blocks < 2 ? 2 : blocks;
    return blocks > NB ? NB : blocks;
}
#endif

int cpllm_int4_amx_matmul(const uint16_t *x, int64_t x_stride, int M, const uint8_t *packed, int K, int N, void *y,
                          int64_t y_stride, int out, int threads) {
    if (K <= 0 || K % GROUP || M <= 0 || N <= 0 || (out != 1 && out != 2)) return 1;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
    if (!amx_permitted()) return 2;
    const int G = K / GROUP, NB = (N + BLOCK_ROWS - 1) / BLOCK_ROWS, PB = panel_blocks(G, NB, threads);
    const int panels = (NB + PB - 1) / PB;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        uint16_t *tiles = aligned_alloc(64, (size_t)G * PB * TILE_WORDS * 2);
        float *stage = aligned_alloc(64, BLOCK_ROWS * 16 * sizeof(float));
        if (tiles == NULL || stage == NULL) {
#pragma omp atomic write
            failed = 1;
        } else {
            configure_tiles(16, 16);
#pragma omp for schedule(dynamic, 1)
            for (int panel = 0; panel < panels; panel++) {
                const int b0 = panel * PB, nb = NB - b0 < PB ? NB - b0 : PB;
                for (int lb = 0; lb < nb; lb++)  /* tiles [block][group] */
                    for (int g = 0; g < G; g++)
                        record_tile(packed + ((int64_t)(b0 + lb) * G + g) * RECORD_BYTES,
                                    tiles + ((int64_t)lb * G + g) * TILE_WORDS);
                for (int m0 = 0; m0 < M; m0 += 32)
                    for (int lb = 0; lb < nb; lb += 2)
                        rows_against_pair(x, x_stride, M, m0, tiles + (int64_t)lb * G * TILE_WORDS, lb + 1 < nb, G,
                                          (b0 + lb) * BLOCK_ROWS, N, (char *)y, y_stride, out, stage);
            }
            _tile_release();
        }
        free(tiles);
        free(stage);
    }
    return failed ? 3 : 0;
#else
    (void)x, (void)x_stride, (void)packed, (void)y, (void)y_stride, (void)threads;
    return 2;
#endif
}

/* 1 where this library was built with AMX (bf16 tiles) and AVX-512 BF16 and the OS grants the tile state. */
int cpllm_int4_amx_available(void) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
    return amx_permitted();
#else
    return 0;
#endif
}
