"""The router's cost, side by side with sglang-router 0.3.2 (Rust) in PD mode, each in front of instant stub workers.

- Throughput: the same wrk load (2 threads, 16 connections, 8 s, the same `POST /v1/completions` body: a text prompt,
  one token) on pdspark's router over the gRPC stubs (`stub_workers.py`, 1 token) and on sglang-router over its own
  HTTP stubs (`http_stub_workers.py`, answering `/generate` and `/v1/completions`). The two runs alternate (`--rounds`),
  so both meet the same contention on a shared machine; the table has every round.
- Added latency: p50 at one connection through each router minus p50 calling its stubs directly (sglang: wrk on the
  decode stub; pdspark: the dual dispatch the router makes, done by a gRPC client in this process, sequentially).
- pdspark's router runs once per `--worker-calls` setting (per-request gRPC calls to the workers, and multiplexed on
  one stream per worker), each its own router and stubs, alternating with the others in every round.
- Optionally (`--baseline-src DIR`), each pdspark router once more from another revision's source (DIR: its `src`,
  e.g. of `git worktree add /tmp/base main`), over its own stubs, in the same rounds: a before/after that meets the
  same contention (`<name>_baseline` in the table; no one-connection figures).
- Optionally (`--real`), the pdspark router over a real dsv4-tiny pair vs that client's direct dual dispatch.

    python bench/bench_router.py [--rounds 2] [--duration 8] [--sglang-python .venv-sglang-router/bin/python] [--real]
        [--worker-calls per-request multiplexed] [--baseline-src ../base/src]

Needs `wrk` (Debian) and sglang-router in its own venv: `make sglang-router-tools` (`make bench-router` runs both).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from pathlib import Path

from pdspark.launch.free_ports import free_ports
from pdspark.launch.service_process import ServiceProcess
from pdspark.rpc import convert
from pdspark.rpc.multiplexed_client import MultiplexedClient
from pdspark.testing.services import start_router, start_worker
from pdspark.types import SamplingParams
from pdspark.v1 import worker_pb2, worker_pb2_grpc

import grpc
from cpu_time import cpu_s, tree_cpu_s
from report import figure, save_figure, write_json

ROOT = Path(__file__).resolve().parent.parent
MODEL_NAME = "stub"  # both routers serve it under this name: one request body for both
BODY = {"model": MODEL_NAME, "prompt": "def fibonacci(n):", "max_tokens": 1}
DIRECT_PROMPT = [11, 12, 13, 14, 15, 16]  # the pdspark direct client's prompt: the text's length in tokens, about
# wrk prints one JSON line at the end: latency percentiles (microseconds), requests, errors (non-2xx included).
LUA = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = [[%s]]
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format('{"requests": %%d, "duration_us": %%d, "p50_us": %%d, "p99_us": %%d, "errors": %%d}\\n',
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
    e.connect + e.read + e.write + e.status + e.timeout))
end
"""
READY_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Load:
    rps: float
    p50_ms: float
    p99_ms: float
    requests: int
    errors: int
    # CPU seconds the router process (all its threads) spent per request, in ms: unlike req/s, barely moved by
    # other jobs sharing the cores.
    cpu_ms_per_request: float | None = None



def wrk(url: str, script: Path, threads: int, connections: int, seconds: float, pid: int | None = None) -> Load:
    """A wrk run; `pid`: the router's process, whose CPU time per request (its processes' too) is measured over the
    run."""
    before = tree_cpu_s(pid) if pid is not None else 0.0
    out = subprocess.run(["wrk", f"-t{threads}", f"-c{connections}", f"-d{seconds:g}s", "-s", str(script), url],
                         capture_output=True, text=True, timeout=seconds + 60, check=True).stdout
    stats = json.loads(out.strip().splitlines()[-1])
    cpu = (tree_cpu_s(pid) - before) / max(1, stats["requests"]) * 1e3 if pid is not None else None
    return Load(stats["requests"] / (stats["duration_us"] / 1e6), stats["p50_us"] / 1e3, stats["p99_us"] / 1e3,
                stats["requests"], stats["errors"], cpu)


def _post_ok(url: str, body: dict) -> bool:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def wait_serving(url: str) -> None:
    """Poll until `url` answers the benchmark's body with 200 (sglang-router activates its workers after it listens)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not _post_ok(url, BODY):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not answer 200 within {READY_TIMEOUT_S:.0f} s")
        time.sleep(0.2)


def start_json_child(argv: list[str], env: dict | None = None) -> tuple[subprocess.Popen, dict]:
    """A child that prints one JSON ready line (the stub servers)."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    return proc, json.loads(proc.stdout.readline())


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)



# ---- pdspark's direct path: the dual dispatch the router makes, from a client in this process ----------------------
async def direct(prefill: str, decode: str, requests: int, concurrency: int = 1,
                 worker_calls: str = "per-request") -> Load:
    """Prefill + Generate sent at once to the stubs, as the router sends them (one gRPC call each, or multiplexed on
    the workers' `Calls` streams), `concurrency` pairs at a time (1: one connection's latency). Its CPU per request is
    this client's: the calls alone, a floor for the router."""
    channels = [grpc.aio.insecure_channel(prefill), grpc.aio.insecure_channel(decode)]
    p_stub, d_stub = worker_pb2_grpc.PrefillWorkerStub(channels[0]), worker_pb2_grpc.DecodeWorkerStub(channels[1])
    p_calls = MultiplexedClient(channels[0], "/pdspark.v1.PrefillWorker/Calls")
    d_calls = MultiplexedClient(channels[1], "/pdspark.v1.DecodeWorker/Calls")
    sampling = convert.sampling_to_pb(SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))

    async def one() -> float:
        tid, rid = uuid.uuid4().hex, uuid.uuid4().hex
        t0 = time.perf_counter()
        p_request = worker_pb2.PrefillRequest(request_id=rid, transfer_id=tid, prompt_token_ids=DIRECT_PROMPT,
                                              sampling=sampling, timeout_ms=60_000)
        g_request = worker_pb2.GenerateRequest(request_id=rid, transfer_id=tid, prompt_token_ids=DIRECT_PROMPT,
                                               sampling=sampling, prefill_address=prefill, timeout_ms=60_000)
        if worker_calls == "multiplexed":
            p_call: asyncio.Future = p_calls.call("prefill", p_request, 65.0).response()
            stream: AsyncIterator = d_calls.call("generate", g_request, 60.0)
        else:
            p_call = asyncio.ensure_future(p_stub.Prefill(p_request))
            stream = d_stub.Generate(g_request)
        async for _ in stream:
            pass
        await p_call
        return time.perf_counter() - t0

    for _ in range(20):
        await one()  # warm-up: connections
    sem = asyncio.Semaphore(concurrency)

    async def limited() -> float:
        async with sem:
            return await one()

    cpu0, t0 = cpu_s(os.getpid()), time.perf_counter()
    lat = sorted(await asyncio.gather(*(limited() for _ in range(requests))))
    elapsed, cpu = time.perf_counter() - t0, cpu_s(os.getpid()) - cpu0
    await p_calls.close()
    await d_calls.close()
    for c in channels:
        await c.close()
    return Load(requests / elapsed, lat[len(lat) // 2] * 1e3, lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e3,
                requests, 0, cpu / requests * 1e3)


# ---- the two stacks -------------------------------------------------------------------------------------------------
class PdsparkStack:
    def __init__(self, model: str, worker_calls: str = "per-request", src: str | None = None, processes: int = 1):
        """`src`: run the router from this source tree (PYTHONPATH) instead of this checkout's; `processes`: the
        router's `--processes`."""
        self.worker_calls = worker_calls
        self.stubs, info = start_json_child([sys.executable, str(ROOT / "bench" / "stub_workers.py"), "--tokens",
                                             "1"])
        self.prefill, self.decode = info["prefill"], info["decode"]
        fake = [ServiceProcess("p", self.stubs, {"address": self.prefill}),
                ServiceProcess("d", self.stubs, {"address": self.decode})]
        self.router = start_router(model, fake[:1], fake[1:], "--served-model-name", MODEL_NAME, "--worker-calls",
                                   worker_calls, "--processes", str(processes),
                                   env={"PYTHONPATH": src} if src else None)
        self.url = f"{self.router.info['http']}/v1/completions"
        wait_serving(self.url)

    def close(self) -> None:
        self.router.stop()
        stop(self.stubs)


class SglangStack:
    def __init__(self, python: str):
        self.stubs, info = start_json_child([sys.executable, str(ROOT / "bench" / "http_stub_workers.py"),
                                             "--tokens", "1"])
        self.decode_url = f"{info['decode']}/v1/completions"
        (port,) = free_ports("127.0.0.1", 1)
        # Warnings only: its per-request log lines would be work pdspark's router does not do.
        self.router = subprocess.Popen(
            [python, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
             "--pd-disaggregation", "--prefill", info["prefill"], "none", "--decode", info["decode"],
             "--prefill-policy", "round_robin", "--decode-policy", "round_robin", "--log-level", "warn"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{port}/v1/completions"
        try:
            wait_serving(self.url)
        except TimeoutError:
            self.close()
            raise

    def close(self) -> None:
        stop(self.router)
        stop(self.stubs)


def stack_name(worker_calls: str, processes: int = 1) -> str:
    """The name of a pdspark run in the results: `pdspark` (per-request calls), `pdspark_multiplexed`,
    `pdspark_multiplexed_x2` (2 router processes)."""
    name = "pdspark" if worker_calls == "per-request" else f"pdspark_{worker_calls}"
    return name if processes == 1 else f"{name}_x{processes}"


def side_by_side(args, script: Path) -> dict:
    sglang = SglangStack(args.sglang_python)
    stacks: dict[str, SglangStack | PdsparkStack] = {"sglang": sglang}
    rounds: list[dict] = []
    try:
        for calls in args.worker_calls:
            for processes in args.router_processes:
                name = stack_name(calls, processes)
                stacks[name] = PdsparkStack(args.model, calls, processes=processes)
                if args.baseline_src:
                    stacks[f"{name}_baseline"] = PdsparkStack(args.model, calls, args.baseline_src, processes)
        for n in range(args.rounds):  # alternating: all meet the same contention
            row = {}
            for name, stack in stacks.items():
                row[name] = asdict(wrk(stack.url, script, 2, 16, args.duration, stack.router.pid))
                print(f"  round {n + 1} {name}: {row[name]['rps']:.0f} req/s, p50 {row[name]['p50_ms']:.2f} ms, "
                      f"{row[name]['cpu_ms_per_request']:.3f} CPU ms/req", file=sys.stderr)
            rounds.append(row)
        one = {"sglang_router": asdict(wrk(sglang.url, script, 1, 1, args.duration)),
               "sglang_direct": asdict(wrk(sglang.decode_url, script, 1, 1, args.duration))}
        ceiling = {}
        for name, stack in stacks.items():
            if not isinstance(stack, PdsparkStack) or name.endswith("_baseline"):
                continue
            calls = stack.worker_calls
            one[f"{name}_router"] = asdict(wrk(stack.url, script, 1, 1, args.duration))
            one[f"{name}_direct"] = asdict(asyncio.run(direct(stack.prefill, stack.decode, args.direct_requests,
                                                              worker_calls=calls)))
            # The calls' own ceiling: the router's two calls per request, from a bare client at 16 at a time.
            ceiling[name] = asdict(asyncio.run(direct(stack.prefill, stack.decode, args.direct_requests * 2, 16,
                                                      worker_calls=calls)))
    finally:
        for stack in stacks.values():
            stack.close()
    return {"rounds": rounds, "one_connection": one, "calls_client_16": ceiling}


def real_cluster(args) -> dict:
    """pdspark's router over a real dsv4-tiny pair (wrk, 1 connection and 16) vs the direct dual dispatch."""
    flags = ["--max-num-seqs", "32", "--max-model-len", "512"]
    p, d = start_worker("prefill", args.model, *flags), start_worker("decode", args.model, *flags,
                                                                     "--no-prefix-cache")
    router = start_router(args.model, [p], [d], "--served-model-name", MODEL_NAME)
    try:
        url = f"{router.info['http']}/v1/completions"
        wait_serving(url)
        with tempfile.TemporaryDirectory() as tmp:
            script = Path(tmp) / "post.lua"
            script.write_text(LUA % json.dumps(BODY))
            return {"router_16": asdict(wrk(url, script, 2, 16, args.duration)),
                    "router_1": asdict(wrk(url, script, 1, 1, args.duration)),
                    "direct_1": asdict(asyncio.run(direct(p.address, d.address, 50)))}
    finally:
        for s in (router, d, p):
            s.stop()


def table(result: dict, args) -> list[str]:
    rounds, one = result["rounds"], result["one_connection"]
    names = [n for n in rounds[0] if n != "sglang"]
    lines = [
        f"pdspark router vs sglang-router 0.3.2 (PD mode), instant stub workers, 1 token, wrk POST /v1/completions "
        f"(2 threads, 16 connections, {args.duration:g} s), rounds alternating",
        "",
        "| round | router | req/s | ratio to sglang-router | p50 ms | p99 ms | router CPU ms/req | errors |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for n, r in enumerate(rounds, 1):
        for name in ("sglang", *names):
            x = r[name]
            lines.append(f"| {n} | {name} | {x['rps']:.0f} | {x['rps'] / r['sglang']['rps']:.2f} | {x['p50_ms']:.2f} | "
                         f"{x['p99_ms']:.2f} | {x['cpu_ms_per_request']:.3f} | {x['errors']} |")
    for name, c in result["calls_client_16"].items():
        lines += ["", f"{name}'s calls alone (a bare client making the router's two calls per request the same way, "
                  f"16 at a time, no HTTP): {c['rps']:.0f} req/s, {c['cpu_ms_per_request']:.3f} CPU ms per request"]
    lines += [
        "",
        "| one connection | router p50 ms | direct p50 ms | added p50 ms |",
        "|---|---:|---:|---:|",
    ]
    for name in ("sglang", *(n for n in names if f"{n}_router" in one)):
        r, d = one[f"{name}_router"], one[f"{name}_direct"]
        lines.append(f"| {name} | {r['p50_ms']:.2f} | {d['p50_ms']:.2f} | {r['p50_ms'] - d['p50_ms']:.2f} |")
    if "real" in result:
        real = result["real"]
        lines += ["", "| real dsv4-tiny pair | req/s at 16 | p50 ms at 1 | direct p50 ms | added p50 ms |",
                  "|---|---:|---:|---:|---:|",
                  f"| pdspark | {real['router_16']['rps']:.1f} | {real['router_1']['p50_ms']:.2f} | "
                  f"{real['direct_1']['p50_ms']:.2f} | {real['router_1']['p50_ms'] - real['direct_1']['p50_ms']:.2f} |"]
    return lines


def label(name: str) -> str:
    """`pdspark_multiplexed` -> `pdspark router (multiplexed)`."""
    if name == "sglang":
        return "sglang-router"
    return "pdspark router" + (f" ({name.split('_', 1)[1]})" if "_" in name else "")


def plot(result: dict, title: str) -> None:
    fig, (ax1, ax2) = figure(ncols=2, width=10)
    rounds = result["rounds"]
    names = list(rounds[0])
    xs = range(len(rounds))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        ax1.bar([x + (i - (len(names) - 1) / 2) * width for x in xs], [r[name]["rps"] for r in rounds], width,
                label=label(name))
    ax1.set_xticks(list(xs), [f"round {n + 1}" for n in xs], fontsize=8)
    ax1.set_ylabel("requests/s (16 connections)")
    ax1.legend(fontsize=8)
    one = result["one_connection"]
    names = [n for n in names if f"{n}_direct" in one]
    direct_of = {n: one[f"{n}_direct"]["p50_ms"] for n in names}
    ax2.bar([x - 0.2 for x in range(len(names))], [direct_of[n] for n in names], 0.4, label="direct")
    ax2.bar([x + 0.2 for x in range(len(names))], [one[f"{n}_router"]["p50_ms"] for n in names], 0.4,
            label="through router")
    ax2.set_xticks(list(range(len(names))), [label(n) for n in names], fontsize=8)
    ax2.set_ylabel("p50 ms at one connection")
    ax2.legend(fontsize=8)
    save_figure(fig, "router", title)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="dsv4-tiny", help="the model whose tokenizer the pdspark router loads")
    parser.add_argument("--rounds", type=int, default=2, help="alternating wrk runs of each router at 16 connections")
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per wrk run")
    parser.add_argument("--direct-requests", type=int, default=1000, help="sequential direct gRPC dual dispatches")
    parser.add_argument("--sglang-python", default=str(ROOT / ".venv-sglang-router" / "bin" / "python"),
                        help="a python with sglang-router 0.3.2 installed (`make sglang-router-tools`)")
    parser.add_argument("--real", action="store_true", help="also the pdspark router over a real dsv4-tiny pair")
    parser.add_argument("--worker-calls", nargs="+", default=["per-request", "multiplexed"],
                        choices=["per-request", "multiplexed"], help="pdspark routers to run (their --worker-calls)")
    parser.add_argument("--router-processes", nargs="+", type=int, default=[1, 2],
                        help="pdspark routers of these --processes (each its own run)")
    parser.add_argument("--baseline-src", default=None, help="also run each pdspark router from this source tree "
                        "(another revision's `src`), in the same rounds")
    parser.add_argument("--no-save", action="store_true", help="print the table only (no JSON/PNG)")
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        sys.exit("wrk is not installed: apt-get install wrk (or `make bench-router`)")
    if not os.path.exists(args.sglang_python):
        sys.exit(f"{args.sglang_python} does not exist: `make sglang-router-tools` installs sglang-router 0.3.2")
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "post.lua"
        script.write_text(LUA % json.dumps(BODY))
        result = side_by_side(args, script)
    if args.real:
        result["real"] = real_cluster(args)
    lines = table(result, args)
    names = [n for n in result["rounds"][0] if n != "sglang"]
    result["throughput_ratio_median"] = {
        n: statistics.median(r[n]["rps"] / r["sglang"]["rps"] for r in result["rounds"]) for n in names}
    one = result["one_connection"]
    result["added_p50_ms"] = {n: one[f"{n}_router"]["p50_ms"] - one[f"{n}_direct"]["p50_ms"]
                              for n in ("sglang", *names) if f"{n}_router" in one}
    result["router_cpu_ms_median"] = {n: statistics.median(r[n]["cpu_ms_per_request"] for r in result["rounds"])
                                      for n in ("sglang", *names)}
    lines += [""] + [f"throughput ratio {n} / sglang-router (median of rounds): "
                     f"{result['throughput_ratio_median'][n]:.2f}" for n in names]
    lines += [f"router CPU ms/req {n} (median of rounds): {result['router_cpu_ms_median'][n]:.3f}"
              for n in ("sglang", *names)]
    print("\n".join(lines))
    if not args.no_save:
        write_json("router", {"args": vars(args), **result})
        plot(result, lines[0])


if __name__ == "__main__":
    main()
