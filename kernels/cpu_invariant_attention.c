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
#pragma omp parallel for num_threads(num_threads) if (num_threads > 1 && work > 1) schedule(dynamic, 1)
    for (int64_t w = 0; w < work; w++) {
        const int64_t run = w / num_kv_heads, kvh = w % num_kv_heads;
        const int64_t t0 = run_start[run], nt = run_start[run + 1] - t0;
        const int32_t *table = block_tables + (int64_t)token_seq[t0] * max_blocks;
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
    free(run_start);
    return 0;
}
