"""Decode speed when the engine shares its cores: OpenMP threads that spin after each parallel region vs threads
that sleep at once (`OMP_WAIT_POLICY`), alone and beside a busy process.

An engine process runs three kinds of threads on its cores: torch's OpenMP team (the main thread and
`threads - 1` workers, which by libgomp's default spin ~300,000 times after each parallel region before they
sleep), the C kernels' GEMM helper (`hardware/cpu/pool.c`, spins 200 us for the next offer), and the main thread
itself. On 2 cores that is already one thread too many; a spinning OpenMP worker holds a core the helper or the main
thread needs, and when another process also wants a core (a router, Mooncake's threads, a neighbour on the node)
the kernel's time slices, milliseconds long, land between the step's microsecond-apart kernels.

Each variant is a child process (the policy is read when libgomp loads, with torch): `spin` (the variable unset:
libgomp's default) and `passive` (what `import pdspark` sets unless the variable is already set). Each child
decodes the held-out prompts plainly and with DSpark at batch 1 and 8 (`bench_dspark.run`) and reports decode
tokens/s and the process's CPU seconds per generated token (prefill included). Each variant runs alone and beside
a busy-looping process (one core's worth of competing work; `--no-busy`: alone only). Variants alternate within
every round; medians of `--rounds`.

    python bench/bench_cpu_contention.py [--rounds 3] [--prompts 4] [--output-len 64] [--batches 1,8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from console import log
from report import figure, grouped_bars, save_figure, write_json

BENCH = Path(__file__).resolve().parent
POLICIES = {"spin": None, "passive": "PASSIVE"}  # None: unset, libgomp's default (spin, then sleep)
MODES = ("plain", "dspark")


def child(args: argparse.Namespace) -> None:
    """One variant: decode tok/s and CPU s per token for every mode and batch, as one JSON line."""
    import resource

    from pdspark import LLM
    from pdspark.llm import resolve_model

    import torch
    from bench_dspark import heldout_prompts, run

    torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    prompts = heldout_prompts(Path(path), args.prompts, args.prompt_len, seed=7)
    opts = dict(max_model_len=args.prompt_len + args.output_len + 64, max_num_seqs=16, enable_prefix_cache=False)
    engines = {"plain": LLM(path, **opts), "dspark": LLM(path, speculative="dspark", **opts)}
    for llm in engines.values():  # warm-up: first-call costs (buffers, the C kernels' helper thread)
        run(llm, prompts[:1], 1, 8)
    out = {}
    for mode, llm in engines.items():
        for b in args.batches:
            batch_prompts = prompts * max(1, b // len(prompts))
            cpu0 = resource.getrusage(resource.RUSAGE_SELF)
            r = run(llm, batch_prompts, b, args.output_len)
            cpu1 = resource.getrusage(resource.RUSAGE_SELF)
            cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
            out[f"{mode} b{b}"] = {"tok_s": r["decode_tok_s"], "cpu_ms_per_token": 1e3 * cpu / max(1, r["tokens"])}
    print(json.dumps(out), flush=True)


def variant(args: argparse.Namespace, policy: str, busy: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if POLICIES[policy] is not None:
        env["OMP_WAIT_POLICY"] = POLICIES[policy]
    else:
        env["PDSPARK_OMP_WAIT_POLICY"] = "default"  # `import pdspark` leaves the variable unset
    burner = None
    if busy:  # one core's worth of competing work, at the same priority
        burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        cmd = [sys.executable, str(Path(__file__)), "--child", "--model", args.model, "--prompts", str(args.prompts),
               "--prompt-len", str(args.prompt_len), "--output-len", str(args.output_len), "--threads",
               str(args.threads), "--batches", ",".join(map(str, args.batches))]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, check=False)
    finally:
        if burner is not None:
            burner.kill()
            burner.wait()
    if done.returncode != 0:
        raise RuntimeError(f"{policy} child failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="dsv4-tiny")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-busy", action="store_true", help="only the runs alone")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.batches = [int(b) for b in str(args.batches).split(",")]
    if args.child:
        return child(args)
    settings = [(p, busy) for busy in ((False,) if args.no_busy else (False, True)) for p in POLICIES]
    results: dict[tuple[str, bool], list[dict]] = {s: [] for s in settings}
    for r in range(args.rounds):
        for policy, busy in settings:
            got = variant(args, policy, busy)
            results[(policy, busy)].append(got)
            log(f"[{r + 1}/{args.rounds}] {policy:<7} {'busy' if busy else 'alone':<5}: " + ", ".join(
                f"{k} {v['tok_s']:.0f} tok/s" for k, v in got.items()))
    keys = list(results[settings[0]][0])

    def med(policy: str, busy: bool, key: str, field: str) -> float:
        return statistics.median(x[key][field] for x in results[(policy, busy)])

    lines = [f"decode tok/s (medians of {args.rounds} rounds; process CPU ms per generated token, prefill included, "
             f"in brackets), {args.threads} threads, {args.prompts} held-out prompts x {args.output_len} tokens, "
             f"{args.model}", "",
             "| run | alongside | spin tok/s | passive tok/s | passive / spin |", "|---|---|---:|---:|---:|"]
    summary = []
    for busy in sorted({b for _, b in settings}):
        for key in keys:
            s, p = med("spin", busy, key, "tok_s"), med("passive", busy, key, "tok_s")
            sc, pc = med("spin", busy, key, "cpu_ms_per_token"), med("passive", busy, key, "cpu_ms_per_token")
            where = "a busy process" if busy else "nothing"
            lines.append(f"| {key} | {where} | {s:.0f} ({sc:.2f}) | {p:.0f} ({pc:.2f}) | {p / s:.2f}x |")
            summary.append({"run": key, "busy": busy, "spin_tok_s": s, "passive_tok_s": p, "spin_cpu_ms": sc,
                            "passive_cpu_ms": pc, "ratio": p / s})
    print("\n".join(lines))
    write_json("cpu_contention", {"args": {k: v for k, v in vars(args).items() if k != "child"},
                                  "summary": summary, "rounds": {f"{p} {'busy' if b else 'alone'}": v
                                                                 for (p, b), v in results.items()}})
    fig, ax = figure(1, width=8)
    labels = [f"{x['run']}\n{'busy' if x['busy'] else 'alone'}" for x in summary]
    grouped_bars(ax, labels, {"spin (libgomp default)": [x["spin_tok_s"] for x in summary],
                              "passive": [x["passive_tok_s"] for x in summary]}, "decode tok/s")
    save_figure(fig, "cpu_contention", "Decode tok/s: OpenMP threads spinning vs sleeping, alone and beside a busy "
                "process")


if __name__ == "__main__":
    sys.path.insert(0, str(BENCH))
    main()
