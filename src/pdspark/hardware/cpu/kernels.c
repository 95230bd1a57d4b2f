/* pdspark CPU kernels: small fused loops whose PyTorch form is dozens of tiny ops per call.
 * Plain C with float32 arithmetic in the same order as the PyTorch reference; called through ctypes. */
#include <math.h>

static float sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }

/* mHC weights from the mixes of one sublayer.
 *   mixes [T, (2+hc)*hc] = pre | post | comb logits (before scale and base)
 *   pre [T, hc] = sigmoid(mix*s0 + b) + eps; post [T, hc] = 2*sigmoid(mix*s1 + b)
 *   comb [T, hc, hc] = row softmax(mix*s2 + b) + eps, column-normalised, then (iters-1) row+column rounds,
 *   each normalisation dividing by (sum + eps). */
void hc_split_sinkhorn(const float *mixes, const float *scale, const float *base, int T, int hc, int iters,
                       float eps, float *pre, float *post, float *comb) {
    const int M = (2 + hc) * hc;
    for (int t = 0; t < T; t++) {
        const float *m = mixes + (long)t * M;
        float *c = comb + (long)t * hc * hc;
        for (int i = 0; i < hc; i++) {
            pre[(long)t * hc + i] = sigmoidf(m[i] * scale[0] + base[i]) + eps;
            post[(long)t * hc + i] = 2.0f * sigmoidf(m[hc + i] * scale[1] + base[hc + i]);
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
}
