"""Expert parallelism on this machine: one process against groups of 2 ranks, each holding half of the routed
experts, in both modes (lockstep: every rank runs the whole batch; DP-attention: each rank owns half of the
requests), on the same prompts; and the planned memory per rank of DeepSeek-V4-Flash on 8 and 16 devices.

Measured per (model, mode), each in a fresh process (rank 0; rank 1 its child): the prefill of a batch (the steps
until every request has its first token), the median decode step after it, the collectives per decode step
(calls, bytes, seconds, on rank 0), the routed-expert and other parameter bytes per rank, and each rank's resident
memory. On a 2-core CPU a group is slower than one process (each exchange costs gloo calls; in lockstep both ranks
compute the whole attention; a DP-attention rank decodes on the module path, without the C decode step): groups
exist to fit a model no single device holds, so the figures are a report, not a target.

    python bench/bench_parallel.py [--models dsv4-tiny,big] [--batch 4] [--prompt-len 64] [--max-tokens 32]
                                   [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pdspark  # noqa: F401  (before torch: its OpenMP workers sleep, see tests/unit/test_bench_imports.py)

import torch
from random_checkpoint import CONFIGS, random_checkpoint
from report import figure, grouped_bars, save_figure, write_json
from resident_memory import rss_mb

# (label, ep_size, dp_attention)
MODES = (("ep 1", 1, False), ("ep 2 lockstep", 2, False), ("ep 2 DP-attention", 2, True))


def _model_path(name: str) -> str:
    if name in CONFIGS:
        return str(random_checkpoint(name))
    from pdspark.assets import resolve_model

    return str(resolve_model(name))


def measure(model: str, ep_size: int, dp_attention: bool, batch: int, prompt_len: int, max_tokens: int) -> dict:
    """One configuration in this process (rank 0): a warm-up batch, then the measured one."""
    from pdspark import LLM, SamplingParams

    llm = LLM(_model_path(model), ep_size=ep_size, dp_attention=dp_attention, page_size=16,
              max_model_len=prompt_len + max_tokens + 16, max_num_seqs=batch,
              max_num_batched_tokens=max(256, batch * prompt_len), enable_prefix_cache=False)
    engine = llm.engine
    runner_model = engine.runner.model
    expert = sum(p.numel() * p.element_size() for n, p in runner_model.named_parameters()
                 if n.endswith(("ffn.w13", "ffn.w2")))
    other = sum(p.numel() * p.element_size() for p in runner_model.parameters()) - expert
    exchange = runner_model.layers[0].ffn.exchange
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for _ in range(2):  # warm-up, then measured
        prompts = [torch.randint(3, 256, (prompt_len,), generator=g).tolist() for _ in range(batch)]
        ids = [engine.add_request(p, params) for p in prompts]
        start = time.perf_counter()
        started: set[str] = set()
        while not started.issuperset(ids):
            started |= {o.request_id for o in engine.step() if o.token_ids}
        prefill_s = time.perf_counter() - start
        before = (exchange.calls, exchange.bytes, exchange.seconds) if exchange is not None else (0, 0, 0.0)
        steps: list[float] = []
        while engine.has_unfinished:
            t = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t)
        after = (exchange.calls, exchange.bytes, exchange.seconds) if exchange is not None else (0, 0, 0.0)
        for i in ids:
            engine.release(i)
    n = max(len(steps), 1)
    ranks_rss = [rss_mb()] + [rss_mb(pid) for pid in (engine.rank_pids if ep_size > 1 else [])]
    llm.close()
    return {"prefill_ms": prefill_s * 1e3, "decode_step_ms": statistics.median(steps) * 1e3,
            "exchanges_per_step": (after[0] - before[0]) / n, "exchange_kb_per_step": (after[1] - before[1]) / n / 1024,
            "exchange_ms_per_step": (after[2] - before[2]) / n * 1e3, "expert_mb_per_rank": expert / 2**20,
            "other_mb_per_rank": other / 2**20, "rss_mb_per_rank": ranks_rss}


def planned_v4_flash() -> list[dict]:
    """DeepSeek-V4-Flash's parameters per rank for ep 1, 8 and 16, counted on the meta device from its config
    (the released config's values, as DeepSeek documents them): routed experts split, everything else on every rank.
    Bytes in the released format (experts MXFP4: 4.25 bits a weight with its scales; linears FP8: 8 bits + one
    scale per 128x128; the rest BF16) and all-BF16."""
    from pdspark.assets import resolve_model
    from pdspark.model.decoder_layer import DecoderLayer
    from pdspark.model.model_config import ModelConfig
    from pdspark.model.rope import RotaryTable

    base = json.loads((Path(resolve_model("dsv4-tiny")) / "config.json").read_text())
    for key in ("layer_types", "mlp_layer_types", "dspark"):  # (V4-Flash gives compress_ratios, num_hash_layers)
        base.pop(key, None)
    cfg = ModelConfig.from_dict({**base, **V4_FLASH})
    # The layers on the meta device (no memory); the rotary table, which computes values, on the CPU at a
    # short length (it holds no parameters).
    rope = RotaryTable(cfg.main_rope, cfg.rope_dim, 16)
    with torch.device("meta"):
        layers = torch.nn.ModuleList(DecoderLayer.target(cfg, t, cfg.hash_layers[i], rope)
                                     for i, t in enumerate(cfg.layer_types))
    expert = other_linear = 0
    rest = 2 * cfg.vocab_size * cfg.hidden_size  # embed and head
    for name, p in layers.named_parameters():
        if name.endswith(("ffn.w13", "ffn.w2")):
            expert += p.numel()
        elif p.dim() == 2 and not name.endswith(("embed", "head", "gate")) and p.shape[0] % 128 == 0:
            other_linear += p.numel()
        else:
            rest += p.numel()
    out = []
    # The cache of 1,000 context tokens of one request, as pdspark's pools hold it (bf16): each CSA layer keeps
    # one compressed entry per `csa_ratio` tokens (head_dim, plus the indexer's key), each HCA layer one per
    # `hca_ratio` tokens; the sliding window (every layer) is a fixed cost per request, not per token.
    n_csa, n_hca = len(cfg.csa_layers), len(cfg.hca_layers)
    per_token = n_csa * (cfg.head_dim + cfg.index_head_dim) / cfg.csa_ratio + n_hca * cfg.head_dim / cfg.hca_ratio
    kv_1k = per_token * 1000 * 2
    window = cfg.num_hidden_layers * cfg.sliding_window * cfg.head_dim * 2
    for n in (1, 8, 16):
        released = expert / n * 4.25 / 8 + other_linear * (1 + 4 / 128**2) + rest * 2
        bf16 = (expert / n + other_linear + rest) * 2
        out.append({"ranks": n, "expert_params_per_rank_g": expert / n / 1e9,
                    "other_params_g": (other_linear + rest) / 1e9, "released_gib_per_rank": released / 2**30,
                    "bf16_gib_per_rank": bf16 / 2**30, "kv_mib_per_1k_tokens": kv_1k / 2**20,
                    "window_mib_per_request": window / 2**20})
    return out


# DeepSeek-V4-Flash's config as far as the format reference gives it (§2); the DSpark/MTP stage is left out.
V4_FLASH = {
    "hidden_size": 4096, "num_hidden_layers": 43, "n_routed_experts": 256, "num_experts_per_tok": 6,
    "moe_intermediate_size": 2048, "vocab_size": 129280, "q_lora_rank": 1024, "o_lora_rank": 1024, "o_groups": 8,
    "num_attention_heads": 64, "head_dim": 512, "qk_rope_head_dim": 64, "index_n_heads": 64,
    "index_head_dim": 128, "hc_mult": 4, "num_hash_layers": 3,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="dsv4-tiny,big")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--child", nargs=3, metavar=("MODEL", "EP_SIZE", "DP"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.child:
        print(json.dumps(measure(args.child[0], int(args.child[1]), args.child[2] == "dp", args.batch,
                                 args.prompt_len, args.max_tokens)))
        return
    models = args.models.split(",")
    results: dict[str, dict[str, dict]] = {m: {} for m in models}
    for m in models:
        _model_path(m)  # (built once, outside the timed children)
        for label, ep, dp in MODES:
            out = subprocess.run([sys.executable, __file__, "--child", m, str(ep), "dp" if dp else "lockstep",
                                  "--batch", str(args.batch), "--prompt-len", str(args.prompt_len), "--max-tokens",
                                  str(args.max_tokens), "--threads", str(args.threads)], check=True,
                                 capture_output=True, text=True, timeout=900)
            results[m][label] = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"{m} {label}: {results[m][label]}", file=sys.stderr, flush=True)
    host = _host()
    lines = [
        f"{host}; batch {args.batch} x {args.prompt_len}-token prompts, {args.max_tokens} output tokens, "
        f"{args.threads} thread(s) per rank",
        "",
        "| model | mode | prefill ms | decode step ms (median) | vs ep 1 | collectives/step | KiB/step | "
        "collective ms/step |"
        " experts MiB/rank | other MiB/rank | RSS MiB per rank |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for m in models:
        base = results[m]["ep 1"]["decode_step_ms"]
        for label, _, _ in MODES:
            r = results[m][label]
            lines.append(f"| {m} | {label} | {r['prefill_ms']:.1f} | {r['decode_step_ms']:.2f} | "
                         f"{r['decode_step_ms'] / base:.2f}x | {r['exchanges_per_step']:.1f} | "
                         f"{r['exchange_kb_per_step']:.1f} | {r['exchange_ms_per_step']:.2f} | "
                         f"{r['expert_mb_per_rank']:.2f} | {r['other_mb_per_rank']:.2f} | "
                         f"{' / '.join(f'{x:.0f}' for x in r['rss_mb_per_rank'])} |")
    plan = planned_v4_flash()
    lines += ["", "Planned: DeepSeek-V4-Flash per rank (experts split, the rest on every rank; the cache of a request "
              "on every rank in lockstep, on its owning rank alone with DP-attention)", "",
              "| ranks | expert params/rank (G) | other params (G) | released format GiB/rank | all-BF16 GiB/rank | "
              "KV MiB per 1k context tokens (bf16) | sliding window MiB per request |",
              "|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {p['ranks']} | {p['expert_params_per_rank_g']:.2f} | {p['other_params_g']:.2f} | "
              f"{p['released_gib_per_rank']:.1f} | {p['bf16_gib_per_rank']:.1f} | {p['kv_mib_per_1k_tokens']:.2f} | "
              f"{p['window_mib_per_request']:.2f} |" for p in plan]
    print("\n".join(lines))
    write_json("parallel", {"args": {k: str(v) for k, v in vars(args).items()}, "host": host, "results": results,
                            "v4_flash_plan": plan})
    fig, (ax_decode, ax_prefill) = figure(ncols=2, width=10.0)
    grouped_bars(ax_decode, models, {label: [results[m][label]["decode_step_ms"] for m in models]
                                     for label, _, _ in MODES}, "decode step (ms, median)")
    grouped_bars(ax_prefill, models, {label: [results[m][label]["prefill_ms"] for m in models]
                                      for label, _, _ in MODES}, "prefill of the batch (ms)")
    save_figure(fig, "parallel", lines[0])


def _host() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


if __name__ == "__main__":
    main()
