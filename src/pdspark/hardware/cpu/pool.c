/* pdspark CPU kernels, pool.c: the helper threads that share a step's big GEMMs, and the GEMM entry points the
 * other parts call (`gemm_exact_w`, `gemm_rows_w`), which offer it work. */
#include "kernels.h"

/* Helper threads for a step's weight GEMMs (`pool_threads(n)`: the caller and n - 1 helpers; 1, the default:
 * none). A job is a number of independent parts (`pool_parts`): the caller and the helpers claim parts one at a time
 * from a shared counter and compute each claimed part whole, so a part's arithmetic does not depend on the thread or
 * the split, and the caller takes every part no helper has claimed by the time it is free (a sleeping helper never
 * makes a job slower than the caller alone). A GEMM big enough (`POOL_MIN_MACS`) splits its output rows into up to
 * n parts (`gemm_pooled`), as do the compact GEMMs (compact.c), the indexer and a verify step's attention rows
 * (ops.c, each part with its own scratch); at 2 threads a multi-row step's expert ranges split in two
 * (`pool_split`). Helpers spin `POOL_SPIN_NS` for the next job (a step's GEMMs come microseconds apart), then sleep
 * on a condition variable. One caller at a time: a job that finds the pool taken (two engines of one process
 * stepping at once) runs alone. A forked child starts with no helper (threads are not
 * copied) and makes new ones when it needs them.
 *
 * The claim word holds (generation, parts, next part) in one atomic 64-bit value, so a helper claims a part of the
 * job it read, never of a job published after its read: it reads the job's function only after its claim, and the
 * caller publishes no new job before every claimed part is done. */
#define POOL_MIN_MACS (1L << 16)
#define POOL_SPIN_NS 200000L
#define POOL_MAX_THREADS 64
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
    int threads;                   /* wanted: 1 .. POOL_MAX_THREADS (set by `pool_threads`) */
    int started;                   /* helper threads made */
    atomic_int busy;               /* a caller owns the pool */
    atomic_ullong work;            /* the claim word: generation << 32 | parts << 16 | next part */
    atomic_int done;               /* parts of the current job finished by helpers */
    atomic_int sleeping;           /* helpers waiting on `cv` */
    void (*fn)(void *, int, int); /* the job: fn(arg, part, parts) */
    void *arg;
    pthread_mutex_t mu;
    pthread_cond_t cv;
} pool = {1, 0, 0, 0, 0, 0, 0, 0, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER};

static inline unsigned long long work_word(unsigned long long gen, int parts, int next) {
    return gen << 32 | (unsigned long long)parts << 16 | (unsigned long long)next;
}
static inline unsigned long long work_gen(unsigned long long w) { return w >> 32; }
static inline int work_parts(unsigned long long w) { return (int)((w >> 16) & 0xFFFF); }
static inline int work_next(unsigned long long w) { return (int)(w & 0xFFFF); }

/* Claim the next part of generation gen (-1: none left, or another job is published). */
static int pool_claim(unsigned long long gen) {
    unsigned long long w = atomic_load(&pool.work);
    while (work_gen(w) == gen && work_next(w) < work_parts(w))
        if (atomic_compare_exchange_weak(&pool.work, &w, w + 1)) return work_next(w);
    return -1;
}

static long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

static void *pool_helper(void *arg) {
    unsigned long long seen = (unsigned long long)(uintptr_t)arg; /* the generation current when it was made */
    for (;;) {
        const long until = now_ns() + POOL_SPIN_NS;
        for (int i = 0; work_gen(atomic_load(&pool.work)) == seen; i++) {
            CPU_RELAX();
            if ((i & 63) == 63 && now_ns() > until) break;
        }
        if (work_gen(atomic_load(&pool.work)) == seen) {
            pthread_mutex_lock(&pool.mu);
            atomic_fetch_add(&pool.sleeping, 1);
            while (work_gen(atomic_load(&pool.work)) == seen) pthread_cond_wait(&pool.cv, &pool.mu);
            atomic_fetch_sub(&pool.sleeping, 1);
            pthread_mutex_unlock(&pool.mu);
        }
        seen = work_gen(atomic_load(&pool.work));
        for (int part; (part = pool_claim(seen)) >= 0;) { /* the job is `seen`'s while a part of it is unfinished */
            pool.fn(pool.arg, part, work_parts(atomic_load(&pool.work)));
            atomic_fetch_add(&pool.done, 1);
        }
    }
    return 0;
}

static void pool_after_fork(void) { /* in the child: no helper thread, fresh locks, no open job */
    pool.started = 0;
    const unsigned long long w = atomic_load(&pool.work);
    atomic_store(&pool.work, work_word(work_gen(w), 0, 0));
    atomic_store(&pool.done, 0);
    atomic_store(&pool.busy, 0);
    atomic_store(&pool.sleeping, 0);
    pthread_mutex_init(&pool.mu, 0);
    pthread_cond_init(&pool.cv, 0);
}

/* Use `n` threads (the caller and n - 1 helpers, at most POOL_MAX_THREADS) for the weight GEMMs from now on. */
void pool_threads(int n) { pool.threads = n < 1 ? 1 : n > POOL_MAX_THREADS ? POOL_MAX_THREADS : n; }

/* Take the pool for one job, with its helpers made (0: taken by another caller, or no helper could be made). */
static int pool_take(void) {
    int idle = 0;
    if (!atomic_compare_exchange_strong(&pool.busy, &idle, 1)) return 0;
    static int at_fork;
    if (!at_fork) at_fork = pthread_atfork(0, 0, pool_after_fork) == 0;
    while (pool.started < pool.threads - 1) {
        pthread_t t;
        const uintptr_t gen = (uintptr_t)work_gen(atomic_load(&pool.work));
        if (pthread_create(&t, 0, pool_helper, (void *)gen) != 0) break;
        pthread_detach(t);
        pool.started++;
    }
    if (pool.started == 0) {
        atomic_store(&pool.busy, 0);
        return 0;
    }
    return 1;
}

/* Part `part` of `parts` of [0, n) in whole blocks of `align` (the last part ends at n): [*lo, *hi), empty when
 * there are fewer blocks than parts. The users' part functions all split their range this way. */
static void part_range(int n, int align, int part, int parts, int *lo, int *hi) {
    const long blocks = (n + align - 1) / align;
    *lo = (int)(blocks * part / parts) * align;
    *hi = part + 1 == parts ? n : (int)(blocks * (part + 1) / parts) * align;
}

/* With the pool taken (`pool_take`): fn(arg, part, parts) for every part in [0, parts), parts <= 65535, on this
 * thread and the helpers, whoever claims each first; the pool is free again on return. The parts must write
 * disjoint memory. */
static void pool_parts(void (*fn)(void *, int, int), void *arg, int parts) {
    pool.fn = fn;
    pool.arg = arg;
    atomic_store(&pool.done, 0);
    const unsigned long long gen = work_gen(atomic_load(&pool.work)) + 1;
    atomic_store(&pool.work, work_word(gen, parts, 0));
    if (atomic_load(&pool.sleeping)) { /* wake as many as the job has parts for (more would only spin) */
        pthread_mutex_lock(&pool.mu);
        for (int i = 1; i < parts; i++) pthread_cond_signal(&pool.cv);
        pthread_mutex_unlock(&pool.mu);
    }
    int mine = 0;
    for (int part; (part = pool_claim(gen)) >= 0; mine++) fn(arg, part, parts);
    while (atomic_load(&pool.done) != parts - mine) CPU_RELAX();
    atomic_store(&pool.busy, 0);
}

/* Two jobs of one split: part 0 `mine`, part 1 `theirs`. */
typedef struct {
    void (*fn[2])(void *);
    void *arg[2];
} split_job;

static void split_part(void *arg, int part, int parts) {
    (void)parts;
    const split_job *j = (const split_job *)arg;
    j->fn[part](j->arg[part]);
}

/* With the pool taken (`pool_take`): fn(arg) and mine(mine_arg), on this thread and a helper; the pool is free
 * again on return. Both must write disjoint memory. */
static void pool_split(void (*fn)(void *), void *arg, void (*mine)(void *), void *mine_arg) {
    split_job j = {{mine, fn}, {mine_arg, arg}};
    pool_parts(split_part, &j, 2);
}

/* The weights at element `off` of w, stored as fp32 (bf = 0) or bf16 bits (bf = 1). */
static const void *weights_at(const void *w, int bf, long off) {
    return bf ? (const void *)((const bf16_t *)w + off) : (const void *)((const float *)w + off);
}

/* A job of the draft's `gemm_rows` (`rows` = 1), on this thread. */
static void gemm_rows_alone(const gemm_job *j) {
    if (j->bf)
        gemm_rows_h((const bf16_t *)j->w, j->x, j->xs, j->T, j->N, j->K, j->out, j->os);
    else
        gemm_rows((const float *)j->w, j->x, j->xs, j->T, j->N, j->K, j->out, j->os);
}

static void gemm_job_run(const gemm_job *j);

static void gemm_job_run(const gemm_job *j) {
    if (j->rows)
        gemm_rows_alone(j);
    else if (j->bf)
        gemm_exact_h((const bf16_t *)j->w, j->x, j->xs, j->T, j->N, j->K, j->out, j->os);
    else
        gemm_exact((const float *)j->w, j->x, j->xs, j->T, j->N, j->K, j->out, j->os);
}

/* Part `part` of `parts` of a GEMM: its output rows, in multiples of 16 (whole AVX-512 tiles) when every part gets
 * that many, else of 4; the last part ends at N. */
static void gemm_part(void *arg, int part, int parts) {
    gemm_job j = *(const gemm_job *)arg;
    int lo, hi;
    part_range(j.N, j.N / parts >= 16 ? 16 : 4, part, parts, &lo, &hi);
    if (lo >= hi) return;
    j.w = weights_at(j.w, j.bf, (long)lo * j.K);
    j.out += lo;
    j.N = hi - lo;
    gemm_job_run(&j);
}

/* Run `job` (rows `[0, N)` of `job.w`), its rows split over the pool's threads when there are helpers, the pool is
 * free and the GEMM big enough: one part per POOL_MIN_MACS / 2 multiply-adds and per 4 rows at most. */
static void gemm_pooled(gemm_job job) {
    const long macs = (long)job.T * job.N * job.K;
    long parts = macs / (POOL_MIN_MACS / 2);
    parts = parts < job.N / 4 ? parts : job.N / 4;
    parts = parts < pool.threads ? parts : pool.threads;
    if (parts < 2 || !pool_take()) {
        gemm_job_run(&job);
        return;
    }
    pool_parts(gemm_part, &job, (int)parts);
}

/* `gemm_exact` of the weights at element `off` of w: fp32 (bf = 0) or bf16 bits (bf = 1), shared with the helper
 * thread when it is worth it. */
static void gemm_exact_w(const void *w, long off, int bf, const float *x, long xs, int T, int N, int K, float *out,
                         long os) {
    gemm_pooled((gemm_job){weights_at(w, bf, off), bf, 0, x, xs, T, N, K, out, os});
}

/* `gemm_rows` of the weights at element `off` of w: fp32 (bf = 0) or bf16 bits (bf = 1), shared with the helper
 * thread when it is worth it. */
static void gemm_rows_w(const void *w, long off, int bf, const float *x, long xs, int T, int N, int K, float *out,
                        long os) {
    gemm_pooled((gemm_job){weights_at(w, bf, off), bf, 1, x, xs, T, N, K, out, os});
}
