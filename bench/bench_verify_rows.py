"""A DSpark verify step's forward against its rows: batch 1 (gamma + 1 rows) and batch 8 (8 x (gamma + 1) rows), beside
plain decode steps (1 and 8 rows), with the bound this machine puts on each.

Two models: dsv4-tiny with its trained draft (its weights sit in a Zen 4's L3), and `v4-shape` (`random_checkpoint.py`:
a V4-Flash-proportioned layer, 409 MB of fp32 weights: a decode step reads them from memory) with a random draft
(`pdspark.testing.random_draft`: a verify step runs its gamma + 1 rows a request whatever its drafts are, so what the
drafts are does not change what this measures). Each model's plain and DSpark engines take turns prompt group by group,
`--rounds` times; the forward (`ModelRunner.run`) of every decode step is timed and keyed by its rows.

The bound of a step of R rows: the larger of reading its weights (`roofline.work_per_token`: the dense ones and the
experts R rows are expected to touch, at the bytes the C path reads) at the GEMV rate over that many bytes, and its
matmul FLOPs (R x `prefill_flops_per_token`) at the fp32 GEMM rate; both rates measured in this run with PyTorch's
kernels (`roofline.machine_limits`). Where the bound of 8 x (gamma + 1) rows is more than 3x that of gamma + 1 rows,
no kernel makes a batch-8 verify cost within 3x of a batch-1 one on this machine: the rows are arithmetic, not reads.
Attention over the context is left out of the bound (at these lengths it is small beside the weights).

    python bench/bench_verify_rows.py [--models dsv4-tiny,v4-shape] [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

import torch
from bench_dspark import DecodeMeter
from random_checkpoint import random_checkpoint
from report import figure, grouped_bars, save_figure, write_json
from roofline import machine_limits, work_per_token

from pdspark import LLM
from pdspark.llm import resolve_model
from pdspark.testing.random_draft import write_random_draft

BATCHES = (1, 8)
PROMPT_LEN, OUTPUT_LEN = 64, 32


def with_draft(name: str) -> Path:
    """The checkpoint `name` with a DSpark draft: dsv4-tiny's own; for a `random_checkpoint` one, a directory of
    links to its files plus a random gamma-5 draft (dsv4-tiny's gamma), made once beside it."""
    if name == "dsv4-tiny":
        return Path(resolve_model(name))
    src = random_checkpoint(name)
    out = src.with_name(f"{src.name}-draft")
    if not (out / "dspark.safetensors").exists():
        out.mkdir(exist_ok=True)
        for f in src.iterdir():
            link = out / f.name
            if not link.exists():
                link.symlink_to(f)
        write_random_draft(out, gamma=5, seed=0)
    return out


def step_bound(path: Path, rows: int, requests: int, threads: int) -> dict:
    """The larger of the weight reads and the matmul FLOPs of a step of `rows` rows over `requests` requests: the
    reads at the rate of a GEMV over as many bytes (out of the caches where they fit, as the step's weights then
    are), the FLOPs at the fp32 GEMM rate, both measured now."""
    work = work_per_token(path, rows)
    limits = machine_limits(threads, working_set_bytes=int(work["decode_step_bytes_read"]))
    read_s = work["decode_step_bytes_read"] / (limits["working_set_gemv_gb_s"] * 1e9)
    flops_s = rows * work["prefill_flops_per_token"] / (limits["gemm_gflops"] * 1e9)
    return {"rows": rows, "requests": requests, "read_ms": 1e3 * read_s, "flops_ms": 1e3 * flops_s,
            "bound_ms": 1e3 * max(read_s, flops_s), "bound_by": "flops" if flops_s > read_s else "reads",
            "limits": limits}


def measure(name: str, rounds: int, threads: int) -> dict:
    path = with_draft(name)
    opts = dict(max_model_len=PROMPT_LEN + OUTPUT_LEN + 64, max_num_seqs=16, enable_prefix_cache=False)
    engines = {"plain": LLM(str(path), **opts), "verify": LLM(str(path), speculative="dspark", **opts)}
    gamma = engines["verify"].engine.drafter.gamma
    meters = {kind: DecodeMeter(llm, OUTPUT_LEN) for kind, llm in engines.items()}
    rng = random.Random(0)
    vocab = engines["plain"].engine.model_config.vocab_size
    times: dict[tuple[str, int], list[float]] = {}
    for r in range(rounds + 1):  # round 0 warms up (first touch of the weights and the pools), not counted
        for b in BATCHES:
            prompts = [[rng.randrange(10, vocab) for _ in range(PROMPT_LEN)] for _ in range(b)]
            for kind, meter in meters.items():
                meter.reset()
                meter.group(prompts)
                rows = b * (gamma + 1 if kind == "verify" else 1)  # every request in the step
                if r:
                    times.setdefault((kind, b), []).extend(meter.forward.times.get(rows, []))
        print(f"{name}: round {r}/{rounds} done", file=sys.stderr, flush=True)
    steps = []
    for (kind, b), ts in sorted(times.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        rows = b * (gamma + 1 if kind == "verify" else 1)
        steps.append({"kind": kind, "batch": b, "steps": len(ts), "forward_ms": 1e3 * statistics.median(ts),
                      **step_bound(path, rows, b, threads)})
    return {"model": name, "gamma": gamma, "steps": steps}


def table(result: dict) -> list[str]:
    steps = {(s["kind"], s["batch"]): s for s in result["steps"]}
    v1 = steps[("verify", 1)]
    limits = v1["limits"]
    lines = [f"\n{result['model']} (gamma {result['gamma']}): fp32 GEMM {limits['gemm_gflops']:.0f} GFLOP/s, DRAM "
             f"GEMV {limits['gemv_gb_s']:.1f} GB/s, GEMV over the batch-1 verify's "
             f"{limits['working_set_bytes'] / 1e6:.1f} MB {limits['working_set_gemv_gb_s']:.1f} GB/s (in this run)\n",
             "| step | rows | forward ms (median) | / batch-1 verify | bound ms (reads, FLOPs) "
             "| bound / batch-1 verify's |",
             "|---|---:|---:|---:|---:|---:|"]
    for s in result["steps"]:
        lines.append(f"| {s['kind']} batch {s['batch']} | {s['rows']} | {s['forward_ms']:.2f} | "
                     f"{s['forward_ms'] / v1['forward_ms']:.2f}x | {s['bound_ms']:.2f} ({s['read_ms']:.2f}, "
                     f"{s['flops_ms']:.2f}) | {s['bound_ms'] / v1['bound_ms']:.2f}x |")
    return lines


def plot(results: list[dict]) -> None:
    fig, axes = figure(ncols=len(results), width=5 * len(results))
    for ax, result in zip(axes if len(results) > 1 else [axes], results, strict=True):
        labels = [f"{s['kind']}\nb{s['batch']} ({s['rows']} rows)" for s in result["steps"]]
        grouped_bars(ax, labels, {"measured": [s["forward_ms"] for s in result["steps"]],
                                  "bound": [s["bound_ms"] for s in result["steps"]]}, "forward ms")
        ax.set_title(result["model"], fontsize=9)
    save_figure(fig, "verify_rows", "Verify step forward against its rows, with this machine's bound")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="dsv4-tiny,v4-shape")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = [measure(name, args.rounds, args.threads) for name in args.models.split(",")]
    for result in results:
        print("\n".join(table(result)))
    write_json("verify_rows", {"args": vars(args), "results": results})
    plot(results)


if __name__ == "__main__":
    main()
