"""pdspark vs transformers' `generate` on the same DSV4 checkpoint: output tokens/s and peak RSS.

Each measurement runs in its own process (so peak RSS belongs to one system), alternating the two systems; with
`--repeats N` the table shows medians. Greedy decoding, EOS ignored, random prompt ids (same for both).
`--config big` runs a bigger random DSV4 (`random_checkpoint.py`) instead of `--model`.

The roofline (`roofline.py`) is measured in the same run, before and after the measurements (medians): fp32 GEMM
GFLOP/s and GEMV GB/s. pdspark's decode is reported as a fraction of the GEMV limit (active weight bytes per step x
steps/s; the bytes as read, a matrix of bf16 numbers at 2 bytes a value, and the fp32-equivalent fraction beside)
and its prefill as a fraction of the GEMM limit (matmul FLOPs per token x prompt tokens/s; the prompts prefilled
alone, timed before the generate run).

    python bench/bench_engine_vs_transformers.py [--model dsv4-tiny | --config big] [--prompt-len 512]
        [--output-len 128] [--device cpu|cuda]

With `--device cuda` both systems run on the GPU, peak memory is the GPU's (`torch.cuda.max_memory_allocated`), and
the results are written as `engine_vs_transformers_cuda` beside the CPU ones (`scripts/device_check.sh`).
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import time

from random_checkpoint import CONFIGS, random_checkpoint
from report import figure, paired_bars, save_figure, write_json
from roofline import machine_limits, work_per_token


def _prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    # Skip the first few ids (special tokens in dsv4-tiny's vocabulary).
    return [torch.randint(8, vocab, (length,), generator=g).tolist() for _ in range(batch)]


class _StepClock:
    """Times the engine's steps: decode steps/s counts the steps after every request has its first token, over
    the time they took (timed where they run: subtracting a separately timed prefill made the figure as noisy as
    the difference of two noisy times)."""

    def __init__(self, engine):
        self.engine, self.ends, self.decoding = engine, [], []
        step = engine.step

        def timed():
            out = step()
            self.ends.append(time.perf_counter())
            reqs = list(engine.requests.values())
            self.decoding.append(bool(reqs) and all(r.output_token_ids for r in reqs))
            return out

        engine.step = timed

    def decode_steps_per_s(self) -> float:
        first = self.decoding.index(True)  # the step that gave the last request its first token
        n = len(self.ends) - 1 - first
        return n / max(self.ends[-1] - self.ends[first], 1e-9)


def _worker(system: str, model: str, batch: int, prompt_len: int, output_len: int, threads: int,
            device: str = "cpu") -> dict:
    import torch

    torch.set_num_threads(threads)
    from pdspark.llm import resolve_model
    from pdspark.model.model_config import ModelConfig

    path = resolve_model(model)
    prompts = _prompts(batch, prompt_len, ModelConfig.from_dir(path).vocab_size, seed=0)
    if system == "pdspark":
        from pdspark import LLM, SamplingParams

        llm = LLM(path, max_model_len=prompt_len + output_len + 64, max_num_seqs=max(batch, 1),
                  max_num_batched_tokens=1024, device=device)
        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        # Warm-up at full length (other ids): the first prefill of a shape pays one-time costs (allocator, BLAS).
        warm = _prompts(1, prompt_len, ModelConfig.from_dir(path).vocab_size, seed=1)
        llm.generate(prompt_token_ids=warm, sampling_params=SamplingParams(max_tokens=2))
        t0 = time.perf_counter()  # the prefill alone (one token each), for the prefill roofline
        llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=1, ignore_eos=True))
        prefill_s = time.perf_counter() - t0
        llm.flush_cache()  # the timed run prefills again (no prefix-cache hit)
        clock = _StepClock(llm.engine)
        t0 = time.perf_counter()
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        seconds = time.perf_counter() - t0
        n_out = sum(len(o.token_ids) for o in outs)
        extra = {"prefill_tok_s": batch * prompt_len / prefill_s, "decode_steps_s": clock.decode_steps_per_s()}
    else:
        from transformers import DeepseekV4ForCausalLM

        hf = DeepseekV4ForCausalLM.from_pretrained(path).eval().to(device)
        hf.generation_config.eos_token_id = None
        ids = torch.tensor(prompts, device=device)  # equal lengths: one static batch, no padding needed
        with torch.no_grad():
            hf.generate(ids[:1, :16], max_new_tokens=2, do_sample=False, pad_token_id=0)  # warm-up
            t0 = time.perf_counter()
            out = hf.generate(ids, max_new_tokens=output_len, do_sample=False, pad_token_id=0)
            seconds = time.perf_counter() - t0
        n_out = int(out.shape[0] * (out.shape[1] - prompt_len))
        extra = {}
    return {**extra,
        "system": system,
        "batch": batch,
        "seconds": seconds,
        "output_tokens": n_out,
        "tokens_per_s": n_out / seconds,
        "peak_rss_mb": (torch.cuda.max_memory_allocated() / 2**20 if device == "cuda"
                        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
    }


def _measure(args, system: str, batch: int) -> dict:
    cmd = [sys.executable, __file__, "--worker", system, "--batch", str(batch), "--model", args.model,
           "--prompt-len", str(args.prompt_len), "--output-len", str(args.output_len), "--threads", str(args.threads),
           "--device", args.device]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{system} batch {batch} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"  {system:<12} batch {batch:>2}: {result['tokens_per_s']:8.1f} tok/s  "
          f"({time.perf_counter() - t0:.0f}s with start-up)", file=sys.stderr, flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="dsv4-tiny")
    parser.add_argument("--config", choices=sorted(CONFIGS), help="a bigger random DSV4 instead of --model")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--worker", choices=["pdspark", "transformers"])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(_worker(args.worker, args.model, args.batch, args.prompt_len, args.output_len, args.threads,
                                 args.device)))
        return

    if args.config:
        args.model = str(random_checkpoint(args.config))
    from pdspark.assets import resolve_model  # (after the worker branch: only the parent needs it here)

    batches = [int(b) for b in args.batches.split(",")]
    working_set = int(work_per_token(resolve_model(args.model), 1)["decode_step_bytes_read"])
    limits = [machine_limits(args.threads, working_set_bytes=working_set)] if args.device == "cpu" else []
    rows = {}
    for rep in range(args.repeats):
        for batch in batches:
            print(f"[repeat {rep + 1}/{args.repeats}] batch {batch}", file=sys.stderr, flush=True)
            for system in ("pdspark", "transformers"):
                rows.setdefault((system, batch), []).append(_measure(args, system, batch))

    def med(system, batch, key):
        return statistics.median(r[key] for r in rows[(system, batch)])

    memory = "RSS" if args.device == "cpu" else "GPU memory"
    label = f"random DSV4 '{args.config}'" if args.config else args.model
    lines = [
        f"model {label}, prompt {args.prompt_len}, output {args.output_len}, greedy, "
        f"{args.threads} threads, {platform.machine() if args.device == 'cpu' else args.device} "
        f"({args.repeats} repeat(s), medians)",
        "",
        f"| batch | pdspark tok/s | transformers tok/s | speedup | pdspark peak {memory} MB | transformers peak "
        f"{memory} MB |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    summary = []
    name = ("engine_vs_transformers" + (f"_{args.config}" if args.config else "")
            + ("" if args.device == "cpu" else f"_{args.device}"))
    for b in batches:
        pd, hf = med("pdspark", b, "tokens_per_s"), med("transformers", b, "tokens_per_s")
        pd_rss, hf_rss = med("pdspark", b, "peak_rss_mb"), med("transformers", b, "peak_rss_mb")
        lines.append(f"| {b} | {pd:.1f} | {hf:.1f} | {pd / hf:.2f}x | {pd_rss:.0f} | {hf_rss:.0f} |")
        summary.append({"batch": b, "pdspark_tok_s": pd, "transformers_tok_s": hf, "speedup": pd / hf,
                        "pdspark_peak_rss_mb": pd_rss, "transformers_peak_rss_mb": hf_rss})
    roofline = None
    if limits:
        limits.append(machine_limits(args.threads, working_set_bytes=working_set))
        gemm = statistics.median(m["gemm_gflops"] for m in limits)
        gemv = statistics.median(m["gemv_gb_s"] for m in limits)
        ws_gemv = statistics.median(m["working_set_gemv_gb_s"] for m in limits)
        roofline = {"gemm_gflops": gemm, "gemv_gb_s": gemv, "working_set_gemv_gb_s": ws_gemv,
                    "working_set_bytes": working_set, "measured": limits, "batches": []}
        lines += ["", f"roofline, measured in this run: fp32 GEMM {gemm:.1f} GFLOP/s, GEMV {gemv:.1f} GB/s from DRAM, "
                  f"{ws_gemv:.1f} GB/s over a decode step's {working_set / 1e6:.1f} MB working set "
                  f"({args.threads} threads)", "",
                  "| batch | decode steps/s | active weight MB / step: fp32, as read | decode GB/s (as read) | "
                  "of DRAM GEMV roofline | of working-set GEMV roofline | fp32-equivalent fraction (DRAM) | "
                  "prefill tok/s | prefill GFLOP/s | of GEMM roofline |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for b in batches:
            work = work_per_token(resolve_model(args.model), b)
            steps, prefill = med("pdspark", b, "decode_steps_s"), med("pdspark", b, "prefill_tok_s")
            # As read: the C decode path reads a matrix of bf16 numbers as bf16 bits (`roofline.work_per_token`).
            gb_s = steps * work["decode_step_bytes_read"] / 1e9
            fp32_gb_s = steps * work["decode_step_bytes"] / 1e9
            gflops = prefill * work["prefill_flops_per_token"] / 1e9
            lines.append(f"| {b} | {steps:.1f} | {work['decode_step_bytes'] / 1e6:.1f}, "
                         f"{work['decode_step_bytes_read'] / 1e6:.1f} | {gb_s:.2f} | {gb_s / gemv:.0%} | "
                         f"{gb_s / ws_gemv:.0%} | {fp32_gb_s / gemv:.0%} | {prefill:.0f} | {gflops:.1f} | "
                         f"{gflops / gemm:.0%} |")
            roofline["batches"].append({"batch": b, **work, "decode_steps_s": steps, "decode_gb_s": gb_s,
                                        "decode_fraction": gb_s / gemv, "working_set_fraction": gb_s / ws_gemv,
                                        "fp32_equivalent_fraction": fp32_gb_s / gemv,
                                        "prefill_tok_s": prefill,
                                        "prefill_gflops": gflops, "prefill_fraction": gflops / gemm})
    print("\n".join(lines))
    write_json(name, {"args": vars(args), "summary": summary, "roofline": roofline,
                      "runs": [r for v in rows.values() for r in v]})
    fig, ax = figure()
    paired_bars(ax, [f"batch {s['batch']}" for s in summary], [s["pdspark_tok_s"] for s in summary],
                [s["transformers_tok_s"] for s in summary], ("pdspark", "transformers generate"), "output tokens / s")
    for x, s in enumerate(summary):
        ax.annotate(f"{s['speedup']:.1f}x", (x - 0.2, s["pdspark_tok_s"]), ha="center", va="bottom")
    save_figure(fig, name, lines[0])


if __name__ == "__main__":
    main()
