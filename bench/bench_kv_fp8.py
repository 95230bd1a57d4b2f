"""The FP8 KV cache (`--kv-cache-dtype fp8_e4m3`) against the unquantized one on the shipped model: logit cosine over
held-out text, greedy agreement over 64-token continuations, and cache bytes per request through `pdspark up`
(P/D over Mooncake: the prefill worker's `pdspark_transfer_bytes`) with a bf16 cache and with the FP8 one.

The quality figures compare the engine with an fp32 cache (the compute dtype) and with the FP8 one, on prompts from
the held-out split of the shipped draft's training recipe (unseen code); the transfer figures run the cluster with
`--dtype bfloat16`, once with a bf16 cache and once with `--kv-cache-dtype fp8_e4m3`; the KV rows are the packed
pools (SWA, C4, C4 indexer, C128), the rest the compressor states (fp32 in both) and the DSpark draft's rows.
Target (issue: real checkpoints): mean cosine >= 0.999.

    python bench/bench_kv_fp8.py [--prompts 16] [--prompt-len 192] [--continuations 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import urllib.request
from pathlib import Path

from pdspark import LLM, SamplingParams
from pdspark.assets import resolve_model
from pdspark.launch.service_process import start_service
from pdspark.testing.prompt_logits import prompt_logits

import torch
from bench_dspark import heldout_prompts
from console import log
from report import figure, save_figure, write_json

OPTS = dict(page_size=16, max_model_len=512, max_num_seqs=4, max_num_batched_tokens=512)


def quality(model: Path, prompts: list[list[int]], continuations: int, tokens: int) -> dict:
    cosines: list[float] = []
    with LLM(str(model), **OPTS) as plain, LLM(str(model), kv_cache_dtype="fp8_e4m3", **OPTS) as fp8:
        for ids in prompts:
            cos = torch.nn.functional.cosine_similarity(prompt_logits(plain, ids), prompt_logits(fp8, ids), dim=-1)
            cosines += cos.tolist()
        params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
        heads = [p[: len(p) // 2] for p in prompts[:continuations]]
        a = [o.token_ids for o in plain.generate(prompt_token_ids=heads, sampling_params=params)]
        b = [o.token_ids for o in fp8.generate(prompt_token_ids=heads, sampling_params=params)]
    agree = [next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), tokens) for x, y in zip(a, b)]
    return {"cosine_mean": statistics.fmean(cosines), "cosine_min": min(cosines), "positions": len(cosines),
            "identical_continuations": sum(n == tokens for n in agree), "continuations": len(agree),
            "mean_tokens_before_divergence": statistics.fmean(agree)}


def transfer_bytes(model: Path, prompts: list[list[int]], extra: list[str]) -> dict[str, float]:
    """Mean cache bytes a request moves from prefill to decode, by payload kind, through `pdspark up` with `extra`
    flags (the prefill worker's `pdspark_transfer_payload_bytes_total` over its transfer count)."""
    cluster = start_service("pdspark up", ["up", "--model", str(model), "--max-model-len", "512", "--max-num-seqs",
                                           "4", "--port", "0", "--grpc-port", "0", *extra],
                            timeout=300, env={"OMP_NUM_THREADS": "1"})
    try:
        for ids in prompts:
            body = json.dumps({"prompt": ids, "max_tokens": 2, "temperature": 0}).encode()
            req = urllib.request.Request(cluster.info["http"] + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                r.read()
        with urllib.request.urlopen(cluster.info["http"] + "/workers", timeout=30) as r:
            prefill = next(w for w in json.loads(r.read()) if w["role"] == "prefill")
        with urllib.request.urlopen(prefill["metrics_url"], timeout=30) as r:
            lines = r.read().decode().splitlines()
        count = next(float(x.split()[1]) for x in lines if x.startswith("pdspark_transfer_bytes_count"))
        kinds = {x.split('"')[1]: float(x.split()[1]) / count for x in lines
                 if x.startswith("pdspark_transfer_payload_bytes_total{")}
        return kinds
    finally:
        cluster.stop()


ROWS = ("swa_kv", "c4_kv", "c4_index", "c128_kv")  # the pools an FP8 cache packs (the rest: fp32 states, draft rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="dsv4-tiny")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=192)
    parser.add_argument("--continuations", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    model = resolve_model(args.model)
    prompts = heldout_prompts(model, args.prompts, args.prompt_len, seed=5)
    log(f"{len(prompts)} held-out prompts of {args.prompt_len} tokens")
    q = quality(model, prompts, args.continuations, args.tokens)
    log(f"quality: {q}")
    moved = {name: transfer_bytes(model, prompts[:4], flags) for name, flags in (
        ("bf16", ["--dtype", "bfloat16"]), ("fp8_e4m3", ["--dtype", "bfloat16", "--kv-cache-dtype", "fp8_e4m3"]))}
    log(f"transfer bytes per request: {moved}")
    rows = {name: sum(v for k, v in kinds.items() if k in ROWS) for name, kinds in moved.items()}
    total = {name: sum(kinds.values()) for name, kinds in moved.items()}
    lines = [
        f"{args.model}: FP8 KV cache vs unquantized, {q['positions']} held-out positions, {q['continuations']} greedy "
        f"{args.tokens}-token continuations",
        "",
        "| logit cosine mean | min | identical continuations | mean tokens before divergence |",
        "|---:|---:|---:|---:|",
        f"| {q['cosine_mean']:.6f} | {q['cosine_min']:.6f} | {q['identical_continuations']}/{q['continuations']} | "
        f"{q['mean_tokens_before_divergence']:.1f} |",
        "",
        f"| cache (bf16 compute) | KV rows bytes per request | all bytes per request ({args.prompt_len}-token "
        "prompts, P/D) |",
        "|---|---:|---:|",
        *(f"| {name} | {rows[name]:,.0f} | {total[name]:,.0f} |" for name in moved),
        f"| fp8 / bf16 | {rows['fp8_e4m3'] / rows['bf16']:.3f} | {total['fp8_e4m3'] / total['bf16']:.3f} |",
    ]
    print("\n".join(lines))
    write_json("kv_fp8", {"args": vars(args), "quality": q, "transfer_bytes": moved})
    fig, ax = figure()
    ax.bar([f"{n} rows" for n in rows] + [f"{n} all" for n in total], [*rows.values(), *total.values()])
    ax.set_ylabel("cache bytes per request (P/D transfer)")
    save_figure(fig, "kv_fp8", lines[0])


if __name__ == "__main__":
    main()
