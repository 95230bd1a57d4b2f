/* pdspark CPU kernels, pool.c: the helper thread that shares a step's big GEMMs, and the GEMM entry points the
 * other parts call (`gemm_exact_w`, `gemm_rows_w`), which offer it work. */
#include "kernels.h"

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

/* `gemm_rows` of the weights at element `off` of w: fp32 (bf = 0) or bf16 bits (bf = 1), shared with the helper
 * thread when it is worth it. */
static void gemm_rows_w(const void *w, long off, int bf, const float *x, long xs, int T, int N, int K, float *out,
                        long os) {
    gemm_pooled((gemm_job){weights_at(w, bf, off), bf, 1, x, xs, T, N, K, out, os});
}
