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

/* Row q [K] of e4m3 bytes times its tiles' scales (s [ceil(K / 128)]) into dst [K]: each byte's value from lut
 * [256] (PyTorch's float8_e4m3fn decode), then one fp32 multiply: the float the dequantized weight holds. */
static void decode_e4m3_row(const unsigned char *q, const float *s, const float *lut, int K, float *dst) {
    for (int c0 = 0; c0 < K; c0 += 128) {
        const float scale = s[c0 / 128];
        const int c1 = c0 + 128 < K ? c0 + 128 : K;
        for (int c = c0; c < c1; c++) dst[c] = lut[q[c]] * scale;
    }
}

/* One compact GEMM's rows [n_begin, n_end) (both multiples of COMPACT_BLOCK_ROWS but the last end): a job for
 * the caller or the helper thread (`pool.c`), each with a scratch of its own. */
typedef struct {
    int mxfp4; /* 0: FP8 tiles (q, scale [ceil(rows/128), scale_cols], row0, lut [256]); 1: MXFP4 (q packed, sbytes
                  [N, K/32], pairs [256][2], e8m0 [256]) */
    const float *x;
    const unsigned char *q, *sbytes;
    const float *scale, *lut, *e8m0;
    const float (*pairs)[2];
    int scale_cols, row0, T, N, K, n_begin, n_end;
    float *out;
    int failed;
} compact_job;

static void compact_rows(compact_job *j, int n, int nb, float *rows) {
    const int K = j->K;
    for (int r = 0; r < nb; r++) {
        float *dst = rows + (long)r * K;
        if (!j->mxfp4) {
            decode_e4m3_row(j->q + (long)(n + r) * K, j->scale + (long)((j->row0 + n + r) / 128) * j->scale_cols,
                            j->lut, K, dst);
            continue;
        }
        const unsigned char *pr = j->q + (long)(n + r) * (K / 2), *sr = j->sbytes + (long)(n + r) * (K / 32);
        for (int g = 0; g < K / 32; g++) { /* bytes 16g .. 16g + 15 hold the 32 inputs of group g */
            const float s = j->e8m0[sr[g]];
            for (int b = 16 * g; b < 16 * g + 16; b++) {
                dst[2 * b] = j->pairs[pr[b]][0] * s;
                dst[2 * b + 1] = j->pairs[pr[b]][1] * s;
            }
        }
    }
}

static void compact_job_fn(void *arg) {
    compact_job *j = arg;
    float *rows = malloc(sizeof(float) * (size_t)COMPACT_BLOCK_ROWS * (size_t)j->K);
    if (rows == 0) {
        j->failed = 1;
        return;
    }
    for (int n = j->n_begin; n < j->n_end; n += COMPACT_BLOCK_ROWS) {
        const int nb = j->n_end - n < COMPACT_BLOCK_ROWS ? j->n_end - n : COMPACT_BLOCK_ROWS;
        compact_rows(j, n, nb, rows);
        gemm_exact(rows, j->x, j->K, j->T, nb, j->K, j->out + n, j->N);
    }
    free(rows);
}

/* Part `part` of `parts` of a compact GEMM: its rows, in whole blocks of COMPACT_BLOCK_ROWS (the last part ends at
 * N); a failed scratch allocation is noted in the job. */
static void compact_part(void *arg, int part, int parts) {
    compact_job *all = (compact_job *)arg;
    compact_job j = *all;
    part_range(all->N, COMPACT_BLOCK_ROWS, part, parts, &j.n_begin, &j.n_end);
    j.failed = 0;
    if (j.n_begin >= j.n_end) return;
    compact_job_fn(&j);
    if (j.failed) __atomic_store_n(&all->failed, 1, __ATOMIC_RELAXED);
}

/* Run `job` (all N rows), split in whole blocks over the pool's threads when there are helpers, the pool is free and
 * the GEMM big enough (one part per POOL_MIN_MACS / 2 multiply-adds; each output is computed whole by one thread:
 * the bits do not depend on the split). */
static int compact_run(compact_job job) {
    long parts = (long)job.T * job.N * job.K / (POOL_MIN_MACS / 2);
    const long blocks = (job.N + COMPACT_BLOCK_ROWS - 1) / COMPACT_BLOCK_ROWS;
    parts = parts < blocks ? parts : blocks;
    parts = parts < pool.threads ? parts : pool.threads;
    if (parts < 2 || !pool_take()) {
        compact_job_fn(&job);
        return job.failed ? -1 : 0;
    }
    pool_parts(compact_part, &job, (int)parts);
    return job.failed ? -1 : 0;
}

/* out [T, N] = x [T, K] @ W^T for FP8 weights q [N, K] (e4m3 bytes) whose row r and column c take the scale
 * scale[((row0 + r) / 128) * scale_cols + c / 128] (fp32 multipliers, `[ceil(rows / 128), scale_cols]`); row0 is
 * where q's first row sits in the matrix the scales tile (a slice of a bigger one: a group of `wo_a`). lut [256]:
 * each byte's e4m3 value. Returns 0, or -1 when a scratch cannot be allocated (the caller falls back). */
int linear_fp8(const float *x, const unsigned char *q, const float *scale, int scale_cols, int row0, const float *lut,
               int T, int N, int K, float *out) {
    return compact_run((compact_job){.mxfp4 = 0, .x = x, .q = q, .scale = scale, .lut = lut, .scale_cols = scale_cols,
                                     .row0 = row0, .T = T, .N = N, .K = K, .n_end = N, .out = out});
}

/* out [T, N] = x [T, K] @ W^T for MXFP4 weights: packed [N, K / 2] (element 2j in the low nibble of byte j, 2j + 1
 * in the high one), scale [N, K / 32] ue8m0 bytes; e2m1 [16]: each code's value, e8m0 [256]: each scale byte's
 * value. K is a multiple of 32. Returns 0, or -1 when a scratch cannot be allocated. */
int linear_mxfp4(const float *x, const unsigned char *packed, const unsigned char *scale, const float *e2m1,
                 const float *e8m0, int T, int N, int K, float *out) {
    float pairs[256][2]; /* each byte's two values (low nibble first): one lookup a byte */
    for (int b = 0; b < 256; b++) pairs[b][0] = e2m1[b & 0x0F], pairs[b][1] = e2m1[b >> 4];
    return compact_run((compact_job){.mxfp4 = 1, .x = x, .q = packed, .sbytes = scale, .e8m0 = e8m0,
                                     .pairs = (const float (*)[2])pairs, .T = T, .N = N, .K = K, .n_end = N,
                                     .out = out});
}
