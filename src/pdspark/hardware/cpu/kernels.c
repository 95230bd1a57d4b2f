/* pdspark CPU kernels: small fused loops whose PyTorch form is dozens of tiny ops per call.
 * Plain C with float32 arithmetic in the reference's order (reductions excepted: dot products and sums of
 * squares use 16 partial sums, as vectorised BLAS kernels do; the indexer's scores keep the exact order of their
 * PyTorch path, in GCC/Clang vector types); called through ctypes. */
#include <math.h>

static float sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }

/* Sum of a[k] * b[k] over 16 interleaved partial sums (the compiler maps them onto vector lanes). */
static float dot(const float *a, const float *b, int n) {
    float acc[16] = {0};
    int k = 0;
    for (; k + 16 <= n; k += 16)
        for (int l = 0; l < 16; l++) acc[l] += a[k + l] * b[k + l];
    float s = 0.0f;
    for (int l = 0; l < 16; l++) s += acc[l];
    for (; k < n; k++) s += a[k] * b[k];
    return s;
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
 *   each normalisation dividing by (sum + eps). */
static void mhc_weights(const float *m, const float *scale, const float *base, int hc, int iters, float eps,
                        float *pre, float *post, float *c) {
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
    for (int it = 0; it < iters; it++) {
        if (it > 0) { /* row normalisation (the first round starts with columns) */
            for (int i = 0; i < hc; i++) {
                float s = 0.0f;
                for (int j = 0; j < hc; j++) s += c[i * hc + j];
                for (int j = 0; j < hc; j++) c[i * hc + j] /= (s + eps);
            }
        }
        for (int j = 0; j < hc; j++) {
            float s = 0.0f;
            for (int i = 0; i < hc; i++) s += c[i * hc + j];
            for (int i = 0; i < hc; i++) c[i * hc + j] /= (s + eps);
        }
    }
}

/* The collapse of one token's streams given its mixes: mHC weights, then x [D] = sum_i pre[i] * h[i, :]. */
static void collapse_token(const float *ht, const float *mixes, const float *scale, const float *base, int hc, int D,
                           int iters, float eps, float *xt, float *pt, float *post, float *comb) {
    mhc_weights(mixes, scale, base, hc, iters, eps, pt, post, comb);
    for (int d = 0; d < D; d++) xt[d] = pt[0] * ht[d];
    for (int i = 1; i < hc; i++)
        for (int d = 0; d < D; d++) xt[d] += pt[i] * ht[i * D + d];
}

/* The whole collapse of the mHC streams for a few tokens: h [T, hc, D] ->
 *   flat = h[t] * rsqrt(mean(h[t]^2) + norm_eps) over the hc*D values; mixes = fn [M, hc*D] @ flat;
 *   (pre, post, comb) from the mixes; x [T, D] = sum_i pre[i] * h[t, i, :].
 * scratch holds hc*D + M floats. */
void hc_collapse(const float *h, const float *fn, const float *scale, const float *base, int T, int hc, int D,
                 int iters, float eps, float norm_eps, float *scratch, float *x, float *pre, float *post,
                 float *comb) {
    const int N = hc * D, M = (2 + hc) * hc;
    float *flat = scratch, *mixes = scratch + N;
    for (int t = 0; t < T; t++) {
        const float *ht = h + (long)t * N;
        const float r = 1.0f / sqrtf(dot(ht, ht, N) / (float)N + norm_eps);
        for (int k = 0; k < N; k++) flat[k] = ht[k] * r;
        for (int m = 0; m < M; m++) mixes[m] = dot(fn + (long)m * N, flat, N);
        collapse_token(ht, mixes, scale, base, hc, D, iters, eps, x + (long)t * D, pre + (long)t * hc,
                       post + (long)t * hc, comb + (long)t * hc * hc);
    }
}

/* The same collapse with the mixes [T, (2+hc)*hc] computed by the caller (long chunks: a BLAS matmul). */
void hc_collapse_mixed(const float *h, const float *mixes, const float *scale, const float *base, int T, int hc,
                       int D, int iters, float eps, float *x, float *pre, float *post, float *comb) {
    const int M = (2 + hc) * hc;
    for (int t = 0; t < T; t++)
        collapse_token(h + (long)t * hc * D, mixes + (long)t * M, scale, base, hc, D, iters, eps, x + (long)t * D,
                       pre + (long)t * hc, post + (long)t * hc, comb + (long)t * hc * hc);
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

/* Eight float lanes (GCC/Clang vector extension): element-wise IEEE mul/add, no contraction (-ffp-contract=off). */
typedef float v8f __attribute__((vector_size(32)));
typedef int v8i __attribute__((vector_size(32)));

static inline v8f splat(float x) { return (v8f){x, x, x, x, x, x, x, x}; }

/* Lightning-indexer scores: out[t, g] = sum_h relu(q[t, h, :] . k_t[g, :]) * scale * w[t, h], for T queries of
 * H heads (q [T, H, D], w [T, H]) against V keys each (k_t = k + t * kstride, [V, D]; kstride 0: the queries share
 * their keys). Every dot product is a plain sum in channel order (no partial sums) and the heads are summed in
 * order, so a score does not depend on T, V, kstride or the vector width: the prefill and decode paths pick the
 * same entries. Vector lanes run over entries (32 at a time, four independent accumulators), not channels, with
 * each block of keys transposed channel-major once per block (once for all queries when they share the keys).
 * relu is `x > 0 ? x : +0`. out [T, V]. */
void index_scores(const float *q, const float *w, const float *k, long kstride, int T, int H, int V, int D,
                  float scale, float *out) {
    enum { NV = 4, NB = 8 * NV };
    v8f kt[D * NV]; /* [D, NB]: one block of keys, channel-major */
    const v8f zero = splat(0.0f), vscale = splat(scale);
    for (int g0 = 0; g0 < V; g0 += NB) {
        const int m = V - g0 < NB ? V - g0 : NB;
        for (int t = 0; t < T; t++) {
            if (t == 0 || kstride != 0) {
                const float *kb = k + (long)t * kstride + (long)g0 * D;
                for (int l = 0; l < NB; l++)
                    for (int d = 0; d < D; d++) kt[d * NV + l / 8][l % 8] = l < m ? kb[(long)l * D + d] : 0.0f;
            }
            v8f o[NV];
            for (int i = 0; i < NV; i++) o[i] = zero;
            for (int h = 0; h < H; h++) {
                const float *qh = q + ((long)t * H + h) * D;
                const v8f wh = splat(w[(long)t * H + h]);
                v8f acc[NV];
                for (int i = 0; i < NV; i++) acc[i] = zero;
                for (int d = 0; d < D; d++) {
                    const v8f qd = splat(qh[d]);
                    for (int i = 0; i < NV; i++) acc[i] = acc[i] + qd * kt[d * NV + i];
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
