"""Prefix cache on vs off: 32 requests sharing a long prefix with distinct suffixes, submitted together.

Reports mean/median TTFT (submission to first token), total time, and the cache hit rate (cached prompt tokens /
prompt tokens). Both modes run in this process on the same engine settings, alternating when `--repeats` > 1.

    python bench/bench_prefix_cache.py [--model dsv4-tiny] [--prefix-len 1500] [--suffix-len 50] [--requests 32]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from pdspark import LLM, SamplingParams
from pdspark.llm import resolve_model
from pdspark.model.model_config import ModelConfig

import torch
from report import figure, save_figure, write_json


def run_once(args, prompts: list[list[int]], cache_on: bool) -> dict:
    llm = LLM(args.model, max_model_len=args.prefix_len + args.suffix_len + args.max_tokens + 64,
              max_num_seqs=args.requests, max_num_batched_tokens=args.budget, enable_prefix_cache=cache_on)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    first: dict[str, float] = {}
    while engine.has_unfinished:
        for out in engine.step():
            first.setdefault(out.request_id, time.perf_counter() - t0)
    total = time.perf_counter() - t0
    cached = sum(engine.requests[i].num_cached_tokens for i in ids)
    outputs = [engine.requests[i].output_token_ids for i in ids]
    ttft = [first[i] for i in ids]
    return {"cache": cache_on, "ttft": ttft, "mean_ttft": statistics.mean(ttft), "median_ttft": statistics.median(ttft),
            "total_s": total, "hit_rate": cached / sum(len(p) for p in prompts), "outputs": outputs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="dsv4-tiny")
    parser.add_argument("--prefix-len", type=int, default=1500)
    parser.add_argument("--suffix-len", type=int, default=50)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    vocab = ModelConfig.from_dir(resolve_model(args.model)).vocab_size
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(8, vocab, (args.prefix_len,), generator=g).tolist()
    prompts = [prefix + torch.randint(8, vocab, (args.suffix_len,), generator=g).tolist() for _ in range(args.requests)]

    runs: dict[bool, list[dict]] = {True: [], False: []}
    for rep in range(args.repeats):
        for cache_on in (False, True):
            r = run_once(args, prompts, cache_on)
            runs[cache_on].append(r)
            print(f"[{rep + 1}/{args.repeats}] cache {'on ' if cache_on else 'off'}: mean TTFT {r['mean_ttft']:.2f}s, "
                  f"total {r['total_s']:.1f}s, hit rate {r['hit_rate']:.1%}", file=sys.stderr, flush=True)
    same = all(a["outputs"] == b["outputs"] for a, b in zip(runs[True], runs[False]))

    def med(on: bool, key: str) -> float:
        return statistics.median(r[key] for r in runs[on])

    lines = [
        f"model {args.model}: {args.requests} requests, shared prefix {args.prefix_len} + suffix {args.suffix_len}, "
        f"{args.max_tokens} output tokens, budget {args.budget} tokens/step ({args.repeats} repeat(s), medians)",
        "",
        "| prefix cache | mean TTFT s | median TTFT s | total s | hit rate |",
        "|---|---:|---:|---:|---:|",
    ]
    for on in (False, True):
        lines.append(f"| {'on' if on else 'off'} | {med(on, 'mean_ttft'):.2f} | {med(on, 'median_ttft'):.2f} | "
                     f"{med(on, 'total_s'):.1f} | {med(on, 'hit_rate'):.1%} |")
    speedup = med(False, "mean_ttft") / med(True, "mean_ttft")
    lines += ["", f"mean TTFT {speedup:.1f}x lower with the cache; identical greedy outputs: {same}"]
    print("\n".join(lines))
    write_json("prefix_cache", {"args": vars(args), "ttft_speedup": speedup, "identical_outputs": same,
                                "runs": [{k: v for k, v in r.items() if k != "outputs"} for rs in runs.values()
                                         for r in rs]})
    fig, ax = figure()
    for on, label in ((False, "cache off"), (True, "cache on")):
        ttft = sorted(runs[on][-1]["ttft"])
        ax.plot(range(1, len(ttft) + 1), ttft, marker=".", label=label)
    ax.set_xlabel("requests (sorted by TTFT)")
    ax.set_ylabel("TTFT (s)")
    ax.legend()
    save_figure(fig, "prefix_cache", lines[0])



if __name__ == "__main__":
    main()
