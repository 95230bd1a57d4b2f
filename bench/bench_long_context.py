"""Decode cost against context length: one request's decode step at 1k, 4k, 16k and 64k tokens of context, with CSA
attending to the indexer's `index_topk` picked entries (`model.indexer.picked_entries`) against the same step
attending through a mask over every visible entry (the path before: same picks, same tokens).

Two models, each with its position range at 128k: dsv4-tiny's weights, and `v4-shape` (`random_checkpoint.py`), a
random DSV4 whose indexer weighs against its layers what V4-Flash's does (dsv4-tiny's is ~11x heavier). Each
context runs in a process of its own with one engine, as a serving process holds (engines sharing a process slowed
one another unevenly: each holds its own weights), `--rounds` times, the contexts' order reversed every other round
so that a slow spell of the VM falls on all alike: a random prompt of that length is prefilled, then `--steps`
greedy decode steps are timed one by one (`Engine.step`; the first `--settle` not counted; medians over the
rounds). In the first round's processes the module path then decodes the same prompt twice, through the picked rows
and through the mask (`--module-steps`), for the same tokens, and the lightning indexer's C pick is timed alone at
that length (its scoring is O(entries) by design, the one part that must grow), with its share of the step, the
pools' bytes and the process's resident memory. Each model runs with each cache of `--kv-cache-dtypes`: the
fp32 rows the reference computes (`auto`), and the FP8 cache (`fp8_e4m3`: main KV rows 448 e4m3 + 64 bf16 channels,
indexer keys e4m3 with a scale, 132 bytes an entry where V4's fp32 keys take 512), as V4's deployments keep it; the
C step reads and writes both. Target (issue: performance against the peers): the 64k step <= 1.5x the 4k step, and
the same tokens on all paths.

    python bench/bench_long_context.py [--models dsv4-tiny,v4-shape] [--contexts 1024,4096,16384,65536]
        [--kv-cache-dtypes auto,fp8_e4m3] [--baseline REV]

With `--baseline REV`, every round runs each context's process at REV's `src/` (exported with `git archive`) and at
the working tree's, the revisions' order alternating from round to round, and a table compares them context by
context (medians of the rounds' medians; each revision's first round checks its own tokens and times its indexer).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pdspark import SamplingParams
from pdspark.assets import resolve_model
from pdspark.engine.factory import create_engine
from pdspark.model import indexer as indexer_module
from pdspark.model.batch import CompressedIndex
from pdspark.model.packed_rows import PackedRows

import torch
from bench_revisions import export_src
from console import log
from random_checkpoint import CONFIGS, random_checkpoint
from report import figure, save_figure, write_json
from resident_memory import rss_mb

_CACHE = Path.home() / ".cache" / "pdspark-bench"
POSITIONS = 131072
PAGE_SIZE = 128


def long_model(name: str) -> Path:
    """`name`'s checkpoint with its position range raised to `POSITIONS` (a copy; rope tables are computed); a random
    config of `random_checkpoint.py` is built with it."""
    if name in CONFIGS:
        return random_checkpoint(name)
    src = Path(resolve_model(name))
    out = _CACHE / f"{src.name}-{POSITIONS}"
    if not (out / "model.safetensors").exists():
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(src, tmp)
        config = json.loads((tmp / "config.json").read_text())
        config["max_position_embeddings"] = POSITIONS
        config.pop("dspark", None)
        (tmp / "config.json").write_text(json.dumps(config, indent=1))
        for f in tmp.glob("dspark*"):
            f.unlink()
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    return out


@contextlib.contextmanager
def dense_mask():
    """The path before: decode tokens attend through a mask over every visible CSA entry (the same picks). The whole
    step's C path compacts inside C, so the module path runs in both modes here (`Engine`'s C step off)."""
    saved = indexer_module.picked_entries
    indexer_module.picked_entries = lambda csa, picked, k: CompressedIndex(csa.rows, picked, csa.max_visible)
    try:
        yield
    finally:
        indexer_module.picked_entries = saved


def prefilled(engine, prompt: list[int], max_tokens: int) -> tuple[str, float]:
    """Add `prompt` (greedy, `max_tokens`) and step until its first token: its id and the prefill's time (s)."""
    t0 = time.perf_counter()
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    while not engine.requests[rid].output_token_ids:
        engine.step()
    return rid, time.perf_counter() - t0


def decode_steps(engine, prompt: list[int], steps: int) -> tuple[list[float], list[int], float]:
    """Step times (s) of `steps` greedy decode steps after the prompt's prefill, the tokens, the prefill's time."""
    rid, prefill_s = prefilled(engine, prompt, steps + 1)
    times: list[float] = []
    while engine.has_unfinished:
        s = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - s)
    tokens = list(engine.requests[rid].output_token_ids)
    engine.release(rid)
    return times, tokens, prefill_s


def indexer_ms(engine, visible: int, page_size: int, repeats: int = 50) -> float:
    """The C indexer pick of one decode token over `visible` entries (scores and top-k), every CSA layer of the
    model (ms, median): read from the engine's own indexer-key pool, a page's entries together and the pages in a
    random order, as a request's pages lie in the pool."""
    from pdspark.hardware.cpu import kernels

    cfg = engine.runner.model.cfg
    csa = engine.kv.model.csa_layers
    view = engine.kv.pools.layer(csa[0]).index_kv  # [rows, D]: a per-layer view of the page-major pool
    pool_keys = getattr(indexer_module, "pool_keys", None)
    if pool_keys is not None:
        keys, layout = pool_keys(view)  # what the C pick reads of it (fp32 rows, FP8 rows, blocks)
        pick = functools.partial(kernels.index_pick, layout=layout)
    else:  # (a --baseline revision before `pool_keys`: index_pick took the FP8 cache's rows as `packed`)
        keys = view.storage if isinstance(view, PackedRows) else view
        pick = functools.partial(kernels.index_pick, packed=isinstance(view, PackedRows))
    H, D = cfg.index_n_heads, cfg.index_head_dim
    q, w = torch.randn(1, H, D), torch.rand(1, H)
    per_page = page_size // cfg.csa_ratio
    pages = torch.randperm(view.shape[0] // per_page)[: -(-visible // per_page)]
    rows = (pages[:, None] * per_page + torch.arange(per_page)).flatten()[None, :visible].contiguous()
    valid = torch.ones(1, visible, dtype=torch.bool)
    layers = len(csa)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        picked = pick(q, w, keys, rows, valid, D**-0.5, cfg.index_topk)
        times.append(time.perf_counter() - t0)
        assert picked is not None
    return 1e3 * layers * statistics.median(times)


def new_engine(model: Path, context: int, steps: int, kv_cache_dtype: str):
    return create_engine(str(model), page_size=PAGE_SIZE, max_model_len=context + steps + 8, max_num_seqs=1,
                         max_num_batched_tokens=2048, enable_prefix_cache=False, kv_cache_dtype=kv_cache_dtype)


def measure_context(name: str, context: int, steps: int, settle: int, module_steps: int, probe: bool, seed: int,
                    kv_cache_dtype: str) -> dict:
    """One process's measurement (`--child`): its one engine prefills the prompt of `context` tokens, then times
    `steps` C decode steps (the first `settle` not counted); with `probe`, the indexer's pick is timed alone, and with
    `module_steps` too, the module path then decodes the same prompt through the picked rows and through the mask for
    the same tokens."""
    model = long_model(name)
    engine = new_engine(model, context, steps, kv_cache_dtype)
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, engine.runner.model.cfg.vocab_size, (context,), generator=g).tolist()
    rid, prefill_s = prefilled(engine, prompt, steps + 2)  # (never done early)
    times = []
    for i in range(steps):
        s = time.perf_counter()
        engine.step()
        if i >= settle:
            times.append(time.perf_counter() - s)
    tokens = list(engine.requests[rid].output_token_ids)[: module_steps + 1]
    while engine.has_unfinished:
        engine.step()
    engine.release(rid)
    out = {"context": context, "prefill_s": prefill_s, "step_s": times, "rss_mb": rss_mb(),
           "c_path_steps_missed": sum(engine.stats.fast_path_fallback_steps.values())}
    model_obj = engine.runner.model
    if probe:
        out.update(indexer_ms=indexer_ms(engine, context // model_obj.cfg.csa_ratio, PAGE_SIZE),
                   visible_csa_entries=context // model_obj.cfg.csa_ratio,
                   pools_mb=sum(t.numel() * t.element_size() for t in vars(engine.kv.pools).values()
                                if isinstance(t, torch.Tensor)) / 2**20,
                   module_gathered_step_ms=None, module_mask_step_ms=None, same_tokens=None)
    if probe and module_steps:
        saved, model_obj._decode_step = model_obj._decode_step, None  # the module path, gathered then masked
        module_times, module_tokens, _ = decode_steps(engine, prompt, module_steps)
        with dense_mask():
            mask_times, mask_tokens, _ = decode_steps(engine, prompt, module_steps)
        model_obj._decode_step = saved
        out.update(module_gathered_step_ms=1e3 * statistics.median(module_times),
                   module_mask_step_ms=1e3 * statistics.median(mask_times),
                   same_tokens=tokens == module_tokens == mask_tokens)
    return out


def measure_model(name: str, kv_cache_dtype: str, contexts: list[int], rounds: int, steps: int, settle: int,
                  module_steps: int, seed: int, src: Path | None = None, first_round: int = 0) -> list[dict]:
    """Every context's row for model `name` over a `kv_cache_dtype` cache: `rounds` rounds of one process per context
    (one engine, as a serving process holds), the contexts' order reversed every other round so that a slow spell of
    the VM falls on all alike; the module path and the indexer alone in the first round's processes. The step is the
    median over the rounds' steps; the prefill the first round's. `src`: the `src/` the processes import (None: the
    installed package); `first_round`: the number of the first of these rounds (its order; the probes in round 0)."""
    runs: dict[int, list[dict]] = {c: [] for c in contexts}
    env = dict(os.environ, PYTHONPATH=str(src)) if src is not None else None
    for r in range(first_round, first_round + rounds):
        for context in contexts if r % 2 == 0 else contexts[::-1]:
            log(f"{name} ({kv_cache_dtype} cache), context {context}, round {r + 1}: prefill and {steps} steps"
                + (f" ({src})" if src is not None else ""))
            cmd = [sys.executable, __file__, "--child", name, str(context), str(steps), str(settle),
                   str(module_steps), str(int(r == 0)), str(seed), kv_cache_dtype]
            run = json.loads(subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True,
                                            env=env).stdout.splitlines()[-1])
            runs[context].append(run)
            log(f"  prefill {run['prefill_s']:.1f} s, C step {1e3 * statistics.median(run['step_s']):.2f} ms")
    rows = []
    for context in contexts:
        first = runs[context][0]
        step = statistics.median([t for run in runs[context] for t in run["step_s"]])
        rows.append({"model": name, "kv_cache_dtype": kv_cache_dtype,
                     **{k: v for k, v in first.items() if k != "step_s"}, "step_ms": 1e3 * step,
                     "c_path_steps_missed": sum(run["c_path_steps_missed"] for run in runs[context]),
                     "round_step_ms": [1e3 * statistics.median(run["step_s"]) for run in runs[context]],
                     "indexer_share": first["indexer_ms"] / (1e3 * step) if "indexer_ms" in first else None,
                     "steps": steps - settle,
                     "rounds": rounds, "module_steps": module_steps})
    return rows


def print_table(rows: list[dict]) -> None:
    """One model's rows as a markdown table, each against the 4k row (`vs_4k` and `rest_vs_4k` added to the rows)."""
    base = next((r for r in rows if r["context"] == 4096), rows[0])
    # The step less the indexer: what must stay flat (the indexer scores every visible entry by design).
    rest = {r["context"]: r["step_ms"] - r["indexer_ms"] for r in rows}
    print(f"\n{rows[0]['model']}, {rows[0]['kv_cache_dtype']} cache\n")
    print("| context | C step ms (per round) | vs 4k | step less indexer, vs 4k | module step ms (picked rows) | "
          "module step ms (mask) | indexer ms (share) | CSA entries | pools MB | RSS MB | prefill s | same tokens |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    for r in rows:
        r["vs_4k"] = r["step_ms"] / base["step_ms"]
        r["rest_vs_4k"] = rest[r["context"]] / rest[base["context"]]
        per_round = ", ".join(f"{v:.2f}" for v in r["round_step_ms"])
        print(f"| {r['context']} | {r['step_ms']:.2f} ({per_round}) | {r['vs_4k']:.2f}x | "
              f"{rest[r['context']]:.2f} ms, {r['rest_vs_4k']:.2f}x | "
              f"{ms(r['module_gathered_step_ms'])} | {ms(r['module_mask_step_ms'])} | "
              f"{r['indexer_ms']:.2f} ({100 * r['indexer_share']:.0f}%) | {r['visible_csa_entries']} | "
              f"{r['pools_mb']:.1f} | {r['rss_mb']:.0f} | {r['prefill_s']:.1f} | "
              f"{'-' if r['same_tokens'] is None else r['same_tokens']} |")


def compare_revisions(args, runs: list[tuple[str, str]], contexts: list[int]) -> None:
    """`--baseline`: every (model, cache)'s contexts at `args.baseline`'s `src/` and at the working tree's, round by
    round, the revisions' order alternating; per revision `print_table`'s table, then one comparing them."""
    with tempfile.TemporaryDirectory() as tmp:
        rev, src = export_src(args.baseline, Path(tmp))
        revisions: list[tuple[str, Path | None]] = [(rev, src), ("now", None)]
        rounds: dict[tuple[str, str, str], list[list[dict]]] = {}
        for r in range(args.rounds):
            for name, dtype in runs:
                for label, path in revisions if r % 2 == 0 else revisions[::-1]:
                    rows = measure_model(name, dtype, contexts, 1, args.steps, args.settle, args.module_steps,
                                         args.seed, src=path, first_round=r)
                    rounds.setdefault((label, name, dtype), []).append(rows)
    merged = {key: _merged_rounds(per_round) for key, per_round in rounds.items()}
    for rows in merged.values():
        print_table(rows)
    print(f"\n{rev} against now (medians of the rounds' medians, ms)\n")
    print(f"| model | cache | context | {rev} step (rounds) | now step (rounds) | now / {rev} | {rev} vs 4k | "
          f"now vs 4k | indexer alone ({rev}, now) | same tokens ({rev}, now) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    summary = []
    for name, dtype in runs:
        before, after = merged[(rev, name, dtype)], merged[("now", name, dtype)]
        for b, a in zip(before, after):
            row = {"model": name, "kv_cache_dtype": dtype, "context": b["context"], "baseline_ms": b["step_ms"],
                   "current_ms": a["step_ms"], "baseline_rounds_ms": b["round_step_ms"],
                   "current_rounds_ms": a["round_step_ms"], "baseline_vs_4k": b["vs_4k"], "current_vs_4k": a["vs_4k"],
                   "baseline_indexer_ms": b["indexer_ms"], "current_indexer_ms": a["indexer_ms"],
                   "same_tokens": [b["same_tokens"], a["same_tokens"]]}
            summary.append(row)

            def rounds_text(ms: list[float]) -> str:
                return ", ".join(f"{v:.2f}" for v in ms)

            print(f"| {name} | {dtype} | {b['context']} | {b['step_ms']:.2f} ({rounds_text(b['round_step_ms'])}) | "
                  f"{a['step_ms']:.2f} ({rounds_text(a['round_step_ms'])}) | {a['step_ms'] / b['step_ms']:.2f}x | "
                  f"{b['vs_4k']:.2f}x | {a['vs_4k']:.2f}x | {b['indexer_ms']:.2f}, {a['indexer_ms']:.2f} | "
                  f"{b['same_tokens']}, {a['same_tokens']} |")
    write_json("long_context_revisions", {"args": vars(args), "baseline": rev, "summary": summary,
                                          "rows": {f"{k[0]} {k[1]} {k[2]}": v for k, v in merged.items()}})
    fig, axes = figure(ncols=len(runs), width=4.0 * len(runs))
    for ax, (name, dtype) in zip(axes if len(runs) > 1 else [axes], runs):
        for (label, _), style in zip(revisions, ("o--", "o-")):
            rows = merged[(label, name, dtype)]
            xs = [r["context"] for r in rows]
            ax.plot(xs, [r["step_ms"] for r in rows], style, label=f"C step, {label}")
            ax.plot(xs, [r["indexer_ms"] for r in rows], style.replace("o", "x"), label=f"indexer alone, {label}")
        _context_axes(ax, name, dtype)
    save_figure(fig, "long_context_revisions", f"decode step vs context: {rev} and now")


def _context_axes(ax, name: str, dtype: str) -> None:
    """One (model, cache) plot's axes: context and step time on log scales, its title and legend."""
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_title(f"{name}, {dtype} cache", fontsize=8)
    ax.set_xlabel("context tokens")
    ax.set_ylabel("ms per decode step (median)")
    ax.legend(fontsize=6)


def _merged_rounds(per_round: list[list[dict]]) -> list[dict]:
    """One revision's rows of several one-round `measure_model` calls as one: the first round's (its probes), with
    every round's step median and their median as the step."""
    rows = [dict(row) for row in per_round[0]]
    for i, row in enumerate(rows):
        row["round_step_ms"] = [rounds[i]["round_step_ms"][0] for rounds in per_round]
        row["step_ms"] = statistics.median(row["round_step_ms"])
        row["indexer_share"] = row["indexer_ms"] / row["step_ms"]
        row["c_path_steps_missed"] = sum(rounds[i]["c_path_steps_missed"] for rounds in per_round)
        row["rounds"] = len(per_round)
    return rows


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":  # one context's process (`measure_context`)
        name, (context, steps, settle, module_steps, probe, seed), dtype = sys.argv[2], map(int, sys.argv[3:9]), \
            sys.argv[9]
        torch.set_num_threads(2)
        print(json.dumps(measure_context(name, context, steps, settle, module_steps, bool(probe), seed, dtype)))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="dsv4-tiny,v4-shape")
    parser.add_argument("--contexts", default="1024,4096,16384,65536")
    parser.add_argument("--rounds", type=int, default=2, help="processes a context (its prefill each time)")
    parser.add_argument("--steps", type=int, default=400, help="decode steps a process")
    parser.add_argument("--settle", type=int, default=16, help="first steps of a process not counted")
    parser.add_argument("--module-steps", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-cache-dtypes", default="auto,fp8_e4m3", help="caches each model runs with")
    parser.add_argument("--baseline", default=None, help="a git revision: each context at it and now, alternating")
    args = parser.parse_args()
    torch.set_num_threads(2)
    contexts = [int(c) for c in args.contexts.split(",")]
    models = args.models.split(",")
    runs = [(name, dtype) for name in models for dtype in args.kv_cache_dtypes.split(",")]
    if args.baseline:
        compare_revisions(args, runs, contexts)
        return
    by_run = {(name, dtype): measure_model(name, dtype, contexts, args.rounds, args.steps, args.settle,
                                           args.module_steps, args.seed) for name, dtype in runs}
    for rows in by_run.values():
        print_table(rows)
    write_json("long_context", {"models": models, "kv_cache_dtypes": args.kv_cache_dtypes.split(","),
                                "rows": [r for rows in by_run.values() for r in rows]})
    fig, axes = figure(ncols=len(runs), width=4.0 * len(runs))
    for ax, ((name, dtype), rows) in zip(axes if len(runs) > 1 else [axes], by_run.items()):
        xs = [r["context"] for r in rows]
        ax.plot(xs, [r["step_ms"] for r in rows], "o-", label="C step (picked rows)")
        if all(r["module_gathered_step_ms"] is not None for r in rows):
            ax.plot(xs, [r["module_gathered_step_ms"] for r in rows], "s-", label="module step (picked rows)")
            ax.plot(xs, [r["module_mask_step_ms"] for r in rows], "^--", label="module step (mask over all entries)")
        ax.plot(xs, [r["indexer_ms"] for r in rows], "x:", label="indexer (C) alone, all CSA layers")
        _context_axes(ax, name, dtype)
    save_figure(fig, "long_context", f"decode step vs context (positions to {POSITIONS})")


if __name__ == "__main__":
    main()
