"""The C library's arrays and limits as Python mirrors them: the slot names of every array a kernel reads (in the order
of the enums in kernels.h), `decode_index`'s token limit, the layer kinds, and the check that a built library agrees
(`pdspark_abi`). A slot added on one side only would make the C loops read or write the wrong word, so `kernels.load`
refuses a library whose table differs, naming each enum."""

from __future__ import annotations

import ctypes

# The slots of `decode_layer`'s arrays, in the order of the enums in kernels.h.
DECODE_WEIGHTS = ("attn_fn", "attn_scale", "attn_base", "attn_norm", "ffn_fn", "ffn_scale", "ffn_base", "ffn_norm",
                  "wx", "q_norm", "wq_b", "kv_norm", "sink", "wo_a", "wo_b", "c_ape", "c_norm", "i_wq_b", "i_ape",
                  "i_norm", "moe_in", "w13", "w2", "w2s", "bias", "tid2eid", "exchange")
DECODE_SIZES = ("kind", "hc", "iters", "hidden", "q_lora", "heads", "head_dim", "o_groups", "o_lora", "c_ratio",
                "c_dim", "i_heads", "i_dim", "i_topk", "experts", "inter", "top_k", "sqrtsoftplus", "expert0",
                "experts_held")
DECODE_SCALARS = ("hc_eps", "hc_norm_eps", "attn_norm_eps", "ffn_norm_eps", "q_eps", "head_eps", "kv_eps", "scale",
                  "c_eps", "i_eps", "i_wscale", "i_scale", "scaling", "limit")
DECODE_STEP = ("positions", "input_ids", "swa_slots", "win_rows", "win_valid", "csa_rows", "csa_valid", "hca_rows",
               "hca_valid", "cos_main", "sin_main", "cos_comp", "sin_comp", "table_cos", "table_sin",
               *(f"csa_{n}" for n in ("out", "pos", "use", "cur", "hist", "wtok", "wrow")),
               *(f"hca_{n}" for n in ("out", "pos", "use", "cur", "hist", "wtok", "wrow")))
DECODE_STEP_SIZES = ("tokens", "window", "rope_dim", "csa_visible", "hca_visible", "csa_groups", "csa_writes",
                     "hca_groups", "hca_writes")
# Pools: pointer and row stride (floats; bytes for packed rows; floats from block to block for blocked rows), then
# whether the main KV pools (SWA, compressed) hold the FP8 cache's packed rows (`quant.kv_fp8`: 1) or fp32 rows (0),
# and how the indexer's key pool holds its rows (`INDEX_KEYS`).
DECODE_POOLS = ("swa", "swa_stride", "comp", "comp_stride", "state", "state_stride", "index", "index_stride",
                "index_state", "index_state_stride", "kv_packed", "index_keys")
# How the indexer's key pool holds its rows (the C picks' `keys` argument, the table's index_keys): fp32 rows, the FP8
# cache's packed rows (`quant.kv_fp8.IndexRowPack`), or fp32 rows in blocks of `ROW_BLOCK` rows, channel-major
# within a block (`model.blocked_rows.BlockedRows`).
INDEX_KEYS = ("rows", "packed", "blocked")
ROW_BLOCK = 8
# `pack_rows`' rope argument for indexer key rows (main KV rows pass their rope width).
INDEX_ROWS = -2
# Layer kinds (`kind` above).
DECODE_SLIDING, DECODE_CSA, DECODE_HCA = 0, 1, 2
# A projection's weights (the table's wx, wq_b, wo_a, wo_b, i_wq_b, moe_in, w13, w2 and w2s point to one): an int64
# array, the number of row segments, then these words per segment (`gemm_proj` in compact.c), and the storages.
PROJ_SEGMENT = ("format", "rows", "data", "scale", "scale_cols", "row0", "period", "scale_period", "lut", "lut2")
PROJ_FORMATS = ("f32", "bf16", "fp8", "mxfp4")


# The slots of `draft_block`'s arrays, in the order of the enums in kernels.h: S stages' weights, then the head's.
DRAFT_STAGE_WEIGHTS = ("attn_fn", "attn_scale", "attn_base", "attn_norm", "ffn_fn", "ffn_scale", "ffn_base",
                       "ffn_norm", "wx", "q_norm", "wq_b", "kv_norm", "sink", "wo_a", "wo_b", "gate_up", "down")
DRAFT_HEAD_WEIGHTS = ("embed", "hc_fn", "hc_scale", "hc_base", "norm", "head", "rope_cos", "rope_sin", "main_proj",
                      "main_norm", "latents")
DRAFT_SIZES = ("stages", "gamma", "mask_id", "hc", "iters", "hidden", "q_lora", "heads", "head_dim", "o_groups",
               "o_lora", "inter", "vocab", "rope_dim", "features", "bf16")
DRAFT_SCALARS = ("hc_eps", "hc_norm_eps", "attn_norm_eps", "ffn_norm_eps", "q_eps", "head_eps", "kv_eps", "scale",
                 "limit", "head_hc_eps", "head_norm_eps", "norm_eps", "main_norm_eps")


# Slots of the step layout `decode_index` reads: the page tables (pointers and row strides, int64), the cache's
# geometry and dummy rows, then the rotary tables (sliding, compressed) and their width. A ratio of 0: no layer of
# that kind.
DECODE_LAYOUT = ("req_to_token", "req_to_token_stride", "req_to_c128", "req_to_c128_stride", "full_to_swa_page",
                 "page_size", "window", "csa_ratio", "hca_ratio", "c128_page_size", "csa_ring", "hca_ring",
                 "swa_dummy_page", "swa_dummy_slot", "c4_dummy_row", "c128_dummy_row", "c4_state_dummy_row",
                 "c128_state_dummy_row", "cos_main", "sin_main", "cos_comp", "sin_comp", "rope_dim")
# Tokens `decode_index` takes at most (its per-token arrays live on the C stack).
INDEX_MAX_TOKENS = 64


# Every C enum (and limit) Python mirrors by hand, in the order `pdspark_abi` (kernels.c) reports them: the
# Python mirror, what it mirrors in kernels.h, and the value this file expects (the slot count of an array above,
# `decode_index`'s token limit, a layer kind's code).
ABI_MIRRORS: tuple[tuple[str, str, int], ...] = (
    ("len(DECODE_WEIGHTS)", "W_COUNT", len(DECODE_WEIGHTS)),
    ("len(DECODE_SIZES)", "I_COUNT", len(DECODE_SIZES)),
    ("len(DECODE_SCALARS)", "F_COUNT", len(DECODE_SCALARS)),
    ("len(DECODE_STEP)", "S_COUNT", len(DECODE_STEP)),
    ("len(DECODE_STEP_SIZES)", "SI_COUNT", len(DECODE_STEP_SIZES)),
    ("len(DECODE_POOLS)", "P_COUNT", len(DECODE_POOLS)),
    ("len(DECODE_LAYOUT)", "L_COUNT", len(DECODE_LAYOUT)),
    ("len(DRAFT_STAGE_WEIGHTS)", "DW_COUNT", len(DRAFT_STAGE_WEIGHTS)),
    ("len(DRAFT_HEAD_WEIGHTS)", "DH_COUNT", len(DRAFT_HEAD_WEIGHTS)),
    ("len(DRAFT_SIZES)", "DI_COUNT", len(DRAFT_SIZES)),
    ("len(DRAFT_SCALARS)", "DF_COUNT", len(DRAFT_SCALARS)),
    ("INDEX_MAX_TOKENS", "INDEX_MAX_TOKENS", INDEX_MAX_TOKENS),
    ("DECODE_SLIDING", "KIND_SLIDING", DECODE_SLIDING),
    ("DECODE_CSA", "KIND_CSA", DECODE_CSA),
    ("DECODE_HCA", "KIND_HCA", DECODE_HCA),
    ("len(PROJ_SEGMENT)", "PS_COUNT", len(PROJ_SEGMENT)),
    *((f"PROJ_FORMATS.index({f!r})", f"WF_{f.upper()}", i) for i, f in enumerate(PROJ_FORMATS)),
    ("len(INDEX_KEYS)", "KEYS_COUNT", len(INDEX_KEYS)),
    ("INDEX_KEYS.index('blocked')", "KEYS_BLOCKED", INDEX_KEYS.index("blocked")),
    ("ROW_BLOCK", "ROW_BLOCK", ROW_BLOCK),
)
# `pdspark_abi` of a library that matches this file.
ABI = tuple(value for _, _, value in ABI_MIRRORS)


def library_abi(lib: ctypes.CDLL) -> tuple[int, ...]:
    """What the library says its arrays and limits are (`pdspark_abi` in kernels.c)."""
    out = (ctypes.c_long * 64)()
    n = lib.pdspark_abi(out, 64)
    return tuple(out[: min(n, 64)])


def abi_mismatches(abi: tuple[int, ...]) -> list[str]:
    """Where the library's `pdspark_abi` contradicts `ABI_MIRRORS`, one line per enum naming both sides (a slot
    added on one side only would make the C loops read or write the wrong word); empty when they agree."""
    out = [f"{mirror} is {value} in kernel_abi.py but {c_name} is {got} in the C library"
           for (mirror, c_name, value), got in zip(ABI_MIRRORS, abi) if got != value]
    if len(abi) < len(ABI_MIRRORS):
        missing = ", ".join(c_name for _, c_name, _ in ABI_MIRRORS[len(abi):])
        out.append(f"the C library reports {len(abi)} values, not {len(ABI_MIRRORS)}: no {missing}")
    elif len(abi) > len(ABI_MIRRORS):
        out.append(f"the C library reports {len(abi)} values, {len(abi) - len(ABI_MIRRORS)} more than kernel_abi.py "
                   f"mirrors ({len(ABI_MIRRORS)})")
    return out
