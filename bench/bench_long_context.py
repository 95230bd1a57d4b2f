"""Decode cost against context length: one request's decode step at 1k, 4k, 16k and 64k tokens of context, with CSA
attending to the indexer's `index_topk` picked entries (`model.indexer.picked_entries`) against the same step
attending through a mask over every visible entry (the path before: same picks, same tokens).

The model is dsv4-tiny's architecture and weights with its position range raised to 128k (`--model` for another):
a random prompt of each length is prefilled once, then the request decodes `--steps` greedy tokens; each step is
timed (`Engine.step`, medians). The same run times the lightning indexer's C kernel alone at each length (its
scoring is O(entries) by design, the one part that must grow) and reports its share of the step, the pools'
bytes and the process's resident memory. Target (issue: performance against the peers): the 64k step <= 1.5x the
4k step, and the same tokens on both paths.

    python bench/bench_long_context.py [--contexts 1024,4096,16384,65536] [--steps 128]
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
    """`name`'s checkpoint with its position range raised to `POSITIONS` (a copy; rope tables are computed)."""
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


def decode_steps(engine, prompt: list[int], steps: int) -> tuple[list[float], list[int], float]:
    """Step times (s) of `steps` greedy decode steps after the prompt's prefill, the tokens, the prefill's time."""
    t0 = time.perf_counter()
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True))
    times: list[float] = []
    prefilled: float | None = None
    while engine.has_unfinished:
        s = time.perf_counter()
        outs = engine.step()
        e = time.perf_counter()
        if prefilled is None:
            if any(o.token_ids for o in outs):
                prefilled = e - t0
        else:
            times.append(e - s)
    tokens = list(engine.requests[rid].output_token_ids)
    engine.release(rid)
    assert prefilled is not None
    return times, tokens, prefilled


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


def measure(model: Path, context: int, steps: int, seed: int) -> dict:
    engine = create_engine(str(model), page_size=PAGE_SIZE, max_model_len=context + steps + 8, max_num_seqs=1,
                           max_num_batched_tokens=2048, enable_prefix_cache=False)
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, engine.runner.model.cfg.vocab_size, (context,), generator=g).tolist()
    times, tokens, prefill_s = decode_steps(engine, prompt, steps)
    log(f"  {context:>6} tokens: prefill {prefill_s:.1f} s, C step {1e3 * statistics.median(times):.2f} ms")
    pools = sum(t.numel() * t.element_size() for t in vars(engine.kv.pools).values() if isinstance(t, torch.Tensor))
    model_obj = engine.runner.model
    saved, model_obj._decode_step = model_obj._decode_step, None  # the module path, gathered then masked
    module_times, module_tokens, _ = decode_steps(engine, prompt, steps)
    with dense_mask():
        mask_times, mask_tokens, _ = decode_steps(engine, prompt, steps)
    model_obj._decode_step = saved
    visible = context // engine.runner.model.cfg.csa_ratio
    step = statistics.median(times)
    idx = indexer_ms(engine, visible, PAGE_SIZE)
    return {"context": context, "prefill_s": prefill_s, "step_ms": 1e3 * step,
            "module_gathered_step_ms": 1e3 * statistics.median(module_times),
            "module_mask_step_ms": 1e3 * statistics.median(mask_times),
            "indexer_ms": idx, "indexer_share": idx / (1e3 * step), "visible_csa_entries": visible,
            "pools_mb": pools / 2**20, "rss_mb": rss_mb(),
            "same_tokens": tokens == module_tokens == mask_tokens, "steps": steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="dsv4-tiny")
    parser.add_argument("--contexts", default="1024,4096,16384,65536")
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(2)
    model = long_model(args.model)
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        log(f"context {context}: prefilling")
        rows.append(measure(model, context, args.steps, args.seed))
    base = next((r for r in rows if r["context"] == 4096), rows[0])
    # The step less the indexer: what must stay flat (the indexer scores every visible entry by design).
    rest = {r["context"]: r["step_ms"] - r["indexer_ms"] for r in rows}
    print("| context | C step ms | vs 4k | step less indexer, vs 4k | module step ms (picked rows) | module step ms "
          "(mask) | indexer ms (share) | CSA entries | pools MB | RSS MB | prefill s | same tokens |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        r["rest_vs_4k"] = rest[r["context"]] / rest[base["context"]]
        print(f"| {r['context']} | {r['step_ms']:.2f} | {r['step_ms'] / base['step_ms']:.2f}x | "
              f"{rest[r['context']]:.2f} ms, {r['rest_vs_4k']:.2f}x | "
              f"{r['module_gathered_step_ms']:.2f} | {r['module_mask_step_ms']:.2f} | "
              f"{r['indexer_ms']:.2f} ({100 * r['indexer_share']:.0f}%) | {r['visible_csa_entries']} | "
              f"{r['pools_mb']:.1f} | {r['rss_mb']:.0f} | {r['prefill_s']:.1f} | {r['same_tokens']} |")
    write_json("long_context", {"model": args.model, "rows": rows})
    fig, ax = figure()
    xs = [r["context"] for r in rows]
    ax.plot(xs, [r["step_ms"] for r in rows], "o-", label="C step (picked rows)")
    ax.plot(xs, [r["module_gathered_step_ms"] for r in rows], "s-", label="module step (picked rows)")
    ax.plot(xs, [r["module_mask_step_ms"] for r in rows], "^--", label="module step (mask over all entries)")
    ax.plot(xs, [r["indexer_ms"] for r in rows], "x:", label="indexer (C), all CSA layers")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context tokens")
    ax.set_ylabel("ms per decode step (median)")
    ax.legend(fontsize=7)
    save_figure(fig, "long_context", f"decode step vs context, {args.model} (positions to {POSITIONS})")


if __name__ == "__main__":
    main()
