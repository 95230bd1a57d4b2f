"""The router's cost: latency it adds (p50/p99) and request throughput, through the router vs calling the workers
directly (the client doing the dual dispatch itself), on stub workers (no model: the router alone) and on the real
cluster. Same requests, same client (gRPC, asyncio), one run.

    python bench/bench_router.py [--model dsv4-tiny] [--requests 200] [--concurrency 16] [--tokens 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from cluster import start_router, start_worker  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import figure, paired_bars, save_figure, write_json  # noqa: E402

from pdspark.rpc import convert  # noqa: E402
from pdspark.service_process import ServiceProcess  # noqa: E402
from pdspark.types import SamplingParams  # noqa: E402
from pdspark.v1 import router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc  # noqa: E402

PROMPT = [11, 12, 13, 14, 15, 16, 17, 18] * 4


async def direct(prefill: str, decode: str, params: SamplingParams) -> float:
    """The client's own dual dispatch (what the router does), timed to the last token."""
    p_stub = worker_pb2_grpc.PrefillWorkerStub(_channel(prefill))
    d_stub = worker_pb2_grpc.DecodeWorkerStub(_channel(decode))
    tid, rid = uuid.uuid4().hex, uuid.uuid4().hex
    sampling = convert.sampling_to_pb(params)
    timeout_ms = 60_000  # relative: each worker times it from receipt
    t0 = time.perf_counter()
    p_call = asyncio.ensure_future(p_stub.Prefill(worker_pb2.PrefillRequest(
        request_id=rid, transfer_id=tid, prompt_token_ids=PROMPT, sampling=sampling, timeout_ms=timeout_ms)))
    async for _ in d_stub.Generate(worker_pb2.GenerateRequest(
            request_id=rid, transfer_id=tid, prompt_token_ids=PROMPT, sampling=sampling, prefill_address=prefill,
            timeout_ms=timeout_ms)):
        pass
    await p_call
    return time.perf_counter() - t0


async def routed(router: str, params: SamplingParams) -> float:
    stub = router_pb2_grpc.RouterStub(_channel(router))
    req = router_pb2.RouterGenerateRequest(token_ids=router_pb2.TokenIds(ids=PROMPT),
                                           sampling=convert.sampling_to_pb(params))
    t0 = time.perf_counter()
    async for _ in stub.Generate(req):
        pass
    return time.perf_counter() - t0


_channels: dict[str, grpc.aio.Channel] = {}


def _channel(address: str) -> grpc.aio.Channel:
    if address not in _channels:
        _channels[address] = grpc.aio.insecure_channel(address)
    return _channels[address]


async def measure(fn, requests: int, concurrency: int) -> dict:
    """Sequential latencies (for percentiles) and concurrent throughput."""
    for _ in range(5):
        await fn()  # warm-up: connections, first compilation of paths
    lat = sorted([await fn() for _ in range(requests)])
    sem = asyncio.Semaphore(concurrency)

    async def one():
        async with sem:
            await fn()

    t0 = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(requests)))
    rps = requests / (time.perf_counter() - t0)
    return {"p50_ms": lat[len(lat) // 2] * 1e3, "p99_ms": lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e3,
            "rps": rps}


async def compare(label: str, prefill: str, decode: str, router: str, args) -> dict:
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    d = await measure(lambda: direct(prefill, decode, params), args.requests, args.concurrency)
    r = await measure(lambda: routed(router, params), args.requests, args.concurrency)
    row = {"workers": label, "direct": d, "router": r, "added_p50_ms": r["p50_ms"] - d["p50_ms"],
           "added_p99_ms": r["p99_ms"] - d["p99_ms"], "throughput_ratio": r["rps"] / d["rps"]}
    print(f"  {label}: direct p50 {d['p50_ms']:.2f} ms, router p50 {r['p50_ms']:.2f} ms", file=sys.stderr)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="dsv4-tiny")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=16, help="tokens per request")
    parser.add_argument("--skip-real", action="store_true")
    args = parser.parse_args()
    rows = []
    stubs = subprocess.Popen([sys.executable, str(Path(__file__).with_name("stub_workers.py")), "--tokens",
                              str(args.tokens)], stdout=subprocess.PIPE, text=True)
    info = json.loads(stubs.stdout.readline())
    fake = [ServiceProcess("p", stubs, {"address": info["prefill"]}), ServiceProcess("d", stubs,
                                                                                   {"address": info["decode"]})]
    router = start_router(args.model, fake[:1], fake[1:])
    try:
        rows.append(asyncio.run(compare("stub", info["prefill"], info["decode"], router.info["grpc"], args)))
    finally:
        router.stop()
        stubs.terminate()
        stubs.wait(10)
    if not args.skip_real:
        flags = ["--max-num-seqs", "32", "--max-model-len", "512"]
        p, d = start_worker("prefill", args.model, *flags), start_worker("decode", args.model, *flags,
                                                                         "--no-prefix-cache")
        router = start_router(args.model, [p], [d])
        try:
            _channels.clear()
            real_args = argparse.Namespace(**{**vars(args), "requests": max(20, args.requests // 5)})
            rows.append(asyncio.run(compare("real (dsv4-tiny)", p.address, d.address, router.info["grpc"], real_args)))
        finally:
            for s in (router, d, p):
                s.stop()
    lines = [
        f"router vs direct dual dispatch, gRPC, {args.tokens} tokens per request, latency over sequential requests, "
        f"throughput at concurrency {args.concurrency}",
        "",
        "| workers | direct p50 ms | router p50 ms | added p50 ms | direct p99 ms | router p99 ms | added p99 ms "
        "| direct req/s | router req/s | throughput ratio |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        d, ro = r["direct"], r["router"]
        lines.append(f"| {r['workers']} | {d['p50_ms']:.2f} | {ro['p50_ms']:.2f} | {r['added_p50_ms']:.2f} | "
                     f"{d['p99_ms']:.2f} | {ro['p99_ms']:.2f} | {r['added_p99_ms']:.2f} | {d['rps']:.1f} | "
                     f"{ro['rps']:.1f} | {r['throughput_ratio']:.2f} |")
    print("\n".join(lines))
    write_json("router", {"args": vars(args), "rows": rows})
    fig, ax = figure(width=8)
    labels = [f"{r['workers']}\n{q}" for r in rows for q in ("p50", "p99")]
    paired_bars(ax, labels, [r["direct"][k] for r in rows for k in ("p50_ms", "p99_ms")],
                [r["router"][k] for r in rows for k in ("p50_ms", "p99_ms")], ("direct", "through router"),
                "latency (ms)")
    save_figure(fig, "router", lines[0])



if __name__ == "__main__":
    main()
