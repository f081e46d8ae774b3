// Batch-invariant GEMM for the CPU: out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), where the
// order in which each output element adds up its K products is fixed by the code, not by M.
//
// Why: a matmul library picks its kernel and blocking by the number of rows (oneDNN's fp32 packed
// linear switches kernels between 1 and 2 rows at K = 1536 on an AVX-512 EPYC; on AMX CPUs the
// bf16 kernels switch too), so a request's logits depend on what else is in the step. Here every
// output element is one vector lane that walks K from 0 upwards, one pair of bf16 (VDPBF16PS) or
// one fp32 (FMA) at a time, in every row tile, in the remainder rows, on every thread: the row
// count only decides how many rows a tile holds, never what a lane adds, or in what order.
//
// Weights are packed once (qw_inv_pack_*) into blocks of 16 output columns:
//   bf16: [N / 16][ceil(K / 2)][16][2]  (column pairs of K, as VDPBF16PS reads them)
//   fp32: [N / 16][K][16]
// N is padded up to a multiple of 16 with zero columns, K up to even with a zero (bf16).
//
// Threads: OpenMP over (column tile, row tile) pairs, static; each output element is computed by
// one thread from start to end, so the thread count changes nothing either.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_simd.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define QW_NB 16      // columns per packed block (one AVX-512 register of fp32)
#define QW_MR 8       // rows per register tile (16 accumulators + 2 weights + 1 broadcast of 32 zmm)
#define QW_NR_BLK 2   // packed blocks per register tile (32 columns)
#define QW_MC_TILES 16  // row tiles per cache chunk (128 rows)

static int64_t cdiv64(int64_t a, int64_t b) { return (a + b - 1) / b; }

int qw_inv_pack_bf16(const uint16_t *w, int64_t n, int64_t k, uint16_t *packed) {
    const int64_t nb = cdiv64(n, QW_NB), k2 = cdiv64(k, 2);
    memset(packed, 0, (size_t)(nb * k2 * QW_NB * 2) * sizeof(uint16_t));
    for (int64_t col = 0; col < n; col++) {
        const int64_t b = col / QW_NB, j = col % QW_NB;
        for (int64_t kk = 0; kk < k; kk++) {
            packed[((b * k2 + kk / 2) * QW_NB + j) * 2 + (kk & 1)] = w[col * k + kk];
        }
    }
    return 0;
}

int qw_inv_pack_f32(const float *w, int64_t n, int64_t k, float *packed) {
    const int64_t nb = cdiv64(n, QW_NB);
    memset(packed, 0, (size_t)(nb * k * QW_NB) * sizeof(float));
    for (int64_t col = 0; col < n; col++) {
        const int64_t b = col / QW_NB, j = col % QW_NB;
        for (int64_t kk = 0; kk < k; kk++) packed[(b * k + kk) * QW_NB + j] = w[col * k + kk];
    }
    return 0;
}

// Writes one 16-column block of fp32 sums (+ bias) to out, rounding to bf16 when is_bf16; only
// the first `valid` columns exist.
static inline void store_block(const float *acc, const float *bias, void *out, int64_t col0, int64_t valid,
                               int is_bf16) {
    for (int64_t j = 0; j < valid; j++) {
        const float v = bias ? acc[j] + bias[col0 + j] : acc[j];
        if (is_bf16) {
            ((uint16_t *)out)[col0 + j] = f32_to_bf16(v);
        } else {
            ((float *)out)[col0 + j] = v;
        }
    }
}

// ---- bf16 ---------------------------------------------------------------------------------------

// One tile: rows [0, mr) of x (row stride ldx), blocks [blk, blk + nblk) of the packed weight.
// Inlined with constant mr and nblk (see dispatch below), so the accumulators stay in registers.
static inline __attribute__((always_inline)) void tile_bf16(const uint16_t *x, int64_t ldx, const int mr,
                                                            const uint16_t *packed, int64_t blk, const int nblk,
                                                            int64_t k, const float *bias, void *out,
                                                            int64_t ldo, int64_t n, int is_bf16) {
    const int64_t k2 = cdiv64(k, 2), full_pairs = k / 2;
    float acc[QW_MR][QW_NR_BLK][QW_NB] __attribute__((aligned(64)));
#if defined(__AVX512BF16__)
    __m512 va[QW_MR][QW_NR_BLK];
    for (int r = 0; r < QW_MR; r++)
        for (int c = 0; c < QW_NR_BLK; c++) va[r][c] = _mm512_setzero_ps();
    const uint16_t *b0 = packed + blk * k2 * QW_NB * 2;
    const uint16_t *b1 = packed + (blk + 1) * k2 * QW_NB * 2;
    for (int64_t p = 0; p < k2; p++) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(b0 + p * QW_NB * 2);
        const __m512bh w1 = nblk > 1 ? (__m512bh)_mm512_loadu_si512(b1 + p * QW_NB * 2) : w0;
        for (int r = 0; r < QW_MR; r++) {
            if (r >= mr) break;
            uint32_t pair;
            if (p < full_pairs) {
                memcpy(&pair, x + r * ldx + 2 * p, sizeof pair);
            } else {  // odd K: the last pair's second element is a zero
                pair = x[r * ldx + 2 * p];
            }
            const __m512bh a = (__m512bh)_mm512_set1_epi32((int)pair);
            va[r][0] = _mm512_dpbf16_ps(va[r][0], a, w0);
            if (nblk > 1) va[r][1] = _mm512_dpbf16_ps(va[r][1], a, w1);
        }
    }
    for (int r = 0; r < QW_MR; r++)
        for (int c = 0; c < QW_NR_BLK; c++) _mm512_store_ps(acc[r][c], va[r][c]);
#else
    // Portable path: the same lane order (pair by pair, even element then odd), in fp32 FMA-free
    // arithmetic (the file is built with -ffp-contract=off).
    memset(acc, 0, sizeof acc);
    for (int64_t c = 0; c < nblk; c++) {
        const uint16_t *b = packed + (blk + c) * k2 * QW_NB * 2;
        for (int64_t r = 0; r < mr; r++) {
            v16f s = splat16(0.0f);
            for (int64_t p = 0; p < k2; p++) {
                const float a0 = bf16_to_f32(x[r * ldx + 2 * p]);
                const float a1 = p < full_pairs ? bf16_to_f32(x[r * ldx + 2 * p + 1]) : 0.0f;
                v16f w_even, w_odd;
                for (int j = 0; j < QW_NB; j++) {
                    w_even[j] = bf16_to_f32(b[(p * QW_NB + j) * 2]);
                    w_odd[j] = bf16_to_f32(b[(p * QW_NB + j) * 2 + 1]);
                }
                s = s + splat16(a0) * w_even + splat16(a1) * w_odd;
            }
            storeu16(acc[r][c], s);
        }
    }
#endif
    for (int64_t r = 0; r < mr; r++) {
        char *row_out = (char *)out + r * ldo * (is_bf16 ? 2 : 4);
        for (int64_t c = 0; c < nblk; c++) {
            const int64_t col0 = (blk + c) * QW_NB;
            const int64_t valid = n - col0 < QW_NB ? n - col0 : QW_NB;
            store_block(acc[r][c], bias, row_out, col0, valid, is_bf16);
        }
    }
}

// ---- fp32 ---------------------------------------------------------------------------------------

static inline __attribute__((always_inline)) void tile_f32(const float *x, int64_t ldx, const int mr,
                                                           const float *packed, int64_t blk, const int nblk,
                                                           int64_t k, const float *bias, float *out, int64_t ldo,
                                                           int64_t n) {
    float acc[QW_MR][QW_NR_BLK][QW_NB] __attribute__((aligned(64)));
    const float *b0 = packed + blk * k * QW_NB;
    const float *b1 = packed + (blk + 1) * k * QW_NB;
#if defined(__AVX512F__)
    __m512 va[QW_MR][QW_NR_BLK];
    for (int r = 0; r < QW_MR; r++)
        for (int c = 0; c < QW_NR_BLK; c++) va[r][c] = _mm512_setzero_ps();
    for (int64_t kk = 0; kk < k; kk++) {
        const __m512 w0 = _mm512_loadu_ps(b0 + kk * QW_NB);
        const __m512 w1 = nblk > 1 ? _mm512_loadu_ps(b1 + kk * QW_NB) : w0;
        for (int r = 0; r < QW_MR; r++) {
            if (r >= mr) break;
            const __m512 a = _mm512_set1_ps(x[r * ldx + kk]);
            va[r][0] = _mm512_fmadd_ps(a, w0, va[r][0]);
            if (nblk > 1) va[r][1] = _mm512_fmadd_ps(a, w1, va[r][1]);
        }
    }
    for (int r = 0; r < QW_MR; r++)
        for (int c = 0; c < QW_NR_BLK; c++) _mm512_store_ps(acc[r][c], va[r][c]);
#else
    memset(acc, 0, sizeof acc);
    for (int64_t r = 0; r < mr; r++) {
        v16f s0 = splat16(0.0f), s1 = splat16(0.0f);
        for (int64_t kk = 0; kk < k; kk++) {
            const v16f a = splat16(x[r * ldx + kk]);
            s0 = s0 + a * loadu16(b0 + kk * QW_NB);
            if (nblk > 1) s1 = s1 + a * loadu16(b1 + kk * QW_NB);
        }
        storeu16(acc[r][0], s0);
        storeu16(acc[r][1], s1);
    }
#endif
    for (int64_t r = 0; r < mr; r++) {
        for (int64_t c = 0; c < nblk; c++) {
            const int64_t col0 = (blk + c) * QW_NB;
            const int64_t valid = n - col0 < QW_NB ? n - col0 : QW_NB;
            store_block(acc[r][c], bias, out + r * ldo, col0, valid, 0);
        }
    }
}

// One non-inlined function per (rows, blocks) pair: the row count picks which registers exist,
// never what a lane computes.
#define QW_TILE_FNS(MR)                                                                                 \
    static void tile_bf16_##MR##_1(const uint16_t *x, int64_t ldx, const uint16_t *p, int64_t blk, int64_t k, \
                                   const float *bias, void *out, int64_t ldo, int64_t n) {             \
        tile_bf16(x, ldx, MR, p, blk, 1, k, bias, out, ldo, n, 1);                                     \
    }                                                                                                   \
    static void tile_bf16_##MR##_2(const uint16_t *x, int64_t ldx, const uint16_t *p, int64_t blk, int64_t k, \
                                   const float *bias, void *out, int64_t ldo, int64_t n) {             \
        tile_bf16(x, ldx, MR, p, blk, 2, k, bias, out, ldo, n, 1);                                     \
    }                                                                                                   \
    static void tile_f32_##MR##_1(const float *x, int64_t ldx, const float *p, int64_t blk, int64_t k,     \
                                  const float *bias, float *out, int64_t ldo, int64_t n) {             \
        tile_f32(x, ldx, MR, p, blk, 1, k, bias, out, ldo, n);                                         \
    }                                                                                                   \
    static void tile_f32_##MR##_2(const float *x, int64_t ldx, const float *p, int64_t blk, int64_t k,     \
                                  const float *bias, float *out, int64_t ldo, int64_t n) {             \
        tile_f32(x, ldx, MR, p, blk, 2, k, bias, out, ldo, n);                                         \
    }
QW_TILE_FNS(1)
QW_TILE_FNS(2)
QW_TILE_FNS(3)
QW_TILE_FNS(4)
QW_TILE_FNS(5)
QW_TILE_FNS(6)
QW_TILE_FNS(7)
QW_TILE_FNS(8)
#undef QW_TILE_FNS

typedef void (*tile_bf16_fn)(const uint16_t *, int64_t, const uint16_t *, int64_t, int64_t, const float *, void *,
                             int64_t, int64_t);
typedef void (*tile_f32_fn)(const float *, int64_t, const float *, int64_t, int64_t, const float *, float *,
                            int64_t, int64_t);
#define QW_ROW(name, MR) {name##_##MR##_1, name##_##MR##_2}
static const tile_bf16_fn TILES_BF16[QW_MR][2] = {
    QW_ROW(tile_bf16, 1), QW_ROW(tile_bf16, 2), QW_ROW(tile_bf16, 3), QW_ROW(tile_bf16, 4),
    QW_ROW(tile_bf16, 5), QW_ROW(tile_bf16, 6), QW_ROW(tile_bf16, 7), QW_ROW(tile_bf16, 8)};
static const tile_f32_fn TILES_F32[QW_MR][2] = {
    QW_ROW(tile_f32, 1), QW_ROW(tile_f32, 2), QW_ROW(tile_f32, 3), QW_ROW(tile_f32, 4),
    QW_ROW(tile_f32, 5), QW_ROW(tile_f32, 6), QW_ROW(tile_f32, 7), QW_ROW(tile_f32, 8)};
#undef QW_ROW

// x: [m, k] (row stride ldx), packed weight as above, bias: [n] fp32 or NULL, out: [m, n] (row
// stride ldo), in bf16 (is_bf16) or fp32.
int qw_inv_gemm(const void *x, int64_t ldx, const void *packed, const float *bias, void *out, int64_t ldo,
                int64_t m, int64_t n, int64_t k, int is_bf16, int num_threads) {
    const int64_t nb = cdiv64(n, QW_NB);
    const int64_t col_tiles = cdiv64(nb, QW_NR_BLK), row_tiles = cdiv64(m, QW_MR);
    // Rows in chunks of QW_MC_TILES row tiles (128 rows: their x stays in L2) and, within a chunk,
    // every column tile over the chunk's rows (one tile's weights, 32 columns x K, stay in L1).
    const int64_t chunks = cdiv64(row_tiles, QW_MC_TILES);
    const int64_t work = chunks * col_tiles;
    (void)num_threads;
#pragma omp parallel for num_threads(num_threads) if (num_threads > 1 && work > 1) schedule(static)
    for (int64_t w = 0; w < work; w++) {
        const int64_t chunk = w / col_tiles, ct = w % col_tiles;
        const int64_t blk = ct * QW_NR_BLK;
        const int64_t nblk = nb - blk < QW_NR_BLK ? nb - blk : QW_NR_BLK;
        const int64_t rt_end = (chunk + 1) * QW_MC_TILES < row_tiles ? (chunk + 1) * QW_MC_TILES : row_tiles;
        for (int64_t rt = chunk * QW_MC_TILES; rt < rt_end; rt++) {
            const int64_t row0 = rt * QW_MR;
            const int64_t mr = m - row0 < QW_MR ? m - row0 : QW_MR;
            if (is_bf16) {
                TILES_BF16[mr - 1][nblk - 1]((const uint16_t *)x + row0 * ldx, ldx, (const uint16_t *)packed, blk,
                                             k, bias, (uint16_t *)out + row0 * ldo, ldo, n);
            } else {
                TILES_F32[mr - 1][nblk - 1]((const float *)x + row0 * ldx, ldx, (const float *)packed, blk, k,
                                            bias, (float *)out + row0 * ldo, ldo, n);
            }
        }
    }
    return 0;
}
