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
// Work is split over (token, KV head) pairs; the query heads of one KV head share each tile's
// transposed keys. Threads never split one token's keys.
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_simd.h"

#define QW_KT 16        // keys per tile (one 16-lane vector of scores)
#define QW_MAX_D 256    // largest head_dim
#define QW_MAX_GROUP 16 // most query heads per KV head

static inline v16f load16(const void *p, int is_bf16) {
    if (!is_bf16) return loadu16((const float *)p);
    const uint16_t *h = (const uint16_t *)p;
    v16f r;
    for (int i = 0; i < 16; i++) r[i] = bf16_to_f32(h[i]);
    return r;
}

static inline float load1(const void *p, int64_t i, int is_bf16) {
    return is_bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

// q, out: [num_tokens, H, D] (token stride q_stride / out_stride elements, heads packed);
// caches: [num_blocks, block_size, KVH, D]; block_tables: [num_seqs, max_blocks] int32;
// token_seq: [num_tokens] int32 (the token's row in block_tables); token_pos: [num_tokens] int32.
// window: 0 for none, else a query sees keys pos - window + 1 .. pos.
int qw_inv_paged_attention(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                           const int32_t *block_tables, const int32_t *token_seq, const int32_t *token_pos,
                           void *out, int64_t out_stride, int64_t num_tokens, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks,
                           int64_t num_blocks, float scale, int64_t window, int has_soft_cap, float soft_cap,
                           int is_bf16, int num_threads) {
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
    const int64_t elem = is_bf16 ? 2 : 4;
    const int64_t row_elems = num_kv_heads * head_dim;  // elements per cache slot
    const int64_t work = num_tokens * num_kv_heads;
    (void)num_threads;
#pragma omp parallel for num_threads(num_threads) if (num_threads > 1 && work > 1) schedule(static)
    for (int64_t w = 0; w < work; w++) {
        const int64_t t = w / num_kv_heads, kvh = w % num_kv_heads;
        const int64_t pos = token_pos[t];
        const int64_t start = window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
        const int32_t *table = block_tables + (int64_t)token_seq[t] * max_blocks;
        float qf[QW_MAX_GROUP][QW_MAX_D];
        v16f acc[QW_MAX_GROUP][QW_MAX_D / 16];
        float m[QW_MAX_GROUP], l[QW_MAX_GROUP];
        float kt[QW_MAX_D][QW_KT];  // the tile's keys, transposed: kt[d][j] = key j, element d
        const void *vrow[QW_KT];
        for (int64_t g = 0; g < group; g++) {
            const int64_t h = kvh * group + g;
            const char *qh = (const char *)q + (t * q_stride + h * head_dim) * elem;
            for (int64_t d = 0; d < head_dim; d++) qf[g][d] = load1(qh, d, is_bf16);
            for (int64_t c = 0; c < dv; c++) acc[g][c] = splat16(0.0f);
            m[g] = -INFINITY;
            l[g] = 0.0f;
        }
        for (int64_t tile0 = start / QW_KT * QW_KT; tile0 <= pos; tile0 += QW_KT) {
            const int64_t lo = start > tile0 ? start - tile0 : 0;           // first valid lane
            const int64_t hi = pos - tile0 + 1 < QW_KT ? pos - tile0 + 1 : QW_KT;  // one past the last
            for (int64_t j = 0; j < QW_KT; j++) {
                if (j < lo || j >= hi) {
                    for (int64_t d = 0; d < head_dim; d++) kt[d][j] = 0.0f;
                    vrow[j] = NULL;
                    continue;
                }
                const int64_t p = tile0 + j;
                const int64_t slot = (int64_t)table[p / block_size] * block_size + p % block_size;
                const char *krow = (const char *)k_cache + (slot * row_elems + kvh * head_dim) * elem;
                for (int64_t d = 0; d < head_dim; d++) kt[d][j] = load1(krow, d, is_bf16);
                vrow[j] = (const char *)v_cache + (slot * row_elems + kvh * head_dim) * elem;
            }
            v16i valid;
            for (int j = 0; j < QW_KT; j++) valid[j] = (j >= lo && j < hi) ? -1 : 0;
            for (int64_t g = 0; g < group; g++) {
                v16f s = splat16(0.0f);
                for (int64_t d = 0; d < head_dim; d++) s = s + splat16(qf[g][d]) * loadu16(kt[d]);
                s = s * splat16(scale);
                if (has_soft_cap) s = vsoft_cap16(s, soft_cap);
                s = (v16f)(((v16i)s & valid) | ((v16i)splat16(-INFINITY) & ~valid));
                const float tile_max = hmax16(s);
                const float m_new = m[g] > tile_max ? m[g] : tile_max;
                const float alpha = expf(m[g] - m_new);  // 0 at the first tile (m = -inf)
                const v16f p = vexp_nonpos16(s - splat16(m_new));
                l[g] = l[g] * alpha + hsum16(p);
                const v16f va = splat16(alpha);
                for (int64_t c = 0; c < dv; c++) acc[g][c] = acc[g][c] * va;
                for (int64_t j = lo; j < hi; j++) {
                    const v16f pj = splat16(p[j]);
                    for (int64_t c = 0; c < dv; c++)
                        acc[g][c] = acc[g][c] + pj * load16((const char *)vrow[j] + c * 16 * elem, is_bf16);
                }
                m[g] = m_new;
            }
        }
        for (int64_t g = 0; g < group; g++) {
            const int64_t h = kvh * group + g;
            char *oh = (char *)out + (t * out_stride + h * head_dim) * elem;
            const v16f inv = splat16(1.0f / l[g]);
            for (int64_t c = 0; c < dv; c++) {
                const v16f o = acc[g][c] * inv;
                for (int i = 0; i < 16; i++) {
                    if (is_bf16) {
                        ((uint16_t *)oh)[c * 16 + i] = f32_to_bf16(o[i]);
                    } else {
                        ((float *)oh)[c * 16 + i] = o[i];
                    }
                }
            }
        }
    }
    return 0;
}
