"""This machine's fp32 limits, measured in the benchmark's own run, and a checkpoint's work per token.

An engine figure means little without the machine's limit beside it: batch-1 decode is bound by reading the active
weights once per token (a GEMV streams them from memory), prefill by the matmul FLOPs. `machine_limits` measures
both with PyTorch's own fp32 kernels on the benchmark's thread count; `work_per_token` counts a DSV4 checkpoint's
active weights (every tensor but the embedding table, whose one row per token is a gather, with the routed experts
scaled by top-k / experts) in the fp32 bytes the engine computes in. Attention over the context (KV reads, scores)
is left out of both: at the benchmarks' lengths it is small next to the weights, so the fractions are upper bounds.
Beside the DRAM GEMV, the same GEMV over a decode step's own working set (`working_set_bytes`): where the weights
fit in the caches that is the limit, and the fraction of it is the honest one.
"""

from __future__ import annotations

import functools
import json
import statistics
import time
from pathlib import Path

# Sizes: the GEMM is compute-bound and cache-friendly; the GEMV's matrix (64 MiB) is far larger than any cache,
# so each call streams it from memory as a decode step streams the weights.
_GEMM_N = 1024
_GEMV_ROWS, _GEMV_COLS = 4096, 4096
_WS_COLS = 1024  # the working-set GEMV's row length (a decode step's matrices are a few hundred to a few thousand)


def _median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up (first-touch of the buffers, thread pool start)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def machine_limits(threads: int, repeats: int = 15, working_set_bytes: int | None = None) -> dict:
    """fp32 GEMM GFLOP/s (`[N, N] @ [N, N]`) and GEMV GB/s (weight bytes read per second by `F.linear` of one
    row) with `threads` intra-op threads; medians of `repeats` calls.

    `gemv_gb_s` streams a 64 MiB matrix from DRAM. With `working_set_bytes` (what one decode step reads) also
    `working_set_gemv_gb_s`: a GEMV over a matrix of that many bytes, called again and again as decode steps are,
    so it stays in the caches exactly when the model's weights would (the limit a small model's decode meets on a
    host whose L2/L3 holds it; the DRAM figure would flatter such a run)."""
    import torch
    import torch.nn.functional as F

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(_GEMM_N, _GEMM_N), torch.randn(_GEMM_N, _GEMM_N)
        gemm_s = _median_seconds(lambda: torch.mm(a, b), repeats)
        w, x = torch.randn(_GEMV_ROWS, _GEMV_COLS), torch.randn(1, _GEMV_COLS)
        gemv_s = _median_seconds(lambda: F.linear(x, w), repeats)
        out = {"threads": threads, "gemm_gflops": 2 * _GEMM_N**3 / gemm_s / 1e9,
               "gemv_gb_s": w.numel() * w.element_size() / gemv_s / 1e9}
        if working_set_bytes:
            rows = max(1, working_set_bytes // (4 * _WS_COLS))
            ws, xs = torch.randn(rows, _WS_COLS), torch.randn(1, _WS_COLS)
            ws_s = _median_seconds(lambda: F.linear(xs, ws), max(repeats, 50))
            out.update(working_set_bytes=ws.numel() * 4, working_set_gemv_gb_s=ws.numel() * 4 / ws_s / 1e9)
    finally:
        torch.set_num_threads(before)
    return out


@functools.cache
def _weight_counts(path: str) -> tuple[int, int, int, int]:
    """`(dense, routed)` values of a checkpoint's weights (the embedding left out), then the bytes of each as the C
    decode path reads them (a matrix whose values are all bf16 numbers at 2 bytes a value). Read once per run."""
    from safetensors import safe_open

    dense = routed = 0
    dense_read = routed_read = 0
    with safe_open(str(Path(path) / "model.safetensors"), "pt") as f:
        for name in f.keys():  # noqa: SIM118  (safe_open is not iterable)
            if "embed_tokens" in name:
                continue
            t = f.get_tensor(name)
            n = t.numel()
            halves = t.dim() >= 2 and t.is_floating_point() and bool((t.bfloat16().float() == t.float()).all())
            if ".experts." in name:
                routed += n
                routed_read += n * (2 if halves else 4)
            else:
                dense += n
                dense_read += n * (2 if halves else 4)
    return dense, routed, dense_read, routed_read


def work_per_token(path: str | Path, batch: int = 1) -> dict:
    """Active weight bytes one decode step of `batch` rows reads, and matmul FLOPs per prompt token.

    With `batch` rows a step reads each expert's weights once if any row routes to it: the expected share of
    experts touched, `1 - (1 - k/E)^batch`, for independent uniform routing. `decode_step_bytes` counts fp32 (the
    model's tensors); `decode_step_bytes_read` counts a matrix whose values are all bf16 numbers at 2 bytes a
    value, as the C decode path stores its projections and head then (`kernels.bf16_copy`)."""
    cfg = json.loads((Path(path) / "config.json").read_text())
    share = cfg["num_experts_per_tok"] / cfg["n_routed_experts"]
    touched = 1 - (1 - share) ** batch
    dense, routed, dense_read, routed_read = _weight_counts(str(path))
    return {
        "decode_step_bytes": 4 * (dense + routed * touched),
        "decode_step_bytes_read": dense_read + routed_read * touched,
        "decode_bytes_per_token": 4 * (dense + routed * touched) / batch,
        "prefill_flops_per_token": 2 * (dense + routed * share),
    }
