"""DSpark on vs off on held-out prompts: decode tokens/s at batch 1 and 8, acceptance length and per position.

Decode tokens/s counts tokens after each request's first one, over the time after that first token (prefill is
excluded). Greedy, EOS ignored. Both modes run in this process, alternating, with `--repeats` medians.

    python bench/bench_dspark.py [--model dsv4-tiny] [--prompts 8] [--prompt-len 128] [--output-len 128]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from pdspark import LLM, SamplingParams
from pdspark.llm import resolve_model

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from train_dspark_draft import heldout_prompts  # noqa: E402  (the held-out split of the training recipe)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import figure, paired_bars, save_figure, write_json  # noqa: E402


def run(llm: LLM, prompts: list[list[int]], batch: int, output_len: int) -> dict:
    """Requests in groups of `batch`; decode time of a group runs from its first token to its last."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    decode_s, n_tokens = 0.0, 0
    verify0 = engine.spec.verify_steps
    for i in range(0, len(prompts), batch):
        ids = [engine.add_request(p, params) for p in prompts[i : i + batch]]
        first = last = None
        while engine.has_unfinished:
            outs = engine.step()
            now = time.perf_counter()
            if outs and first is None:
                first = now
            last = now
        decode_s += last - first
        n_tokens += sum(len(engine.requests[r].output_token_ids) - 1 for r in ids)
        for r in ids:
            engine.release(r)
    return {"decode_tok_s": n_tokens / decode_s, "verify_steps": engine.spec.verify_steps - verify0,
            "tokens": n_tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="dsv4-tiny")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    prompts = heldout_prompts(Path(path), args.prompts, args.prompt_len, seed=7)
    opts = dict(max_model_len=args.prompt_len + args.output_len + 64, max_num_seqs=16, enable_prefix_cache=False)
    plain = LLM(path, **opts)
    spec = LLM(path, speculative="dspark", **opts)
    batches = [int(b) for b in args.batches.split(",")]
    rows: dict[tuple[str, int], list[dict]] = {}
    for rep in range(args.repeats):
        for b in batches:
            for name, llm in (("plain", plain), ("dspark", spec)):
                r = run(llm, prompts, b, args.output_len)
                rows.setdefault((name, b), []).append(r)
                print(f"[{rep + 1}/{args.repeats}] batch {b} {name:<6}: {r['decode_tok_s']:.1f} decode tok/s",
                      file=sys.stderr, flush=True)
    stats = spec.engine.spec
    acc_len = stats.mean_acceptance_length
    per_pos = [c / max(stats.verify_steps, 1) for c in stats.accepted_per_position]

    def med(name, b):
        return statistics.median(r["decode_tok_s"] for r in rows[(name, b)])

    lines = [
        f"model {args.model}: {args.prompts} held-out prompts of {args.prompt_len} tokens, {args.output_len} greedy "
        f"output tokens, {args.threads} threads ({args.repeats} repeat(s), medians)",
        "",
        "| batch | plain decode tok/s | DSpark decode tok/s | speedup |",
        "|---:|---:|---:|---:|",
    ]
    summary = []
    for b in batches:
        p, s = med("plain", b), med("dspark", b)
        lines.append(f"| {b} | {p:.1f} | {s:.1f} | {s / p:.2f}x |")
        summary.append({"batch": b, "plain_tok_s": p, "dspark_tok_s": s, "speedup": s / p})
    lines += [
        "",
        f"mean acceptance length (tokens per verify step, bonus included): {acc_len:.2f}",
        "acceptance per draft position: " + ", ".join(f"{x:.2f}" for x in per_pos),
    ]
    print("\n".join(lines))
    write_json("dspark", {"args": vars(args), "summary": summary, "mean_acceptance_length": acc_len,
                          "acceptance_per_position": per_pos})
    fig, (a1, a2) = figure(ncols=2, width=10)
    paired_bars(a1, [f"batch {s['batch']}" for s in summary], [s["plain_tok_s"] for s in summary],
                [s["dspark_tok_s"] for s in summary], ("plain", "DSpark"), "decode tokens / s")
    a2.bar(range(1, len(per_pos) + 1), per_pos)
    a2.set_xlabel("draft position")
    a2.set_ylabel("P(accepted)")
    a2.set_ylim(0, 1)
    save_figure(fig, "dspark", lines[0])



if __name__ == "__main__":
    main()
