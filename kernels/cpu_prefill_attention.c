// Paged prefill attention for the CPU: causal attention of each prefill chunk's queries over its
// sequence's whole context, K/V read through the block table (the chunk's own K/V are already
// written there), online softmax, fp32 accumulation. One call serves every prefill chunk of a step.
//
// Built at first use by cpu_prefill_attention.py with `gcc -O3 -march=native -fopenmp` and called
// through ctypes. Vector code uses GCC vector extensions at 16 floats (one AVX-512 register; GCC
// splits it in two on AVX2), not intrinsics, so one source builds for any x86-64 target.
//
// Layouts (all contiguous, element offsets):
//   q, out:          [num_tokens, num_heads, head_dim]; sequence s owns rows query_start[s] ..
//                    query_start[s + 1] - 1, the last positions of its context
//   k, v:            [num_blocks, block_size, num_kv_heads, head_dim]
//   block_tables:    [num_seqs, max_blocks] int32
//   seq_lens:        [num_seqs] int32, context length including the chunk
//   query_start:     [num_seqs + 1] int32
//
// Two phases per call. First each sequence's K is copied for each KV head into fp32 and transposed
// ([D, L]) and V into fp32 ([L, D]), once, shared by every query head of the group and every query
// tile. Then work units, (sequence, query head, tile of QT queries), longest context first, are
// claimed by the threads. A unit walks the keys its tile may see in blocks of KB: scores of QT
// queries x KB keys from the transposed K (each K value loaded feeds 4 query rows), the causal mask
// on blocks that cross the diagonal, the online-softmax update, then P.V into the QT x D
// accumulators (each V value loaded feeds 4 rows).
//
// bf16 on a CPU with AMX (built with -march=native where the compiler defines __AMX_BF16__ and
// __AMX_TILE__, head_dim a multiple of 32, and the process granted the tile state: cpu_amx.h) takes
// a third path, run_unit_amx: both products by TDPBF16PS on 16 x 16 fp32 tiles, computed transposed
// (S^T = K Q^T, O^T += V^T P^T) so that the online softmax in AVX-512 runs down columns, one vector
// per key for the tile's 16 queries. Refused the tile state, it takes the VDPBF16PS path (or the
// fp32 one). On the 2-core AMX Xeon, same shapes, 2048 query tokens a call in prompts of 32-512
// (scripts/bench_cpu_prefill_attention.py, median calls, machine shared with other work): one
// thread 76-371 GFLOP/s against 19-80 for the VDPBF16PS path in the same run (3.9-4.9x), two
// threads 88-591 against 31-144 (2.8-4.1x); short prompts gain least (a tile's one key block).
//
// Measured on the 2-core AVX-512-BF16 EPYC (Zen 4), SmolLM2 shapes (9 heads, 3 KV heads, head_dim
// 64), bf16, one thread, prompts of 280-500 tokens: 82-99 GFLOP/s with the VDPBF16PS path against
// 30-47 for torch's SDPA flash kernel a sequence at a time (with its gather), in the same run; the
// fp32 path is 1.5-1.8x slower than the VDPBF16PS one.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_simd.h"

// bf16 with AVX512-BF16 (built with -march=native on such a CPU): both products by VDPBF16PS, 32
// bf16 pairs multiplied and added into 16 fp32 lanes per instruction, half the instructions of the
// fp32 path. K^T and V are kept in bf16, in pair layouts; the probabilities are rounded to bf16
// before P.V, as torch's flash attention does for bf16 inputs.
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_DP 1
#else
#define HAVE_DP 0
#endif

#include "cpu_amx.h"
#if defined(QW_HAVE_AMX)
#define HAVE_AMX 1
#else
#define HAVE_AMX 0
#endif


#define QT 16  // queries per tile
#define KB 64  // keys per block (four vectors)
#define MAX_HEAD_DIM 256

enum {
    QW_OK = 0,
    QW_BAD_SEQ_LEN = 1,
    QW_BAD_BLOCK_ID = 2,
    QW_BAD_SHAPE = 3,
    QW_NO_MEMORY = 4,
};

typedef struct {
    const void *q, *k, *v;
    const int32_t *block_tables, *seq_lens, *query_start;
    void *out;
    int64_t num_heads, num_kv_heads, head_dim, block_size, max_blocks, num_blocks;
    float scale;
    int is_bf16;
    int use_dp;      // the VDPBF16PS path: bf16, HAVE_DP and head_dim a multiple of 32
    int64_t window;  // the query at position i sees keys i - window + 1 .. i
    int has_soft_cap;
    float soft_cap;  // scores s become tanh(s / soft_cap) * soft_cap before the softmax
    int use_amx;     // the AMX path: bf16, HAVE_AMX, head_dim a multiple of 32, tiles granted
} Params;

// First key the query at position `pos` sees.
static inline int64_t first_key(const Params *p, int64_t pos) { return pos >= p->window ? pos - p->window + 1 : 0; }

typedef struct {
    int32_t seq, head, first;  // the tile's first query, within the sequence's chunk
    int32_t cost;              // keys it sees: the sort key
} Unit;

// Per sequence: its K^T and V for every KV head (Lp: the context rounded up to KB keys, Dp:
// head_dim rounded up to 64; the padding is zero). fp32 path: kt [KVH, D, Lp], v [KVH, Lp, Dp].
// VDPBF16PS path, bf16 pairs in the same memory: kt [KVH, D / 2, Lp, 2] (two dims of one key side
// by side) and v [KVH, Lp / 2, D, 2] (one dim of two keys side by side). AMX path, bf16: kt holds
// K itself, [KVH, Lp, D] (its A tiles of 16 keys x 32 dims are rows D * 2 bytes apart), and v holds
// V^T as contiguous 1 KiB A tiles of 16 dims x 32 keys, [KVH, Lp / 32, D / 16, 16, 32].
typedef struct {
    float *kt;
    float *v;
    int64_t padded_len;
} SeqKV;

static inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

#if HAVE_AMX
// convert_kv for the AMX path (layouts: see SeqKV). K rows are copied as they are; V^T takes two
// keys at a time where it can (an even key and the next, both in [t0, t1): pieces may start at an
// odd key, and a pair is one 32-bit store, so no two threads write the same pair), as 32-bit
// scatters of their interleaved dims.
static int convert_kv_amx(const Params *p, int64_t s, const SeqKV *kv, int64_t t0, int64_t t1) {
    const int64_t KV = p->num_kv_heads, D = p->head_dim, BS = p->block_size, Lp = kv->padded_len;
    const int32_t *table = p->block_tables + s * p->max_blocks;
    // unpacklo/hi_epi16 of two keys' dims d0 .. d0 + 31 hold, in 128-bit lane i, the pairs of dims
    // d0 + 8i + 0..3 (lo) and d0 + 8i + 4..7 (hi); dim x of a V^T tile row is 32-bit pair
    // (x / 16) * 256 + (x % 16) * 16 from the tile column.
    int32_t lo_i[16], hi_i[16];
    for (int j = 0; j < 16; j++) {
        const int x = 8 * (j / 4) + j % 4;
        lo_i[j] = (x / 16) * 256 + (x % 16) * 16;
        hi_i[j] = ((x + 4) / 16) * 256 + ((x + 4) % 16) * 16;
    }
    const __m512i lo_index = _mm512_loadu_si512(lo_i), hi_index = _mm512_loadu_si512(hi_i);
    for (int64_t t = t0; t < t1; t++) {
        const int64_t block = table[t / BS];
        if (block < 0 || block >= p->num_blocks) return QW_BAD_BLOCK_ID;
        const int64_t base = (block * BS + t % BS) * KV * D;
        const int pair = t % 2 == 0 && t + 1 < t1;
        int64_t base1 = 0;
        if (pair) {
            const int64_t block1 = table[(t + 1) / BS];
            if (block1 < 0 || block1 >= p->num_blocks) return QW_BAD_BLOCK_ID;
            base1 = (block1 * BS + (t + 1) % BS) * KV * D;
        }
        for (int64_t h = 0; h < KV; h++) {
            const uint16_t *k0 = (const uint16_t *)p->k + base + h * D, *v0 = (const uint16_t *)p->v + base + h * D;
            uint16_t *kt = (uint16_t *)kv->kt + h * D * Lp + t * D;
            uint16_t *vt = (uint16_t *)kv->v + h * D * Lp + (t / 32) * (D / 16) * 512 + t % 32;
            memcpy(kt, k0, (size_t)D * sizeof(uint16_t));
            if (!pair) {  // dim d of key t: V^T tile (t / 32, d / 16), row d % 16, column t % 32
                for (int64_t d = 0; d < D; d++) vt[(d / 16) * 512 + (d % 16) * 32] = v0[d];
                continue;
            }
            const uint16_t *k1 = (const uint16_t *)p->k + base1 + h * D, *v1 = (const uint16_t *)p->v + base1 + h * D;
            memcpy(kt + D, k1, (size_t)D * sizeof(uint16_t));
            for (int64_t d0 = 0; d0 < D; d0 += 32) {
                const __m512i a = _mm512_loadu_si512(v0 + d0), b = _mm512_loadu_si512(v1 + d0);
                void *dst = vt + (d0 / 16) * 512;  // t even: 4-byte aligned
                _mm512_i32scatter_epi32(dst, lo_index, _mm512_unpacklo_epi16(a, b), 4);
                _mm512_i32scatter_epi32(dst, hi_index, _mm512_unpackhi_epi16(a, b), 4);
            }
        }
        t += pair;
    }
    return QW_OK;
}
#endif

// Copies tokens [t0, t1) of sequence s into its fp32 K^T and V; 0, or QW_BAD_BLOCK_ID.
static int convert_kv(const Params *p, int64_t s, const SeqKV *kv, int64_t Dp, int64_t t0, int64_t t1) {
    const int64_t KV = p->num_kv_heads, D = p->head_dim, BS = p->block_size, Lp = kv->padded_len;
    const int32_t *table = p->block_tables + s * p->max_blocks;
#if HAVE_AMX
    if (p->use_amx) return convert_kv_amx(p, s, kv, t0, t1);
#endif
    for (int64_t t = t0; t < t1; t++) {
        const int64_t block = table[t / BS];
        if (block < 0 || block >= p->num_blocks) return QW_BAD_BLOCK_ID;
        const int64_t base = ((block * BS + t % BS) * KV) * D;
        for (int64_t h = 0; h < KV; h++) {
            if (p->use_dp) {
                const uint16_t *kr = (const uint16_t *)p->k + base + h * D, *vs = (const uint16_t *)p->v + base + h * D;
                uint16_t *kt2 = (uint16_t *)kv->kt + h * D * Lp + 2 * t;
                uint16_t *v2 = (uint16_t *)kv->v + h * Lp * D + (t / 2) * 2 * D + t % 2;
                for (int64_t d = 0; d < D; d++) {
                    kt2[(d / 2) * 2 * Lp + d % 2] = kr[d];
                    v2[2 * d] = vs[d];
                }
                continue;
            }
            float *kt = kv->kt + h * D * Lp + t, *vr = kv->v + (h * Lp + t) * Dp;
            if (p->is_bf16) {
                const uint16_t *kr = (const uint16_t *)p->k + base + h * D, *vs = (const uint16_t *)p->v + base + h * D;
                for (int64_t d = 0; d < D; d++) {
                    kt[d * Lp] = bf16_to_f32(kr[d]);
                    vr[d] = bf16_to_f32(vs[d]);
                }
            } else {
                const float *kr = (const float *)p->k + base + h * D, *vs = (const float *)p->v + base + h * D;
                for (int64_t d = 0; d < D; d++) kt[d * Lp] = kr[d];
                memcpy(vr, vs, (size_t)D * sizeof(float));
            }
        }
    }
    return QW_OK;
}

// Scores of 4 query rows (q: [4, D] scaled, rows q_stride apart) against keys [j0, j0 + KB) of kt
// ([D, Lp]): 16 accumulators, each K vector loaded feeds 4 rows.
static inline void scores4(const float *q, int64_t q_stride, const float *kt, int64_t Lp, int64_t j0, int64_t D,
                           float *s) {
    v16f acc[4][KB / 16];
    for (int r = 0; r < 4; r++)
        for (int x = 0; x < KB / 16; x++) acc[r][x] = splat16(0);
    for (int64_t d = 0; d < D; d++) {
        const float *row = kt + d * Lp + j0;
        v16f k[KB / 16];
        for (int x = 0; x < KB / 16; x++) k[x] = loadu16(row + 16 * x);
        for (int r = 0; r < 4; r++) {
            const v16f qr = splat16(q[r * q_stride + d]);
            for (int x = 0; x < KB / 16; x++) acc[r][x] += qr * k[x];
        }
    }
    for (int r = 0; r < 4; r++)
        for (int x = 0; x < KB / 16; x++) storeu16(s + r * KB + 16 * x, acc[r][x]);
}

// acc[4, D] = acc * alpha[r] + p[4, KB] . v[j0 .. j0 + kb, D], 64 columns at a time (D: a multiple
// of 64, the row stride of acc and v).
static inline void pv4(float *acc, const float *alpha, const float *p, const float *v, int64_t j0, int64_t kb,
                       int64_t D) {
    for (int64_t c = 0; c < D; c += 64) {
        v16f o[4][4];
        for (int r = 0; r < 4; r++)
            for (int x = 0; x < 4; x++) o[r][x] = loadu16(acc + r * D + c + 16 * x) * splat16(alpha[r]);
        for (int64_t j = 0; j < kb; j++) {
            const float *vr = v + (j0 + j) * D + c;
            const v16f v0 = loadu16(vr), v1 = loadu16(vr + 16), v2 = loadu16(vr + 32), v3 = loadu16(vr + 48);
            for (int r = 0; r < 4; r++) {
                const v16f w = splat16(p[r * KB + j]);
                o[r][0] += w * v0;
                o[r][1] += w * v1;
                o[r][2] += w * v2;
                o[r][3] += w * v3;
            }
        }
        for (int r = 0; r < 4; r++)
            for (int x = 0; x < 4; x++) storeu16(acc + r * D + c + 16 * x, o[r][x]);
    }
}

#if HAVE_DP
// scores4 with VDPBF16PS: q [4, D / 2] bf16 pairs (rows q_stride pairs apart), kt2 [D / 2, Lp, 2].
static inline void scores4_dp(const uint32_t *q, int64_t q_stride, const uint16_t *kt2, int64_t Lp, int64_t j0,
                              int64_t D, float scale, float *s) {
    __m512 acc[4][KB / 16];
    for (int r = 0; r < 4; r++)
        for (int x = 0; x < KB / 16; x++) acc[r][x] = _mm512_setzero_ps();
    for (int64_t dp = 0; dp < D / 2; dp++) {
        const uint16_t *row = kt2 + (dp * Lp + j0) * 2;
        __m512bh k[KB / 16];
        for (int x = 0; x < KB / 16; x++) k[x] = (__m512bh)_mm512_loadu_si512(row + 32 * x);
        for (int r = 0; r < 4; r++) {
            const __m512bh qr = (__m512bh)_mm512_set1_epi32((int)q[r * q_stride + dp]);
            for (int x = 0; x < KB / 16; x++) acc[r][x] = _mm512_dpbf16_ps(acc[r][x], k[x], qr);
        }
    }
    const __m512 sc = _mm512_set1_ps(scale);
    for (int r = 0; r < 4; r++)
        for (int x = 0; x < KB / 16; x++) _mm512_storeu_ps(s + r * KB + 16 * x, _mm512_mul_ps(acc[r][x], sc));
}

// pv4 with VDPBF16PS: p [4, KB] bf16 probabilities, v2 [Lp / 2, D, 2]; acc [4, D] (D: a multiple of
// 64, also the row stride of acc).
static inline void pv4_dp(float *acc, const float *alpha, const uint16_t *p, const uint16_t *v2, int64_t j0,
                          int64_t kb, int64_t D) {
    for (int64_t c = 0; c < D; c += 64) {
        __m512 o[4][4];
        for (int r = 0; r < 4; r++)
            for (int x = 0; x < 4; x++)
                o[r][x] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + c + 16 * x), _mm512_set1_ps(alpha[r]));
        for (int64_t j = 0; j < kb; j += 2) {
            const uint16_t *vr = v2 + ((j0 + j) / 2 * D + c) * 2;
            __m512bh vv[4];
            for (int x = 0; x < 4; x++) vv[x] = (__m512bh)_mm512_loadu_si512(vr + 32 * x);
            for (int r = 0; r < 4; r++) {
                uint32_t pair;
                memcpy(&pair, p + r * KB + j, sizeof pair);
                const __m512bh w = (__m512bh)_mm512_set1_epi32((int)pair);
                for (int x = 0; x < 4; x++) o[r][x] = _mm512_dpbf16_ps(o[r][x], vv[x], w);
            }
        }
        for (int r = 0; r < 4; r++)
            for (int x = 0; x < 4; x++) _mm512_storeu_ps(acc + r * D + c + 16 * x, o[r][x]);
    }
}
#endif

// Per-thread working memory (D a multiple of 64 after padding: see head_dim_padded).
typedef struct {
    float *q, *acc;   // [QT, Dp]
    float *s;         // [QT, KB] scores, then probabilities
    uint16_t *pbf;    // [QT, KB] the probabilities in bf16 (VDPBF16PS path)
    float m[QT], l[QT], alpha[QT];
} Scratch;

static void run_unit(const Params *p, const Unit *u, const SeqKV *kv, int64_t Dp, Scratch *w) {
    const int64_t H = p->num_heads, D = p->head_dim, G = H / p->num_kv_heads;
    const int64_t s = u->seq, h = u->head, kvh = h / G;
    const int64_t n = p->query_start[s + 1] - p->query_start[s], L = p->seq_lens[s];
    const int64_t first = u->first, rows = n - first < QT ? n - first : QT;
    const int64_t Lp = kv->padded_len;
    // Element offsets of this KV head's K^T and V (bf16 pairs on the VDPBF16PS path, where Dp = D).
    const float *kt = p->use_dp ? (const float *)((const uint16_t *)kv->kt + kvh * D * Lp) : kv->kt + kvh * D * Lp;
    const float *vf = p->use_dp ? (const float *)((const uint16_t *)kv->v + kvh * Lp * D) : kv->v + kvh * Lp * Dp;
    // Rows past the chunk's end repeat its last query: computed and never stored.
    for (int64_t r = 0; r < QT; r++) {
        const int64_t i = first + (r < rows ? r : rows - 1);
        const int64_t off = ((p->query_start[s] + i) * H + h) * D;
        if (p->use_dp)  // q as bf16 pairs [QT, Dp / 2], scaled after the products
            memcpy((uint32_t *)w->q + r * (Dp / 2), (const uint16_t *)p->q + off, (size_t)D * sizeof(uint16_t));
        for (int64_t d = 0; d < D && !p->use_dp; d++) {
            const float x = p->is_bf16 ? bf16_to_f32(((const uint16_t *)p->q)[off + d]) : ((const float *)p->q)[off + d];
            w->q[r * Dp + d] = x * p->scale;
        }
        for (int64_t d = D; d < Dp && !p->use_dp; d++) w->q[r * Dp + d] = 0.0f;
        memset(w->acc + r * Dp, 0, (size_t)Dp * sizeof(float));
        w->m[r] = -INFINITY;
        w->l[r] = 0.0f;
    }
    // Query i (within the chunk) is at position L - n + i and sees keys first_key(L - n + i) ..
    // L - n + i. Key blocks before the tile's first row's window are skipped.
    const int64_t pos0 = L - n + first, key_end = pos0 + rows;
    for (int64_t j0 = first_key(p, pos0) / KB * KB; j0 < key_end; j0 += KB) {
        const int64_t kb = key_end - j0 < KB ? key_end - j0 : KB;
#if HAVE_DP
        if (p->use_dp)
            for (int64_t r = 0; r < QT; r += 4)
                scores4_dp((const uint32_t *)w->q + r * (Dp / 2), Dp / 2, (const uint16_t *)kt, Lp, j0, D, p->scale,
                           w->s + r * KB);
        else
#endif
            for (int64_t r = 0; r < QT; r += 4) scores4(w->q + r * Dp, Dp, kt, Lp, j0, D, w->s + r * KB);
        for (int64_t r = 0; r < QT; r++) {
            float *sr = w->s + r * KB;
            const int64_t pos = pos0 + (r < rows ? r : rows - 1);
            if (p->has_soft_cap)  // the whole block: keys past kb are masked below
                for (int c = 0; c < KB; c += 16) storeu16(sr + c, vsoft_cap16(loadu16(sr + c), p->soft_cap));
            // Keys past the query's position (and past the block's end), and keys before its
            // window, are masked.
            const int64_t visible = pos - j0 + 1 < kb ? pos - j0 + 1 : kb;
            for (int64_t c = visible < 0 ? 0 : visible; c < KB; c++) sr[c] = -INFINITY;
            for (int64_t c = 0; c < first_key(p, pos) - j0 && c < KB; c++) sr[c] = -INFINITY;
            v16f x[KB / 16], mx = loadu16(sr);
            for (int c = 0; c < KB / 16; c++) {
                x[c] = loadu16(sr + 16 * c);
                mx = vmax16(mx, x[c]);
            }
            const float block_max = hmax16(mx);
            const float m_new = block_max > w->m[r] ? block_max : w->m[r];
            if (m_new == -INFINITY) {  // nothing visible yet: the block is before this row's window
                w->alpha[r] = 1.0f;
                memset(sr, 0, KB * sizeof(float));
                memset(w->pbf + r * KB, 0, KB * sizeof(uint16_t));
                continue;
            }
            v16f sum = splat16(0);
            for (int c = 0; c < KB / 16; c++) {
                const v16f pc = vexp_nonpos16(x[c] - splat16(m_new));
                sum += pc;
                storeu16(sr + 16 * c, pc);
#if HAVE_DP
                if (p->use_dp) {
                    __m512 pv;
                    memcpy(&pv, &pc, sizeof pv);
                    _mm256_storeu_si256((__m256i *)(w->pbf + r * KB + 16 * c), (__m256i)_mm512_cvtneps_pbh(pv));
                }
#endif
            }
            w->alpha[r] = w->m[r] == -INFINITY ? 0.0f : expf(w->m[r] - m_new);
            w->l[r] = w->l[r] * w->alpha[r] + hsum16(sum);
            w->m[r] = m_new;
        }
#if HAVE_DP
        if (p->use_dp)
            for (int64_t r = 0; r < QT; r += 4)
                pv4_dp(w->acc + r * Dp, w->alpha + r, w->pbf + r * KB, (const uint16_t *)vf, j0, kb, Dp);
        else
#endif
            for (int64_t r = 0; r < QT; r += 4) pv4(w->acc + r * Dp, w->alpha + r, w->s + r * KB, vf, j0, kb, Dp);
    }
    for (int64_t r = 0; r < rows; r++) {
        const int64_t off = ((p->query_start[s] + first + r) * H + h) * D;
        const float inv = 1.0f / w->l[r];
        const float *a = w->acc + r * Dp;
        if (p->is_bf16) {
            uint16_t *o = (uint16_t *)p->out + off;
            for (int64_t d = 0; d < D; d++) o[d] = f32_to_bf16(a[d] * inv);
        } else {
            float *o = (float *)p->out + off;
            for (int64_t d = 0; d < D; d++) o[d] = a[d] * inv;
        }
    }
}

#if HAVE_AMX
// 2^x for x <= 0, 16 lanes: 2^n * 2^f with n = round(x), |f| <= 1/2, 2^f by its Taylor polynomial
// to degree 6 (relative error about 1.2e-7, near fp32's own rounding). x is clamped at -126 (the
// result stays normal, about 1.2e-38: no denormals in the sums); masked lanes are zeroed apart.
static inline __m512 exp2_nonpos(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 y = _mm512_set1_ps(1.5403530393e-4f);
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.3333558146e-3f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(9.6181291076e-3f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(5.5504108665e-2f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.4022650696e-1f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.9314718056e-1f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(y, n);
}

// 16 x 16 transpose of 32-bit lanes in registers (row i in, column i out): unpacks of pairs, then
// of 64-bit halves, then two rounds of 128-bit lane shuffles. Moves bits only (bf16 pairs too).
static inline void transpose16_ps(__m512 r[16]) {
    __m512 t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        u[4 * i] = (__m512)_mm512_unpacklo_pd((__m512d)t[4 * i], (__m512d)t[4 * i + 2]);
        u[4 * i + 1] = (__m512)_mm512_unpackhi_pd((__m512d)t[4 * i], (__m512d)t[4 * i + 2]);
        u[4 * i + 2] = (__m512)_mm512_unpacklo_pd((__m512d)t[4 * i + 1], (__m512d)t[4 * i + 3]);
        u[4 * i + 3] = (__m512)_mm512_unpackhi_pd((__m512d)t[4 * i + 1], (__m512d)t[4 * i + 3]);
    }
    for (int j = 0; j < 4; j++) {
        t[j] = _mm512_shuffle_f32x4(u[j], u[4 + j], 0x88);
        t[4 + j] = _mm512_shuffle_f32x4(u[j], u[4 + j], 0xdd);
        t[8 + j] = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0x88);
        t[12 + j] = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0xdd);
    }
    for (int j = 0; j < 4; j++) {
        r[j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88);
        r[8 + j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0xdd);
        r[4 + j] = _mm512_shuffle_f32x4(t[4 + j], t[12 + j], 0x88);
        r[12 + j] = _mm512_shuffle_f32x4(t[4 + j], t[12 + j], 0xdd);
    }
}
// run_unit with TDPBF16PS, transposed so that the softmax runs down columns: one vector holds one
// key's scores for the tile's 16 queries, and the row maxima and sums are plain vector max and add,
// no horizontal reductions and no per-row scalar work. S^T [KB keys, QT] = K Q^T (A: 16 keys x 32
// dims of K, row-major; B: Q^T in pairs), O^T [D, QT] += V^T P^T (A: 16 dims x 32 keys of V^T; B:
// P^T in pairs). The calling thread has loaded a configuration of every tile as 16 rows x 64 bytes.
// Tiles: 0-3 accumulators (S^T of four 16-key sub-blocks, then O^T), 4-5 A tiles, 6-7 B tiles.
// Scratch: w->q holds Q^T [D / 2, QT, 2] bf16, w->acc O^T [D / 16, 16, QT] fp32, w->s S^T [KB, QT],
// w->pbf P^T [KB / 2, QT, 2] bf16.
static void run_unit_amx(const Params *p, const Unit *u, const SeqKV *kv, Scratch *w) {
    const int64_t H = p->num_heads, D = p->head_dim, G = H / p->num_kv_heads;
    const int64_t s = u->seq, h = u->head, kvh = h / G;
    const int64_t n = p->query_start[s + 1] - p->query_start[s], L = p->seq_lens[s];
    const int64_t first = u->first, rows = n - first < QT ? n - first : QT;
    const int64_t Lp = kv->padded_len, DC = D / 32, DV = D / 16;  // 32-dim K chunks, 16-dim V chunks
    const uint16_t *kt = (const uint16_t *)kv->kt + kvh * D * Lp, *vt = (const uint16_t *)kv->v + kvh * D * Lp;
    uint32_t *qt = (uint32_t *)w->q;
    const int64_t pos0 = L - n + first, key_end = pos0 + rows;
    // Rows past the chunk's end repeat its last query: computed and never stored. Q^T by 16 x 16
    // transposes of bf16 pairs: row d2 of Q^T is pair d2 of each query.
    int32_t pos_r[QT];
    const uint16_t *q0 = (const uint16_t *)p->q + ((p->query_start[s] + first) * H + h) * D;
    for (int64_t r = 0; r < QT; r++) pos_r[r] = (int32_t)(pos0 + (r < rows ? r : rows - 1));
    for (int64_t c = 0; c < DC; c++) {
        __m512 x[16];
        for (int64_t r = 0; r < QT; r++) x[r] = _mm512_loadu_ps(q0 + (r < rows ? r : rows - 1) * H * D + 32 * c);
        transpose16_ps(x);
        for (int j = 0; j < 16; j++) _mm512_storeu_ps(qt + (16 * c + j) * QT, x[j]);
    }
    memset(w->acc, 0, (size_t)(D * QT) * sizeof(float));
    const __m512i pos = _mm512_loadu_si512(pos_r);
    // The window as a bound on (query position - key position); a causal window fits int32 (the
    // context does).
    const __m512i window = _mm512_set1_epi32((int32_t)(p->window < INT32_MAX ? p->window : INT32_MAX));
    const __m512 minus_inf = _mm512_set1_ps(-INFINITY), log2e = _mm512_set1_ps(1.44269504088896341f);
    // Scores in the log2 domain: t = s * scale * log2(e) (after the cap, where there is one), so the
    // probabilities are 2^(t - m).
    const __m512 to_t = _mm512_set1_ps(p->has_soft_cap ? p->scale : p->scale * 1.44269504088896341f);
    // interleave[2q] = q, interleave[2q + 1] = 16 + q: pairs two keys' bf16 for one query.
    int16_t il[32];
    for (int q2 = 0; q2 < 16; q2++) {
        il[2 * q2] = (int16_t)q2;
        il[2 * q2 + 1] = (int16_t)(16 + q2);
    }
    const __m512i interleave = _mm512_loadu_si512(il);
    __m512 m = minus_inf, l = _mm512_setzero_ps();
    const int64_t last_first_key = first_key(p, pos0 + rows - 1);
    for (int64_t j0 = first_key(p, pos0) / KB * KB; j0 < key_end; j0 += KB) {
        const int64_t kb = key_end - j0 < KB ? key_end - j0 : KB;
        const int64_t subs = (kb + 15) / 16, keys = (kb + 31) / 32 * 32;  // sub-blocks; keys in P^T
        // S^T [KB, QT] = K Q^T, one 16 x 16 tile per 16 keys, 32 dims per product.
        const uint16_t *kblock = kt + j0 * D;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t c = 0; c < DC; c++) {
            _tile_loadd(6, qt + c * 16 * QT, 64);
            _tile_loadd(4, kblock + 32 * c, D * 2);
            _tile_dpbf16ps(0, 4, 6);
            if (subs > 1) {
                _tile_loadd(5, kblock + 16 * D + 32 * c, D * 2);
                _tile_dpbf16ps(1, 5, 6);
            }
            if (subs > 2) {
                _tile_loadd(4, kblock + 32 * D + 32 * c, D * 2);
                _tile_dpbf16ps(2, 4, 6);
            }
            if (subs > 3) {
                _tile_loadd(5, kblock + 48 * D + 32 * c, D * 2);
                _tile_dpbf16ps(3, 5, 6);
            }
        }
        float *st = w->s;
        _tile_stored(0, st, 64);
        if (subs > 1) _tile_stored(1, st + 256, 64);
        if (subs > 2) _tile_stored(2, st + 512, 64);
        if (subs > 3) _tile_stored(3, st + 768, 64);
        // Masks only where some query misses some key of the block: the diagonal, a window's edge,
        // keys past kb (S^T rows there are stale: the mask replaces them, and zeroes their P).
        const int masked = kb < KB || j0 + KB - 1 > pos0 || last_first_key > j0;
        __mmask16 vis[KB];
        __m512 mx = minus_inf;
        for (int64_t k = 0; k < keys; k++) {
            __m512 t = _mm512_loadu_ps(st + 16 * k);
            if (p->has_soft_cap)
                t = _mm512_mul_ps((__m512)vsoft_cap16((v16f)_mm512_mul_ps(t, to_t), p->soft_cap), log2e);
            else
                t = _mm512_mul_ps(t, to_t);
            if (masked) {  // query r sees key j iff j <= pos_r and pos_r - j < window
                const __m512i key = _mm512_set1_epi32((int32_t)(j0 + k));
                const __m512i behind = _mm512_sub_epi32(pos, key);
                vis[k] = _mm512_cmpge_epi32_mask(behind, _mm512_setzero_si512()) &
                         _mm512_cmplt_epi32_mask(behind, window);
                t = _mm512_mask_mov_ps(minus_inf, vis[k], t);
            }
            mx = _mm512_max_ps(mx, t);
            _mm512_storeu_ps(st + 16 * k, t);
        }
        const __m512 m_new = _mm512_max_ps(m, mx);
        // Rows that see nothing yet (a window ahead of the block) keep m = -inf; they subtract 0,
        // and their P is all masked.
        const __mmask16 seen = _mm512_cmp_ps_mask(m_new, minus_inf, _CMP_NEQ_OQ);
        const __m512 m_use = _mm512_maskz_mov_ps(seen, m_new);
        const __mmask16 had = _mm512_cmp_ps_mask(m, minus_inf, _CMP_NEQ_OQ);  // rows with some O^T
        const __m512 alpha = _mm512_maskz_mov_ps(had, exp2_nonpos(_mm512_sub_ps(m, m_use)));
        m = m_new;
        __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
        uint16_t *pt = w->pbf;
        for (int64_t k = 0; k < keys; k += 2) {
            __m512 p0 = exp2_nonpos(_mm512_sub_ps(_mm512_loadu_ps(st + 16 * k), m_use));
            __m512 p1 = exp2_nonpos(_mm512_sub_ps(_mm512_loadu_ps(st + 16 * k + 16), m_use));
            if (masked) {
                p0 = _mm512_maskz_mov_ps(vis[k], p0);
                p1 = _mm512_maskz_mov_ps(vis[k + 1], p1);
            }
            sum0 = _mm512_add_ps(sum0, p0);
            sum1 = _mm512_add_ps(sum1, p1);
            // bf16 of keys k (low half) and k + 1 (high half), then interleaved per query.
            const __m512i pair = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);
            _mm512_storeu_si512(pt + 16 * k, _mm512_permutexvar_epi16(interleave, pair));
        }
        l = _mm512_fmadd_ps(l, alpha, _mm512_add_ps(sum0, sum1));
        // O^T = O^T * alpha (per query: per column) + V^T P^T, 64 dims (four tiles) at a time, then
        // 32 (D = 96, 160, 224): independent accumulators keep the tile unit busy.
        // Only rows with some O^T need it (the others are zero): none on a tile's first block.
        if (_mm512_mask_cmp_ps_mask(had, alpha, _mm512_set1_ps(1.0f), _CMP_NEQ_OQ))
            for (int64_t d = 0; d < D; d++)
                _mm512_storeu_ps(w->acc + 16 * d, _mm512_mul_ps(_mm512_loadu_ps(w->acc + 16 * d), alpha));
        _tile_loadd(6, pt, 64);
        if (keys > 32) _tile_loadd(7, pt + 512, 64);
        const uint16_t *v0 = vt + (j0 / 32) * DV * 512, *v1 = v0 + DV * 512;
        int64_t c = 0;
        for (; c + 4 <= DV; c += 4) {
            float *a0 = w->acc + c * 256;
            const uint16_t *x0 = v0 + c * 512, *x1 = v1 + c * 512;
            _tile_loadd(0, a0, 64);
            _tile_loadd(1, a0 + 256, 64);
            _tile_loadd(2, a0 + 512, 64);
            _tile_loadd(3, a0 + 768, 64);
            _tile_loadd(4, x0, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(5, x0 + 512, 64);
            _tile_dpbf16ps(1, 5, 6);
            _tile_loadd(4, x0 + 1024, 64);
            _tile_dpbf16ps(2, 4, 6);
            _tile_loadd(5, x0 + 1536, 64);
            _tile_dpbf16ps(3, 5, 6);
            if (keys > 32) {
                _tile_loadd(4, x1, 64);
                _tile_dpbf16ps(0, 4, 7);
                _tile_loadd(5, x1 + 512, 64);
                _tile_dpbf16ps(1, 5, 7);
                _tile_loadd(4, x1 + 1024, 64);
                _tile_dpbf16ps(2, 4, 7);
                _tile_loadd(5, x1 + 1536, 64);
                _tile_dpbf16ps(3, 5, 7);
            }
            _tile_stored(0, a0, 64);
            _tile_stored(1, a0 + 256, 64);
            _tile_stored(2, a0 + 512, 64);
            _tile_stored(3, a0 + 768, 64);
        }
        for (; c < DV; c += 2) {
            float *a0 = w->acc + c * 256;
            _tile_loadd(0, a0, 64);
            _tile_loadd(1, a0 + 256, 64);
            _tile_loadd(4, v0 + c * 512, 64);
            _tile_loadd(5, v0 + c * 512 + 512, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 5, 6);
            if (keys > 32) {
                _tile_loadd(4, v1 + c * 512, 64);
                _tile_loadd(5, v1 + c * 512 + 512, 64);
                _tile_dpbf16ps(0, 4, 7);
                _tile_dpbf16ps(1, 5, 7);
            }
            _tile_stored(0, a0, 64);
            _tile_stored(1, a0 + 256, 64);
        }
    }
    // out[r, d] = O^T[d, r] / l[r]: row r is column r of each 16 x 16 block of O^T.
    float inv[QT];
    _mm512_storeu_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), l));
    uint16_t *o = (uint16_t *)p->out + ((p->query_start[s] + first) * H + h) * D;
    for (int64_t c = 0; c < DV; c++) {
        __m512 x[16];
        for (int d = 0; d < 16; d++) x[d] = _mm512_loadu_ps(w->acc + c * 256 + 16 * d);
        transpose16_ps(x);
        for (int64_t r = 0; r < rows; r++)
            _mm256_storeu_si256((__m256i *)(o + r * H * D + 16 * c),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(x[r], _mm512_set1_ps(inv[r]))));
    }
}
#endif

// 1 when bf16 calls with head_dim a multiple of 32 take the AMX path: built with AMX and the process
// granted the tile state (asked here, once per process).
int qw_prefill_amx_available(void) {
#if HAVE_AMX
    return qw_amx_request();
#else
    return 0;
#endif
}

static int by_cost_desc(const void *a, const void *b) {
    const Unit *x = a, *y = b;
    return (x->cost < y->cost) - (x->cost > y->cost);
}

// Entry point (ctypes): sequences [seq_begin, seq_end) of the tables. head_dim a multiple of 16 up to
// MAX_HEAD_DIM; num_heads a multiple of num_kv_heads. The query at position i sees keys
// max(0, i - window + 1) .. i (a window of max_blocks * block_size or more: causal attention), and
// with has_soft_cap its scaled scores are capped by tanh. allow_amx 0 keeps bf16 off the AMX path
// (to compare the paths). Returns QW_OK or an error code.
int qw_paged_prefill_attention(const void *q, const void *k, const void *v, const int32_t *block_tables,
                               const int32_t *seq_lens, const int32_t *query_start, void *out, int64_t seq_begin,
                               int64_t seq_end, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                               int64_t block_size, int64_t max_blocks, int64_t num_blocks, float scale, int64_t window,
                               int has_soft_cap, float soft_cap, int is_bf16, int num_threads, int allow_amx) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || head_dim % 16 != 0 || head_dim > MAX_HEAD_DIM ||
        block_size <= 0 || num_threads <= 0 || seq_begin < 0 || seq_end < seq_begin || window < 1 ||
        (has_soft_cap && !(soft_cap > 0.0f)))
        return QW_BAD_SHAPE;
    if (seq_end == seq_begin) return QW_OK;
    Params p = {q,          k,          v,         block_tables, seq_lens,
                query_start, out,       num_heads, num_kv_heads, head_dim,
                block_size, max_blocks, num_blocks, scale,       is_bf16,
                HAVE_DP && is_bf16 && head_dim % 64 == 0, window, has_soft_cap, soft_cap, 0};
    // The tile state is asked for only when the path could be taken; refused, bf16 stays on VDPBF16PS.
    p.use_amx = HAVE_AMX && allow_amx && is_bf16 && head_dim % 32 == 0 && qw_prefill_amx_available();
    if (p.use_amx) p.use_dp = 0;
    const int64_t num_seqs = seq_end - seq_begin, Dp = round_up(head_dim, 64);
    // Floats per key of one KV head's K^T (and of its V): the AMX path keeps bf16, unpadded.
    const int64_t key_floats = p.use_amx ? head_dim / 2 : Dp;

    int64_t num_units = 0, floats = 0;
    for (int64_t s = seq_begin; s < seq_end; s++) {
        const int64_t n = query_start[s + 1] - query_start[s], L = seq_lens[s];
        if (n < 1 || L < n || L > max_blocks * block_size) return QW_BAD_SEQ_LEN;
        num_units += num_heads * ((n + QT - 1) / QT);
        floats += 2 * num_kv_heads * round_up(L, KB) * key_floats;
    }
    Unit *units = malloc((size_t)num_units * sizeof(Unit));
    SeqKV *kv = malloc((size_t)num_seqs * sizeof(SeqKV));
    // Zeroed: the padding keys past each context (masked; their V rows must not be NaN).
    float *kv_data = calloc((size_t)floats, sizeof(float));
    if (!units || !kv || !kv_data) {
        free(units);
        free(kv);
        free(kv_data);
        return QW_NO_MEMORY;
    }
    int64_t ui = 0, offset = 0;
    for (int64_t s = seq_begin; s < seq_end; s++) {
        const int64_t n = query_start[s + 1] - query_start[s], L = seq_lens[s], Lp = round_up(L, KB);
        SeqKV *e = &kv[s - seq_begin];
        e->padded_len = Lp;
        e->kt = kv_data + offset;
        e->v = e->kt + num_kv_heads * key_floats * Lp;
        offset += 2 * num_kv_heads * Lp * key_floats;
        for (int64_t h = 0; h < num_heads; h++)
            for (int64_t first = 0; first < n; first += QT)
                units[ui++] = (Unit){(int32_t)s, (int32_t)h, (int32_t)first,
                                     (int32_t)(L - n + first + QT - first_key(&p, L - n + first))};
    }
    qsort(units, (size_t)num_units, sizeof(Unit), by_cost_desc);

    // Conversion work in pieces of 256 tokens, so that one long context is shared out too. Only the
    // keys some query of the chunk sees are converted: from the first query's window on.
    int64_t num_pieces = 0;
#define KEYS_SEEN(s) (seq_lens[s] - first_key(&p, seq_lens[s] - (query_start[(s) + 1] - query_start[s])))
    for (int64_t s = seq_begin; s < seq_end; s++) num_pieces += (KEYS_SEEN(s) + 255) / 256;
    int err = QW_OK;
    int64_t next_unit = 0;
    const int64_t work = num_units * QT * head_dim;
    const int parallel = num_threads > 1 && work > (1 << 14);
#pragma omp parallel num_threads(num_threads) if (parallel)
    {
#pragma omp for schedule(dynamic)
        for (int64_t piece = 0; piece < num_pieces; piece++) {
            int64_t s = seq_begin, first = piece;
            while (first >= (KEYS_SEEN(s) + 255) / 256) {
                first -= (KEYS_SEEN(s) + 255) / 256;
                s++;
            }
            const int64_t lo = seq_lens[s] - KEYS_SEEN(s);
            const int64_t t0 = lo + first * 256, t1 = t0 + 256 < seq_lens[s] ? t0 + 256 : seq_lens[s];
            const int rc = convert_kv(&p, s, &kv[s - seq_begin], Dp, t0, t1);
            if (rc != QW_OK) {
#pragma omp atomic write
                err = rc;
            }
        }
        // (the implicit barrier of the loop above: every K^T and V is ready)
        Scratch w;
        // q, acc and s in fp32, then the bf16 probabilities (half a float each).
        float *buf = aligned_alloc(64, (size_t)(2 * QT * Dp + QT * KB + QT * KB / 2) * sizeof(float));
        if (!buf) {
#pragma omp atomic write
            err = QW_NO_MEMORY;
        }
        int ok;
#pragma omp atomic read
        ok = err;
        ok = ok == QW_OK && buf != NULL;
#if HAVE_AMX
        qw_amx_tilecfg cfg;
        if (ok && p.use_amx) {  // per thread: the configuration is thread state
            qw_amx_config_all(&cfg, 16, 64);
            _tile_loadconfig(&cfg);
        }
#endif
        if (ok) {
            w.q = buf;
            w.acc = buf + QT * Dp;
            w.s = buf + 2 * QT * Dp;
            w.pbf = (uint16_t *)(w.s + QT * KB);
            for (;;) {
                const int64_t i = __atomic_fetch_add(&next_unit, 1, __ATOMIC_RELAXED);
                if (i >= num_units) break;
                const Unit *u = &units[i];
#if HAVE_AMX
                if (p.use_amx) {
                    run_unit_amx(&p, u, &kv[u->seq - seq_begin], &w);
                    continue;
                }
#endif
                run_unit(&p, u, &kv[u->seq - seq_begin], Dp, &w);
            }
        }
#if HAVE_AMX
        if (ok && p.use_amx) _tile_release();  // the thread carries no tile state out of the call
#endif
        free(buf);
    }
#undef KEYS_SEEN
    free(units);
    free(kv);
    free(kv_data);
    return err;
}
