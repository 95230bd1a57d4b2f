/* pdspark CPU kernels, draft_block.c: a DSpark draft block (`model.cpu.draft_step`): every stage and the head of one
 * proposal in one call (`draft_block`), and the context rows of committed tokens (`draft_inject`). */
#include "kernels.h"

/* Sink attention of M draft blocks of G rows: row (m, g)'s H heads q [T, H, d] attend to block m's W context rows
 * ctx[rows[m, :]] (where valid[m, :]; pool rows `cstride` floats apart) and then to all G rows of its block bkv
 * [T, d] (bidirectional), plus one sink logit per head, with `sink_attend`'s arithmetic. sc holds H * (W + G)
 * floats. out [T, H, d]. */
static void draft_attend(const float *q, const float *ctx, long cstride, const long *rows,
                         const unsigned char *valid, int W, const float *bkv, int M, int G, int H, int d,
                         const float *sink, float scale, float *sc, float *out) {
    const int K = W + G;
    for (int m = 0; m < M; m++) {
        for (int g = 0; g < G; g++) {
            const long t = (long)m * G + g;
            const float *qt = q + t * H * d;
            for (int j = 0; j < K; j++) {
                if (j < W && !valid[(long)m * W + j]) {
                    for (int h = 0; h < H; h++) sc[(long)h * K + j] = -INFINITY;
                    continue;
                }
                const float *kv = j < W ? ctx + rows[(long)m * W + j] * cstride : bkv + ((long)m * G + j - W) * d;
                int h = 0;
                float s4[4];
                for (; h + 4 <= H; h += 4) {
                    dot4(qt + (long)h * d, qt + (long)(h + 1) * d, qt + (long)(h + 2) * d, qt + (long)(h + 3) * d,
                         kv, d, s4);
                    for (int i = 0; i < 4; i++) sc[(long)(h + i) * K + j] = s4[i] * scale;
                }
                for (; h < H; h++) sc[(long)h * K + j] = dot(qt + (long)h * d, kv, d) * scale;
            }
            for (int h = 0; h < H; h++) {
                float *s = sc + (long)h * K, *oh = out + (t * H + h) * d;
                float mx = sink[h];
                for (int j = 0; j < K; j++)
                    if (s[j] > mx) mx = s[j];
                float z = expf(sink[h] - mx);
                for (int j = 0; j < K; j++) {
                    s[j] = s[j] == -INFINITY ? 0.0f : expf(s[j] - mx);
                    z += s[j];
                }
                for (int c = 0; c < d; c++) oh[c] = 0.0f;
                for (int j = 0; j < K; j++) {
                    if (s[j] == 0.0f) continue;
                    const float *kv = j < W ? ctx + rows[(long)m * W + j] * cstride
                                            : bkv + ((long)m * G + j - W) * d;
                    const float p = s[j] / z;
                    for (int c = 0; c < d; c++) oh[c] += p * kv[c];
                }
            }
        }
    }
}

/* Floats `draft_block` carves from its scratch for M blocks over W context rows. */
long draft_scratch_floats(const int *wi, int M, int W) {
    const long T = (long)M * wi[DI_GAMMA], hc = wi[DI_HC], D = wi[DI_D], QL = wi[DI_QL], H = wi[DI_H];
    const long HD = wi[DI_HD], GL = (long)wi[DI_G] * wi[DI_L], I = wi[DI_INTER], r = wi[DI_R];
    const long per_row = 2 * r + 3 * hc * D + 2 * D + hc + hc + hc * hc + QL + HD + QL + 4 * H * HD + HD + GL + 2 * I
                         + I + hc * D + (2 + hc) * hc;
    return T * per_row + H * (W + wi[DI_GAMMA]) + HD + 16 * 32;
}

/* One stage (`DraftStage.forward_prepared`) on the block rows' streams h [T, hc, D] -> h_out: the mHC collapse with
 * the attention norm, q_a and the latent in one projection, the queries (q norm, wq_b, head norm, rope), the block's
 * K=V rows (kv norm, rope), the attention over context and block rows, the output projection, the expand; the FFN
 * collapse with its norm, gate and up in one projection, SwiGLU, down, the expand. cos/sin [T, r]. */
static void draft_stage(const long *wp, const int *wi, const float *wf, int M, const float *ctx, long cstride,
                        const long *rows, const unsigned char *valid, int W, const float *cos, const float *sin,
                        const float *h, float *h_out, float *at) {
    const int G = wi[DI_GAMMA], T = M * G, hc = wi[DI_HC], D = wi[DI_D], QL = wi[DI_QL], H = wi[DI_H];
    const int HD = wi[DI_HD], OG = wi[DI_G], L = wi[DI_L], I = wi[DI_INTER], r = wi[DI_R], NX = QL + HD;
    const int C = H * HD / OG, bf = wi[DI_BF16];
    float *x = take(&at, (long)T * D), *pre = take(&at, (long)T * hc), *post = take(&at, (long)T * hc);
    float *comb = take(&at, (long)T * hc * hc), *cscr = take(&at, (long)T * (hc * D + (2 + hc) * hc));
    float *xp = take(&at, (long)T * NX), *qr = take(&at, (long)T * QL), *qh = take(&at, (long)T * H * HD);
    float *q = take(&at, (long)T * H * HD), *bkv = take(&at, (long)T * HD), *o = take(&at, (long)T * H * HD);
    float *un = take(&at, (long)T * H * HD), *mid = take(&at, (long)T * OG * L), *y = take(&at, (long)T * D);
    float *hm = take(&at, (long)T * hc * D), *gu = take(&at, (long)T * 2 * I), *act = take(&at, (long)T * I);
    float *small = take(&at, HD), *sc = take(&at, (long)H * (W + G));

    hc_collapse(h, PTR(wp, DW_ATTN_FN), PTR(wp, DW_ATTN_SCALE), PTR(wp, DW_ATTN_BASE), T, hc, D, wi[DI_ITERS],
                wf[DF_HC_EPS], wf[DF_HC_NORM_EPS], cscr, x, pre, post, comb, PTR(wp, DW_ATTN_NORM),
                wf[DF_ATTN_NORM_EPS]);
    gemm_rows_w(PTR(wp, DW_X), 0, bf, x, D, T, NX, D, xp, NX);
    rms_norm(xp, NX, PTR(wp, DW_Q_NORM), T, QL, wf[DF_Q_EPS], qr);
    gemm_rows_w(PTR(wp, DW_Q_B), 0, bf, qr, QL, T, H * HD, QL, qh, (long)H * HD);
    norm_rope(qh, HD, 0, T * H, H, HD, wf[DF_HEAD_EPS], cos, sin, r, q, 0, 0, small);
    norm_rope(xp + QL, NX, PTR(wp, DW_KV_NORM), T, 1, HD, wf[DF_KV_EPS], cos, sin, r, bkv, 0, 0, small);
    draft_attend(q, ctx, cstride, rows, valid, W, bkv, M, G, H, HD, PTR(wp, DW_SINK), wf[DF_SCALE], sc, o);
    /* `attn_out` with the rows sharing each weight read */
    rope_rotate(o, cos, sin, T, H, HD, r, -1.0f, un);
    for (int g = 0; g < OG; g++)
        gemm_rows_w(PTR(wp, DW_O_A), (long)g * L * C, bf, un + (long)g * C, (long)H * HD, T, L, C, mid + (long)g * L,
                  (long)OG * L);
    gemm_rows_w(PTR(wp, DW_O_B), 0, bf, mid, (long)OG * L, T, D, OG * L, y, D);
    hc_expand(y, h, post, comb, T, hc, D, hm);

    hc_collapse(hm, PTR(wp, DW_FFN_FN), PTR(wp, DW_FFN_SCALE), PTR(wp, DW_FFN_BASE), T, hc, D, wi[DI_ITERS],
                wf[DF_HC_EPS], wf[DF_HC_NORM_EPS], cscr, x, pre, post, comb, PTR(wp, DW_FFN_NORM),
                wf[DF_FFN_NORM_EPS]);
    gemm_rows_w(PTR(wp, DW_GATE_UP), 0, bf, x, D, T, 2 * I, D, gu, 2L * I);
    for (int t = 0; t < T; t++)
        for (int i = 0; i < I; i++)
            act[(long)t * I + i] = swiglu1(gu[(long)t * 2 * I + i], gu[(long)t * 2 * I + I + i], wf[DF_LIMIT]);
    gemm_rows_w(PTR(wp, DW_DOWN), 0, bf, act, I, T, D, I, y, D);
    hc_expand(y, hm, post, comb, T, hc, D, h_out);
}

/* `DSparkDraft.base_logits(block_hidden(...))` of M blocks in one call: block m's rows are [anchors[m], MASK x
 * (G-1)] at positions anchor_pos[m] + 0 .. G-1, embedded and replicated over the hc streams; every stage
 * (`draft_stage`, stage s reading its context rows from ctx[2s] with row stride ctx[2s+1]); then per row the head's
 * collapse, the final norm and the LM head, as `lm_head` does (its rows sharing each weight read).
 * wp [S * DW_COUNT + DH_COUNT] pointers; rows, valid [M, W]; logits [M * G, V]. */
void draft_block(const long *wp, const int *wi, const float *wf, const long *anchors, const long *anchor_pos, int M,
                 const long *ctx, const long *rows, const unsigned char *valid, int W, float *scratch,
                 float *logits) {
    const int S = wi[DI_STAGES], G = wi[DI_GAMMA], T = M * G, hc = wi[DI_HC], D = wi[DI_D], r = wi[DI_R];
    const int V = wi[DI_V];
    const long *hp = wp + (long)S * DW_COUNT;
    float *at = scratch;
    float *cos = take(&at, (long)T * r), *sin = take(&at, (long)T * r);
    float *h = take(&at, (long)T * hc * D), *h2 = take(&at, (long)T * hc * D);
    for (int t = 0; t < T; t++) {
        const long pos = anchor_pos[t / G] + t % G, id = t % G == 0 ? anchors[t / G] : wi[DI_MASK];
        for (int c = 0; c < r; c++) {
            cos[(long)t * r + c] = PTR(hp, DH_COS)[pos * r + c];
            sin[(long)t * r + c] = PTR(hp, DH_SIN)[pos * r + c];
        }
        const float *e = PTR(hp, DH_EMBED) + id * D;
        for (int i = 0; i < hc; i++)
            for (int d = 0; d < D; d++) h[((long)t * hc + i) * D + d] = e[d];
    }
    for (int s = 0; s < S; s++) {
        draft_stage(wp + (long)s * DW_COUNT, wi, wf, M, (const float *)ctx[2 * s], ctx[2 * s + 1], rows, valid, W,
                    cos, sin, h, h2, at);
        float *swap = h;
        h = h2;
        h2 = swap;
    }
    /* the head: `lm_head`'s collapse and norm per row into y [T, D], then the LM head for all rows */
    const int HDc = hc * D;
    float *flat = take(&at, HDc), *y = h2;
    const float *fn = PTR(hp, DH_HC_FN), *scale = PTR(hp, DH_HC_SCALE), *base = PTR(hp, DH_HC_BASE);
    for (int t = 0; t < T; t++) {
        const float *hn = h + (long)t * HDc;
        float *yt = y + (long)t * D;
        const float rr = 1.0f / sqrtf(dot(hn, hn, HDc) / (float)HDc + wf[DF_HEAD_NORM_EPS]);
        for (int k = 0; k < HDc; k++) flat[k] = hn[k] * rr;
        for (int d = 0; d < D; d++) yt[d] = 0.0f;
        for (int i = 0; i < hc; i++) {
            const float pre = sigmoidf(dot(fn + (long)i * HDc, flat, HDc) * scale[0] + base[i]) + wf[DF_HEAD_HC_EPS];
            for (int d = 0; d < D; d++) yt[d] = i == 0 ? pre * hn[d] : yt[d] + pre * hn[i * D + d];
        }
        rms_norm(yt, D, PTR(hp, DH_NORM), 1, D, wf[DF_NORM_EPS], yt);
    }
    gemm_rows_w(PTR(hp, DH_HEAD), 0, wi[DI_BF16], y, D, T, V, D, logits, V);
}

/* `DSparkDrafter.inject` in one call: the context rows of N committed tokens from their target features
 * features [N, F]: main_x = rms_norm(main_proj [D, F] @ f) * main_norm; every stage's latent in one projection
 * (latents [S * HD, D], stage s's rows s*HD ..); stage s's row = rope(rms_norm(latent_s) * kv_norm_s, position),
 * written to ctx[2s] + slots[n] * ctx[2s+1]. scratch holds N * (2r + D + S*HD) + HD floats (+ rounding). */
void draft_inject(const long *wp, const int *wi, const float *wf, const float *features, int N,
                  const long *positions, const long *ctx, const long *slots, float *scratch) {
    const int S = wi[DI_STAGES], D = wi[DI_D], HD = wi[DI_HD], r = wi[DI_R], F = wi[DI_FEATURES];
    const long *hp = wp + (long)S * DW_COUNT;
    float *at = scratch;
    float *cos = take(&at, (long)N * r), *sin = take(&at, (long)N * r), *x = take(&at, (long)N * D);
    float *lat = take(&at, (long)N * S * HD), *small = take(&at, HD);
    for (int n = 0; n < N; n++)
        for (int c = 0; c < r; c++) {
            cos[(long)n * r + c] = PTR(hp, DH_COS)[positions[n] * r + c];
            sin[(long)n * r + c] = PTR(hp, DH_SIN)[positions[n] * r + c];
        }
    gemm_rows_w(PTR(hp, DH_MAIN_PROJ), 0, wi[DI_BF16], features, F, N, D, F, x, D);
    rms_norm(x, D, PTR(hp, DH_MAIN_NORM), N, D, wf[DF_MAIN_NORM_EPS], x);
    gemm_rows_w(PTR(hp, DH_LATENTS), 0, wi[DI_BF16], x, D, N, S * HD, D, lat, (long)S * HD);
    for (int s = 0; s < S; s++)
        norm_rope(lat + (long)s * HD, (long)S * HD, PTR(wp + (long)s * DW_COUNT, DW_KV_NORM), N, 1, HD,
                  wf[DF_KV_EPS], cos, sin, r, (float *)ctx[2 * s], slots, ctx[2 * s + 1], small);
}
