"""DSpark on vs off on held-out prompts: decode tokens/s at batch 1 and 8, acceptance length and per position.

Decode tokens/s counts a group's tokens from the step at which its last prompt was computed to its end (prefill is
excluded: at batch 8 the prompts take more than one step's token budget, and a step that computes prompts is not a
decode step). Greedy, EOS ignored. Three engines run in this process, taking turns group by group (a slow spell of a
shared VM then falls on all three alike), with `--repeats` medians: plain, DSpark at every step, and DSpark with
`speculative_policy="when-faster"` (the governor of `engine/spec_governor.py`, which drafts only at the batch sizes
where it measured drafting faster; its exploration is part of its figure).

Where a step goes at batch 1: the forward of a plain decode step (1 row) and of a verify step (gamma + 1 rows), and
the draft's proposal, medians over the steps. The roofline (`roofline.py`: fp32 GEMV GB/s measured in this run,
before and after) puts plain decode and DSpark's committed tokens as fractions of the memory limit.

    python bench/bench_dspark.py [--model dsv4-tiny] [--prompts 8] [--prompt-len 128] [--output-len 128]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from pdspark import LLM, SamplingParams
from pdspark.llm import resolve_model

import torch
from report import figure, grouped_bars, save_figure, write_json
from roofline import machine_limits, work_per_token


class StepTimer:
    """Wall time of every call of `obj.name` while active, keyed by the call's row count (`rows_of(args)`)."""

    def __init__(self, obj, name: str, rows_of):
        self.obj, self.name, self.rows_of = obj, name, rows_of
        self.times: dict[int, list[float]] = {}

    def __enter__(self):
        inner = getattr(self.obj, self.name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            out = inner(*args, **kwargs)
            self.times.setdefault(self.rows_of(args), []).append(time.perf_counter() - t0)
            return out

        setattr(self.obj, self.name, timed)
        return self

    def __exit__(self, *exc):
        delattr(self.obj, self.name)  # back to the class's method


class DecodeMeter:
    """One engine's decode time and tokens, a group of requests at a time (`group`), with the medians of its step
    forwards by row count and of its proposals (`result`). The engines of a run take turns group by group, so that
    a slow spell of a shared VM (its neighbours) falls on all of them alike rather than on one engine's whole turn."""

    def __init__(self, llm: LLM, output_len: int):
        self.engine = engine = llm.engine
        self.params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        self.forward = StepTimer(engine.runner, "run", lambda a: sum(len(c.token_ids) for c in a[0]))
        self.propose = (StepTimer(engine.drafter, "propose", lambda a: len(a[0]))
                        if engine.drafter is not None else None)
        self.reset()

    def reset(self) -> None:
        self.decode_s, self.tokens, self.decode_steps, self.drafted_steps = 0.0, 0, 0, 0
        self.verify0 = self.engine.spec.verify_steps
        for timer in (self.forward, self.propose):
            if timer is not None:
                timer.times = {}

    def group(self, prompts: list[list[int]]) -> None:
        """Decode one group of requests at once; its decode time runs from the step at which its last prompt was
        computed to its last token."""
        engine = self.engine
        with contextlib.ExitStack() as timers:
            for timer in (self.forward, self.propose):
                if timer is not None:
                    timers.enter_context(timer)
            ids = [engine.add_request(p, self.params) for p in prompts]
            first = last = None
            before = 0  # the group's tokens when its decoding began
            while engine.has_unfinished:
                verified = engine.spec.verify_steps  # counts verify chunks: more than one a step at batch > 1
                engine.step()
                now = time.perf_counter()
                if first is None:
                    # Decoding begins once every prompt is computed: a group's prompts may take several steps (the
                    # step's token budget), and those steps are prefill, whatever tokens they also decode.
                    if all(engine.requests[r].output_token_ids for r in ids):
                        first = now
                        before = sum(len(engine.requests[r].output_token_ids) for r in ids)
                else:
                    self.decode_steps += 1
                    self.drafted_steps += engine.spec.verify_steps > verified
                last = now
            assert first is not None and last is not None
            self.decode_s += last - first
            self.tokens += sum(len(engine.requests[r].output_token_ids) for r in ids) - before
            for r in ids:
                engine.release(r)

    def result(self) -> dict:
        """Decode tokens/s over the groups since `reset`, and the step medians (up to 16 rows: decode and verify
        steps)."""
        medians = {f"forward_ms_{rows}_rows": 1e3 * statistics.median(ts)
                   for rows, ts in sorted(self.forward.times.items()) if rows <= 16}
        if self.propose is not None:
            medians.update({f"propose_ms_{m}_blocks": 1e3 * statistics.median(ts)
                            for m, ts in sorted(self.propose.times.items())})
        verify_steps = self.engine.spec.verify_steps - self.verify0
        return {"decode_tok_s": self.tokens / self.decode_s, "verify_steps": verify_steps,
                "decode_steps": self.decode_steps, "drafted_steps": self.drafted_steps, "tokens": self.tokens,
                **medians}


def run(llm: LLM, prompts: list[list[int]], batch: int, output_len: int) -> dict:
    """One engine alone (`bench_kernel_threads`, `bench_cpu_contention`): `prompts` decoded in groups of `batch`,
    `DecodeMeter.result`'s figures over them."""
    meter = DecodeMeter(llm, output_len)
    for i in range(0, len(prompts), batch):
        meter.group(prompts[i : i + batch])
    return meter.result()


RECIPE = Path(__file__).resolve().parents[1] / "scripts" / "train_dspark_draft.py"


def heldout_prompts(model_dir: Path, n: int, length: int, seed: int) -> list[list[int]]:
    """Prompts from the held-out split of the draft's training recipe (unseen code), from the recipe's own CLI."""
    cmd = [sys.executable, str(RECIPE), "--out", str(model_dir), "--stage", "heldout", "--prompts", str(n),
           "--prompt-len", str(length), "--seed", str(seed)]
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)


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
    # The governor: drafts only at the batch sizes where this machine measures them faster (`spec_governor.py`).
    auto = LLM(path, speculative="dspark", speculative_policy="when-faster", **opts)
    batches = [int(b) for b in args.batches.split(",")]
    working_set = int(work_per_token(path, 1)["decode_step_bytes_read"])
    limits = [machine_limits(args.threads, working_set_bytes=working_set)]
    meters = {name: DecodeMeter(llm, args.output_len) for name, llm in (("plain", plain), ("dspark", spec),
                                                                           ("auto", auto))}
    rows: dict[tuple[str, int], list[dict]] = {}
    for rep in range(args.repeats):
        for b in batches:
            for meter in meters.values():
                meter.reset()
            for i in range(0, len(prompts), b):  # the engines take turns, group by group
                for meter in meters.values():
                    meter.group(prompts[i : i + b])
            for name, meter in meters.items():
                r = meter.result()
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
        "| batch | plain decode tok/s | DSpark decode tok/s | speedup | DSpark when faster tok/s | speedup | "
        "its steps with drafts |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    summary = []
    for b in batches:
        p, s, a = med("plain", b), med("dspark", b), med("auto", b)
        drafted = sum(r["drafted_steps"] for r in rows[("auto", b)]) / max(
            1, sum(r["decode_steps"] for r in rows[("auto", b)]))
        lines.append(f"| {b} | {p:.1f} | {s:.1f} | {s / p:.2f}x | {a:.1f} | {a / p:.2f}x | {drafted:.0%} |")
        summary.append({"batch": b, "plain_tok_s": p, "dspark_tok_s": s, "speedup": s / p,
                        "when_faster_tok_s": a, "when_faster_speedup": a / p, "when_faster_drafted_steps": drafted})
    lines += [
        "",
        f"mean acceptance length (tokens per verify step, bonus included): {acc_len:.2f}",
        "acceptance per draft position: " + ", ".join(f"{x:.2f}" for x in per_pos),
    ]
    # Batch 1, where a step goes: medians over the repeats of the per-run step medians.
    limits.append(machine_limits(args.threads, working_set_bytes=working_set))
    gemv = statistics.median(m["gemv_gb_s"] for m in limits)
    ws_gemv = statistics.median(m["working_set_gemv_gb_s"] for m in limits)
    step_bytes = work_per_token(path, 1)["decode_step_bytes"]
    gamma = spec.engine.drafter.gamma

    def med_key(name, key):
        vals = [r[key] for r in rows.get((name, 1), []) if key in r]
        return statistics.median(vals) if vals else float("nan")

    decode_ms = med_key("plain", "forward_ms_1_rows")
    verify_ms = med_key("dspark", f"forward_ms_{gamma + 1}_rows")
    propose_ms = med_key("dspark", "propose_ms_1_blocks")
    steps = {"decode_forward_ms": decode_ms, "verify_forward_ms": verify_ms, "propose_ms": propose_ms,
             "verify_over_decode": verify_ms / decode_ms, "gemv_gb_s": gemv, "working_set_gemv_gb_s": ws_gemv,
             "decode_step_bytes": step_bytes, "decode_step_bytes_read": working_set, "measured": limits}
    if 1 in batches:
        plain_gb_s = med("plain", 1) * step_bytes / 1e9
        read_gb_s = med("plain", 1) * working_set / 1e9
        steps.update(plain_fraction=plain_gb_s / gemv, dspark_equivalent_fraction=med("dspark", 1) * step_bytes / 1e9
                     / gemv, plain_working_set_fraction=read_gb_s / ws_gemv)
        lines += [
            "",
            f"batch 1, where a step goes (medians): plain decode forward {decode_ms:.2f} ms; DSpark verify forward "
            f"({gamma + 1} rows) {verify_ms:.2f} ms = {verify_ms / decode_ms:.2f}x a decode forward; proposal "
            f"{propose_ms:.2f} ms",
            f"roofline (measured in this run): fp32 GEMV {gemv:.1f} GB/s; {step_bytes / 1e6:.1f} MB of active weights "
            f"per plain step: plain decode at {plain_gb_s / gemv:.0%} of it, DSpark's committed tokens x those bytes "
            f"at {steps['dspark_equivalent_fraction']:.0%}",
            f"working-set roofline: a GEMV over the {working_set / 1e6:.1f} MB a plain step reads (as read) runs at "
            f"{ws_gemv:.1f} GB/s here (cache-resident where the weights are); plain decode reads at "
            f"{read_gb_s / ws_gemv:.0%} of it",
        ]
    print("\n".join(lines))
    write_json("dspark", {"args": vars(args), "summary": summary, "mean_acceptance_length": acc_len,
                          "acceptance_per_position": per_pos, "batch1_steps": steps,
                          "runs": {f"{n} b{b}": v for (n, b), v in rows.items()}})
    fig, (a1, a2) = figure(ncols=2, width=10)
    engines = {"plain": "plain_tok_s", "DSpark": "dspark_tok_s", "DSpark when faster": "when_faster_tok_s"}
    grouped_bars(a1, [f"batch {s['batch']}" for s in summary],
                 {name: [s[key] for s in summary] for name, key in engines.items()}, "decode tokens / s")
    a2.bar(range(1, len(per_pos) + 1), per_pos)
    a2.set_xlabel("draft position")
    a2.set_ylabel("P(accepted)")
    a2.set_ylim(0, 1)
    save_figure(fig, "dspark", lines[0])


if __name__ == "__main__":
    main()
