/* pdspark CPU kernels, compact.c: the GEMMs of weights kept in their checkpoint's compact formats, DeepSeek-V4's
 * FP8 e4m3 weights with one scale per 128x128 tile and its MXFP4 routed experts (two e2m1 codes a byte, one ue8m0
 * scale per 32 inputs of a row; see `pdspark.quant.release_formats`).
 *
 * A block of weight rows is decoded into a scratch of fp32 rows (each value `code value * scale`, one fp32 multiply,
 * exactly the float the dequantized checkpoint holds), then multiplied by `gemm_exact`, whose every output is one
 * `dot` of a weight row and an input row whatever rows share the call. So an output has the bits the fp32 weights
 * decoded at load would give it through `linear_rows`, while the weights stay resident at 1 byte (FP8) or half a
 * byte (MXFP4) per value and are read once per call. The code tables come from the caller (PyTorch's own decodes of
 * the 256 e4m3 bytes, the 16 e2m1 codes and the 256 ue8m0 bytes), so the two paths cannot disagree on a value. */
#include <stdlib.h>

#include "kernels.h"

/* Weight rows decoded per block: one AVX-512 tile of `gemm_exact` (16 rows), a few L2-resident KiB per row. */
#define COMPACT_BLOCK_ROWS 16

/* out [T, N] = x [T, K] @ W^T for FP8 weights q [N, K] (e4m3 bytes) whose row r and column c take the scale
 * scale[((row0 + r) / 128) * scale_cols + c / 128] (fp32 multipliers, `[ceil(rows / 128), scale_cols]`); row0 is
 * where q's first row sits in the matrix the scales tile (a slice of a bigger one: a group of `wo_a`). lut [256]:
 * each byte's e4m3 value. Returns 0, or -1 when the scratch cannot be allocated (the caller falls back). */
int linear_fp8(const float *x, const unsigned char *q, const float *scale, int scale_cols, int row0, const float *lut,
               int T, int N, int K, float *out) {
    float *rows = malloc(sizeof(float) * (size_t)COMPACT_BLOCK_ROWS * (size_t)K);
    if (rows == 0) return -1;
    for (int n0 = 0; n0 < N; n0 += COMPACT_BLOCK_ROWS) {
        const int nb = N - n0 < COMPACT_BLOCK_ROWS ? N - n0 : COMPACT_BLOCK_ROWS;
        for (int r = 0; r < nb; r++) {
            const unsigned char *qr = q + (long)(n0 + r) * K;
            const float *sr = scale + (long)((row0 + n0 + r) / 128) * scale_cols;
            float *dst = rows + (long)r * K;
            for (int c = 0; c < K; c++) dst[c] = lut[qr[c]] * sr[c / 128];
        }
        gemm_exact(rows, x, K, T, nb, K, out + n0, N);
    }
    free(rows);
    return 0;
}

/* out [T, N] = x [T, K] @ W^T for MXFP4 weights: packed [N, K / 2] (element 2j in the low nibble of byte j, 2j + 1
 * in the high one), scale [N, K / 32] ue8m0 bytes; e2m1 [16]: each code's value, e8m0 [256]: each scale byte's
 * value. K is a multiple of 32. Returns 0, or -1 when the scratch cannot be allocated. */
int linear_mxfp4(const float *x, const unsigned char *packed, const unsigned char *scale, const float *e2m1,
                 const float *e8m0, int T, int N, int K, float *out) {
    float *rows = malloc(sizeof(float) * (size_t)COMPACT_BLOCK_ROWS * (size_t)K);
    if (rows == 0) return -1;
    const int half = K / 2, groups = K / 32;
    for (int n0 = 0; n0 < N; n0 += COMPACT_BLOCK_ROWS) {
        const int nb = N - n0 < COMPACT_BLOCK_ROWS ? N - n0 : COMPACT_BLOCK_ROWS;
        for (int r = 0; r < nb; r++) {
            const unsigned char *pr = packed + (long)(n0 + r) * half;
            const unsigned char *sr = scale + (long)(n0 + r) * groups;
            float *dst = rows + (long)r * K;
            for (int j = 0; j < half; j++) {
                const float s = e8m0[sr[j / 16]]; /* bytes 16g .. 16g + 15 hold the 32 inputs of group g */
                dst[2 * j] = e2m1[pr[j] & 0x0F] * s;
                dst[2 * j + 1] = e2m1[pr[j] >> 4] * s;
            }
        }
        gemm_exact(rows, x, K, T, nb, K, out + n0, N);
    }
    free(rows);
    return 0;
}
