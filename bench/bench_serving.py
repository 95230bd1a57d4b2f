"""pdspark under guidellm, the load generator people point at vLLM and SGLang: its default chat benchmark
(/v1/chat/completions) and its text-completions benchmark (/v1/completions) against `pdspark up`, at several
concurrencies, with synthetic prompts. Per API: a table (requests ok, errors, TTFT and ITL percentiles, output
tokens/s per concurrency), bench/results/serving.json and serving.png.

guidellm runs from its own venv (`make bench-serving` creates .venv-bench/): its requirements would move the
project's pinned torch and transformers. This script runs with the project's python and starts one fresh
`pdspark up` per API (random free ports), stopped by PID at the end, on Ctrl-C and on errors.

Failed requests are measured results, not script failures: they are counted in the table and in the JSON, and the
exit status stays 0 unless --fail-on-errors. The exit status is 1 when a level produced no guidellm result at all
(guidellm crashed or ran past --level-timeout, or the cluster could not be started).

    python bench/bench_serving.py [--guidellm .venv-bench/bin/guidellm] [--concurrency 1,4,16,64,256]
        [--prompt-tokens 256] [--output-tokens 64] [--requests N] [--apis chat,completions] [--fail-on-errors]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

from pdspark.assets import resolve_model
from pdspark.launch.service_process import ServiceProcess, spawn_service, wait_ready

from console import Stopped, log, stop_on_signals
from report import RESULTS, figure, paired_bars, save_figure, write_json

ROOT = Path(__file__).resolve().parent.parent
RAW = RESULTS / "serving"  # guidellm's own JSON and console log per run (large; git-ignored)
APIS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}



class Cluster:
    """`pdspark up` as a child process; restarted when it has died (an overloaded level can take it down, and the
    next level should measure a serving cluster, not connection refusals)."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.service: ServiceProcess | None = None
        self.starts = 0

    def ensure(self) -> tuple[str | None, str | None]:
        """(router HTTP URL, None) once a cluster serves, or (None, why not)."""
        if self.service is not None and self.service.alive:
            return self.service.info["http"], None
        if self.service is not None:
            log(f"  pdspark up exited (rc {self.service.proc.returncode}); starting a new one\n"
                f"{self.service.tail(15)}")
        # Ports 0: the machine is shared, a fixed port may be taken by someone else's cluster.
        cmd = ["up", "--model", self.args.model, "--port", "0", "--grpc-port", "0", *shlex.split(self.args.up_args)]
        log(f"  starting pdspark {' '.join(cmd)}")
        t0 = time.monotonic()
        # Held before waiting, so that Ctrl-C during the start still finds it to stop.
        self.service = spawn_service("pdspark up", cmd)
        try:
            wait_ready(self.service, timeout=self.args.start_timeout)
        except RuntimeError as e:  # wait_ready has stopped it
            self.service = None
            return None, str(e)
        self.starts += 1
        http = self.service.info["http"]
        log(f"  cluster ready at {http} in {time.monotonic() - t0:.1f}s")
        warm_up(http, self.args.model)
        return http, None

    def stop(self) -> None:
        if self.service is not None:
            rc = self.service.stop()
            log(f"  pdspark up stopped (rc {rc})")
            self.service = None


def warm_up(http: str, model: str) -> None:
    """One short request before measuring, so that whatever a fresh cluster does on its first request is not
    counted in the first level's TTFT."""
    body = json.dumps({"model": model, "prompt": "def fibonacci(n):", "max_tokens": 8}).encode()
    req = urllib.request.Request(f"{http}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            resp.read()
    except OSError as e:  # not fatal: guidellm will then count the failures itself
        log(f"  warm-up request failed: {e}")


def requests_for(args: argparse.Namespace, concurrency: int) -> int:
    # Enough requests for every stream to run at least twice (the level is then measured at its concurrency, not
    # in its ramp-up and drain), bounded so the whole sweep stays minutes long.
    return args.requests if args.requests else max(2 * concurrency, 16)


def guidellm_command(args: argparse.Namespace, target: str, api: str, concurrency: int, requests: int, seed: int,
                     out: Path) -> list[str]:
    backend = f"kind=openai_http,target={target},model={args.model},timeout={args.request_timeout}"
    if api != "chat":  # chat is guidellm's default request format
        backend += f",request_format={APIS[api]}"
    return [
        args.guidellm, "run",
        "--backend", backend,
        "--profile", f"kind=concurrent,streams={concurrency}",
        "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}",
        "--tokenizer", f"kind=hf_auto,model={resolve_model(args.model)}",
        "--constraint", f"kind=max_requests,count={requests}",
        # guidellm's synthetic prompts are the same for the same seed: one seed for every level would send prompts
        # the prefill worker's prefix cache already holds, and later levels would measure cache hits.
        "--seed", f"kind=static,value={seed}",
        "--output", f"kind=json,path={out}",
        "--disable-console-interactive",
    ]


def _stop_group(proc: subprocess.Popen) -> None:
    """Stop guidellm and its worker processes: it runs in its own session, so its group id is its PID."""
    for sig, wait in ((signal.SIGINT, 20), (signal.SIGKILL, 10)):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(wait)


def run_guidellm(cmd: list[str], log_path: Path, args: argparse.Namespace) -> tuple[str, int | None]:
    """("ran" | "failed" | "timed out", return code)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1",  # the tokenizer is a local directory; never wait on the network
           # guidellm's default is up to 10 client processes; on a machine of a few cores they would take CPU from
           # the server being measured. One asyncio process drives hundreds of streams.
           "GUIDELLM__MAX_WORKER_PROCESSES": str(args.client_processes)}
    t0 = time.monotonic()
    with open(log_path, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            while True:
                try:
                    rc = proc.wait(30)
                    return ("ran" if rc == 0 else "failed"), rc
                except subprocess.TimeoutExpired:
                    elapsed = time.monotonic() - t0
                    if elapsed > args.level_timeout:
                        log(f"    guidellm ran past {args.level_timeout:.0f}s; stopping it")
                        return "timed out", None
                    log(f"    ... {elapsed:.0f}s")
        finally:
            _stop_group(proc)


def _dist(metrics: dict, name: str, key: str) -> float | None:
    """A percentile (or 'mean') of guidellm's distribution over successful requests; None when there were none
    (guidellm then writes zeros, which would read as measured values)."""
    d = metrics[name]["successful"]
    if not d["count"]:
        return None
    return d["mean"] if key == "mean" else d["percentiles"][key]


def _error_text(error: str | None) -> str:
    """One key per distinct failure. guidellm stores the exception's repr; for HTTP errors that holds the URL (with
    this run's port) and a documentation link, so only the status is kept."""
    error = error or "unknown error"
    status = re.search(r"(?:Client|Server) error '([^']+)'", error)
    if status:
        return f"HTTP {status.group(1)}"
    return error.replace("\\n", "\n").splitlines()[0][:240]


def guidellm_body(args: argparse.Namespace, api: str, raw: dict) -> tuple[dict, str]:
    """A request body as guidellm sends it, and where it came from. guidellm records the body of successful
    requests only; without one, the same shape (its default chat format: content as a list of text parts,
    max_completion_tokens, continuous usage stats) is rebuilt around a filler prompt of about the same length."""
    for r in raw["benchmarks"][0]["requests"]["successful"]:
        if r.get("request_args"):
            return json.loads(r["request_args"])["body"], "a successful request's body"
    body: dict = {"model": args.model, "stream": True,
                  "stream_options": {"include_usage": True, "continuous_usage_stats": True}, "ignore_eos": True}
    text = " ".join(["the"] * args.prompt_tokens)  # one token per word in dsv4-tiny's tokenizer (about, in others)
    if api == "chat":
        body |= {"max_completion_tokens": args.output_tokens,
                 "messages": [{"role": "user", "content": [{"type": "text", "text": text}]}]}
    else:
        body |= {"max_tokens": args.output_tokens, "prompt": text}
    return body, "guidellm's request shape, filler prompt"


def replay(target: str, api: str, body: dict) -> str:
    """Send one request of the level again, alone, after it: guidellm keeps only the exception, not the server's
    answer, which says why (an error body) or shows the failure needed the load (it then succeeds)."""
    req = urllib.request.Request(target + APIS[api], data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            resp.read()
            return f"HTTP {resp.status} (succeeded when sent alone)"
    except urllib.error.HTTPError as e:
        return f"HTTP {e.code}: {e.read()[:300].decode(errors='replace')}"
    except Exception as e:  # a diagnostic: whatever went wrong is its answer, never the benchmark's end
        return f"{type(e).__name__}: {e}"


def summarize(raw: dict) -> dict:
    """The fields this benchmark reports, from guidellm's JSON (one benchmark per run)."""
    b = raw["benchmarks"][0]
    m = b["metrics"]
    totals = m["request_totals"]
    errors = Counter(_error_text(r["info"].get("error")) for r in b["requests"]["errored"])
    return {
        "ok": totals["successful"],
        "errored": totals["errored"],
        "incomplete": totals["incomplete"],
        "ttft_p50_ms": _dist(m, "time_to_first_token_ms", "p50"),
        "ttft_p99_ms": _dist(m, "time_to_first_token_ms", "p99"),
        "itl_p50_ms": _dist(m, "inter_token_latency_ms", "p50"),
        "itl_p99_ms": _dist(m, "inter_token_latency_ms", "p99"),
        # Output tokens of successful requests per second over the run: 0 when none succeeded, a true value.
        "output_tok_s": m["output_tokens_per_second"]["successful"]["mean"],
        "request_latency_p50_s": _dist(m, "request_latency", "p50"),
        "prompt_tokens_median": _dist(m, "prompt_token_count", "p50"),
        "output_tokens_mean": _dist(m, "output_token_count", "mean"),
        "duration_s": b["duration"],
        "client_processes": b["config"]["strategy"].get("worker_count"),
        "errors": dict(errors.most_common()),
        "guidellm_version": raw["metadata"]["guidellm_version"],
    }


def run_level(args: argparse.Namespace, cluster: Cluster, api: str, concurrency: int, seed: int, step: str) -> dict:
    requests = requests_for(args, concurrency)
    row: dict = {"api": api, "request_format": APIS[api], "concurrency": concurrency, "requests": requests,
                 "seed": seed, "notes": []}
    log(f"[{step}] {api} concurrency {concurrency}: {requests} requests")
    target, why = cluster.ensure()
    if target is None:
        log(f"  cluster did not start:\n{why}")
        return {**row, "status": "failed", "failure": f"cluster did not start: {why}"}
    out, log_path = RAW / f"{api}-c{concurrency}.json", RAW / f"{api}-c{concurrency}.log"
    out.unlink(missing_ok=True)  # a result left by an earlier run must not pass for this one
    cmd = guidellm_command(args, target, api, concurrency, requests, seed, out)
    row["command"] = shlex.join(cmd)
    row["raw"], row["log"] = str(out.relative_to(ROOT)), str(log_path.relative_to(ROOT))
    t0 = time.monotonic()
    status, rc = run_guidellm(cmd, log_path, args)
    row["wall_s"] = time.monotonic() - t0
    if status != "timed out" and out.exists():
        if rc:  # its results were written: report them, and that it then failed
            row["notes"].append(f"guidellm exited with rc {rc} after writing its JSON (see {row['log']})")
        try:
            raw = json.loads(out.read_text())
            row.update(status="ran", **summarize(raw))
        except (ValueError, KeyError, IndexError, TypeError) as e:  # another layout, or cut short: say so, go on
            row.update(status="failed", failure=f"could not read guidellm's JSON ({type(e).__name__}: {e})")
            log(f"  {row['failure']}")
            return row
        if row["errored"] and cluster.service is not None and cluster.service.alive:
            body, source = guidellm_body(args, api, raw)
            row["replayed_error"] = f"{replay(target, api, body)} [{source}]"
        log(f"  ok {row['ok']}/{requests}, errors {row['errored']}, incomplete {row['incomplete']}, TTFT p50 "
            f"{_fmt(row['ttft_p50_ms'])} ms, {row['output_tok_s']:.1f} output tok/s ({row['wall_s']:.0f}s)")
        for text, n in row["errors"].items():
            log(f"    {n} x {text}")
        if "replayed_error" in row:
            log(f"    one failed request sent again alone: {row['replayed_error']}")
    else:
        tail = log_path.read_text()[-3000:] if log_path.exists() else ""
        failure = "no JSON written" if status == "ran" else f"guidellm {status}" + (f" (rc {rc})" if rc else "")
        row.update(status="failed" if status == "ran" else status, failure=failure, log_tail=tail)
        log(f"  {failure}; last lines of {log_path}:\n{tail[-1500:]}")
    if cluster.service is not None and not cluster.service.alive:
        row["notes"].append("pdspark up exited during this level")
        log(f"  {row['notes'][-1]}")
    return row


def _fmt(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _up_label(args: argparse.Namespace) -> str:
    return f"`pdspark up {args.up_args}`" if args.up_args else "`pdspark up` defaults"


def table(args: argparse.Namespace, api: str, rows: list[dict]) -> list[str]:
    version = next((r["guidellm_version"] for r in rows if "guidellm_version" in r), "?")
    lines = [
        f"guidellm {version}, {api} ({APIS[api]}), synthetic prompts {args.prompt_tokens} tokens, "
        f"{args.output_tokens} output tokens (ignore_eos), {args.model}, {_up_label(args)}",
        "",
        "| concurrency | requests ok | errors | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | output tok/s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    notes = []
    for r in rows:
        if r["status"] != "ran":
            lines.append(f"| {r['concurrency']} | - / {r['requests']} | {r['status']} | - | - | - | - | - |")
            notes.append(f"concurrency {r['concurrency']}: {r['failure']}")
            notes += [f"concurrency {r['concurrency']}: {note}" for note in r["notes"]]
            continue
        lines.append(f"| {r['concurrency']} | {r['ok']} / {r['requests']} | {r['errored']} | "
                     f"{_fmt(r['ttft_p50_ms'])} | {_fmt(r['ttft_p99_ms'])} | {_fmt(r['itl_p50_ms'], 2)} | "
                     f"{_fmt(r['itl_p99_ms'], 2)} | {r['output_tok_s']:.1f} |")
        for text, n in r["errors"].items():
            notes.append(f"concurrency {r['concurrency']}: {n} x {text}")
        if "replayed_error" in r:
            notes.append(f"concurrency {r['concurrency']}: one failed request sent again alone: {r['replayed_error']}")
        if r["incomplete"]:
            notes.append(f"concurrency {r['concurrency']}: {r['incomplete']} requests incomplete (cancelled)")
        if r["output_tokens_mean"] is not None and r["output_tokens_mean"] < args.output_tokens:
            notes.append(f"concurrency {r['concurrency']}: successful requests averaged "
                         f"{r['output_tokens_mean']:.1f} output tokens, fewer than the {args.output_tokens} asked")
        notes += [f"concurrency {r['concurrency']}: {note}" for note in r["notes"]]
    if notes:
        lines += ["", *notes]
    return lines


def plot(args: argparse.Namespace, rows: list[dict], title: str) -> None:
    levels = args.concurrency
    by = {(r["api"], r["concurrency"]): r for r in rows}

    def series(api: str, key: str) -> list[float]:
        # NaN, not 0, where nothing was measured: matplotlib leaves the bar out instead of drawing a false zero.
        out = []
        for c in levels:
            r = by.get((api, c))
            v = r.get(key) if r is not None and r["status"] == "ran" else None
            out.append(math.nan if v is None else v)
        return out

    def failed_pct(api: str) -> list[float]:
        out = []
        for c in levels:
            r = by.get((api, c))
            out.append(math.nan if r is None or r["status"] != "ran" else
                       100 * (r["errored"] + r["incomplete"]) / max(1, r["ok"] + r["errored"] + r["incomplete"]))
        return out

    apis = ("chat", "completions")
    labels = [str(c) for c in levels]
    fig, axes = figure(ncols=3, width=13)
    paired_bars(axes[0], labels, series(apis[0], "output_tok_s"), series(apis[1], "output_tok_s"), apis,
                "output tok/s")
    paired_bars(axes[1], labels, series(apis[0], "ttft_p50_ms"), series(apis[1], "ttft_p50_ms"), apis,
                "TTFT p50 (ms)")
    paired_bars(axes[2], labels, failed_pct(apis[0]), failed_pct(apis[1]), apis, "failed requests (%)")
    axes[2].set_ylim(0, 100)  # a fixed scale: no failures reads as an empty panel, not as an axis around zero
    for ax in axes:
        ax.set_xlabel("concurrency")
    save_figure(fig, "serving", title)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_guidellm = ROOT / ".venv-bench" / "bin" / "guidellm"
    parser.add_argument("--guidellm", default=str(default_guidellm) if default_guidellm.exists() else "guidellm",
                        help="the guidellm executable (make bench-serving installs it into .venv-bench/)")
    parser.add_argument("--model", default="dsv4-tiny", help="model served by `pdspark up`; its tokenizer directory "
                        "is guidellm's processor")
    parser.add_argument("--concurrency", default="1,4,16,64,256", help="comma-separated concurrency levels")
    parser.add_argument("--apis", default="chat,completions", help="comma-separated: chat, completions")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=0,
                        help="requests per level (default: max(2 x concurrency, 16))")
    parser.add_argument("--seed", type=int, default=42, help="first seed of the synthetic prompts (one per run)")
    parser.add_argument("--client-processes", type=int, default=1, help="guidellm worker processes")
    parser.add_argument("--request-timeout", type=float, default=600,
                        help="guidellm's read timeout per request, s (a hung request becomes an error)")
    parser.add_argument("--level-timeout", type=float, default=1800, help="wall-clock limit of one guidellm run, s")
    parser.add_argument("--start-timeout", type=float, default=300, help="limit for `pdspark up` to be ready, s")
    parser.add_argument("--up-args", default="", help="extra `pdspark up` flags, e.g. '--max-num-seqs 32'")
    parser.add_argument("--fail-on-errors", action="store_true",
                        help="exit 1 when any request failed (by default failures are only reported)")
    args = parser.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    args.apis = [a.strip() for a in args.apis.split(",") if a.strip()]
    unknown = [a for a in args.apis if a not in APIS]
    if unknown or not args.apis or not args.concurrency or min(args.concurrency) < 1:
        parser.error(f"--apis must be among {', '.join(APIS)}; --concurrency positive integers")
    return args



def main() -> int:
    args = parse_args()
    if shutil.which(args.guidellm) is None:
        log(f"guidellm not found at {args.guidellm!r}: run `make bench-serving` (it creates .venv-bench/) or pass "
            "--guidellm PATH")
        return 2
    # Both signals unwind through the finally blocks, which stop guidellm and the cluster. SIGINT is set explicitly:
    # a shell starting this in the background hands it SIGINT ignored, and Python then keeps it ignored.
    stop_on_signals()
    RAW.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    total = len(args.apis) * len(args.concurrency)
    seed = args.seed
    starts = 0
    for api in args.apis:
        # A fresh cluster per API: an overloaded level of one API must not leave the other a degraded cluster.
        cluster = Cluster(args)
        try:
            for c in args.concurrency:
                rows.append(run_level(args, cluster, api, c, seed, f"{len(rows) + 1}/{total}"))
                seed += 1
        finally:
            cluster.stop()
            starts += cluster.starts
    lines: list[str] = []
    for api in args.apis:
        lines += table(args, api, [r for r in rows if r["api"] == api]) + [""]
    print("\n".join(lines).rstrip())
    write_json("serving", {"args": vars(args), "tokenizer": resolve_model(args.model), "cluster_starts": starts,
                           "rows": rows})
    plot(args, rows, f"guidellm, chat vs completions, {args.prompt_tokens} prompt / {args.output_tokens} output "
                     f"tokens, {args.model}, {_up_label(args)}; requests per level: "
                     f"{args.requests or 'max(2 x concurrency, 16)'}")
    log(f"results: {RESULTS / 'serving.json'}; guidellm's own JSON and logs: {RAW}")
    no_result = [r for r in rows if r["status"] != "ran"]
    failed_requests = sum(r.get("errored", 0) + r.get("incomplete", 0) for r in rows)
    if no_result:
        log(f"{len(no_result)} level(s) produced no result")
        return 1
    return 1 if args.fail_on_errors and failed_requests else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Stopped as e:
        log(f"stopped by signal {e.args[0]}; cluster and guidellm stopped, no results written")
        sys.exit(128 + e.args[0])
