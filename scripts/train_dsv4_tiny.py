#!/usr/bin/env python
"""Train the shipped `dsv4-tiny` checkpoint: a byte-level BPE tokenizer and a small DeepSeek-V4 target model.

Stages (`--stage`):
  tokenizer    train the BPE tokenizer on the train split; write tokenizer.json and tokenizer_config.json
  target       train `DeepseekV4ForCausalLM` on the packed train split; save it with `save_pretrained`
  eval-target  held-out bits per byte, a greedy sample, the model card
  all          tokenizer, target, eval-target
The speculative draft is trained later by a separate stage; the model card keeps a line for it.

Corpus: the running interpreter's standard library (`*.py`, site-/dist-packages excluded), split into train and
held-out by a hash of each file's relative path. Everything is seeded. `--steps` pins the schedule; without it a
short timing probe picks the step count from `--target-minutes`, and the choice is printed and written to
`train_log.json`, so a run is reproduced with `--steps N`.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from dsv4_tiny_recipe.card import write_card
from dsv4_tiny_recipe.console import hms, log
from dsv4_tiny_recipe.corpus import corpus_record
from dsv4_tiny_recipe.evaluation import run_eval_stage
from dsv4_tiny_recipe.recipe import DEFAULT_OUT
from dsv4_tiny_recipe.record import read_record, write_record
from dsv4_tiny_recipe.target import run_target_stage
from dsv4_tiny_recipe.tokenizer import run_tokenizer_stage


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stage", required=True, choices=("tokenizer", "target", "eval-target", "all"))
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="asset directory (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=None, help="total target steps; skips the timing probe")
    p.add_argument("--target-minutes", type=float, default=32.0, help="target training-loop budget for the probe")
    p.add_argument("--probe-steps", type=int, default=5, help="timed probe steps per phase (after one warmup)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--long-seq-len", type=int, default=2048)
    p.add_argument("--long-batch-size", type=int, default=1)
    p.add_argument("--long-frac", type=float, default=0.1, help="fraction of the steps in the long phase (at the end)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup-frac", type=float, default=0.04)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--indexer-loss-weight", type=float, default=1.0)
    p.add_argument("--router-bias-rate", type=float, default=1e-2, help="DeepSeek uses 1e-3 over far more steps")
    p.add_argument("--final-loss-window", type=int, default=20)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-tokens", type=int, default=204_800)
    p.add_argument("--eval-batch", type=int, default=8)
    p.add_argument("--sample-tokens", type=int, default=64)
    return p.parse_args(argv)


STAGES = {"tokenizer": run_tokenizer_stage, "target": run_target_stage, "eval-target": run_eval_stage}
# A rerun stage invalidates what later stages recorded (a new tokenizer means a new model, and so on).
STALE_AFTER = {"tokenizer": ("target", "eval", "draft"), "target": ("eval", "draft"), "eval-target": ()}


def main(argv=None) -> None:
    args = parse_args(argv)
    names = list(STAGES) if args.stage == "all" else [args.stage]
    start = time.time()
    record = read_record(args.out)
    record["corpus"] = corpus_record()
    for name in names:
        for key in STALE_AFTER[name]:
            record.pop(key, None)
        STAGES[name](args, record)
        write_record(args.out, record)
        write_card(args.out, record)
    if args.stage == "all":
        record["all_wall_s"] = round(time.time() - start, 1)
        write_record(args.out, record)
        write_card(args.out, record)
    log(f"[{args.stage}] finished in {hms(time.time() - start)}; outputs in {args.out}")


if __name__ == "__main__":
    main()
