"""Decode cost against context length: one request's decode step at 1k, 4k, 16k and 64k tokens of context, with CSA
attending to the indexer's `index_topk` picked entries (`model.indexer.picked_entries`) against the same step
attending through a mask over every visible entry (the path before: same picks, same tokens).

Two models, each with its position range at 128k: dsv4-tiny's weights, and `v4-shape` (`random_checkpoint.py`), a
random DSV4 whose indexer weighs against its layers what V4-Flash's does (dsv4-tiny's is ~11x heavier). For each, a
random prompt of each length is prefilled into an engine of its own; then the engines take turns, `--groups` groups
of `--per-group` greedy decode steps each (the first `--settle` of a group not counted: the caches after another
engine's turn), so a slow spell of the VM falls on every context alike; each step is timed (`Engine.step`,
medians). Then the module path decodes the same prompt twice, through the picked rows and through the mask
(`--module-steps`), for the same tokens. The same run times the lightning indexer's C pick alone at each length (its
scoring is O(entries) by design, the one part that must grow) and reports its share of the step, the pools' bytes
and the process's resident memory. Target (issue: performance against the peers): the 64k step <= 1.5x the 4k step,
and the same tokens on all paths.

    python bench/bench_long_context.py [--models dsv4-tiny,v4-shape] [--contexts 1024,4096,16384,65536]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import time
from pathlib import Path

import torch
from console import log
from random_checkpoint import CONFIGS, random_checkpoint
from report import figure, save_figure, write_json
from resident_memory import rss_mb

from pdspark import SamplingParams
from pdspark.assets import resolve_model
from pdspark.engine.factory import create_engine
from pdspark.model import indexer as indexer_module
from pdspark.model.batch import CompressedIndex

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


def taking_turns(engines: dict[int, object], groups: int, per_group: int, settle: int) -> dict[int, list[float]]:
    """The C step's times (s) of each engine (one prefilled request each), the engines taking turns a group of
    `per_group` steps at a time, the first `settle` of each group not counted (each engine holds its own weights:
    after another's turn a step runs 2-3x slower, and ~1.3x for the next ~10)."""
    times: dict[int, list[float]] = {c: [] for c in engines}
    for g in range(groups):
        order = list(engines) if g % 2 == 0 else list(reversed(engines))
        for context in order:
            engine = engines[context]
            for i in range(per_group):
                s = time.perf_counter()
                engine.step()
                if i >= settle:
                    times[context].append(time.perf_counter() - s)
    return times


def indexer_ms(engine, visible: int, page_size: int, repeats: int = 50) -> float:
    """The C indexer pick of one decode token over `visible` entries (scores and top-k), every CSA layer of the
    model (ms, median): read from the engine's own indexer-key pool, a page's entries together and the pages in a
    random order, as a request's pages lie in the pool."""
    from pdspark.hardware.cpu import kernels

    cfg = engine.runner.model.cfg
    csa = engine.kv.model.csa_layers
    keys = engine.kv.pools.layer(csa[0]).index_kv  # [rows, D]: a per-layer view of the page-major pool
    H, D = cfg.index_n_heads, cfg.index_head_dim
    q, w = torch.randn(1, H, D), torch.rand(1, H)
    per_page = page_size // cfg.csa_ratio
    pages = torch.randperm(keys.shape[0] // per_page)[: -(-visible // per_page)]
    rows = (pages[:, None] * per_page + torch.arange(per_page)).flatten()[None, :visible].contiguous()
    valid = torch.ones(1, visible, dtype=torch.bool)
    layers = len(csa)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        picked = kernels.index_pick(q, w, keys, rows, valid, D**-0.5, cfg.index_topk)
        times.append(time.perf_counter() - t0)
        assert picked is not None
    return 1e3 * layers * statistics.median(times)


def new_engine(model: Path, context: int, steps: int):
    return create_engine(str(model), page_size=PAGE_SIZE, max_model_len=context + steps + 8, max_num_seqs=1,
                         max_num_batched_tokens=2048, enable_prefix_cache=False)


def measure_model(name: str, contexts: list[int], groups: int, per_group: int, settle: int, module_steps: int,
                  seed: int) -> list[dict]:
    """Every context's row for model `name`: the engines prefilled, the C steps taking turns, then per context the
    module path's steps (picked rows, then the mask) for the same tokens, and the indexer's pick alone."""
    model = long_model(name)
    steps = groups * per_group
    engines, prompts, rids, prefill = {}, {}, {}, {}
    for context in contexts:
        log(f"{name}, context {context}: prefilling")
        engines[context] = engine = new_engine(model, context, steps)
        g = torch.Generator().manual_seed(seed)
        prompts[context] = torch.randint(3, engine.runner.model.cfg.vocab_size, (context,), generator=g).tolist()
        rids[context], prefill[context] = prefilled(engine, prompts[context], steps + 2)  # (never done early)
        log(f"  prefill {prefill[context]:.1f} s")
    log(f"{name}: {groups} groups of {per_group} C steps, the {len(contexts)} contexts taking turns")
    times = taking_turns(engines, groups, per_group, settle)
    rows = []
    for context in contexts:
        engine = engines.pop(context)
        tokens = list(engine.requests[rids[context]].output_token_ids)[: module_steps + 1]
        while engine.has_unfinished:
            engine.step()
        engine.release(rids[context])
        pools = sum(t.numel() * t.element_size() for t in vars(engine.kv.pools).values()
                    if isinstance(t, torch.Tensor))
        model_obj = engine.runner.model
        saved, model_obj._decode_step = model_obj._decode_step, None  # the module path, gathered then masked
        module_times, module_tokens, _ = decode_steps(engine, prompts[context], module_steps)
        with dense_mask():
            mask_times, mask_tokens, _ = decode_steps(engine, prompts[context], module_steps)
        model_obj._decode_step = saved
        step = statistics.median(times[context])
        idx = indexer_ms(engine, context // model_obj.cfg.csa_ratio, PAGE_SIZE)
        log(f"  {context:>6} tokens: C step {1e3 * step:.2f} ms, indexer alone {idx:.2f} ms")
        rows.append({"model": name, "context": context, "prefill_s": prefill[context], "step_ms": 1e3 * step,
                     "module_gathered_step_ms": 1e3 * statistics.median(module_times),
                     "module_mask_step_ms": 1e3 * statistics.median(mask_times),
                     "indexer_ms": idx, "indexer_share": idx / (1e3 * step),
                     "visible_csa_entries": context // model_obj.cfg.csa_ratio, "pools_mb": pools / 2**20,
                     "rss_mb": rss_mb(), "same_tokens": tokens == module_tokens == mask_tokens,
                     "steps": len(times[context]), "module_steps": module_steps})
        del engine, model_obj
    return rows


def print_table(rows: list[dict]) -> None:
    """One model's rows as a markdown table, each against the 4k row (`rest_vs_4k` added to the rows)."""
    base = next((r for r in rows if r["context"] == 4096), rows[0])
    # The step less the indexer: what must stay flat (the indexer scores every visible entry by design).
    rest = {r["context"]: r["step_ms"] - r["indexer_ms"] for r in rows}
    print(f"\n{rows[0]['model']}\n")
    print("| context | C step ms | vs 4k | step less indexer, vs 4k | module step ms (picked rows) | module step ms "
          "(mask) | indexer ms (share) | CSA entries | pools MB | RSS MB | prefill s | same tokens |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        r["vs_4k"] = r["step_ms"] / base["step_ms"]
        r["rest_vs_4k"] = rest[r["context"]] / rest[base["context"]]
        print(f"| {r['context']} | {r['step_ms']:.2f} | {r['vs_4k']:.2f}x | "
              f"{rest[r['context']]:.2f} ms, {r['rest_vs_4k']:.2f}x | "
              f"{r['module_gathered_step_ms']:.2f} | {r['module_mask_step_ms']:.2f} | "
              f"{r['indexer_ms']:.2f} ({100 * r['indexer_share']:.0f}%) | {r['visible_csa_entries']} | "
              f"{r['pools_mb']:.1f} | {r['rss_mb']:.0f} | {r['prefill_s']:.1f} | {r['same_tokens']} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="dsv4-tiny,v4-shape")
    parser.add_argument("--contexts", default="1024,4096,16384,65536")
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--per-group", type=int, default=80)
    parser.add_argument("--settle", type=int, default=16, help="steps of each group not counted")
    parser.add_argument("--module-steps", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(2)
    contexts = [int(c) for c in args.contexts.split(",")]
    models = args.models.split(",")
    by_model = {name: measure_model(name, contexts, args.groups, args.per_group, args.settle, args.module_steps,
                                    args.seed) for name in models}
    for rows in by_model.values():
        print_table(rows)
    write_json("long_context", {"models": models, "rows": [r for rows in by_model.values() for r in rows]})
    fig, axes = figure(ncols=len(models), width=5.0 * len(models))
    for ax, (name, rows) in zip(axes if len(models) > 1 else [axes], by_model.items()):
        xs = [r["context"] for r in rows]
        ax.plot(xs, [r["step_ms"] for r in rows], "o-", label="C step (picked rows)")
        ax.plot(xs, [r["module_gathered_step_ms"] for r in rows], "s-", label="module step (picked rows)")
        ax.plot(xs, [r["module_mask_step_ms"] for r in rows], "^--", label="module step (mask over all entries)")
        ax.plot(xs, [r["indexer_ms"] for r in rows], "x:", label="indexer (C) alone, all CSA layers")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(name, fontsize=8)
        ax.set_xlabel("context tokens")
        ax.set_ylabel("ms per decode step (median)")
        ax.legend(fontsize=6)
    save_figure(fig, "long_context", f"decode step vs context (positions to {POSITIONS})")


if __name__ == "__main__":
    main()
