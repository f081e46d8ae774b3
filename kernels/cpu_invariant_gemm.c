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
//
// AMX (bf16, when built for a CPU with AMX tiles and the OS grants them; the caller chooses with
// `amx`): TDPBF16PS on 16 x 16 fp32 C tiles. Each C tile row is one output row, each element one
// chain: zeroed, then one TDPBF16PS per 32-element chunk of K, chunks in order 0, 32, 64, ...,
// into the same fp32 accumulator, stored once at the end. The hardware computes every C row from
// its own A row only, so the rows beside it (real rows, the zero rows that pad the last row tile,
// or none) change no bit; row tiles of 16 or 32 rows and column groups of 32 or 64 change which
// tile registers hold a chain, never the chain. The packed weight is the same [N / 16][K2][16][2]
// layout with K2 rounded up to a multiple of 16 pairs (zeros), so each (column block, K chunk) is
// one contiguous 1 KiB B tile in the VNNI layout TDPBF16PS reads. The AMX and AVX-512 paths give
// different bits (the dot products round differently), each the same for every M.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_amx.h"
#include "cpu_simd.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

// AVX2 + FMA without AVX-512 (16 ymm registers): a tile is computed one 16-column block at a time,
// its rows QW_AVX2_ROWS at a time (2 accumulators a row, the block's weights for one k held once
// for them). A lane's chain is the same as in the other paths (below), so these are row groups
// of registers only.
#define QW_AVX2_ROWS 4

#define QW_NB 16      // columns per packed block (one AVX-512 register of fp32)
#define QW_MR 8       // rows per register tile (16 accumulators + 2 weights + 1 broadcast of 32 zmm)
#define QW_NR_BLK 2   // packed blocks per register tile (32 columns)
#define QW_MC_TILES 16  // row tiles per cache chunk (128 rows)

static int64_t cdiv64(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Pairs of K per packed block: ceil(K / 2), rounded up to whole AMX K chunks (16 pairs) for AMX.
static int64_t packed_k2(int64_t k, int amx) {
    const int64_t k2 = cdiv64(k, 2);
    return amx ? cdiv64(k2, 16) * 16 : k2;
}

// *out = 1 when this build has the AMX path and the OS grants the tile registers.
int qw_inv_amx_available(int *out) {
#if defined(QW_HAVE_AMX)
    *out = qw_amx_request();
#else
    *out = 0;
#endif
    return 0;
}

int qw_inv_pack_bf16(const uint16_t *w, int64_t n, int64_t k, uint16_t *packed, int amx) {
    const int64_t nb = cdiv64(n, QW_NB), k2 = packed_k2(k, amx);
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
#elif defined(__AVX2__) && defined(__FMA__)
    // The portable path's arithmetic, vectorized: a bf16 x bf16 product is exact in fp32, so each
    // FMA rounds once, as the portable a * b + c does (its product exact, its sum rounded), and
    // the bits are the portable path's. A packed pair (even k, odd k) is one 32-bit lane: even =
    // lane << 16, odd = lane & 0xffff0000 are the two fp32 values.
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
    for (int c = 0; c < nblk; c++) {
        const uint16_t *b = packed + (blk + c) * k2 * QW_NB * 2;
        for (int g = 0; g < mr; g += QW_AVX2_ROWS) {
            __m256 lo[QW_AVX2_ROWS], hi[QW_AVX2_ROWS];
            for (int r = 0; r < QW_AVX2_ROWS; r++) lo[r] = hi[r] = _mm256_setzero_ps();
            for (int64_t p = 0; p < k2; p++) {
                const __m256i w_lo = _mm256_loadu_si256((const __m256i *)(b + p * QW_NB * 2));
                const __m256i w_hi = _mm256_loadu_si256((const __m256i *)(b + p * QW_NB * 2 + QW_NB));
                const __m256 even_lo = _mm256_castsi256_ps(_mm256_slli_epi32(w_lo, 16));
                const __m256 odd_lo = _mm256_castsi256_ps(_mm256_and_si256(w_lo, high));
                const __m256 even_hi = _mm256_castsi256_ps(_mm256_slli_epi32(w_hi, 16));
                const __m256 odd_hi = _mm256_castsi256_ps(_mm256_and_si256(w_hi, high));
                for (int r = 0; r < QW_AVX2_ROWS; r++) {
                    if (g + r >= mr) break;
                    const uint16_t *xr = x + (g + r) * ldx;
                    const __m256 a0 = _mm256_set1_ps(bf16_to_f32(xr[2 * p]));
                    const __m256 a1 = _mm256_set1_ps(p < full_pairs ? bf16_to_f32(xr[2 * p + 1]) : 0.0f);
                    lo[r] = _mm256_fmadd_ps(a1, odd_lo, _mm256_fmadd_ps(a0, even_lo, lo[r]));
                    hi[r] = _mm256_fmadd_ps(a1, odd_hi, _mm256_fmadd_ps(a0, even_hi, hi[r]));
                }
            }
            for (int r = 0; r < QW_AVX2_ROWS; r++) {
                if (g + r >= mr) break;
                _mm256_store_ps(acc[g + r][c], lo[r]);
                _mm256_store_ps(acc[g + r][c] + 8, hi[r]);
            }
        }
    }
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

// ---- bf16 on AMX tiles --------------------------------------------------------------------------

#if defined(QW_HAVE_AMX)
#define QW_AMX_ROWS 16    // rows per A / C tile
#define QW_AMX_GROUP 4    // column blocks (of 16) per work item: 64 columns
#define QW_AMX_MC 128     // rows per work item (their A rows stay in L2 while the group's B tiles cycle)

// Bias, bf16 rounding and the store of one 16 x 16 C tile's first `rows` rows and `cols` columns.
static inline void amx_store(const float *c, int64_t rows, int64_t cols, const float *bias, int64_t col0,
                             uint16_t *out, int64_t ldo) {
    const __mmask16 mask = (__mmask16)((1u << cols) - 1u);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + col0) : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; r++) {
        __m512 v = _mm512_load_ps(c + r * QW_NB);
        if (bias) v = _mm512_add_ps(v, b);
        const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
        _mm256_mask_storeu_epi16(out + r * ldo + col0, mask, h);
    }
}

// 16 rows x up to 4 column blocks (nt of them): C tiles 0-3, A tile 4, B tiles 5-7 (the fourth
// block reuses tile 5). a: 16 rows (stride lda elements), k2 packed pairs, steps chunks of 32.
static void amx_1x4(const uint16_t *a, int64_t lda, const uint16_t *const *b, int nt, int64_t steps,
                    float (*c)[QW_AMX_ROWS * QW_NB]) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const int64_t stride_a = lda * 2;
    for (int64_t s = 0; s < steps; s++) {
        _tile_loadd(4, a + s * 32, stride_a);
        _tile_loadd(5, b[0] + s * 512, 64);
        _tile_dpbf16ps(0, 4, 5);
        if (nt > 1) {
            _tile_loadd(6, b[1] + s * 512, 64);
            _tile_dpbf16ps(1, 4, 6);
        }
        if (nt > 2) {
            _tile_loadd(7, b[2] + s * 512, 64);
            _tile_dpbf16ps(2, 4, 7);
        }
        if (nt > 3) {
            _tile_loadd(5, b[3] + s * 512, 64);
            _tile_dpbf16ps(3, 4, 5);
        }
    }
    _tile_stored(0, c[0], 64);
    if (nt > 1) _tile_stored(1, c[1], 64);
    if (nt > 2) _tile_stored(2, c[2], 64);
    if (nt > 3) _tile_stored(3, c[3], 64);
}

// 32 rows (two A tiles, a0 and a1) x up to 2 column blocks: C tiles 0-3 (row tile r, block j in
// tile 2 r + j), A tiles 4-5, B tiles 6-7. Each C element runs the same chain as in amx_1x4.
static void amx_2x2(const uint16_t *a0, const uint16_t *a1, int64_t lda, const uint16_t *const *b, int nt,
                    int64_t steps, float (*c)[QW_AMX_ROWS * QW_NB]) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const int64_t stride_a = lda * 2;
    for (int64_t s = 0; s < steps; s++) {
        _tile_loadd(4, a0 + s * 32, stride_a);
        _tile_loadd(6, b[0] + s * 512, 64);
        _tile_loadd(5, a1 + s * 32, stride_a);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(2, 5, 6);
        if (nt > 1) {
            _tile_loadd(7, b[1] + s * 512, 64);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, c[0], 64);
    _tile_stored(2, c[2], 64);
    if (nt > 1) {
        _tile_stored(1, c[1], 64);
        _tile_stored(3, c[3], 64);
    }
}

// x: [m, k] bf16 (row stride ldx) -> out [m, n] bf16. Rows whose A tile would run past m, and every
// row when K is not a whole number of 32-element chunks, are read from a zero-padded copy.
static int gemm_amx(const uint16_t *x, int64_t ldx, const uint16_t *packed, const float *bias, uint16_t *out,
                    int64_t ldo, int64_t m, int64_t n, int64_t k, int num_threads) {
    const int64_t k2 = packed_k2(k, 1), steps = k2 / 16, kp = k2 * 2;
    const int64_t nb = cdiv64(n, QW_NB);
    // Row tiles [0, full_tiles) read x itself; the rest read `pad` ([pad_rows, kp], zeros beyond x).
    const int64_t full_tiles = k % 32 == 0 ? m / QW_AMX_ROWS : 0;
    const int64_t pad_row0 = full_tiles * QW_AMX_ROWS;
    const int64_t pad_rows = cdiv64(m - pad_row0, QW_AMX_ROWS) * QW_AMX_ROWS;
    uint16_t *pad = NULL;
    if (pad_rows > 0) {
        pad = aligned_alloc(64, (size_t)cdiv64(pad_rows * kp * 2, 64) * 64);
        if (!pad) return 4;
        memset(pad, 0, (size_t)(pad_rows * kp) * sizeof(uint16_t));
        for (int64_t r = pad_row0; r < m; r++)
            memcpy(pad + (r - pad_row0) * kp, x + r * ldx, (size_t)k * sizeof(uint16_t));
    }
    const int64_t groups = cdiv64(nb, QW_AMX_GROUP), chunks = cdiv64(m, QW_AMX_MC);
    const int64_t work = groups * chunks;
    (void)num_threads;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && work > 1)
    {
        qw_amx_tilecfg cfg;
        qw_amx_config_all(&cfg, QW_AMX_ROWS, 64);
        _tile_loadconfig(&cfg);
        float c[4][QW_AMX_ROWS * QW_NB] __attribute__((aligned(64)));  // the C tiles of one call
#pragma omp for schedule(static)
        for (int64_t w = 0; w < work; w++) {
            const int64_t chunk = w / groups, g = w % groups;
            const int64_t blk0 = g * QW_AMX_GROUP;
            const int nt = (int)(nb - blk0 < QW_AMX_GROUP ? nb - blk0 : QW_AMX_GROUP);
            const uint16_t *b[QW_AMX_GROUP];
            for (int j = 0; j < QW_AMX_GROUP; j++) b[j] = packed + (blk0 + (j < nt ? j : 0)) * k2 * QW_NB * 2;
            const int64_t row_end = (chunk + 1) * QW_AMX_MC < m ? (chunk + 1) * QW_AMX_MC : m;
            for (int64_t row0 = chunk * QW_AMX_MC; row0 < row_end;) {
                // The A rows of the row tile at row r: x itself, or the padded copy.
#define QW_A_ROWS(r) ((r) < pad_row0 ? x + (r) * ldx : pad + ((r) - pad_row0) * kp)
#define QW_A_LD(r) ((r) < pad_row0 ? ldx : kp)
                const int64_t rows0 = row_end - row0 < QW_AMX_ROWS ? row_end - row0 : QW_AMX_ROWS;
                const int64_t row1 = row0 + QW_AMX_ROWS;
                if (row1 < row_end && QW_A_LD(row0) == QW_A_LD(row1)) {
                    // Two row tiles at once, column blocks two by two.
                    const int64_t rows1 = row_end - row1 < QW_AMX_ROWS ? row_end - row1 : QW_AMX_ROWS;
                    for (int j = 0; j < nt; j += 2) {
                        const int ntj = nt - j < 2 ? nt - j : 2;
                        amx_2x2(QW_A_ROWS(row0), QW_A_ROWS(row1), QW_A_LD(row0), b + j, ntj, steps, c);
                        for (int u = 0; u < ntj; u++) {
                            const int64_t col0 = (blk0 + j + u) * QW_NB;
                            const int64_t cols = n - col0 < QW_NB ? n - col0 : QW_NB;
                            amx_store(c[u], rows0, cols, bias, col0, out + row0 * ldo, ldo);
                            amx_store(c[2 + u], rows1, cols, bias, col0, out + row1 * ldo, ldo);
                        }
                    }
                    row0 += 2 * QW_AMX_ROWS;
                } else {
                    amx_1x4(QW_A_ROWS(row0), QW_A_LD(row0), b, nt, steps, c);
                    for (int u = 0; u < nt; u++) {
                        const int64_t col0 = (blk0 + u) * QW_NB;
                        const int64_t cols = n - col0 < QW_NB ? n - col0 : QW_NB;
                        amx_store(c[u], rows0, cols, bias, col0, out + row0 * ldo, ldo);
                    }
                    row0 += QW_AMX_ROWS;
                }
#undef QW_A_ROWS
#undef QW_A_LD
            }
        }
        _tile_release();
    }
    free(pad);
    return 0;
}
#endif  // QW_HAVE_AMX

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
#elif defined(__AVX2__) && defined(__FMA__)
    // One FMA per k, as the AVX-512 path: the same bits.
    for (int c = 0; c < nblk; c++) {
        const float *b = c == 0 ? b0 : b1;
        for (int g = 0; g < mr; g += QW_AVX2_ROWS) {
            __m256 lo[QW_AVX2_ROWS], hi[QW_AVX2_ROWS];
            for (int r = 0; r < QW_AVX2_ROWS; r++) lo[r] = hi[r] = _mm256_setzero_ps();
            for (int64_t kk = 0; kk < k; kk++) {
                const __m256 w_lo = _mm256_loadu_ps(b + kk * QW_NB);
                const __m256 w_hi = _mm256_loadu_ps(b + kk * QW_NB + 8);
                for (int r = 0; r < QW_AVX2_ROWS; r++) {
                    if (g + r >= mr) break;
                    const __m256 a = _mm256_broadcast_ss(x + (g + r) * ldx + kk);
                    lo[r] = _mm256_fmadd_ps(a, w_lo, lo[r]);
                    hi[r] = _mm256_fmadd_ps(a, w_hi, hi[r]);
                }
            }
            for (int r = 0; r < QW_AVX2_ROWS; r++) {
                if (g + r >= mr) break;
                _mm256_store_ps(acc[g + r][c], lo[r]);
                _mm256_store_ps(acc[g + r][c] + 8, hi[r]);
            }
        }
    }
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
// stride ldo), in bf16 (is_bf16) or fp32. amx: the weight was packed for AMX (bf16 only; the
// caller asked qw_inv_amx_available first).
int qw_inv_gemm(const void *x, int64_t ldx, const void *packed, const float *bias, void *out, int64_t ldo,
                int64_t m, int64_t n, int64_t k, int is_bf16, int amx, int num_threads) {
    if (amx) {
#if defined(QW_HAVE_AMX)
        if (!is_bf16 || !qw_amx_request()) return 5;
        return gemm_amx((const uint16_t *)x, ldx, (const uint16_t *)packed, bias, (uint16_t *)out, ldo, m, n, k,
                        num_threads);
#else
        return 5;
#endif
    }
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
