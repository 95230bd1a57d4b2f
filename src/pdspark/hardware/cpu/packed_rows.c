/* pdspark CPU kernels, packed_rows.c: the FP8 cache's rows (`--kv-cache-dtype fp8_e4m3`, `quant/kv_fp8.py`) read
 * and written by the C decode step, bit for bit as the PyTorch encode and decode give them, so that the C step and
 * the module path give the same tokens over packed pools as over float ones.
 *
 * - main KV rows (`KvRowPack`, dim = nope + rope): the nope channels as e4m3 in blocks of 64, each block's scale a
 *   power of two 2^e (the byte e + 127 after the rope channels' bf16 bytes), bytes padded to a multiple of 8;
 * - indexer key rows (`IndexRowPack`): e4m3 in blocks of 128, each with an fp32 scale (amax / 448) after the values.
 *
 * Encoding rounds as torch's casts do (float -> e4m3fn and float -> bf16: nearest, ties to even; e4m3 saturates at
 * +-448, infinities included). Decoding is exact (e4m3 and bf16 are subsets of fp32) but for the one rounding of
 * value * scale, done in fp32 as torch does; 16 bytes at a time where the CPU has AVX-512 (compact.c's decode of
 * FP8 weights): at long context the indexer decodes every visible key row of a step. */

#define E4M3_MAX 448.0f
#define KV_BLOCK 64
#define INDEX_BLOCK 128

static inline uint32_t f32_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    return u;
}

static inline float f32_of(uint32_t u) {
    float x;
    memcpy(&x, &u, 4);
    return x;
}

/* float -> e4m3fn byte, nearest with ties to even. */
static uint8_t e4m3_encode(float f) {
    uint32_t u = f32_bits(f);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80);
    u &= 0x7FFFFFFFu;
    if (u > 0x7F800000u) return sign | 0x7F;  /* NaN: e4m3's NaN pattern */
    if (u >= 0x43E00000u) return sign | 0x7E; /* |f| >= 448, inf included: saturated to 448, as torch's cast */
    if (u < (121u << 23)) {                   /* below 2^-6, e4m3's least normal: a subnormal, in units of 2^-9 */
        /* Adding 2^14 (whose ulp is 2^-9) lets the FPU round to the nearest unit, ties to even. */
        const uint32_t magic = 141u << 23;
        return sign | (uint8_t)(f32_bits(f32_of(u) + f32_of(magic)) - magic);
    }
    /* A normal: rebias the exponent (127 -> 7) and round the 23-bit mantissa to 3 bits, ties to even. */
    const uint32_t odd = (u >> 20) & 1u;
    u += (uint32_t)(7 - 127) * (1u << 23) + 0x7FFFFu + odd;
    return sign | (uint8_t)(u >> 20);
}

/* float -> bf16 bits, nearest with ties to even (a NaN stays a quiet NaN). */
static bf16_t bf16_encode(float f) {
    const uint32_t u = f32_bits(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
    return (bf16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* e4m3 byte -> its float (exact). */
static inline float e4m3_value(uint8_t b) {
    const uint32_t mag = b & 0x7Fu, sign = (uint32_t)(b & 0x80) << 24;
    if (mag == 0x7F) return f32_of(sign | 0x7FC00000u);
    if (mag < 8) return f32_of(sign | f32_bits((float)mag * 0x1p-9f)); /* subnormal: mag units of 2^-9 */
    return f32_of(sign | ((mag << 20) + (120u << 23)));
}

/* Each e4m3 byte's value (`e4m3_value`), filled when the library loads: what a packed row decodes to, a byte at a
 * time, or 16 at a time through compact.c's `e4m3_values16` (AVX-512: the half-to-single conversion) where the CPU has
 * it, as the FP8 weights decode. */
static float e4m3_table[256];

__attribute__((constructor)) static void fill_e4m3_table(void) {
    for (int b = 0; b < 256; b++) e4m3_table[b] = e4m3_value((uint8_t)b);
}

/* out[i] = value(b[i]) * scale for i < n (one fp32 multiply: torch's `values * scale`). */
static void e4m3_decode(const uint8_t *b, int n, float scale, float *out) {
    int i = 0;
#ifdef COMPACT_AVX512
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(out + i, _mm512_mul_ps(e4m3_values16(b + i, e4m3_table), _mm512_set1_ps(scale)));
#endif
    for (; i < n; i++) out[i] = e4m3_table[b[i]] * scale;
}

/* A main KV row's layout: nope = dim - rope e4m3 bytes, then rope bf16 values, then one scale byte per block of
 * KV_BLOCK nope channels; width padded to 8 bytes (`KvRowPack.width`). */
static inline int kv_scales(int dim, int rope) { return (dim - rope + KV_BLOCK - 1) / KV_BLOCK; }
static inline long kv_width(int dim, int rope) {
    return ((long)(dim - rope) + 2L * rope + kv_scales(dim, rope) + 7) / 8 * 8;
}
static inline long index_width(int dim) { return dim + 4L * ((dim + INDEX_BLOCK - 1) / INDEX_BLOCK); }

/* max |x[i]| over n values, NaN when one is NaN (as torch's amax). */
static float abs_max(const float *x, int n) {
    float a = 0.0f;
    for (int i = 0; i < n; i++) {
        const float v = fabsf(x[i]);
        if (v != v) return v;
        if (v > a) a = v;
    }
    return a;
}

/* The power-of-two exponent e of a main KV block: the least e with 2^e >= y = amax / 448 (`KvRowPack.encode`:
 * ceil(log2 y), taken exactly from y's bits); 0 where y is not finite. */
static int kv_block_exponent(float amax) {
    const float y = (amax < 1e-4f ? 1e-4f : amax) / E4M3_MAX;
    if (!isfinite(y)) return 0;
    int e;
    const float m = frexpf(y, &e); /* y = m * 2^e, m in [0.5, 1) */
    return m == 0.5f ? e - 1 : e;
}

/* One fp32 row x [dim] -> its packed main KV row out [kv_width]. */
static void kv_pack_row(const float *x, int dim, int rope, uint8_t *out) {
    const int nope = dim - rope, S = kv_scales(dim, rope);
    uint8_t *scales = out + nope + 2L * rope;
    for (int s = 0; s < S; s++) {
        const int lo = s * KV_BLOCK, n = nope - lo < KV_BLOCK ? nope - lo : KV_BLOCK;
        const int e = kv_block_exponent(abs_max(x + lo, n));
        const float p = f32_of((uint32_t)(e + 127) << 23); /* 2^e: e lies in [-22, 120] */
        for (int i = 0; i < n; i++) out[lo + i] = e4m3_encode(x[lo + i] / p);
        const int byte = e + 127;
        scales[s] = (uint8_t)(byte < 0 ? 0 : byte > 254 ? 254 : byte);
    }
    for (int i = 0; i < rope; i++) {
        const bf16_t h = bf16_encode(x[nope + i]);
        memcpy(out + nope + 2L * i, &h, 2);
    }
    const long used = nope + 2L * rope + S, width = kv_width(dim, rope);
    for (long i = used; i < width; i++) out[i] = 0;
}

/* A packed main KV row -> fp32 out [dim]. */
static void kv_unpack_row(const uint8_t *p, int dim, int rope, float *out) {
    const int nope = dim - rope, S = kv_scales(dim, rope);
    const uint8_t *scales = p + nope + 2L * rope;
    for (int s = 0; s < S; s++) {
        const int lo = s * KV_BLOCK, n = nope - lo < KV_BLOCK ? nope - lo : KV_BLOCK;
        /* 2^(byte - 127); byte 0 (never written: scales are at least 2^-22) gives +0 */
        e4m3_decode(p + lo, n, f32_of(scales[s] == 0 ? 0u : (uint32_t)scales[s] << 23), out + lo);
    }
    for (int i = 0; i < rope; i++) {
        bf16_t h;
        memcpy(&h, p + nope + 2L * i, 2);
        out[nope + i] = bf16f(h);
    }
}

/* One fp32 row x [dim] -> its packed indexer key row out [index_width]. */
static void index_pack_row(const float *x, int dim, uint8_t *out) {
    for (int lo = 0, s = 0; lo < dim; lo += INDEX_BLOCK, s++) {
        const int n = dim - lo < INDEX_BLOCK ? dim - lo : INDEX_BLOCK;
        float scale = abs_max(x + lo, n) / E4M3_MAX;
        if (scale < 1e-12f) scale = 1e-12f;
        for (int i = 0; i < n; i++) out[lo + i] = e4m3_encode(x[lo + i] / scale);
        memcpy(out + dim + 4L * s, &scale, 4);
    }
}

/* A packed indexer key row -> fp32 out [dim]. */
static void index_unpack_row(const uint8_t *p, int dim, float *out) {
    for (int lo = 0, s = 0; lo < dim; lo += INDEX_BLOCK, s++) {
        float scale;
        memcpy(&scale, p + dim + 4L * s, 4);
        e4m3_decode(p + lo, dim - lo < INDEX_BLOCK ? dim - lo : INDEX_BLOCK, scale, out + lo);
    }
}

/* A pool's rows as the decode step reads and writes them: fp32 rows `stride` floats apart (rope = FLOAT_ROWS);
 * packed rows `stride` bytes apart, main KV rows (rope >= 0, dim = nope + rope) or indexer key rows (rope =
 * INDEX_ROWS); or fp32 rows in blocks of ROW_BLOCK (rope = BLOCKED_ROWS: the indexer's keys of an fp32 cache,
 * `model/blocked_rows.py`), channel-major within a block: row r's channel d at base[(r / ROW_BLOCK) * stride + d *
 * ROW_BLOCK + r % ROW_BLOCK], `stride` floats from one block to the next. */
#define INDEX_ROWS (-2)
#define FLOAT_ROWS (-1)
#define BLOCKED_ROWS (-3)
typedef struct pool_rows {
    void *base;
    long stride;
    int dim, rope;
} pool_rows;

/* Whether a row is not `dim` contiguous floats (written through `rows_write`, read through `rows_read`). */
static inline int rows_packed(const pool_rows *r) { return r->rope != FLOAT_ROWS; }

/* Row `row` of the pool into out [dim] (fp32, decoded where packed). */
static void rows_read(const pool_rows *r, long row, float *out) {
    if (r->rope == FLOAT_ROWS) memcpy(out, (const float *)r->base + row * r->stride, sizeof(float) * r->dim);
    else if (r->rope == BLOCKED_ROWS) {
        const float *b = (const float *)r->base + (row / ROW_BLOCK) * r->stride + row % ROW_BLOCK;
        for (int d = 0; d < r->dim; d++) out[d] = b[d * ROW_BLOCK];
    } else if (r->rope == INDEX_ROWS) index_unpack_row((const uint8_t *)r->base + row * r->stride, r->dim, out);
    else kv_unpack_row((const uint8_t *)r->base + row * r->stride, r->dim, r->rope, out);
}

/* x [dim] into row `row` of the pool (encoded where packed). */
static void rows_write(const pool_rows *r, long row, const float *x) {
    if (r->rope == FLOAT_ROWS) memcpy((float *)r->base + row * r->stride, x, sizeof(float) * r->dim);
    else if (r->rope == BLOCKED_ROWS) {
        float *b = (float *)r->base + (row / ROW_BLOCK) * r->stride + row % ROW_BLOCK;
        for (int d = 0; d < r->dim; d++) b[d * ROW_BLOCK] = x[d];
    } else if (r->rope == INDEX_ROWS) index_pack_row(x, r->dim, (uint8_t *)r->base + row * r->stride);
    else kv_pack_row(x, r->dim, r->rope, (uint8_t *)r->base + row * r->stride);
}

/* n fp32 rows x [n, dim] -> packed rows out [n, width] (rope >= 0: main KV rows; INDEX_ROWS: indexer key rows); and
 * back. For the tests that hold these to `quant/kv_fp8.py`'s encode and decode. */
void pack_rows(const float *x, long n, int dim, int rope, uint8_t *out) {
    const pool_rows r = {out, rope == INDEX_ROWS ? index_width(dim) : kv_width(dim, rope), dim, rope};
    for (long i = 0; i < n; i++) rows_write(&r, i, x + i * dim);
}

void unpack_rows(const uint8_t *p, long n, int dim, int rope, float *out) {
    const pool_rows r = {(void *)p, rope == INDEX_ROWS ? index_width(dim) : kv_width(dim, rope), dim, rope};
    for (long i = 0; i < n; i++) rows_read(&r, i, out + i * dim);
}
