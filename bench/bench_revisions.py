"""The engine at two git revisions of pdspark, side by side: did a change slow anything down?

Each measurement runs the offline engine in its own process with `PYTHONPATH` pointing at one revision's `src/`
(the baseline is exported with `git archive` into a temporary folder), alternating the two revisions so that machine
noise hits both alike. Cases: batch-1 and batch-8 greedy decode, a long prefill, and DSpark at batch 1 on the shipped
model. Reports medians and the current/baseline ratio (> 1: the current tree is faster).

    python bench/bench_revisions.py [--baseline HEAD~1] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from report import figure, paired_bars, save_figure, write_json

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Case:
    name: str
    batch: int
    prompt_len: int
    output_len: int
    speculative: bool = False


CASES = (
    Case("decode b1", 1, 128, 96),
    Case("decode b8", 8, 128, 64),
    Case("prefill 2048", 1, 2048, 1),
    Case("dspark b1", 1, 128, 96, speculative=True),
)


def _worker(case: Case, model: str, threads: int) -> dict:
    """Runs inside the measured process: tokens/s of one case (prefill: prompt tokens/s)."""
    import torch

    torch.set_num_threads(threads)
    from pdspark import LLM, SamplingParams

    try:  # where `resolve_model` lives depends on the revision
        from pdspark.assets import resolve_model
    except ImportError:
        from pdspark.llm import resolve_model
    from pdspark.model.model_config import ModelConfig

    path = resolve_model(model)
    vocab = ModelConfig.from_dir(path).vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(8, vocab, (case.prompt_len,), generator=g).tolist() for _ in range(case.batch)]
    options = {"speculative": "dspark"} if case.speculative else {}
    llm = LLM(path, max_model_len=case.prompt_len + case.output_len + 64, max_num_seqs=max(case.batch, 1),
              max_num_batched_tokens=2048, **options)
    llm.generate(prompt_token_ids=[prompts[0][:16]], sampling_params=SamplingParams(max_tokens=2))  # warm-up
    params = SamplingParams(temperature=0, max_tokens=case.output_len, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    seconds = time.perf_counter() - t0
    produced = case.batch * case.prompt_len if case.output_len == 1 else sum(len(o.token_ids) for o in outs)
    return {"seconds": seconds, "tokens_per_s": produced / seconds,
            "token_ids": [list(o.token_ids) for o in outs]}


def export_src(revision: str, into: Path) -> tuple[str, Path]:
    """`revision`'s `src/` exported (`git archive`) under `into`: its short hash and the exported `src/`."""
    rev = subprocess.run(["git", "rev-parse", "--short", revision], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()
    archive = subprocess.run(["git", "archive", rev, "src"], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return rev, into / "src"


def _measure(src: Path, case: Case, args) -> dict:
    cmd = [sys.executable, __file__, "--worker", json.dumps(asdict(case)), "--model", args.model,
           "--threads", str(args.threads)]
    env = {"PYTHONPATH": str(src), "PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{case.name} at {src} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="HEAD~1", help="git revision to compare the working tree against")
    parser.add_argument("--model", default="dsv4-tiny")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--worker")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(_worker(Case(**json.loads(args.worker)), args.model, args.threads)))
        return

    runs: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        rev, src = export_src(args.baseline, Path(tmp))
        trees = {"baseline": src, "current": ROOT / "src"}
        for rep in range(args.repeats):
            for case in CASES:
                for name in (("baseline", "current") if rep % 2 == 0 else ("current", "baseline")):
                    r = _measure(trees[name], case, args)
                    runs.setdefault((case.name, name), []).append(r)
                    print(f"[{rep + 1}/{args.repeats}] {case.name:<13} {name:<8} {r['tokens_per_s']:8.1f} tok/s",
                          file=sys.stderr, flush=True)

    lines = [
        f"model {args.model}, baseline {rev} vs working tree, {args.threads} thread(s), {platform.machine()}, "
        f"medians of {args.repeats}",
        "",
        "| case | baseline tok/s | current tok/s | current / baseline | same tokens |",
        "|---|---:|---:|---:|---|",
    ]
    summary = []
    for case in CASES:
        base = statistics.median(r["tokens_per_s"] for r in runs[(case.name, "baseline")])
        cur = statistics.median(r["tokens_per_s"] for r in runs[(case.name, "current")])
        same = runs[(case.name, "baseline")][0]["token_ids"] == runs[(case.name, "current")][0]["token_ids"]
        lines.append(f"| {case.name} | {base:.1f} | {cur:.1f} | {cur / base:.2f} | {'yes' if same else 'NO'} |")
        summary.append({"case": case.name, "baseline_tok_s": base, "current_tok_s": cur, "ratio": cur / base,
                        "same_tokens": same})
    print("\n".join(lines))
    write_json("revisions", {"args": vars(args), "baseline": rev, "summary": summary,
                             "runs": {f"{k[0]}/{k[1]}": [r["tokens_per_s"] for r in v] for k, v in runs.items()}})
    fig, ax = figure(width=8.0)
    paired_bars(ax, [s["case"] for s in summary], [s["baseline_tok_s"] for s in summary],
                [s["current_tok_s"] for s in summary], (f"baseline {rev}", "current"), "tokens / s")
    save_figure(fig, "revisions", lines[0])


if __name__ == "__main__":
    main()
