"""A DSpark verify step's forward against its rows: batch 1 (gamma + 1 rows) and batch 8 (8 x (gamma + 1) rows), beside
plain decode steps (1 and 8 rows), each with what PyTorch's own kernels take for its work on this machine.

Two models: dsv4-tiny with its trained draft (its weights sit in a Zen 4's L3), and `v4-shape` (`random_checkpoint.py`:
a V4-Flash-proportioned layer, 409 MB of fp32 weights: a decode step reads them from memory) with a random draft
(`pdspark.testing.random_draft`: a verify step runs its gamma + 1 rows a request whatever its drafts are, so what the
drafts are does not change what this measures). Each model runs in a process of its own (after dsv4-tiny in the same
process, v4-shape's steps ran 1.7x slower than alone), its plain and DSpark engines taking turns prompt group by group,
`--rounds` times; the forward (`ModelRunner.run`) of every decode step is timed and keyed by its rows.

The reference of a step of R rows: the larger of what PyTorch's fp32 GEMV takes to read its weights
(`roofline.work_per_token`: the dense ones and the experts R rows are expected to touch, at the bytes the C path
reads; the GEMV over a matrix of as many bytes, out of the caches where they fit as the step's weights then are) and
what PyTorch's fp32 GEMM takes for its matmul FLOPs (R x `prefill_flops_per_token`), both measured in this run
(`roofline.machine_limits`). Not a bound: the C path's own GEMV (prefetching) reads faster than PyTorch's. What it
tells is the shape: where the reference of 8 x (gamma + 1) rows is several times that of gamma + 1 rows, the rows are
arithmetic on this machine and a batch-8 verify costs about that many times a batch-1 one with any kernel of that
speed; where it stays near 1-2x, the rows share the weight reads and a kernel could keep the batch-8 verify within a
few times the batch-1 one. Attention over the context is left out (at these lengths it is small beside the weights).

    python bench/bench_verify_rows.py [--models dsv4-tiny,v4-shape] [--rounds 3] [--threads 2]
    python bench/bench_verify_rows.py --baseline REV [--runs 3]   # the forwards at a git revision and now

With `--baseline`, each model's process runs `--runs` times at each of two revisions of `src/` (REV exported with
`git archive`, and the working tree), alternating, and the table gives each step's median forward at both: what a
change did to these steps, measured in the same hour of a VM whose speed moves from hour to hour.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from pdspark import LLM
from pdspark.llm import resolve_model
from pdspark.testing.random_draft import write_random_draft

import torch
from bench_dspark import DecodeMeter
from bench_revisions import ROOT, export_src
from random_checkpoint import random_checkpoint
from report import figure, grouped_bars, save_figure, write_json
from roofline import machine_limits, work_per_token

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


def step_reference(path: Path, rows: int, requests: int, threads: int) -> dict:
    """What PyTorch's kernels take for the weight reads and for the matmul FLOPs of a step of `rows` rows over
    `requests` requests (the module docstring), and the larger of the two, measured now."""
    work = work_per_token(path, rows)
    limits = machine_limits(threads, working_set_bytes=int(work["decode_step_bytes_read"]))
    read_s = work["decode_step_bytes_read"] / (limits["working_set_gemv_gb_s"] * 1e9)
    flops_s = rows * work["prefill_flops_per_token"] / (limits["gemm_gflops"] * 1e9)
    return {"rows": rows, "requests": requests, "read_ms": 1e3 * read_s, "flops_ms": 1e3 * flops_s,
            "reference_ms": 1e3 * max(read_s, flops_s), "larger": "flops" if flops_s > read_s else "reads",
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
                      **step_reference(path, rows, b, threads)})
    return {"model": name, "gamma": gamma, "steps": steps}


def table(result: dict) -> list[str]:
    steps = {(s["kind"], s["batch"]): s for s in result["steps"]}
    v1 = steps[("verify", 1)]
    limits = v1["limits"]
    lines = [f"\n{result['model']} (gamma {result['gamma']}): fp32 GEMM {limits['gemm_gflops']:.0f} GFLOP/s, DRAM "
             f"GEMV {limits['gemv_gb_s']:.1f} GB/s, GEMV over the batch-1 verify's "
             f"{limits['working_set_bytes'] / 1e6:.1f} MB {limits['working_set_gemv_gb_s']:.1f} GB/s (in this run)\n",
             "| step | rows | forward ms (median) | / batch-1 verify | PyTorch reference ms (reads, FLOPs) "
             "| reference / batch-1 verify's |",
             "|---|---:|---:|---:|---:|---:|"]
    for s in result["steps"]:
        lines.append(f"| {s['kind']} batch {s['batch']} | {s['rows']} | {s['forward_ms']:.2f} | "
                     f"{s['forward_ms'] / v1['forward_ms']:.2f}x | {s['reference_ms']:.2f} ({s['read_ms']:.2f}, "
                     f"{s['flops_ms']:.2f}) | {s['reference_ms'] / v1['reference_ms']:.2f}x |")
    return lines


def plot(results: list[dict]) -> None:
    fig, axes = figure(ncols=len(results), width=5 * len(results))
    for ax, result in zip(axes if len(results) > 1 else [axes], results, strict=True):
        labels = [f"{s['kind']}\nb{s['batch']} ({s['rows']} rows)" for s in result["steps"]]
        grouped_bars(ax, labels, {"measured": [s["forward_ms"] for s in result["steps"]],
                                  "PyTorch reference": [s["reference_ms"] for s in result["steps"]]},
                     "forward ms")
        ax.set_title(result["model"], fontsize=9)
    save_figure(fig, "verify_rows", "Verify step forward against its rows, with PyTorch kernels' time for its work")


def child(name: str, args, src: Path | None = None) -> dict:
    """`measure(name)` in a process of its own, with `src` (a revision's `src/`) first on its path."""
    cmd = [sys.executable, __file__, "--child", name, "--rounds", str(args.rounds), "--threads", str(args.threads)]
    env = dict(os.environ, PYTHONPATH=str(src)) if src is not None else None
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def compare_revisions(args) -> None:
    """Each model's steps at `args.baseline` and at the working tree, `args.runs` processes each, alternating."""
    forwards: dict[tuple[str, str, str], list[float]] = {}  # (model, step, revision) -> forward ms of each run
    rows: dict[tuple[str, str], int] = {}
    with tempfile.TemporaryDirectory() as tmp:
        rev, src = export_src(args.baseline, Path(tmp))
        trees = {rev: src, "current": ROOT / "src"}
        for name in args.models.split(","):
            for run in range(args.runs):
                for label in (rev, "current") if run % 2 == 0 else ("current", rev):
                    for s in child(name, args, trees[label])["steps"]:
                        step = f"{s['kind']} batch {s['batch']}"
                        forwards.setdefault((name, step, label), []).append(s["forward_ms"])
                        rows[(name, step)] = s["rows"]
                    print(f"{name}: run {run + 1}/{args.runs} at {label} done", file=sys.stderr, flush=True)
    lines = [f"| model | step | rows | {rev} forward ms | current forward ms | current / {rev} |",
             "|---|---|---:|---:|---:|---:|"]
    summary = []
    for (name, step), n in rows.items():
        base, cur = (statistics.median(forwards[(name, step, label)]) for label in (rev, "current"))
        lines.append(f"| {name} | {step} | {n} | {base:.2f} | {cur:.2f} | **{cur / base:.2f}x** |")
        summary.append({"model": name, "step": step, "rows": n, "baseline_ms": base, "current_ms": cur})
    for name in args.models.split(","):
        v = {label: [statistics.median(forwards[(name, f"verify batch {b}", label)]) for b in BATCHES]
             for label in (rev, "current")}
        lines.append(f"\n{name}: batch-8 verify / batch-1 verify: {rev} {v[rev][1] / v[rev][0]:.2f}x, current "
                     f"{v['current'][1] / v['current'][0]:.2f}x")
    print("\n".join(lines))
    write_json("verify_rows_revisions", {"args": vars(args), "baseline": rev, "summary": summary,
                                         "runs": {"/".join(k): v for k, v in forwards.items()}})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="dsv4-tiny,v4-shape")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--baseline", default=None, help="a git revision: run each model at it and now, alternating")
    parser.add_argument("--runs", type=int, default=3, help="with --baseline: processes per model and revision")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # measure this model, print its JSON
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.child:
        print(json.dumps(measure(args.child, args.rounds, args.threads)))
        return
    if args.baseline:
        compare_revisions(args)
        return
    results = [child(name, args) for name in args.models.split(",")]
    for result in results:
        print("\n".join(table(result)))
    write_json("verify_rows", {"args": vars(args), "results": results})
    plot(results)


if __name__ == "__main__":
    main()
