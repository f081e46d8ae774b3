// Paged decode attention for the CPU: one query token per sequence, K/V read in place through the
// block table (never gathered for the whole batch), online softmax, fp32 accumulation.
//
// Built at first use by cpu_paged_attention.py with `gcc -O3 -march=native -fopenmp` and called
// through ctypes. The vector code uses GCC vector extensions at 8 floats (one AVX2 register), not
// intrinsics, so one source builds for any target GCC knows (checked: x86-64 baseline SSE2, same
// results; AVX2) and the tested code is the shipped code. The one exception is the bf16 path of CPUs
// with AVX512-BF16 (dot products, in intrinsics; see "bf16 on cores with AVX512-BF16" below), which
// replaces the scores and P.V loops there and keeps everything else.
//
// Layouts (all contiguous, element offsets):
//   q, out:   [num_seqs, num_heads, head_dim]
//   k, v:     [num_blocks, block_size, num_kv_heads, head_dim]
//   tables:   [num_seqs, max_blocks] int32
//   seq_lens: [num_seqs] int32
//
// Work is split into units (sequence, token range), handed to OpenMP threads longest first. A unit
// walks its tokens in chunks of CHUNK; for each chunk and KV head it computes the scores of all the
// group's query heads, updates their running max and sum, and accumulates P.V, reading K and V rows
// straight from the cache (bf16 is widened in registers: a converted fp32 copy cost more in stores
// than it saved). While a chunk computes, the next chunk's K and V (or the first chunk of the
// thread's next unit) are prefetched a line or two at a time.
// Long sequences in small batches are split into several units whose partial results are merged
// afterwards (flash-decoding), so that every thread has work at batch 1.
// A sliding window (the query sees the last `window` keys) just starts each sequence's units at its
// window: blocks before it are never read or prefetched, so a windowed decode costs its window. A
// logits soft-cap bends each chunk's scores by tanh before the online softmax.
//
// Measured on a 2-core AMD EPYC (Zen 3, AVX2) VM with SmolLM2-135M shapes (9 heads, 3 KV heads,
// head_dim 64, bf16), 128 sequences x 400 tokens, K/V from DRAM: 2.2 ms per layer on 2 threads
// (gather + SDPA eager: ~110 ms; K and V are 39 MB, a pure read of which takes 1.3 ms), 4.1 ms on
// 1 thread.
// One thread computes about 60 ns per token with K/V in L2; from DRAM it is limited by the misses
// one core keeps in flight, hence the paced prefetch below.
// On a 2-core AMX Xeon VM (same shapes, bf16, 2 threads; scripts/bench_cpu_attention.py
// --compare-source, the two quietest of seven runs on a shared machine, uncontended medians):
// 128 x 400 1.74-1.93 ms per layer against a copy floor of 1.57-1.59 (k/floor 1.11-1.21; the
// code before the AVX512-BF16 path and the L2 prefetch, in the same runs: 1.58-1.68), 32 x 1000
// k/floor 1.25-1.27 (before: 1.60-1.65).
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_simd.h"

// Software prefetches go to L1 (3) on AVX2-only CPUs and into L2 (2) on AVX-512 ones. On the AMX
// Xeons L2 was about 10% faster from DRAM (bf16 and fp32, 1 thread, 128 x 400 and 32 x 1000,
// SmolLM2-135M shapes, loaded machine; a pace 1.5x or 2x faster was 10-25% slower there, as on the
// EPYC). On the AVX512-BF16 EPYC (Zen 4, 2 threads, same shapes, quiet) L2 alone made the generic
// code 1.07-1.09x faster in bf16 and 1.11-1.26x in fp32; with the AVX512-BF16 path below, bf16 went
// 1.27-1.38x faster than the generic code with L1 prefetches (k/floor 2.2-2.3 -> 1.7-2.3).
#if defined(__AVX512F__)
#define PREFETCH_LOCALITY 2
#else
#define PREFETCH_LOCALITY 3
#endif

// Tokens per online-softmax step: 32 beat 8 and 64 with K/V in cache (per-chunk max, exp and
// rescale are amortised) and tie with them from DRAM. A multiple of 8 (the score tiles).
#define CHUNK 32
#define MAX_HEAD_DIM 512

enum {
    QW_OK = 0,
    QW_BAD_SEQ_LEN = 1,
    QW_BAD_BLOCK_ID = 2,
    QW_BAD_SHAPE = 3,
    QW_NO_MEMORY = 4,
};

// bf16 is the top half of an fp32. Read 16 bf16 as 8 uint32 lanes, each holding elements 2i (low
// half) and 2i+1 (high half): a shift gives the even elements as fp32 and a mask the odd ones, with
// no shuffles. So in bf16 mode every 16-element group of a row is kept "split": its 8 even elements,
// then its 8 odd ones. q and the accumulators use the same order (dot products and P.V do not care)
// and the output is put back in order when stored.
static inline void load_bf16x16_split(const uint16_t *p, v8f *even, v8f *odd) {
    v8u w;
    memcpy(&w, p, sizeof w);
    *even = (v8f)(w << 16);
    *odd = (v8f)(w & 0xffff0000u);
}

// 16 elements of a row from element d on, as two vectors: bf16 in split order, fp32 in order.
// `bf16` is a constant at every call site, so each kernel below is compiled once per dtype.
static inline __attribute__((always_inline)) void load16(const void *row, int64_t d, int bf16, v8f *a, v8f *b) {
    if (bf16) {
        load_bf16x16_split((const uint16_t *)row + d, a, b);
    } else {
        *a = loadu8((const float *)row + d);
        *b = loadu8((const float *)row + d + 8);
    }
}

// Sums of 8 vectors, one per lane: lane i of the result is the sum of a[i]'s lanes.
static inline v8f hadd(v8f a, v8f b) {
    const v8i even = {0, 2, 8, 10, 4, 6, 12, 14};
    const v8i odd = {1, 3, 9, 11, 5, 7, 13, 15};
    return __builtin_shuffle(a, b, even) + __builtin_shuffle(a, b, odd);
}

static inline v8f transpose_sum8(v8f a0, v8f a1, v8f a2, v8f a3, v8f a4, v8f a5, v8f a6, v8f a7) {
    v8f h0123 = hadd(hadd(a0, a1), hadd(a2, a3));
    v8f h4567 = hadd(hadd(a4, a5), hadd(a6, a7));
    const v8i lo = {0, 1, 2, 3, 8, 9, 10, 11};
    const v8i hi = {4, 5, 6, 7, 12, 13, 14, 15};
    return __builtin_shuffle(h0123, h4567, lo) + __builtin_shuffle(h0123, h4567, hi);
}

typedef struct {
    const void *q, *k, *v;
    const int32_t *block_tables, *seq_lens;
    void *out;
    int64_t num_seqs, num_heads, num_kv_heads, head_dim, block_size, max_blocks, num_blocks;
    float scale;
    int is_bf16;
    int64_t window;  // the query (at position len - 1) sees the last `window` keys
    int has_soft_cap;
    float soft_cap;  // scores s become tanh(s / soft_cap) * soft_cap before the softmax
} Params;

// First key a sequence of `len` tokens attends to: keys before it are never read, so a windowed
// decode costs its window, not its context.
static inline int64_t window_begin(const Params *p, int64_t len) { return len > p->window ? len - p->window : 0; }

typedef struct {
    int32_t seq;
    int32_t slot;  // index into the partial-result buffers when the sequence is split, else -1
    int64_t begin, end;
} Unit;

// Per-thread working memory, one allocation. G = num_heads / num_kv_heads, C = chunk.
typedef struct {
    float *qs;       // [H, D] query times scale (bf16: split order)
    float *acc;      // [H, D] unnormalised output (bf16: split order)
    float *m, *l;    // [H] running max and running sum of exp
    float *sc, *pr;  // [G, C] scores, then probabilities, of one KV head's query heads
    float *alpha;    // [G] rescale of the accumulators for this chunk
    float *zero;     // [D] stands in for rows past the end of the chunk in the 8-token score tiles
    int64_t *tok_off;  // [C] element offset of each token's [KV, D] record
    void *base;
} Scratch;

static int scratch_alloc(Scratch *s, const Params *p) {
    const int64_t H = p->num_heads, KV = p->num_kv_heads, D = p->head_dim, C = CHUNK, G = H / KV;
    const int64_t floats = 2 * H * D + 2 * H + 2 * G * C + G + D;
    // Each array is padded to 16 floats so that every one starts 64-byte aligned.
    const size_t bytes = (size_t)(floats + 16 * 8) * sizeof(float) + (size_t)C * sizeof(int64_t) + 64;
    char *b = calloc(1, bytes);
    if (!b) return QW_NO_MEMORY;
    s->base = b;
    float *f = (float *)(((uintptr_t)b + 63) & ~(uintptr_t)63);
#define TAKE(field, count) \
    s->field = f;          \
    f += ((count) + 15) & ~(int64_t)15;
    TAKE(qs, H * D)
    TAKE(acc, H * D)
    TAKE(m, H)
    TAKE(l, H)
    TAKE(sc, G * C)
    TAKE(pr, G * C)
    TAKE(alpha, G)
    TAKE(zero, D)
#undef TAKE
    s->tok_off = (int64_t *)f;
    return QW_OK;
}

// Software prefetch of the next chunk's K and V, paced by the arithmetic: every inner loop step
// reports its FMAs and gets its share of the lines. Blocks sit at random places in the pool, where
// hardware prefetchers lose the trail, and one core keeps only ~24 misses in flight: a prefetch
// that finds them all busy stalls the pipeline, so a burst at the start of a chunk (or all of them
// in the P.V half) overlapped almost nothing with the compute, and an even pace does.
typedef struct {
    const char *start[2 * CHUNK + 2];  // contiguous byte ranges: one per block touched, K and V
    int64_t len[2 * CHUNK + 2];
    int num_runs, run;
    const char *p;
    int64_t left;    // bytes left in the current range
    int64_t rate;    // lines per FMA, 16.16 fixed point
    int64_t credit;  // lines owed, 16.16 fixed point
} Prefetcher;

static inline void prefetch_line(Prefetcher *pf) {
    if (pf->left <= 0) {
        if (pf->run >= pf->num_runs) return;
        pf->p = pf->start[pf->run];
        pf->left = pf->len[pf->run++];
    }
    __builtin_prefetch(pf->p, 0, PREFETCH_LOCALITY);
    pf->p += 64;
    pf->left -= 64;
}

// Called from inner loops after `fmas` FMAs.
static inline void prefetch_paced(Prefetcher *pf, int64_t fmas) {
    pf->credit += fmas * pf->rate;
    while (pf->credit >= 65536) {
        pf->credit -= 65536;
        prefetch_line(pf);
    }
}

static inline void prefetch_rest(Prefetcher *pf) {
    while (pf->left > 0 || pf->run < pf->num_runs) prefetch_line(pf);
}

// Points pf at the K and V bytes of tokens [begin, end) of the sequence whose block table is
// `table`; returns the number of cache lines. Stops at an invalid block id (run_unit reports it).
static int64_t plan_prefetch(Prefetcher *pf, const Params *p, const int32_t *table, int64_t begin, int64_t end) {
    const int64_t BS = p->block_size, rec_bytes = p->num_kv_heads * p->head_dim * (p->is_bf16 ? 2 : 4);
    int64_t lines = 0;
    pf->num_runs = pf->run = 0;
    pf->left = pf->rate = pf->credit = 0;
    for (int64_t pos = begin; pos < end;) {
        const int64_t block = table[pos / BS];
        if (block < 0 || block >= p->num_blocks) break;
        int64_t run = BS - pos % BS;  // tokens left in this block
        if (run > end - pos) run = end - pos;
        // Whole lines: from the line holding the first byte to the one holding the last.
        const int64_t first = (block * BS + pos % BS) * rec_bytes, off = first & ~(int64_t)63;
        const int64_t bytes = first + run * rec_bytes - off;
        pf->start[pf->num_runs] = (const char *)p->k + off;
        pf->len[pf->num_runs++] = bytes;
        pf->start[pf->num_runs] = (const char *)p->v + off;
        pf->len[pf->num_runs++] = bytes;
        lines += 2 * ((bytes + 63) / 64);
        pos += run;
    }
    return lines;
}

// Scores of 8 tokens for one head: lane i = q . row[i]. Eight independent accumulators keep both
// FMA pipes busy through the 4-cycle latency; one transpose-and-add tree per 8 tokens.
// The fp32 choice (8 tokens x 1 head: 4.7 cycles per head and token, L1-resident, Zen 3).
static inline __attribute__((always_inline)) v8f scores8x1(const float *q, const void *const *row, int64_t D,
                                                           int bf16, Prefetcher *pf) {
    v8f a0 = splat8(0), a1 = splat8(0), a2 = splat8(0), a3 = splat8(0);
    v8f a4 = splat8(0), a5 = splat8(0), a6 = splat8(0), a7 = splat8(0);
    for (int64_t d = 0; d < D; d += 16) {
        const v8f q0 = loadu8(q + d), q1 = loadu8(q + d + 8);
        v8f x, y;
#define DOT(i)                       \
    load16(row[i], d, bf16, &x, &y); \
    a##i += q0 * x;                  \
    a##i += q1 * y;
        DOT(0) DOT(1) DOT(2) DOT(3) DOT(4) DOT(5) DOT(6) DOT(7)
#undef DOT
        prefetch_paced(pf, 16);
    }
    return transpose_sum8(a0, a1, a2, a3, a4, a5, a6, a7);
}

// Scores of 4 tokens for 3 (or 2) heads of a group: each bf16 row widened once feeds all of them
// (bf16: 5.4 cycles per head and token against 7.3 for scores8x1). q + j * D is head j.
static inline __attribute__((always_inline)) void scores4x3(const float *q, const void *const *row, int64_t D,
                                                            int bf16, int heads, float *s0, float *s1, float *s2,
                                                            Prefetcher *pf) {
    v8f a0 = splat8(0), a1 = splat8(0), a2 = splat8(0), a3 = splat8(0);
    v8f b0 = splat8(0), b1 = splat8(0), b2 = splat8(0), b3 = splat8(0);
    v8f c0 = splat8(0), c1 = splat8(0), c2 = splat8(0), c3 = splat8(0);
    const float *qa = q, *qb = q + D, *qc = q + 2 * D;
    for (int64_t d = 0; d < D; d += 16) {
        v8f x, y;
#define DOT(i)                                 \
    load16(row[i], d, bf16, &x, &y);           \
    a##i += loadu8(qa + d) * x;                 \
    a##i += loadu8(qa + d + 8) * y;             \
    b##i += loadu8(qb + d) * x;                 \
    b##i += loadu8(qb + d + 8) * y;             \
    if (heads == 3) {                          \
        c##i += loadu8(qc + d) * x;             \
        c##i += loadu8(qc + d + 8) * y;         \
    }
        DOT(0) DOT(1) DOT(2) DOT(3)
#undef DOT
        prefetch_paced(pf, 8 * heads);
    }
    float r[8];
    storeu8(r, transpose_sum8(a0, a1, a2, a3, b0, b1, b2, b3));
    memcpy(s0, r, 4 * sizeof(float));
    memcpy(s1, r + 4, 4 * sizeof(float));
    if (heads == 3) {
        storeu8(r, transpose_sum8(c0, c1, c2, c3, c0, c1, c2, c3));
        memcpy(s2, r, 4 * sizeof(float));
    }
}

// sc[g][0:n8] = scores of the group's heads g (q: [G, D]) against rows[0:n8].
static inline __attribute__((always_inline)) void group_scores(const float *q, const void *const *row,
                                                               int64_t n8, int64_t D, int64_t G, int64_t C,
                                                               float *sc, int bf16, Prefetcher *pf) {
    int64_t g = 0;
    if (bf16) {
        // `heads` is spelled out as a constant so that each variant is compiled without the branch.
        for (; g + 3 <= G; g += 3)
            for (int64_t t = 0; t < n8; t += 4)
                scores4x3(q + g * D, row + t, D, bf16, 3, sc + g * C + t, sc + (g + 1) * C + t,
                          sc + (g + 2) * C + t, pf);
        if (G - g == 2) {
            for (int64_t t = 0; t < n8; t += 4)
                scores4x3(q + g * D, row + t, D, bf16, 2, sc + g * C + t, sc + (g + 1) * C + t, NULL, pf);
            g += 2;
        }
    }
    for (; g < G; g++)
        for (int64_t t = 0; t < n8; t += 8) storeu8(sc + g * C + t, scores8x1(q + g * D, row + t, D, bf16, pf));
}

// P.V for 3 heads of a group, 16 columns at a time, two tokens per step into two sets of
// accumulators (12 chains hide the FMA latency): 4.6 cycles per head and token, L1-resident.
// acc_j[0:D] = acc_j * alpha_j + sum_t p_j[t] * row[t][0:D] for t < n, j < 3.
static inline __attribute__((always_inline)) void accumulate_pv3(float *acc, const float *alpha, const float *p,
                                                                 int64_t C, const void *const *row, int64_t n,
                                                                 int64_t D, int bf16, Prefetcher *pf) {
    float *acc0 = acc, *acc1 = acc + D, *acc2 = acc + 2 * D;
    const float *p0 = p, *p1 = p + C, *p2 = p + 2 * C;
    const v8f va0 = splat8(alpha[0]), va1 = splat8(alpha[1]), va2 = splat8(alpha[2]);
    for (int64_t d = 0; d < D; d += 16) {
        v8f a00 = loadu8(acc0 + d) * va0, a01 = loadu8(acc0 + d + 8) * va0;
        v8f a10 = loadu8(acc1 + d) * va1, a11 = loadu8(acc1 + d + 8) * va1;
        v8f a20 = loadu8(acc2 + d) * va2, a21 = loadu8(acc2 + d + 8) * va2;
        v8f c00 = splat8(0), c01 = splat8(0), c10 = splat8(0), c11 = splat8(0), c20 = splat8(0), c21 = splat8(0);
        int64_t t = 0;
        for (; t + 2 <= n; t += 2) {
            prefetch_paced(pf, 12);
            v8f x, y, b;
            load16(row[t], d, bf16, &x, &y);
            b = splat8(p0[t]);
            a00 += b * x;
            a01 += b * y;
            b = splat8(p1[t]);
            a10 += b * x;
            a11 += b * y;
            b = splat8(p2[t]);
            a20 += b * x;
            a21 += b * y;
            load16(row[t + 1], d, bf16, &x, &y);
            b = splat8(p0[t + 1]);
            c00 += b * x;
            c01 += b * y;
            b = splat8(p1[t + 1]);
            c10 += b * x;
            c11 += b * y;
            b = splat8(p2[t + 1]);
            c20 += b * x;
            c21 += b * y;
        }
        if (t < n) {
            prefetch_paced(pf, 6);
            v8f x, y, b;
            load16(row[t], d, bf16, &x, &y);
            b = splat8(p0[t]);
            a00 += b * x;
            a01 += b * y;
            b = splat8(p1[t]);
            a10 += b * x;
            a11 += b * y;
            b = splat8(p2[t]);
            a20 += b * x;
            a21 += b * y;
        }
        storeu8(acc0 + d, a00 + c00);
        storeu8(acc0 + d + 8, a01 + c01);
        storeu8(acc1 + d, a10 + c10);
        storeu8(acc1 + d + 8, a11 + c11);
        storeu8(acc2 + d, a20 + c20);
        storeu8(acc2 + d + 8, a21 + c21);
    }
}

// P.V for 2 heads, 32 columns at a time: each V vector loaded feeds both (5.1 cycles per head
// and token for bf16, 4.1 for fp32, against 6.2 and 5.3 one head at a time).
static inline __attribute__((always_inline)) void accumulate_pv2(float *acc, const float *alpha, const float *p,
                                                                 int64_t C, const void *const *row, int64_t n,
                                                                 int64_t D, int bf16, Prefetcher *pf) {
    float *acc0 = acc, *acc1 = acc + D;
    const float *p0 = p, *p1 = p + C;
    const v8f va0 = splat8(alpha[0]), va1 = splat8(alpha[1]);
    int64_t d = 0;
    for (; d + 32 <= D; d += 32) {
        v8f a00 = loadu8(acc0 + d) * va0, a01 = loadu8(acc0 + d + 8) * va0;
        v8f a02 = loadu8(acc0 + d + 16) * va0, a03 = loadu8(acc0 + d + 24) * va0;
        v8f a10 = loadu8(acc1 + d) * va1, a11 = loadu8(acc1 + d + 8) * va1;
        v8f a12 = loadu8(acc1 + d + 16) * va1, a13 = loadu8(acc1 + d + 24) * va1;
        for (int64_t t = 0; t < n; t++) {
            prefetch_paced(pf, 8);
            v8f v0, v1, v2, v3;
            load16(row[t], d, bf16, &v0, &v1);
            load16(row[t], d + 16, bf16, &v2, &v3);
            v8f b = splat8(p0[t]);
            a00 += b * v0;
            a01 += b * v1;
            a02 += b * v2;
            a03 += b * v3;
            b = splat8(p1[t]);
            a10 += b * v0;
            a11 += b * v1;
            a12 += b * v2;
            a13 += b * v3;
        }
        storeu8(acc0 + d, a00);
        storeu8(acc0 + d + 8, a01);
        storeu8(acc0 + d + 16, a02);
        storeu8(acc0 + d + 24, a03);
        storeu8(acc1 + d, a10);
        storeu8(acc1 + d + 8, a11);
        storeu8(acc1 + d + 16, a12);
        storeu8(acc1 + d + 24, a13);
    }
    if (d < D) {  // D % 32 == 16
        v8f a00 = loadu8(acc0 + d) * va0, a01 = loadu8(acc0 + d + 8) * va0;
        v8f a10 = loadu8(acc1 + d) * va1, a11 = loadu8(acc1 + d + 8) * va1;
        for (int64_t t = 0; t < n; t++) {
            prefetch_paced(pf, 4);
            v8f v0, v1;
            load16(row[t], d, bf16, &v0, &v1);
            const v8f b0 = splat8(p0[t]), b1 = splat8(p1[t]);
            a00 += b0 * v0;
            a01 += b0 * v1;
            a10 += b1 * v0;
            a11 += b1 * v1;
        }
        storeu8(acc0 + d, a00);
        storeu8(acc0 + d + 8, a01);
        storeu8(acc1 + d, a10);
        storeu8(acc1 + d + 8, a11);
    }
}

// P.V for 1 head, 64 columns at a time (MHA, or the last head of an odd group).
static inline __attribute__((always_inline)) void accumulate_pv1(float *acc, float alpha, const float *p,
                                                                 const void *const *row, int64_t n, int64_t D,
                                                                 int bf16, Prefetcher *pf) {
    const v8f va = splat8(alpha);
    int64_t d = 0;
    for (; d + 64 <= D; d += 64) {
        v8f a0 = loadu8(acc + d) * va, a1 = loadu8(acc + d + 8) * va;
        v8f a2 = loadu8(acc + d + 16) * va, a3 = loadu8(acc + d + 24) * va;
        v8f a4 = loadu8(acc + d + 32) * va, a5 = loadu8(acc + d + 40) * va;
        v8f a6 = loadu8(acc + d + 48) * va, a7 = loadu8(acc + d + 56) * va;
        for (int64_t t = 0; t < n; t++) {
            prefetch_paced(pf, 8);
            const v8f b = splat8(p[t]);
            v8f x, y;
            load16(row[t], d, bf16, &x, &y);
            a0 += b * x;
            a1 += b * y;
            load16(row[t], d + 16, bf16, &x, &y);
            a2 += b * x;
            a3 += b * y;
            load16(row[t], d + 32, bf16, &x, &y);
            a4 += b * x;
            a5 += b * y;
            load16(row[t], d + 48, bf16, &x, &y);
            a6 += b * x;
            a7 += b * y;
        }
        storeu8(acc + d, a0);
        storeu8(acc + d + 8, a1);
        storeu8(acc + d + 16, a2);
        storeu8(acc + d + 24, a3);
        storeu8(acc + d + 32, a4);
        storeu8(acc + d + 40, a5);
        storeu8(acc + d + 48, a6);
        storeu8(acc + d + 56, a7);
    }
    for (; d < D; d += 16) {
        v8f a0 = loadu8(acc + d) * va, a1 = loadu8(acc + d + 8) * va;
        for (int64_t t = 0; t < n; t++) {
            prefetch_paced(pf, 2);
            v8f x, y;
            load16(row[t], d, bf16, &x, &y);
            a0 += splat8(p[t]) * x;
            a1 += splat8(p[t]) * y;
        }
        storeu8(acc + d, a0);
        storeu8(acc + d + 8, a1);
    }
}

// acc[g] = acc[g] * alpha[g] + P[g] . V for the group's heads; acc: [G, D], p: [G, C].
static inline __attribute__((always_inline)) void group_pv(float *acc, const float *alpha, const float *p, int64_t C,
                                                           const void *const *row, int64_t n, int64_t D, int64_t G,
                                                           int bf16, Prefetcher *pf) {
    int64_t g = 0;
    for (; g + 3 <= G; g += 3)
        accumulate_pv3(acc + g * D, alpha + g, p + g * C, C, row, n, D, bf16, pf);
    if (G - g == 2) accumulate_pv2(acc + g * D, alpha + g, p + g * C, C, row, n, D, bf16, pf);
    if (G - g == 1) accumulate_pv1(acc + g * D, alpha[g], p + g * C, row, n, D, bf16, pf);
}

// ---- bf16 on cores with AVX512-BF16 (the AMX Xeons, the AVX512-BF16 EPYC) ------------------------
//
// Scores by VDPBF16PS on the raw bf16 q and K (fp32 products and sums, scale applied after), P.V by
// 16-lane FMAs with all of a KV head's accumulators in registers, softmax at 16 lanes. Measured on a
// 2-core AMX Xeon VM (SmolLM2-135M shapes, one thread, 4 x 400 tokens, K/V in L2, best of 2000
// calls, machine shared): 4.3 ns per head and token with the generic code, 3.8 here. Where the time
// goes here (same setup, parts switched off): scores 1.8, P.V 1.0, softmax 0.5, the rest (token
// offsets, row pointers, issuing the paced prefetches: 12 lines a token) 1.0. From DRAM the
// kernel's compute and its memory time add up more than they overlap, so this shows at about the
// same share there (1 thread, 128 x 400 and 32 x 1000: 0.84-0.92x of the generic code's time, both
// with the L2 prefetch below; medians of uncontended calls, machine shared).
// Taken on every CPU with AVX512-BF16: the AMX Xeons and the AVX512-BF16 EPYC (Zen 4, 512-bit ops
// split in two halves), where with the L2 prefetch it measured 1.27-1.38x the generic code's speed
// from DRAM (figures with the prefetch note above). -DQW_DECODE_GENERIC forces the generic code
// (the tests compare the two).
// Tried and dropped (same machine): AMX tiles for the scores (16 tokens x the group's heads per
// TDPBF16PS, K tiles loaded in place when a tile's rows are evenly strided, else staged): 3.45 ns
// per head and token with K/V in L2 against 4.1, but 12-20% slower from DRAM (1 thread, uncontended
// medians, three runs), where a tile load stalls on its misses; prefetching every other line (the
// pair line did not come with it), bursts at chunk start, extra L1 prefetches of the next KV head's
// rows, and a lookahead of two chunks: slower or no better.
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && !defined(QW_DECODE_GENERIC)
#define QW_DECODE_AVX512 1
#include <immintrin.h>

// Tokens per score tile of this path: chunks are padded to a multiple of it with the zero row.
#define TILE16 16

// Lane i of the result = sum of a[i]'s 16 lanes (a transpose-and-add tree, 30 shuffles, 15 adds).
static inline __attribute__((always_inline)) __m512 reduce16x16(const __m512 *a) {
    __m512 s1[8], s2[4], s3[2];
    // Per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] for the pair (a, b).
    for (int i = 0; i < 8; i++)
        s1[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    // Per 128-bit lane: the lane's sum for each of 4 rows.
    for (int i = 0; i < 4; i++)
        s2[i] = _mm512_add_ps(_mm512_shuffle_ps(s1[2 * i], s1[2 * i + 1], 0x44),
                              _mm512_shuffle_ps(s1[2 * i], s1[2 * i + 1], 0xEE));
    // 128-bit lanes: [rows 0-3 lanes 0+1, rows 0-3 lanes 2+3, rows 4-7 lanes 0+1, rows 4-7 lanes 2+3].
    for (int i = 0; i < 2; i++)
        s3[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s2[2 * i], s2[2 * i + 1], 0x88),
                              _mm512_shuffle_f32x4(s2[2 * i], s2[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(s3[0], s3[1], 0x88), _mm512_shuffle_f32x4(s3[0], s3[1], 0xDD));
}

// 32 bf16 from p as the operand type of VDPBF16PS. A memcpy, not a cast of _mm512_loadu_si512:
// GCC 12 moved each cast through the stack (a store and a reload per dot product).
static inline __m512bh load_bh32(const uint16_t *p) {
    __m512bh r;
    memcpy(&r, p, sizeof r);
    return r;
}

// The same for 16 bf16, the upper half zero.
static inline __m512bh load_bh16(const uint16_t *p) {
    __m256i lo;
    memcpy(&lo, p, sizeof lo);
    const __m512i w = _mm512_zextsi256_si512(lo);
    __m512bh r;
    memcpy(&r, &w, sizeof r);
    return r;
}

// sc[0:16] = scale * (q . row[t]) for 16 rows, q and rows bf16 [D] (D a multiple of 16).
static inline __attribute__((always_inline)) void scores16_avx512(const uint16_t *q, const void *const *row,
                                                                  int64_t D, float scale, float *sc,
                                                                  Prefetcher *pf) {
    __m512 a[TILE16];
#pragma GCC unroll 16
    for (int i = 0; i < TILE16; i++) a[i] = _mm512_setzero_ps();
    int64_t d = 0;
    for (; d + 32 <= D; d += 32) {
        const __m512bh qv = load_bh32(q + d);
#pragma GCC unroll 16
        for (int i = 0; i < TILE16; i++) a[i] = _mm512_dpbf16_ps(a[i], qv, load_bh32((const uint16_t *)row[i] + d));
        prefetch_paced(pf, 64);  // 16 tokens x 32 columns, in the 8-lane FMAs the pace counts
    }
    if (d < D) {  // D % 32 == 16: the high half of q and rows is zero
        const __m512bh qv = load_bh16(q + d);
#pragma GCC unroll 16
        for (int i = 0; i < TILE16; i++) a[i] = _mm512_dpbf16_ps(a[i], qv, load_bh16((const uint16_t *)row[i] + d));
        prefetch_paced(pf, 32);
    }
    _mm512_storeu_ps(sc, _mm512_mul_ps(reduce16x16(a), _mm512_set1_ps(scale)));
}

// P.V over columns [d, d + width) for `heads` heads of a group (width 64, 32 or 16; heads 1-3):
// acc_j = acc_j * alpha_j + sum_t p_j[t] * row[t], acc: [heads, D]. Each 32-column group of the
// accumulators is in split order (its 16 even columns, then its 16 odd ones: a shift and a mask
// widen bf16 pairs); a 16-column tail is in order.
static inline __attribute__((always_inline)) void pv_avx512(float *acc, int64_t D, const float *alpha,
                                                            const float *p, int64_t C, const void *const *row,
                                                            int64_t n, int64_t d, int width, int heads,
                                                            Prefetcher *pf) {
    const int nv = width / 16;
    const __m512i hi_mask = _mm512_set1_epi32((int)0xffff0000u);
    __m512 a[3][4];
#pragma GCC unroll 3
    for (int h = 0; h < heads; h++)
#pragma GCC unroll 4
        for (int j = 0; j < nv; j++)
            a[h][j] = _mm512_mul_ps(_mm512_loadu_ps(acc + h * D + d + 16 * j), _mm512_set1_ps(alpha[h]));
    for (int64_t t = 0; t < n; t++) {
        const uint16_t *r = (const uint16_t *)row[t] + d;
        __m512 x[4];
        if (width >= 32) {
#pragma GCC unroll 2
            for (int k = 0; k < width / 32; k++) {
                const __m512i w = _mm512_loadu_si512(r + 32 * k);
                x[2 * k] = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
                x[2 * k + 1] = _mm512_castsi512_ps(_mm512_and_si512(w, hi_mask));
            }
        } else {
            x[0] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)r)), 16));
        }
#pragma GCC unroll 3
        for (int h = 0; h < heads; h++) {
            const __m512 b = _mm512_set1_ps(p[h * C + t]);
#pragma GCC unroll 4
            for (int j = 0; j < nv; j++) a[h][j] = _mm512_fmadd_ps(b, x[j], a[h][j]);
        }
        prefetch_paced(pf, heads * width / 8);
    }
#pragma GCC unroll 3
    for (int h = 0; h < heads; h++)
#pragma GCC unroll 4
        for (int j = 0; j < nv; j++) _mm512_storeu_ps(acc + h * D + d + 16 * j, a[h][j]);
}

static inline __attribute__((always_inline)) void pv_heads_avx512(float *acc, int64_t D, const float *alpha,
                                                                  const float *p, int64_t C,
                                                                  const void *const *row, int64_t n, int heads,
                                                                  Prefetcher *pf) {
    int64_t d = 0;
    for (; d + 64 <= D; d += 64) pv_avx512(acc, D, alpha, p, C, row, n, d, 64, heads, pf);
    if (d + 32 <= D) {
        pv_avx512(acc, D, alpha, p, C, row, n, d, 32, heads, pf);
        d += 32;
    }
    if (d < D) pv_avx512(acc, D, alpha, p, C, row, n, d, 16, heads, pf);
}

// acc[g] = acc[g] * alpha[g] + P[g] . V for the group's heads, three at a time; acc: [G, D], p: [G, C].
static void group_pv_avx512(float *acc, const float *alpha, const float *p, int64_t C, const void *const *row,
                            int64_t n, int64_t D, int64_t G, Prefetcher *pf) {
    int64_t g = 0;
    for (; g + 3 <= G; g += 3) pv_heads_avx512(acc + g * D, D, alpha + g, p + g * C, C, row, n, 3, pf);
    if (G - g == 2) pv_heads_avx512(acc + g * D, D, alpha + g, p + g * C, C, row, n, 2, pf);
    if (G - g == 1) pv_heads_avx512(acc + g * D, D, alpha + g, p + g * C, C, row, n, 1, pf);
}

// sc[g][0:npad] for the group's heads (q: bf16 [G, D]) against rows[0:npad], npad a multiple of 16.
static void group_scores_avx512(const uint16_t *q, const void *const *row, int64_t npad, int64_t D, int64_t G,
                                int64_t C, float scale, float *sc, Prefetcher *pf) {
    for (int64_t g = 0; g < G; g++)
        for (int64_t t = 0; t < npad; t += TILE16) scores16_avx512(q + g * D, row + t, D, scale, sc + g * C + t, pf);
}
#else
#define QW_DECODE_AVX512 0
#endif

// Online-softmax step for one head over a chunk: sc[0:n8] scores in, pr[0:n8] probabilities out
// (zero past n); updates m, l and returns the factor for the old accumulator.
static inline float softmax_step(float *sc, float *pr, int64_t n, int64_t n8, float *m, float *l) {
    for (int64_t t = n; t < n8; t++) sc[t] = -INFINITY;
    v8f vm = splat8(*m);
    for (int64_t t = 0; t < n8; t += 8) vm = vmax8(vm, loadu8(sc + t));
    const float mx = hmax8(vm);
    // On the first chunk m = -inf and nothing is accumulated yet, so alpha's value is moot.
    const float alpha = *m == -INFINITY ? 0.0f : vexp_nonpos8(splat8(*m - mx))[0];
    v8f vs = splat8(0.0f);
    for (int64_t t = 0; t < n8; t += 8) {
        const v8f e = vexp_nonpos8(loadu8(sc + t) - splat8(mx));
        storeu8(pr + t, e);
        vs += e;
    }
    // Padding lanes (scored -inf) come out of vexp_nonpos8 as exactly 0.
    *m = mx;
    *l = *l * alpha + hsum8(vs);
    return alpha;
}

#if QW_DECODE_AVX512
// softmax_step at 16 lanes, for chunks padded to 16 tokens (half the exp and max instructions).
static inline float softmax_step16(float *sc, float *pr, int64_t n, int64_t n16, float *m, float *l) {
    for (int64_t t = n; t < n16; t++) sc[t] = -INFINITY;
    v16f vm = splat16(*m);
    for (int64_t t = 0; t < n16; t += 16) vm = vmax16(vm, loadu16(sc + t));
    const float mx = hmax16(vm);
    const float alpha = *m == -INFINITY ? 0.0f : vexp_nonpos8(splat8(*m - mx))[0];
    v16f vs = splat16(0.0f);
    for (int64_t t = 0; t < n16; t += 16) {
        const v16f e = vexp_nonpos16(loadu16(sc + t) - splat16(mx));
        storeu16(pr + t, e);
        vs += e;
    }
    *m = mx;
    *l = *l * alpha + hsum16(vs);
    return alpha;
}
#endif

// Runs the tokens [u->begin, u->end) of one sequence; leaves s->acc, s->m, s->l for all heads.
// next_unit (may be NULL): what this thread runs next, whose first chunk it prefetches.
static inline __attribute__((always_inline)) void run_unit_impl(const Params *p, const Unit *u,
                                                                const Unit *next_unit, Scratch *s, int *err,
                                                                int bf16) {
    const int64_t H = p->num_heads, KV = p->num_kv_heads, D = p->head_dim, G = H / KV;
    const int64_t BS = p->block_size, C = CHUNK, rec = KV * D;  // rec: elements per token
    const int64_t esize = bf16 ? 2 : 4;
    const int32_t *table = p->block_tables + (int64_t)u->seq * p->max_blocks;
    // The AVX-512 path scores 16 tokens at a time from the bf16 q itself; the generic one 8 (or 4).
    const int wide = QW_DECODE_AVX512 && bf16;
    const int64_t tile = wide ? 16 : 8;

    // qs: [H, D] = q[seq] * scale in fp32 (bf16: in the split order of load_bf16x16_split).
    const char *q = (const char *)p->q + (int64_t)u->seq * H * D * esize;
    for (int64_t i = 0; !wide && i < H * D; i += 16) {
        v8f a, b;
        load16(q, i, bf16, &a, &b);
        storeu8(s->qs + i, a * splat8(p->scale));
        storeu8(s->qs + i + 8, b * splat8(p->scale));
    }
    memset(s->acc, 0, (size_t)(H * D) * sizeof(float));
    for (int64_t h = 0; h < H; h++) {
        s->m[h] = -INFINITY;
        s->l[h] = 0.0f;
    }

    const void *krow[CHUNK], *vrow[CHUNK];
    Prefetcher pf;
    for (int64_t c0 = u->begin; c0 < u->end; c0 += C) {
        const int64_t n = (u->end - c0 < C) ? u->end - c0 : C;
        const int64_t n8 = (n + tile - 1) / tile * tile;  // padded to whole score tiles
        // Block by block: one division per chunk, not two per token (a 64-bit division costs tens of
        // cycles, as much as a token's scores on the AVX-512 path).
        for (int64_t t = 0, bi = c0 / BS, in = c0 % BS; t < n; bi++, in = 0) {
            int64_t block = table[bi];
            if (block < 0 || block >= p->num_blocks) {
                *err = QW_BAD_BLOCK_ID;
                block = 0;  // keep reading in bounds; the caller raises
            }
            for (int64_t off = (block * BS + in) * rec; in < BS && t < n; in++, t++, off += rec) s->tok_off[t] = off;
        }
        // The next chunk, or the first chunk of the thread's next unit, is prefetched while this
        // one computes.
        const int32_t *pf_table = table;
        int64_t pf_begin = 0, pf_end = 0;
        if (c0 + C < u->end) {
            pf_begin = c0 + C;
            pf_end = pf_begin + C < u->end ? pf_begin + C : u->end;
        } else if (next_unit) {
            pf_table = p->block_tables + (int64_t)next_unit->seq * p->max_blocks;
            pf_begin = next_unit->begin;
            pf_end = pf_begin + C < next_unit->end ? pf_begin + C : next_unit->end;
        }
        const int64_t pf_lines = plan_prefetch(&pf, p, pf_table, pf_begin, pf_end);
        // Vector FMAs in this chunk: D/8 per head and token for the scores (n8 tokens) and for P.V.
        // A faster pace (done by 80% or 50% of the chunk) or a lookahead of two chunks measured
        // slower: the misses in flight are the limit, not how early they are asked for.
        pf.rate = pf_lines * 65536 / (H * (n8 + n) * D / 8);

        for (int64_t kvh = 0; kvh < KV; kvh++) {
            const char *k = (const char *)p->k + kvh * D * esize, *v = (const char *)p->v + kvh * D * esize;
            for (int64_t t = 0; t < n; t++) {
                krow[t] = k + s->tok_off[t] * esize;
                vrow[t] = v + s->tok_off[t] * esize;
            }
            for (int64_t t = n; t < n8; t++) krow[t] = s->zero;

            // Scores, then softmax, for all heads of the group before any P.V: independent work
            // that the core can overlap.
            const int64_t h0 = kvh * G;
#if QW_DECODE_AVX512
            if (wide)
                group_scores_avx512((const uint16_t *)q + h0 * D, krow, n8, D, G, C, p->scale, s->sc, &pf);
            else
#endif
                group_scores(s->qs + h0 * D, krow, n8, D, G, C, s->sc, bf16, &pf);
            if (p->has_soft_cap)  // padding lanes too: softmax_step masks them after
                for (int64_t g = 0; g < G; g++)
                    for (int64_t t = 0; t < n8; t += 8)
                        storeu8(s->sc + g * C + t, vsoft_cap8(loadu8(s->sc + g * C + t), p->soft_cap));
            for (int64_t g = 0; g < G; g++) {
                float *sc = s->sc + g * C, *pr = s->pr + g * C, *m = s->m + h0 + g, *l = s->l + h0 + g;
#if QW_DECODE_AVX512
                if (wide) {
                    s->alpha[g] = softmax_step16(sc, pr, n, n8, m, l);
                    continue;
                }
#endif
                s->alpha[g] = softmax_step(sc, pr, n, n8, m, l);
            }
#if QW_DECODE_AVX512
            if (wide)
                group_pv_avx512(s->acc + h0 * D, s->alpha, s->pr, C, vrow, n, D, G, &pf);
            else
#endif
                group_pv(s->acc + h0 * D, s->alpha, s->pr, C, vrow, n, D, G, bf16, &pf);
        }
        prefetch_rest(&pf);  // rounding leftovers
    }
}

static void run_unit(const Params *p, const Unit *u, const Unit *next_unit, Scratch *s, int *err) {
    if (p->is_bf16)
        run_unit_impl(p, u, next_unit, s, err, 1);
    else
        run_unit_impl(p, u, next_unit, s, err, 0);
}

static void store_row(const Params *p, int64_t seq, int64_t h, const float *x, float inv) {
    const int64_t D = p->head_dim, off = (seq * p->num_heads + h) * D;
    if (p->is_bf16 && QW_DECODE_AVX512) {
        uint16_t *o = (uint16_t *)p->out + off;
        // x is in pv_avx512's order: each 32-group split (16 even columns, 16 odd), a 16-tail in order.
        int64_t d = 0;
        for (; d + 32 <= D; d += 32)
            for (int64_t j = 0; j < 16; j++) {
                o[d + 2 * j] = f32_to_bf16(x[d + j] * inv);
                o[d + 2 * j + 1] = f32_to_bf16(x[d + 16 + j] * inv);
            }
        for (; d < D; d++) o[d] = f32_to_bf16(x[d] * inv);
    } else if (p->is_bf16) {
        uint16_t *o = (uint16_t *)p->out + off;
        // x is in the split order of load_bf16x16_split; put each 16-group back in order.
        for (int64_t d = 0; d < D; d += 16)
            for (int64_t j = 0; j < 8; j++) {
                o[d + 2 * j] = f32_to_bf16(x[d + j] * inv);
                o[d + 2 * j + 1] = f32_to_bf16(x[d + 8 + j] * inv);
            }
    } else {
        float *o = (float *)p->out + off;
        for (int64_t d = 0; d < D; d++) o[d] = x[d] * inv;
    }
}

static int by_length_desc(const void *a, const void *b) {
    const Unit *x = a, *y = b;
    const int64_t lx = x->end - x->begin, ly = y->end - y->begin;
    return (lx < ly) - (lx > ly);
}

// Entry point (ctypes). Pointers are to contiguous tensors in the layouts above; q, k, v and out are
// fp32, or bf16 when is_bf16. Each query sees the last `window` keys of its sequence (a window of
// max_blocks * block_size or more: all of them), and with has_soft_cap its scaled scores are
// capped to (-soft_cap, soft_cap) by tanh. head_dim must be a multiple of 16 up to MAX_HEAD_DIM and num_heads a
// multiple of num_kv_heads. Returns QW_OK, or an error code with `out` partly written.
int qw_paged_decode_attention(const void *q, const void *k, const void *v, const int32_t *block_tables,
                              const int32_t *seq_lens, void *out, int64_t num_seqs, int64_t num_heads,
                              int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks,
                              int64_t num_blocks, float scale, int64_t window, int has_soft_cap, float soft_cap,
                              int is_bf16, int num_threads) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || head_dim % 16 != 0 || head_dim > MAX_HEAD_DIM ||
        block_size <= 0 || num_threads <= 0 || window < 1 || (has_soft_cap && !(soft_cap > 0.0f)))
        return QW_BAD_SHAPE;
    if (num_seqs == 0) return QW_OK;

    Params p = {q, k, v, block_tables, seq_lens, out, num_seqs, num_heads, num_kv_heads, head_dim,
                block_size, max_blocks, num_blocks, scale, is_bf16, window, has_soft_cap, soft_cap};

    // Lengths below count the keys each query sees: its window, or its whole context.
    int64_t total = 0, max_len = 0;
    for (int64_t i = 0; i < num_seqs; i++) {
        const int64_t len = seq_lens[i];
        if (len < 1 || len > max_blocks * block_size) return QW_BAD_SEQ_LEN;
        const int64_t seen = len - window_begin(&p, len);
        total += seen;
        max_len = seen > max_len ? seen : max_len;
    }
    // Small batches run on the calling thread: waking the pool (microseconds, tens if its threads
    // sleep) costs more than it saves below ~1000 tokens of SmolLM2-135M (~60 us of work).
    const int64_t work = total * num_heads * head_dim;
    const int parallel = num_threads > 1 && work > (1 << 19);
    // Split sequences only when there are too few to share out; each split costs a merge.
    int64_t part = max_len;
    if (parallel && num_seqs < 4 * (int64_t)num_threads) {
        const int64_t target = 8 * (int64_t)num_threads;
        part = ((total + target - 1) / target + CHUNK - 1) / CHUNK * CHUNK;
        if (part < 2 * CHUNK) part = 2 * CHUNK;
    }
    int64_t num_units = 0, num_slots = 0;
    for (int64_t i = 0; i < num_seqs; i++) {
        const int64_t seen = seq_lens[i] - window_begin(&p, seq_lens[i]);
        const int64_t parts = (seen + part - 1) / part;
        num_units += parts;
        if (parts > 1) num_slots += parts;
    }
    Unit *units = malloc((size_t)num_units * sizeof(Unit));
    int32_t *split_seqs = malloc((size_t)num_seqs * sizeof(int32_t));
    int64_t *first_slot = malloc((size_t)num_seqs * sizeof(int64_t));
    // Partial results of split sequences: per slot [H, D] acc then [H] m then [H] l.
    const int64_t slot_floats = num_heads * head_dim + 2 * num_heads;
    float *partial = num_slots ? malloc((size_t)(num_slots * slot_floats) * sizeof(float)) : NULL;
    if (!units || !split_seqs || !first_slot || (num_slots && !partial)) {
        free(units);
        free(split_seqs);
        free(first_slot);
        free(partial);
        return QW_NO_MEMORY;
    }
    int64_t num_split = 0, slot = 0, ui = 0;
    for (int64_t i = 0; i < num_seqs; i++) {
        const int64_t len = seq_lens[i], begin = window_begin(&p, len);
        const int64_t parts = (len - begin + part - 1) / part;
        first_slot[i] = parts > 1 ? slot : -1;
        if (parts > 1) split_seqs[num_split++] = (int32_t)i;
        for (int64_t j = 0; j < parts; j++) {
            const int64_t b = begin + j * part, e = b + part < len ? b + part : len;
            units[ui++] = (Unit){(int32_t)i, parts > 1 ? (int32_t)(slot++) : -1, b, e};
        }
    }
    qsort(units, (size_t)num_units, sizeof(Unit), by_length_desc);

    int err = QW_OK;
    int64_t next_index = 0;
#pragma omp parallel num_threads(num_threads) if (parallel)
    {
        Scratch s;
        int ok = scratch_alloc(&s, &p) == QW_OK;
        if (!ok) {
#pragma omp atomic write
            err = QW_NO_MEMORY;
        }
        int local_err = QW_OK;
        // Units are claimed one at a time, longest first (balances mixed lengths), and the next one
        // is claimed before the current one starts so that its first chunk can be prefetched.
        int64_t cur = ok ? __atomic_fetch_add(&next_index, 1, __ATOMIC_RELAXED) : num_units;
        while (cur < num_units) {
            const int64_t after = __atomic_fetch_add(&next_index, 1, __ATOMIC_RELAXED);
            const Unit *u = &units[cur];
            run_unit(&p, u, after < num_units ? &units[after] : NULL, &s, &local_err);
            if (u->slot < 0) {
                for (int64_t h = 0; h < num_heads; h++)
                    store_row(&p, u->seq, h, s.acc + h * head_dim, 1.0f / s.l[h]);
            } else {
                float *dst = partial + u->slot * slot_floats;
                memcpy(dst, s.acc, (size_t)(num_heads * head_dim) * sizeof(float));
                memcpy(dst + num_heads * head_dim, s.m, (size_t)num_heads * sizeof(float));
                memcpy(dst + num_heads * head_dim + num_heads, s.l, (size_t)num_heads * sizeof(float));
            }
            cur = after;
        }
#pragma omp barrier
        // Merge the parts of split sequences: rescale each to the common max, then normalise.
#pragma omp for schedule(static)
        for (int64_t i = 0; i < num_split; i++) {
            if (!ok) continue;
            const int64_t seq = split_seqs[i], len = seq_lens[seq];
            const int64_t parts = (len - window_begin(&p, len) + part - 1) / part;
            const float *base = partial + first_slot[seq] * slot_floats;
            for (int64_t h = 0; h < num_heads; h++) {
                float mx = -INFINITY, sum = 0.0f;
                for (int64_t j = 0; j < parts; j++) {
                    const float mj = base[j * slot_floats + num_heads * head_dim + h];
                    mx = mj > mx ? mj : mx;
                }
                float *acc = s.acc;  // reused as [D] scratch
                memset(acc, 0, (size_t)head_dim * sizeof(float));
                for (int64_t j = 0; j < parts; j++) {
                    const float *slot_j = base + j * slot_floats;
                    const float w = expf(slot_j[num_heads * head_dim + h] - mx);
                    sum += w * slot_j[num_heads * head_dim + num_heads + h];
                    for (int64_t d = 0; d < head_dim; d++) acc[d] += w * slot_j[h * head_dim + d];
                }
                store_row(&p, seq, h, acc, 1.0f / sum);
            }
        }
        if (local_err != QW_OK) {
#pragma omp atomic write
            err = local_err;
        }
        if (ok) free(s.base);
    }
    free(units);
    free(split_seqs);
    free(first_slot);
    free(partial);
    return err;
}

// Which bf16 code this build runs: 1 for the AVX512-BF16 path, 0 for the generic one.
int qw_paged_decode_bf16_variant(void) { return QW_DECODE_AVX512; }

// ---- KV-cache write -----------------------------------------------------------------------------

// The step's new K and V rows into their cache slots: row t of k and v goes to slot
// slot_mapping[t] of k_cache and v_cache ([num_slots, row_bytes] each). k and v rows may be
// strided (views into the qkv matmul's output); within a row the heads are packed. One memcpy per
// row: torch's index_copy_ costs about 70 us per call at 128 rows here, two calls a layer.
// Returns QW_BAD_BLOCK_ID, having written nothing, when a slot is outside [0, num_slots).
int qw_write_kv_cache(const void *k, int64_t k_stride, const void *v, int64_t v_stride, void *k_cache,
                      void *v_cache, const int64_t *slot_mapping, int64_t num_tokens, int64_t num_slots,
                      int64_t row_bytes) {
    // Strides are in bytes here.
    for (int64_t t = 0; t < num_tokens; t++)
        if (slot_mapping[t] < 0 || slot_mapping[t] >= num_slots) return QW_BAD_BLOCK_ID;
    // One thread: a full 2,048-row bf16 budget (SmolLM2-135M, 0.8 MB each for K and V) takes
    // 60 us; two threads took longer on the loaded 2-core machine (100 us) and gain little idle.
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t slot = slot_mapping[t];
        memcpy((char *)k_cache + slot * row_bytes, (const char *)k + t * k_stride, (size_t)row_bytes);
        memcpy((char *)v_cache + slot * row_bytes, (const char *)v + t * v_stride, (size_t)row_bytes);
    }
    return QW_OK;
}
