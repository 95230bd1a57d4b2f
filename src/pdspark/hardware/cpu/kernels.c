/* pdspark CPU kernels: small fused loops whose PyTorch form is dozens of tiny ops per call.
 * Plain C with float32 arithmetic in the reference's order (reductions excepted: dot products and sums of
 * squares use 16 partial sums, as vectorised BLAS kernels do; the indexer's scores keep the exact order of their
 * PyTorch path, in GCC/Clang vector types; the DSpark draft's GEMMs use fused multiply-adds where the CPU has
 * them, see `draft_block`); called through ctypes. */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <time.h>

static float sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }

/* Weights may be stored as bfloat16 bits. A checkpoint's weights are bf16 numbers (DSV4 ships bf16), which fp32
 * holds exactly, and widening bf16 to fp32 is exact: so a kernel that reads each weight as its bf16 bits and widens
 * it in a register computes every product and sum of its fp32 twin bit for bit, while reading half the bytes (a
 * decode step streams its weights from L3 or DRAM). The caller stores a matrix that way only when every value
 * round-trips (`pdspark.hardware.cpu.kernels.bf16_copy`). The weight-reading kernels below are written once and
 * instantiated for both storages: `dot`, `dot4`, `gemm_exact4` (fp32) and `dot_h`, `dot4_h`, `gemm_exact4_h`. */
typedef unsigned short bf16_t;

static inline float bf16f(bf16_t h) {
    union { unsigned int u; float f; } v;
    v.u = (unsigned int)h << 16;
    return v.f;
}

#define F32_VALUE(v) (v)

/* Rows a GEMV asks the memory for ahead of the four it reads: a decode step's weights stream from DRAM (or L3) in
 * short rows (a few hundred floats), too short for the hardware prefetchers to ramp up on their own; asking 8 rows
 * ahead took a one-core GEMV over [*, 192] rows from ~7 to ~10 GB/s out of DRAM and ~15 to ~30 GB/s out of L3. */
#define GEMV_AHEAD 8

/* Hint the cache lines of bytes [from, to) of w into the cache (no arithmetic: results are unchanged). */
static void prefetch(const void *w, long from, long to) {
    for (long o = from; o < to; o += 64) __builtin_prefetch((const char *)w + o, 0, 0);
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

/* Lane tt * R + i of the result: `dot` of weight row i of r (rows K apart) with input row tt of x (rows xs apart),
 * over the first K16 = K - K % 16 columns. */
#define GEMM_TILE(SUFFIX, W, LOAD, R, TB)                                                                          \
    static inline __attribute__((always_inline)) __m512 tile##SUFFIX##_##R##x##TB(const W *r, long K, int K16,     \
                                                                                   const float *x, long xs) {      \
        __m512 acc[16];                                                                                            \
        for (int j = 0; j < 16; j++) acc[j] = _mm512_setzero_ps();                                                 \
        for (int k = 0; k < K16; k += 16) {                                                                        \
            __m512 wv[R];                                                                                          \
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
 * ahead), input rows 4 at a time, then the last 3, 2 or 1; rows past the last block of 16 go to `gemm_exact4`. */
#define GEMM_AVX512(SUFFIX, W, VALUE, LOAD)                                                                         \
    GEMM_TILE(SUFFIX, W, LOAD, 16, 1)                                                                               \
    GEMM_TILE(SUFFIX, W, LOAD, 8, 2)                                                                                \
    GEMM_TILE(SUFFIX, W, LOAD, 4, 3)                                                                                \
    GEMM_TILE(SUFFIX, W, LOAD, 4, 4)                                                                                \
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
            if (lo < hi) prefetch(w, lo * row, hi * row);                                                           \
            float *o = out + n;                                                                                     \
            int t = 0;                                                                                              \
            for (; t + 4 <= T; t += 4)                                                                              \
                for (int b = 0; b < 16; b += 4)                                                                     \
                    put##SUFFIX(tile##SUFFIX##_4x4(r + (long)b * K, K, K16, x + t * xs, xs), 4, 4, o + t * os + b,  \
                                os);                                                                                \
            if (T - t == 3)                                                                                         \
                for (int b = 0; b < 16; b += 4)                                                                     \
                    put##SUFFIX(tile##SUFFIX##_4x3(r + (long)b * K, K, K16, x + t * xs, xs), 4, 3, o + t * os + b,  \
                                os);                                                                                \
            else if (T - t == 2)                                                                                    \
                for (int b = 0; b < 16; b += 8)                                                                     \
                    put##SUFFIX(tile##SUFFIX##_8x2(r + (long)b * K, K, K16, x + t * xs, xs), 8, 2, o + t * os + b,  \
                                os);                                                                                \
            else if (T - t == 1)                                                                                    \
                put##SUFFIX(tile##SUFFIX##_16x1(r, K, K16, x + t * xs, xs), 16, 1, o + t * os, os);                 \
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

/* One helper thread for the weight GEMMs of a step (`pool_threads(2)`; 1, the default: none). A GEMM big enough
 * (`POOL_MIN_MACS`) offers its last output rows to the helper and computes the first ones itself; whoever claims the
 * offer first computes them (the caller takes them back when the helper has not woken by the time its own share is
 * done, so a sleeping helper never makes a GEMM slower than alone). Each output is computed whole by one thread
 * with the same code: the bits do not depend on the split. The helper spins `POOL_SPIN_NS` for the next offer (a
 * step's GEMMs come microseconds apart), then sleeps on a condition variable. One caller at a time: a GEMM that
 * finds the helper taken (two engines of one process stepping at once) runs alone. A forked child starts with no
 * helper (its thread is not copied) and makes a new one when it needs it. */
#define POOL_MIN_MACS (1L << 16)
#define POOL_SPIN_NS 200000L
#if defined(__x86_64__) || defined(__i386__)
#define CPU_RELAX() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define CPU_RELAX() __asm__ __volatile__("yield")
#else
#define CPU_RELAX() ((void)0)
#endif

typedef struct {
    const void *w;
    int bf;
    int rows; /* 0: `gemm_exact`; 1: the draft's `gemm_rows` */
    const float *x;
    long xs;
    int T, N, K;
    float *out;
    long os;
} gemm_job;

static struct {
    int threads;                        /* wanted: 1 or 2 (set by `pool_threads`) */
    int started;                        /* the helper thread exists */
    atomic_int busy;                    /* a caller owns the pool */
    atomic_long posted, claimed, done;  /* offer generations: posted, claimed (by either thread), done by the helper */
    atomic_int sleeping;                /* the helper waits on `cv` */
    void (*fn)(void *);                 /* the offer: fn(arg) */
    void *arg;
    pthread_mutex_t mu;
    pthread_cond_t cv;
} pool = {1, 0, 0, 0, 0, 0, 0, 0, 0, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER};

static void gemm_rows_alone(const gemm_job *j); /* (below, with the draft's kernels) */

/* The weights at element `off` of w, stored as fp32 (bf = 0) or bf16 bits (bf = 1). */
static const void *weights_at(const void *w, int bf, long off) {
    return bf ? (const void *)((const bf16_t *)w + off) : (const void *)((const float *)w + off);
}

static void gemm_job_run(const gemm_job *j);

static void gemm_job_fn(void *j) { gemm_job_run((const gemm_job *)j); }

static void gemm_job_run(const gemm_job *j) {
    if (j->rows)
        gemm_rows_alone(j);
    else if (j->bf)
        gemm_exact_h((const bf16_t *)j->w, j->x, j->xs, j->T, j->N, j->K, j->out, j->os);
    else
        gemm_exact((const float *)j->w, j->x, j->xs, j->T, j->N, j->K, j->out, j->os);
}

static int pool_claim(long gen) {
    long prev = gen - 1;
    return atomic_compare_exchange_strong(&pool.claimed, &prev, gen);
}

static long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

static void *pool_helper(void *arg) {
    (void)arg;
    long seen = atomic_load(&pool.claimed); /* no offer is open when the thread is made */
    for (;;) {
        const long until = now_ns() + POOL_SPIN_NS;
        for (int i = 0; atomic_load(&pool.posted) == seen; i++) {
            CPU_RELAX();
            if ((i & 63) == 63 && now_ns() > until) break;
        }
        if (atomic_load(&pool.posted) == seen) {
            pthread_mutex_lock(&pool.mu);
            atomic_store(&pool.sleeping, 1);
            while (atomic_load(&pool.posted) == seen) pthread_cond_wait(&pool.cv, &pool.mu);
            atomic_store(&pool.sleeping, 0);
            pthread_mutex_unlock(&pool.mu);
        }
        seen = atomic_load(&pool.posted);
        if (pool_claim(seen)) { /* the offer is this generation's: it was written before `posted` moved */
            pool.fn(pool.arg);
            atomic_store(&pool.done, seen);
        }
    }
    return 0;
}

static void pool_after_fork(void) { /* in the child: no helper thread, fresh locks, no open offer */
    pool.started = 0;
    atomic_store(&pool.claimed, atomic_load(&pool.posted)); /* (an offer of a parent's thread that is not here) */
    atomic_store(&pool.done, atomic_load(&pool.posted));
    atomic_store(&pool.busy, 0);
    atomic_store(&pool.sleeping, 0);
    pthread_mutex_init(&pool.mu, 0);
    pthread_cond_init(&pool.cv, 0);
}

/* Use `n` threads (1 or 2) for the weight GEMMs from now on. */
void pool_threads(int n) { pool.threads = n > 1 ? 2 : 1; }

static int pool_take(void) {
    int idle = 0;
    if (!atomic_compare_exchange_strong(&pool.busy, &idle, 1)) return 0;
    if (!pool.started) {
        static int at_fork;
        if (!at_fork) at_fork = pthread_atfork(0, 0, pool_after_fork) == 0;
        pthread_t t;
        if (pthread_create(&t, 0, pool_helper, 0) != 0) {
            atomic_store(&pool.busy, 0);
            return 0;
        }
        pthread_detach(t);
        pool.started = 1;
    }
    return 1;
}

/* With the pool taken (`pool_take`): offer fn(arg) to the helper, run mine(mine_arg) meanwhile, then fn(arg) here
 * unless the helper claimed it first (then wait for it); the pool is free again on return. Both must write
 * disjoint memory. */
static void pool_split(void (*fn)(void *), void *arg, void (*mine)(void *), void *mine_arg) {
    pool.fn = fn;
    pool.arg = arg;
    const long gen = atomic_fetch_add(&pool.posted, 1) + 1;
    if (atomic_load(&pool.sleeping)) {
        pthread_mutex_lock(&pool.mu);
        pthread_cond_signal(&pool.cv);
        pthread_mutex_unlock(&pool.mu);
    }
    mine(mine_arg);
    if (pool_claim(gen))
        fn(arg); /* the helper has not taken it: ours after all */
    else
        while (atomic_load(&pool.done) != gen) CPU_RELAX();
    atomic_store(&pool.busy, 0);
}

/* Run `mine` (rows `[0, N)` of `mine.w`), its last rows offered to the helper thread when it is wanted, free and
 * the GEMM big enough. */
static void gemm_pooled(gemm_job mine) {
    const int half = (mine.N / 2) & ~3; /* a multiple of 4: the split falls between groups of four rows */
    if (pool.threads < 2 || (long)mine.T * mine.N * mine.K < POOL_MIN_MACS || half == 0 || !pool_take()) {
        gemm_job_run(&mine);
        return;
    }
    gemm_job theirs = mine; /* rows [half, N) */
    theirs.w = weights_at(mine.w, mine.bf, (long)half * mine.K);
    theirs.N = mine.N - half;
    theirs.out = mine.out + half;
    mine.N = half;
    pool_split(gemm_job_fn, &theirs, gemm_job_fn, &mine);
}

/* `gemm_exact` of the weights at element `off` of w: fp32 (bf = 0) or bf16 bits (bf = 1), shared with the helper
 * thread when it is worth it. */
static void gemm_exact_w(const void *w, long off, int bf, const float *x, long xs, int T, int N, int K, float *out,
                         long os) {
    gemm_pooled((gemm_job){weights_at(w, bf, off), bf, 0, x, xs, T, N, K, out, os});
}

/* out [T, N] = x [T, K] @ w [N, K]^T with `gemm_exact`'s arithmetic: every output row's bits depend on its own
 * input row only, however many rows come with it (a BLAS GEMM picks other kernels, with other summation orders,
 * for other row counts). */
void linear_rows(const float *x, const float *w, int T, int N, int K, float *out) {
    gemm_exact_w(w, 0, 0, x, K, T, N, K, out, N);
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
    for (int t = 0; t < T; t++) {
        collapse_token(h + (long)t * N, mixes + (long)t * M, scale, base, hc, D, iters, eps, x + (long)t * D,
                       pre + (long)t * hc, post + (long)t * hc, comb + (long)t * hc * hc);
        if (x_norm_w != 0) rms_norm(x + (long)t * D, D, x_norm_w, 1, D, x_norm_eps, x + (long)t * D);
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
static void index_scores_from(const float *q, const float *w, const float *k, long kstride, const long *rows,
                              long row_stride, int T, int H, int V, int D, float scale, float *out) {
    enum { NV = 4, NB = 8 * NV };
    v8f kt[D * NV]; /* [D, NB]: one block of keys, channel-major */
    const v8f zero = splat(0.0f), vscale = splat(scale);
    for (int g0 = 0; g0 < V; g0 += NB) {
        const int m = V - g0 < NB ? V - g0 : NB;
        for (int t = 0; t < T; t++) {
            if (t == 0 || kstride != 0 || rows != 0) {
                const float *kb = k + (long)t * kstride + (long)g0 * D;
                for (int l = 0; l < NB; l++) {
                    const float *kl = rows == 0 ? kb + (long)l * D
                                                : k + rows[(long)t * V + g0 + (l < m ? l : 0)] * row_stride;
                    for (int d = 0; d < D; d++) kt[d * NV + l / 8][l % 8] = l < m ? kl[d] : 0.0f;
                }
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

void index_scores(const float *q, const float *w, const float *k, long kstride, int T, int H, int V, int D,
                  float scale, float *out) {
    index_scores_from(q, w, k, kstride, 0, 0, T, H, V, D, scale, out);
}

/* The k-th largest of n floats (quickselect over a scratch copy `a`, which it reorders). */
static float kth_largest(float *a, int n, int k) {
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        const float pivot = a[(lo + hi) / 2];
        int i = lo, j = hi;
        while (i <= j) {
            while (a[i] > pivot) i++;
            while (a[j] < pivot) j--;
            if (i <= j) { const float tmp = a[i]; a[i] = a[j]; a[j] = tmp; i++; j--; }
        }
        if (k - 1 <= j) hi = j;
        else if (k - 1 >= i) lo = i;
        else break;
    }
    return a[k - 1];
}

/* The lightning indexer's pick for a few decode/verify tokens, keys read in place from the pool (rows `row_stride`
 * floats apart): the scores of `index_scores` (the same bits) against each token's rows [T, V], then the top `topk`
 * among its valid entries by the tie rule (higher score first, equal scores: lower entry first).
 * picked [T, V] (bytes) = valid and among the top. scratch holds 2 * V floats. */
void index_pick(const float *q, const float *w, const float *k, long row_stride, const long *rows,
                const unsigned char *valid, int T, int H, int V, int D, float scale, int topk, float *scratch,
                unsigned char *picked) {
    float *sc = scratch, *tmp = scratch + V;
    for (int t = 0; t < T; t++) {
        index_scores_from(q + (long)t * H * D, w + (long)t * H, k, 0, rows + (long)t * V, row_stride, 1, H, V, D,
                          scale, sc);
        const unsigned char *ok = valid + (long)t * V;
        unsigned char *pk = picked + (long)t * V;
        int n = 0;
        for (int g = 0; g < V; g++)
            if (ok[g]) tmp[n++] = sc[g];
        if (n <= topk) {
            for (int g = 0; g < V; g++) pk[g] = ok[g];
            continue;
        }
        const float kth = kth_largest(tmp, n, topk);
        int above = 0;
        for (int g = 0; g < V; g++) above += ok[g] && sc[g] > kth;
        int ties = topk - above; /* equal to the k-th score: the lowest entries first */
        for (int g = 0; g < V; g++) {
            pk[g] = ok[g] && (sc[g] > kth || (sc[g] == kth && ties-- > 0));
        }
    }
}

/* ---- decode-step kernels: a few tokens, many tiny ops in PyTorch ------------------------------------------------ */

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
 * x [T, D], w13 [E, 2I, D] (gate rows then up rows), w2 [E, D, I], w2s [D, I]; scratch 3I + 2D floats, ids k
 * words, ws k floats. */
static void moe_decode_w(const float *x, const float *lgu, long lstride, const long *input_ids, const long *tid2eid,
                         const float *bias, const void *w13, const void *w2, const void *w2s, int bf, int T, int D,
                         int E, int I, int k, int sqrtsoftplus, float scaling, float limit, float *scratch, long *ids,
                         float *ws, float *out) {
    float *h = scratch, *act = scratch + 2 * I, *acc = scratch + 3 * I, *y = scratch + 3 * I + D;
    for (int t = 0; t < T; t++) {
        const float *xt = x + (long)t * D, *lt = lgu + (long)t * lstride;
        float *ot = out + (long)t * D;
        route_token(lt, tid2eid != 0 ? tid2eid + input_ids[t] * k : 0, bias, E, k, sqrtsoftplus, scaling, ids, ws);
        /* routed experts, in slot order */
        for (int j = 0; j < k; j++) { /* one row: `gemv`'s bits */
            gemm_exact_w(w13, ids[j] * 2L * I * D, bf, xt, D, 1, 2 * I, D, h, 2 * I);
            for (int i = 0; i < I; i++) act[i] = swiglu1(h[i], h[I + i], limit);
            gemm_exact_w(w2, ids[j] * (long)D * I, bf, act, I, 1, D, I, y, D);
            for (int d = 0; d < D; d++) acc[d] = j == 0 ? y[d] * ws[j] : acc[d] + y[d] * ws[j];
        }
        /* shared expert */
        const float *sg = lt + E, *su = lt + E + I;
        for (int i = 0; i < I; i++) act[i] = swiglu1(sg[i], su[i], limit);
        gemm_exact_w(w2s, 0, bf, act, I, 1, D, I, y, D);
        for (int d = 0; d < D; d++) ot[d] = acc[d] + y[d];
    }
}

void moe_decode(const float *x, const float *lgu, long lstride, const long *input_ids, const long *tid2eid,
                const float *bias, const float *w13, const float *w2, const float *w2s, int T, int D, int E, int I,
                int k, int sqrtsoftplus, float scaling, float limit, float *scratch, long *ids, float *ws, float *out) {
    moe_decode_w(x, lgu, lstride, input_ids, tid2eid, bias, w13, w2, w2s, 0, T, D, E, I, k, sqrtsoftplus, scaling,
                 limit, scratch, ids, ws, out);
}

/* A range of routed experts of `moe_decode_rows_w`, each over the rows that picked it; `scr` is this range's own
 * MOE_RANGE_FLOATS(T, k, D, I) floats (gathered rows, activations, outputs, row slots). An expert may be picked
 * by up to T*k rows, not T: a hash layer's tid2eid row may name one expert in several slots (transformers
 * initialises the table to zeros: every slot expert 0), and each slot then counts once, as in the reference. */
#define MOE_RANGE_FLOATS(T, k, D, I) ((long)(T) * (k) * (2L * (D) + 3L * (I) + 1))
typedef struct {
    const float *x;
    const void *w13, *w2;
    int bf, T, D, I, k, e0, e1;
    float limit;
    const long *ids;
    float *ys; /* [T, k, D]: token t's slot j output */
    float *scr;
} moe_range;

static void moe_experts(void *arg) {
    const moe_range *m = (const moe_range *)arg;
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
        gemm_exact_w(m->w13, (long)e * 2 * I * D, m->bf, xg, D, n, 2 * I, D, hg, 2 * I);
        for (int r = 0; r < n; r++)
            for (int i = 0; i < I; i++)
                ag[(long)r * I + i] = swiglu1(hg[(long)r * 2 * I + i], hg[(long)r * 2 * I + I + i], m->limit);
        gemm_exact_w(m->w2, (long)e * D * I, m->bf, ag, I, n, D, I, yg, D);
        for (int r = 0; r < n; r++)
            for (int d = 0; d < D; d++) m->ys[(long)rows[r] * D + d] = yg[(long)r * D + d];
    }
}

/* `moe_decode` for a verify step's few tokens with each routed expert's weights read once for every token that
 * picked it (the per-token loop reads them once per pick): routing as there, then per expert its tokens' rows
 * gathered and run through `gemm_exact`, the outputs kept per (token, slot) and summed per token in slot order,
 * then the shared term, so every output has `moe_decode`'s bits. With the helper thread (`pool_threads(2)`) the
 * experts are split in two ranges of about as many rows, one per thread (each expert's arithmetic unchanged).
 * Scratch: T*k longs ids, T*k floats ws, 2 * MOE_RANGE_FLOATS(T, k, D, I) + T*k*D floats fs
 * (`moe_rows_scratch_floats`). */
static void moe_decode_rows_w(const float *x, const float *lgu, long lstride, const long *input_ids,
                              const long *tid2eid, const float *bias, const void *w13, const void *w2,
                              const void *w2s, int bf, int T, int D, int E, int I, int k, int sqrtsoftplus,
                              float scaling, float limit, long *ids, float *ws, float *fs, float *out) {
    const long range_scr = MOE_RANGE_FLOATS(T, k, D, I);
    float *ys = fs + 2 * range_scr; /* [T, k, D] */
    for (int t = 0; t < T; t++) { /* routing, as `moe_decode` */
        route_token(lgu + (long)t * lstride, tid2eid != 0 ? tid2eid + input_ids[t] * k : 0, bias, E, k, sqrtsoftplus,
                    scaling, ids + (long)t * k, ws + (long)t * k);
    }
    moe_range mine = {x, w13, w2, bf, T, D, I, k, 0, E, limit, ids, ys, fs};
    /* The split: the first expert at which half of the T*k picks are behind. */
    int split = 0;
    for (long behind = 0; split < E && 2 * behind < (long)T * k; split++)
        for (long p = 0; p < (long)T * k; p++) behind += ids[p] == split;
    if (pool.threads >= 2 && split > 0 && split < E && (long)T * k * 3 * I * D >= POOL_MIN_MACS && pool_take()) {
        moe_range theirs = mine;
        mine.e1 = theirs.e0 = split;
        theirs.scr = fs + range_scr;
        pool_split(moe_experts, &theirs, moe_experts, &mine);
    } else {
        moe_experts(&mine);
    }
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
    gemm_exact_w(w2s, 0, bf, ag, I, T, D, I, yg, D);
    for (int t = 0; t < T; t++)
        for (int d = 0; d < D; d++) out[(long)t * D + d] = out[(long)t * D + d] + yg[(long)t * D + d];
}

/* The floats `moe_decode_rows` needs in fs (its Python wrapper sizes fs with this). */
long moe_rows_scratch_floats(int T, int k, int D, int I) {
    return 2 * MOE_RANGE_FLOATS(T, k, D, I) + (long)T * k * D;
}

void moe_decode_rows(const float *x, const float *lgu, long lstride, const long *input_ids, const long *tid2eid,
                     const float *bias, const float *w13, const float *w2, const float *w2s, int T, int D, int E,
                     int I, int k, int sqrtsoftplus, float scaling, float limit, long *ids, float *ws, float *fs,
                     float *out) {
    moe_decode_rows_w(x, lgu, lstride, input_ids, tid2eid, bias, w13, w2, w2s, 0, T, D, E, I, k, sqrtsoftplus,
                      scaling, limit, ids, ws, fs, out);
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
    const int K = W + V;
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
            const float *kv = win ? swa + win_rows[idx] * swa_stride : comp + comp_rows[idx] * comp_stride;
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
            for (int j = 0; j < K; j++) {
                if (sc[j] == 0.0f) continue;
                const int win = j < W;
                const long idx = (long)t * (win ? W : V) + (win ? j : j - W);
                const float *kv = win ? swa + win_rows[idx] * swa_stride : comp + comp_rows[idx] * comp_stride;
                const float p = sc[j] / z;
                for (int c = 0; c < d; c++) oh[c] += p * kv[c];
            }
        }
    }
}

/* `sink_attend`'s arguments, for a range of its rows. */
typedef struct {
    const float *q, *swa;
    long swa_stride;
    const long *win_rows;
    const unsigned char *win_valid;
    int W;
    const float *comp;
    long comp_stride;
    const long *comp_rows;
    const unsigned char *comp_valid;
    int V;
    const float *sink;
    float scale;
    int T, H, d;
    float *scratch, *out;
} attend_job;

static void attend_job_fn(void *arg) {
    const attend_job *a = (const attend_job *)arg;
    sink_attend(a->q, a->swa, a->swa_stride, a->win_rows, a->win_valid, a->W, a->comp, a->comp_stride, a->comp_rows,
                a->comp_valid, a->V, a->sink, a->scale, a->T, a->H, a->d, a->scratch, a->out);
}

/* `sink_attend` of a verify step's rows, the last half offered to the helper thread (each row's arithmetic
 * unchanged); `scratch2` holds the helper's H*(W+V) floats. */
static void sink_attend_rows(attend_job a, float *scratch2) {
    const int half = a.T / 2;
    if (pool.threads < 2 || half == 0 || !pool_take()) {
        attend_job_fn(&a);
        return;
    }
    attend_job b = a;
    const long hd = (long)half * a.H * a.d;
    b.q += hd;
    b.out += hd;
    b.win_rows += (long)half * a.W;
    b.win_valid += (long)half * a.W;
    if (a.V > 0) {
        b.comp_rows += (long)half * a.V;
        b.comp_valid += (long)half * a.V;
    }
    b.T = a.T - half;
    b.scratch = scratch2;
    a.T = half;
    pool_split(attend_job_fn, &b, attend_job_fn, &a);
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
static void attn_out_rows_w(const float *o, const float *cos, const float *sin, int T, int H, int d, int r,
                            const void *wo_a, int G, int L, const void *wo_b, int Dm, int bf, float *scratch,
                            float *out) {
    const int C = H * d / G;
    float *un = scratch, *mid = scratch + (long)T * H * d;
    for (int t = 0; t < T; t++)
        rope_rotate(o + (long)t * H * d, cos + (long)t * r, sin + (long)t * r, 1, H, d, r, -1.0f,
                    un + (long)t * H * d);
    for (int g = 0; g < G; g++)
        gemm_exact_w(wo_a, (long)g * L * C, bf, un + (long)g * C, H * d, T, L, C, mid + g * L, (long)G * L);
    gemm_exact_w(wo_b, 0, bf, mid, (long)G * L, T, Dm, G * L, out, Dm);
}

void attn_out_rows(const float *o, const float *cos, const float *sin, int T, int H, int d, int r, const float *wo_a,
                   int G, int L, const float *wo_b, int Dm, float *scratch, float *out) {
    attn_out_rows_w(o, cos, sin, T, H, d, r, wo_a, G, L, wo_b, Dm, 0, scratch, out);
}

/* ---- one whole decoder layer of a decode step ---------------------------------------------------------------- */



/* Slots of the arrays `decode_layer` reads. Keep in step with `pdspark.hardware.cpu.kernels.DECODE_*`. */
enum { /* the layer's weights (pointers, fixed once the weights are final) */
    W_ATTN_FN, W_ATTN_SCALE, W_ATTN_BASE, W_ATTN_NORM, W_FFN_FN, W_FFN_SCALE, W_FFN_BASE, W_FFN_NORM,
    W_X, W_Q_NORM, W_Q_B, W_KV_NORM, W_SINK, W_O_A, W_O_B, W_C_APE, W_C_NORM, W_I_Q_B, W_I_APE, W_I_NORM,
    W_MOE_IN, W_13, W_2, W_2S, W_BIAS, W_TID2EID, W_COUNT
};
enum { /* the layer's sizes */
    I_KIND, I_HC, I_ITERS, I_D, I_QL, I_H, I_HD, I_G, I_L, I_C_RATIO, I_C_DIM, I_I_HEADS, I_I_DIM, I_I_TOPK,
    I_E, I_INTER, I_K, I_SQRTSP, I_BF16, I_COUNT /* I_BF16: the projections are bf16 bits (`gemm_exact_h`) */
};
enum { /* the layer's scalars */
    F_HC_EPS, F_HC_NORM_EPS, F_ATTN_NORM_EPS, F_FFN_NORM_EPS, F_Q_EPS, F_HEAD_EPS, F_KV_EPS, F_SCALE, F_C_EPS,
    F_I_EPS, F_I_WSCALE, F_I_SCALE, F_SCALING, F_LIMIT, F_COUNT
};
enum { /* the step's indices (pointers, shared by every layer) */
    S_POS, S_IDS, S_SLOTS, S_WIN_ROWS, S_WIN_VALID, S_CSA_ROWS, S_CSA_VALID, S_HCA_ROWS, S_HCA_VALID,
    S_COS_MAIN, S_SIN_MAIN, S_COS_COMP, S_SIN_COMP, S_TAB_COS, S_TAB_SIN,
    S_CP_OUT, S_CP_POS, S_CP_USE, S_CP_CUR, S_CP_HIST, S_CP_WTOK, S_CP_WROW,
    S_HP_OUT, S_HP_POS, S_HP_USE, S_HP_CUR, S_HP_HIST, S_HP_WTOK, S_HP_WROW, S_COUNT
};
enum { SI_T, SI_W, SI_R, SI_V_CSA, SI_V_HCA, SI_G_CSA, SI_N_CSA, SI_G_HCA, SI_N_HCA, SI_COUNT };
enum { /* the layer's pools: pointer, row stride (floats) */
    P_SWA, P_SWA_STRIDE, P_COMP, P_COMP_STRIDE, P_STATE, P_STATE_STRIDE, P_IDX, P_IDX_STRIDE, P_IDX_STATE,
    P_IDX_STATE_STRIDE, P_COUNT
};
enum { KIND_SLIDING, KIND_CSA, KIND_HCA };

#define PTR(a, i) ((const float *)(a)[i])
#define LPTR(a, i) ((const long *)(a)[i])
#define BPTR(a, i) ((const unsigned char *)(a)[i])

/* A bump allocator over the caller's scratch (floats). */
static float *take(float **at, long n) {
    float *p = *at;
    *at += (n + 15) & ~15L;
    return p;
}

/* The floats `decode_layer` carves from its scratch (each `take` below, rounded as `take` rounds) for T tokens,
 * at most V visible compressed entries and a window of W, given the layer's sizes wi: the one formula Python sizes
 * the scratch with (`kernels.decode_layer_scratch_floats`) and `decode_layers` checks against. Keep it in step with
 * the takes of `decode_layer`. */
static long r16(long n) { return (n + 15) & ~15L; }

long decode_layer_scratch_floats(const int *wi, int T, int V, int W) {
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
            n += 2 * r16(t * Hi * Di) + r16(t * Hi) + r16(2L * V) + r16((t * V + 3) / 4);
    }
    n += r16(2 * ((long)H * (W + V) + 16)) + r16(t * (H * HD + wi[I_G] * wi[I_L])) + r16(t * (E + 2 * I));
    if (T == 1) n += r16(3L * I + 2L * D + K);
    else n += r16(2 * t * K) + r16(t * K) + r16(moe_rows_scratch_floats(T, K, D, I));
    return n;
}

/* `DecoderLayer.forward` for a few decode tokens that gather their own windows (no dense segments): the mHC
 * collapse (with the sublayer norm), the fused x projection, the queries, the raw latent written to its SWA rows,
 * the compressors and the CSA indexer's pick, the sink attention read from the pools, the output projection, the
 * expand; then the FFN collapse, the MoE and the expand. The same steps, in the same order, as the separate calls
 * (BLAS matmuls become `dot` GEMVs). h and h_out [T, hc, D]. scratch: see `kernels.decode_scratch_floats`. */
static void decode_layer_run(const long *wp, const int *wi, const float *wf, const long *sp, const int *si,
                             const long *pp, const float *h, float *h_out, float *scratch, long *ids_buf) {
    const int T = si[SI_T], W = si[SI_W], r = si[SI_R];
    const int kind = wi[I_KIND], hc = wi[I_HC], D = wi[I_D], QL = wi[I_QL], H = wi[I_H], HD = wi[I_HD];
    const int cdim = wi[I_C_DIM], cw = kind == KIND_CSA ? 2 * cdim : cdim; /* compressor width (coff * dim) */
    const int Hi = wi[I_I_HEADS], Di = wi[I_I_DIM], iw = 2 * Di;
    const int E = wi[I_E], I = wi[I_INTER], K = wi[I_K], bf = wi[I_BF16];
    const int NX = QL + HD + (kind != KIND_SLIDING ? 2 * cw : 0) + (kind == KIND_CSA ? 2 * iw + Hi : 0);
    const int M = (2 + hc) * hc;
    const float *cos = kind == KIND_SLIDING ? PTR(sp, S_COS_MAIN) : PTR(sp, S_COS_COMP);
    const float *sin = kind == KIND_SLIDING ? PTR(sp, S_SIN_MAIN) : PTR(sp, S_SIN_COMP);
    float *at = scratch;
    float *x = take(&at, (long)T * D), *pre = take(&at, (long)T * hc), *post = take(&at, (long)T * hc);
    float *comb = take(&at, (long)T * hc * hc), *cscr = take(&at, (long)T * (hc * D + M));
    float *xp = take(&at, (long)T * NX), *qr = take(&at, (long)T * QL), *qh = take(&at, (long)T * H * HD);
    float *q = take(&at, (long)T * H * HD), *o = take(&at, (long)T * H * HD), *y = take(&at, (long)T * D);
    float *hm = take(&at, (long)T * hc * D), *small = take(&at, 4L * (HD > 3 * Di ? HD : 3 * Di) + 64);

    /* attention sublayer */
    hc_collapse(h, PTR(wp, W_ATTN_FN), PTR(wp, W_ATTN_SCALE), PTR(wp, W_ATTN_BASE), T, hc, D, wi[I_ITERS],
                wf[F_HC_EPS], wf[F_HC_NORM_EPS], cscr, x, pre, post, comb, PTR(wp, W_ATTN_NORM), wf[F_ATTN_NORM_EPS]);
    gemm_exact_w(PTR(wp, W_X), 0, bf, x, D, T, NX, D, xp, NX);
    rms_norm(xp, NX, PTR(wp, W_Q_NORM), T, QL, wf[F_Q_EPS], qr);
    gemm_exact_w(PTR(wp, W_Q_B), 0, bf, qr, QL, T, H * HD, QL, qh, H * HD);
    norm_rope(qh, HD, 0, T * H, H, HD, wf[F_HEAD_EPS], cos, sin, r, q, 0, 0, small);
    norm_rope(xp + QL, NX, PTR(wp, W_KV_NORM), T, 1, HD, wf[F_KV_EPS], cos, sin, r, (float *)pp[P_SWA],
              LPTR(sp, S_SLOTS), pp[P_SWA_STRIDE], small);
    const float *comp = 0;
    const long *comp_rows = 0;
    const unsigned char *comp_valid = 0;
    int V = 0;
    if (kind != KIND_SLIDING) {
        const int csa = kind == KIND_CSA;
        const int p0 = csa ? S_CP_OUT : S_HP_OUT;
        float *rows = take(&at, (long)T * 2 * (cw > iw ? cw : iw));
        compressor_run(xp + QL + HD, NX, LPTR(sp, S_POS), T, PTR(wp, W_C_APE), wi[I_C_RATIO], cdim, csa,
                       si[csa ? SI_G_CSA : SI_G_HCA], LPTR(sp, p0), LPTR(sp, p0 + 1), BPTR(sp, p0 + 2),
                       LPTR(sp, p0 + 3), LPTR(sp, p0 + 4), si[csa ? SI_N_CSA : SI_N_HCA], LPTR(sp, p0 + 5),
                       LPTR(sp, p0 + 6), PTR(wp, W_C_NORM), wf[F_C_EPS], PTR(sp, S_TAB_COS), PTR(sp, S_TAB_SIN), r,
                       rows, (float *)pp[P_STATE], pp[P_STATE_STRIDE], (float *)pp[P_COMP], pp[P_COMP_STRIDE], small);
        comp = (const float *)pp[P_COMP];
        if (csa) {
            compressor_run(xp + QL + HD + 2 * cw, NX, LPTR(sp, S_POS), T, PTR(wp, W_I_APE), wi[I_C_RATIO], Di, 1,
                           si[SI_G_CSA], LPTR(sp, S_CP_OUT), LPTR(sp, S_CP_POS), BPTR(sp, S_CP_USE),
                           LPTR(sp, S_CP_CUR), LPTR(sp, S_CP_HIST), si[SI_N_CSA], LPTR(sp, S_CP_WTOK),
                           LPTR(sp, S_CP_WROW), PTR(wp, W_I_NORM), wf[F_I_EPS], PTR(sp, S_TAB_COS),
                           PTR(sp, S_TAB_SIN), r, rows, (float *)pp[P_IDX_STATE], pp[P_IDX_STATE_STRIDE],
                           (float *)pp[P_IDX], pp[P_IDX_STRIDE], small);
            V = si[SI_V_CSA];
            comp_rows = LPTR(sp, S_CSA_ROWS);
            comp_valid = BPTR(sp, S_CSA_VALID);
            if (V > wi[I_I_TOPK]) { /* the indexer picks; otherwise every visible entry */
                float *iq = take(&at, (long)T * Hi * Di), *iqr = take(&at, (long)T * Hi * Di);
                float *iwt = take(&at, (long)T * Hi), *isc = take(&at, 2L * V);
                unsigned char *picked = (unsigned char *)take(&at, ((long)T * V + 3) / 4);
                gemm_exact_w(PTR(wp, W_I_Q_B), 0, bf, qr, QL, T, Hi * Di, QL, iq, Hi * Di);
                for (int t = 0; t < T; t++) {
                    const float *hw = xp + (long)t * NX + QL + HD + 2 * cw + 2 * iw;
                    for (int j = 0; j < Hi; j++) iwt[t * Hi + j] = hw[j] * wf[F_I_WSCALE];
                }
                rope_rotate(iq, cos, sin, T, Hi, Di, r, 1.0f, iqr);
                index_pick(iqr, iwt, (const float *)pp[P_IDX], pp[P_IDX_STRIDE], comp_rows, comp_valid, T, Hi, V,
                           Di, wf[F_I_SCALE], wi[I_I_TOPK], isc, picked);
                comp_valid = picked;
            }
        } else {
            V = si[SI_V_HCA];
            comp_rows = LPTR(sp, S_HCA_ROWS);
            comp_valid = BPTR(sp, S_HCA_VALID);
        }
        if (V == 0) comp = 0;
    }
    const long ascr_n = (long)H * (W + V) + 16;
    float *ascr = take(&at, 2 * ascr_n); /* this thread's and the helper's */
    sink_attend_rows((attend_job){q, (const float *)pp[P_SWA], pp[P_SWA_STRIDE], LPTR(sp, S_WIN_ROWS),
                                  BPTR(sp, S_WIN_VALID), W, comp, pp[P_COMP_STRIDE], comp_rows, comp_valid, V,
                                  PTR(wp, W_SINK), wf[F_SCALE], T, H, HD, ascr, o},
                     ascr + ascr_n);
    float *oscr = take(&at, (long)T * (H * HD + wi[I_G] * wi[I_L]));
    attn_out_rows_w(o, cos, sin, T, H, HD, r, PTR(wp, W_O_A), wi[I_G], wi[I_L], PTR(wp, W_O_B), D, bf, oscr, y);
    hc_expand(y, h, post, comb, T, hc, D, hm);

    /* FFN sublayer */
    hc_collapse(hm, PTR(wp, W_FFN_FN), PTR(wp, W_FFN_SCALE), PTR(wp, W_FFN_BASE), T, hc, D, wi[I_ITERS],
                wf[F_HC_EPS], wf[F_HC_NORM_EPS], cscr, x, pre, post, comb, PTR(wp, W_FFN_NORM), wf[F_FFN_NORM_EPS]);
    float *lgu = take(&at, (long)T * (E + 2 * I));
    gemm_exact_w(PTR(wp, W_MOE_IN), 0, bf, x, D, T, E + 2 * I, D, lgu, E + 2 * I);
    if (T == 1) {
        float *mscr = take(&at, 3L * I + 2L * D + K);
        moe_decode_w(x, lgu, E + 2 * I, LPTR(sp, S_IDS), LPTR(wp, W_TID2EID), PTR(wp, W_BIAS), PTR(wp, W_13),
                     PTR(wp, W_2), PTR(wp, W_2S), bf, T, D, E, I, K, wi[I_SQRTSP], wf[F_SCALING], wf[F_LIMIT], mscr,
                   ids_buf, mscr + 3 * I + 2 * D, y);
    } else { /* ids: T*K longs (as many floats again), ws: T*K floats, then the grouped scratch */
        long *gids = (long *)take(&at, 2L * T * K);
        float *gws = take(&at, (long)T * K), *gscr = take(&at, moe_rows_scratch_floats(T, K, D, I));
        moe_decode_rows_w(x, lgu, E + 2 * I, LPTR(sp, S_IDS), LPTR(wp, W_TID2EID), PTR(wp, W_BIAS), PTR(wp, W_13),
                          PTR(wp, W_2), PTR(wp, W_2S), bf, T, D, E, I, K, wi[I_SQRTSP], wf[F_SCALING], wf[F_LIMIT],
                          gids, gws, gscr, y);
    }
    hc_expand(y, hm, post, comb, T, hc, D, h_out);
}

/* `decode_layer_run` when its scratch (scratch_n floats) holds what it carves; else -1, nothing done. */
int decode_layer(const long *wp, const int *wi, const float *wf, const long *sp, const int *si, const long *pp,
                 const float *h, float *h_out, float *scratch, long scratch_n, long *ids_buf) {
    const int V = si[SI_V_CSA] > si[SI_V_HCA] ? si[SI_V_CSA] : si[SI_V_HCA];
    if (decode_layer_scratch_floats(wi, si[SI_T], V, si[SI_W]) > scratch_n) return -1;
    decode_layer_run(wp, wi, wf, sp, si, pp, h, h_out, scratch, ids_buf);
    return 0;
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

/* ---- a DSpark draft block (`model.draft_step`): every stage and the head of one proposal in one call ---------- */

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
 * with one rounding per multiply-add (the draft's logits need not match BLAS bit for bit; see model.draft_step).
 * Instantiated for fp32 weights (`gemm_rows`) and bf16 bits (`gemm_rows_h`: each 8-lane load widens 8 values
 * exactly, so every multiply-add is the fp32 instance's on the same numbers). */
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
            for (int t = 0; t < T; t += 2) {                                                                        \
                const int two = t + 1 < T;                                                                          \
                const float *x0 = x + (long)t * xs, *x1 = x + (long)(t + two) * xs;                                 \
                __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00,            \
                       a30 = a00, a31 = a00;                                                                        \
                for (int k = 0; k < K8; k += 8) {                                                                   \
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

static void gemm_rows_alone(const gemm_job *j) {
    if (j->bf)
        gemm_rows_h((const bf16_t *)j->w, j->x, j->xs, j->T, j->N, j->K, j->out, j->os);
    else
        gemm_rows((const float *)j->w, j->x, j->xs, j->T, j->N, j->K, j->out, j->os);
}

/* `gemm_rows` of the weights at element `off` of w: fp32 (bf = 0) or bf16 bits (bf = 1), shared with the helper
 * thread when it is worth it. */
static void gemm_rows_w(const void *w, long off, int bf, const float *x, long xs, int T, int N, int K, float *out,
                        long os) {
    gemm_pooled((gemm_job){weights_at(w, bf, off), bf, 1, x, xs, T, N, K, out, os});
}

/* Slots of `draft_block`'s arrays. Keep in step with `pdspark.hardware.cpu.kernels.DRAFT_*`. */
enum { /* one stage's weights (the table holds S of these, then the DH_* head slots) */
    DW_ATTN_FN, DW_ATTN_SCALE, DW_ATTN_BASE, DW_ATTN_NORM, DW_FFN_FN, DW_FFN_SCALE, DW_FFN_BASE, DW_FFN_NORM,
    DW_X, DW_Q_NORM, DW_Q_B, DW_KV_NORM, DW_SINK, DW_O_A, DW_O_B, DW_GATE_UP, DW_DOWN, DW_COUNT
};
enum { DH_EMBED, DH_HC_FN, DH_HC_SCALE, DH_HC_BASE, DH_NORM, DH_HEAD, DH_COS, DH_SIN, DH_MAIN_PROJ, DH_MAIN_NORM,
       DH_LATENTS, DH_COUNT };
enum { DI_STAGES, DI_GAMMA, DI_MASK, DI_HC, DI_ITERS, DI_D, DI_QL, DI_H, DI_HD, DI_G, DI_L, DI_INTER, DI_V, DI_R,
       DI_FEATURES, DI_BF16, DI_COUNT }; /* DI_BF16: the matrices (not the embedding) are bf16 bits */
enum { DF_HC_EPS, DF_HC_NORM_EPS, DF_ATTN_NORM_EPS, DF_FFN_NORM_EPS, DF_Q_EPS, DF_HEAD_EPS, DF_KV_EPS, DF_SCALE,
       DF_LIMIT, DF_HEAD_HC_EPS, DF_HEAD_NORM_EPS, DF_NORM_EPS, DF_MAIN_NORM_EPS, DF_COUNT };

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

/* ---- decode-index: a small step's indices and its layers without Python in between --------------------------- */

/* Slots of the step layout `decode_index` reads. Keep in step with `pdspark.hardware.cpu.kernels.DECODE_LAYOUT`. */
enum {
    L_RTT, L_RTT_STRIDE, L_RTC, L_RTC_STRIDE, L_F2S, L_PAGE, L_WINDOW, L_CSA_RATIO, L_HCA_RATIO, L_C128_PAGE,
    L_CSA_RING, L_HCA_RING, L_SWA_DUMMY_PAGE, L_SWA_DUMMY_SLOT, L_C4_DUMMY, L_C128_DUMMY, L_C4_STATE_DUMMY,
    L_C128_STATE_DUMMY, L_COS_MAIN, L_SIN_MAIN, L_COS_COMP, L_SIN_COMP, L_ROPE_DIM, L_COUNT
};
#define INDEX_MAX_TOKENS 64

/* Page-scoped CSA state row of a position (`StateRings.c4_rows`): its SWA page's ring, the dummy row where the
 * page was released. */
static long c4_state_row(const long *L, long full, long pos) {
    const long page = ((const long *)L[L_F2S])[full / L[L_PAGE]];
    return page == L[L_SWA_DUMMY_PAGE] ? L[L_C4_STATE_DUMMY] : page * L[L_CSA_RING] + pos % L[L_CSA_RING];
}

/* One compressor kind's plan (`engine.forward_batch._csa_plan` / `_hca_plan`): the closing groups of the step's
 * tokens with their source columns, and the token rows whose state must persist. Writes the plan's seven arrays
 * (slots p0 .. p0+6 of sp) and returns the group count in *groups, the write count in *writes. */
static void plan(const long *L, const long *sp, int p0, int csa, int T, const long *tslot, const long *pos,
                 const long *tstart, const long *tend, int *groups, int *writes) {
    const long *rtt = (const long *)L[L_RTT], rs = L[L_RTT_STRIDE], P = L[L_PAGE];
    const long R = csa ? L[L_CSA_RATIO] : L[L_HCA_RATIO], span = csa ? 2 * R : R;
    long *out_rows = (long *)sp[p0], *gpos = (long *)sp[p0 + 1], *cur = (long *)sp[p0 + 3];
    long *hist = (long *)sp[p0 + 4], *wtok = (long *)sp[p0 + 5], *wrow = (long *)sp[p0 + 6];
    unsigned char *use = (unsigned char *)sp[p0 + 2];
    int G = 0, N = 0;
    for (int t = 0; t < T; t++) {
        const long p = pos[t], s = tslot[t];
        if ((p + 1) % R != 0) continue;
        const long gs = (p / R) * R, first = csa ? gs - R : gs;
        if (csa) {
            out_rows[G] = rtt[s * rs + gs] / R;
        } else {
            const long g = gs / R, cps = L[L_C128_PAGE];
            out_rows[G] = ((const long *)L[L_RTC])[s * L[L_RTC_STRIDE] + g / cps] * cps + g % cps;
        }
        gpos[G] = gs;
        for (long j = 0; j < span; j++) {
            const long q = first + j, k = G * span + j;
            const int u = q >= tstart[t];
            use[k] = (unsigned char)u;
            cur[k] = u ? t - (p - q) : 0;
            if (csa)
                hist[k] = q >= 0 && !u ? c4_state_row(L, rtt[s * rs + q], q) : L[L_C4_STATE_DUMMY];
            else
                hist[k] = !u ? s * L[L_HCA_RING] + q % L[L_HCA_RING] : L[L_C128_STATE_DUMMY];
        }
        G++;
    }
    for (int t = 0; t < T; t++) {
        const long p = pos[t], s = tslot[t];
        long keep;
        int w;
        if (csa) { /* the overlap group before the chunk's start, and every page's last group */
            keep = (tstart[t] / R) * R - R;
            if (tend[t] - L[L_CSA_RING] > keep) keep = tend[t] - L[L_CSA_RING];
            w = p >= keep || p % P >= P - R;
        } else {
            keep = (tstart[t] / R) * R;
            if (tend[t] - L[L_HCA_RING] > keep) keep = tend[t] - L[L_HCA_RING];
            w = p >= keep;
        }
        if (!w) continue;
        wtok[N] = t;
        wrow[N] = csa ? c4_state_row(L, rtt[s * rs + p], p) : s * L[L_HCA_RING] + p % L[L_HCA_RING];
        N++;
    }
    *groups = G, *writes = N;
}

/* Every index of a small step of short chunks (`engine.forward_batch.build_forward_batch` without dense segments)
 * straight from the page tables, into the arrays the step table sp points to (`kernels.DECODE_STEP`), plus the
 * step's rotary rows; si receives the step sizes (`kernels.DECODE_STEP_SIZES`).
 * req: [n, then (slot, start, length) per chunk, then every chunk's token ids]. L: `kernels.DECODE_LAYOUT`.
 * Returns the token count, or -1 past INDEX_MAX_TOKENS. */
int decode_index(const long *req, const long *L, const long *sp, int *si) {
    const long n = req[0], *ids = req + 1 + 3 * n;
    const long *rtt = (const long *)L[L_RTT], rs = L[L_RTT_STRIDE], *f2s = (const long *)L[L_F2S];
    const long P = L[L_PAGE], W = L[L_WINDOW];
    const int r = (int)L[L_ROPE_DIM];
    long tslot[INDEX_MAX_TOKENS], tstart[INDEX_MAX_TOKENS], tend[INDEX_MAX_TOKENS];
    long *pos = (long *)sp[S_POS], *tid = (long *)sp[S_IDS], *slots = (long *)sp[S_SLOTS];
    int T = 0;
    for (long c = 0; c < n; c++) {
        const long slot = req[1 + 3 * c], start = req[2 + 3 * c], len = req[3 + 3 * c];
        if (T + len > INDEX_MAX_TOKENS) return -1;
        for (long j = 0; j < len; j++, T++) {
            tslot[T] = slot, tstart[T] = start, tend[T] = start + len;
            pos[T] = start + j;
            tid[T] = ids[T];
        }
    }
    long *wrows = (long *)sp[S_WIN_ROWS];
    unsigned char *wvalid = (unsigned char *)sp[S_WIN_VALID];
    for (int t = 0; t < T; t++) {
        const long s = tslot[t], p = pos[t], full = rtt[s * rs + p];
        slots[t] = f2s[full / P] * P + full % P;
        for (long j = 0; j < W; j++) { /* positions p-W+1 .. p, oldest first */
            const long q = p - (W - 1) + j;
            const long f = q >= 0 ? rtt[s * rs + q] : 0;
            wvalid[t * W + j] = (unsigned char)(q >= 0);
            wrows[t * W + j] = q >= 0 ? f2s[f / P] * P + f % P : L[L_SWA_DUMMY_SLOT];
        }
        const float *tabs[4] = {(const float *)L[L_COS_MAIN], (const float *)L[L_SIN_MAIN],
                                (const float *)L[L_COS_COMP], (const float *)L[L_SIN_COMP]};
        const int outs[4] = {S_COS_MAIN, S_SIN_MAIN, S_COS_COMP, S_SIN_COMP};
        for (int k = 0; k < 4; k++)
            for (int d = 0; d < r; d++) ((float *)sp[outs[k]])[(long)t * r + d] = tabs[k][p * r + d];
    }
    for (int k = 0; k < SI_COUNT; k++) si[k] = 0;
    si[SI_T] = T, si[SI_W] = (int)W, si[SI_R] = r;
    for (int csa = 1; csa >= 0; csa--) {
        const long R = csa ? L[L_CSA_RATIO] : L[L_HCA_RATIO];
        if (R == 0) continue; /* no layer of this kind */
        long V = 0;
        for (int t = 0; t < T; t++)
            if ((pos[t] + 1) / R > V) V = (pos[t] + 1) / R;
        long *rows = (long *)sp[csa ? S_CSA_ROWS : S_HCA_ROWS];
        unsigned char *valid = (unsigned char *)sp[csa ? S_CSA_VALID : S_HCA_VALID];
        const long cps = L[L_C128_PAGE];
        for (int t = 0; t < T; t++) {
            const long visible = (pos[t] + 1) / R, s = tslot[t];
            for (long g = 0; g < V; g++) {
                const int v = g < visible;
                valid[t * V + g] = (unsigned char)v;
                if (csa) /* pages are multiples of R: the group's first position gives its C4 row */
                    rows[t * V + g] = v ? rtt[s * rs + g * R] / R : L[L_C4_DUMMY];
                else
                    rows[t * V + g] = v ? ((const long *)L[L_RTC])[s * L[L_RTC_STRIDE] + g / cps] * cps + g % cps
                                        : L[L_C128_DUMMY];
            }
        }
        si[csa ? SI_V_CSA : SI_V_HCA] = (int)V;
        plan(L, sp, csa ? S_CP_OUT : S_HP_OUT, csa, T, tslot, pos, tstart, tend, &si[csa ? SI_G_CSA : SI_G_HCA],
             &si[csa ? SI_N_CSA : SI_N_HCA]);
    }
    return T;
}

/* Every layer of a small step after `decode_index`: the token embeddings copied into each of the hc streams of h0
 * [T, hc, D], then layer l reads one buffer and writes the other. tables [n, 4]: each layer's weights, sizes,
 * scalars and pools arrays (`decode_layer`'s first and sixth arguments). Returns the buffer holding the result
 * (0: h0, 1: h1), or -1 (nothing done) when some layer's scratch exceeds scratch_n floats.
 * Drafter features (a DSpark verify step): where capture != NULL and capture[l] = c >= 0, layer l's output streams
 * averaged over hc go to columns [c * D, (c + 1) * D) of features [T, F] (F floats a row), as `DSV4Model.forward`'s
 * `h.mean(dim=1)`: the streams summed in order, then divided by hc (the bits of ATen's CPU mean). */
int decode_layers(int n, const long *tables, const long *sp, const int *si, const float *embed, int hc, int D,
                  float *h0, float *h1, float *scratch, long scratch_n, long *ids_buf, const int *capture,
                  float *features, int F) {
    const int T = si[SI_T];
    const int V = si[SI_V_CSA] > si[SI_V_HCA] ? si[SI_V_CSA] : si[SI_V_HCA];
    for (int l = 0; l < n; l++) /* every layer's scratch fits, before anything is written */
        if (decode_layer_scratch_floats((const int *)tables[4L * l + 1], T, V, si[SI_W]) > scratch_n) return -1;
    const long *ids = (const long *)sp[S_IDS];
    for (int t = 0; t < T; t++)
        for (int i = 0; i < hc; i++) {
            const float *e = embed + ids[t] * (long)D;
            float *o = h0 + ((long)t * hc + i) * D;
            for (int d = 0; d < D; d++) o[d] = e[d];
        }
    float *bufs[2] = {h0, h1};
    for (int l = 0; l < n; l++) {
        const long *tb = tables + 4L * l;
        decode_layer_run((const long *)tb[0], (const int *)tb[1], (const float *)tb[2], sp, si, (const long *)tb[3],
                         bufs[l % 2], bufs[(l + 1) % 2], scratch, ids_buf);
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


/* The library's contract with its Python caller: the slot counts of every array it reads, the limits of its
 * fixed-size buffers and the layer kinds, in the order of `pdspark.hardware.cpu.kernels.ABI`. Python compares them
 * with its own tuples when it loads the library and refuses a library that disagrees (a slot added on one side
 * only would read or write the wrong word). Writes at most n values; returns how many there are. */
int pdspark_abi(long *out, int n) {
    const long abi[] = {W_COUNT,  I_COUNT,  F_COUNT,   S_COUNT,  SI_COUNT,     P_COUNT,  L_COUNT,
                        DW_COUNT, DH_COUNT, DI_COUNT,  DF_COUNT, INDEX_MAX_TOKENS,
                        KIND_SLIDING, KIND_CSA, KIND_HCA};
    const int count = (int)(sizeof(abi) / sizeof(abi[0]));
    for (int i = 0; i < count && i < n; i++) out[i] = abi[i];
    return count;
}
