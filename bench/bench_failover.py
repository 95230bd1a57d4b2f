"""Failover as a client sees it, on `pdspark up --prefill 2 --decode 2` (dsv4-tiny, DSpark on): a decode worker
SIGKILLed mid-stream, a decode worker SIGSTOPped mid-stream (hung: it keeps its sockets, answers nothing, and is
SIGCONTed after --hold-s), and a prefill worker SIGKILLed while requests are in prefill. Each fault scenario runs
beside its control, the same load with no fault, in rounds (control, SIGKILL, SIGSTOP, ...) so that machine noise
hits all alike.

Per trial:
- detect: signal -> the worker shows unhealthy in the router's /workers (polled every 50 ms);
- recover: signal -> the worker healthy in /workers again (SIGKILL: the launcher restarted it on its port;
  SIGSTOP: measured from SIGCONT instead);
- gap: in every stream that migrated (its decode worker changed; the native /generate stream names it per chunk),
  the longest wait between two chunks, against the median wait between chunks of the same streams; and the
  longest wait in the streams that did not migrate;
- lost: requests that did not complete with exactly the offline engine's greedy tokens (an unfailed run of the same
  prompts, computed before the cluster starts). Must be 0: the exit status is 1 otherwise.

Prints two tables (medians and p90 over the trials), writes bench/results/failover.json and failover.png.

    python bench/bench_failover.py [--trials 5] [--streams 8] [--max-tokens 160] [--kill-after 48] [--hold-s 3]
        [--prefill-requests 16] [--up-args '--restart-backoff-s 1']
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import shlex
import signal
import statistics
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from pdspark import LLM, SamplingParams
from pdspark.launch.service_process import ServiceProcess, spawn_service, wait_ready
from pdspark.v1 import worker_pb2, worker_pb2_grpc

import grpc
import torch
from console import Stopped, log, stop_on_signals
from report import RESULTS, figure, save_figure, write_json

POLL_S = 0.05  # /workers polling while a fault is watched
REQUEST_TIMEOUT_S = 120.0  # a request not over by then counts as lost (and the trial goes on)
WATCH_TIMEOUT_S = 90.0  # detection and recovery must each happen within this long
DECODE_SCENARIOS = ("decode: no fault", "decode SIGKILL", "decode SIGSTOP")
PREFILL_SCENARIOS = ("prefill: no fault", "prefill SIGKILL")



@dataclass
class Stream:
    """One request as the client saw it (native /generate, streamed)."""

    token_ids: list[int] = field(default_factory=list)
    chunk_times: list[float] = field(default_factory=list)  # time.monotonic() at each chunk
    decode_workers: list[str] = field(default_factory=list)  # per chunk
    sent_at: float = 0.0
    done: bool = False  # [DONE] arrived after a finish reason
    error: str | None = None

    @property
    def migrated(self) -> bool:
        return len(set(self.decode_workers)) > 1

    def intervals(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.sent_at if self.chunk_times else None


def generate(http: str, prompt_ids: list[int], max_tokens: int, on_chunk: Callable[[Stream], None]) -> Stream:
    s = Stream(sent_at=time.monotonic())
    body = {"input_ids": prompt_ids, "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": max_tokens, "ignore_eos": True}}
    req = urllib.request.Request(f"{http}/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          "X-Request-Timeout": str(REQUEST_TIMEOUT_S)})
    finished = False
    try:
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S + 10) as r:
            for raw in r:
                line = raw.decode().strip()
                if line == "data: [DONE]":
                    s.done = finished
                    break
                if not line.startswith("data: "):
                    continue
                event = json.loads(line.removeprefix("data: "))
                if "error" in event:
                    s.error = f"{event['error']['code']}: {event['error']['message']}"
                    continue
                s.chunk_times.append(time.monotonic())
                s.token_ids += event["output_ids"]
                s.decode_workers.append(event["meta_info"]["decode_worker"])
                finished = event["meta_info"]["finish_reason"] is not None
                on_chunk(s)
    except (OSError, http.client.HTTPException, ValueError) as e:
        s.error = repr(e)
    return s


class Cluster:
    """`pdspark up` as a child process, and what the bench asks of it."""

    def __init__(self, args: argparse.Namespace):
        cmd = ["up", "--model", args.model, "--prefill", "2", "--decode", "2", "--port", "0", "--grpc-port", "0",
               *shlex.split(args.up_args)]
        log(f"starting pdspark {' '.join(cmd)}")
        self.service: ServiceProcess = spawn_service("pdspark up", cmd, env={"OMP_NUM_THREADS": "1"})
        self.http = ""
        self.channels: dict[str, grpc.Channel] = {}

    def wait_ready(self, timeout: float) -> None:
        wait_ready(self.service, timeout=timeout)  # stops it when it does not become ready
        self.http = self.service.info["http"]

    def current(self, name: str) -> dict:
        """`{"pid", "address"}` of the service's current run (after any restart)."""
        restarted = [e for e in self.service.events if e.get("event") == "restarted" and e.get("service") == name]
        return restarted[-1] if restarted else self.service.info["services"][name]

    def name_of(self, address: str) -> str:
        return next(n for n in self.service.info["services"] if self.current(n)["address"] == address)

    def workers(self) -> dict[str, bool] | None:
        """address -> healthy, as the router sees it; None when it does not answer."""
        try:
            with urllib.request.urlopen(f"{self.http}/workers", timeout=5) as r:
                return {w["address"]: w["healthy"] for w in json.loads(r.read())}
        except (OSError, http.client.HTTPException, ValueError):
            return None

    def wait_healthy(self, timeout: float = WATCH_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while not ((ws := self.workers()) and len(ws) == 4 and all(ws.values())):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the cluster is not healthy after {timeout:.0f}s: {ws}")
            time.sleep(POLL_S)

    def transfers(self, name: str) -> int:
        address = self.current(name)["address"]
        if address not in self.channels:
            self.channels[address] = grpc.insecure_channel(address)
        stub = worker_pb2_grpc.PrefillWorkerStub(self.channels[address])
        return stub.GetLoad(worker_pb2.LoadRequest(), timeout=5).transfers_in_flight

    def stop(self) -> int:
        for channel in self.channels.values():
            channel.close()
        return self.service.stop()


def watch(cluster: Cluster, name: str, signalled: float, resumed: Callable[[], float | None]) -> dict:
    """Poll /workers from the signal on: when worker `name` went unhealthy, when the launcher had it ready again
    (a new pid: SIGKILL only), and when /workers showed it healthy again (timed from `resumed()`, the SIGCONT time,
    when it returns one)."""
    address, pid = cluster.current(name)["address"], cluster.current(name)["pid"]
    out: dict = {"detect_s": None, "restarted_s": None, "recover_s": None}
    deadline = signalled + WATCH_TIMEOUT_S
    while time.monotonic() < deadline:
        healthy = (cluster.workers() or {}).get(address)
        now = time.monotonic()
        if out["restarted_s"] is None and cluster.current(name)["pid"] != pid:
            out["restarted_s"] = now - signalled
        if out["detect_s"] is None and healthy is False:
            out["detect_s"] = now - signalled
        elif out["detect_s"] is not None and healthy:
            out["recover_s"] = now - (resumed() or signalled)
            return out
        time.sleep(POLL_S)
    return out


def run_trial(cluster: Cluster, scenario: str, prompts: list[list[int]], refs: list[list[int]],
              args: argparse.Namespace) -> dict:
    cluster.wait_healthy()
    decode = scenario.startswith("decode")
    max_tokens = args.max_tokens if decode else args.prefill_max_tokens
    fault = None if "no fault" in scenario else scenario.split()[-1]
    trigger = threading.Event()  # set once the first request has --kill-after tokens (or ended)
    first: list[Stream] = []  # the first request's stream, from its first chunk on

    def one(i: int, ids: list[int]) -> Stream:
        def on_chunk(s: Stream) -> None:
            if i == 0:
                first[:] = [s]
                if len(s.token_ids) >= args.kill_after:
                    trigger.set()

        try:
            return generate(cluster.http, ids, max_tokens, on_chunk)
        finally:
            if i == 0:
                trigger.set()

    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(one, i, ids) for i, ids in enumerate(prompts)]
        row: dict = {"scenario": scenario, "detect_s": None, "recover_s": None}
        if fault is not None:
            row.update(inject(cluster, fault, decode, trigger, first, futures, args))
        streams = [f.result(REQUEST_TIMEOUT_S + 30) for f in futures]
    lost = [i for i, (s, ref) in enumerate(zip(streams, refs)) if not s.done or s.error or s.token_ids != ref]
    migrated = [s for s in streams if s.migrated]
    others = [s for s in streams if not s.migrated]
    row.update({
        "requests": len(streams), "lost": len(lost),
        "lost_detail": [f"request {i}: {streams[i].error or ('tokens differ' if streams[i].done else 'no end')}"
                        for i in lost],
        "migrated": len(migrated),
        # The longest wait between two chunks of a migrated stream, and the typical one (median over every
        # interval of those streams; of all streams when none migrated).
        "gap_ms": max((max(s.intervals()) for s in migrated if s.intervals()), default=None),
        "other_gap_ms": max((max(s.intervals()) for s in others if s.intervals()), default=None),
        "median_interval_ms": statistics.median(x for s in (migrated or streams) for x in s.intervals()),
        "ttft_p50_ms": statistics.median(s.ttft for s in streams if s.ttft is not None),
        "ttft_max_ms": max(s.ttft for s in streams if s.ttft is not None),
    })
    row["streams"] = [{"migrated": s.migrated, "chunks": len(s.chunk_times), "tokens": len(s.token_ids),
                       "decode_workers": [w for i, w in enumerate(s.decode_workers)
                                          if i == 0 or w != s.decode_workers[i - 1]],
                       "max_gap_ms": max(s.intervals(), default=0) * 1000,
                       "median_gap_ms": statistics.median(s.intervals()) * 1000 if s.intervals() else None}
                      for s in streams]
    for key in ("gap_ms", "other_gap_ms", "median_interval_ms", "ttft_p50_ms", "ttft_max_ms"):
        row[key] = None if row[key] is None else row[key] * 1000
    return row


def inject(cluster: Cluster, fault: str, decode: bool, trigger: threading.Event, first: list[Stream], futures,
           args: argparse.Namespace) -> dict:
    """Signal the worker (the decode worker serving the first stream once it has --kill-after tokens; the prefill
    worker with the most transfers in flight), watch /workers, and let a SIGSTOPped one go after --hold-s."""
    if decode:
        if not trigger.wait(REQUEST_TIMEOUT_S):
            raise RuntimeError("the first stream produced nothing")
        stream = first[0] if first else None
        if stream is None or stream.done or not stream.decode_workers:
            return {"note": "the first stream ended before the fault"}
        name = cluster.name_of(stream.decode_workers[-1])
    else:
        deadline = time.monotonic() + 30
        while not any(amounts := [cluster.transfers(n) for n in ("prefill-0", "prefill-1")]):
            if time.monotonic() > deadline or all(f.done() for f in futures):
                return {"note": "no transfer in flight to interrupt"}
            time.sleep(0.01)
        name = ("prefill-0", "prefill-1")[amounts.index(max(amounts))]
    target = cluster.current(name)
    resumed: list[float] = []
    signalled = time.monotonic()
    os.kill(target["pid"], getattr(signal, fault))
    result: dict = {}
    watcher = threading.Thread(target=lambda: result.update(
        watch(cluster, name, signalled, lambda: resumed[0] if resumed else None)), daemon=True)
    watcher.start()
    if fault == "SIGSTOP":
        try:
            time.sleep(args.hold_s)  # the fault: the worker stays stopped this long
        finally:
            os.kill(target["pid"], signal.SIGCONT)
            resumed.append(time.monotonic())
    watcher.join(WATCH_TIMEOUT_S + 5)
    return {"victim": name, **result}


def offline_refs(args: argparse.Namespace, prompt_sets: list[list[list[int]]], max_tokens: list[int]
                 ) -> list[list[list[int]]]:
    """Greedy token ids of every prompt set from one offline engine (the unfailed run)."""
    llm = LLM(args.model, max_num_seqs=32, max_num_batched_tokens=4096)
    out = []
    for prompts, n in zip(prompt_sets, max_tokens):
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(
            temperature=0, max_tokens=n, ignore_eos=True))
        out.append([list(o.token_ids) for o in outs])
    return out


def random_prompts(n: int, length: int, seed: int, vocab: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(8, vocab) for _ in range(length)] for _ in range(n)]


def _stat(rows: list[dict], key: str, q: float) -> float | None:
    values = sorted(r[key] for r in rows if r.get(key) is not None)
    if not values:
        return None
    return statistics.median(values) if q == 0.5 else values[min(len(values) - 1, int(q * len(values)))]


def _cell(rows: list[dict], key: str, digits: int = 1) -> str:
    p50, p90 = _stat(rows, key, 0.5), _stat(rows, key, 0.9)
    return "-" if p50 is None else f"{p50:.{digits}f} / {p90:.{digits}f}"


def tables(rows: list[dict], args: argparse.Namespace) -> list[str]:
    by = {s: [r for r in rows if r["scenario"] == s] for s in (*DECODE_SCENARIOS, *PREFILL_SCENARIOS)}
    lines = [
        f"{args.model}, `{_up_command(args)}`, {args.trials} trials per scenario, "
        f"p50 / p90 over trials; {platform.machine()}, {os.cpu_count()} cores",
        "",
        f"Decode: {args.streams} greedy streams of {args.max_tokens} tokens; the fault hits the decode worker serving "
        f"the first stream after its {args.kill_after}th token (SIGSTOP held {args.hold_s:.0f} s).",
        "",
        "| scenario | detect s | restarted s | recover s | longest gap, migrated streams ms | longest gap, other "
        "streams ms | median chunk gap ms | migrated streams | requests lost |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in DECODE_SCENARIOS:
        rs = by[s]
        lines.append(f"| {s} | {_cell(rs, 'detect_s', 2)} | {_cell(rs, 'restarted_s', 2)} | "
                     f"{_cell(rs, 'recover_s', 2)} | {_cell(rs, 'gap_ms', 0)} | "
                     f"{_cell(rs, 'other_gap_ms', 0)} | {_cell(rs, 'median_interval_ms', 0)} | "
                     f"{sum(r['migrated'] for r in rs)} / {sum(r['requests'] for r in rs)} | "
                     f"{sum(r['lost'] for r in rs)} |")
    lines += [
        "",
        f"Prefill: {args.prefill_requests} concurrent greedy requests, {args.prefill_prompt_len}-token prompts, "
        f"{args.prefill_max_tokens} tokens; SIGKILL of the prefill worker with the most transfers in flight.",
        "",
        "| scenario | detect s | restarted s | recover s | TTFT p50 ms | TTFT max ms | requests lost |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for s in PREFILL_SCENARIOS:
        rs = by[s]
        lines.append(f"| {s} | {_cell(rs, 'detect_s', 2)} | {_cell(rs, 'restarted_s', 2)} | "
                     f"{_cell(rs, 'recover_s', 2)} | {_cell(rs, 'ttft_p50_ms', 0)} | {_cell(rs, 'ttft_max_ms', 0)} | "
                     f"{sum(r['lost'] for r in rs)} / {sum(r['requests'] for r in rs)} |")
    notes = [f"{r['scenario']}: {r['note']}" for r in rows if r.get("note")]
    notes += [f"{r['scenario']}: {d}" for r in rows for d in r["lost_detail"]]
    notes += [f"{r['scenario']}: not detected / not recovered within {WATCH_TIMEOUT_S:.0f}s" for r in rows
              if "SIG" in r["scenario"] and not r.get("note") and r["recover_s"] is None]
    return lines + (["", *notes] if notes else [])


def _up_command(args: argparse.Namespace) -> str:
    return " ".join(["pdspark up --prefill 2 --decode 2", *shlex.split(args.up_args)])


def plot(rows: list[dict], title: str) -> None:
    import math

    def med(scenario: str, key: str) -> float:
        v = _stat([r for r in rows if r["scenario"] == scenario], key, 0.5)
        return math.nan if v is None else v

    fig, axes = figure(ncols=3, width=13)
    faults = ("decode SIGKILL", "decode SIGSTOP", "prefill SIGKILL")
    xs = range(len(faults))
    for i, (key, label) in enumerate((("detect_s", "marked down"), ("restarted_s", "restarted (launcher)"),
                                      ("recover_s", "healthy again (SIGSTOP: after SIGCONT)"))):
        axes[0].bar([x + (i - 1) * 0.27 for x in xs], [med(s, key) for s in faults], 0.27, label=label)
    axes[0].set_xticks(list(xs), faults, fontsize=8)
    axes[0].set_ylabel("seconds (median)")
    axes[0].legend(fontsize=7)
    axes[0].set_title("worker down / back in /workers", fontsize=9)
    labels = ["no fault (any stream)", "decode SIGKILL", "decode SIGSTOP"]
    gaps = [med("decode: no fault", "other_gap_ms"), med("decode SIGKILL", "gap_ms"), med("decode SIGSTOP", "gap_ms")]
    typical = [med(s, "median_interval_ms") for s in DECODE_SCENARIOS]
    axes[1].bar([x - 0.2 for x in range(3)], gaps, 0.4, label="longest gap in a stream")
    axes[1].bar([x + 0.2 for x in range(3)], typical, 0.4, label="median chunk gap")
    axes[1].set_xticks(range(3), labels, fontsize=8)
    axes[1].set_yscale("log")
    axes[1].set_ylabel("ms (median over trials)")
    axes[1].legend(fontsize=7)
    axes[1].set_title("what a migrated stream's client sees", fontsize=9)
    axes[2].bar([x - 0.2 for x in range(2)], [med(s, "ttft_p50_ms") for s in PREFILL_SCENARIOS], 0.4,
                label="TTFT p50")
    axes[2].bar([x + 0.2 for x in range(2)], [med(s, "ttft_max_ms") for s in PREFILL_SCENARIOS], 0.4,
                label="TTFT max")
    axes[2].set_xticks(range(2), ["no fault", "prefill SIGKILL"], fontsize=8)
    axes[2].set_ylabel("ms (median over trials)")
    axes[2].legend(fontsize=7)
    axes[2].set_title("prefill killed under load", fontsize=9)
    save_figure(fig, "failover", title)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="dsv4-tiny")
    parser.add_argument("--trials", type=int, default=5, help="trials per scenario")
    parser.add_argument("--streams", type=int, default=8, help="concurrent streams of a decode trial")
    parser.add_argument("--prompt-len", type=int, default=32, help="prompt tokens of a decode trial's streams")
    parser.add_argument("--max-tokens", type=int, default=160, help="tokens per stream of a decode trial")
    parser.add_argument("--kill-after", type=int, default=48, help="the first stream's tokens before the fault")
    parser.add_argument("--hold-s", type=float, default=3.0, help="how long a SIGSTOPped worker stays stopped")
    parser.add_argument("--prefill-requests", type=int, default=16)
    parser.add_argument("--prefill-prompt-len", type=int, default=256)
    parser.add_argument("--prefill-max-tokens", type=int, default=16)
    parser.add_argument("--up-args", default="", help="extra `pdspark up` flags, e.g. '--restart-backoff-s 0.5'")
    parser.add_argument("--start-timeout", type=float, default=300)
    return parser.parse_args()



def main() -> int:
    args = parse_args()
    stop_on_signals()
    from pdspark.assets import resolve_model
    from pdspark.model.model_config import ModelConfig

    vocab = ModelConfig.from_dir(resolve_model(args.model)).vocab_size
    decode_prompts = random_prompts(args.streams, args.prompt_len, 0, vocab)
    # Fresh prefill prompts per trial: a prefix-cache hit would leave the prefill workers nothing to do.
    prefill_prompts = {(s, t): random_prompts(args.prefill_requests, args.prefill_prompt_len, 1 + 2 * t + i, vocab)
                       for t in range(args.trials) for i, s in enumerate(PREFILL_SCENARIOS)}
    # The cluster starts meanwhile (not measured); one intra-op thread each, on a machine of few cores.
    torch.set_num_threads(1)
    cluster = Cluster(args)  # held before anything else: Ctrl-C from here on still stops it
    rows: list[dict] = []
    try:
        t0 = time.monotonic()
        decode_refs, *refs = offline_refs(args, [decode_prompts, *prefill_prompts.values()],
                                          [args.max_tokens] + [args.prefill_max_tokens] * len(prefill_prompts))
        prefill_refs = dict(zip(prefill_prompts, refs))
        log(f"offline references (the unfailed run): {time.monotonic() - t0:.1f}s")
        cluster.wait_ready(args.start_timeout)
        # A few requests first, so that no worker's first request is measured.
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda ids: generate(cluster.http, ids, 4, lambda s: None),
                          random_prompts(4, 64, -1, vocab)))
        scenarios = [*DECODE_SCENARIOS, *PREFILL_SCENARIOS]
        for t in range(args.trials):
            for s in scenarios:
                if s.startswith("decode"):
                    row = run_trial(cluster, s, decode_prompts, decode_refs, args)
                else:
                    row = run_trial(cluster, s, prefill_prompts[(s, t)], prefill_refs[(s, t)], args)
                rows.append({"trial": t, **row})
                log(f"[{t + 1}/{args.trials}] {s:<18} {_trial_text(row)}")
        cluster.wait_healthy()
    finally:
        rc = cluster.stop()
        log(f"pdspark up stopped (rc {rc})")
    lines = tables(rows, args)
    print("\n".join(lines))
    write_json("failover", {"args": vars(args), "machine": platform.machine(), "cores": os.cpu_count(),
                            "rows": rows})
    plot(rows, lines[0])
    log(f"results: {RESULTS / 'failover.json'}")
    lost = sum(r["lost"] for r in rows)
    if lost:
        log(f"{lost} request(s) lost")
    return 1 if lost else 0


def _trial_text(row: dict) -> str:
    def f(key: str, unit: str, scale: float = 1.0, digits: int = 2) -> str:
        v = row.get(key)
        return f"{key.removesuffix('_s').removesuffix('_ms')} {'-' if v is None else f'{v * scale:.{digits}f}'}{unit}"

    parts = [f"{row['lost']}/{row['requests']} lost", f"{row['migrated']} migrated"]
    if "victim" in row:
        parts += [row["victim"], f("detect_s", "s"), f("restarted_s", "s"), f("recover_s", "s")]
    parts += [f("gap_ms", "ms", digits=0), f("other_gap_ms", "ms", digits=0), f("median_interval_ms", "ms", digits=0),
              f("ttft_max_ms", "ms", digits=0)]
    return ", ".join(parts + ([row["note"]] if row.get("note") else []))


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Stopped as e:
        log(f"stopped by signal {e.args[0]}; the cluster is stopped, no results written")
        sys.exit(128 + e.args[0])
