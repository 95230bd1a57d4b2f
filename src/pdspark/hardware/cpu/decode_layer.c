/* pdspark CPU kernels, decode_layer.c: one whole decoder layer of a decode step (`decode_layer`), its scratch
 * formula, and every layer of a small step after `decode_index` (`decode_layers`). */
#include "kernels.h"

/* The floats `decode_layer` carves from its scratch (each `take` below, rounded as `take` rounds) for T tokens,
 * at most V visible compressed entries and a window of W, given the layer's sizes wi: the one formula Python sizes
 * the scratch with (`kernels.decode_layer_scratch_floats`) and `decode_layers` checks against. Keep it in step with
 * the takes of `decode_layer`. */
static long r16(long n) { return (n + 15) & ~15L; }

/* The widest row a layer writes to its pools (SWA latent, compressed entry, indexer key). */
static int staged_width(int HD, int cdim, int Di) {
    const int w = HD > cdim ? HD : cdim;
    return w > Di ? w : Di;
}

/* Whether a layer's pools (`decode_layer`'s pp) hold any rows written through a staging row (packed or blocked). */
static int pools_packed(const long *pp) { return pp[P_KV_PACKED] != 0 || pp[P_IDX_KEYS] != KEYS_ROWS; }

long decode_layer_scratch_floats(const int *wi, int T, int V, int W, int packed) {
    const int kind = wi[I_KIND], hc = wi[I_HC], D = wi[I_D], QL = wi[I_QL], H = wi[I_H], HD = wi[I_HD];
    const int cdim = wi[I_C_DIM], cw = kind == KIND_CSA ? 2 * cdim : cdim;
    const int Hi = wi[I_I_HEADS], Di = wi[I_I_DIM], iw = 2 * Di;
    const int E = wi[I_E], I = wi[I_INTER], K = wi[I_K];
    const int NX = QL + HD + (kind != KIND_SLIDING ? 2 * cw : 0) + (kind == KIND_CSA ? 2 * iw + Hi : 0);
    const long t = T, M = (2 + hc) * hc;
    long n = r16(t * D) + 2 * r16(t * hc) + r16(t * hc * hc) + r16(t * (hc * D + M)) + r16(t * NX) + r16(t * QL)
             + 3 * r16(t * H * HD) + r16(t * D) + r16(t * hc * D) + r16(4L * (HD > 3 * Di ? HD : 3 * Di) + 64);
    if (kind != KIND_SLIDING) {
        n += r16(t * 2 * (cw > iw ? cw : iw));
        if (kind == KIND_CSA && V > wi[I_I_TOPK])
            n += 2 * r16(t * Hi * Di) + r16(t * Hi) + r16(2L * V) + r16((t * V + 3) / 4)
                 + r16(2L * t * wi[I_I_TOPK]) + r16((t * wi[I_I_TOPK] + 3) / 4);
    }
    n += r16(ATTEND_MAX_PARTS * ((long)H * (W + V) + 16)) + r16(t * (H * HD + wi[I_G] * wi[I_L]))
         + r16(t * (E + 2 * I));
    if (T == 1 && wi[I_E_HELD] == E) n += r16(3L * I + 2L * D + K);
    else n += r16(2 * t * K) + r16(t * K) + r16(moe_rows_scratch_floats(T, K, D, I));
    if (packed) /* the FP8 cache's rows in fp32 before they are encoded (and their rows 0 .. T-1); attention's row */
        n += r16(2 * t) + r16(t * staged_width(HD, cdim, Di)) + r16(ATTEND_MAX_PARTS * (H + HD));
    return n;
}

/* `DecoderLayer.forward` for a few decode tokens that gather their own windows (no dense segments): the mHC
 * collapse (with the sublayer norm), the fused x projection, the queries, the raw latent written to its SWA rows,
 * the compressors and the CSA indexer's pick, the sink attention read from the pools, the output projection, the
 * expand; then the FFN collapse, the MoE and the expand. The same steps, in the same order, as the separate calls
 * (BLAS matmuls become `dot` GEMVs). h and h_out [T, hc, D]. scratch: see `kernels.decode_layer_scratch_floats`.
 * Projections (W_X, W_Q_B, W_I_Q_B, W_O_A, W_O_B, W_MOE_IN, W_13, W_2, W_2S) are `gemm_proj` descriptors: fp32,
 * bf16 bits or the checkpoint's compact FP8/MXFP4 weights, segment by segment.
 * Returns 0, -1 when the expert exchange (expert parallelism) failed, -3 when a compact weight block's scratch could
 * not be allocated. */
static int decode_layer_run(const long *wp, const int *wi, const float *wf, const long *sp, const int *si,
                             const long *pp, const float *h, float *h_out, float *scratch, long *ids_buf) {
    const int T = si[SI_T], W = si[SI_W], r = si[SI_R];
    const int kind = wi[I_KIND], hc = wi[I_HC], D = wi[I_D], QL = wi[I_QL], H = wi[I_H], HD = wi[I_HD];
    const int cdim = wi[I_C_DIM], cw = kind == KIND_CSA ? 2 * cdim : cdim; /* compressor width (coff * dim) */
    const int Hi = wi[I_I_HEADS], Di = wi[I_I_DIM], iw = 2 * Di;
    const int E = wi[I_E], I = wi[I_INTER], K = wi[I_K];
    const int NX = QL + HD + (kind != KIND_SLIDING ? 2 * cw : 0) + (kind == KIND_CSA ? 2 * iw + Hi : 0);
    const int M = (2 + hc) * hc;
    const float *cos = kind == KIND_SLIDING ? PTR(sp, S_COS_MAIN) : PTR(sp, S_COS_COMP);
    const float *sin = kind == KIND_SLIDING ? PTR(sp, S_SIN_MAIN) : PTR(sp, S_SIN_COMP);
    /* The FP8 cache (`packed_rows.c`): rows are computed in fp32 into `staged` as for float pools, then encoded
     * into their pool rows; attention reads its rows decoded into fp32 first. The indexer decodes its keys itself.
     * Its keys may also be fp32 rows in blocks (KEYS_BLOCKED), written through the staging row the same way. */
    const int kv_packed = (int)pp[P_KV_PACKED], idx_keys = (int)pp[P_IDX_KEYS];
    const pool_rows swa_rows = {(void *)pp[P_SWA], pp[P_SWA_STRIDE], HD, kv_packed ? r : FLOAT_ROWS};
    const pool_rows comp_pool = {(void *)pp[P_COMP], pp[P_COMP_STRIDE], HD, kv_packed ? r : FLOAT_ROWS};
    float *at = scratch;
    float *x = take(&at, (long)T * D), *pre = take(&at, (long)T * hc), *post = take(&at, (long)T * hc);
    float *comb = take(&at, (long)T * hc * hc), *cscr = take(&at, (long)T * (hc * D + M));
    float *xp = take(&at, (long)T * NX), *qr = take(&at, (long)T * QL), *qh = take(&at, (long)T * H * HD);
    float *q = take(&at, (long)T * H * HD), *o = take(&at, (long)T * H * HD), *y = take(&at, (long)T * D);
    float *hm = take(&at, (long)T * hc * D), *small = take(&at, 4L * (HD > 3 * Di ? HD : 3 * Di) + 64);

    /* attention sublayer */
    hc_collapse(h, PTR(wp, W_ATTN_FN), PTR(wp, W_ATTN_SCALE), PTR(wp, W_ATTN_BASE), T, hc, D, wi[I_ITERS],
                wf[F_HC_EPS], wf[F_HC_NORM_EPS], cscr, x, pre, post, comb, PTR(wp, W_ATTN_NORM), wf[F_ATTN_NORM_EPS]);
    if (gemm_proj(LPTR(wp, W_X), 0, x, D, T, NX, D, xp, NX) != 0) return -3;
    rms_norm(xp, NX, PTR(wp, W_Q_NORM), T, QL, wf[F_Q_EPS], qr);
    if (gemm_proj(LPTR(wp, W_Q_B), 0, qr, QL, T, H * HD, QL, qh, H * HD) != 0) return -3;
    norm_rope(qh, HD, 0, T * H, H, HD, wf[F_HEAD_EPS], cos, sin, r, q, 0, 0, small);
    long *ident = 0; /* 0 .. T-1: the staged rows */
    float *staged = 0;
    if (pools_packed(pp)) {
        ident = (long *)take(&at, 2L * T);
        staged = take(&at, (long)T * staged_width(HD, cdim, Di));
        for (int t = 0; t < T; t++) ident[t] = t;
    }
    if (kv_packed) {
        norm_rope(xp + QL, NX, PTR(wp, W_KV_NORM), T, 1, HD, wf[F_KV_EPS], cos, sin, r, staged, 0, 0, small);
        for (int t = 0; t < T; t++) rows_write(&swa_rows, LPTR(sp, S_SLOTS)[t], staged + (long)t * HD);
    } else {
        norm_rope(xp + QL, NX, PTR(wp, W_KV_NORM), T, 1, HD, wf[F_KV_EPS], cos, sin, r, (float *)pp[P_SWA],
                  LPTR(sp, S_SLOTS), pp[P_SWA_STRIDE], small);
    }
    const float *comp = 0;
    const long *comp_rows = 0;
    const unsigned char *comp_valid = 0;
    int V = 0;
    if (kind != KIND_SLIDING) {
        const int csa = kind == KIND_CSA;
        const int p0 = csa ? S_CP_OUT : S_HP_OUT;
        float *rows = take(&at, (long)T * 2 * (cw > iw ? cw : iw));
        const int G = si[csa ? SI_G_CSA : SI_G_HCA];
        compressor_run(xp + QL + HD, NX, LPTR(sp, S_POS), T, PTR(wp, W_C_APE), wi[I_C_RATIO], cdim, csa, G,
                       kv_packed ? ident : LPTR(sp, p0), LPTR(sp, p0 + 1), BPTR(sp, p0 + 2), LPTR(sp, p0 + 3),
                       LPTR(sp, p0 + 4), si[csa ? SI_N_CSA : SI_N_HCA], LPTR(sp, p0 + 5), LPTR(sp, p0 + 6),
                       PTR(wp, W_C_NORM), wf[F_C_EPS], PTR(sp, S_TAB_COS), PTR(sp, S_TAB_SIN), r, rows,
                       (float *)pp[P_STATE], pp[P_STATE_STRIDE], kv_packed ? staged : (float *)pp[P_COMP],
                       kv_packed ? HD : pp[P_COMP_STRIDE], small);
        for (int g = 0; kv_packed && g < G; g++) rows_write(&comp_pool, LPTR(sp, p0)[g], staged + (long)g * HD);
        comp = (const float *)pp[P_COMP];
        if (csa) {
            const pool_rows idx_pool = {(void *)pp[P_IDX], pp[P_IDX_STRIDE], Di,
                                        idx_keys == KEYS_PACKED    ? INDEX_ROWS
                                        : idx_keys == KEYS_BLOCKED ? BLOCKED_ROWS
                                                                   : FLOAT_ROWS};
            const int idx_staged = rows_packed(&idx_pool); /* (written row by row through `rows_write`) */
            compressor_run(xp + QL + HD + 2 * cw, NX, LPTR(sp, S_POS), T, PTR(wp, W_I_APE), wi[I_C_RATIO], Di, 1,
                           G, idx_staged ? ident : LPTR(sp, S_CP_OUT), LPTR(sp, S_CP_POS), BPTR(sp, S_CP_USE),
                           LPTR(sp, S_CP_CUR), LPTR(sp, S_CP_HIST), si[SI_N_CSA], LPTR(sp, S_CP_WTOK),
                           LPTR(sp, S_CP_WROW), PTR(wp, W_I_NORM), wf[F_I_EPS], PTR(sp, S_TAB_COS),
                           PTR(sp, S_TAB_SIN), r, rows, (float *)pp[P_IDX_STATE], pp[P_IDX_STATE_STRIDE],
                           idx_staged ? staged : (float *)pp[P_IDX], idx_staged ? Di : pp[P_IDX_STRIDE], small);
            for (int g = 0; idx_staged && g < G; g++)
                rows_write(&idx_pool, LPTR(sp, S_CP_OUT)[g], staged + (long)g * Di);
            V = si[SI_V_CSA];
            comp_rows = LPTR(sp, S_CSA_ROWS);
            comp_valid = BPTR(sp, S_CSA_VALID);
            if (V > wi[I_I_TOPK]) { /* the indexer picks; otherwise every visible entry */
                float *iq = take(&at, (long)T * Hi * Di), *iqr = take(&at, (long)T * Hi * Di);
                float *iwt = take(&at, (long)T * Hi), *isc = take(&at, 2L * V);
                unsigned char *picked = (unsigned char *)take(&at, ((long)T * V + 3) / 4);
                if (gemm_proj(LPTR(wp, W_I_Q_B), 0, qr, QL, T, Hi * Di, QL, iq, Hi * Di) != 0) return -3;
                for (int t = 0; t < T; t++) {
                    const float *hw = xp + (long)t * NX + QL + HD + 2 * cw + 2 * iw;
                    for (int j = 0; j < Hi; j++) iwt[t * Hi + j] = hw[j] * wf[F_I_WSCALE];
                }
                rope_rotate(iq, cos, sin, T, Hi, Di, r, 1.0f, iqr);
                index_pick(iqr, iwt, (const void *)pp[P_IDX], pp[P_IDX_STRIDE], idx_keys, comp_rows, comp_valid, T,
                           Hi, V, Di, wf[F_I_SCALE], wi[I_I_TOPK], isc, picked);
                /* Attention reads the picked entries only: the window and topk rows whatever the context. */
                const int k = wi[I_I_TOPK];
                long *crows = (long *)take(&at, 2L * T * k);
                unsigned char *cvalid = (unsigned char *)take(&at, ((long)T * k + 3) / 4);
                compact_picks(comp_rows, picked, T, V, k, crows, cvalid);
                comp_rows = crows;
                comp_valid = cvalid;
                V = k;
            }
        } else {
            V = si[SI_V_HCA];
            comp_rows = LPTR(sp, S_HCA_ROWS);
            comp_valid = BPTR(sp, S_HCA_VALID);
        }
        if (V == 0) comp = 0;
    }
    const long ascr_n = (long)H * (W + V) + 16 + (kv_packed ? H + HD : 0);
    float *ascr = take(&at, ATTEND_MAX_PARTS * ascr_n); /* one for each part of the rows (`sink_attend_rows`) */
    sink_attend_rows((attend_job){q, (const float *)pp[P_SWA], pp[P_SWA_STRIDE], LPTR(sp, S_WIN_ROWS),
                                  BPTR(sp, S_WIN_VALID), W, comp, pp[P_COMP_STRIDE], comp_rows, comp_valid, V,
                                  PTR(wp, W_SINK), wf[F_SCALE], T, H, HD, ascr, o, kv_packed ? &swa_rows : 0,
                                  kv_packed && comp != 0 ? &comp_pool : 0},
                     ascr_n);
    float *oscr = take(&at, (long)T * (H * HD + wi[I_G] * wi[I_L]));
    if (attn_out_rows_p(o, cos, sin, T, H, HD, r, LPTR(wp, W_O_A), wi[I_G], wi[I_L], LPTR(wp, W_O_B), D, oscr, y)
        != 0)
        return -3;
    hc_expand(y, h, post, comb, T, hc, D, hm);

    /* FFN sublayer */
    hc_collapse(hm, PTR(wp, W_FFN_FN), PTR(wp, W_FFN_SCALE), PTR(wp, W_FFN_BASE), T, hc, D, wi[I_ITERS],
                wf[F_HC_EPS], wf[F_HC_NORM_EPS], cscr, x, pre, post, comb, PTR(wp, W_FFN_NORM), wf[F_FFN_NORM_EPS]);
    float *lgu = take(&at, (long)T * (E + 2 * I));
    if (gemm_proj(LPTR(wp, W_MOE_IN), 0, x, D, T, E + 2 * I, D, lgu, E + 2 * I) != 0) return -3;
    const int e0 = wi[I_E0], e_held = wi[I_E_HELD];
    const expert_exchange ex = (expert_exchange)wp[W_EXCHANGE];
    if (T == 1 && e_held == E) { /* one process: one token's slots summed as they come */
        float *mscr = take(&at, 3L * I + 2L * D + K);
        if (moe_decode_p(x, lgu, E + 2 * I, LPTR(sp, S_IDS), LPTR(wp, W_TID2EID), PTR(wp, W_BIAS), LPTR(wp, W_13),
                         LPTR(wp, W_2), LPTR(wp, W_2S), T, D, E, I, K, wi[I_SQRTSP], wf[F_SCALING], wf[F_LIMIT],
                         mscr, ids_buf, mscr + 3 * I + 2 * D, y) != 0)
            return -3;
    } else { /* ids: T*K longs (as many floats again), ws: T*K floats, then the grouped scratch */
        long *gids = (long *)take(&at, 2L * T * K);
        float *gws = take(&at, (long)T * K), *gscr = take(&at, moe_rows_scratch_floats(T, K, D, I));
        const int rc = moe_decode_rows_p(x, lgu, E + 2 * I, LPTR(sp, S_IDS), LPTR(wp, W_TID2EID), PTR(wp, W_BIAS),
                                         LPTR(wp, W_13), LPTR(wp, W_2), LPTR(wp, W_2S), T, D, E, e0, e_held, ex, I,
                                         K, wi[I_SQRTSP], wf[F_SCALING], wf[F_LIMIT], gids, gws, gscr, y);
        if (rc != 0) return rc == -1 ? -1 : -3;
    }
    hc_expand(y, hm, post, comb, T, hc, D, h_out);
    return 0;
}

/* `decode_layer_run` when its scratch (scratch_n floats) holds what it carves; else -1, nothing done; -2 when the
 * expert exchange failed; -3 when a compact weight block's scratch could not be allocated. */
int decode_layer(const long *wp, const int *wi, const float *wf, const long *sp, const int *si, const long *pp,
                 const float *h, float *h_out, float *scratch, long scratch_n, long *ids_buf) {
    const int V = si[SI_V_CSA] > si[SI_V_HCA] ? si[SI_V_CSA] : si[SI_V_HCA];
    if (decode_layer_scratch_floats(wi, si[SI_T], V, si[SI_W], pools_packed(pp)) > scratch_n) return -1;
    const int rc = decode_layer_run(wp, wi, wf, sp, si, pp, h, h_out, scratch, ids_buf);
    return rc == 0 ? 0 : rc == -1 ? -2 : -3;
}

/* Every layer of a small step after `decode_index`: the token embeddings (fp32, or bf16 bits when embed_bf16: a
 * compact model's, widened exactly) copied into each of the hc streams of h0 [T, hc, D], then layer l reads one
 * buffer and writes the other. tables [n, 4]: each layer's weights, sizes, scalars and pools arrays
 * (`decode_layer`'s first and sixth arguments). Returns the buffer holding the result (0: h0, 1: h1), or -1
 * (nothing done) when some layer's scratch exceeds scratch_n floats, -2 when a layer's expert exchange failed, -3
 * when a compact weight block's scratch could not be allocated (the buffers then hold partial results).
 * Drafter features (a DSpark verify step): where capture != NULL and capture[l] = c >= 0, layer l's output streams
 * averaged over hc go to columns [c * D, (c + 1) * D) of features [T, F] (F floats a row), as `DSV4Model.forward`'s
 * `h.mean(dim=1)`: the streams summed in order, then divided by hc (the bits of ATen's CPU mean). */
int decode_layers(int n, const long *tables, const long *sp, const int *si, const void *embed, int embed_bf16, int hc,
                  int D, float *h0, float *h1, float *scratch, long scratch_n, long *ids_buf, const int *capture,
                  float *features, int F) {
    const int T = si[SI_T];
    const int V = si[SI_V_CSA] > si[SI_V_HCA] ? si[SI_V_CSA] : si[SI_V_HCA];
    for (int l = 0; l < n; l++) /* every layer's scratch fits, before anything is written */
        if (decode_layer_scratch_floats((const int *)tables[4L * l + 1], T, V, si[SI_W],
                                        pools_packed((const long *)tables[4L * l + 3])) > scratch_n)
            return -1;
    const long *ids = (const long *)sp[S_IDS];
    for (int t = 0; t < T; t++)
        for (int i = 0; i < hc; i++) {
            float *o = h0 + ((long)t * hc + i) * D;
            if (embed_bf16) {
                const bf16_t *e = (const bf16_t *)embed + ids[t] * (long)D;
                for (int d = 0; d < D; d++) o[d] = bf16f(e[d]);
            } else {
                const float *e = (const float *)embed + ids[t] * (long)D;
                for (int d = 0; d < D; d++) o[d] = e[d];
            }
        }
    float *bufs[2] = {h0, h1};
    for (int l = 0; l < n; l++) {
        const long *tb = tables + 4L * l;
        const int rc = decode_layer_run((const long *)tb[0], (const int *)tb[1], (const float *)tb[2], sp, si,
                                        (const long *)tb[3], bufs[l % 2], bufs[(l + 1) % 2], scratch, ids_buf);
        if (rc != 0) return rc == -1 ? -2 : -3;
        if (capture == 0 || capture[l] < 0) continue;
        for (int t = 0; t < T; t++) {
            const float *ht = bufs[(l + 1) % 2] + (long)t * hc * D;
            float *ft = features + (long)t * F + (long)capture[l] * D;
            for (int d = 0; d < D; d++) {
                float s = ht[d];
                for (int i = 1; i < hc; i++) s += ht[(long)i * D + d];
                ft[d] = s / (float)hc;
            }
        }
    }
    return n % 2;
}
