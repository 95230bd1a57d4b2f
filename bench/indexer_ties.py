"""How often the CSA indexer's top-k cut falls inside a tie on a trained model (dsv4-tiny) over held-out text.

Every query row of every CSA layer that sees more valid compressed entries than `index_topk` is a cut; a cut is tied
when the last kept score equals the first dropped one (then the tie rule, lowest entry first, decides what is kept),
and a zero tie when that score is 0 (all of the entry's head dot products <= 0). Prompts: this repository's own
Python sources (dsv4-tiny was trained on Python's standard library, so these are unseen), prefilled through the
engine. Prints a table; `--files` and `--tokens` size the run.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pdspark import LLM
from pdspark.model import indexer as indexer_module

import torch

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=1500, help="prompt length (dsv4-tiny's index_topk is 64)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    llm = LLM("dsv4-tiny", max_model_len=args.tokens + 8)
    assert llm.tokenizer is not None
    tally = {"cuts": 0, "tied": 0, "zero": 0, "tied_entries": 0}
    original = indexer_module.select_topk

    def counting(scores, valid, k):
        masked = scores.masked_fill(~valid, float("-inf")).sort(dim=-1, descending=True).values
        rows = valid.sum(-1) > k
        if rows.any():
            kept, dropped = masked[rows, k - 1], masked[rows, k]
            tied = kept == dropped
            tally["cuts"] += int(rows.sum())
            tally["tied"] += int(tied.sum())
            tally["zero"] += int((tied & (kept == 0)).sum())
            tally["tied_entries"] += int((masked[rows] == kept[:, None]).sum(-1)[tied].sum())
        return original(scores, valid, k)

    indexer_module.select_topk = counting
    files = sorted((ROOT / "src" / "pdspark").rglob("*.py"), key=lambda p: -p.stat().st_size)[: args.files]
    for i, f in enumerate(files, 1):
        ids = llm.tokenizer.encode(f.read_text())[: args.tokens]
        llm.generate(prompt_token_ids=[ids], sampling_params=_one_token())
        print(f"[{i}/{len(files)}] {f.relative_to(ROOT)}: {len(ids)} tokens", flush=True)
    indexer_module.select_topk = original
    cuts = max(tally["cuts"], 1)
    print(f"\n| query rows with top-k active | cut inside a tie | of which at score 0 | entries tied at such a cut "
          f"(mean) |\n|---|---|---|---|\n| {tally['cuts']} | {tally['tied']} ({100 * tally['tied'] / cuts:.2f}%) "
          f"| {tally['zero']} | {tally['tied_entries'] / max(tally['tied'], 1):.1f} |")


def _one_token():
    from pdspark import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


if __name__ == "__main__":
    main()
