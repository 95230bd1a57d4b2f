"""Structured outputs on the shipped model: what the grammar costs a decode step, and DSpark's acceptance with and
without one.

Each of `--schemas` varied JSON schemas (`pdspark.testing.json_schemas`) is generated greedily at batch 1, one request
at a time, in four modes: plain decoding and DSpark, each free (`ignore_eos`, as many tokens as the constrained
output has) and under the schema. The grammar's own cost is timed around every mask it computes
(`GrammarCursor.constrain`: the matcher catching up with the row's output, the bitmask fill, the masking), DSpark's
draft rows included (their drafts are masked too: a draft the grammar refuses could never be accepted).

    python bench/bench_structured.py [--schemas 16]
"""

from __future__ import annotations

import argparse
import statistics
import time

from pdspark import LLM, SamplingParams
from pdspark.engine.grammar import GrammarCursor
from pdspark.testing.json_schemas import varied_schemas
from pdspark.types import StructuredOutputs

from console import log
from report import figure, grouped_bars, save_figure, write_json

PROMPT = "<|user|>\nDescribe the object as JSON.<|end|>\n<|assistant|>\n"
MAX_TOKENS = 256


class MaskTimer:
    """Times every `GrammarCursor.constrain` call (wrapped for the run)."""

    def __init__(self) -> None:
        self.calls, self.seconds = 0, 0.0
        self._inner = GrammarCursor.constrain
        timer = self

        def timed(cursor, *args):
            start = time.perf_counter()
            try:
                return timer._inner(cursor, *args)
            finally:
                timer.seconds += time.perf_counter() - start
                timer.calls += 1

        GrammarCursor.constrain = timed  # type: ignore[method-assign]

    def close(self) -> None:
        GrammarCursor.constrain = self._inner  # type: ignore[method-assign]


def run(llm: LLM, params: list[SamplingParams]) -> dict:
    """Every request alone (batch 1): tokens, engine steps, wall time, DSpark counters."""
    steps, tokens, seconds = 0, 0, 0.0
    spec_before = (llm.engine.spec.verify_steps, llm.engine.spec.accepted_tokens)
    for p in params:
        llm.engine.add_request(llm.tokenizer.encode(PROMPT), p)
        start = time.perf_counter()
        while llm.engine.has_unfinished:
            outs = llm.engine.step()
            steps += 1
            for o in outs:
                if o.finished:
                    tokens += len(o.token_ids)
                    llm.engine.release(o.request_id)
        seconds += time.perf_counter() - start
    verify = llm.engine.spec.verify_steps - spec_before[0]
    accepted = llm.engine.spec.accepted_tokens - spec_before[1]
    return {"tokens": tokens, "steps": steps, "seconds": seconds, "tok_s": tokens / seconds,
            "ms_per_step": 1e3 * seconds / steps,
            "acceptance": (accepted + verify) / verify if verify else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schemas", type=int, default=16)
    args = ap.parse_args()
    schemas = varied_schemas(args.schemas, seed=3)
    constrained = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=StructuredOutputs.of(
        json=s)) for s in schemas]
    results: dict[str, dict] = {}
    for spec in (None, "dspark"):
        name = "dspark" if spec else "plain"
        with LLM("dsv4-tiny", max_num_seqs=1, speculative=spec) as llm:
            llm.generate([PROMPT], constrained[:1])  # (warm: the first compile, the fast path)
            lengths = [len(o.token_ids) for o in llm.generate([PROMPT] * len(schemas), constrained)]
            free = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
            log(f"{name}: free decoding")
            results[f"{name}, free"] = run(llm, free)
            log(f"{name}: under the schemas")
            timer = MaskTimer()
            try:
                results[f"{name}, schema"] = run(llm, constrained)
            finally:
                timer.close()
            results[f"{name}, schema"]["mask_us"] = 1e6 * timer.seconds / max(timer.calls, 1)
            results[f"{name}, schema"]["mask_share"] = timer.seconds / results[f"{name}, schema"]["seconds"]
    print(f"\n{'mode':16} {'tokens':>7} {'steps':>6} {'ms/step':>8} {'tok/s':>7} {'accept':>7} {'mask us':>8} "
          f"{'mask %':>7}")
    for mode, r in results.items():
        acc = f"{r['acceptance']:.2f}" if r["acceptance"] else "-"
        mask = (f"{r['mask_us']:8.1f} {100 * r['mask_share']:6.1f}%" if "mask_us" in r else f"{'-':>8} {'-':>7}")
        print(f"{mode:16} {r['tokens']:7d} {r['steps']:6d} {r['ms_per_step']:8.2f} {r['tok_s']:7.1f} {acc:>7} {mask}")
    for spec in ("plain", "dspark"):
        ratio = results[f"{spec}, schema"]["tok_s"] / results[f"{spec}, free"]["tok_s"]
        print(f"{spec}: schema / free tokens per second = {ratio:.2f}x")
    write_json("bench_structured", {"schemas": args.schemas, "results": results,
                                    "median_tokens": statistics.median(r["tokens"] for r in results.values())})
    fig, axes = figure(2, width=9)
    modes = ["plain", "dspark"]
    grouped_bars(axes[0], modes, {k: [results[f"{m}, {k}"]["tok_s"] for m in modes] for k in ("free", "schema")},
                 "tokens/s (batch 1)")
    grouped_bars(axes[1], ["dspark"], {k: [results[f"dspark, {k}"]["acceptance"] or 0] for k in ("free", "schema")},
                 "tokens per verify step")
    save_figure(fig, "bench_structured", "JSON schemas on dsv4-tiny: decode speed and DSpark acceptance")


if __name__ == "__main__":
    main()
