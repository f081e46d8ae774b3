// Helpers the CPU kernels share: bf16 <-> fp32, and GCC-vector-extension arithmetic at 8 floats
// (one AVX2 register) and 16 floats (one AVX-512 register; GCC splits it in two on AVX2). Vector
// extensions, not intrinsics, so one source builds for any target GCC knows.
//
// Included by cpu_paged_attention.c, cpu_prefill_attention.c and cpu_fused_ops.c. cpu_build.py
// hashes every file a kernel includes with quotes, so a change here rebuilds all of them.
#ifndef QWORKER_CPU_SIMD_H
#define QWORKER_CPU_SIMD_H

#include <stdint.h>
#include <string.h>

// ---- bf16 ---------------------------------------------------------------------------------------

static inline float bf16_to_f32(uint16_t h) {
    const uint32_t w = (uint32_t)h << 16;
    float f;
    memcpy(&f, &w, sizeof f);
    return f;
}

// Round to nearest even, as torch does; NaN stays NaN.
static inline uint16_t f32_to_bf16(float f) {
    uint32_t w;
    memcpy(&w, &f, sizeof w);
    if ((w & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((w >> 16) | 0x40u);
    w += 0x7fffu + ((w >> 16) & 1u);
    return (uint16_t)(w >> 16);
}

// ---- vectors ------------------------------------------------------------------------------------

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

static inline v8f splat8(float x) { return (v8f){x, x, x, x, x, x, x, x}; }
static inline v16f splat16(float x) { return (v16f){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

static inline v8f loadu8(const float *p) {
    v8f r;
    memcpy(&r, p, sizeof r);
    return r;
}

static inline v16f loadu16(const float *p) {
    v16f r;
    memcpy(&r, p, sizeof r);
    return r;
}

static inline void storeu8(float *p, v8f x) { memcpy(p, &x, sizeof x); }
static inline void storeu16(float *p, v16f x) { memcpy(p, &x, sizeof x); }

static inline v8f vmax8(v8f a, v8f b) {
    v8i m = a > b;
    return (v8f)(((v8i)a & m) | ((v8i)b & ~m));
}

static inline v16f vmax16(v16f a, v16f b) {
    v16i m = a > b;
    return (v16f)(((v16i)a & m) | ((v16i)b & ~m));
}

// exp(x) for x <= 0 (the argument is always score - running max). Cephes expf polynomial after
// Cody-Waite range reduction; about 2 ulp. Inputs below -87 are clamped (result ~1e-38), and -inf
// (a masked score) gives exactly 0. One body, instantiated at both widths.
#define QW_DEFINE_VEXP_NONPOS(name, vf, vi, splat, vmax)                \
    static inline vf name(vf x) {                                       \
        const vi masked = x < splat(-1e30f);                            \
        const vf magic = splat(12582912.0f); /* 1.5 * 2^23: rounds */ \
        x = vmax(x, splat(-87.0f));                                     \
        vf t = x * splat(1.44269504088896341f) + magic;                 \
        vi n = (vi)t - (vi)magic;                                       \
        vf r = t - magic;                                               \
        vf f = x - r * splat(0.693359375f);                             \
        f = f - r * splat(-2.12194440e-4f);                             \
        vf p = splat(1.9875691500e-4f);                                 \
        p = p * f + splat(1.3981999507e-3f);                            \
        p = p * f + splat(8.3334519073e-3f);                            \
        p = p * f + splat(4.1665795894e-2f);                            \
        p = p * f + splat(1.6666665459e-1f);                            \
        p = p * f + splat(5.0000001201e-1f);                            \
        p = p * f * f + f + splat(1.0f);                                \
        vi pow2n = (n + 127) << 23;                                     \
        return (vf)((vi)(p * (vf)pow2n) & ~masked);                     \
    }
QW_DEFINE_VEXP_NONPOS(vexp_nonpos8, v8f, v8i, splat8, vmax8)
QW_DEFINE_VEXP_NONPOS(vexp_nonpos16, v16f, v16i, splat16, vmax16)
#undef QW_DEFINE_VEXP_NONPOS

// cap * tanh(x / cap) for the logits soft-cap, from one vexp_nonpos of -2|x| / cap: tanh|y| =
// (1 - e) / (1 + e) with e = exp(-2|y|) <= 1, no overflow; the sign is x's. Absolute error a few
// ulp of cap (the 1 - e near y = 0), far below the scores' own rounding.
#define QW_DEFINE_VSOFT_CAP(name, vf, vi, splat, vmax, vexp)                      \
    static inline vf name(vf x, float cap) {                                     \
        const vf ax = vmax(x, -x);                                                \
        const vf e = vexp(ax * splat(-2.0f / cap));                               \
        const vf t = (splat(1.0f) - e) / (splat(1.0f) + e) * splat(cap);          \
        return (vf)((vi)t | ((vi)x & (vi)splat(-0.0f)));                          \
    }
QW_DEFINE_VSOFT_CAP(vsoft_cap8, v8f, v8i, splat8, vmax8, vexp_nonpos8)
QW_DEFINE_VSOFT_CAP(vsoft_cap16, v16f, v16i, splat16, vmax16, vexp_nonpos16)
#undef QW_DEFINE_VSOFT_CAP

// Horizontal sum and max by halving: lanes i and i + w combined, w = 4, 2, 1 (16 lanes: 8 first).
static inline float hsum8(v8f x) {
    const v8i h4 = {4, 5, 6, 7, 0, 1, 2, 3}, h2 = {2, 3, 0, 1, 6, 7, 4, 5}, h1 = {1, 0, 3, 2, 5, 4, 7, 6};
    x += __builtin_shuffle(x, h4);
    x += __builtin_shuffle(x, h2);
    x += __builtin_shuffle(x, h1);
    return x[0];
}

static inline float hmax8(v8f x) {
    const v8i h4 = {4, 5, 6, 7, 0, 1, 2, 3}, h2 = {2, 3, 0, 1, 6, 7, 4, 5}, h1 = {1, 0, 3, 2, 5, 4, 7, 6};
    x = vmax8(x, __builtin_shuffle(x, h4));
    x = vmax8(x, __builtin_shuffle(x, h2));
    x = vmax8(x, __builtin_shuffle(x, h1));
    return x[0];
}

static inline void split16(v16f x, v8f *lo, v8f *hi) {
    memcpy(lo, &x, sizeof *lo);
    memcpy(hi, (const char *)&x + sizeof *lo, sizeof *hi);
}

static inline float hsum16(v16f x) {
    v8f lo, hi;
    split16(x, &lo, &hi);
    return hsum8(lo + hi);
}

static inline float hmax16(v16f x) {
    v8f lo, hi;
    split16(x, &lo, &hi);
    return hmax8(vmax8(lo, hi));
}

#endif  // QWORKER_CPU_SIMD_H
