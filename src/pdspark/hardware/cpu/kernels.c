/* pdspark CPU kernels: small fused loops whose PyTorch form is dozens of tiny ops per call.
 * Plain C with float32 arithmetic in the reference's order (reductions excepted: dot products and sums of
 * squares use 16 partial sums, as vectorised BLAS kernels do; the indexer's scores keep the exact order of their
 * PyTorch path, in GCC/Clang vector types; the DSpark draft's GEMMs use fused multiply-adds where the CPU has
 * them, see `gemm_rows`); called through ctypes.
 *
 * The library is this one translation unit, made of parts with one job each (kernels.h: what they share):
 *   gemm.c          the weight GEMMs and dot products (fp32 weights and bf16 bits)
 *   pool.c          the helper thread that shares a step's big GEMMs
 *   compact.c       the GEMMs of compact weights (FP8 128x128 tiles, MXFP4 experts), decoded a block of rows at a time,
 *                   and of a projection whose rows are segments in any of the storages (`gemm_proj`)
 *   packed_rows.c   the FP8 cache's rows (`--kv-cache-dtype fp8_e4m3`), encoded and decoded as PyTorch does
 *   ops.c           the per-op kernels (norms, rope, mHC, indexer, sink attention, compressor, output projection,
 *                   LM head)
 *   moe.c           MoE routing and experts
 *   decode_layer.c  a decode step's whole decoder layer, and every layer of a small step
 *   draft_block.c   the DSpark draft block and its context rows
 *   decode_index.c  a small step's indices from the page tables
 * They are included here, not compiled apart, so the compiler still sees one file: the `static` helpers inline
 * across parts as they did when the parts were one file. The build (`kernel_build`) compiles this file; its cache
 * key covers every .c and .h file beside it. */
#include "kernels.h"

#include "gemm.c"
#include "pool.c"
#include "compact.c"
#include "packed_rows.c"
#include "ops.c"
#include "moe.c"
#include "decode_layer.c"
#include "draft_block.c"
#include "decode_index.c"

/* The library's contract with its Python caller: the slot counts of every array it reads, the limits of its
 * fixed-size buffers and the layer kinds (the enums of kernels.h), in the order of
 * `pdspark.hardware.cpu.kernels.ABI_MIRRORS`, which names the Python mirror of each. Python compares them with its
 * mirrors when it loads the library and refuses a library that disagrees, naming the enums that differ (a slot
 * added on one side only would read or write the wrong word). Writes at most n values; returns how many there
 * are. */
int pdspark_abi(long *out, int n) {
    const long abi[] = {W_COUNT,  I_COUNT,  F_COUNT,   S_COUNT,  SI_COUNT,     P_COUNT,  L_COUNT,
                        DW_COUNT, DH_COUNT, DI_COUNT,  DF_COUNT, INDEX_MAX_TOKENS,
                        KIND_SLIDING, KIND_CSA, KIND_HCA, PS_COUNT, WF_F32, WF_BF16, WF_FP8, WF_MXFP4,
                        KEYS_COUNT, KEYS_BLOCKED, ROW_BLOCK};
    const int count = (int)(sizeof(abi) / sizeof(abi[0]));
    for (int i = 0; i < count && i < n; i++) out[i] = abi[i];
    return count;
}
