// The model's elementwise ops for the CPU, each in one pass over its rows: residual add + RMSNorm,
// RMSNorm, rotary embedding of q and k straight out of the fused qkv matmul, and SiLU-and-mul.
//
// Built at first use by cpu_fused_ops.py (`gcc -O3 -march=native -fopenmp -ffp-contract=off`) and
// called through ctypes. In torch each of these is 4 to 10 separate ops, each a pass over memory
// with a temporary and a dispatch; here a row is read once and written once.
//
// At SmolLM2 sizes the ops are bound by instructions, not memory (a 2048 x 3072 gate_up block is in
// the last-level cache), so the loops are written for few instructions per element: 32 elements a
// step in two 16-lane vectors, bf16 widened and narrowed by shifts on 32-bit words (see `block`),
// bf16 rounding in four integer ops, and SiLU's exp with FMA and without branches. Against the
// auto-vectorized 8-lane loops of the same steps: about 2x on one core (bench_cpu_elementwise.py).
//
// Rounding follows the torch reference ops (transformers' order) step by step: in bf16, every
// intermediate that torch rounds to bf16 is rounded here too (round to nearest even), and products
// and sums are computed in fp32 as torch computes them; -ffp-contract=off keeps a * b - c * d from
// becoming an FMA with one rounding fewer; the RMSNorm's sum of squares is added in the order of
// torch's sum kernel (see SquareSum). What can differ from torch: exp in SiLU (an ulp or two here;
// torch uses its own vectorized exp). In bf16 that vanishes in the final rounding but for a rare
// tie; in fp32 it is ulp-level.
//
// Layouts (element offsets; row strides given where rows are not packed):
//   rms norm:  x [rows, n] (stride x_stride), residual [rows, n], weight [n], out [rows, n]
//   rotary:    q [rows, H, D] (stride q_stride), k [rows, KVH, D] (stride k_stride); q_out, k_out
//              packed; positions [rows] int64; cos, sin [max_positions, D / 2] fp32
//   silu:      x [rows, 2 I] (stride x_stride: gate then up), out [rows, I]
//   argmax:    logits [rows, vocab] (stride), out [rows] int64
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_simd.h"

enum { QW_OK = 0, QW_BAD_POSITION = 1 };

// x rounded to bf16 and back (the value torch holds after storing x in a bf16 tensor).
static inline float round_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

static inline float load(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store(void *p, int64_t i, float x, int bf16) {
    if (bf16)
        ((uint16_t *)p)[i] = f32_to_bf16(x);
    else
        ((float *)p)[i] = x;
}

// The vector loops work in blocks of 32 elements held as two 16-lane vectors (one AVX-512 register
// each; GCC splits them on narrower targets), and leave a row's last n % 32 elements to the scalar
// load/store above, which round the same way lane for lane. In fp32 a block is elements 0-15 and
// 16-31; in bf16 it is the even and the odd elements, because 32 bf16 read as 16 uint32 words
// widen to fp32 with one shift (even) and one mask (odd), and narrow back with one shift and an or.
// Every operand of an op is loaded the same way, so the elementwise results land where they belong.
typedef uint32_t v16u __attribute__((vector_size(64)));

typedef struct {
    v16f a, b;
} block;

#define BLOCK 32

static inline block bload(const void *p, int64_t i, int bf16) {
    block r;
    if (bf16) {
        v16u w;
        memcpy(&w, (const uint16_t *)p + i, sizeof w);
        r.a = (v16f)(w << 16);
        r.b = (v16f)(w & 0xffff0000u);
    } else {
        memcpy(&r.a, (const float *)p + i, sizeof r.a);
        memcpy(&r.b, (const float *)p + i + 16, sizeof r.b);
    }
    return r;
}

// The bits of x rounded to bf16 (round to nearest even) in the high half of each lane: f32_to_bf16
// of every lane, shifted left by 16, without its NaN case. Every value rounded here is the result
// of fp32 arithmetic on bf16 inputs, so a NaN is quiet with its low 16 bits zero (its payload
// comes from a bf16 input, or it is the default NaN), and adding 0x7fff + lsb leaves its high
// half as it is: the same bits as f32_to_bf16 gives.
static inline v16u vbf16_bits(v16f x) {
    const v16u w = (v16u)x;
    return (w + ((w >> 16) & 1u) + 0x7fffu) & 0xffff0000u;
}

// x rounded to the dtype (a no-op in fp32).
static inline v16f vround(v16f x, int bf16) { return bf16 ? (v16f)vbf16_bits(x) : x; }

// Stores a block already rounded to the dtype (in bf16: low 16 bits zero in every lane).
static inline void bstore_exact(void *p, int64_t i, block x, int bf16) {
    if (bf16) {
        const v16u w = ((v16u)x.a >> 16) | (v16u)x.b;
        memcpy((uint16_t *)p + i, &w, sizeof w);
    } else {
        memcpy((float *)p + i, &x.a, sizeof x.a);
        memcpy((float *)p + i + 16, &x.b, sizeof x.b);
    }
}

// Stores a block rounded to the dtype.
static inline void bstore(void *p, int64_t i, block x, int bf16) {
    x.a = vround(x.a, bf16);
    x.b = vround(x.b, bf16);
    bstore_exact(p, i, x, bf16);
}

// Threads for `elements` of work: one below ~64K elements, where waking the pool costs more than
// it saves (a 128 x 576 decode row block is 74K).
static inline int threads_for(int64_t elements, int num_threads) {
    return elements >= (1 << 16) && num_threads > 1 ? num_threads : 1;
}

// ---- RMSNorm ------------------------------------------------------------------------------------

// CeilLog2 of torch's reduction utilities: 1 up to 2, else the bit width of x - 1.
static inline int ceil_log2(int64_t x) { return x <= 2 ? 1 : 64 - __builtin_clzll((unsigned long long)(x - 1)); }

// The sum of a row's squares in the order torch's sum kernel adds them (x.pow(2).mean(-1) is that
// sum divided by n; the kernel is built for AVX2 on every x86 capability, so the order is the same
// on the AVX2 and AVX-512 machines): 8-lane vectors taken 4 at a time, i.e. 32 partial sums, one
// per element index mod 32, over the row's whole 32-element blocks with a cascade of 4 levels
// every 2^level_power blocks; then the leftover 8-element vectors into the first 8 partial sums,
// the other 24 into those 8, and a scalar sum of the last n % 8 squares and then of the 8 lanes.
// Checked bit for bit against torch on random rows of 64 to 5,120 elements
// (tests/kernels/test_cpu_fused_ops.py); a different order changes the variance's last bit, which
// flipped about 5 in a million bf16 outputs of the norms on real activations.
typedef struct {
    v16f a[4], b[4];  // the cascade's levels, each 32 partial sums in the block's lane order
    int64_t blocks;   // whole blocks added so far
    int64_t level_mask;
    int level_power;
} SquareSum;

static inline void square_sum_init(SquareSum *q, int64_t num_blocks) {
    for (int l = 0; l < 4; l++) q->a[l] = q->b[l] = splat16(0.0f);
    q->blocks = 0;
    const int power = ceil_log2(num_blocks) / 4;  // torch: max(4, CeilLog2(size) / num_levels)
    q->level_power = power > 4 ? power : 4;
    q->level_mask = ((int64_t)1 << q->level_power) - 1;
}

static inline __attribute__((always_inline)) void square_sum_block(SquareSum *q, block v) {
    q->a[0] += v.a * v.a;
    q->b[0] += v.b * v.b;
    if ((++q->blocks & q->level_mask) != 0) return;
    // A full step of 2^level_power blocks: carry each level into the next while its count is due.
    for (int l = 1; l < 4; l++) {
        q->a[l] += q->a[l - 1];
        q->b[l] += q->b[l - 1];
        q->a[l - 1] = q->b[l - 1] = splat16(0.0f);
        if ((q->blocks & (q->level_mask << (l * q->level_power))) != 0) break;
    }
}

// The total; h holds the row in fp32, whole blocks in lane order, the rest (n % 32) as it is.
static inline float square_sum_total(const SquareSum *q, const float *h, int64_t n, int bf16) {
    const v16f ta = ((q->a[0] + q->a[1]) + q->a[2]) + q->a[3];
    const v16f tb = ((q->b[0] + q->b[1]) + q->b[2]) + q->b[3];
    float part[32];  // by element index mod 32
    for (int j = 0; j < 16; j++) {
        part[bf16 ? 2 * j : j] = ta[j];
        part[bf16 ? 2 * j + 1 : 16 + j] = tb[j];
    }
    const int64_t done = q->blocks * BLOCK, vectors_end = n / 8 * 8;
    float lanes[8];
    for (int l = 0; l < 8; l++) lanes[l] = part[l];
    for (int64_t i = done; i < vectors_end; i += 8)
        for (int l = 0; l < 8; l++) lanes[l] += h[i + l] * h[i + l];
    for (int k = 1; k < 4; k++)
        for (int l = 0; l < 8; l++) lanes[l] += part[8 * k + l];
    float sum = 0.0f;
    for (int64_t i = vectors_end; i < n; i++) sum += h[i] * h[i];
    for (int l = 0; l < 8; l++) sum += lanes[l];
    return sum;
}

static inline __attribute__((always_inline)) void rms_norm_row(const void *x, void *residual, const void *weight,
                                                               void *out, int64_t n, float eps, int has_residual,
                                                               int bf16, float *h) {
    // h: the row in fp32 (x + residual, rounded to the dtype as torch's add rounds it), each block
    // in its lane order. Pass 1 writes it (and the sum into residual) and sums the squares of its
    // whole blocks; square_sum_total adds the rest in torch's order.
    SquareSum squares;
    square_sum_init(&squares, n / BLOCK);
    int64_t i = 0;
    for (; i + BLOCK <= n; i += BLOCK) {
        block v = bload(x, i, bf16);
        if (has_residual) {
            const block r = bload(residual, i, bf16);
            v.a = vround(v.a + r.a, bf16);
            v.b = vround(v.b + r.b, bf16);
            bstore_exact(residual, i, v, bf16);
        }
        storeu16(h + i, v.a);
        storeu16(h + i + 16, v.b);
        square_sum_block(&squares, v);
    }
    for (; i < n; i++) {
        float v = load(x, i, bf16);
        if (has_residual) {
            v = v + load(residual, i, bf16);
            if (bf16) v = round_bf16(v);
            store(residual, i, v, bf16);
        }
        h[i] = v;
    }
    const float sum = square_sum_total(&squares, h, n, bf16);
    const float inv = 1.0f / sqrtf(sum / (float)n + eps);
    // Pass 2, from h in L1: out = weight * (h * inv), with h * inv rounded to the dtype first in
    // bf16 (transformers' hidden.to(dtype) before the weight).
    const v16f vinv = splat16(inv);
    for (i = 0; i + BLOCK <= n; i += BLOCK) {
        const block w = bload(weight, i, bf16);
        block o;
        o.a = w.a * vround(loadu16(h + i) * vinv, bf16);
        o.b = w.b * vround(loadu16(h + i + 16) * vinv, bf16);
        bstore(out, i, o, bf16);
    }
    for (; i < n; i++) {
        const float normed = h[i] * inv;
        store(out, i, load(weight, i, bf16) * (bf16 ? round_bf16(normed) : normed), bf16);
    }
}

// out = rms_norm(x (+ residual)) * weight; with has_residual, residual = x + residual first (in
// place). Rows of x are x_stride elements apart; residual and out are packed [rows, n].
int qw_rms_norm(const void *x, int64_t x_stride, void *residual, const void *weight, void *out, int64_t rows,
                int64_t n, float eps, int has_residual, int is_bf16, int num_threads) {
    const int nt = threads_for(rows * n, num_threads);
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        float h[n];
        const int64_t esize = is_bf16 ? 2 : 4;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            const char *xr = (const char *)x + r * x_stride * esize;
            char *res = has_residual ? (char *)residual + r * n * esize : NULL;
            char *o = (char *)out + r * n * esize;
            if (is_bf16)
                rms_norm_row(xr, res, weight, o, n, eps, has_residual, 1, h);
            else
                rms_norm_row(xr, res, weight, o, n, eps, has_residual, 0, h);
        }
    }
    return QW_OK;
}

// ---- rotary -------------------------------------------------------------------------------------

// Rotate-half convention (HF Llama): for i < D/2, with c, s = cos, sin of the position cast to the
// dtype, out[i] = x[i] c - x[i + D/2] s and out[i + D/2] = x[i + D/2] c + x[i] s, each product and
// the sum rounded to the dtype. c and s are in block order (see block_order): each whole block of
// 32 as its two vectors hold it, the tail as it is.
static inline __attribute__((always_inline)) void rotate_head(const void *x, void *out, const float *c,
                                                              const float *s, int64_t half, int bf16) {
    int64_t i = 0;
    for (; i + BLOCK <= half; i += BLOCK) {
        const block x1 = bload(x, i, bf16), x2 = bload(x, i + half, bf16);
        const v16f ca = loadu16(c + i), cb = loadu16(c + i + 16), sa = loadu16(s + i), sb = loadu16(s + i + 16);
        block lo, hi;
        lo.a = vround(x1.a * ca, bf16) - vround(x2.a * sa, bf16);
        lo.b = vround(x1.b * cb, bf16) - vround(x2.b * sb, bf16);
        hi.a = vround(x2.a * ca, bf16) + vround(x1.a * sa, bf16);
        hi.b = vround(x2.b * cb, bf16) + vround(x1.b * sb, bf16);
        bstore(out, i, lo, bf16);
        bstore(out, i + half, hi, bf16);
    }
    for (; i < half; i++) {
        const float x1 = load(x, i, bf16), x2 = load(x, i + half, bf16);
        float a = x1 * c[i], b = x2 * s[i], d = x2 * c[i], e = x1 * s[i];
        if (bf16) {
            a = round_bf16(a);
            b = round_bf16(b);
            d = round_bf16(d);
            e = round_bf16(e);
        }
        store(out, i, a - b, bf16);
        store(out, i + half, d + e, bf16);
    }
}

// Where element i of a row of n goes when the row is kept in block order: within each whole block
// of 32, the lanes of its two vectors (bf16: even elements, then odd); the tail stays in place.
static inline int64_t block_order(int64_t i, int64_t n, int bf16) {
    const int64_t start = i / BLOCK * BLOCK, j = i % BLOCK;
    if (!bf16 || start + BLOCK > n) return i;
    return start + (j % 2 ? 16 + j / 2 : j / 2);
}

// q_out, k_out = rotary(q, k). Rows of q and k are q_stride and k_stride elements apart (views
// into the fused qkv matmul's output); within a row, heads are packed.
int qw_rotary(const void *q, int64_t q_stride, const void *k, int64_t k_stride, const int64_t *positions,
              const float *cos_table, const float *sin_table, int64_t max_positions, void *q_out, void *k_out,
              int64_t rows, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int is_bf16,
              int num_threads) {
    const int64_t half = head_dim / 2, esize = is_bf16 ? 2 : 4;
    for (int64_t r = 0; r < rows; r++)
        if (positions[r] < 0 || positions[r] >= max_positions) return QW_BAD_POSITION;
    const int nt = threads_for(rows * (num_heads + num_kv_heads) * head_dim, num_threads);
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        float c[half], s[half];
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            const float *cr = cos_table + positions[r] * half, *sr = sin_table + positions[r] * half;
            for (int64_t i = 0; i < half; i++) {
                const int64_t at = block_order(i, half, is_bf16);
                c[at] = is_bf16 ? round_bf16(cr[i]) : cr[i];
                s[at] = is_bf16 ? round_bf16(sr[i]) : sr[i];
            }
            for (int64_t h = 0; h < num_heads + num_kv_heads; h++) {
                const int is_q = h < num_heads;
                const int64_t head = is_q ? h : h - num_heads;
                const char *x = is_q ? (const char *)q + (r * q_stride + head * head_dim) * esize
                                     : (const char *)k + (r * k_stride + head * head_dim) * esize;
                char *o = is_q ? (char *)q_out + (r * num_heads + head) * head_dim * esize
                               : (char *)k_out + (r * num_kv_heads + head) * head_dim * esize;
                if (is_bf16)
                    rotate_head(x, o, c, s, half, 1);
                else
                    rotate_head(x, o, c, s, half, 0);
            }
        }
    }
    return QW_OK;
}

// ---- SiLU and mul -------------------------------------------------------------------------------

// a * b + c with one rounding where the CPU has FMA: the file is built with -ffp-contract=off (for
// the ops that must round as torch does), but exp's polynomial only needs to be accurate, and half
// its instructions go away with FMA.
#ifdef __FMA__
#define MADD(a, b, c) __builtin_fmaf((a), (b), (c))
#else
#define MADD(a, b, c) ((a) * (b) + (c))
#endif

// exp(x) by Cody-Waite range reduction and the Cephes expf polynomial, about 2 ulp, branch-free so
// that the loop below vectorizes. Below -87.3 it returns exp(-87.3) (silu's x / (1 + exp(-x)) is
// then x, as with the true exp); above 88.72 it returns inf, as expf does.
static inline float exp_approx(float x) {
    const float xc = x < -87.3f ? -87.3f : (x > 88.72f ? 88.72f : x);
    // n = round(xc / ln 2), in [-126, 128]: adding 1.5 * 2^23 rounds to an integer in the low bits.
    const float magic = 12582912.0f;
    const float t = xc * 1.44269504088896341f + magic;
    int32_t ti, mi;
    memcpy(&ti, &t, sizeof ti);
    memcpy(&mi, &magic, sizeof mi);
    const int32_t n = ti - mi;
    const float nf = t - magic;
    const float f = MADD(nf, 2.12194440e-4f, MADD(nf, -0.693359375f, xc));
    float p = 1.9875691500e-4f;
    p = MADD(p, f, 1.3981999507e-3f);
    p = MADD(p, f, 8.3334519073e-3f);
    p = MADD(p, f, 4.1665795894e-2f);
    p = MADD(p, f, 1.6666665459e-1f);
    p = MADD(p, f, 5.0000001201e-1f);
    p = MADD(p * f, f, f + 1.0f);
    // 2^n as a float's exponent field, which holds 2^127 at most: 2^128 is 2^127 * 2.
    const int32_t top = n > 127;
    const int32_t bits = (n - top + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    const float r = p * scale * (top ? 2.0f : 1.0f);
    return x > 88.72f ? INFINITY : r;
}

// FMA contraction is allowed from here to the end of the SiLU section: exp's polynomial only needs
// to be accurate, and a third of its instructions go away with FMA. Nothing here rounds as torch
// does through an add after a product but 1 + exp(-g), where the product is by a power of two
// (exact), so the fused and the unfused sum are the same.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")

// exp(x) on 16 lanes, for silu's 1 + exp(-g): the steps of exp_approx with two changes that leave
// 1 + exp(x) as it was and save the branches' instructions. Below -20, 1 + exp(x) is 1 in fp32
// (exp(-17) < 2^-24), so x is clamped there; above 89 it is clamped to 89, and 2^n is applied as
// 2 p * 2^(n - 1) (n <= 128), so exp overflows to inf by itself from about 88.72 on.
static inline v16f vexp_silu(v16f x) {
    const v16f lo = splat16(-20.0f), hi = splat16(89.0f), magic = splat16(12582912.0f);
    const v16i below = x < lo, above = x > hi;
    const v16f xc = (v16f)(((v16i)lo & below) | ((v16i)hi & above) | ((v16i)x & ~(below | above)));
    const v16f t = xc * splat16(1.44269504088896341f) + magic;
    const v16i n = (v16i)t - (v16i)magic;
    const v16f nf = t - magic;
    const v16f f = nf * splat16(2.12194440e-4f) + (nf * splat16(-0.693359375f) + xc);
    v16f p = splat16(1.9875691500e-4f);
    p = p * f + splat16(1.3981999507e-3f);
    p = p * f + splat16(8.3334519073e-3f);
    p = p * f + splat16(4.1665795894e-2f);
    p = p * f + splat16(1.6666665459e-1f);
    p = p * f + splat16(5.0000001201e-1f);
    p = p * f * f + (f + splat16(1.0f));
    const v16f half_scale = (v16f)((n + 126) << 23);  // 2^(n - 1), n in [-29, 128]
    return (p + p) * half_scale;
}

static inline __attribute__((always_inline)) void silu_row(const void *x, void *out, int64_t inter, int bf16) {
    // torch's silu: g / (1 + exp(-g)) in fp32, rounded to the dtype before the product with up.
    int64_t i = 0;
    for (; i + BLOCK <= inter; i += BLOCK) {
        const block g = bload(x, i, bf16), u = bload(x, i + inter, bf16);
        block o;
        o.a = vround(g.a / (splat16(1.0f) + vexp_silu(-g.a)), bf16) * u.a;
        o.b = vround(g.b / (splat16(1.0f) + vexp_silu(-g.b)), bf16) * u.b;
        bstore(out, i, o, bf16);
    }
    for (; i < inter; i++) {
        const float g = load(x, i, bf16), u = load(x, i + inter, bf16);
        float a = g / (1.0f + exp_approx(-g));
        if (bf16) a = round_bf16(a);
        store(out, i, a * u, bf16);
    }
}

// out = silu(gate) * up, gate and up the two halves of each x row (x_stride elements apart).
int qw_silu_and_mul(const void *x, int64_t x_stride, void *out, int64_t rows, int64_t inter, int is_bf16,
                    int num_threads) {
    const int64_t esize = is_bf16 ? 2 : 4;
    const int nt = threads_for(rows * inter, num_threads);
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const char *xr = (const char *)x + r * x_stride * esize;
        char *o = (char *)out + r * inter * esize;
        if (is_bf16)
            silu_row(xr, o, inter, 1);
        else
            silu_row(xr, o, inter, 0);
    }
    return QW_OK;
}

#pragma GCC pop_options

// ---- greedy argmax ------------------------------------------------------------------------------

// The index of the largest logit of a row, as torch.argmax picks it: the first of equal maxima, the
// first NaN where there is one (torch counts NaN above everything), 0 for a row of -inf. One pass:
// every lane keeps its largest value and, by a strict >, the first index holding it, so the row's
// first maximum is the smallest index among the lanes holding the row's maximum. NaN fails every
// comparison and is looked for only where the pass saw one.
static inline __attribute__((always_inline)) int64_t argmax_row(const void *row, int64_t n, int bf16) {
    int64_t i = 0, best = 0;
    float best_value = -INFINITY;
    int seen_nan = 0;
    if (n >= BLOCK) {
        // Lane j of a block holds element 2 j (a) and 2 j + 1 (b) in bf16, j and 16 + j in fp32.
        v16i idx_a, idx_b;
        for (int j = 0; j < 16; j++) {
            idx_a[j] = bf16 ? 2 * j : j;
            idx_b[j] = bf16 ? 2 * j + 1 : 16 + j;
        }
        block v = bload(row, 0, bf16);
        v16f max_a = v.a, max_b = v.b;
        v16i at_a = idx_a, at_b = idx_b;
        v16i nan = (v.a != v.a) | (v.b != v.b);
        for (i = BLOCK; i + BLOCK <= n; i += BLOCK) {
            v = bload(row, i, bf16);
            const int32_t offset = (int32_t)i;  // vocab < 2^31
            const v16i up_a = v.a > max_a, up_b = v.b > max_b;
            max_a = (v16f)(((v16i)v.a & up_a) | ((v16i)max_a & ~up_a));
            max_b = (v16f)(((v16i)v.b & up_b) | ((v16i)max_b & ~up_b));
            at_a = ((idx_a + offset) & up_a) | (at_a & ~up_a);
            at_b = ((idx_b + offset) & up_b) | (at_b & ~up_b);
            nan |= (v.a != v.a) | (v.b != v.b);
        }
        for (int j = 0; j < 16; j++) seen_nan |= nan[j] != 0;
        best = at_a[0];
        best_value = max_a[0];
        for (int j = 0; j < 16; j++) {
            const float va = max_a[j], vb = max_b[j];
            if (va > best_value || (va == best_value && at_a[j] < best)) best_value = va, best = at_a[j];
            if (vb > best_value || (vb == best_value && at_b[j] < best)) best_value = vb, best = at_b[j];
        }
    } else {
        best_value = load(row, 0, bf16);
        seen_nan = best_value != best_value;
        i = 1;
    }
    for (; i < n; i++) {
        const float v = load(row, i, bf16);
        seen_nan |= v != v;
        if (v > best_value) best_value = v, best = i;
    }
    if (seen_nan)
        for (i = 0; i < n; i++) {
            const float v = load(row, i, bf16);
            if (v != v) return i;
        }
    return best;
}

// out[r] = argmax of logits row r (rows `stride` elements apart).
int qw_argmax_rows(const void *logits, int64_t stride, int64_t rows, int64_t n, int is_bf16, int64_t *out,
                   int num_threads) {
    const int64_t esize = is_bf16 ? 2 : 4;
    const int nt = threads_for(rows * n / 8, num_threads);  // a compare per element: 8x the ops' share
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const char *row = (const char *)logits + r * stride * esize;
        out[r] = is_bf16 ? argmax_row(row, n, 1) : argmax_row(row, n, 0);
    }
    return QW_OK;
}

// 1 where the library was built with AVX-512, so that a 32-element block is two registers. On AVX2
// GCC splits each 16-lane vector in two and, in the argmax loop's nine live vectors, spills them to
// the stack: there (a -march=x86-64-v3 build on the AVX512-BF16 EPYC, torch at its AVX2 level, 128
// rows of 49,152 fp32 logits) the kernel took 12.0-12.5 ms against torch.argmax's 3.0-4.9 ms, so
// the sampler keeps torch's argmax on such CPUs.
int qw_fused_ops_avx512(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}
