/* pdspark CPU kernels, gemm.c: the weight GEMMs and dot products, for fp32 weights and bf16 bits (see kernels.h):
 * `dot`, `dot4` and `gemm_exact` (every output exactly a `dot`, whatever rows share the call; an AVX-512 form with
 * the same bits), `gemv`, and the DSpark draft's `gemm_rows` (fused multiply-adds, its own order). */
#include "kernels.h"

/* Rows a GEMV asks the memory for ahead of the four it reads: a decode step's weights stream from DRAM (or L3) in
 * short rows (a few hundred floats), too short for the hardware prefetchers to ramp up on their own; asking 8 rows
 * ahead took a one-core GEMV over [*, 192] rows from ~7 to ~10 GB/s out of DRAM and ~15 to ~30 GB/s out of L3. */
#define GEMV_AHEAD 8

/* Hint the cache lines of bytes [from, to) of w into the cache (no arithmetic: results are unchanged). */
static void prefetch(const void *w, long from, long to) {
    for (long o = from; o < to; o += 64) __builtin_prefetch((const char *)w + o, 0, 0);
}

/* The same into L2 only (prefetcht1): for bytes wanted after the next few thousand cycles, which asked into L1 would
 * push out what the core is working on. */
static void prefetch_l2(const void *w, long from, long to) {
    for (long o = from; o < to; o += 64) __builtin_prefetch((const char *)w + o, 0, 2);
}

/* 0 with `-DPDSPARK_NO_WEIGHT_AHEAD`: the weights asked for as before the spread requests below (`gemm_exact`'s next
 * block all at once into L1, the compact GEMMs' not at all), which bench/bench_weight_gemm.py measures against. */
#ifdef PDSPARK_NO_WEIGHT_AHEAD
#define WEIGHT_AHEAD 0
#else
#define WEIGHT_AHEAD 1
#endif

/* Bytes [next, end) of w to ask for into L2 `per` at a time, at each step of a loop that computes meanwhile
 * (`ahead_step`): spread out, the requests never fill the core's miss queue ahead of the loads the loop itself waits
 * for, as a burst of hundreds does. `ahead_over` plans `steps` steps; `gemm_exact` (below) and the compact GEMMs
 * (compact.c) ask so for the weights they will read next. */
typedef struct {
    const char *w;       /* the matrix */
    long next, end, per; /* its bytes [next, end) not asked for yet, and how many to ask for at each step */
} ahead_t;

static inline __attribute__((always_inline)) void ahead_step(ahead_t *a) {
    const long to = a->next + a->per < a->end ? a->next + a->per : a->end;
    for (; a->next < to; a->next += 64) __builtin_prefetch(a->w + a->next, 0, 2); /* into L2 (prefetcht1) */
}

static inline ahead_t ahead_over(const void *w, long from, long to, long steps) {
    const long bytes = to > from ? to - from : 0;
    const long per = steps > 0 ? (bytes / steps + 63) & ~63L : bytes;
    return (ahead_t){(const char *)w, from, from + bytes, per};
}

/* For weights of type W whose value is VALUE(w[k]) (SUFFIX names the instance):
 *   dot:        sum of a[k] * b[k] over 16 interleaved partial sums (the compiler maps them onto vector lanes);
 *   dot4:       four `dot`s of a[j] with the same b, each with the very same arithmetic as `dot` (the four chains of
 *               partial sums and their final additions interleave, which hides the adds' latency on short rows);
 *   gemm_exact4: out [T, N] (rows `os` apart) = x [T, K] (rows `xs` apart) @ w [N, K]^T, each entry exactly a
 *               `dot` (the same bits per row whatever T), with each group of four weight rows read once for all T
 *               rows while it sits in L1 and asked for GEMV_AHEAD rows ahead: a verify step's rows share each weight
 *               read where per-row GEMVs would stream the matrix from L2/L3 T times. `gemm_exact` (below) is this,
 *               or its AVX-512 form with the same bits. */
#define WEIGHT_KERNELS(SUFFIX, W, VALUE)                                                                            \
    static float dot##SUFFIX(const W *a, const float *b, int n) {                                                   \
        float acc[16] = {0};                                                                                        \
        int k = 0;                                                                                                  \
        for (; k + 16 <= n; k += 16)                                                                                \
            for (int l = 0; l < 16; l++) acc[l] += VALUE(a[k + l]) * b[k + l];                                      \
        float s = 0.0f;                                                                                             \
        for (int l = 0; l < 16; l++) s += acc[l];                                                                   \
        for (; k < n; k++) s += VALUE(a[k]) * b[k];                                                                 \
        return s;                                                                                                   \
    }                                                                                                               \
                                                                                                                    \
    static void dot4##SUFFIX(const W *a0, const W *a1, const W *a2, const W *a3, const float *b, int n,             \
                             float *out) {                                                                          \
        float c0[16] = {0}, c1[16] = {0}, c2[16] = {0}, c3[16] = {0};                                               \
        int k = 0;                                                                                                  \
        for (; k + 16 <= n; k += 16)                                                                                \
            for (int l = 0; l < 16; l++) {                                                                          \
                c0[l] += VALUE(a0[k + l]) * b[k + l];                                                               \
                c1[l] += VALUE(a1[k + l]) * b[k + l];                                                               \
                c2[l] += VALUE(a2[k + l]) * b[k + l];                                                               \
                c3[l] += VALUE(a3[k + l]) * b[k + l];                                                               \
            }                                                                                                       \
        float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;                                                           \
        for (int l = 0; l < 16; l++) {                                                                              \
            s0 += c0[l];                                                                                            \
            s1 += c1[l];                                                                                            \
            s2 += c2[l];                                                                                            \
            s3 += c3[l];                                                                                            \
        }                                                                                                           \
        for (; k < n; k++) {                                                                                        \
            s0 += VALUE(a0[k]) * b[k];                                                                              \
            s1 += VALUE(a1[k]) * b[k];                                                                              \
            s2 += VALUE(a2[k]) * b[k];                                                                              \
            s3 += VALUE(a3[k]) * b[k];                                                                              \
        }                                                                                                           \
        out[0] = s0, out[1] = s1, out[2] = s2, out[3] = s3;                                                         \
    }                                                                                                               \
                                                                                                                    \
    /* `dot4` of two vectors b and e at once: each weight value widened once for both; every output has the   \
     * bits `dot4` gives it alone. */                                                                           \
    static void dot4x2##SUFFIX(const W *a0, const W *a1, const W *a2, const W *a3, const float *b,              \
                               const float *e, int n, float *out, float *oute) {                                \
        float c0[16] = {0}, c1[16] = {0}, c2[16] = {0}, c3[16] = {0};                                               \
        float d0[16] = {0}, d1[16] = {0}, d2[16] = {0}, d3[16] = {0};                                               \
        int k = 0;                                                                                                  \
        for (; k + 16 <= n; k += 16)                                                                                \
            for (int l = 0; l < 16; l++) {                                                                          \
                const float w0 = VALUE(a0[k + l]), w1 = VALUE(a1[k + l]), w2 = VALUE(a2[k + l]),                    \
                            w3 = VALUE(a3[k + l]);                                                                  \
                c0[l] += w0 * b[k + l];                                                                             \
                c1[l] += w1 * b[k + l];                                                                             \
                c2[l] += w2 * b[k + l];                                                                             \
                c3[l] += w3 * b[k + l];                                                                             \
                d0[l] += w0 * e[k + l];                                                                             \
                d1[l] += w1 * e[k + l];                                                                             \
                d2[l] += w2 * e[k + l];                                                                             \
                d3[l] += w3 * e[k + l];                                                                             \
            }                                                                                                       \
        float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f, t0 = 0.0f, t1 = 0.0f, t2 = 0.0f, t3 = 0.0f;               \
        for (int l = 0; l < 16; l++) {                                                                              \
            s0 += c0[l];                                                                                            \
            s1 += c1[l];                                                                                            \
            s2 += c2[l];                                                                                            \
            s3 += c3[l];                                                                                            \
            t0 += d0[l];                                                                                            \
            t1 += d1[l];                                                                                            \
            t2 += d2[l];                                                                                            \
            t3 += d3[l];                                                                                            \
        }                                                                                                           \
        for (; k < n; k++) {                                                                                        \
            const float w0 = VALUE(a0[k]), w1 = VALUE(a1[k]), w2 = VALUE(a2[k]), w3 = VALUE(a3[k]);                 \
            s0 += w0 * b[k];                                                                                        \
            s1 += w1 * b[k];                                                                                        \
            s2 += w2 * b[k];                                                                                        \
            s3 += w3 * b[k];                                                                                        \
            t0 += w0 * e[k];                                                                                        \
            t1 += w1 * e[k];                                                                                        \
            t2 += w2 * e[k];                                                                                        \
            t3 += w3 * e[k];                                                                                        \
        }                                                                                                           \
        out[0] = s0, out[1] = s1, out[2] = s2, out[3] = s3;                                                         \
        oute[0] = t0, oute[1] = t1, oute[2] = t2, oute[3] = t3;                                                     \
    }                                                                                                               \
                                                                                                                    \
    static void gemm_exact4##SUFFIX(const W *w, const float *x, long xs, int T, int N, int K, float *out,         \
                                    long os) {                                                                  \
        const long row = (long)K * (long)sizeof(W);                                                                 \
        int n = 0;                                                                                                  \
        float s4[4], e4[4];                                                                                         \
        prefetch(w, 0, (N < GEMV_AHEAD ? N : GEMV_AHEAD) * row);                                                    \
        for (; n + 4 <= N; n += 4) {                                                                                \
            const W *r = w + (long)n * K;                                                                           \
            const int lo = n + GEMV_AHEAD, hi = lo + 4 < N ? lo + 4 : N;                                            \
            if (lo < hi) prefetch(w, lo * row, hi * row);                                                           \
            int t = 0;                                                                                              \
            for (; t + 2 <= T; t += 2) { /* rows in pairs: the weights widened once per pair */                    \
                dot4x2##SUFFIX(r, r + K, r + 2L * K, r + 3L * K, x + (long)t * xs, x + (long)(t + 1) * xs, K, s4,   \
                               e4);                                                                                 \
                for (int i = 0; i < 4; i++) {                                                                       \
                    out[(long)t * os + n + i] = s4[i];                                                              \
                    out[(long)(t + 1) * os + n + i] = e4[i];                                                        \
                }                                                                                                   \
            }                                                                                                       \
            if (t < T) {                                                                                            \
                dot4##SUFFIX(r, r + K, r + 2L * K, r + 3L * K, x + (long)t * xs, K, s4);                            \
                for (int i = 0; i < 4; i++) out[(long)t * os + n + i] = s4[i];                                      \
            }                                                                                                       \
        }                                                                                                           \
        for (; n < N; n++)                                                                                          \
            for (int t = 0; t < T; t++) out[(long)t * os + n] = dot##SUFFIX(w + (long)n * K, x + (long)t * xs, K);  \
    }

WEIGHT_KERNELS(, float, F32_VALUE)
WEIGHT_KERNELS(_h, bf16_t, bf16f)
#if defined(__AVX512F__) && !defined(PDSPARK_NO_AVX512_GEMM)
#include <immintrin.h>
/* `gemm_exact` on AVX-512: the same bits as `gemm_exact4`, ~1.3x faster at one row and ~1.7x at 6-8 (a verify
 * step), measured on a Zen 4 core. There, widening the weights and adding up each output's 16 partial sums one
 * by one (the order `dot` defines) cost as much as the products. Here a tile computes 16 outputs at once: R weight
 * rows x TB input rows (R * TB = 16), each weight widened once for its TB rows, one register of 16 partial sums
 * per output (lane l = `dot`'s acc[l]); then the 16 registers are transposed so that one vector addition per lane
 * adds lane l of all 16 outputs, in `dot`'s order (0 + acc[0] + ... + acc[15]). */

/* Lane j of the result: 0 + a[j][0] + a[j][1] + ... + a[j][15], added in that order. */
static inline __m512 lane_sums16(const __m512 a[16]) {
    __m512 t[16], u[16];
    for (int i = 0; i < 16; i += 2) { /* pairs of rows, interleaved */
        t[i] = _mm512_unpacklo_ps(a[i], a[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(a[i], a[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) { /* u[4g + c]: lane 4q + c of rows 4g..4g+3 in its 128-bit chunk q */
        const __m512d t0 = _mm512_castps_pd(t[i]), t1 = _mm512_castps_pd(t[i + 1]);
        const __m512d t2 = _mm512_castps_pd(t[i + 2]), t3 = _mm512_castps_pd(t[i + 3]);
        u[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(t0, t2));
        u[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(t0, t2));
        u[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(t1, t3));
        u[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(t1, t3));
    }
    for (int i = 0; i < 4; i++) { /* 128-bit chunks across the four groups of rows */
        t[i] = _mm512_shuffle_f32x4(u[i], u[4 + i], 0x88);
        t[4 + i] = _mm512_shuffle_f32x4(u[i], u[4 + i], 0xdd);
        t[8 + i] = _mm512_shuffle_f32x4(u[8 + i], u[12 + i], 0x88);
        t[12 + i] = _mm512_shuffle_f32x4(u[8 + i], u[12 + i], 0xdd);
    }
    for (int i = 0; i < 4; i++) { /* now u[l] holds lane l of rows 0..15 */
        u[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);
        u[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xdd);
        u[4 + i] = _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0x88);
        u[12 + i] = _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0xdd);
    }
    __m512 s = _mm512_setzero_ps();
    for (int l = 0; l < 16; l++) s = _mm512_add_ps(s, u[l]);
    return s;
}

static inline __m512 load16(const float *p) { return _mm512_loadu_ps(p); }
static inline __m512 load16_h(const bf16_t *p) { /* 16 bf16 bits widened: the same floats, exactly */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* The next block of weight rows, asked for into L2 a few cache lines at a time from inside the tiles' loops
 * (`ahead_step` at every 16 columns) rather than into L1 all at once when a block begins: a burst of a block's 512
 * (bf16, K = 1,024) to 1,024 (fp32) requests filled the core's miss queue, and the tiles then waited for the lines
 * they needed behind it, so a verify step's GEMM read DRAM and computed in turn; and a block asked for into L1
 * pushed the one being computed out of it (a block is 32-64 KiB, an L1 32-48). Measured on one Zen 4 core
 * (bench/bench_weight_gemm.py builds both), each output's bits unchanged: fp32 [1,024, 1,024] matrices from DRAM
 * 39 -> 52 GFLOP/s at 12 rows (a batch-8 verify's rows for one expert), 30 -> 43 at 6, 60 -> 65 at 48; bf16 37 ->
 * 66 at 6 rows and GEMVs 12 -> 20 GB/s; a bf16 GEMV over [16,384, 192] out of L3 (dsv4-tiny's decode) 32 -> 39
 * GB/s. (`WEIGHT_AHEAD` 0: the burst into L1, as before.) */

/* Tile calls a block of 16 weight rows takes for T input rows (`gemm_exact` below: 8 rows a tile, then 4, then 3,
 * 2 or 1), each `K16 / 16` steps long. */
static int block_tiles(int T) {
    static const int last[4] = {0, 1, 2, 4}; /* T % 4 rows left: none, one 16x1 tile, two 8x2, four 4x3 */
    return (T / 8) * 8 + ((T % 8) / 4) * 4 + last[T % 4];
}

/* Ask for bytes [from, to) of the weights w: an even share at each step of a block of T rows, or (not `spread`)
 * all now, into L1. */
static inline ahead_t ahead_plan(const void *w, long from, long to, int T, int K16, int spread) {
    if (!spread) {
        prefetch(w, from, to);
        return ahead_over(w, to, to, 0);
    }
    return ahead_over(w, from, to, (long)block_tiles(T) * (K16 / 16));
}

/* Lane tt * R + i of the result: `dot` of weight row i of r (rows K apart) with input row tt of x (rows xs apart),
 * over the first K16 = K - K % 16 columns. */
#define GEMM_TILE(SUFFIX, W, LOAD, R, TB)                                                                           \
    static inline __attribute__((always_inline)) __m512 tile##SUFFIX##_##R##x##TB(const W *r, long K, int K16,     \
                                                                                   const float *x, long xs,        \
                                                                                   ahead_t *ah) {                  \
        __m512 acc[16];                                                                                            \
        for (int j = 0; j < 16; j++) acc[j] = _mm512_setzero_ps();                                                 \
        for (int k = 0; k < K16; k += 16) {                                                                        \
            __m512 wv[R];                                                                                          \
            if (WEIGHT_AHEAD) ahead_step(ah);                                                                      \
            for (int i = 0; i < R; i++) wv[i] = LOAD(r + i * K + k);                                               \
            for (int tt = 0; tt < TB; tt++) {                                                                      \
                const __m512 xv = _mm512_loadu_ps(x + tt * xs + k);                                                \
                for (int i = 0; i < R; i++)                                                                        \
                    acc[tt * R + i] = _mm512_add_ps(acc[tt * R + i], _mm512_mul_ps(wv[i], xv));                    \
            }                                                                                                      \
        }                                                                                                          \
        return lane_sums16(acc);                                                                                   \
    }

/* gemm_exact: blocks of 16 weight rows (each read from L1 for every group of input rows; the next block asked for
 * ahead), input rows 8 at a time (two weight rows a tile, each widened once for the 8: 3-5% faster than 4 at a time
 * from 8 rows on a Zen 4 core), then 4, then the last 3, 2 or 1; rows past the last block of 16 go to `gemm_exact4`.
 * At dsv4-tiny's K = 192 it runs ~55-64 GFLOP/s from 8 rows, ~80 at K = 2048: each tile's transposition of its 16
 * registers (`lane_sums16`) does not depend on K. */
#define GEMM_AVX512(SUFFIX, W, VALUE, LOAD)                                                                         \
    GEMM_TILE(SUFFIX, W, LOAD, 16, 1)                                                                               \
    GEMM_TILE(SUFFIX, W, LOAD, 8, 2)                                                                                \
    GEMM_TILE(SUFFIX, W, LOAD, 4, 3)                                                                                \
    GEMM_TILE(SUFFIX, W, LOAD, 4, 4)                                                                                \
    GEMM_TILE(SUFFIX, W, LOAD, 2, 8)                                                                                \
                                                                                                                    \
    /* Store tile lanes tt * R + i as out rows t + tt, columns n + i. */                                            \
    static inline void put##SUFFIX(__m512 v, int R, int TB, float *out, long os) {                                  \
        float s[16];                                                                                                \
        _mm512_storeu_ps(s, v);                                                                                     \
        for (int tt = 0; tt < TB; tt++)                                                                             \
            for (int i = 0; i < R; i++) out[(long)tt * os + i] = s[tt * R + i];                                     \
    }                                                                                                               \
                                                                                                                    \
    static void gemm_exact##SUFFIX(const W *w, const float *x, long xs, int T, int N, int K, float *out, long os) { \
        const long row = (long)K * (long)sizeof(W);                                                                 \
        const int K16 = K & ~15;                                                                                    \
        int n = 0;                                                                                                  \
        prefetch(w, 0, (N < 16 ? N : 16) * row);                                                                    \
        for (; n + 16 <= N; n += 16) {                                                                              \
            const W *r = w + (long)n * K;                                                                           \
            const int lo = n + 16, hi = lo + 16 < N ? lo + 16 : N;                                                  \
            ahead_t ah = ahead_plan(w, lo * row, hi * row, T, K16, WEIGHT_AHEAD);                                   \
            float *o = out + n;                                                                                     \
            int t = 0;                                                                                              \
            for (; t + 8 <= T; t += 8) /* 8 input rows a tile: each weight widened once for all 8 */                \
                for (int b = 0; b < 16; b += 2)                                                                     \
                    put##SUFFIX(tile##SUFFIX##_2x8(r + (long)b * K, K, K16, x + t * xs, xs, &ah), 2, 8,             \
                                o + t * os + b, os);                                                                \
            for (; t + 4 <= T; t += 4)                                                                              \
                for (int b = 0; b < 16; b += 4)                                                                     \
                    put##SUFFIX(tile##SUFFIX##_4x4(r + (long)b * K, K, K16, x + t * xs, xs, &ah), 4, 4,             \
                                o + t * os + b, os);                                                                \
            if (T - t == 3)                                                                                         \
                for (int b = 0; b < 16; b += 4)                                                                     \
                    put##SUFFIX(tile##SUFFIX##_4x3(r + (long)b * K, K, K16, x + t * xs, xs, &ah), 4, 3,             \
                                o + t * os + b, os);                                                                \
            else if (T - t == 2)                                                                                    \
                for (int b = 0; b < 16; b += 8)                                                                     \
                    put##SUFFIX(tile##SUFFIX##_8x2(r + (long)b * K, K, K16, x + t * xs, xs, &ah), 8, 2,             \
                                o + t * os + b, os);                                                                \
            else if (T - t == 1)                                                                                    \
                put##SUFFIX(tile##SUFFIX##_16x1(r, K, K16, x + t * xs, xs, &ah), 16, 1, o + t * os, os);            \
            for (int k = K16; k < K; k++) /* `dot`'s tail, after its partial sums */                                \
                for (int t2 = 0; t2 < T; t2++)                                                                      \
                    for (int i = 0; i < 16; i++) o[t2 * os + i] += VALUE(r[(long)i * K + k]) * x[t2 * xs + k];      \
        }                                                                                                           \
        if (n < N) gemm_exact4##SUFFIX(w + (long)n * K, x, xs, T, N - n, K, out + n, os);                           \
    }

GEMM_AVX512(, float, F32_VALUE, load16)
GEMM_AVX512(_h, bf16_t, bf16f, load16_h)
#else
static void gemm_exact(const float *w, const float *x, long xs, int T, int N, int K, float *out, long os) {
    gemm_exact4(w, x, xs, T, N, K, out, os);
}

static void gemm_exact_h(const bf16_t *w, const float *x, long xs, int T, int N, int K, float *out, long os) {
    gemm_exact4_h(w, x, xs, T, N, K, out, os);
}
#endif

/* out [N] = w [N, K] @ x [K] (each row exactly a `dot`): `gemm_exact` of one row. */
static void gemv(const float *w, const float *x, int N, int K, float *out) {
    gemm_exact(w, x, K, 1, N, K, out, N);
}

/* ---- the DSpark draft's GEMM ------------------------------------------------------------------------------------- */

#if defined(__AVX2__) && defined(__FMA__) && !defined(PDSPARK_DRAFT_NO_FMA)
#include <immintrin.h>

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* out [T, N] (rows `os` apart) = x [T, K] (rows `xs` apart) @ w [N, K]^T for a draft block's few rows: four weight
 * rows times two block rows per pass in fused multiply-adds over 8 lanes (eight accumulators in registers), so each
 * weight load serves two rows and each row load four weights. Only the draft uses it: its own summation order,
 * with one rounding per multiply-add (the draft's logits need not match BLAS bit for bit; see model.cpu.draft_step).
 * Instantiated for fp32 weights (`gemm_rows`) and bf16 bits (`gemm_rows_h`: each 8-lane load widens 8 values
 * exactly, so every multiply-add is the fp32 instance's on the same numbers). The rows two groups on are asked for
 * into L2 as it goes (`ahead_step`): a draft's head and layers read from DRAM where its model is big, and without
 * it one Zen 4 core read bf16 [1,024, 1,024] matrices at 7.6 GB/s at 1 row (18 with it) and 26 GFLOP/s at 6 (41). */
#define LOAD8_F32(p) _mm256_loadu_ps(p)
#define LOAD8_BF16(p) \
    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#define GEMM_ROWS(SUFFIX, W, VALUE, LOAD8)                                                                          \
    static void gemm_rows##SUFFIX(const W *w, const float *x, long xs, int T, int N, int K, float *out, long os) {  \
        const int K8 = K & ~7;                                                                                      \
        int n = 0;                                                                                                  \
        for (; n < N; n += 4) {                                                                                     \
            const int nr = N - n < 4 ? N - n : 4;                                                                   \
            const W *r[4];                                                                                          \
            for (int i = 0; i < 4; i++) r[i] = w + (long)(n + (i < nr ? i : 0)) * K;                                \
            const long rb = (long)K * (long)sizeof(W), end = (long)N * rb, on = (long)(n + 8) * rb;                 \
            const long lo = on < end ? on : end, hi = lo + 4 * rb < end ? lo + 4 * rb : end;                        \
            ahead_t ah = ahead_over(w, lo, hi, (long)((T + 1) / 2) * (K8 / 8)); /* the rows two groups on */        \
            for (int t = 0; t < T; t += 2) {                                                                        \
                const int two = t + 1 < T;                                                                          \
                const float *x0 = x + (long)t * xs, *x1 = x + (long)(t + two) * xs;                                 \
                __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00,            \
                       a30 = a00, a31 = a00;                                                                        \
                for (int k = 0; k < K8; k += 8) {                                                                   \
                    if (WEIGHT_AHEAD) ahead_step(&ah);                                                              \
                    const __m256 v0 = _mm256_loadu_ps(x0 + k), v1 = _mm256_loadu_ps(x1 + k);                        \
                    __m256 wv = LOAD8(r[0] + k);                                                                    \
                    a00 = _mm256_fmadd_ps(wv, v0, a00);                                                             \
                    a01 = _mm256_fmadd_ps(wv, v1, a01);                                                             \
                    wv = LOAD8(r[1] + k);                                                                           \
                    a10 = _mm256_fmadd_ps(wv, v0, a10);                                                             \
                    a11 = _mm256_fmadd_ps(wv, v1, a11);                                                             \
                    wv = LOAD8(r[2] + k);                                                                           \
                    a20 = _mm256_fmadd_ps(wv, v0, a20);                                                             \
                    a21 = _mm256_fmadd_ps(wv, v1, a21);                                                             \
                    wv = LOAD8(r[3] + k);                                                                           \
                    a30 = _mm256_fmadd_ps(wv, v0, a30);                                                             \
                    a31 = _mm256_fmadd_ps(wv, v1, a31);                                                             \
                }                                                                                                   \
                float s[4][2] = {{hsum8(a00), hsum8(a01)}, {hsum8(a10), hsum8(a11)}, {hsum8(a20), hsum8(a21)},      \
                                 {hsum8(a30), hsum8(a31)}};                                                         \
                for (int i = 0; i < nr; i++)                                                                        \
                    for (int k = K8; k < K; k++) {                                                                  \
                        s[i][0] += VALUE(r[i][k]) * x0[k];                                                          \
                        s[i][1] += VALUE(r[i][k]) * x1[k];                                                          \
                    }                                                                                               \
                for (int i = 0; i < nr; i++) {                                                                      \
                    out[(long)t * os + n + i] = s[i][0];                                                            \
                    if (two) out[(long)(t + 1) * os + n + i] = s[i][1];                                             \
                }                                                                                                   \
            }                                                                                                       \
        }                                                                                                           \
    }

GEMM_ROWS(, float, F32_VALUE, LOAD8_F32)
GEMM_ROWS(_h, bf16_t, bf16f, LOAD8_BF16)
#else
static void gemm_rows(const float *w, const float *x, long xs, int T, int N, int K, float *out, long os) {
    gemm_exact(w, x, xs, T, N, K, out, os);
}

static void gemm_rows_h(const bf16_t *w, const float *x, long xs, int T, int N, int K, float *out, long os) {
    gemm_exact_h(w, x, xs, T, N, K, out, os);
}
#endif
