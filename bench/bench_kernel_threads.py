"""The C kernels' threads: a weight GEMV/GEMM and whole decode steps at 1 .. N threads, each count in its own process.

The engine's threads are the CPUs the process may use (`cpu_budget`: the affinity mask capped by the cgroup quota);
the C decode step shares each large weight GEMM among that many threads (`pool.c`: the caller and its helpers claim
parts of whole 16-row tiles). This measures how that scales on the host:
- GEMV / GEMM: `kernels.linear_rows` over a bf16 weight matrix of `--matrix-mib` MiB (64: out of the caches on most
  hosts) at 1 and 8 input rows, GB/s of weights read (medians of 20 calls).
- Decode: `--model` plain decoding at batch 1 and 8, `--output-len` greedy tokens after 128-token random prompts,
  decode tokens/s (prefill excluded, as `bench_dspark` counts them; medians of `--repeats`).

    python bench/bench_kernel_threads.py [--threads 1,2] [--model dsv4-tiny] [--matrix-mib 64]

Thread counts default to 1, 2, 4, ... up to the CPUs this process may use (and that count itself).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from pdspark import LLM
from pdspark.hardware.cpu import kernels
from pdspark.hardware.cpu.cpu_budget import usable_cpus

import torch
from bench_dspark import run
from console import log
from report import figure, save_figure, write_json

PROMPT_LEN = 128


def gemv_gb_s(rows: int, mib: int, calls: int = 20) -> float:
    """GB/s of bf16 weights read by `linear_rows` over a [N, 4096] matrix of `mib` MiB with `rows` input rows."""
    K = 4096
    w = torch.randn(mib * 2**20 // (2 * K), K).bfloat16()
    x = torch.randn(rows, K)
    times = []
    with torch.inference_mode():
        kernels.linear_rows(x, w)  # (the helpers made, the pages touched)
        for _ in range(calls):
            t0 = time.perf_counter()
            kernels.linear_rows(x, w)
            times.append(time.perf_counter() - t0)
    return w.numel() * 2 / statistics.median(times) / 1e9


def worker(threads: int, args) -> dict:
    """One thread count's figures, in this process (run as `--worker N` by `main`)."""
    torch.set_num_threads(threads)
    kernels.set_threads(threads)
    out: dict = {"threads": threads, "gemv_gb_s": gemv_gb_s(1, args.matrix_mib),
                 "gemm8_gb_s": gemv_gb_s(8, args.matrix_mib)}
    llm = LLM(args.model, max_model_len=PROMPT_LEN + args.output_len + 16, max_num_seqs=8,
              enable_prefix_cache=False)
    vocab = llm.engine.runner.model.cfg.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (PROMPT_LEN,), generator=g).tolist() for _ in range(8)]
    for batch in (1, 8):
        rates = [run(llm, prompts[:batch], batch, args.output_len)["decode_tok_s"] for _ in range(args.repeats)]
        out[f"decode_b{batch}_tok_s"] = statistics.median(rates)
    return out


def default_threads() -> list[int]:
    n, counts = usable_cpus(), []
    t = 1
    while t < n:
        counts.append(t)
        t *= 2
    return [*counts, n]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", help="comma-separated thread counts (default: 1, 2, 4, ... and the usable CPUs)")
    parser.add_argument("--model", default="dsv4-tiny")
    parser.add_argument("--matrix-mib", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        print(json.dumps(worker(args.worker, args)), flush=True)
        return
    counts = [int(t) for t in args.threads.split(",")] if args.threads else default_threads()
    rows = []
    for i, threads in enumerate(counts):
        log(f"[{i + 1}/{len(counts)}] {threads} thread(s)")
        cmd = [sys.executable, __file__, "--worker", str(threads), "--model", args.model, "--matrix-mib",
               str(args.matrix_mib), "--output-len", str(args.output_len), "--repeats", str(args.repeats)]
        done = subprocess.run(cmd, check=True, capture_output=True, text=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    base = rows[0]
    lines = [f"model {args.model}; bf16 matrix of {args.matrix_mib} MiB; usable CPUs here: {usable_cpus()}", "",
             "| threads | GEMV GB/s (1 row) | GEMM GB/s (8 rows) | decode b1 tok/s | decode b8 tok/s |",
             "|---:|---:|---:|---:|---:|"]
    for r in rows:
        cells = [f"{r[k]:.1f} ({r[k] / base[k]:.2f}x)" for k in ("gemv_gb_s", "gemm8_gb_s", "decode_b1_tok_s",
                                                                   "decode_b8_tok_s")]
        lines.append(f"| {r['threads']} | " + " | ".join(cells) + " |")
    print("\n".join(lines))
    write_json("kernel_threads", {"args": vars(args), "usable_cpus": usable_cpus(), "rows": rows})
    fig, axes = figure(2, width=9)
    xs = [r["threads"] for r in rows]
    for key, label in (("gemv_gb_s", "GEMV, 1 row"), ("gemm8_gb_s", "GEMM, 8 rows")):
        axes[0].plot(xs, [r[key] for r in rows], marker="o", label=label)
    axes[0].set_xlabel("threads")
    axes[0].set_ylabel("GB/s of bf16 weights read")
    axes[0].legend()
    for key, label in (("decode_b1_tok_s", "batch 1"), ("decode_b8_tok_s", "batch 8")):
        axes[1].plot(xs, [r[key] for r in rows], marker="o", label=label)
    axes[1].set_xlabel("threads")
    axes[1].set_ylabel("decode tokens/s")
    axes[1].legend()
    save_figure(fig, "kernel_threads", f"C kernels' threads: {args.model}, {args.matrix_mib} MiB GEMV")


if __name__ == "__main__":
    main()
