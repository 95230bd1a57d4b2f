"""ModelSlim W8A8_DYNAMIC vs float on the same tiny DSV4 model: decode tokens/s and peak memory at batch 1 and 16.

Both checkpoints are the msmodelslim fixtures (`make modelslim-fixtures`; `float/` and its quantized copies).
Each (model, batch) runs in a fresh process, so that its peak resident memory (`ru_maxrss`) is its own; decode
tokens/s counts the tokens generated after every request of the batch has its first token, over that time.

    python bench/bench_quant.py [--fixtures DIR] [--batches 1,16] [--max-tokens 48] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

from pdspark.testing.script_module import load_script

import torch
from report import figure, paired_bars, save_figure, write_json
from resident_memory import rss_mb

ROOT = Path(__file__).resolve().parents[1]

MODELS = ("float", "w8a8_dynamic")
_QUANTIZABLE = re.compile(r"(attn\.(wq_a|wq_b|wkv)|indexer\.wq_b|shared\.w[123]|ffn\.(w13|w2)|ffn\.experts\.\w+)"
                          r"(\.weight|\.weight_scale)?$")
PROMPT_LEN = 32


def default_fixtures() -> Path:
    return load_script(ROOT / "scripts" / "make_modelslim_fixtures.py").fixture_dir()


def measure(path: Path, batch: int, max_tokens: int) -> dict:
    """One configuration, in this process: a warm-up batch, then the measured one."""
    from pdspark import LLM, SamplingParams

    llm = LLM(str(path), page_size=16, max_model_len=256, max_num_seqs=max(batch, 1),
              max_num_batched_tokens=max(256, batch * PROMPT_LEN))
    model = llm.engine.runner.model
    weight_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    # The linears W8A8_DYNAMIC quantizes (attention wq_a/wq_b/wkv, indexer wq_b, shared and routed experts): int8
    # weights and fp32 scales in the quantized model, the float weights they replace in the float one.
    linear_bytes = sum(t.numel() * t.element_size() for n, t in model.state_dict().items() if _QUANTIZABLE.search(n))
    g = torch.Generator().manual_seed(batch)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    engine = llm.engine
    for _ in range(2):  # warm-up, then measured
        prompts = [torch.randint(3, 4096, (PROMPT_LEN,), generator=g).tolist() for _ in range(batch)]
        ids = [engine.add_request(p, params) for p in prompts]
        started: float | None = None
        tokens_at_start = 0
        while engine.has_unfinished:
            engine.step()
            if started is None and all(engine.requests[i].output_token_ids for i in ids):
                started = time.perf_counter()
                tokens_at_start = sum(len(engine.requests[i].output_token_ids) for i in ids)
        elapsed = time.perf_counter() - started if started is not None else float("nan")
        generated = sum(len(engine.requests[i].output_token_ids) for i in ids) - tokens_at_start
    return {"decode_tok_s": generated / elapsed, "weight_mb": weight_bytes / 2**20,
            "quantizable_linears_mb": linear_bytes / 2**20, "rss_mb": rss_mb(),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixtures", type=Path, default=None)
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", nargs=2, metavar=("MODEL_DIR", "BATCH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.child:
        print(json.dumps(measure(Path(args.child[0]), int(args.child[1]), args.max_tokens)))
        return
    fixtures = args.fixtures or default_fixtures()
    batches = [int(b) for b in args.batches.split(",")]
    results: dict[str, dict[int, dict]] = {m: {} for m in MODELS}
    for batch in batches:
        for m in MODELS:
            out = subprocess.run([sys.executable, __file__, "--child", str(fixtures / m), str(batch), "--max-tokens",
                                  str(args.max_tokens), "--threads", str(args.threads)],
                                 check=True, capture_output=True, text=True, timeout=900)
            results[m][batch] = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"{m} batch {batch}: {results[m][batch]}", file=sys.stderr, flush=True)
    lines = [
        f"msmodelslim fixture (4 layers, hidden 64, 8 experts, vocab 129280), prompts {PROMPT_LEN} tokens, "
        f"{args.max_tokens} output tokens, {args.threads} threads",
        "",
        "| model | batch | decode tok/s | peak RSS MB | RSS after MB | all weights MB | quantizable linears MB |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for batch in batches:
        for m in MODELS:
            r = results[m][batch]
            lines.append(f"| {m} | {batch} | {r['decode_tok_s']:.1f} | {r['peak_rss_mb']:.0f} | {r['rss_mb']:.0f} | "
                         f"{r['weight_mb']:.1f} | {r['quantizable_linears_mb']:.2f} |")
    print("\n".join(lines))
    write_json("quant", {"args": {k: str(v) for k, v in vars(args).items()}, "results": results})
    fig, (ax_speed, ax_mem) = figure(ncols=2, width=10.0)
    labels = [f"batch {b}" for b in batches]
    paired_bars(ax_speed, labels, [results["float"][b]["decode_tok_s"] for b in batches],
                [results["w8a8_dynamic"][b]["decode_tok_s"] for b in batches], ("float", "W8A8_DYNAMIC"),
                "decode tokens/s")
    paired_bars(ax_mem, labels, [results["float"][b]["peak_rss_mb"] for b in batches],
                [results["w8a8_dynamic"][b]["peak_rss_mb"] for b in batches], ("float", "W8A8_DYNAMIC"),
                "peak RSS (MB)")
    save_figure(fig, "quant", lines[0])


if __name__ == "__main__":
    main()
