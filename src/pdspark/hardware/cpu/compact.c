/* pdspark CPU kernels, compact.c: the GEMMs of weights kept in their checkpoint's compact formats, DeepSeek-V4's
 * FP8 e4m3 weights with one scale per 128x128 tile and its MXFP4 routed experts (two e2m1 codes a byte, one ue8m0
 * scale per 32 inputs of a row; see `pdspark.quant.release_formats`).
 *
 * A block of weight rows is decoded into a scratch of fp32 rows (each value `code value * scale`, one fp32 multiply,
 * exactly the float the dequantized checkpoint holds), then multiplied by `gemm_exact`, whose every output is one
 * `dot` of a weight row and an input row whatever rows share the call; for 1 to COMPACT_FUSED_T input rows each
 * chunk of 16 values is decoded in a register and multiplied at once, in `dot`'s order. So an output has the bits the
 * fp32 weights decoded at load would give it through `linear_rows`, while the weights stay resident at 1 byte (FP8)
 * or half a byte (MXFP4) per value and are read once per call. The code tables come from the caller (PyTorch's own
 * decodes of the 256 e4m3 bytes, the 16 e2m1 codes and the 256 ue8m0 bytes), so the two paths cannot disagree on a
 * value (the AVX-512 decodes compute the same values: tested on every code).
 *
 * `gemm_proj` (at the end) is the decode step's GEMM of a projection whose rows are segments in different storages
 * (fp32, bf16 bits, FP8, MXFP4), each through its kernel. */
#include <stdlib.h>

#include "kernels.h"

/* Weight rows decoded per block: one AVX-512 tile of `gemm_exact` (16 rows), a few L2-resident KiB per row. */
#define COMPACT_BLOCK_ROWS 16
/* The compact bytes read next are asked for into L2 this many blocks (or, for a few input rows, groups of rows)
 * ahead of the ones being computed (`ahead_step`, gemm.c): read from DRAM without it, an FP8 GEMV took its bytes at
 * ~4 GB/s on a Zen 4 core, its decode waiting on each line. Measured there over [1,024, 1,024] matrices (256 MiB of
 * them; bench/bench_weight_gemm.py), the same bits: FP8 8.6 -> 12.8 GFLOP/s at 1 row, 29 -> 37 at 6, 38 -> 41 at
 * 12, 58 -> 61 at 48; MXFP4 12.7 -> 18.6 at 1 row, 52 -> 58 at 16. One block or group ahead did about as well as
 * two, four or eight.
 * (Not with `PDSPARK_NO_WEIGHT_AHEAD`, gemm.c.) */
#define COMPACT_AHEAD 2

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && !defined(PDSPARK_NO_AVX512_DECODE)
#define COMPACT_AVX512 1
#include <immintrin.h>

/* 16 e4m3 bytes -> their values, as torch decodes them (lut [256]; tested on every byte): each byte's exponent and
 * mantissa bits shifted into a half float's (whose exponent bias, 15, is e4m3's 7 plus 8: an e4m3 subnormal becomes
 * a half subnormal) and its sign to bit 15, widened by the CPU's exact half-to-single conversion, times 2^8 (exact);
 * the two NaN bytes take the table's value. */
static inline __m512 e4m3_values16(const unsigned char *q, const float *lut) {
    const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)q));
    const __m256i m7 = _mm256_and_si256(v, _mm256_set1_epi16(0x7F));
    const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(v, _mm256_set1_epi16(0x80)), 8);
    const __m512 f = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_or_si256(_mm256_slli_epi16(m7, 7), sign)),
                                   _mm512_set1_ps(256.0f));
    const __mmask16 nan = _mm256_cmpeq_epi16_mask(m7, _mm256_set1_epi16(0x7F));
    return nan ? _mm512_mask_i32gather_ps(f, nan, _mm512_cvtepu16_epi32(v), lut, 4) : f;
}
#endif

/* Row q [K] of e4m3 bytes times its tiles' scales (s [ceil(K / 128)]) into dst [K]: each byte's value (lut [256],
 * PyTorch's float8_e4m3fn decode; the same values computed 16 at a time where the CPU has AVX-512), then one fp32
 * multiply: the float the dequantized weight holds. */
static void decode_e4m3_row(const unsigned char *q, const float *s, const float *lut, int K, float *dst) {
    for (int c0 = 0; c0 < K; c0 += 128) {
        const float scale = s[c0 / 128];
        const int c1 = c0 + 128 < K ? c0 + 128 : K;
        int c = c0;
#ifdef COMPACT_AVX512
        for (; c + 16 <= c1; c += 16)
            _mm512_storeu_ps(dst + c, _mm512_mul_ps(e4m3_values16(q + c, lut), _mm512_set1_ps(scale)));
#endif
        for (; c < c1; c++) dst[c] = lut[q[c]] * scale;
    }
}

/* Row pr [K / 2] of MXFP4 (element 2b in the low nibble of byte b, 2b + 1 in the high one) times its groups' scales
 * (sr [K / 32] ue8m0 bytes, values e8m0 [256]) into dst [K]: each code's value (e2m1 [16]) times its group's scale,
 * one fp32 multiply. A group's 32 values are 16 bytes: on AVX-512, two table lookups in a register and an
 * interleave. */
static void decode_mxfp4_row(const unsigned char *pr, const unsigned char *sr, const float *e2m1, const float *e8m0,
                             int K, float *dst) {
#ifdef COMPACT_AVX512
    const __m512 table = _mm512_loadu_ps(e2m1);
    const __m512i even = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i odd = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    for (int g = 0; g < K / 32; g++) {
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(pr + 16 * g)));
        const __m512 lo = _mm512_permutexvar_ps(_mm512_and_si512(v, _mm512_set1_epi32(0x0F)), table);
        const __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
        const __m512 scale = _mm512_set1_ps(e8m0[sr[g]]);
        _mm512_storeu_ps(dst + 32 * g, _mm512_mul_ps(_mm512_permutex2var_ps(lo, even, hi), scale));
        _mm512_storeu_ps(dst + 32 * g + 16, _mm512_mul_ps(_mm512_permutex2var_ps(lo, odd, hi), scale));
    }
#else
    for (int g = 0; g < K / 32; g++) { /* bytes 16g .. 16g + 15 hold the 32 inputs of group g */
        const float s = e8m0[sr[g]];
        for (int b = 16 * g; b < 16 * g + 16; b++) {
            dst[2 * b] = e2m1[pr[b] & 0x0F] * s;
            dst[2 * b + 1] = e2m1[pr[b] >> 4] * s;
        }
    }
#endif
}

/* One compact GEMM's rows [n_begin, n_end) (both multiples of COMPACT_BLOCK_ROWS but the last end): a job for
 * the caller or the helper thread (`pool.c`), each with a scratch of its own. */
typedef struct {
    int mxfp4; /* 0: FP8 tiles (q, scale [ceil(rows/128), scale_cols], row0, lut [256]); 1: MXFP4 (q packed, sbytes
                  [N, K/32], e2m1 [16], e8m0 [256]) */
    const float *x;
    const unsigned char *q, *sbytes;
    const float *scale, *lut, *e2m1, *e8m0;
    int scale_cols, row0, T, N, K, n_begin, n_end;
    long xs, os; /* x's and out's row strides (floats) */
    float *out;
    int failed;
} compact_job;

static void compact_rows(compact_job *j, int n, int nb, float *rows) {
    const int K = j->K;
    const long row_bytes = j->mxfp4 ? K / 2 : K;
    for (int r = 0; r < nb; r++) {
        const int ahead = n + COMPACT_AHEAD * COMPACT_BLOCK_ROWS + r; /* its row in the block decoded after next */
        if (WEIGHT_AHEAD && ahead < j->n_end) prefetch_l2(j->q, ahead * row_bytes, (ahead + 1) * row_bytes);
        float *dst = rows + (long)r * K;
        if (j->mxfp4)
            decode_mxfp4_row(j->q + (long)(n + r) * (K / 2), j->sbytes + (long)(n + r) * (K / 32), j->e2m1, j->e8m0,
                             K, dst);
        else
            decode_e4m3_row(j->q + (long)(n + r) * K, j->scale + (long)((j->row0 + n + r) / 128) * j->scale_cols,
                            j->lut, K, dst);
    }
}

/* This thread's block of decoded rows (COMPACT_BLOCK_ROWS x K floats), kept for its next call: a decode step runs
 * hundreds of compact GEMMs, and a fresh block of this size would be mapped and unmapped by each. Grown when a
 * wider K comes; NULL when that failed. */
static __thread float *compact_block;
static __thread long compact_block_floats;

static float *compact_rows_scratch(int K) {
    const long need = (long)COMPACT_BLOCK_ROWS * K;
    if (compact_block_floats < need) {
        free(compact_block);
        compact_block = malloc(sizeof(float) * (size_t)need);
        compact_block_floats = compact_block ? need : 0;
    }
    return compact_block;
}

#ifdef COMPACT_AVX512
/* A few input rows (decode steps, a batch-1 DSpark verify step: up to COMPACT_FUSED_T) take each weight chunk of 16
 * decoded in a register and multiplied at once, without the decoded block's round trip through memory. Each output
 * keeps `dot`'s arithmetic: 16 lane sums of products (a product, then a sum: no fused multiply-add), the lanes added
 * in order from 0.0f, then the columns past the last whole chunk one by one. Weight rows go in groups of
 * COMPACT_FUSED_ROWS(T) so that the sums of a group's rows and the T input rows stay in at most 16 registers. */
#define COMPACT_FUSED_T 6
#define COMPACT_FUSED_ROWS(T) ((T) <= 4 ? 4 : 2)

/* acc[r][t] += w * x[t][k .. k + 16), for every input row. */
#define COMPACT_MADD(r, w, k)                                                                                       \
    do {                                                                                                            \
        const __m512 w_ = (w);                                                                                      \
        for (int t = 0; t < T; t++)                                                                                 \
            acc[r][t] = _mm512_add_ps(acc[r][t], _mm512_mul_ps(w_, _mm512_loadu_ps(x + (long)t * xs + (k))));      \
    } while (0)

/* out[t * os + r] = the finished sum of weight row r and input row t: acc's lanes in order, then the columns from k
 * on (`tail(r, c)`: weight row r's value at column c). */
#define COMPACT_FINISH(tail)                                                                                        \
    do {                                                                                                            \
        float lanes[16];                                                                                            \
        for (int r = 0; r < nr; r++)                                                                                \
            for (int t = 0; t < T; t++) {                                                                           \
                _mm512_storeu_ps(lanes, acc[r][t]);                                                                 \
                float s = 0.0f;                                                                                     \
                for (int l = 0; l < 16; l++) s += lanes[l];                                                         \
                for (int c = k; c < K; c++) s += (tail) * x[(long)t * xs + c];                                     \
                out[(long)t * os + r] = s;                                                                          \
            }                                                                                                       \
    } while (0)

/* The rows of job j (`row_bytes` each) a fused kernel over rows [n, n + nr) asks for over its `steps` steps: the group
 * of nr rows COMPACT_AHEAD groups on, within the job's rows. */
static inline ahead_t compact_ahead(const compact_job *j, int n, int nr, long row_bytes, long steps) {
    const long end = (long)j->n_end * row_bytes, from = (long)(n + COMPACT_AHEAD * nr) * row_bytes;
    return ahead_over(j->q, from < end ? from : end, from + nr * row_bytes < end ? from + nr * row_bytes : end, steps);
}

/* FP8 rows [n, n + nr) of job j (nr <= 4), T <= COMPACT_FUSED_T input rows -> out [T, nr] (rows os apart). Inlined
 * with T and nr constants (`compact_dot`), so that the sums live in registers. */
static inline __attribute__((always_inline)) void compact_dot_fp8(const compact_job *j, int n, int nr, float *out,
                                                                  int T) {
    const int K = j->K;
    const long xs = j->xs, os = j->os;
    const float *x = j->x;
    const unsigned char *q[4];
    const float *sc[4];
    __m512 acc[4][COMPACT_FUSED_T];
    for (int r = 0; r < nr; r++) {
        q[r] = j->q + (long)(n + r) * K;
        sc[r] = j->scale + (long)((j->row0 + n + r) / 128) * j->scale_cols;
        for (int t = 0; t < T; t++) acc[r][t] = _mm512_setzero_ps();
    }
    ahead_t ah = compact_ahead(j, n, nr, K, K / 16);
    int k = 0;
    for (; k + 16 <= K; k += 16) {
        if (WEIGHT_AHEAD) ahead_step(&ah);
        for (int r = 0; r < nr; r++)
            COMPACT_MADD(r, _mm512_mul_ps(e4m3_values16(q[r] + k, j->lut), _mm512_set1_ps(sc[r][k / 128])), k);
    }
    COMPACT_FINISH(j->lut[q[r][c]] * sc[r][c / 128]);
}

/* MXFP4 rows [n, n + nr) of job j (nr <= 4; K a multiple of 32), T <= COMPACT_FUSED_T input rows -> out [T, nr]. */
static inline __attribute__((always_inline)) void compact_dot_mxfp4(const compact_job *j, int n, int nr, float *out,
                                                                    int T) {
    const int K = j->K;
    const long xs = j->xs, os = j->os;
    const float *x = j->x;
    const __m512 table = _mm512_loadu_ps(j->e2m1);
    const __m512i even = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i odd = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    const unsigned char *pr[4], *sr[4];
    __m512 acc[4][COMPACT_FUSED_T];
    for (int r = 0; r < nr; r++) {
        pr[r] = j->q + (long)(n + r) * (K / 2);
        sr[r] = j->sbytes + (long)(n + r) * (K / 32);
        for (int t = 0; t < T; t++) acc[r][t] = _mm512_setzero_ps();
    }
    ahead_t ah = compact_ahead(j, n, nr, K / 2, K / 32);
    int k = 0;
    for (; k + 32 <= K; k += 32) {
        if (WEIGHT_AHEAD) ahead_step(&ah);
        for (int r = 0; r < nr; r++) {
            const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(pr[r] + k / 2)));
            const __m512 lo = _mm512_permutexvar_ps(_mm512_and_si512(v, _mm512_set1_epi32(0x0F)), table);
            const __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
            const __m512 scale = _mm512_set1_ps(j->e8m0[sr[r][k / 32]]);
            COMPACT_MADD(r, _mm512_mul_ps(_mm512_permutex2var_ps(lo, even, hi), scale), k);
            COMPACT_MADD(r, _mm512_mul_ps(_mm512_permutex2var_ps(lo, odd, hi), scale), k + 16);
        }
    }
    COMPACT_FINISH(0.0f); /* (no columns left: 32 divides K) */
}

/* Rows [n, n + nr) of job j, nr <= COMPACT_FUSED_ROWS(T): the fused kernel of its format instantiated for its T and
 * nr. */
static void compact_dot(const compact_job *j, int n, int nr, float *out) {
#define COMPACT_DOT_T(T)                                                                                            \
    case T:                                                                                                         \
        if (nr == COMPACT_FUSED_ROWS(T))                                                                            \
            j->mxfp4 ? compact_dot_mxfp4(j, n, COMPACT_FUSED_ROWS(T), out, T)                                       \
                     : compact_dot_fp8(j, n, COMPACT_FUSED_ROWS(T), out, T);                                        \
        else                                                                                                        \
            j->mxfp4 ? compact_dot_mxfp4(j, n, nr, out, T) : compact_dot_fp8(j, n, nr, out, T);                     \
        break;
    switch (j->T) {
        COMPACT_DOT_T(1) COMPACT_DOT_T(2) COMPACT_DOT_T(3) COMPACT_DOT_T(4)
        COMPACT_DOT_T(5) COMPACT_DOT_T(6)
    }
#undef COMPACT_DOT_T
}
#endif

static void compact_job_fn(void *arg) {
    compact_job *j = arg;
#ifdef COMPACT_AVX512
    if (j->T <= COMPACT_FUSED_T) {
        const int group = COMPACT_FUSED_ROWS(j->T);
        for (int n = j->n_begin; n < j->n_end; n += group)
            compact_dot(j, n, j->n_end - n < group ? j->n_end - n : group, j->out + n);
        return;
    }
#endif
    float *rows = compact_rows_scratch(j->K);
    if (rows == 0) {
        j->failed = 1;
        return;
    }
    for (int n = j->n_begin; n < j->n_end; n += COMPACT_BLOCK_ROWS) {
        const int nb = j->n_end - n < COMPACT_BLOCK_ROWS ? j->n_end - n : COMPACT_BLOCK_ROWS;
        compact_rows(j, n, nb, rows);
        gemm_exact(rows, j->x, j->xs, j->T, nb, j->K, j->out + n, j->os);
    }
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
                                     .row0 = row0, .T = T, .N = N, .K = K, .n_end = N, .xs = K, .os = N,
                                     .out = out});
}

/* out [T, N] = x [T, K] @ W^T for MXFP4 weights: packed [N, K / 2] (element 2j in the low nibble of byte j, 2j + 1
 * in the high one), scale [N, K / 32] ue8m0 bytes; e2m1 [16]: each code's value, e8m0 [256]: each scale byte's
 * value. K is a multiple of 32. Returns 0, or -1 when a scratch cannot be allocated. */
int linear_mxfp4(const float *x, const unsigned char *packed, const unsigned char *scale, const float *e2m1,
                 const float *e8m0, int T, int N, int K, float *out) {
    return compact_run((compact_job){.mxfp4 = 1, .x = x, .q = packed, .sbytes = scale, .e2m1 = e2m1, .e8m0 = e8m0,
                                     .T = T, .N = N, .K = K, .n_end = N, .xs = K, .os = N, .out = out});
}

/* ---- a projection's weights in any storage: what the decode step's layer table points to ------------------------- */

/* One GEMM over rows [r, r + n) of segment g (`PS_*` words, see kernels.h): out [T, n] (rows os apart) = x [T, K]
 * (rows xs apart) @ those rows^T, each output one `dot` of its weight row as fp32 (decoded first where compact):
 * the bits of `gemm_exact` over the weights decoded to fp32. Returns 0, or -1 when a compact block's scratch
 * cannot be allocated. */
static int gemm_segment(const long *g, long r, const float *x, long xs, int T, int n, int K, float *out, long os) {
    const long fmt = g[PS_FMT];
    if (fmt == WF_F32 || fmt == WF_BF16) {
        gemm_exact_w((const void *)g[PS_DATA], r * K, fmt == WF_BF16, x, xs, T, n, K, out, os);
        return 0;
    }
    if (fmt == WF_MXFP4)
        return compact_run((compact_job){.mxfp4 = 1, .x = x, .q = (const unsigned char *)g[PS_DATA] + r * (K / 2),
                                         .sbytes = (const unsigned char *)g[PS_SCALE] + r * (K / 32),
                                         .e2m1 = (const float *)g[PS_LUT], .e8m0 = (const float *)g[PS_LUT2],
                                         .T = T, .N = n, .K = K, .n_end = n, .xs = xs, .os = os, .out = out});
    /* FP8 tiles. A stack of matrices (routed experts) of PS_PERIOD rows each, every one with its own PS_SCALE_PERIOD
     * rows of tile scales: a call runs one matrix at a time, its rows' tiles counted from the matrix's first row
     * (offset by PS_ROW0: a slice of a bigger matrix). */
    const long period = g[PS_PERIOD], cols = g[PS_SCALE_COLS];
    while (n > 0) {
        const long e = period ? r / period : 0, rr = period ? r % period : r;
        const int m = period && rr + n > period ? (int)(period - rr) : n;
        if (compact_run((compact_job){.mxfp4 = 0, .x = x, .q = (const unsigned char *)g[PS_DATA] + r * K,
                                      .scale = (const float *)g[PS_SCALE] + e * g[PS_SCALE_PERIOD] * cols,
                                      .scale_cols = (int)cols, .row0 = (int)(g[PS_ROW0] + rr),
                                      .lut = (const float *)g[PS_LUT], .T = T, .N = m, .K = K, .n_end = m, .xs = xs,
                                      .os = os, .out = out}) != 0)
            return -1;
        r += m, n -= m, out += m;
    }
    return 0;
}

/* out [T, N] (rows os apart) = x [T, K] (rows xs apart) @ rows [row, row + N) of projection p^T: p[0] segments of
 * rows one after another, each in its own storage (`PS_*` words from p + 1), so a fused projection may join an
 * FP8 matrix and fp32 ones without a stacked copy. Every output has the bits of `gemm_exact` over the weights decoded
 * to fp32, whatever the storage and the split. Returns 0, or -1 when a compact scratch cannot be allocated. */
static int gemm_proj(const long *p, long row, const float *x, long xs, int T, int N, int K, float *out, long os) {
    long s0 = 0;
    for (long s = 0; s < p[0] && N > 0; s++) {
        const long *g = p + 1 + s * PS_COUNT, s1 = s0 + g[PS_ROWS];
        if (row < s1) {
            const int n = row + N < s1 ? N : (int)(s1 - row);
            if (gemm_segment(g, row - s0, x, xs, T, n, K, out, os) != 0) return -1;
            row += n, N -= n, out += n;
        }
        s0 = s1;
    }
    return 0;
}

/* A projection of one segment of plain weights w [rows, K], fp32 (bf = 0) or bf16 bits (bf = 1), in p. */
static const long *proj_plain(long p[1 + PS_COUNT], const void *w, int bf, long rows) {
    for (int i = 0; i <= PS_COUNT; i++) p[i] = 0;
    p[0] = 1;
    p[1 + PS_FMT] = bf ? WF_BF16 : WF_F32, p[1 + PS_ROWS] = rows, p[1 + PS_DATA] = (long)w;
    return p;
}

/* `gemm_proj` for Python (tests and the module path's one-off callers): x [T, K], out [T, N] packed. */
int linear_proj(const long *p, long row, const float *x, int T, int N, int K, float *out) {
    return gemm_proj(p, row, x, K, T, N, K, out, N);
}
