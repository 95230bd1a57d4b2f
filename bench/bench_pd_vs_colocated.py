"""P/D vs colocated under interference: inter-token latency (ITL) of a decode-heavy stream while 2,048-token prompts
arrive periodically, and their TTFT.

- colocated: one engine process (`colocated.py`) that prefills and decodes everything, two torch threads, on both
  cores.
- P/D: a prefill worker pinned to core 0 and a decode worker pinned to core 1 (`os.sched_setaffinity` on every
  thread of each process), one torch thread each, requests sent with the router's dual dispatch.
Each mode runs an idle phase (the stream alone) and then an interference phase (the stream plus a long prompt every
`--long-every` seconds). The stream: `--streams` concurrent requests with short prompts and `--stream-tokens`
tokens each, replaced as they finish. ITL: the gap between a stream's consecutive outputs, per token (an output
carrying k tokens counts k gaps of 1/k). Greedy, plain decoding (no DSpark), no prefix cache.

    python bench/bench_pd_vs_colocated.py [--model dsv4-tiny] [--idle-s 8] [--load-s 24] [--long-every 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator

from pdspark import SamplingParams
from pdspark.llm import resolve_model
from pdspark.model.model_config import ModelConfig
from pdspark.rpc import convert
from pdspark.testing.services import start_worker  # (worker processes started and stopped by PID)
from pdspark.v1 import worker_pb2, worker_pb2_grpc

import grpc
import torch
from colocated import ColocatedWorker
from report import figure, paired_bars, save_figure, write_json

# (arrival time, tokens in this output) per output of one request
Generate = Callable[[list[int], SamplingParams], Iterator[tuple[float, int]]]


def pin(pid: int, cpus: set[int]) -> None:
    """Pin every thread of `pid` (threads started later inherit it from their pinned parents)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), cpus)


def pd_generate(prefill, decode) -> Generate:
    p_stub = worker_pb2_grpc.PrefillWorkerStub(grpc.insecure_channel(prefill.address))
    d_stub = worker_pb2_grpc.DecodeWorkerStub(grpc.insecure_channel(decode.address))

    def generate(prompt: list[int], params: SamplingParams) -> Iterator[tuple[float, int]]:
        tid, rid = uuid.uuid4().hex, uuid.uuid4().hex
        sampling = convert.sampling_to_pb(params)
        leg = threading.Thread(target=lambda: p_stub.Prefill(worker_pb2.PrefillRequest(
            request_id=rid, transfer_id=tid, prompt_token_ids=prompt, sampling=sampling, timeout_ms=120_000),
            timeout=150))
        leg.start()
        req = worker_pb2.GenerateRequest(request_id=rid, transfer_id=tid, prompt_token_ids=prompt, sampling=sampling,
                                         prefill_address=prefill.address, timeout_ms=120_000)
        for chunk in d_stub.Generate(req, timeout=150):
            if chunk.token_ids:
                yield time.perf_counter(), len(chunk.token_ids)
        leg.join(150)

    return generate


def colocated_generate(worker: ColocatedWorker) -> Generate:
    def generate(prompt: list[int], params: SamplingParams) -> Iterator[tuple[float, int]]:
        seen = 0
        for event in worker.generate(uuid.uuid4().hex, prompt, params):
            if event.num_tokens > seen:
                yield event.at, event.num_tokens - seen
                seen = event.num_tokens

    return generate


class Phase:
    """Samples gathered while a phase runs: ITL of stream tokens that arrived in it, TTFT of its long prompts."""

    def __init__(self, name: str):
        self.name = name
        self.itl: list[float] = []
        self.long_ttft: list[float] = []
        self.stream_ttft: list[float] = []


def run_mode(generate: Generate, args, vocab: int) -> dict[str, Phase]:
    g = torch.Generator().manual_seed(1)
    stream_params = SamplingParams(temperature=0, max_tokens=args.stream_tokens, ignore_eos=True)
    long_params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    lock = threading.Lock()
    prompts = [torch.randint(8, vocab, (args.short_len,), generator=g).tolist() for _ in range(64)]
    longs = [torch.randint(8, vocab, (args.long_len,), generator=g).tolist() for _ in range(64)]
    list(generate(prompts[0], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)))  # warm-up
    list(generate(longs[-1], long_params))
    phases = {"idle": Phase("idle"), "interference": Phase("interference")}
    current: list[Phase | None] = [None]
    stop = threading.Event()

    def stream(k: int) -> None:
        i = k
        while not stop.is_set():
            t0 = last = time.perf_counter()
            first = True
            for at, n in generate(prompts[i % len(prompts)], stream_params):
                with lock:
                    phase = current[0]
                    if phase is not None:
                        if first:
                            phase.stream_ttft.append(at - t0)
                        else:
                            phase.itl.extend([(at - last) / n] * n)
                first, last = False, at
            i += args.streams

    threads = [threading.Thread(target=stream, args=(k,), daemon=True) for k in range(args.streams)]
    for t in threads:
        t.start()
    time.sleep(2.0)  # let the stream reach its steady state before sampling (a rate, not synchronisation)
    with lock:
        current[0] = phases["idle"]
    time.sleep(args.idle_s)
    with lock:
        current[0] = phases["interference"]
    end = time.perf_counter() + args.load_s
    j = 0
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        first_at = next(iter(generate(longs[j % len(longs)], long_params)))[0]
        phases["interference"].long_ttft.append(first_at - t0)
        print(f"    long prompt {j + 1}: TTFT {(first_at - t0) * 1e3:.0f} ms", file=sys.stderr, flush=True)
        j += 1
        time.sleep(max(0.0, args.long_every - (time.perf_counter() - t0)))
    with lock:
        current[0] = None
    stop.set()
    for t in threads:
        t.join(120)
    return phases


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def summary(phases: dict[str, Phase]) -> dict:
    idle, load = phases["idle"], phases["interference"]
    return {
        "idle_itl_p50_ms": pct(idle.itl, 0.5) * 1e3, "idle_itl_p99_ms": pct(idle.itl, 0.99) * 1e3,
        "load_itl_p50_ms": pct(load.itl, 0.5) * 1e3, "load_itl_p99_ms": pct(load.itl, 0.99) * 1e3,
        "p99_degradation": pct(load.itl, 0.99) / pct(idle.itl, 0.99),
        # The longest gaps: once decode steps are fast, a stall per long prompt per stream can fall below the 1%
        # of inter-token gaps that p99 looks at, while every stream still waits out the whole prefill.
        "idle_itl_p999_ms": pct(idle.itl, 0.999) * 1e3, "load_itl_p999_ms": pct(load.itl, 0.999) * 1e3,
        "idle_itl_max_ms": max(idle.itl, default=float("nan")) * 1e3,
        "load_itl_max_ms": max(load.itl, default=float("nan")) * 1e3,
        "long_ttft_p50_ms": pct(load.long_ttft, 0.5) * 1e3, "long_ttft_p99_ms": pct(load.long_ttft, 0.99) * 1e3,
        "stream_ttft_p50_ms": pct(load.stream_ttft, 0.5) * 1e3,
        "stream_ttft_p99_ms": pct(load.stream_ttft, 0.99) * 1e3,
        "samples": {"idle_itl": len(idle.itl), "load_itl": len(load.itl), "long_prompts": len(load.long_ttft)},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="dsv4-tiny")
    parser.add_argument("--streams", type=int, default=4, help="concurrent decode-heavy requests")
    parser.add_argument("--stream-tokens", type=int, default=64)
    parser.add_argument("--short-len", type=int, default=32)
    parser.add_argument("--long-len", type=int, default=2048)
    parser.add_argument("--long-every", type=float, default=3.0, help="seconds between long prompts")
    parser.add_argument("--idle-s", type=float, default=8.0)
    parser.add_argument("--load-s", type=float, default=24.0)
    args = parser.parse_args()
    path = resolve_model(args.model)
    vocab = ModelConfig.from_dir(path).vocab_size
    max_len = args.long_len + 64
    seqs = args.streams + 2
    common = ["--max-model-len", str(max_len), "--max-num-seqs", str(seqs), "--max-num-batched-tokens", "2048",
              "--no-prefix-cache"]
    options = dict(max_model_len=max_len, max_num_seqs=seqs, max_num_batched_tokens=2048, enable_prefix_cache=False)
    results = {}

    print("colocated: one engine on cores {0, 1}...", file=sys.stderr, flush=True)
    worker = ColocatedWorker(str(path), options, threads=2, cpus={0, 1})
    try:
        results["colocated"] = summary(run_mode(colocated_generate(worker), args, vocab))
    finally:
        worker.stop()

    print("P/D: prefill on core 0, decode on core 1...", file=sys.stderr, flush=True)
    prefill = start_worker("prefill", path, *common)
    decode = start_worker("decode", path, *common)
    try:
        pin(prefill.pid, {0})
        pin(decode.pid, {1})
        results["pd"] = summary(run_mode(pd_generate(prefill, decode), args, vocab))
    finally:
        decode.stop()
        prefill.stop()

    lines = [
        f"model {args.model}: {args.streams} streams x {args.stream_tokens} tokens, a {args.long_len}-token prompt "
        f"every {args.long_every:g}s; idle {args.idle_s:g}s, interference {args.load_s:g}s",
        "",
        "| mode | idle ITL p50 / p99 / max ms | loaded ITL p50 / p99 / p99.9 / max ms | p99 loaded / idle "
        "| long-prompt TTFT p50 / p99 ms | stream TTFT p50 / p99 ms |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for mode, r in results.items():
        lines.append(f"| {mode} | {r['idle_itl_p50_ms']:.1f} / {r['idle_itl_p99_ms']:.1f} / "
                     f"{r['idle_itl_max_ms']:.0f} | {r['load_itl_p50_ms']:.1f} / {r['load_itl_p99_ms']:.1f} / "
                     f"{r['load_itl_p999_ms']:.0f} / {r['load_itl_max_ms']:.0f} | {r['p99_degradation']:.2f}x | "
                     f"{r['long_ttft_p50_ms']:.0f} / {r['long_ttft_p99_ms']:.0f} | "
                     f"{r['stream_ttft_p50_ms']:.0f} / {r['stream_ttft_p99_ms']:.0f} |")
    print("\n".join(lines))
    write_json("pd_vs_colocated", {"args": vars(args), "results": results})
    fig, (a1, a3, a2) = figure(ncols=3, width=14)
    modes = list(results)
    paired_bars(a1, modes, [results[m]["idle_itl_p99_ms"] for m in modes],
                [results[m]["load_itl_p99_ms"] for m in modes], ("idle", "with long prompts"), "p99 ITL (ms)")
    paired_bars(a3, modes, [results[m]["idle_itl_max_ms"] for m in modes],
                [results[m]["load_itl_max_ms"] for m in modes], ("idle", "with long prompts"), "longest ITL (ms)")
    a2.bar(modes, [results[m]["long_ttft_p50_ms"] for m in modes])
    a2.set_ylabel(f"{args.long_len}-token prompt TTFT p50 (ms)")
    save_figure(fig, "pd_vs_colocated", lines[0])


if __name__ == "__main__":
    main()
