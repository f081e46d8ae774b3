// The model's elementwise ops for the CPU, each in one pass over its rows: residual add + RMSNorm,
// RMSNorm, rotary embedding of q and k straight out of the fused qkv matmul, and SiLU-and-mul.
//
// Built at first use by cpu_fused_ops.py (`gcc -O3 -march=native -fopenmp -ffp-contract=off`) and
// called through ctypes. In torch each of these is 4 to 10 separate ops, each a pass over memory
// with a temporary and a dispatch; here a row is read once and written once.
//
// Rounding follows the torch reference ops (transformers' order) step by step: in bf16, every
// intermediate that torch rounds to bf16 is rounded here too (round to nearest even), and products
// and sums are computed in fp32 as torch computes them; -ffp-contract=off keeps a * b - c * d from
// becoming an FMA with one rounding fewer. What can differ from torch: the order of the RMSNorm's
// sum of squares (an fp32 reduction: the last bit of the variance) and exp in SiLU (about 2 ulp
// here; torch uses its own vectorized exp). In bf16 both vanish in the final rounding but for a
// rare tie; in fp32 they are ulp-level.
//
// Layouts (element offsets; row strides given where rows are not packed):
//   rms norm:  x [rows, n] (stride x_stride), residual [rows, n], weight [n], out [rows, n]
//   rotary:    q [rows, H, D] (stride q_stride), k [rows, KVH, D] (stride k_stride); q_out, k_out
//              packed; positions [rows] int64; cos, sin [max_positions, D / 2] fp32
//   silu:      x [rows, 2 I] (stride x_stride: gate then up), out [rows, I]
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

// Threads for `elements` of work: one below ~64K elements, where waking the pool costs more than
// it saves (a 128 x 576 decode row block is 74K).
static inline int threads_for(int64_t elements, int num_threads) {
    return elements >= (1 << 16) && num_threads > 1 ? num_threads : 1;
}

// ---- RMSNorm ------------------------------------------------------------------------------------

#define LANES 16

static inline __attribute__((always_inline)) void rms_norm_row(const void *x, void *residual, const void *weight,
                                                               void *out, int64_t n, float eps, int has_residual,
                                                               int bf16, float *h) {
    // h: the row in fp32 (x + residual, rounded to the dtype as torch's add rounds it).
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        for (int j = 0; j < LANES; j++) {
            float v = load(x, i + j, bf16);
            if (has_residual) {
                v = v + load(residual, i + j, bf16);
                if (bf16) v = round_bf16(v);
            }
            h[i + j] = v;
            acc[j] += v * v;
        }
    }
    float sum = 0.0f;
    for (; i < n; i++) {
        float v = load(x, i, bf16);
        if (has_residual) {
            v = v + load(residual, i, bf16);
            if (bf16) v = round_bf16(v);
        }
        h[i] = v;
        sum += v * v;
    }
    for (int j = 0; j < LANES; j++) sum += acc[j];
    const float inv = 1.0f / sqrtf(sum / (float)n + eps);
    if (has_residual)
        for (i = 0; i < n; i++) store(residual, i, h[i], bf16);
    if (bf16) {
        for (i = 0; i < n; i++) store(out, i, load(weight, i, 1) * round_bf16(h[i] * inv), 1);
    } else {
        for (i = 0; i < n; i++) ((float *)out)[i] = ((const float *)weight)[i] * (h[i] * inv);
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
// the sum rounded to the dtype.
static inline __attribute__((always_inline)) void rotate_head(const void *x, void *out, const float *c,
                                                              const float *s, int64_t half, int bf16) {
    for (int64_t i = 0; i < half; i++) {
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
                c[i] = is_bf16 ? round_bf16(cr[i]) : cr[i];
                s[i] = is_bf16 ? round_bf16(sr[i]) : sr[i];
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

static inline __attribute__((always_inline)) void silu_row(const void *x, void *out, int64_t inter, int bf16) {
    for (int64_t i = 0; i < inter; i++) {
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
