/* pdspark CPU kernels: what the parts of the library share. kernels.c includes this header, then every part in
 * the order listed below, into one translation unit (the parts are not compiled on their own): a part may use what
 * the parts before it define. This header holds the helpers every part uses, the slot enums of the arrays the
 * library reads (its contract with `pdspark.hardware.cpu.kernels`, checked through `pdspark_abi`), the types and
 * prototypes one part uses from another, and the prototypes of the functions Python calls. */
#ifndef PDSPARK_KERNELS_H
#define PDSPARK_KERNELS_H

#include <math.h>
#include <pthread.h>
#include <string.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

static float sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }

/* Weights may be stored as bfloat16 bits. A checkpoint's weights are bf16 numbers (DSV4 ships bf16), which fp32
 * holds exactly, and widening bf16 to fp32 is exact: so a kernel that reads each weight as its bf16 bits and widens
 * it in a register computes every product and sum of its fp32 twin bit for bit, while reading half the bytes (a
 * decode step streams its weights from L3 or DRAM). The caller stores a matrix that way only when every value
 * round-trips (`pdspark.hardware.cpu.kernels.bf16_copy`). The weight-reading kernels (gemm.c) are written once and
 * instantiated for both storages: `dot`, `dot4`, `gemm_exact4` (fp32) and `dot_h`, `dot4_h`, `gemm_exact4_h`. */
typedef unsigned short bf16_t;

static inline float bf16f(bf16_t h) {
    union { unsigned int u; float f; } v;
    v.u = (unsigned int)h << 16;
    return v.f;
}

#define F32_VALUE(v) (v)

/* ---- the contract with Python: the slots of every array the library reads ---------------------------------------- */

/* Slots of the arrays `decode_layer` reads. Keep in step with `pdspark.hardware.cpu.kernels.DECODE_*`. */
enum { /* the layer's weights (pointers, fixed once the weights are final) */
    W_ATTN_FN, W_ATTN_SCALE, W_ATTN_BASE, W_ATTN_NORM, W_FFN_FN, W_FFN_SCALE, W_FFN_BASE, W_FFN_NORM,
    W_X, W_Q_NORM, W_Q_B, W_KV_NORM, W_SINK, W_O_A, W_O_B, W_C_APE, W_C_NORM, W_I_Q_B, W_I_APE, W_I_NORM,
    W_MOE_IN, W_13, W_2, W_2S, W_BIAS, W_TID2EID,
    W_EXCHANGE, /* expert parallelism: an `expert_exchange` (NULL in one process) */
    W_COUNT
};
enum { /* the layer's sizes */
    I_KIND, I_HC, I_ITERS, I_D, I_QL, I_H, I_HD, I_G, I_L, I_C_RATIO, I_C_DIM, I_I_HEADS, I_I_DIM, I_I_TOPK,
    I_E, I_INTER, I_K, I_SQRTSP,
    I_E0, I_E_HELD, /* expert parallelism: the experts this rank holds, [I_E0, I_E0 + I_E_HELD) of the I_E */
    I_COUNT
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
enum { /* the layer's pools: pointer, row stride (floats; bytes for packed rows; floats from block to block for
        * blocked rows); then whether the main KV pools (SWA, compressed) hold the FP8 cache's packed rows
        * (`packed_rows.c`), and how the indexer's key pool holds its rows (KEYS_*) */
    P_SWA, P_SWA_STRIDE, P_COMP, P_COMP_STRIDE, P_STATE, P_STATE_STRIDE, P_IDX, P_IDX_STRIDE, P_IDX_STATE,
    P_IDX_STATE_STRIDE, P_KV_PACKED, P_IDX_KEYS, P_COUNT
};
enum { KIND_SLIDING, KIND_CSA, KIND_HCA };
/* How the indexer's key pool holds its rows: fp32 rows; the FP8 cache's packed rows; fp32 rows in blocks of
 * ROW_BLOCK, channel-major within a block (`packed_rows.c`'s BLOCKED_ROWS: the pick reads 8 entries' channel as one
 * vector, with no transposition). */
enum { KEYS_ROWS, KEYS_PACKED, KEYS_BLOCKED, KEYS_COUNT };
#define ROW_BLOCK 8

/* A projection's weights (the W_X, W_Q_B, W_O_A, W_O_B, W_I_Q_B, W_MOE_IN, W_13, W_2 and W_2S slots point to one):
 * word 0 the number of row segments, then PS_COUNT words per segment, its rows following the previous segment's.
 * Keep in step with `pdspark.hardware.cpu.kernel_abi.PROJ_SEGMENT` and `PROJ_FORMATS`. */
enum { WF_F32, WF_BF16, WF_FP8, WF_MXFP4, WF_COUNT }; /* a segment's storage */
enum {
    PS_FMT, PS_ROWS, /* WF_*, and the segment's rows */
    PS_DATA, /* fp32 or bf16 bits [rows, K]; e4m3 bytes [rows, K]; MXFP4 pairs of codes [rows, K / 2] */
    PS_SCALE, /* FP8: fp32 tile scales [.., PS_SCALE_COLS]; MXFP4: ue8m0 bytes [rows, K / 32] */
    PS_SCALE_COLS, /* FP8: ceil(K / 128) */
    PS_ROW0, /* FP8: where row 0 sits in the matrix its scales tile (a slice of a bigger one: 0 for a whole one) */
    PS_PERIOD, PS_SCALE_PERIOD, /* FP8 stacks (routed experts): rows and scale rows per matrix (0: one matrix) */
    PS_LUT, /* FP8: fp32 [256] each e4m3 byte's value; MXFP4: fp32 [16] each e2m1 code's value */
    PS_LUT2, /* MXFP4: fp32 [256] each ue8m0 byte's value */
    PS_COUNT
};

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

/* Slots of the step layout `decode_index` reads. Keep in step with `pdspark.hardware.cpu.kernels.DECODE_LAYOUT`. */
enum {
    L_RTT, L_RTT_STRIDE, L_RTC, L_RTC_STRIDE, L_F2S, L_PAGE, L_WINDOW, L_CSA_RATIO, L_HCA_RATIO, L_C128_PAGE,
    L_CSA_RING, L_HCA_RING, L_SWA_DUMMY_PAGE, L_SWA_DUMMY_SLOT, L_C4_DUMMY, L_C128_DUMMY, L_C4_STATE_DUMMY,
    L_C128_STATE_DUMMY, L_COS_MAIN, L_SIN_MAIN, L_COS_COMP, L_SIN_COMP, L_ROPE_DIM, L_COUNT
};
#define INDEX_MAX_TOKENS 64

/* The arrays above hold pointers as int64 words: slot i of a as a float, int64 or byte array. */
#define PTR(a, i) ((const float *)(a)[i])
#define LPTR(a, i) ((const long *)(a)[i])
#define BPTR(a, i) ((const unsigned char *)(a)[i])

/* A bump allocator over the caller's scratch (floats). */
static float *take(float **at, long n) {
    float *p = *at;
    *at += (n + 15) & ~15L;
    return p;
}

/* ---- gemm.c: the weight GEMMs and dot products ------------------------------------------------------------------- */

static float dot(const float *a, const float *b, int n);
static void dot4(const float *a0, const float *a1, const float *a2, const float *a3, const float *b, int n,
                 float *out);
static void gemm_exact(const float *w, const float *x, long xs, int T, int N, int K, float *out, long os);
static void gemm_exact_h(const bf16_t *w, const float *x, long xs, int T, int N, int K, float *out, long os);
static void gemv(const float *w, const float *x, int N, int K, float *out);
static void gemm_rows(const float *w, const float *x, long xs, int T, int N, int K, float *out, long os);
static void gemm_rows_h(const bf16_t *w, const float *x, long xs, int T, int N, int K, float *out, long os);

/* ---- pool.c: the helper threads for a step's big GEMMs ----------------------------------------------------------- */
/* Its state `pool` (`pool.threads`: the caller and its helpers, 1 .. POOL_MAX_THREADS) and `POOL_MIN_MACS` (the
 * least work worth splitting) are defined there and read by compact.c, ops.c and moe.c. */

static int pool_take(void);
static void pool_split(void (*fn)(void *), void *arg, void (*mine)(void *), void *mine_arg);
static void gemm_exact_w(const void *w, long off, int bf, const float *x, long xs, int T, int N, int K, float *out,
                         long os);
static void gemm_rows_w(const void *w, long off, int bf, const float *x, long xs, int T, int N, int K, float *out,
                        long os);
void pool_threads(int n);

/* ---- compact.c: compact weights, and a projection's weights in any storage ------------------------------------ */

static int gemm_proj(const long *p, long row, const float *x, long xs, int T, int N, int K, float *out, long os);
static const long *proj_plain(long p[1 + PS_COUNT], const void *w, int bf, long rows);
int linear_proj(const long *p, long row, const float *x, int T, int N, int K, float *out);

/* ---- ops.c: the per-op kernels ----------------------------------------------------------------------------------- */

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
    const struct pool_rows *swa_pk, *comp_pk; /* the FP8 cache's packed rows in place of swa / comp, or NULL */
} attend_job;

/* The parts a verify step's attention rows split into at most (each its own scratch of H*(W+V) floats). */
#define ATTEND_MAX_PARTS 8
static void sink_attend_rows(attend_job a, long scratch_floats);
static int attn_out_rows_p(const float *o, const float *cos, const float *sin, int T, int H, int d, int r,
                           const long *wo_a, int G, int L, const long *wo_b, int Dm, float *scratch, float *out);
void linear_rows(const float *x, const float *w, int T, int N, int K, float *out);
void rms_norm(const float *x, long stride, const float *w, int N, int D, float eps, float *out);
void rope_rotate(const float *x, const float *cos, const float *sin, int T, int H, int D, int r, float sign,
                 float *out);
void hc_collapse(const float *h, const float *fn, const float *scale, const float *base, int T, int hc, int D,
                 int iters, float eps, float norm_eps, float *scratch, float *x, float *pre, float *post,
                 float *comb, const float *x_norm_w, float x_norm_eps);
void hc_collapse_mixed(const float *h, const float *mixes, const float *scale, const float *base, int T, int hc,
                       int D, int iters, float eps, float *x, float *pre, float *post, float *comb);
void hc_expand(const float *y, const float *res, const float *post, const float *comb, int T, int hc, int D,
               float *out);
void index_scores(const float *q, const float *w, const float *k, long kstride, int T, int H, int V, int D,
                  float scale, float *out);
void index_pick(const float *q, const float *w, const void *k, long row_stride, int keys, const long *rows,
                const unsigned char *valid, int T, int H, int V, int D, float scale, int topk, float *scratch,
                unsigned char *picked);
void index_pick_shared(const float *q, const float *w, const void *k, long row_stride, int keys, const long *rows,
                       const unsigned char *valid, int T, int H, int V, int D, float scale, int topk, float *scratch,
                       int scratch_parts, long *out_rows, unsigned char *out_valid);
long index_pick_shared_scratch_floats(int V);
void topk_mask(const float *scores, const unsigned char *valid, int T, int V, int topk, float *scratch,
               unsigned char *picked);
void compact_picks(const long *rows, const unsigned char *picked, int T, int V, int k, long *out_rows,
                   unsigned char *out_valid);
void sink_attend(const float *q, const float *swa, long swa_stride, const long *win_rows,
                 const unsigned char *win_valid, int W, const float *comp, long comp_stride, const long *comp_rows,
                 const unsigned char *comp_valid, int V, const float *sink, float scale, int T, int H, int d,
                 float *scratch, float *out);
void compressor_run(const float *proj, long pstride, const long *positions, int T, const float *ape, int ratio,
                    int dim, int overlap, int G, const long *out_rows, const long *gpos, const unsigned char *use_cur,
                    const long *cur_rows, const long *hist_rows, int N, const long *write_tokens,
                    const long *write_rows, const float *norm_w, float eps, const float *cos_table,
                    const float *sin_table, int r, float *rows, float *state, long state_stride, float *pool,
                    long pool_stride, float *scratch);
void norm_rope(const float *x, long x_stride, const float *w, int N, int H, int D, float eps, const float *cos,
               const float *sin, int r, float *out, const long *out_rows, long out_stride, float *scratch);
void attn_out(const float *o, const float *cos, const float *sin, int T, int H, int d, int r, const float *wo_a,
              int G, int L, const float *wo_b, int Dm, float *scratch, float *out);
void attn_out_rows(const float *o, const float *cos, const float *sin, int T, int H, int d, int r, const float *wo_a,
                   int G, int L, const float *wo_b, int Dm, float *scratch, float *out);
void lm_head(const float *h, int N, int hc, int D, const float *fn, const float *scale, const float *base,
             float hc_eps, float norm_eps, const float *norm_w, float eps, const void *head, int V, int head_bf16,
             float *scratch, float *out);

/* ---- moe.c: MoE routing and experts ------------------------------------------------------------------------------ */

static float swiglu1(float g, float u, float limit);
static int moe_decode_p(const float *x, const float *lgu, long lstride, const long *input_ids, const long *tid2eid,
                        const float *bias, const long *w13, const long *w2, const long *w2s, int T, int D, int E,
                        int I, int k, int sqrtsoftplus, float scaling, float limit, float *scratch, long *ids,
                        float *ws, float *out);
/* Expert parallelism: sums ys [n floats] (each (token, slot) output row, zeros where another rank holds the slot's
 * expert) over the ranks of the group, in place; 0 on success, else nonzero (a collective failed or timed out). */
typedef int (*expert_exchange)(float *ys, long n);
static int moe_decode_rows_p(const float *x, const float *lgu, long lstride, const long *input_ids,
                             const long *tid2eid, const float *bias, const long *w13, const long *w2, const long *w2s,
                             int T, int D, int E, int e0, int e_held, expert_exchange ex, int I, int k,
                             int sqrtsoftplus, float scaling, float limit, long *ids, float *ws, float *fs,
                             float *out);
void moe_decode(const float *x, const float *lgu, long lstride, const long *input_ids, const long *tid2eid,
                const float *bias, const float *w13, const float *w2, const float *w2s, int T, int D, int E, int I,
                int k, int sqrtsoftplus, float scaling, float limit, float *scratch, long *ids, float *ws, float *out);
long moe_rows_scratch_floats(int T, int k, int D, int I);
int moe_decode_rows(const float *x, const float *lgu, long lstride, const long *input_ids, const long *tid2eid,
                    const float *bias, const float *w13, const float *w2, const float *w2s, int T, int D, int E,
                    int e0, int e_held, expert_exchange ex, int I, int k, int sqrtsoftplus, float scaling,
                    float limit, long *ids, float *ws, float *fs, float *out);

/* ---- decode_layer.c: a decode step's decoder layers -------------------------------------------------------------- */

long decode_layer_scratch_floats(const int *wi, int T, int V, int W, int packed);
void pack_rows(const float *x, long n, int dim, int rope, uint8_t *out);
void unpack_rows(const uint8_t *p, long n, int dim, int rope, float *out);
int decode_layer(const long *wp, const int *wi, const float *wf, const long *sp, const int *si, const long *pp,
                 const float *h, float *h_out, float *scratch, long scratch_n, long *ids_buf);
int decode_layers(int n, const long *tables, const long *sp, const int *si, const void *embed, int embed_bf16, int hc,
                  int D, float *h0, float *h1, float *scratch, long scratch_n, long *ids_buf, const int *capture,
                  float *features, int F);

/* ---- draft_block.c: the DSpark draft ----------------------------------------------------------------------------- */

long draft_scratch_floats(const int *wi, int M, int W);
void draft_block(const long *wp, const int *wi, const float *wf, const long *anchors, const long *anchor_pos, int M,
                 const long *ctx, const long *rows, const unsigned char *valid, int W, float *scratch,
                 float *logits);
void draft_inject(const long *wp, const int *wi, const float *wf, const float *features, int N,
                  const long *positions, const long *ctx, const long *slots, float *scratch);

/* ---- decode_index.c: a small step's indices from the page tables ------------------------------------------------- */

int decode_index(const long *req, const long *L, const long *sp, int *si);

/* ---- kernels.c --------------------------------------------------------------------------------------------------- */

int pdspark_abi(long *out, int n);

#endif
