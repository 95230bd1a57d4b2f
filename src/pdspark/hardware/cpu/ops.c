/* pdspark CPU kernels, ops.c: the per-op kernels Python calls one by one and the layers compose: RMS norm, rope,
 * the mHC collapse and expand, the lightning indexer's scores and pick, sink attention, the compressor, the
 * attention output projection and the LM head. */
#include "kernels.h"

/* Eight float lanes (GCC/Clang vector extension): element-wise IEEE mul/add, no contraction (-ffp-contract=off). */
typedef float v8f __attribute__((vector_size(32)));
typedef int v8i __attribute__((vector_size(32)));

static inline v8f splat(float x) { return (v8f){x, x, x, x, x, x, x, x}; }

/* out [T, N] = x [T, K] @ w [N, K]^T with `gemm_exact`'s arithmetic: every output row's bits depend on its own
 * input row only, however many rows come with it (a BLAS GEMM picks other kernels, with other summation orders,
 * for other row counts). */
void linear_rows(const float *x, const float *w, int T, int N, int K, float *out) {
    gemm_exact_w(w, 0, 0, x, K, T, N, K, out, N);
}

/* `linear_rows` of bf16 weights w [N, K] (bits): the products and sums of their fp32 twin, bit for bit. */
void linear_rows_h(const float *x, const void *w, int T, int N, int K, float *out) {
    gemm_exact_w(w, 0, 1, x, K, T, N, K, out, N);
}

/* out [T, N] = x [T, K] @ w [N, K]^T with the DSpark draft's GEMM (`gemm_rows`: fused multiply-adds, its own
 * order), w fp32 (bf = 0) or bf16 bits (bf = 1): for benchmarks (the draft block calls `gemm_rows_w` itself). */
void linear_rows_draft(const float *x, const void *w, int bf, int T, int N, int K, float *out) {
    gemm_rows_w(w, 0, bf, x, K, T, N, K, out, N);
}

/* RMS normalisation of each row: out [N, D] = x * (1 / sqrt(mean(x^2) + eps)) (* w when w is not NULL); input
 * rows start `stride` floats apart (a column slice of a wider matrix), output rows are packed. */
void rms_norm(const float *x, long stride, const float *w, int N, int D, float eps, float *out) {
    for (int n = 0; n < N; n++) {
        const float *xn = x + (long)n * stride;
        float *on = out + (long)n * D;
        const float r = 1.0f / sqrtf(dot(xn, xn, D) / (float)D + eps);
        if (w == 0)
            for (int d = 0; d < D; d++) on[d] = xn[d] * r;
        else
            for (int d = 0; d < D; d++) on[d] = xn[d] * r * w[d];
    }
}

/* Interleaved partial RoPE: out = x with the trailing r channels of each of the T*H rows of length D rotated,
 * pair (x0, x1) -> (x0*c0 + sign*(x1*s0), x1*c1 + sign*(x0*s1)), where cos/sin [T, r] are the per-channel
 * tables (sin signed per pair) shared by the H rows of a token and sign = -1 rotates backwards. */
void rope_rotate(const float *x, const float *cos, const float *sin, int T, int H, int D, int r, float sign,
                 float *out) {
    for (int t = 0; t < T; t++) {
        const float *c = cos + (long)t * r, *s = sin + (long)t * r;
        for (int h = 0; h < H; h++) {
            const float *xr = x + ((long)t * H + h) * D;
            float *o = out + ((long)t * H + h) * D;
            for (int d = 0; d < D - r; d++) o[d] = xr[d];
            const float *xp = xr + D - r;
            float *op = o + D - r;
            for (int i = 0; i < r; i += 2) {
                op[i] = xp[i] * c[i] + sign * (xp[i + 1] * s[i]);
                op[i + 1] = xp[i + 1] * c[i + 1] + sign * (xp[i] * s[i + 1]);
            }
        }
    }
}

/* mHC weights of one token from its mixes m [(2+hc)*hc] = pre | post | comb logits (before scale and base):
 *   pre [hc] = sigmoid(m*s0 + b) + eps; post [hc] = 2*sigmoid(m*s1 + b)
 *   comb [hc, hc] = row softmax(m*s2 + b) + eps, column-normalised, then (iters-1) row+column rounds,
 *   each normalisation dividing by (sum + eps).
 * Split in two: `mhc_start` (pre, post and the softmax, a token at a time) and `sinkhorn_lanes` (the
 * normalisations, eight tokens at once). */
static void mhc_start(const float *m, const float *scale, const float *base, int hc, float eps, float *pre,
                      float *post, float *c) {
    for (int i = 0; i < hc; i++) {
        pre[i] = sigmoidf(m[i] * scale[0] + base[i]) + eps;
        post[i] = 2.0f * sigmoidf(m[hc + i] * scale[1] + base[hc + i]);
    }
    for (int i = 0; i < hc; i++) {
        float *row = c + i * hc;
        float mx = -INFINITY;
        for (int j = 0; j < hc; j++) {
            row[j] = m[2 * hc + i * hc + j] * scale[2] + base[2 * hc + i * hc + j];
            if (row[j] > mx) mx = row[j];
        }
        float s = 0.0f;
        for (int j = 0; j < hc; j++) {
            row[j] = expf(row[j] - mx);
            s += row[j];
        }
        for (int j = 0; j < hc; j++) row[j] = row[j] / s + eps;
    }
}

/* The Sinkhorn rounds of T tokens' comb matrices c [T, hc, hc], eight tokens at a time in the lanes of one
 * vector per matrix entry: each lane does one token's divisions and adds in the order a token alone does them
 * (element-wise IEEE operations, no contraction), so every bit is the token-at-a-time loop's. A round is a chain
 * of dependent sums and divisions per token, 20 rounds of 32 divisions for V4's hc = 4, and every decoder layer
 * collapses its streams twice: eight to a vector, a 6-row verify forward of dsv4-tiny ran 0.90 -> 0.86 ms on a
 * Zen 4 core (the collapse of 6 rows alone 3.2 -> 1.3 us; of one row 0.54 -> 0.72 us, ~0.6% of a decode step). */
static void sinkhorn_lanes(float *c, int T, int hc, int iters, float eps) {
    enum { L = 8 };
    const int E = hc * hc;
    const v8f veps = splat(eps);
    for (int t0 = 0; t0 < T; t0 += L) {
        const int n = T - t0 < L ? T - t0 : L;
        v8f m[E]; /* m[e][l]: entry e of token t0 + l's matrix (lanes past n: ones, never read back) */
        for (int e = 0; e < E; e++) {
            m[e] = splat(1.0f);
            for (int l = 0; l < n; l++) m[e][l] = c[(long)(t0 + l) * E + e];
        }
        for (int it = 0; it < iters; it++) {
            if (it > 0) { /* row normalisation (the first round starts with columns) */
                for (int i = 0; i < hc; i++) {
                    v8f s = splat(0.0f);
                    for (int j = 0; j < hc; j++) s = s + m[i * hc + j];
                    for (int j = 0; j < hc; j++) m[i * hc + j] = m[i * hc + j] / (s + veps);
                }
            }
            for (int j = 0; j < hc; j++) {
                v8f s = splat(0.0f);
                for (int i = 0; i < hc; i++) s = s + m[i * hc + j];
                for (int i = 0; i < hc; i++) m[i * hc + j] = m[i * hc + j] / (s + veps);
            }
        }
        for (int e = 0; e < E; e++)
            for (int l = 0; l < n; l++) c[(long)(t0 + l) * E + e] = m[e][l];
    }
}

/* The collapse of T tokens' streams h [T, hc, D] given their mixes [T, (2+hc)*hc]: mHC weights (pre [T, hc],
 * post [T, hc], comb [T, hc, hc]), then x[t] [D] = sum_i pre[t, i] * h[t, i, :]. */
static void collapse_tokens(const float *h, const float *mixes, const float *scale, const float *base, int T, int hc,
                            int D, int iters, float eps, float *x, float *pre, float *post, float *comb) {
    const int M = (2 + hc) * hc;
    for (int t = 0; t < T; t++)
        mhc_start(mixes + (long)t * M, scale, base, hc, eps, pre + (long)t * hc, post + (long)t * hc,
                  comb + (long)t * hc * hc);
    sinkhorn_lanes(comb, T, hc, iters, eps);
    for (int t = 0; t < T; t++) {
        const float *ht = h + (long)t * hc * D, *pt = pre + (long)t * hc;
        float *xt = x + (long)t * D;
        for (int d = 0; d < D; d++) xt[d] = pt[0] * ht[d];
        for (int i = 1; i < hc; i++)
            for (int d = 0; d < D; d++) xt[d] += pt[i] * ht[i * D + d];
    }
}

/* The whole collapse of the mHC streams for a few tokens: h [T, hc, D] ->
 *   flat = h[t] * rsqrt(mean(h[t]^2) + norm_eps) over the hc*D values; mixes = fn [M, hc*D] @ flat;
 *   (pre, post, comb) from the mixes; x [T, D] = sum_i pre[i] * h[t, i, :], then RMS-normalised with the
 *   sublayer's norm weight x_norm_w when given (NULL: x as collapsed).
 * The mixes of all T rows come from one `gemm_exact_w` (each row's bits as its own GEMV's; the rows share the reads
 * of fn, in pairs and with the helper thread). scratch holds T * (hc*D + M) floats. */
void hc_collapse(const float *h, const float *fn, const float *scale, const float *base, int T, int hc, int D,
                 int iters, float eps, float norm_eps, float *scratch, float *x, float *pre, float *post,
                 float *comb, const float *x_norm_w, float x_norm_eps) {
    const int N = hc * D, M = (2 + hc) * hc;
    float *flat = scratch, *mixes = scratch + (long)T * N;
    for (int t = 0; t < T; t++) {
        const float *ht = h + (long)t * N;
        const float r = 1.0f / sqrtf(dot(ht, ht, N) / (float)N + norm_eps);
        for (int k = 0; k < N; k++) flat[(long)t * N + k] = ht[k] * r;
    }
    gemm_exact_w(fn, 0, 0, flat, N, T, M, N, mixes, M);
    collapse_tokens(h, mixes, scale, base, T, hc, D, iters, eps, x, pre, post, comb);
    if (x_norm_w != 0)
        for (int t = 0; t < T; t++) rms_norm(x + (long)t * D, D, x_norm_w, 1, D, x_norm_eps, x + (long)t * D);
}

/* The same collapse with the mixes [T, (2+hc)*hc] computed by the caller (long chunks: a BLAS matmul). */
void hc_collapse_mixed(const float *h, const float *mixes, const float *scale, const float *base, int T, int hc,
                       int D, int iters, float eps, float *x, float *pre, float *post, float *comb) {
    collapse_tokens(h, mixes, scale, base, T, hc, D, iters, eps, x, pre, post, comb);
}

/* Write a sublayer's output back into the streams: out[t, i, :] = post[t, i] * y[t, :] + sum_j comb[t, j, i] *
 * res[t, j, :] (the mix summed first, in j order, as the reference's matmul does).
 * y [T, D], res and out [T, hc, D], post [T, hc], comb [T, hc, hc]. */
void hc_expand(const float *y, const float *res, const float *post, const float *comb, int T, int hc, int D,
               float *out) {
    for (int t = 0; t < T; t++) {
        const float *yt = y + (long)t * D, *rt = res + (long)t * hc * D, *ct = comb + (long)t * hc * hc;
        for (int i = 0; i < hc; i++) {
            float *o = out + ((long)t * hc + i) * D;
            const float p = post[(long)t * hc + i];
            for (int d = 0; d < D; d++) o[d] = ct[i] * rt[d];
            for (int j = 1; j < hc; j++) {
                const float c = ct[j * hc + i];
                for (int d = 0; d < D; d++) o[d] += c * rt[j * D + d];
            }
            for (int d = 0; d < D; d++) o[d] = p * yt[d] + o[d];
        }
    }
}

/* Lightning-indexer scores: out[t, g] = sum_h relu(q[t, h, :] . k_t[g, :]) * scale * w[t, h], for T queries of
 * H heads (q [T, H, D], w [T, H]) against V keys each (k_t = k + t * kstride, [V, D]; kstride 0: the queries share
 * their keys; or, with `rows`, the pool rows k + rows[t * rows_tstride + g] * row_stride, read in place, or of
 * `pool`: the FP8 cache's packed rows or rows in blocks, `packed_rows.c`; rows_tstride 0: the queries share their
 * rows). Every dot product is a plain sum in channel order (no partial sums) and the heads are summed in order, so a
 * score does not depend on T, V, kstride, the vector width or the pool's layout: the prefill and decode paths pick
 * the same entries. Vector lanes run over entries (64 at a time, eight independent accumulators), not channels, with
 * each block of keys transposed channel-major once per block (once for all queries when they share the keys), or,
 * from a pool in blocks, read in place where each 8 entries are a whole block. relu is `x > 0 ? x : +0`. out [T, V]. */
/* kt[d * NV + i] (lanes l = 0..7) = row[8 i + l][d0 + d] for d < 8: eight rows' channels d0 .. d0+7 transposed
 * with shuffles (a scalar transpose stores one lane at a time, and each vector load of kt then waits on eight
 * stores); NULL rows are zeros. Data movement only: the scores' arithmetic is unchanged. */
static void transpose8(const float *const r[8], int d0, int NV, int i, v8f *kt) {
    v8f a[8];
    for (int l = 0; l < 8; l++) {
        if (r[l] != 0) memcpy(&a[l], r[l] + d0, sizeof(v8f));
        else a[l] = splat(0.0f);
    }
    v8f b[8], c[8];
    for (int l = 0; l < 8; l += 2) {
        b[l] = __builtin_shuffle(a[l], a[l + 1], (v8i){0, 8, 1, 9, 4, 12, 5, 13});
        b[l + 1] = __builtin_shuffle(a[l], a[l + 1], (v8i){2, 10, 3, 11, 6, 14, 7, 15});
    }
    for (int l = 0; l < 8; l += 4) {
        for (int j = 0; j < 2; j++) {
            c[l + j] = __builtin_shuffle(b[l + j], b[l + j + 2], (v8i){0, 1, 8, 9, 4, 5, 12, 13});
            c[l + j + 2] = __builtin_shuffle(b[l + j], b[l + j + 2], (v8i){2, 3, 10, 11, 6, 7, 14, 15});
        }
    }
    /* c[j] (j < 4) holds rows 0-3 of channels (ch[j], ch[j] + 4) in its halves, c[j + 4] rows 4-7 of the same: the
     * last stage joins the halves. */
    static const int ch[4] = {0, 2, 1, 3};
    for (int j = 0; j < 4; j++) {
        kt[(d0 + ch[j]) * NV + i] = __builtin_shuffle(c[j], c[j + 4], (v8i){0, 1, 2, 3, 8, 9, 10, 11});
        kt[(d0 + ch[j] + 4) * NV + i] = __builtin_shuffle(c[j], c[j + 4], (v8i){4, 5, 6, 7, 12, 13, 14, 15});
    }
}

/* Hint the cache lines of a row of n floats into the cache (no arithmetic: results are unchanged). */
static inline void prefetch_row(const float *r, int n) {
    for (int o = 0; o < n; o += 16) __builtin_prefetch(r + o, 0, 3);
}

/* An unaligned view of 8 floats (a blocked pool's block is read in place). */
typedef float v8f_u __attribute__((vector_size(32), aligned(4)));

/* The block of a blocked pool that holds entries g .. g+7 of a row list whole, in order (rt[g] the first row of a
 * block and the next seven its next rows), or NULL: its channel d is then the 8 floats at d * ROW_BLOCK. */
static inline const float *whole_block(const pool_rows *b, const long *rt, int g) {
    const long r0 = rt[g];
    if (r0 % ROW_BLOCK != 0) return 0;
    for (int l = 1; l < ROW_BLOCK; l++)
        if (rt[g + l] != r0 + l) return 0;
    return (const float *)b->base + (r0 / ROW_BLOCK) * b->stride;
}

static void index_scores_from(const float *q, const float *w, const float *k, long kstride, const long *rows,
                              long row_stride, long rows_tstride, int T, int H, int V, int D, float scale,
                              const pool_rows *pool, float *out) {
    /* Eight independent accumulators of 8 lanes (64 entries a block): each score is a chain of D dependent adds, so
     * four chains left the adder waiting on their latency (NV 4 -> 8: one thread's scores over 16,384 contiguous
     * keys 0.127 -> 0.117 ms on a Zen 4 core, a pick over pool rows 0.199 -> 0.193 ms; 16 lanes or 16 chains
     * measured no faster). */
    enum { NV = 8, NB = 8 * NV };
    v8f kt[D * NV]; /* [D, NB]: one block of keys, channel-major */
    /* A blocked pool's groups of 8 entries read in place (`whole_block`), where all NV of a block of keys are whole:
     * the scores then read each group's channels from its block (kb8), not kt. */
    const float *kb8[NV];
    int in_place = 0;
    /* Packed key rows (`pool` INDEX_ROWS, with `rows`: FP8 rows `pool->stride` bytes apart) are decoded a block at a
     * time into kd [NB, D], then read as float rows: the same floats the PyTorch path decodes, so the same scores.
     * Blocked rows (`pool` BLOCKED_ROWS) are read in place where a group of 8 entries is a whole block, in order (a
     * page's entries are: pages hold whole blocks); a group that is not is copied out into kd row by row, and a
     * whole group beside it into kt. */
    const int packed = pool != 0 && pool->rope == INDEX_ROWS, blocked = pool != 0 && pool->rope == BLOCKED_ROWS;
    float kd[pool != 0 ? NB * D : 1];
    const v8f zero = splat(0.0f), vscale = splat(scale);
    for (int g0 = 0; g0 < V; g0 += NB) {
        const int m = V - g0 < NB ? V - g0 : NB;
        for (int t = 0; t < T; t++) {
            if (t == 0 || kstride != 0 || (rows != 0 && rows_tstride != 0)) {
                const float *kb = k + (long)t * kstride + (long)g0 * D;
                const long *rt = rows == 0 ? 0 : rows + (long)t * rows_tstride;
                const float *r[NB];
                for (int l = 0; l < NB; l++)
                    r[l] = l >= m ? 0 : rows == 0 ? kb + (long)l * D : k + rt[g0 + l] * row_stride;
                in_place = 0;
                if (packed) {
                    const uint8_t *base = (const uint8_t *)pool->base;
                    for (int l = 0; l < m; l++) {
                        /* the same row of the block after next asked for into L2 as each row is decoded (pool rows
                         * lie apart, in pages): spread out, not the next block's rows all at once, a pick over
                         * 16,384 FP8 keys from DRAM ran 1.1-1.2x faster on a Zen 4 core (gemm.c's `ahead_step`) */
                        const int ahead = g0 + 2 * NB + l;
                        if (ahead < V)
                            prefetch_l2(base + rt[ahead] * pool->stride, 0, index_width(D));
                        index_unpack_row(base + rt[g0 + l] * pool->stride, D, kd + (long)l * D);
                        r[l] = kd + (long)l * D;
                    }
                } else if (blocked) {
                    /* Measured on a Zen 4 core, 16,384 keys of 128 channels in random pages, 2 heads: 1.6x faster
                     * from DRAM and 1.8x warm than transposing the same keys as fp32 rows (the same bits). */
                    int whole = 0;
                    for (int i = 0; i < NV; i++) {
                        const int ahead = g0 + 2 * NB + 8 * i; /* the block after next's, as the rows' below */
                        if (ahead < V)
                            prefetch_l2((const float *)pool->base + (rt[ahead] / ROW_BLOCK) * pool->stride, 0,
                                        (long)D * ROW_BLOCK * (long)sizeof(float));
                        kb8[i] = 8 * i + 8 <= m ? whole_block(pool, rt, g0 + 8 * i) : 0;
                        whole += kb8[i] != 0;
                        for (int l = 8 * i; kb8[i] == 0 && l < 8 * i + 8 && l < m; l++) {
                            rows_read(pool, rt[g0 + l], kd + (long)l * D);
                            r[l] = kd + (long)l * D;
                        }
                    }
                    in_place = whole == NV;
                    for (int i = 0; !in_place && i < NV; i++) {
                        if (kb8[i] == 0) continue;
                        for (int d = 0; d < D; d++) memcpy(&kt[d * NV + i], kb8[i] + (long)d * ROW_BLOCK, sizeof(v8f));
                        for (int l = 8 * i; l < 8 * i + 8; l++) r[l] = 0; /* (in kt already: not transposed) */
                    }
                } else if (rows != 0 && D % 8 != 0) { /* the next block's keys asked for now: pool rows lie apart */
                    for (int l = g0 + NB; l < g0 + 2 * NB && l < V; l++) prefetch_row(k + rt[l] * row_stride, D);
                }
                if (!in_place && D % 8 == 0) {
                    for (int i = 0; i < NV; i++) {
                        if (blocked && kb8[i] != 0) continue; /* (copied into kt above) */
                        /* fp32 pool rows lie apart (layers, pages): the block after next's rows of this group of 8
                         * asked for into L2, as the packed rows above (the next block's 64 at once into L1 instead:
                         * a single-core pick over 16,384 keys ran 1.5x slower from DRAM, 1.9x from L3) */
                        if (pool == 0 && rows != 0)
                            for (int l = g0 + 2 * NB + 8 * i; l < g0 + 2 * NB + 8 * i + 8 && l < V; l++)
                                prefetch_l2(k + rt[l] * row_stride, 0, (long)D * (long)sizeof(float));
                        for (int d0 = 0; d0 < D; d0 += 8) transpose8(r + 8 * i, d0, NV, i, kt);
                    }
                } else if (!in_place) {
                    for (int l = 0; l < NB; l++) {
                        if (blocked && kb8[l / 8] != 0) continue;
                        for (int d = 0; d < D; d++) kt[d * NV + l / 8][l % 8] = r[l] != 0 ? r[l][d] : 0.0f;
                    }
                }
            }
            v8f o[NV];
            for (int i = 0; i < NV; i++) o[i] = zero;
            for (int h = 0; h < H; h++) {
                const float *qh = q + ((long)t * H + h) * D;
                const v8f wh = splat(w[(long)t * H + h]);
                v8f acc[NV];
                for (int i = 0; i < NV; i++) acc[i] = zero;
                if (in_place) { /* (the same products and sums, read from the blocks) */
                    for (int d = 0; d < D; d++) {
                        const v8f qd = splat(qh[d]);
                        for (int i = 0; i < NV; i++)
                            acc[i] = acc[i] + qd * (v8f)*(const v8f_u *)(kb8[i] + (long)d * ROW_BLOCK);
                    }
                } else {
                    for (int d = 0; d < D; d++) {
                        const v8f qd = splat(qh[d]);
                        for (int i = 0; i < NV; i++) acc[i] = acc[i] + qd * kt[d * NV + i];
                    }
                }
                for (int i = 0; i < NV; i++) {
                    const v8f r = (v8f)((v8i)(acc[i] > zero) & (v8i)acc[i]);
                    o[i] = o[i] + r * vscale * wh;
                }
            }
            float *ot = out + (long)t * V + g0;
            for (int l = 0; l < m; l++) ot[l] = o[l / 8][l % 8];
        }
    }
}

void index_scores(const float *q, const float *w, const float *k, long kstride, int T, int H, int V, int D,
                  float scale, float *out) {
    index_scores_from(q, w, k, kstride, 0, 0, 0, T, H, V, D, scale, 0, out);
}

/* A score's place in the order as an unsigned key: key(a) < key(b) exactly when a < b for numbers, -0 and +0 (equal
 * scores) share +0's key, and every NaN ranks above +inf (where a descending `torch.sort` puts it). */
static inline uint32_t order_key(float f) {
    if (f != f) return UINT32_MAX;
    f += 0.0f; /* -0 + 0 = +0 (kept: the kernels build without -ffast-math) */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u ^ ((uint32_t)((int32_t)u >> 31) | 0x80000000u);
}

/* Buckets per round of the radix select below: 8 KiB of counts, in L1. */
#define PICK_BUCKETS 2048

/* The key of the `need`-th largest of the n keys `a` (1-based; a is reordered) and, in *equal_needed, how many of the
 * keys equal to it are among the top `need`. Each round counts the keys into PICK_BUCKETS buckets of equal width over
 * [lo, hi], finds the bucket that holds the need-th largest, keeps only its keys (moved to the front of a) and
 * narrows [lo, hi] to it: at most three rounds for 32-bit keys, the first over all n, the others over one bucket's. */
static uint32_t kth_key(uint32_t *a, int n, int need, uint32_t lo, uint32_t hi, int *equal_needed) {
    int counts[PICK_BUCKETS];
    while (lo < hi) {
        int shift = 0;
        while (((hi - lo) >> shift) >= PICK_BUCKETS) shift++;
        memset(counts, 0, sizeof counts);
        for (int i = 0; i < n; i++) counts[(a[i] - lo) >> shift]++;
        int b = (int)((hi - lo) >> shift);
        while (counts[b] < need) need -= counts[b--]; /* (the buckets above b hold fewer than need keys) */
        const uint32_t first = lo + ((uint32_t)b << shift);
        const uint32_t last = shift == 0 ? first : first + ((1u << shift) - 1u);
        int m = 0;
        for (int i = 0; i < n; i++)
            if (((a[i] - lo) >> shift) == (uint32_t)b) a[m++] = a[i];
        n = m;
        lo = first;
        hi = last < hi ? last : hi;
        if (shift == 0) break;
        uint32_t mn = UINT32_MAX, mx = 0; /* the bucket's own range: the next round spreads over it */
        for (int i = 0; i < n; i++) {
            mn = a[i] < mn ? a[i] : mn;
            mx = a[i] > mx ? a[i] : mx;
        }
        lo = mn, hi = mx;
    }
    *equal_needed = need;
    return lo;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define PICK_AVX512 1
/* The order keys of 16 scores, lane by lane `order_key`'s. */
static inline __m512i order_keys16(__m512 f) {
    const __m512i u = _mm512_castps_si512(_mm512_add_ps(f, _mm512_setzero_ps())); /* -0 + 0 = +0 */
    const __m512i key = _mm512_xor_si512(u, _mm512_or_si512(_mm512_srai_epi32(u, 31), _mm512_set1_epi32(INT32_MIN)));
    return _mm512_mask_mov_epi32(key, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), _mm512_set1_epi32(-1));
}

/* The lanes of 16 `ok` bytes that are set. */
static inline __mmask16 ok16(const unsigned char *ok) {
    const __m128i b = _mm_loadu_si128((const __m128i *)ok);
    return _mm_test_epi8_mask(b, b);
}
#else
#define PICK_AVX512 0
#endif

/* pk [V] = ok and among the top `topk` of the scores sc [V] by the tie rule (higher first, equal: lower entry
 * first): every ok entry when there are at most topk. The k-th score comes from a radix select over the scores' order
 * keys (`kth_key`: O(V), a few branch-free passes; a quickselect's data-dependent branches cost ~3x as much at 16k
 * entries); which entries it picks depends only on the scores. With AVX-512 the two passes over all V entries (the
 * valid keys with their range, and the marks) take 16 entries at a time; the same keys and marks. tmp holds V
 * floats. */
static void pick_top(const float *sc, const unsigned char *ok, int V, int topk, float *tmp, unsigned char *pk) {
    uint32_t *keys = (uint32_t *)tmp;
    uint32_t lo = UINT32_MAX, hi = 0;
    int n = 0, g = 0;
#if PICK_AVX512
    __m512i vlo = _mm512_set1_epi32(-1), vhi = _mm512_setzero_si512();
    for (; g + 16 <= V; g += 16) {
        const __m512i key = order_keys16(_mm512_loadu_ps(sc + g));
        const __mmask16 v = ok16(ok + g);
        /* (compress in a register, then store all 16 lanes: n + 16 <= g + 16 <= V; the memory form of the
         * compress is microcoded on Zen 4) */
        _mm512_storeu_si512(keys + n, _mm512_maskz_compress_epi32(v, key));
        n += __builtin_popcount(v);
        vlo = _mm512_mask_min_epu32(vlo, v, vlo, key);
        vhi = _mm512_mask_max_epu32(vhi, v, vhi, key);
    }
    lo = (uint32_t)_mm512_reduce_min_epu32(vlo);
    hi = (uint32_t)_mm512_reduce_max_epu32(vhi);
#endif
    for (; g < V; g++) {
        const uint32_t key = order_key(sc[g]);
        keys[n] = key;
        n += ok[g] != 0;
        if (ok[g]) {
            lo = key < lo ? key : lo;
            hi = key > hi ? key : hi;
        }
    }
    if (n <= topk) {
        for (g = 0; g < V; g++) pk[g] = ok[g];
        return;
    }
    int ties; /* entries whose key is the k-th's that the top takes: the lowest ones first */
    const uint32_t kth = kth_key(keys, n, topk, lo, hi, &ties);
    g = 0;
#if PICK_AVX512
    const __m512i vk = _mm512_set1_epi32((int)kth);
    for (; g + 16 <= V; g += 16) {
        const __m512i key = order_keys16(_mm512_loadu_ps(sc + g));
        const __mmask16 v = ok16(ok + g);
        __mmask16 take = _mm512_mask_cmpgt_epu32_mask(v, key, vk);
        __mmask16 equal = _mm512_mask_cmpeq_epu32_mask(v, key, vk);
        for (; equal != 0 && ties > 0; ties--) { /* the lowest entries first */
            take |= equal & (__mmask16)-equal;
            equal &= equal - 1;
        }
        _mm_storeu_si128((__m128i *)(pk + g), _mm_maskz_set1_epi8(take, 1));
    }
#endif
    for (; g < V; g++) {
        const uint32_t key = order_key(sc[g]);
        pk[g] = ok[g] && (key > kth || (key == kth && ties-- > 0));
    }
}

/* One token's `index_scores_from` over its rows: a job for `index_scores_split`. */
typedef struct {
    const float *q, *w, *k;
    long row_stride;
    const long *rows;
    int H, V, D;
    float scale;
    const pool_rows *pool; /* packed or blocked key rows (k unused), or NULL: fp32 rows */
    float *out;
} scores_job;

static void scores_job_fn(void *arg) {
    const scores_job *j = (const scores_job *)arg;
    index_scores_from(j->q, j->w, j->k, 0, j->rows, j->row_stride, 0, 1, j->H, j->V, j->D, j->scale, j->pool,
                      j->out);
}

/* Entries of one token's scores per thread below which a helper is not worth waking (a few microseconds of work). */
#define SCORES_SPLIT_MIN 2048

/* Part `part` of `parts` of one token's scores: its entries, in whole blocks of 32 (the last part ends at V; a
 * multiple of ROW_BLOCK, so a blocked pool's whole blocks stay whole). */
static void scores_part(void *arg, int part, int parts) {
    scores_job j = *(const scores_job *)arg;
    int lo, hi;
    part_range(j.V, 32, part, parts, &lo, &hi);
    if (lo >= hi) return;
    j.rows += lo;
    j.out += lo;
    j.V = hi - lo;
    scores_job_fn(&j);
}

/* One token's scores over its V rows, split by entries over the pool's threads when there are enough of them
 * (SCORES_SPLIT_MIN a thread): each score is computed whole by one thread with the same code, so the bits do not
 * depend on the split. At long context this is a decode step's one O(context) part (DSV4's lightning indexer scores
 * every entry). */
static void index_scores_split(scores_job job) {
    int parts = job.V / SCORES_SPLIT_MIN;
    parts = parts < pool.threads ? parts : pool.threads;
    if (parts < 2 || !pool_take()) {
        scores_job_fn(&job);
        return;
    }
    pool_parts(scores_part, &job, parts);
}

/* The pool's key rows as `index_scores_from` reads them (`keys`: KEYS_*): NULL for fp32 rows. */
static const pool_rows *key_rows(int keys, const void *k, long stride, int D, pool_rows *out) {
    if (keys == KEYS_ROWS) return 0;
    *out = (pool_rows){(void *)k, stride, D, keys == KEYS_PACKED ? INDEX_ROWS : BLOCKED_ROWS};
    return out;
}

/* The lightning indexer's pick for a few decode/verify tokens, keys read in place from the pool (`keys`): fp32 rows
 * `row_stride` floats apart (KEYS_ROWS), the FP8 cache's key rows `row_stride` bytes apart, decoded as they are read
 * (KEYS_PACKED, `packed_rows.c`), or fp32 rows in blocks of ROW_BLOCK, `row_stride` floats from block to block
 * (KEYS_BLOCKED). The scores of `index_scores` (the same bits, over the decoded floats) against each token's
 * rows [T, V], then the top `topk` among its valid entries by the tie rule (higher score first, equal scores: lower
 * entry first). picked [T, V] (bytes) = valid and among the top. scratch holds 2 * V floats. */
void index_pick(const float *q, const float *w, const void *k, long row_stride, int keys, const long *rows,
                const unsigned char *valid, int T, int H, int V, int D, float scale, int topk, float *scratch,
                unsigned char *picked) {
    float *sc = scratch, *tmp = scratch + V;
    pool_rows held;
    const pool_rows *pool_keys = key_rows(keys, k, row_stride, D, &held);
    for (int t = 0; t < T; t++) {
        index_scores_split((scores_job){q + (long)t * H * D, w + (long)t * H, (const float *)k, row_stride,
                                        rows + (long)t * V, H, V, D, scale, pool_keys, sc});
        pick_top(sc, valid + (long)t * V, V, topk, tmp, picked + (long)t * V);
    }
}

/* The top-`topk` mask of each row of scores [T, V] among its valid entries, by the tie rule (`pick_top`): the
 * mask `model.indexer.select_topk` describes, in O(V) a row instead of a sort. scratch holds V floats. */
void topk_mask(const float *scores, const unsigned char *valid, int T, int V, int topk, float *scratch,
               unsigned char *picked) {
    for (int t = 0; t < T; t++)
        pick_top(scores + (long)t * V, valid + (long)t * V, V, topk, scratch, picked + (long)t * V);
}

/* A prefill segment's queries: how many score their shared keys together (each block of keys transposed once for
 * all of them; their scores [G, V] in scratch). */
#define SHARED_PICK_GROUP 16

/* Floats of one part's scratch in `index_pick_shared`: the scores of a group [G, V], pick_top's V, its mask's V
 * bytes. */
#define SHARED_PICK_SCRATCH(V) ((SHARED_PICK_GROUP + 1) * (long)(V) + ((long)(V) + 3) / 4)

/* `index_pick_shared` of queries [0, T) of a job (a part of a segment's queries). */
typedef struct {
    const float *q, *w, *k;
    long row_stride;
    const long *rows;
    const unsigned char *valid;
    int T, H, V, D;
    float scale;
    int topk;
    float *scratch; /* SHARED_PICK_SCRATCH(V) floats a part */
    long *out_rows;
    unsigned char *out_valid;
    pool_rows keys; /* packed or blocked key rows (k unused), as `index_pick` reads them */
    int pooled; /* whether `keys` holds them (else fp32 rows) */
} shared_pick_job;

static void shared_pick_fn(void *arg) {
    const shared_pick_job *j = (const shared_pick_job *)arg;
    const long V = j->V;
    float *sc = j->scratch, *tmp = j->scratch + SHARED_PICK_GROUP * V;
    unsigned char *pk = (unsigned char *)(tmp + V);
    for (int t0 = 0; t0 < j->T; t0 += SHARED_PICK_GROUP) {
        const int n = j->T - t0 < SHARED_PICK_GROUP ? j->T - t0 : SHARED_PICK_GROUP;
        index_scores_from(j->q + (long)t0 * j->H * j->D, j->w + (long)t0 * j->H, j->k, 0, j->rows, j->row_stride, 0,
                          n, j->H, j->V, j->D, j->scale, j->pooled ? &j->keys : 0, sc);
        for (int t = 0; t < n; t++) { /* the pick, then its rows in entry order (`compact_picks`) */
            pick_top(sc + t * V, j->valid + (t0 + t) * V, j->V, j->topk, tmp, pk);
            compact_picks(j->rows, pk, 1, j->V, j->topk, j->out_rows + (long)(t0 + t) * j->topk,
                          j->out_valid + (long)(t0 + t) * j->topk);
        }
    }
}

/* Part `part` of `parts` of a segment's queries, in whole groups of SHARED_PICK_GROUP when every part gets one
 * (the last part ends at T), with the part's own scratch. */
static void shared_pick_part(void *arg, int part, int parts) {
    shared_pick_job j = *(const shared_pick_job *)arg;
    int lo, hi;
    part_range(j.T, j.T / parts >= SHARED_PICK_GROUP ? SHARED_PICK_GROUP : 1, part, parts, &lo, &hi);
    if (lo >= hi) return;
    j.q += (long)lo * j.H * j.D;
    j.w += (long)lo * j.H;
    j.valid += (long)lo * j.V;
    j.out_rows += (long)lo * j.topk;
    j.out_valid += (long)lo * j.topk;
    j.scratch += (long)part * SHARED_PICK_SCRATCH(j.V);
    j.T = hi - lo;
    shared_pick_fn(&j);
}

/* The indexer's pick for the queries of one prefill segment, which share their candidate entries: `index_pick` with
 * one row list rows [V] (read in place from the pool as `index_pick` reads it, `keys`; packed rows decoded once a
 * block for a group of queries) for all T queries, each
 * with its own valid [T, V] (the causal visible count), and the picks as rows of their own (`compact_picks`: out_rows /
 * out_valid [T, topk], in entry order, then invalid padding), with no [T, V] array of scores or mask: the queries go
 * in groups of SHARED_PICK_GROUP, split over the pool's threads (at most `scratch_parts`). Every score and pick is
 * computed whole by one thread with `index_pick`'s code: the same picks. scratch holds scratch_parts *
 * SHARED_PICK_SCRATCH(V) floats (`index_pick_shared_scratch_floats`). */
void index_pick_shared(const float *q, const float *w, const void *k, long row_stride, int keys, const long *rows,
                       const unsigned char *valid, int T, int H, int V, int D, float scale, int topk, float *scratch,
                       int scratch_parts, long *out_rows, unsigned char *out_valid) {
    shared_pick_job job = {q,        w,       (const float *)k, row_stride, rows, valid, T, H, V, D, scale, topk,
                           scratch,  out_rows, out_valid, {0}, 0};
    job.pooled = key_rows(keys, k, row_stride, D, &job.keys) != 0;
    long parts = (long)T * V / SCORES_SPLIT_MIN;
    parts = parts < T ? parts : T;
    parts = parts < pool.threads ? parts : pool.threads;
    parts = parts < scratch_parts ? parts : scratch_parts;
    if (parts < 2 || !pool_take()) {
        shared_pick_fn(&job);
        return;
    }
    pool_parts(shared_pick_part, &job, (int)parts);
}

/* The floats of one part's scratch in `index_pick_shared` over V entries. */
long index_pick_shared_scratch_floats(int V) { return SHARED_PICK_SCRATCH(V); }

/* The picked entries of each token's mask `picked [T, V]` as rows of their own: out_rows/out_valid [T, k] hold its
 * rows[t, g] for the picked g in entry order (the order `sink_attend` reads a mask in, so attending to them gives
 * the mask's bits), then invalid padding (row 0) where fewer than k were picked. */
void compact_picks(const long *rows, const unsigned char *picked, int T, int V, int k, long *out_rows,
                   unsigned char *out_valid) {
    for (int t = 0; t < T; t++) {
        const long *rt = rows + (long)t * V;
        const unsigned char *pt = picked + (long)t * V;
        long *ot = out_rows + (long)t * k;
        unsigned char *vt = out_valid + (long)t * k;
        int n = 0;
        for (int g = 0; g < V && n < k; g++) {
            if (!pt[g]) continue;
            ot[n] = rt[g];
            vt[n++] = 1;
        }
        for (; n < k; n++) {
            ot[n] = 0;
            vt[n] = 0;
        }
    }
}

/* ---- decode-step kernels: a few tokens, many tiny ops in PyTorch ------------------------------------------------ */

/* Row r of one of `sink_attend_p`'s sources: in place (rows `stride` floats apart), or decoded into `row` where the
 * source is packed (pk). */
static inline const float *attend_row(const float *base, long stride, const pool_rows *pk, long r, float *row) {
    if (pk == 0) return base + r * stride;
    rows_read(pk, r, row);
    return row;
}

/* `sink_attend`, where either source may be the FP8 cache's packed rows (swa_pk, comp_pk non-NULL; their
 * base/stride then used instead of swa/comp and the *_stride floats): each row a token reads is decoded into fp32
 * before its use (`packed_rows.c`, the floats the PyTorch path gathers), once for the scores and once for the
 * values, whose pass then runs rows outer and heads inner (each output still sums its rows in key order: the same
 * bits). scratch holds H * (W + V) floats, and H + d more where a source is packed. */
static void sink_attend_p(const float *q, const float *swa, long swa_stride, const pool_rows *swa_pk,
                          const long *win_rows, const unsigned char *win_valid, int W, const float *comp,
                          long comp_stride, const pool_rows *comp_pk, const long *comp_rows,
                          const unsigned char *comp_valid, int V, const float *sink, float scale, int T, int H, int d,
                          float *scratch, float *out) {
    const int K = W + V, packed = swa_pk != 0 || comp_pk != 0;
    float *zs = scratch + (long)H * K, *row = zs + H; /* [H] each head's softmax sum; [d] a decoded row */
    for (int t = 0; t < T; t++) {
        const float *qt = q + (long)t * H * d;
        /* scores [H, K]: each key row read once for every head */
        for (int j = 0; j < K; j++) {
            const int win = j < W;
            const long idx = (long)t * (win ? W : V) + (win ? j : j - W);
            if (!(win ? win_valid[idx] : comp_valid[idx])) {
                for (int h = 0; h < H; h++) scratch[(long)h * K + j] = -INFINITY;
                continue;
            }
            const float *kv = win ? attend_row(swa, swa_stride, swa_pk, win_rows[idx], row)
                                  : attend_row(comp, comp_stride, comp_pk, comp_rows[idx], row);
            int h = 0;
            float s4[4];
            for (; h + 4 <= H; h += 4) {
                dot4(qt + (long)h * d, qt + (long)(h + 1) * d, qt + (long)(h + 2) * d, qt + (long)(h + 3) * d, kv,
                     d, s4);
                for (int i = 0; i < 4; i++) scratch[(long)(h + i) * K + j] = s4[i] * scale;
            }
            for (; h < H; h++) scratch[(long)h * K + j] = dot(qt + (long)h * d, kv, d) * scale;
        }
        for (int h = 0; h < H; h++) {
            float *sc = scratch + (long)h * K, *oh = out + ((long)t * H + h) * d;
            float m = sink[h];
            for (int j = 0; j < K; j++)
                if (sc[j] > m) m = sc[j];
            float z = expf(sink[h] - m);
            for (int j = 0; j < K; j++) {
                sc[j] = sc[j] == -INFINITY ? 0.0f : expf(sc[j] - m);
                z += sc[j];
            }
            for (int c = 0; c < d; c++) oh[c] = 0.0f;
            if (packed) { /* (the values below, rows outer) */
                zs[h] = z;
                continue;
            }
            for (int j = 0; j < K; j++) {
                if (sc[j] == 0.0f) continue;
                const int win = j < W;
                const long idx = (long)t * (win ? W : V) + (win ? j : j - W);
                const float *kv = win ? swa + win_rows[idx] * swa_stride : comp + comp_rows[idx] * comp_stride;
                const float p = sc[j] / z;
                for (int c = 0; c < d; c++) oh[c] += p * kv[c];
            }
        }
        for (int j = 0; packed && j < K; j++) {
            const int win = j < W;
            const long idx = (long)t * (win ? W : V) + (win ? j : j - W);
            const float *kv = 0;
            for (int h = 0; h < H; h++) {
                const float e = scratch[(long)h * K + j];
                if (e == 0.0f) continue;
                if (kv == 0)
                    kv = win ? attend_row(swa, swa_stride, swa_pk, win_rows[idx], row)
                             : attend_row(comp, comp_stride, comp_pk, comp_rows[idx], row);
                float *oh = out + ((long)t * H + h) * d;
                const float p = e / zs[h];
                for (int c = 0; c < d; c++) oh[c] += p * kv[c];
            }
        }
    }
}

/* Sink attention of a few tokens straight from the pools (no gathered copies): token t's H query heads
 * q [T, H, d] attend to the K=V rows swa[win_rows[t, :W]] (where win_valid) and comp[comp_rows[t, :V]] (where
 * comp_valid; comp may be NULL with V = 0; pool rows `*_stride` floats apart), plus one sink logit per head that
 * takes mass but adds no value:
 *   s_k = (q . kv_k) * scale; p = softmax([s, sink[h]]); out[t, h] = sum_k p_k kv_k (keys in window-then-comp order).
 * scratch holds H * (W + V) floats. out [T, H, d]. */
void sink_attend(const float *q, const float *swa, long swa_stride, const long *win_rows,
                 const unsigned char *win_valid, int W, const float *comp, long comp_stride, const long *comp_rows,
                 const unsigned char *comp_valid, int V, const float *sink, float scale, int T, int H, int d,
                 float *scratch, float *out) {
    sink_attend_p(q, swa, swa_stride, 0, win_rows, win_valid, W, comp, comp_stride, 0, comp_rows, comp_valid, V, sink,
                  scale, T, H, d, scratch, out);
}

static void attend_job_fn(void *arg) {
    const attend_job *a = (const attend_job *)arg;
    sink_attend_p(a->q, a->swa, a->swa_stride, a->swa_pk, a->win_rows, a->win_valid, a->W, a->comp, a->comp_stride,
                  a->comp_pk, a->comp_rows, a->comp_valid, a->V, a->sink, a->scale, a->T, a->H, a->d, a->scratch,
                  a->out);
}

/* A part of `sink_attend_rows`: its rows, with its own scratch. */
typedef struct {
    attend_job a;
    long scratch_floats;
} attend_parts;

static void attend_part(void *arg, int part, int parts) {
    const attend_parts *j = (const attend_parts *)arg;
    int lo, hi;
    part_range(j->a.T, 1, part, parts, &lo, &hi);
    if (lo >= hi) return;
    attend_job b = j->a;
    b.q += (long)lo * b.H * b.d;
    b.out += (long)lo * b.H * b.d;
    b.win_rows += (long)lo * b.W;
    b.win_valid += (long)lo * b.W;
    if (b.V > 0) {
        b.comp_rows += (long)lo * b.V;
        b.comp_valid += (long)lo * b.V;
    }
    b.T = hi - lo;
    b.scratch += part * j->scratch_floats;
    attend_job_fn(&b);
}

/* `sink_attend` of a verify step's rows, split over the pool's threads (at most ATTEND_MAX_PARTS parts, each a range
 * of rows with its own scratch: each row's arithmetic unchanged); a.scratch holds ATTEND_MAX_PARTS * scratch_floats
 * floats, scratch_floats >= H*(W+V) (+ H + d where a source is packed) each. */
static void sink_attend_rows(attend_job a, long scratch_floats) {
    int parts = pool.threads < ATTEND_MAX_PARTS ? pool.threads : ATTEND_MAX_PARTS;
    parts = parts < a.T ? parts : a.T;
    if (parts < 2 || !pool_take()) {
        attend_job_fn(&a);
        return;
    }
    attend_parts j = {a, scratch_floats};
    pool_parts(attend_part, &j, parts);
}

/* One compressor's step (`model.compressor.Compressor.run`) in one call. w = coff * dim (coff 2 with overlap).
 *   rows [T, 2w] = proj (rows `pstride` apart) with ape[pos % ratio] added to the score half: [kv | score];
 *   each closing group g pools its `span` source rows (use_cur: rows[cur_rows], else state[hist_rows]); with overlap
 *   source row s < ratio reads channels [0, dim) and the others [dim, 2 dim); per channel a softmax of the scores
 *   over the rows weights the kv values (summed in row order); the entry is RMS-normalised (times norm_w) and
 *   rotated at gpos (tables [max_len, r]) into pool[out_rows[g]] (rows of `dim`);
 *   then state[write_rows[n]] = rows[write_tokens[n]] (after the groups: writes may reuse rows they read).
 * state and pool rows are `*_stride` floats apart. scratch holds 3 * dim floats. */
void compressor_run(const float *proj, long pstride, const long *positions, int T, const float *ape, int ratio,
                    int dim, int overlap, int G, const long *out_rows, const long *gpos, const unsigned char *use_cur,
                    const long *cur_rows, const long *hist_rows, int N, const long *write_tokens,
                    const long *write_rows, const float *norm_w, float eps, const float *cos_table,
                    const float *sin_table, int r, float *rows, float *state, long state_stride, float *pool,
                    long pool_stride, float *scratch) {
    const int w = (overlap ? 2 : 1) * dim, span = (overlap ? 2 : 1) * ratio;
    for (int t = 0; t < T; t++) {
        const float *p = proj + (long)t * pstride, *a = ape + (positions[t] % ratio) * w;
        float *o = rows + (long)t * 2 * w;
        for (int c = 0; c < w; c++) o[c] = p[c];
        for (int c = 0; c < w; c++) o[w + c] = p[w + c] + a[c];
    }
    float *mx = scratch, *z = scratch + dim, *pooled = scratch + 2 * dim;
    for (int g = 0; g < G; g++) {
        const long base = (long)g * span;
        for (int pass = 0; pass < 3; pass++) {
            for (int c = 0; c < dim; c++) {
                if (pass == 0) mx[c] = -INFINITY;
                if (pass == 1) z[c] = 0.0f;
                if (pass == 2) pooled[c] = 0.0f;
            }
            for (int s = 0; s < span; s++) {
                const float *src = use_cur[base + s] ? rows + cur_rows[base + s] * 2 * w
                                                  : state + hist_rows[base + s] * state_stride;
                const int off = overlap && s >= ratio ? dim : 0;
                const float *kv = src + off, *sc = src + w + off;
                for (int c = 0; c < dim; c++) {
                    if (pass == 0) mx[c] = sc[c] > mx[c] ? sc[c] : mx[c];
                    else if (pass == 1) z[c] += expf(sc[c] - mx[c]);
                    else pooled[c] += kv[c] * (expf(sc[c] - mx[c]) / z[c]);
                }
            }
        }
        float *entry = pool + out_rows[g] * pool_stride;
        rms_norm(pooled, dim, norm_w, 1, dim, eps, pooled);
        rope_rotate(pooled, cos_table + gpos[g] * r, sin_table + gpos[g] * r, 1, 1, dim, r, 1.0f, entry);
    }
    for (int n = 0; n < N; n++) {
        const float *src = rows + write_tokens[n] * 2 * w;
        float *dst = state + write_rows[n] * state_stride;
        for (int c = 0; c < 2 * w; c++) dst[c] = src[c];
    }
}

/* RMS normalisation (times w when not NULL) then rotation of the trailing r channels, for N rows of D channels:
 * row n = token n / H (its rope tables cos/sin [r] at cos + (n / H) * r), read `x_stride` floats apart; written
 * packed into out (out_rows NULL) or to out + out_rows[n] * out_stride (a pool's rows). scratch holds D floats. */
void norm_rope(const float *x, long x_stride, const float *w, int N, int H, int D, float eps, const float *cos,
               const float *sin, int r, float *out, const long *out_rows, long out_stride, float *scratch) {
    for (int n = 0; n < N; n++) {
        rms_norm(x + (long)n * x_stride, D, w, 1, D, eps, scratch);
        float *o = out_rows == 0 ? out + (long)n * D : out + out_rows[n] * out_stride;
        rope_rotate(scratch, cos + (long)(n / H) * r, sin + (long)(n / H) * r, 1, 1, D, r, 1.0f, o);
    }
}

/* The attention output projection of a few tokens: o [T, H, d] rotated back by -position (tables [T, r]), the
 * grouped low-rank projection (head group g's H*d/G channels through wo_a rows [g*L, (g+1)*L)) and wo_b [Dm, G*L]:
 *   out [T, Dm] = wo_b @ concat_g(wo_a_g @ unrotate(o)_g). scratch holds H*d + G*L floats. */
void attn_out(const float *o, const float *cos, const float *sin, int T, int H, int d, int r, const float *wo_a,
              int G, int L, const float *wo_b, int Dm, float *scratch, float *out) {
    const int C = H * d / G;
    float *un = scratch, *mid = scratch + H * d;
    for (int t = 0; t < T; t++) {
        rope_rotate(o + (long)t * H * d, cos + (long)t * r, sin + (long)t * r, 1, H, d, r, -1.0f, un);
        for (int g = 0; g < G; g++) gemv(wo_a + (long)g * L * C, un + (long)g * C, L, C, mid + g * L);
        gemv(wo_b, mid, Dm, G * L, out + (long)t * Dm);
    }
}

/* `attn_out` with the rows sharing each weight read (`gemm_exact`; the same bits): every token unrotated first,
 * then each group's wo_a and wo_b over all T rows. scratch holds T * (H*d + G*L) floats. */
static int attn_out_rows_p(const float *o, const float *cos, const float *sin, int T, int H, int d, int r,
                           const long *wo_a, int G, int L, const long *wo_b, int Dm, float *scratch, float *out) {
    const int C = H * d / G;
    float *un = scratch, *mid = scratch + (long)T * H * d;
    for (int t = 0; t < T; t++)
        rope_rotate(o + (long)t * H * d, cos + (long)t * r, sin + (long)t * r, 1, H, d, r, -1.0f,
                    un + (long)t * H * d);
    for (int g = 0; g < G; g++)
        if (gemm_proj(wo_a, (long)g * L, un + (long)g * C, H * d, T, L, C, mid + g * L, (long)G * L) != 0) return -1;
    return gemm_proj(wo_b, 0, mid, (long)G * L, T, Dm, G * L, out, Dm);
}

void attn_out_rows(const float *o, const float *cos, const float *sin, int T, int H, int d, int r, const float *wo_a,
                   int G, int L, const float *wo_b, int Dm, float *scratch, float *out) {
    long pa[1 + PS_COUNT], pb[1 + PS_COUNT];
    attn_out_rows_p(o, cos, sin, T, H, d, r, proj_plain(pa, wo_a, 0, (long)G * L), G, L,
                    proj_plain(pb, wo_b, 0, Dm), Dm, scratch, out); /* (plain weights: nothing to allocate) */
}

/* The model's head for a few rows: the final mHC collapse (`HyperHead`: no Sinkhorn), the final RMSNorm and the
 * LM head (fp32, or bf16 bits when head_bf16). Per row of streams h [N, hc, D]: flat = h * rsqrt(mean(h^2) +
 * norm_eps); pre_i = sigmoid(fn_i . flat * scale + base_i) + hc_eps; y = sum_i pre_i h_i (in stream order);
 * y = rms_norm(y) * norm_w; out [N, V] = head @ y.
 * scratch holds hc*D + N*D floats. */
void lm_head(const float *h, int N, int hc, int D, const float *fn, const float *scale, const float *base,
             float hc_eps, float norm_eps, const float *norm_w, float eps, const void *head, int V, int head_bf16,
             float *scratch, float *out) {
    const int HD = hc * D;
    float *flat = scratch, *ys = scratch + HD;
    for (int n = 0; n < N; n++) {
        const float *hn = h + (long)n * HD;
        float *y = ys + (long)n * D;
        const float r = 1.0f / sqrtf(dot(hn, hn, HD) / (float)HD + norm_eps);
        for (int k = 0; k < HD; k++) flat[k] = hn[k] * r;
        for (int d = 0; d < D; d++) y[d] = 0.0f;
        for (int i = 0; i < hc; i++) {
            const float pre = sigmoidf(dot(fn + (long)i * HD, flat, HD) * scale[0] + base[i]) + hc_eps;
            for (int d = 0; d < D; d++) y[d] = i == 0 ? pre * hn[d] : y[d] + pre * hn[i * D + d];
        }
        rms_norm(y, D, norm_w, 1, D, eps, y);
    }
    gemm_exact_w(head, 0, head_bf16, ys, D, N, V, D, out, V); /* the rows share each read of the head */
}
