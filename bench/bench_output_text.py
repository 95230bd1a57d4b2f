"""Output text per token: decoded whole at every step (as before) vs a few tokens at a time (`OutputText`).

Two measurements in one run, alternating the two modes:
1. the text cost of one more token at output lengths 128 / 1,024 / 4,096 (the shipped tokenizer, a code text);
2. batch-1 greedy generation of `--max-tokens` tokens with dsv4-tiny through `LLM` (tok/s, same tokens and text).

    python bench/bench_output_text.py [--max-tokens 2048] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from pdspark import LLM, SamplingParams
from pdspark.assets import resolve_model
from pdspark.engine.output_text import OutputText
from pdspark.model.tokenizer import Tokenizer

import torch
from report import figure, paired_bars, save_figure, write_json

LENGTHS = (128, 1024, 4096)
MODES = ("whole", "incremental")


_BYTEWISE = Tokenizer.decodes_bytewise  # the property itself


def set_mode(mode: str) -> None:
    """`whole`: every step decodes the whole output again (what `OutputText` does for non-byte-level tokenizers)."""
    Tokenizer.decodes_bytewise = _BYTEWISE if mode == "incremental" else property(lambda self: False)


def text_cost_us(tokenizer: Tokenizer, ids: list[int], mode: str, tokens: int = 64) -> float:
    """Microseconds of text work for each of the `tokens` tokens that follow `ids[:-tokens]`."""
    set_mode(mode)
    text, output = OutputText(), ids[:-tokens]
    text.decode(tokenizer, output)
    t0 = time.perf_counter()
    for token in ids[-tokens:]:  # the output grows in place, as a request's does
        output.append(token)
        text.decode(tokenizer, output)
    return (time.perf_counter() - t0) / tokens * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = Tokenizer.from_dir(resolve_model("dsv4-tiny"))
    code = (Path(__file__).resolve().parents[1] / "src" / "pdspark" / "serving" / "decode_worker.py").read_text()
    ids = (tokenizer.encode(code) * 8)[:max(LENGTHS)]
    cost = {m: {n: [] for n in LENGTHS} for m in MODES}
    for _ in range(args.repeats):
        for n in LENGTHS:
            for mode in MODES:
                cost[mode][n].append(text_cost_us(tokenizer, ids[:n], mode))

    llm = LLM("dsv4-tiny", max_model_len=args.max_tokens + 64)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(["def f():"], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))  # warm
    tok_s: dict[str, list[float]] = {m: [] for m in MODES}
    texts: dict[str, str] = {}
    for rep in range(args.repeats):
        for mode in MODES if rep % 2 == 0 else MODES[::-1]:
            set_mode(mode)
            t0 = time.perf_counter()
            out = llm.generate(["def fibonacci(n):"], params)[0]
            tok_s[mode].append(len(out.token_ids) / (time.perf_counter() - t0))
            texts[mode] = out.text
            print(f"[{rep + 1}/{args.repeats}] {mode}: {tok_s[mode][-1]:.1f} tok/s", file=sys.stderr, flush=True)
    same = texts["whole"] == texts["incremental"]

    med = statistics.median
    lines = [f"dsv4-tiny tokenizer, text cost per output token (medians of {args.repeats}); batch-1 greedy "
             f"generation of {args.max_tokens} tokens through LLM", "",
             "| output length | whole µs/token | incremental µs/token | ratio |", "|---:|---:|---:|---:|"]
    for n in LENGTHS:
        w, i = med(cost["whole"][n]), med(cost["incremental"][n])
        lines.append(f"| {n} | {w:.1f} | {i:.1f} | {w / i:.1f}x |")
    w, i = med(tok_s["whole"]), med(tok_s["incremental"])
    lines += ["", "| generation | whole tok/s | incremental tok/s | ratio |", "|---|---:|---:|---:|",
              f"| {args.max_tokens} tokens, batch 1 | {w:.1f} | {i:.1f} | {i / w:.2f}x |", "",
              f"same text in both modes: {same}"]
    print("\n".join(lines))
    write_json("output_text", {"args": vars(args), "text_cost_us": cost, "tok_s": tok_s, "same_text": same})
    fig, ax = figure()
    paired_bars(ax, [str(n) for n in LENGTHS], [med(cost["whole"][n]) for n in LENGTHS],
                [med(cost["incremental"][n]) for n in LENGTHS], MODES, "text µs per token")
    ax.set_xlabel("output length (tokens)")
    save_figure(fig, "output_text", lines[0])


if __name__ == "__main__":
    main()
