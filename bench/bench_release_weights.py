"""DeepSeek-V4's released format, loaded compact (FP8/MXFP4 as stored) vs decoded to float32, and decoded at batch 1
against the same model in BF16: peak load memory, resident bytes, decode tokens/s and weight bytes read per token.

The checkpoint is a random one of the released format (`testing/random_release_checkpoint.py`, >= 1 GiB by default:
a V4-Flash-shaped config, shrunk), with its BF16 twin (the same numbers). Each measurement runs in a fresh process so
that its peak resident memory (`VmHWM`) is its own; load memory is the growth over the process before the load.
Targets (issue: real checkpoints): peak load <= resident + the largest tensor + 10%; resident <= 1.05x the checkpoint.

    python bench/bench_release_weights.py [--dir DIR] [--tokens 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from console import log
from report import figure, paired_bars, save_figure, write_json
from resident_memory import rss_mb

CONFIG = dict(
    model_type="deepseek_v4", architectures=["DeepseekV4ForCausalLM"], vocab_size=65536, hidden_size=1024,
    num_hidden_layers=6, num_attention_heads=8, head_dim=512, qk_rope_head_dim=64, q_lora_rank=512, o_groups=2,
    o_lora_rank=512, index_n_heads=8, index_head_dim=128, index_topk=64, n_routed_experts=64, num_experts_per_tok=6,
    moe_intermediate_size=1024, num_hash_layers=1, hc_mult=4, sliding_window=128,
    compress_ratios=[0, 4, 128, 4, 128, 0, 0], num_nextn_predict_layers=1, expert_dtype="fp4", rope_theta=10000,
    max_position_embeddings=4096, bos_token_id=0, eos_token_id=1,
    quantization_config={"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
                         "weight_block_size": [128, 128]})
PROMPT_LEN = 16


def vm_hwm_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def child_load(path: Path, weight_format: str) -> dict:
    """Load the target in this process: memory before, peak, after, and what the weights hold."""
    from pdspark.model.loader import load_checkpoint
    from pdspark.model.resident_weights import ResidentWeights, checkpoint_bytes

    before = rss_mb()
    t0 = time.perf_counter()
    ckpt = load_checkpoint(path, 256, weight_format=weight_format, draft=False)
    seconds = time.perf_counter() - t0
    resident = ResidentWeights.of(ckpt.model)
    stored = checkpoint_bytes(path, skip_prefixes=("mtp.",))
    return {"load_s": seconds, "rss_before_mb": before, "peak_mb": vm_hwm_mb(), "rss_after_mb": rss_mb(),
            "resident_mb": resident.total / 2**20, "resident_by_dtype_mb": {k: v / 2**20 for k, v in
                                                                            resident.by_dtype.items()},
            "checkpoint_mb": sum(stored.values()) / 2**20}


def child_decode(path: Path, tokens: int, repeats: int) -> dict:
    """Batch-1 greedy decode: tokens/s after the first token, median over `repeats` (after one warm-up)."""
    from pdspark import LLM, SamplingParams

    import torch

    llm = LLM(str(path), page_size=16, max_model_len=256, max_num_seqs=1, max_num_batched_tokens=256)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    rates = []
    for _ in range(repeats + 1):
        rid = engine.add_request(torch.randint(3, 4096, (PROMPT_LEN,), generator=g).tolist(), params)
        started = None
        while engine.has_unfinished:
            engine.step()
            if started is None and engine.requests[rid].output_token_ids:
                started = time.perf_counter()
        rates.append((tokens - 1) / (time.perf_counter() - started))
    model = engine.runner.model
    return {"tok_s": statistics.median(rates[1:]), "decode_path": "C decode step" if model.decode_step_off is None
            else f"module path ({model.decode_step_off})"}


def bytes_per_token(cfg: dict, compact: bool) -> float:
    """Weight bytes a batch-1 decode step reads: every layer's non-expert weights, its top-k routed experts, the
    head, one embedding row (BF16 twin: 2 bytes a weight, as its bf16 fast path reads them)."""
    from pdspark.model.model_config import ModelConfig
    from pdspark.model.tensor_inventory import released_tensors

    model_cfg = ModelConfig.from_dict(cfg)
    specs = [s for s in released_tensors(model_cfg, cfg["expert_dtype"]) if not s.name.startswith("mtp.")]
    k, E = model_cfg.num_experts_per_tok, model_cfg.n_routed_experts
    total = 0.0
    for s in specs:
        if compact:
            n = float(s.nbytes)
        else:  # the twin: scales gone, FP8 and packed MXFP4 weights decoded to BF16 (2 and 4 bytes a stored byte)
            n = 0.0 if s.name.endswith(".scale") else s.nbytes * {"F8_E4M3": 2, "I8": 4}.get(s.dtype, 1)
        if s.expert is not None:
            n *= k / E  # a token's top-k of the layer's experts
        elif s.name == "embed.weight" or s.name.endswith("tid2eid"):
            n /= s.shape[0]  # one row
        total += n
    return total


def run_child(*args: str, timeout: float = 1800) -> dict:
    out = subprocess.run([sys.executable, __file__, *args], check=True, capture_output=True, text=True,
                         timeout=timeout)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/pdspark-release-bench"))
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child-load", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--child-decode", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_load:
        print(json.dumps(child_load(Path(args.child_load[0]), args.child_load[1])))
        return
    if args.child_decode:
        print(json.dumps(child_decode(Path(args.child_decode), args.tokens, args.repeats)))
        return
    from pdspark.model.resident_weights import checkpoint_bytes
    from pdspark.model.tensor_inventory import stored_tensors
    from pdspark.model.weights import checkpoint_files
    from pdspark.testing.random_release_checkpoint import write_random_release_checkpoint

    fixture, twin = args.dir / "release", args.dir / "bf16"
    if not (fixture / "config.json").is_file() or not (twin / "config.json").is_file():
        log(f"writing a random released-format checkpoint and its BF16 twin under {args.dir}")
        write_random_release_checkpoint(CONFIG, fixture, twin, progress=True)
    largest = max(t.nbytes for t in stored_tensors(checkpoint_files(fixture)))
    size = sum(checkpoint_bytes(fixture).values())
    log(f"checkpoint {size / 2**30:.2f} GiB, largest tensor {largest / 2**20:.0f} MiB")
    loads = {}
    for fmt in ("compact", "float32"):
        loads[fmt] = run_child("--child-load", str(fixture), fmt)
        log(f"load {fmt}: {loads[fmt]}")
    decode = {}
    for name, path in (("compact FP8/MXFP4", fixture), ("BF16 twin", twin)):
        decode[name] = run_child("--child-decode", str(path), "--tokens", str(args.tokens), "--repeats",
                                 str(args.repeats))
        decode[name]["weight_mb_per_token"] = bytes_per_token(CONFIG, name.startswith("compact")) / 2**20
        log(f"decode {name}: {decode[name]}")
    lines = [
        f"random released-format checkpoint {size / 2**30:.2f} GiB ({CONFIG['num_hidden_layers']} layers, hidden "
        f"{CONFIG['hidden_size']}, {CONFIG['n_routed_experts']} MXFP4 experts, vocab {CONFIG['vocab_size']}); largest "
        f"tensor {largest / 2**20:.0f} MiB",
        "",
        "| weights | load s | resident MiB | resident / checkpoint | peak load growth MiB | resident + largest + 10% |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for fmt, r in loads.items():
        growth = r["peak_mb"] - r["rss_before_mb"]
        ratio = r["resident_mb"] / r["checkpoint_mb"]
        lines.append(f"| {fmt} | {r['load_s']:.1f} | {r['resident_mb']:.0f} | {ratio:.3f} | {growth:.0f} | "
                     f"{(r['resident_mb'] + largest / 2**20) * 1.1:.0f} |")
    lines += ["", "| batch-1 decode | tok/s | weight MiB read per token | path |", "|---|---:|---:|---|"]
    for name, r in decode.items():
        lines.append(f"| {name} | {r['tok_s']:.2f} | {r['weight_mb_per_token']:.1f} | {r['decode_path']} |")
    print("\n".join(lines))
    write_json("release_weights", {"args": {k: str(v) for k, v in vars(args).items()}, "loads": loads,
                                   "decode": decode, "checkpoint_bytes": size, "largest_tensor_bytes": largest})
    fig, (ax_mem, ax_speed) = figure(ncols=2, width=10.0)
    paired_bars(ax_mem, ["resident", "peak load growth"],
                [loads["compact"]["resident_mb"], loads["compact"]["peak_mb"] - loads["compact"]["rss_before_mb"]],
                [loads["float32"]["resident_mb"], loads["float32"]["peak_mb"] - loads["float32"]["rss_before_mb"]],
                ("compact", "float32"), "MiB")
    names = list(decode)
    ax_speed.bar(names, [decode[n]["tok_s"] for n in names])
    ax_speed.set_ylabel("batch-1 decode tokens/s")
    save_figure(fig, "release_weights", lines[0])


if __name__ == "__main__":
    main()
