/* pdspark CPU kernels, moe.c: a few tokens' MoE after the fused router + shared gate/up matmul: routing, the routed
 * experts (per token, or each expert once over the rows that picked it) and the shared expert's down projection. */
#include "kernels.h"

/* SwiGLU with DSV4's clamps, as `moe.swiglu`: silu(min(g, limit)) * clamp(u, -limit, limit). */
static float swiglu1(float g, float u, float limit) {
    g = g > limit ? limit : g;
    u = u > limit ? limit : (u < -limit ? -limit : u);
    return g / (1.0f + expf(-g)) * u;
}

/* One token's routing, shared by `moe_decode` and `moe_decode_rows` so the two pick the same experts with the same
 * weight bits: lt [E] its router logits, eids [k] its row of tid2eid (hash layers) or NULL (top-k of score + bias,
 * bias [E]); writes the experts ids [k] and their weights ws [k] (see `moe_decode` for the formulas). */
static void route_token(const float *lt, const long *eids, const float *bias, int E, int k, int sqrtsoftplus,
                        float scaling, long *ids, float *ws) {
    if (eids != 0) {
        for (int j = 0; j < k; j++) ids[j] = eids[j];
    } else {
        for (int j = 0; j < k; j++) {
            int best = -1;
            float bv = -INFINITY;
            for (int e = 0; e < E; e++) {
                int taken = 0;
                for (int i = 0; i < j; i++) taken |= ids[i] == e;
                if (taken) continue;
                const float s = (sqrtsoftplus ? sqrtf(lt[e] > 20.0f ? lt[e] : log1pf(expf(lt[e])))
                                              : 1.0f / (1.0f + expf(-lt[e]))) + bias[e];
                if (best < 0 || s > bv) { best = e; bv = s; }
            }
            ids[j] = best;
        }
    }
    float wsum = 0.0f;
    for (int j = 0; j < k; j++) {
        const float l = lt[ids[j]];
        ws[j] = sqrtsoftplus ? sqrtf(l > 20.0f ? l : log1pf(expf(l))) : 1.0f / (1.0f + expf(-l));
        wsum += ws[j];
    }
    for (int j = 0; j < k; j++) ws[j] = ws[j] / (wsum + 1e-20f) * scaling;
}

/* The routed experts and the shared expert's down projection of a few tokens, after the one fused matmul that
 * gives each token its router logits, shared gate and shared up: lgu [T, E + 2I] (rows `lstride` apart).
 *   routing: score = sqrt(softplus(logit)) (sqrtsoftplus) or sigmoid(logit); experts = tid2eid[input_id] (hash
 *            layers, tid2eid != NULL) or the top-k of score + bias (highest first, lower index on ties);
 *            weight = score / (sum of the k scores + 1e-20) * scaling.
 *   out[t] = sum_j weight_j * w2[e_j] @ swiglu(w13[e_j] @ x[t]) + w2s @ swiglu(shared gate, shared up),
 * the routed terms summed in slot order, then the shared term added (as `MoE.forward`'s pair loop).
 * x [T, D]; projections (`gemm_proj`) w13 of E * 2I rows of D (each expert's gate rows then up rows), w2 of E * D
 * rows of I, w2s of D rows of I; scratch 3I + 2D floats, ids k words, ws k floats. Returns 0, or -1 when a compact
 * block's scratch could not be allocated. */
static int moe_decode_p(const float *x, const float *lgu, long lstride, const long *input_ids, const long *tid2eid,
                        const float *bias, const long *w13, const long *w2, const long *w2s, int T, int D, int E,
                        int I, int k, int sqrtsoftplus, float scaling, float limit, float *scratch, long *ids,
                        float *ws, float *out) {
    float *h = scratch, *act = scratch + 2 * I, *acc = scratch + 3 * I, *y = scratch + 3 * I + D;
    for (int t = 0; t < T; t++) {
        const float *xt = x + (long)t * D, *lt = lgu + (long)t * lstride;
        float *ot = out + (long)t * D;
        route_token(lt, tid2eid != 0 ? tid2eid + input_ids[t] * k : 0, bias, E, k, sqrtsoftplus, scaling, ids, ws);
        /* routed experts, in slot order */
        for (int j = 0; j < k; j++) { /* one row: `gemv`'s bits */
            if (gemm_proj(w13, ids[j] * 2L * I, xt, D, 1, 2 * I, D, h, 2 * I) != 0) return -1;
            for (int i = 0; i < I; i++) act[i] = swiglu1(h[i], h[I + i], limit);
            if (gemm_proj(w2, ids[j] * (long)D, act, I, 1, D, I, y, D) != 0) return -1;
            for (int d = 0; d < D; d++) acc[d] = j == 0 ? y[d] * ws[j] : acc[d] + y[d] * ws[j];
        }
        /* shared expert */
        const float *sg = lt + E, *su = lt + E + I;
        for (int i = 0; i < I; i++) act[i] = swiglu1(sg[i], su[i], limit);
        if (gemm_proj(w2s, 0, act, I, 1, D, I, y, D) != 0) return -1;
        for (int d = 0; d < D; d++) ot[d] = acc[d] + y[d];
    }
    return 0;
}

void moe_decode(const float *x, const float *lgu, long lstride, const long *input_ids, const long *tid2eid,
                const float *bias, const float *w13, const float *w2, const float *w2s, int T, int D, int E, int I,
                int k, int sqrtsoftplus, float scaling, float limit, float *scratch, long *ids, float *ws, float *out) {
    long p13[1 + PS_COUNT], p2[1 + PS_COUNT], p2s[1 + PS_COUNT];
    moe_decode_p(x, lgu, lstride, input_ids, tid2eid, bias, proj_plain(p13, w13, 0, 2L * E * I),
                 proj_plain(p2, w2, 0, (long)E * D), proj_plain(p2s, w2s, 0, D), T, D, E, I, k, sqrtsoftplus, scaling,
                 limit, scratch, ids, ws, out); /* (plain weights: nothing to allocate) */
}

/* A range of routed experts of `moe_decode_rows_p`, each over the rows that picked it; `scr` is this range's own
 * MOE_RANGE_FLOATS(T, k, D, I) floats (gathered rows, activations, outputs, row slots). An expert may be picked
 * by up to T*k rows, not T: a hash layer's tid2eid row may name one expert in several slots (transformers
 * initialises the table to zeros: every slot expert 0), and each slot then counts once, as in the reference. */
#define MOE_RANGE_FLOATS(T, k, D, I) ((long)(T) * (k) * (2L * (D) + 3L * (I) + 1))
typedef struct {
    const float *x;
    const long *w13, *w2; /* the held experts' projections: expert e at index e - held0 */
    int T, D, I, k, e0, e1, held0;
    float limit;
    const long *ids;
    float *ys; /* [T, k, D]: token t's slot j output */
    float *scr;
    int failed; /* a compact block's scratch could not be allocated */
} moe_range;

static void moe_experts(void *arg) {
    moe_range *m = (moe_range *)arg;
    const int T = m->T, D = m->D, I = m->I, k = m->k;
    const long n_max = (long)T * k; /* rows an expert can gather */
    float *xg = m->scr, *hg = xg + n_max * D, *ag = hg + n_max * 2 * I, *yg = ag + n_max * I;
    int *rows = (int *)(yg + n_max * D); /* the (token * k + slot) of each gathered row */
    for (int e = m->e0; e < m->e1; e++) { /* each expert once, over the rows that picked it */
        int n = 0;
        for (int t = 0; t < T; t++)
            for (int j = 0; j < k; j++)
                if (m->ids[(long)t * k + j] == e) {
                    rows[n] = t * k + j;
                    for (int d = 0; d < D; d++) xg[(long)n * D + d] = m->x[(long)t * D + d];
                    n++;
                }
        if (n == 0) continue;
        if (gemm_proj(m->w13, (long)(e - m->held0) * 2 * I, xg, D, n, 2 * I, D, hg, 2 * I) != 0) {
            m->failed = 1;
            return;
        }
        for (int r = 0; r < n; r++)
            for (int i = 0; i < I; i++)
                ag[(long)r * I + i] = swiglu1(hg[(long)r * 2 * I + i], hg[(long)r * 2 * I + I + i], m->limit);
        if (gemm_proj(m->w2, (long)(e - m->held0) * D, ag, I, n, D, I, yg, D) != 0) {
            m->failed = 1;
            return;
        }
        for (int r = 0; r < n; r++)
            for (int d = 0; d < D; d++) m->ys[(long)rows[r] * D + d] = yg[(long)r * D + d];
    }
}

/* `moe_decode` for a verify step's few tokens with each routed expert's weights read once for every token that
 * picked it (the per-token loop reads them once per pick): routing as there, then per expert its tokens' rows
 * gathered and run through `gemm_exact`, the outputs kept per (token, slot) and summed per token in slot order,
 * then the shared term, so every output has `moe_decode`'s bits. With one helper thread (`pool_threads(2)`) the
 * experts are split in two ranges of about as many rows, one per thread; with more, each expert's GEMMs are split
 * over all of them (each expert's arithmetic unchanged either way).
 * Expert parallelism: this rank holds experts [e0, e0 + e_held) of the E (w13, w2 hold those only); the slots of
 * the others stay zero and `ex` sums the (token, slot) rows over the ranks before the slot-order sum, so every
 * output has the bits of one process holding all E (each row is computed by exactly one rank; x + 0 is x).
 * Returns 0, -1 when `ex` failed, -2 when a compact block's scratch could not be allocated (out not written).
 * Scratch: T*k longs ids, T*k floats ws, 2 * MOE_RANGE_FLOATS(T, k, D, I) + T*k*D floats fs
 * (`moe_rows_scratch_floats`). */
static int moe_decode_rows_p(const float *x, const float *lgu, long lstride, const long *input_ids,
                             const long *tid2eid, const float *bias, const long *w13, const long *w2, const long *w2s,
                             int T, int D, int E, int e0, int e_held, expert_exchange ex, int I, int k,
                             int sqrtsoftplus, float scaling, float limit, long *ids, float *ws, float *fs,
                             float *out) {
    const long range_scr = MOE_RANGE_FLOATS(T, k, D, I);
    const int e1 = e0 + e_held;
    float *ys = fs + 2 * range_scr; /* [T, k, D] */
    for (int t = 0; t < T; t++) { /* routing, as `moe_decode` */
        route_token(lgu + (long)t * lstride, tid2eid != 0 ? tid2eid + input_ids[t] * k : 0, bias, E, k, sqrtsoftplus,
                    scaling, ids + (long)t * k, ws + (long)t * k);
    }
    long held = 0; /* the picks of held experts */
    for (long p = 0; p < (long)T * k; p++) held += ids[p] >= e0 && ids[p] < e1;
    if (held < (long)T * k)
        for (long p = 0; p < (long)T * k * D; p++) ys[p] = 0.0f;
    moe_range mine = {x, w13, w2, T, D, I, k, e0, e1, e0, limit, ids, ys, fs, 0};
    /* The split: the first expert at which half of the held picks are behind. */
    int split = e0;
    for (long behind = 0; split < e1 && 2 * behind < held; split++)
        for (long p = 0; p < (long)T * k; p++) behind += ids[p] == split;
    /* Two threads: two ranges of experts, one a thread. More: the experts one after another, each GEMM split over
     * every thread (`gemm_proj`): a range a thread would leave the others idle. */
    if (pool.threads == 2 && split > e0 && split < e1 && held * 3 * I * D >= POOL_MIN_MACS && pool_take()) {
        moe_range theirs = mine;
        mine.e1 = theirs.e0 = split;
        theirs.scr = fs + range_scr;
        pool_split(moe_experts, &theirs, moe_experts, &mine);
        mine.failed |= theirs.failed;
    } else {
        moe_experts(&mine);
    }
    if (mine.failed) return -2;
    if (ex != 0 && ex(ys, (long)T * k * D) != 0) return -1;
    for (int t = 0; t < T; t++) { /* routed terms in slot order, as `moe_decode`'s acc */
        float *ot = out + (long)t * D;
        for (int j = 0; j < k; j++) {
            const float *y = ys + ((long)t * k + j) * D, w = ws[(long)t * k + j];
            for (int d = 0; d < D; d++) ot[d] = j == 0 ? y[d] * w : ot[d] + y[d] * w;
        }
    }
    float *ag = fs, *yg = ag + (long)T * I; /* the first range's scratch, free again (T*(I + D) <= range_scr) */
    for (int t = 0; t < T; t++) /* shared expert's activations */
        for (int i = 0; i < I; i++)
            ag[(long)t * I + i] = swiglu1(lgu[(long)t * lstride + E + i], lgu[(long)t * lstride + E + I + i], limit);
    if (gemm_proj(w2s, 0, ag, I, T, D, I, yg, D) != 0) return -2;
    for (int t = 0; t < T; t++)
        for (int d = 0; d < D; d++) out[(long)t * D + d] = out[(long)t * D + d] + yg[(long)t * D + d];
    return 0;
}

/* The floats `moe_decode_rows` needs in fs (its Python wrapper sizes fs with this). */
long moe_rows_scratch_floats(int T, int k, int D, int I) {
    return 2 * MOE_RANGE_FLOATS(T, k, D, I) + (long)T * k * D;
}

/* Returns 0, or -1 when `ex` failed (expert parallelism: see `moe_decode_rows_p`; one process: e0 0, e_held E,
 * ex NULL). */
int moe_decode_rows(const float *x, const float *lgu, long lstride, const long *input_ids, const long *tid2eid,
                    const float *bias, const float *w13, const float *w2, const float *w2s, int T, int D, int E,
                    int e0, int e_held, expert_exchange ex, int I, int k, int sqrtsoftplus, float scaling,
                    float limit, long *ids, float *ws, float *fs, float *out) {
    long p13[1 + PS_COUNT], p2[1 + PS_COUNT], p2s[1 + PS_COUNT];
    return moe_decode_rows_p(x, lgu, lstride, input_ids, tid2eid, bias, proj_plain(p13, w13, 0, 2L * e_held * I),
                             proj_plain(p2, w2, 0, (long)e_held * D), proj_plain(p2s, w2s, 0, D), T, D, E, e0, e_held,
                             ex, I, k, sqrtsoftplus, scaling, limit, ids, ws, fs, out);
}
