// Batch-invariant paged attention for the CPU: one function for prefill chunks and decode steps,
// in which the reduction over a query token's keys depends only on the token's position, never on
// the batch, on how the prompt was chunked, or on whether its prefix came from the cache.
//
// Every query token (at absolute position pos, keys [start, pos] with start = 0 or the window's
// first key) walks its keys in tiles of QW_KT = 16 positions aligned to absolute positions
// (tile t holds positions [16 t, 16 t + 16)), from the first tile to the last, with an online
// softmax: per tile, 16 scores in one vector (lane j = key 16 t + j; a lane outside [start, pos]
// is -inf, so its weight is exactly 0), the tile's max, the rescale, then the weighted values added
// key by key in position order. K and V always come from the cache (the step writes its own K/V
// there first), so a token computed in a prefill chunk, in a decode step, or after a prefix-cache
// hit reads the same numbers in the same order and gets the same bits.
//
// Work is split over (query tile, KV head) pairs; the query heads of one KV head and the tokens of
// one query tile share each key tile's transposed keys. Threads never split one token's keys.
//
// bf16 with AVX512-BF16 (built with -march=native on such a CPU): the same tiles and the same
// online softmax, both products by VDPBF16PS on bf16 pairs (unit_dp): a tile's keys are transposed
// once into pair rows (kt[p][j] = dims 2p, 2p + 1 of key j), so a score is two fixed chains over
// the pairs (even and odd p) added once; the probabilities are rounded to bf16 (as the default
// prefill kernel does) and P.V runs over key pairs in position order into fp32. Every token runs
// that one code path, prefill or decode, so the invariance argument above is unchanged; the bits
// differ from the fp32-FMA path's, which bf16 takes on CPUs without AVX512-BF16.
//
// bf16 on AMX (built for AMX, head_dim a multiple of 32, the tile state granted, allow_amx): unit_amx,
// 32-key tiles aligned to absolute positions; S = Q K^T and O = P V by TDPBF16PS on 16 x 16 tiles
// (a row of C from its own row of A only), the row-wise online softmax in AVX-512 between them,
// and acc = acc * alpha + O once per tile. Again one path for every token; its bits differ from
// the VDPBF16PS path's (QWORKER_INVARIANT_ATTENTION_AMX=0 on the Python side picks that one).
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_simd.h"

#define QW_KT 16        // keys per tile (one 16-lane vector of scores)
#define QW_MAX_D 256    // largest head_dim
#define QW_MAX_GROUP 16 // most query heads per KV head

typedef uint16_t v16h __attribute__((vector_size(32)));

static inline v16f load16(const void *p, int is_bf16) {
    if (!is_bf16) return loadu16((const float *)p);
    v16h h;
    memcpy(&h, p, sizeof h);
    return (v16f)(__builtin_convertvector(h, v16i) << 16);
}

static inline float load1(const void *p, int64_t i, int is_bf16) {
    return is_bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

#define QW_MAX_ROWS 32  // query rows (tokens x heads of one KV head) sharing one tile's keys

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define QW_HAVE_DP 1

// In place: r[i] (row i of a 16 x 16 matrix of 32-bit elements) becomes column i.
static inline void transpose16_epi32(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    // u[4 g + c], 128-bit lane L: column 4 L + c of rows 4 g .. 4 g + 3.
    __m512i u[16];
    for (int g = 0; g < 4; g++) {
        u[4 * g] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
        u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
        u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
        u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
    }
    for (int c = 0; c < 4; c++) {
        const __m512i x0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88);
        const __m512i x1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xdd);
        const __m512i y0 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88);
        const __m512i y1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xdd);
        r[c] = _mm512_shuffle_i32x4(x0, y0, 0x88);
        r[8 + c] = _mm512_shuffle_i32x4(x0, y0, 0xdd);
        r[4 + c] = _mm512_shuffle_i32x4(x1, y1, 0x88);
        r[12 + c] = _mm512_shuffle_i32x4(x1, y1, 0xdd);
    }
}

// permutex2var indices interleaving two rows of 32 bf16 (a: 0-31, b: 32-63) into pairs: lo takes
// the pairs of elements 0-15, hi of 16-31.
static inline void pair_interleave_indices(__m512i *lo, __m512i *hi) {
    uint16_t l[32], h[32];
    for (int i = 0; i < 32; i++) {
        l[i] = (uint16_t)((i & 1 ? 32 : 0) + i / 2);
        h[i] = (uint16_t)((i & 1 ? 32 : 0) + 16 + i / 2);
    }
    *lo = _mm512_loadu_si512(l);
    *hi = _mm512_loadu_si512(h);
}

// One work item (tokens t0 .. t0 + nt - 1 of one sequence at consecutive positions, KV head kvh)
// in bf16 with VDPBF16PS; see the header comment. q, out: bf16 [tokens, H, D]; caches bf16.
static void unit_dp(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                    const int32_t *table, const int32_t *token_pos, int64_t t0, int64_t nt, int64_t kvh,
                    int64_t group, int64_t head_dim, int64_t block_size, int64_t row_elems, float scale,
                    int64_t window, int has_soft_cap, float soft_cap, uint16_t *out, int64_t out_stride) {
    const int64_t pairs = head_dim / 2, pblocks = (pairs + 15) / 16, dv = head_dim / 16;
    uint32_t qp[QW_MAX_ROWS + 1][QW_MAX_D / 2] __attribute__((aligned(64)));  // row QW_MAX_ROWS: zeros
    __m512 acc[QW_MAX_ROWS + 1][QW_MAX_D / 16];
    float m[QW_MAX_ROWS], l[QW_MAX_ROWS];
    int64_t first_key[QW_MAX_ROWS];
    uint32_t kt[QW_MAX_D / 2][QW_KT] __attribute__((aligned(64)));      // kt[p][j]: pair p of key j
    uint32_t vp[QW_KT / 2][QW_MAX_D] __attribute__((aligned(64)));      // vp[jp][d]: v[2 jp][d], v[2 jp + 1][d]
    memset(qp[QW_MAX_ROWS], 0, sizeof qp[QW_MAX_ROWS]);
    for (int64_t i = 0; i < nt; i++) {
        const int64_t pos = token_pos[t0 + i];
        first_key[i] = window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
        for (int64_t g = 0; g < group; g++) {
            const int64_t r = i * group + g, h = kvh * group + g;
            memcpy(qp[r], q + (t0 + i) * q_stride + h * head_dim, (size_t)head_dim * sizeof(uint16_t));
            for (int64_t c = 0; c < dv; c++) acc[r][c] = _mm512_setzero_ps();
            m[r] = -INFINITY;
            l[r] = 0.0f;
        }
    }
    __m512i idx_lo, idx_hi;
    pair_interleave_indices(&idx_lo, &idx_hi);
    const int64_t last_pos = token_pos[t0 + nt - 1];
    const int64_t lowest = first_key[0];
    for (int64_t tile0 = lowest / QW_KT * QW_KT; tile0 <= last_pos; tile0 += QW_KT) {
        const int64_t any_lo = lowest > tile0 ? lowest - tile0 : 0;
        const int64_t any_hi = last_pos - tile0 + 1 < QW_KT ? last_pos - tile0 + 1 : QW_KT;
        const uint16_t *krow[QW_KT], *vrow[QW_KT];  // NULL: a key no token of the item reads (zeros)
        for (int64_t j = 0; j < QW_KT; j++) {
            if (j < any_lo || j >= any_hi) {
                krow[j] = vrow[j] = NULL;
                continue;
            }
            const int64_t p = tile0 + j;
            const int64_t slot = (int64_t)table[p / block_size] * block_size + p % block_size;
            krow[j] = k_cache + slot * row_elems + kvh * head_dim;
            vrow[j] = v_cache + slot * row_elems + kvh * head_dim;
        }
        // K^T in pair rows, 16 pairs at a time.
        for (int64_t pb = 0; pb < pblocks; pb++) {
            const int64_t n_p = pairs - pb * 16 < 16 ? pairs - pb * 16 : 16;
            const __mmask16 pm = (__mmask16)((1u << n_p) - 1u);
            __m512i rows[QW_KT];
            for (int j = 0; j < QW_KT; j++)
                rows[j] = krow[j] ? _mm512_maskz_loadu_epi32(pm, (const uint32_t *)krow[j] + pb * 16)
                                  : _mm512_setzero_si512();
            transpose16_epi32(rows);
            for (int64_t pp = 0; pp < n_p; pp++) _mm512_store_si512(kt[pb * 16 + pp], rows[pp]);
        }
        // V in key pairs, 32 dims at a time.
        for (int jp = 0; jp < QW_KT / 2; jp++) {
            for (int64_t d0 = 0; d0 < head_dim; d0 += 32) {
                const int64_t n_d = head_dim - d0 < 32 ? head_dim - d0 : 32;
                const __mmask32 dm = (__mmask32)(n_d == 32 ? 0xffffffffu : (1u << n_d) - 1u);
                const __m512i a = vrow[2 * jp] ? _mm512_maskz_loadu_epi16(dm, vrow[2 * jp] + d0)
                                               : _mm512_setzero_si512();
                const __m512i b = vrow[2 * jp + 1] ? _mm512_maskz_loadu_epi16(dm, vrow[2 * jp + 1] + d0)
                                                   : _mm512_setzero_si512();
                _mm512_store_si512(vp[jp] + d0, _mm512_permutex2var_epi16(a, idx_lo, b));
                if (n_d > 16) _mm512_store_si512(vp[jp] + d0 + 16, _mm512_permutex2var_epi16(a, idx_hi, b));
            }
        }
        int64_t active[QW_MAX_ROWS + 3];
        int64_t num_active = 0;
        for (int64_t i = 0; i < nt; i++) {
            const int64_t pos = token_pos[t0 + i], start = first_key[i];
            if (tile0 > pos || tile0 + QW_KT <= start) continue;
            for (int64_t g = 0; g < group; g++) active[num_active++] = i * group + g;
        }
        for (int64_t a = num_active; a < num_active + 3; a++) active[a] = QW_MAX_ROWS;
        for (int64_t a = 0; a < num_active; a += 4) {
            // Scores, four rows at once: per row two chains (even and odd pairs), then their sum.
            __m512 se[4], so[4];
            for (int u = 0; u < 4; u++) se[u] = so[u] = _mm512_setzero_ps();
            for (int64_t p = 0; p < pairs; p += 2) {
                const __m512bh k0 = (__m512bh)_mm512_load_si512(kt[p]);
                const __m512bh k1 = (__m512bh)_mm512_load_si512(kt[p + 1]);
                for (int u = 0; u < 4; u++) {
                    const uint32_t *qr = qp[active[a + u]];
                    se[u] = _mm512_dpbf16_ps(se[u], (__m512bh)_mm512_set1_epi32((int)qr[p]), k0);
                    so[u] = _mm512_dpbf16_ps(so[u], (__m512bh)_mm512_set1_epi32((int)qr[p + 1]), k1);
                }
            }
            uint32_t pw[4][QW_KT / 2] __attribute__((aligned(32)));  // bf16 probabilities, in pairs
            for (int u = 0; u < 4; u++) {
                const int64_t r = active[a + u];
                if (r == QW_MAX_ROWS) {
                    memset(pw[u], 0, sizeof pw[u]);
                    continue;
                }
                const int64_t i = r / group;
                const int64_t pos = token_pos[t0 + i], start = first_key[i];
                const int64_t lo = start > tile0 ? start - tile0 : 0;
                const int64_t hi = pos - tile0 + 1 < QW_KT ? pos - tile0 + 1 : QW_KT;
                const __mmask16 valid = (__mmask16)(((1u << hi) - 1u) & ~((1u << lo) - 1u));
                v16f sc = (v16f)_mm512_add_ps(se[u], so[u]) * splat16(scale);
                if (has_soft_cap) sc = vsoft_cap16(sc, soft_cap);
                sc = (v16f)_mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid, (__m512)sc);
                const float tile_max = hmax16(sc);
                const float m_new = m[r] > tile_max ? m[r] : tile_max;
                const float alpha = expf(m[r] - m_new);  // 0 at the first tile (m = -inf)
                const v16f pv = vexp_nonpos16(sc - splat16(m_new));  // exactly 0 on invalid lanes
                l[r] = l[r] * alpha + hsum16(pv);
                const __m512 va = _mm512_set1_ps(alpha);
                for (int64_t c = 0; c < dv; c++) acc[r][c] = _mm512_mul_ps(acc[r][c], va);
                m[r] = m_new;
                _mm256_store_si256((__m256i *)pw[u], (__m256i)_mm512_cvtneps_pbh((__m512)pv));
            }
            // P.V over key pairs in position order; a zero probability adds an exact zero.
            for (int jp = 0; jp < QW_KT / 2; jp++) {
                const __m512bh w0 = (__m512bh)_mm512_set1_epi32((int)pw[0][jp]);
                const __m512bh w1 = (__m512bh)_mm512_set1_epi32((int)pw[1][jp]);
                const __m512bh w2 = (__m512bh)_mm512_set1_epi32((int)pw[2][jp]);
                const __m512bh w3 = (__m512bh)_mm512_set1_epi32((int)pw[3][jp]);
                for (int64_t c = 0; c < dv; c++) {
                    const __m512bh vv = (__m512bh)_mm512_load_si512(vp[jp] + 16 * c);
                    acc[active[a]][c] = _mm512_dpbf16_ps(acc[active[a]][c], w0, vv);
                    acc[active[a + 1]][c] = _mm512_dpbf16_ps(acc[active[a + 1]][c], w1, vv);
                    acc[active[a + 2]][c] = _mm512_dpbf16_ps(acc[active[a + 2]][c], w2, vv);
                    acc[active[a + 3]][c] = _mm512_dpbf16_ps(acc[active[a + 3]][c], w3, vv);
                }
            }
        }
    }
    for (int64_t i = 0; i < nt; i++) {
        for (int64_t g = 0; g < group; g++) {
            const int64_t r = i * group + g, h = kvh * group + g;
            uint16_t *oh = out + (t0 + i) * out_stride + h * head_dim;
            const __m512 inv = _mm512_set1_ps(1.0f / l[r]);
            for (int64_t c = 0; c < dv; c++)
                _mm256_storeu_si256((__m256i *)(oh + 16 * c),
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[r][c], inv)));
        }
    }
}

#include "cpu_amx.h"
#if defined(QW_HAVE_AMX)
#define QW_AKT 32  // keys per AMX tile step: one 32-key chunk of P per TDPBF16PS

// B tiles of a 32-key tile: kt[c][h]: K^T of keys 16 h .. 16 h + 15, dims 32 c .. 32 c + 31, in
// pairs ([16 pairs][16 keys]); vt[jp][d]: values of keys 2 jp, 2 jp + 1 for dim d (one B tile per
// 16 dims, row stride QW_MAX_D pairs).
typedef struct {
    uint32_t kt[QW_MAX_D / 32][2][16][16] __attribute__((aligned(64)));
    uint32_t vt[QW_AKT / 2][QW_MAX_D] __attribute__((aligned(64)));
    float s[QW_MAX_ROWS][QW_AKT] __attribute__((aligned(64)));          // scores
    uint16_t p[QW_MAX_ROWS][QW_AKT] __attribute__((aligned(64)));       // bf16 probabilities
    float o[QW_MAX_ROWS][QW_MAX_D] __attribute__((aligned(64)));        // this tile's P.V
} AmxScratch;

// One KV head's rows of a work item: queries (zero rows after the last), accumulators, softmax state.
typedef struct {
    uint32_t qp[QW_MAX_ROWS][QW_MAX_D / 2] __attribute__((aligned(64)));
    __m512 acc[QW_MAX_ROWS][QW_MAX_D / 16];
    float m[QW_MAX_ROWS], l[QW_MAX_ROWS], alpha[QW_MAX_ROWS];
} AmxHead;

// P.V of row tile rt into o: C tiles 0-3 hold dims 16 dc .. 16 dc + 15 for four dc at a time.
static inline void amx_pv(AmxScratch *w, int rt, int64_t dv) {
    for (int64_t d0 = 0; d0 < dv; d0 += 4) {
        const int64_t n = dv - d0 < 4 ? dv - d0 : 4;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        _tile_loadd(4, w->p[16 * rt], QW_AKT * 2);
        _tile_loadd(5, w->vt[0] + 16 * d0, QW_MAX_D * 4);
        _tile_dpbf16ps(0, 4, 5);
        if (n > 1) {
            _tile_loadd(6, w->vt[0] + 16 * (d0 + 1), QW_MAX_D * 4);
            _tile_dpbf16ps(1, 4, 6);
        }
        if (n > 2) {
            _tile_loadd(7, w->vt[0] + 16 * (d0 + 2), QW_MAX_D * 4);
            _tile_dpbf16ps(2, 4, 7);
        }
        if (n > 3) {
            _tile_loadd(5, w->vt[0] + 16 * (d0 + 3), QW_MAX_D * 4);
            _tile_dpbf16ps(3, 4, 5);
        }
        _tile_stored(0, w->o[16 * rt] + 16 * d0, QW_MAX_D * 4);
        if (n > 1) _tile_stored(1, w->o[16 * rt] + 16 * (d0 + 1), QW_MAX_D * 4);
        if (n > 2) _tile_stored(2, w->o[16 * rt] + 16 * (d0 + 2), QW_MAX_D * 4);
        if (n > 3) _tile_stored(3, w->o[16 * rt] + 16 * (d0 + 3), QW_MAX_D * 4);
    }
}

// One work item in bf16 on AMX tiles (head_dim a multiple of 32; the thread has loaded a 16 x 64
// configuration): tokens t0 .. t0 + nt - 1 of one sequence, every KV head (the heads' lines of a
// slot are one contiguous row of the cache, read together). Keys in tiles of 32 aligned to
// absolute positions; per tile and KV head: S = Q K^T (one C tile per 16 rows x 16 keys, zeroed,
// then one TDPBF16PS per 32 dims in order), the row-wise online softmax on the stored scores (as
// unit_dp, over 32 lanes), P rounded to bf16, O = P V (one TDPBF16PS per 16 rows x 16 dims,
// zeroed), then acc = acc * alpha + O per row. Rows are independent in every step, and a row's
// lanes outside its keys carry probability 0.
static void unit_amx(AmxScratch *w /* [num_kv_heads] */, AmxHead *heads, const uint16_t *q, int64_t q_stride,
                     const uint16_t *k_cache, const uint16_t *v_cache, const int32_t *table,
                     const int32_t *token_pos, int64_t t0, int64_t nt, int64_t num_kv_heads, int64_t group,
                     int64_t head_dim, int64_t block_size, int64_t row_elems, float scale, int64_t window,
                     int has_soft_cap, float soft_cap, uint16_t *out, int64_t out_stride) {
    const int64_t pairs = head_dim / 2, dchunks = head_dim / 32, dv = head_dim / 16;
    const int64_t rows = nt * group, row_tiles = (rows + 15) / 16;
    int64_t first_key[QW_MAX_ROWS];
    for (int64_t i = 0; i < nt; i++) {
        const int64_t pos = token_pos[t0 + i];
        first_key[i] = window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
    }
    for (int64_t kvh = 0; kvh < num_kv_heads; kvh++) {
        AmxHead *hd = &heads[kvh];
        memset(hd->qp, 0, (size_t)row_tiles * 16 * sizeof hd->qp[0]);
        for (int64_t i = 0; i < nt; i++) {
            for (int64_t g = 0; g < group; g++) {
                const int64_t r = i * group + g, h = kvh * group + g;
                memcpy(hd->qp[r], q + (t0 + i) * q_stride + h * head_dim, (size_t)head_dim * sizeof(uint16_t));
                for (int64_t c = 0; c < dv; c++) hd->acc[r][c] = _mm512_setzero_ps();
                hd->m[r] = -INFINITY;
                hd->l[r] = 0.0f;
            }
        }
    }
    for (int64_t kvh = 0; kvh < num_kv_heads; kvh++)  // padding rows
        for (int64_t r = rows; r < row_tiles * 16; r++) memset(w[kvh].p[r], 0, sizeof w[kvh].p[r]);
    __m512i idx_lo, idx_hi;
    pair_interleave_indices(&idx_lo, &idx_hi);
    const int64_t last_pos = token_pos[t0 + nt - 1];
    const int64_t lowest = first_key[0];
    for (int64_t tile0 = lowest / QW_AKT * QW_AKT; tile0 <= last_pos; tile0 += QW_AKT) {
        const int64_t any_lo = lowest > tile0 ? lowest - tile0 : 0;
        const int64_t any_hi = last_pos - tile0 + 1 < QW_AKT ? last_pos - tile0 + 1 : QW_AKT;
        // The next tile's slots (every KV head's K and V), a line at a time: decode steps read the
        // cache from DRAM in block-table order.
        for (int64_t p = tile0 + QW_AKT; p < tile0 + 2 * QW_AKT && p <= last_pos; p++) {
            const int64_t slot = (int64_t)table[p / block_size] * block_size + p % block_size;
            const char *kp = (const char *)(k_cache + slot * row_elems);
            const char *vq = (const char *)(v_cache + slot * row_elems);
            for (int64_t b = 0; b < row_elems * 2; b += 64) {
                _mm_prefetch(kp + b, _MM_HINT_T0);
                _mm_prefetch(vq + b, _MM_HINT_T0);
            }
        }
        int64_t slot_of[QW_AKT];  // -1: a key no token of the item reads (zeros)
        for (int64_t j = 0; j < QW_AKT; j++) {
            const int64_t p = tile0 + j;
            slot_of[j] = j < any_lo || j >= any_hi ? -1
                                                   : (int64_t)table[p / block_size] * block_size + p % block_size;
        }
        // Which tokens this tile concerns, and their valid lanes (the same for every KV head).
        uint32_t valid[QW_MAX_ROWS];
        uint8_t on[QW_MAX_ROWS];
        for (int64_t i = 0; i < nt; i++) {
            const int64_t pos = token_pos[t0 + i], start = first_key[i];
            on[i] = (uint8_t)!(tile0 > pos || tile0 + QW_AKT <= start);
            const int64_t lo = start > tile0 ? start - tile0 : 0;
            const int64_t hi = pos - tile0 + 1 < QW_AKT ? pos - tile0 + 1 : QW_AKT;
            valid[i] = on[i] ? (uint32_t)(((uint64_t)1 << hi) - 1u) & ~(uint32_t)(((uint64_t)1 << lo) - 1u) : 0;
        }
        // Four passes over the KV heads (pack, S, softmax, P.V), so that a tile load never
        // reads lines that plain stores wrote just before: a tile load waits for them to
        // commit, which was a fifth of the kernel's time when each head ran its steps in turn.
        for (int64_t kvh = 0; kvh < num_kv_heads; kvh++) {
            AmxScratch *wk = &w[kvh];
            const uint16_t *krow[QW_AKT], *vrow[QW_AKT];
            for (int64_t j = 0; j < QW_AKT; j++) {
                krow[j] = slot_of[j] < 0 ? NULL : k_cache + slot_of[j] * row_elems + kvh * head_dim;
                vrow[j] = slot_of[j] < 0 ? NULL : v_cache + slot_of[j] * row_elems + kvh * head_dim;
            }
            for (int h = 0; h < 2; h++) {
                for (int64_t pb = 0; pb < pairs / 16; pb++) {
                    __m512i r16[16];
                    for (int j = 0; j < 16; j++)
                        r16[j] = krow[16 * h + j]
                                     ? _mm512_loadu_si512((const uint32_t *)krow[16 * h + j] + pb * 16)
                                     : _mm512_setzero_si512();
                    transpose16_epi32(r16);
                    for (int pp = 0; pp < 16; pp++) _mm512_store_si512(wk->kt[pb][h][pp], r16[pp]);
                }
            }
            for (int jp = 0; jp < QW_AKT / 2; jp++) {
                for (int64_t d0 = 0; d0 < head_dim; d0 += 32) {
                    const __m512i a =
                        vrow[2 * jp] ? _mm512_loadu_si512(vrow[2 * jp] + d0) : _mm512_setzero_si512();
                    const __m512i b =
                        vrow[2 * jp + 1] ? _mm512_loadu_si512(vrow[2 * jp + 1] + d0) : _mm512_setzero_si512();
                    _mm512_store_si512(wk->vt[jp] + d0, _mm512_permutex2var_epi16(a, idx_lo, b));
                    _mm512_store_si512(wk->vt[jp] + d0 + 16, _mm512_permutex2var_epi16(a, idx_hi, b));
                }
            }
        }
        for (int64_t kvh = 0; kvh < num_kv_heads; kvh++) {
            AmxHead *hd = &heads[kvh];
            AmxScratch *wk = &w[kvh];
            // S = Q K^T: C tile 2 rt + h, A tiles 4 (rows 0-15) and 5 (16-31), B tiles 6 and 7.
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t c = 0; c < dchunks; c++) {
                _tile_loadd(6, wk->kt[c][0], 64);
                _tile_loadd(7, wk->kt[c][1], 64);
                _tile_loadd(4, hd->qp[0] + 16 * c, QW_MAX_D * 2);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                if (row_tiles > 1) {
                    _tile_loadd(5, hd->qp[16] + 16 * c, QW_MAX_D * 2);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                }
            }
            _tile_stored(0, wk->s[0], QW_AKT * 4);
            _tile_stored(1, wk->s[0] + 16, QW_AKT * 4);
            if (row_tiles > 1) {
                _tile_stored(2, wk->s[16], QW_AKT * 4);
                _tile_stored(3, wk->s[16] + 16, QW_AKT * 4);
            }
        }
        for (int64_t kvh = 0; kvh < num_kv_heads; kvh++) {
            AmxHead *hd = &heads[kvh];
            AmxScratch *wk = &w[kvh];
            // The row-wise online softmax; a row this tile does not concern gets P = 0, keeps acc.
            for (int64_t i = 0; i < nt; i++) {
                for (int64_t g = 0; g < group; g++) {
                    const int64_t r = i * group + g;
                    if (!on[i]) {
                        memset(wk->p[r], 0, sizeof wk->p[r]);
                        continue;
                    }
                    v16f s0 = (v16f)_mm512_load_ps(wk->s[r]) * splat16(scale);
                    v16f s1 = (v16f)_mm512_load_ps(wk->s[r] + 16) * splat16(scale);
                    if (has_soft_cap) {
                        s0 = vsoft_cap16(s0, soft_cap);
                        s1 = vsoft_cap16(s1, soft_cap);
                    }
                    const __m512 ninf = _mm512_set1_ps(-INFINITY);
                    s0 = (v16f)_mm512_mask_mov_ps(ninf, (__mmask16)(valid[i] & 0xffffu), (__m512)s0);
                    s1 = (v16f)_mm512_mask_mov_ps(ninf, (__mmask16)(valid[i] >> 16), (__m512)s1);
                    const float tile_max = hmax16(vmax16(s0, s1));
                    const float m_new = hd->m[r] > tile_max ? hd->m[r] : tile_max;
                    hd->alpha[r] = expf(hd->m[r] - m_new);  // 0 at the first tile (m = -inf)
                    const v16f p0 = vexp_nonpos16(s0 - splat16(m_new)), p1 = vexp_nonpos16(s1 - splat16(m_new));
                    hd->l[r] = hd->l[r] * hd->alpha[r] + (hsum16(p0) + hsum16(p1));
                    hd->m[r] = m_new;
                    _mm256_store_si256((__m256i *)wk->p[r], (__m256i)_mm512_cvtneps_pbh((__m512)p0));
                    _mm256_store_si256((__m256i *)(wk->p[r] + 16), (__m256i)_mm512_cvtneps_pbh((__m512)p1));
                }
            }
        }
        for (int64_t kvh = 0; kvh < num_kv_heads; kvh++) {
            AmxHead *hd = &heads[kvh];
            AmxScratch *wk = &w[kvh];
            for (int rt = 0; rt < row_tiles; rt++) amx_pv(wk, rt, dv);
            for (int64_t r = 0; r < rows; r++) {
                if (!on[r / group]) continue;
                const __m512 va = _mm512_set1_ps(hd->alpha[r]);
                for (int64_t c = 0; c < dv; c++)
                    hd->acc[r][c] = _mm512_fmadd_ps(hd->acc[r][c], va, _mm512_load_ps(wk->o[r] + 16 * c));
            }
        }
    }
    for (int64_t kvh = 0; kvh < num_kv_heads; kvh++) {
        const AmxHead *hd = &heads[kvh];
        for (int64_t i = 0; i < nt; i++) {
            for (int64_t g = 0; g < group; g++) {
                const int64_t r = i * group + g, h = kvh * group + g;
                uint16_t *oh = out + (t0 + i) * out_stride + h * head_dim;
                const __m512 inv = _mm512_set1_ps(1.0f / hd->l[r]);
                for (int64_t c = 0; c < dv; c++)
                    _mm256_storeu_si256((__m256i *)(oh + 16 * c),
                                        (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(hd->acc[r][c], inv)));
            }
        }
    }
}
#endif  // QW_HAVE_AMX
#endif  // QW_HAVE_DP

// q, out: [num_tokens, H, D] (token stride q_stride / out_stride elements, heads packed);
// caches: [num_blocks, block_size, KVH, D]; block_tables: [num_seqs, max_blocks] int32;
// token_seq: [num_tokens] int32 (the token's row in block_tables); token_pos: [num_tokens] int32.
// window: 0 for none, else a query sees keys pos - window + 1 .. pos.
//
// Query tiling: up to QW_MAX_ROWS / group consecutive tokens of one sequence share each tile's
// keys (loaded and transposed once); each token still runs exactly its own tiles, in order, with
// its own lane mask, so the tiling changes no bit.
int qw_inv_paged_attention(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                           const int32_t *block_tables, const int32_t *token_seq, const int32_t *token_pos,
                           void *out, int64_t out_stride, int64_t num_tokens, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks,
                           int64_t num_blocks, float scale, int64_t window, int has_soft_cap, float soft_cap,
                           int is_bf16, int allow_amx, int num_threads) {
    if (head_dim % 16 != 0 || head_dim > QW_MAX_D || num_heads % num_kv_heads != 0 ||
        num_heads / num_kv_heads > QW_MAX_GROUP)
        return 3;
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t pos = token_pos[t];
        if (pos < 0 || pos >= max_blocks * block_size) return 1;
        const int32_t *table = block_tables + (int64_t)token_seq[t] * max_blocks;
        for (int64_t b = 0; b <= pos / block_size; b++)
            if (table[b] < 0 || table[b] >= num_blocks) return 2;
    }
    const int64_t group = num_heads / num_kv_heads, dv = head_dim / 16;
    const int64_t qb = QW_MAX_ROWS / group;  // tokens per query tile
    // Query tiles: runs of at most qb tokens of one sequence at consecutive positions.
    int64_t *run_start = malloc((size_t)(num_tokens + 1) * sizeof(int64_t));
    if (!run_start) return 4;
    int64_t num_runs = 0;
    for (int64_t t = 0; t < num_tokens; t++) {
        if (num_runs == 0 || t - run_start[num_runs - 1] >= qb || token_seq[t] != token_seq[t - 1] ||
            token_pos[t] != token_pos[t - 1] + 1)
            run_start[num_runs++] = t;
    }
    run_start[num_runs] = num_tokens;
    const int64_t elem = is_bf16 ? 2 : 4;
    const int64_t row_elems = num_kv_heads * head_dim;  // elements per cache slot
    const int64_t work = num_runs * num_kv_heads;
    (void)num_threads;
    int use_amx = 0;
#if defined(QW_HAVE_AMX)
    use_amx = allow_amx && is_bf16 && head_dim % 32 == 0 && qw_amx_request();
#else
    (void)allow_amx;
#endif
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && work > 1)
    {
#if defined(QW_HAVE_AMX)
        AmxScratch *scratch = NULL;
        AmxHead *heads = NULL;
        if (use_amx) {
            scratch = aligned_alloc(64, (size_t)num_kv_heads * sizeof(AmxScratch));  // one per KV head
            heads = aligned_alloc(64, (size_t)num_kv_heads * sizeof(AmxHead));
            if (!scratch || !heads) {
#pragma omp atomic write
                failed = 1;
            }
            qw_amx_tilecfg cfg;
            qw_amx_config_all(&cfg, 16, 64);
            _tile_loadconfig(&cfg);
        }
#endif
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < work; w++) {
#if defined(QW_HAVE_AMX)
        if (use_amx) {  // one item per run, every KV head (work counts runs x KV heads: skip the rest)
            if (w % num_kv_heads != 0) continue;
            const int64_t run = w / num_kv_heads, t0 = run_start[run], nt = run_start[run + 1] - t0;
            const int32_t *table = block_tables + (int64_t)token_seq[t0] * max_blocks;
            if (scratch && heads)
                unit_amx(scratch, heads, (const uint16_t *)q, q_stride, (const uint16_t *)k_cache,
                         (const uint16_t *)v_cache, table, token_pos, t0, nt, num_kv_heads, group, head_dim,
                         block_size, row_elems, scale, window, has_soft_cap, soft_cap, (uint16_t *)out, out_stride);
            continue;
        }
#endif
        const int64_t run = w / num_kv_heads, kvh = w % num_kv_heads;
        const int64_t t0 = run_start[run], nt = run_start[run + 1] - t0;
        const int32_t *table = block_tables + (int64_t)token_seq[t0] * max_blocks;
#if defined(QW_HAVE_DP)
        if (is_bf16) {
            unit_dp((const uint16_t *)q, q_stride, (const uint16_t *)k_cache, (const uint16_t *)v_cache, table,
                    token_pos, t0, nt, kvh, group, head_dim, block_size, row_elems, scale, window, has_soft_cap,
                    soft_cap, (uint16_t *)out, out_stride);
            continue;
        }
#endif
        v16f qv[QW_MAX_ROWS + 1][QW_MAX_D / 16];  // row QW_MAX_ROWS: zeros, the padding row
        v16f acc[QW_MAX_ROWS + 1][QW_MAX_D / 16];  // row QW_MAX_ROWS: the padding row's
        float m[QW_MAX_ROWS], l[QW_MAX_ROWS];
        int64_t first_key[QW_MAX_ROWS];
        v16f kf[QW_KT][QW_MAX_D / 16];  // the tile's keys in fp32, converted once per tile
        v16f vt[QW_KT][QW_MAX_D / 16];  // the tile's values in fp32, converted once per tile
        for (int64_t c = 0; c < dv; c++) qv[QW_MAX_ROWS][c] = splat16(0.0f);
        for (int64_t i = 0; i < nt; i++) {
            const int64_t pos = token_pos[t0 + i];
            first_key[i] = window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
            for (int64_t g = 0; g < group; g++) {
                const int64_t r = i * group + g, h = kvh * group + g;
                const char *qh = (const char *)q + ((t0 + i) * q_stride + h * head_dim) * elem;
                for (int64_t c = 0; c < dv; c++) qv[r][c] = load16(qh + c * 16 * elem, is_bf16);
                for (int64_t c = 0; c < dv; c++) acc[r][c] = splat16(0.0f);
                m[r] = -INFINITY;
                l[r] = 0.0f;
            }
        }
        const int64_t last_pos = token_pos[t0 + nt - 1];
        const int64_t lowest = first_key[0];  // positions rise along the run, so do window starts
        for (int64_t tile0 = lowest / QW_KT * QW_KT; tile0 <= last_pos; tile0 += QW_KT) {
            // Keys of this tile any token of the run may read: [lowest, last_pos] within the tile.
            const int64_t any_lo = lowest > tile0 ? lowest - tile0 : 0;
            const int64_t any_hi = last_pos - tile0 + 1 < QW_KT ? last_pos - tile0 + 1 : QW_KT;
            for (int64_t j = 0; j < QW_KT; j++) {
                if (j < any_lo || j >= any_hi) {
                    for (int64_t c = 0; c < dv; c++) kf[j][c] = vt[j][c] = splat16(0.0f);
                    continue;
                }
                const int64_t p = tile0 + j;
                const int64_t slot = (int64_t)table[p / block_size] * block_size + p % block_size;
                const char *krow = (const char *)k_cache + (slot * row_elems + kvh * head_dim) * elem;
                for (int64_t c = 0; c < dv; c++) kf[j][c] = load16(krow + c * 16 * elem, is_bf16);
                const char *vrow = (const char *)v_cache + (slot * row_elems + kvh * head_dim) * elem;
                for (int64_t c = 0; c < dv; c++) vt[j][c] = load16(vrow + c * 16 * elem, is_bf16);
            }
            // The rows that read this tile, then their scores four rows at a time (four
            // independent FMA chains; a missing fourth row is the zero row QW_MAX_ROWS), one
            // code path for every row, so a row's score never depends on its neighbours.
            int64_t active[QW_MAX_ROWS + 3];
            int64_t num_active = 0;
            for (int64_t i = 0; i < nt; i++) {
                const int64_t pos = token_pos[t0 + i], start = first_key[i];
                if (tile0 > pos || tile0 + QW_KT <= start) continue;  // not one of this token's tiles
                for (int64_t g = 0; g < group; g++) active[num_active++] = i * group + g;
            }
            for (int64_t a = num_active; a < num_active + 3; a++) active[a] = QW_MAX_ROWS;
            for (int64_t a = 0; a < num_active; a += 4) {
                // Score of key j: the 16-lane products of the head_dim / 16 chunks added in chunk
                // order, then hsum16's fixed halving. One key row feeds four query rows.
                v16f s4[4];
                const v16f *q0 = qv[active[a]], *q1 = qv[active[a + 1]], *q2 = qv[active[a + 2]],
                           *q3 = qv[active[a + 3]];
                for (int64_t j = 0; j < QW_KT; j++) {
                    v16f t0 = q0[0] * kf[j][0], t1 = q1[0] * kf[j][0], t2 = q2[0] * kf[j][0],
                         t3 = q3[0] * kf[j][0];
                    for (int64_t c = 1; c < dv; c++) {
                        t0 = t0 + q0[c] * kf[j][c];
                        t1 = t1 + q1[c] * kf[j][c];
                        t2 = t2 + q2[c] * kf[j][c];
                        t3 = t3 + q3[c] * kf[j][c];
                    }
                    s4[0][j] = hsum16(t0);
                    s4[1][j] = hsum16(t1);
                    s4[2][j] = hsum16(t2);
                    s4[3][j] = hsum16(t3);
                }
                // Softmax update per row; the padding row's weights are 0 and its accumulator
                // (row QW_MAX_ROWS) is never read.
                v16f p4[4];
                for (int u = 0; u < 4; u++) {
                    const int64_t r = active[a + u];
                    if (r == QW_MAX_ROWS) {
                        p4[u] = splat16(0.0f);
                        continue;
                    }
                    const int64_t i = r / group;
                    const int64_t pos = token_pos[t0 + i], start = first_key[i];
                    const int64_t lo = start > tile0 ? start - tile0 : 0;                  // first valid lane
                    const int64_t hi = pos - tile0 + 1 < QW_KT ? pos - tile0 + 1 : QW_KT;  // one past the last
                    v16i valid;
                    for (int j = 0; j < QW_KT; j++) valid[j] = (j >= lo && j < hi) ? -1 : 0;
                    v16f sc = s4[u] * splat16(scale);
                    if (has_soft_cap) sc = vsoft_cap16(sc, soft_cap);
                    sc = (v16f)(((v16i)sc & valid) | ((v16i)splat16(-INFINITY) & ~valid));
                    const float tile_max = hmax16(sc);
                    const float m_new = m[r] > tile_max ? m[r] : tile_max;
                    const float alpha = expf(m[r] - m_new);  // 0 at the first tile (m = -inf)
                    p4[u] = vexp_nonpos16(sc - splat16(m_new));  // exactly 0 on invalid lanes
                    l[r] = l[r] * alpha + hsum16(p4[u]);
                    const v16f va = splat16(alpha);
                    for (int64_t c = 0; c < dv; c++) acc[r][c] = acc[r][c] * va;
                    m[r] = m_new;
                }
                // P.V over all 16 keys in position order, four rows at once. An invalid lane adds
                // p * v = 0 exactly to an accumulator that is never -0, so it changes no bit:
                // a row's sum is the same whatever rows share its group.
                const int64_t r0 = active[a], r1 = active[a + 1], r2 = active[a + 2], r3 = active[a + 3];
                for (int64_t j = 0; j < QW_KT; j++) {
                    const v16f w0 = splat16(p4[0][j]), w1 = splat16(p4[1][j]), w2 = splat16(p4[2][j]),
                               w3 = splat16(p4[3][j]);
                    for (int64_t c = 0; c < dv; c++) {
                        const v16f vj = vt[j][c];
                        acc[r0][c] = acc[r0][c] + w0 * vj;
                        acc[r1][c] = acc[r1][c] + w1 * vj;
                        acc[r2][c] = acc[r2][c] + w2 * vj;
                        acc[r3][c] = acc[r3][c] + w3 * vj;
                    }
                }
            }
        }
        for (int64_t i = 0; i < nt; i++) {
            for (int64_t g = 0; g < group; g++) {
                const int64_t r = i * group + g, h = kvh * group + g;
                char *oh = (char *)out + ((t0 + i) * out_stride + h * head_dim) * elem;
                const v16f inv = splat16(1.0f / l[r]);
                for (int64_t c = 0; c < dv; c++) {
                    const v16f o = acc[r][c] * inv;
                    for (int k = 0; k < 16; k++) {
                        if (is_bf16) {
                            ((uint16_t *)oh)[c * 16 + k] = f32_to_bf16(o[k]);
                        } else {
                            ((float *)oh)[c * 16 + k] = o[k];
                        }
                    }
                }
            }
        }
    }
#if defined(QW_HAVE_AMX)
        if (use_amx) _tile_release();
        free(scratch);
        free(heads);
#endif
    }
    free(run_start);
    return failed ? 4 : 0;
}
