"""Chaos: one process of a `pdspark up --prefill 2 --decode 2` cluster (DSpark on) is SIGKILLed, or SIGSTOPped and
SIGCONTed after a hold of 1-3 s, at a moment hypothesis picks, while a mixed load runs: 8 requests, greedy and
seeded, streamed and not, through the OpenAI HTTP API and the gRPC SDK (`pdspark.client.Client`), sent 0.15 s
apart. Each example asserts:

- every request ends within its deadline (nothing hangs), with its full answer or a clean error: an HTTP status
  with OpenAI's error body (or the error event of a broken SSE stream), a `ClientError` with its `error_code`; and
  when the router itself is killed, a broken connection (its streams are lost by design). A worker fault loses no
  request: every one completes (decode streams migrate, prefill failures before the first token are retried);
- no streamed token is lost or repeated: the chunks add up to the answer (token ids for the SDK; the text and the
  usage count for SSE), which equals the offline engine's (`make_llm`, one engine, DSpark off), greedy and seeded
  alike; what a killed router cut short is a prefix of it;
- afterwards every worker's pools are back to their free counts (GetLoad: nothing running, waiting, queued or in
  transfer; every used page is a prefix-cache page), and the cluster serves again. The recovery time (signal ->
  every worker healthy in /workers and a fresh request served) is printed (`pytest -s`).

Every (process kind, signal) pair is a parametrized case, so each run covers all six; hypothesis draws the rest per
example (the load's order and prompts, which stream triggers the fault and after how many of its tokens, which
instance when two are equally busy, the hold) and prints the falsifying example and its reproduction blob on
failure. Shrinking is off: an example costs seconds of real processes. `PDSPARK_CHAOS_EXAMPLES=N` runs N examples
per case (default 1), for a longer soak.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from threading import Event
from typing import Any

import grpc
import pytest
from hypothesis import Phase, assume, given, settings
from hypothesis import strategies as st

from helpers import make_llm
from pdspark import SamplingParams
from pdspark.client import Client, ClientError
from pdspark.errors import ErrorCode
from pdspark.launch.service_process import ServiceProcess, start_service
from pdspark.rpc.status import reported_failure
from pdspark.testing.time_scale import scaled
from pdspark.testing.waiting import wait_until
from pdspark.testing.worker_load import WorkerAt, load_of, what_is_held

ENGINE = ["--page-size", "16", "--max-model-len", "256", "--max-num-seqs", "8"]
# A killed worker is back within seconds (same port); the others serve meanwhile.
SUPERVISION = ["--restart-backoff-s", "0.5", "--max-restart-backoff-s", "1"]
MAX_TOKENS = 64
# Byte-level prompts of different lengths (the test checkpoint's tokenizer is one token per byte).
PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n",
    "The quick brown fox",
    "for i in range(10):\n    print(i * i)\n" * 3,
    "SELECT name, count(*) FROM users GROUP BY name ORDER BY 2 DESC LIMIT 10;\n" * 2,
]
SEEDED = dict(temperature=0.9, top_p=0.95)
STAGGER_S = 0.15  # between the starts of the load's requests: some are always in prefill when the fault hits
REQUEST_TIMEOUT_S = 30.0  # the router's bound on each request (X-Request-Timeout, the SDK's timeout)
LOAD_DEADLINE_S = scaled(45.0)  # a request not over by then hangs
EXAMPLES = int(os.environ.get("PDSPARK_CHAOS_EXAMPLES", "1"))
WORKERS = {"prefill": ("prefill-0", "prefill-1"), "decode": ("decode-2", "decode-3")}


@dataclass(frozen=True)
class Req:
    api: str  # "http" (OpenAI /v1/completions) or "sdk" (gRPC)
    streamed: bool
    seeded: bool  # else greedy
    prompt: int  # index into PROMPTS

    @property
    def seed(self) -> int | None:
        return 1000 + self.prompt if self.seeded else None

    def sampling(self) -> dict:
        return dict(SEEDED, seed=self.seed) if self.seeded else dict(temperature=0.0)

    def __str__(self) -> str:
        return (f"{self.api} {'stream' if self.streamed else 'unary'} {'seeded' if self.seeded else 'greedy'} "
                f"prompt {self.prompt}")


@dataclass(frozen=True)
class Fault:
    kind: str  # "prefill", "decode" or "router"
    signal: str  # "SIGKILL" or "SIGSTOP"
    trigger: int  # which streamed request of the load triggers it
    after_tokens: int  # ... once it received this many tokens (or ended)
    instance: int  # which of two equally busy workers
    hold_s: float  # SIGSTOP: how long until SIGCONT


@dataclass
class Outcome:
    req: Req
    text: str = ""  # what reached the client, chunks concatenated
    token_ids: list[int] | None = None  # the SDK's
    completion_tokens: int | None = None  # the server's count (HTTP usage)
    finish_reason: str | None = None
    error: str | None = None  # a clean, typed failure
    broken: str | None = None  # the connection broke (a killed router)
    bad: str | None = None  # anything else: an untyped error, a malformed answer, no end of stream
    seconds: float = 0.0

    @property
    def completed(self) -> bool:
        return self.error is None and self.broken is None and self.bad is None


COMBOS = [Req(api, streamed, seeded, 0) for api in ("http", "sdk") for streamed in (True, False)
          for seeded in (False, True)]


@st.composite
def loads(draw) -> list[Req]:
    """The 8 combinations of (API, streamed, sampling), in a drawn order, each with a drawn prompt."""
    order = draw(st.permutations(COMBOS))
    return [Req(r.api, r.streamed, r.seeded, draw(st.integers(0, len(PROMPTS) - 1))) for r in order]


def faults(kind: str, sig: str) -> st.SearchStrategy[Fault]:
    # A prefill works before a stream's first tokens: hit it early, while the later requests are still arriving.
    after = st.integers(1, 4) if kind == "prefill" else st.integers(1, 48)
    return st.builds(Fault, st.just(kind), st.just(sig), st.integers(0, 3), after, st.integers(0, 1),
                     st.sampled_from([1.0, 2.0, 3.0]))


# ---- the cluster -----------------------------------------------------------------------------------------------------
# Mooncake's transfer timeout short (the write grace of a quarantine): see `cluster`. The plan's deadline is the
# router's transfer timeout (30 s by default; `pdspark up` passes it on its command line).
QUARANTINE_ENV = {"MC_TRANSFER_TIMEOUT": "3"}
FREE_WITHIN_S = scaled(30 + 3 + 10)


@pytest.fixture(scope="module")
def cluster(draft_ckpt) -> Iterator[ServiceProcess]:
    """The children inherit `QUARANTINE_ENV`, so that pages quarantined after a stopped or killed prefill worker
    (freed once no write of its can land: the plan's deadline + the transfer engine's timeout) come back within
    `FREE_WITHIN_S`."""
    service = start_service("pdspark up", ["up", "--model", str(draft_ckpt), "--prefill", "2", "--decode", "2",
                                           "--port", "0", "--grpc-port", "0", *ENGINE, *SUPERVISION],
                            timeout=240, env={"OMP_NUM_THREADS": "1", **QUARANTINE_ENV})
    try:
        yield service
    finally:
        assert service.stop() == 0


@pytest.fixture(scope="module")
def offline(draft_ckpt) -> dict[tuple[int, bool], tuple[list[int], str]]:
    """(prompt, seeded) -> the uninterrupted output: one engine, no P/D, DSpark off (the equality ladder's bottom)."""
    llm = make_llm(draft_ckpt, page_size=16, max_model_len=256)
    keys = [(p, seeded) for p in range(len(PROMPTS)) for seeded in (False, True)]
    params = [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **Req("sdk", True, s, p).sampling())
              for p, s in keys]
    outs = llm.generate([PROMPTS[p] for p, _ in keys], params)
    return {k: (list(o.token_ids), o.text or "") for k, o in zip(keys, outs)}


def current(cluster: ServiceProcess, name: str) -> dict:
    """`{"pid", "address"}` of the service's current run (after any restart)."""
    restarts = [e for e in cluster.events if e.get("event") == "restarted" and e.get("service") == name]
    return restarts[-1] if restarts else cluster.info["services"][name]


def restarts(cluster: ServiceProcess, name: str) -> int:
    return sum(1 for e in cluster.events if e.get("event") == "restarted" and e.get("service") == name)


def workers(cluster: ServiceProcess) -> list[dict] | None:
    """/workers, or None while the router does not answer (killed, restarting)."""
    try:
        with urllib.request.urlopen(cluster.info["http"] + "/workers", timeout=5) as r:
            return json.loads(r.read())
    except (OSError, http.client.HTTPException):
        return None


def all_healthy(cluster: ServiceProcess) -> bool:
    ws = workers(cluster)
    return ws is not None and len(ws) == 4 and all(w["healthy"] for w in ws)


def counters(cluster: ServiceProcess) -> dict[str, float]:
    """The router's migration and retry counters (empty while it does not answer)."""
    try:
        with urllib.request.urlopen(cluster.info["http"] + "/metrics", timeout=5) as r:
            text = r.read().decode()
    except (OSError, http.client.HTTPException):
        return {}
    names = {"pdspark_router_migrations_total": "migrations", "pdspark_router_retries_total": "retries"}
    return {names[k]: float(v) for k, _, v in (line.partition(" ") for line in text.splitlines()) if k in names}


def serves(cluster: ServiceProcess) -> bool:
    """A fresh small request succeeds."""
    try:
        with Client(cluster.info["grpc"], timeout=10) as client:
            return len(client.generate("x = 1", max_tokens=4, temperature=0, ignore_eos=True).token_ids) == 4
    except ClientError:
        return False


# ---- the load ----------------------------------------------------------------------------------------------------
def http_request(cluster: ServiceProcess, req: Req, on_tokens: Callable[[int], None]) -> Outcome:
    out = Outcome(req)
    body: dict = {"model": cluster.info["model"], "prompt": PROMPTS[req.prompt], "max_tokens": MAX_TOKENS,
                  "ignore_eos": True, "stream": req.streamed, **req.sampling()}
    if req.streamed:  # every chunk carries the count so far: the trigger and the lost/repeated token check
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    request = urllib.request.Request(cluster.info["http"] + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json",
                                              "X-Request-Timeout": str(REQUEST_TIMEOUT_S)})
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S + 10) as r:
            if not req.streamed:
                answer = json.loads(r.read())
                out.text, out.finish_reason = answer["choices"][0]["text"], answer["choices"][0]["finish_reason"]
                out.completion_tokens = answer["usage"]["completion_tokens"]
                return out
            done = False
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                event = json.loads(line.removeprefix("data: "))
                if "error" in event:  # a stream broken after its first chunk: the error travels as an event
                    out.error = typed_http_error(None, event)
                    continue
                if event.get("usage"):
                    out.completion_tokens = event["usage"]["completion_tokens"]
                    on_tokens(out.completion_tokens)
                if event["choices"]:
                    out.text += event["choices"][0]["text"]
                    out.finish_reason = event["choices"][0]["finish_reason"] or out.finish_reason
            if not done:
                out.broken = "the SSE stream ended without [DONE]"
    except urllib.error.HTTPError as e:
        out.error = typed_http_error(e.code, json.loads(e.read() or b"null"))
    except (TimeoutError, urllib.error.URLError) as e:
        if isinstance(e, TimeoutError) or isinstance(e.reason, TimeoutError):
            out.bad = f"no answer within {REQUEST_TIMEOUT_S + 10:.0f}s: {e!r}"
        else:
            out.broken = repr(e)  # refused: the router is down
    except (OSError, http.client.HTTPException) as e:  # reset, closed mid-answer
        out.broken = repr(e)
    except (ValueError, KeyError, IndexError) as e:
        out.bad = f"malformed answer: {e!r}"
    if out.error is not None and out.error.startswith("untyped"):
        out.bad, out.error = out.error, None
    return out


def typed_http_error(status: int | None, body: Any) -> str:
    """`"HTTP 503 unavailable"` when `body` is OpenAI's error object with one of pdspark's codes, matching `status`
    (None: an SSE error event); otherwise a description starting with "untyped"."""
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict) or set(error) != {"message", "type", "param", "code"}:
        return f"untyped HTTP {status} error: {body!r}"
    try:
        code = ErrorCode(error["code"])
    except ValueError:
        return f"untyped HTTP {status} error (unknown code): {body!r}"
    if (status is not None and status != code.http_status) or error["type"] != code.openai_type:
        return f"untyped HTTP {status} error (status or type does not match its code): {body!r}"
    return f"HTTP {status or 'stream'} {code.value}: {error['message']}"


def sdk_request(cluster: ServiceProcess, req: Req, on_tokens: Callable[[int], None]) -> Outcome:
    out = Outcome(req, token_ids=[])
    assert out.token_ids is not None
    try:
        with Client(cluster.info["grpc"], timeout=REQUEST_TIMEOUT_S) as client:
            args: dict = dict(max_tokens=MAX_TOKENS, ignore_eos=True, **req.sampling())
            if not req.streamed:
                result = client.generate(PROMPTS[req.prompt], **args)
                out.token_ids, out.text = result.token_ids, result.text
                out.finish_reason = result.finish_reason.value if result.finish_reason else None
                return out
            for chunk in client.stream(PROMPTS[req.prompt], **args):
                out.token_ids += chunk.token_ids
                out.text += chunk.text
                out.finish_reason = chunk.finish_reason.value if chunk.finish_reason else out.finish_reason
                on_tokens(len(out.token_ids))
    except ClientError as e:
        cause = e.__cause__
        if isinstance(cause, grpc.RpcError) and reported_failure(cause) is not None:
            if e.code == e.error_code.grpc_status:
                out.error = f"{e.code} {e.error_code.value}: {e.message}"
            else:
                out.bad = f"untyped: {e} (error_code {e.error_code.value})"
        elif e.code == "UNAVAILABLE":
            out.broken = str(e)  # the transport: the router is down
        else:  # the client's own deadline (the router should have ended the request first), or worse
            out.bad = f"failed in the transport: {e}"
    return out


def run_load(cluster: ServiceProcess, load: list[Req], fault: Fault, trigger: Event) -> list[Future]:
    """Start the load's requests STAGGER_S apart (from a pool); `trigger` is set once the fault's trigger stream
    received `fault.after_tokens` tokens, or ended."""
    streamed = [i for i, r in enumerate(load) if r.streamed]
    trigger_idx = streamed[fault.trigger % len(streamed)]
    t0 = time.monotonic()

    def one(i: int, req: Req) -> Outcome:
        time.sleep(max(0.0, t0 + i * STAGGER_S - time.monotonic()))  # pacing the arrivals, not synchronisation

        def on_tokens(n: int) -> None:
            if i == trigger_idx and n >= fault.after_tokens:
                trigger.set()

        started = time.monotonic()
        try:
            out = (http_request if req.api == "http" else sdk_request)(cluster, req, on_tokens)
        finally:
            if i == trigger_idx:
                trigger.set()
        out.seconds = time.monotonic() - started
        return out

    pool = ThreadPoolExecutor(len(load), thread_name_prefix="chaos-load")
    try:
        return [pool.submit(one, i, r) for i, r in enumerate(load)]
    finally:
        pool.shutdown(wait=False)


# ---- the fault ---------------------------------------------------------------------------------------------------
def victim(cluster: ServiceProcess, fault: Fault) -> str:
    """The service to signal: the router, or the busier worker of the kind (ties: the drawn instance)."""
    if fault.kind == "router":
        return "router"
    names = WORKERS[fault.kind]

    def work(name: str) -> int:
        report = load_of(WorkerAt(fault.kind, current(cluster, name)["address"]))
        return report.running if fault.kind == "decode" else report.transfers_in_flight

    amounts = [work(n) for n in names]
    return names[fault.instance] if amounts[0] == amounts[1] else names[amounts.index(max(amounts))]


def inject(cluster: ServiceProcess, fault: Fault, name: str) -> None:
    pid = current(cluster, name)["pid"]
    if fault.signal == "SIGKILL":
        os.kill(pid, signal.SIGKILL)
        return
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(fault.hold_s)  # the fault itself: the process stays stopped this long
    finally:
        os.kill(pid, signal.SIGCONT)


def recover(cluster: ServiceProcess, fault: Fault, name: str, restarts_before: int) -> None:
    if fault.signal == "SIGKILL":
        wait_until(lambda: restarts(cluster, name) > restarts_before, 60, f"the launcher restarts {name}")
    wait_until(lambda: all_healthy(cluster), 30, "every worker healthy in /workers")
    wait_until(lambda: serves(cluster), 30, "a fresh request served")


# ---- the checks --------------------------------------------------------------------------------------------------
def problems(out: Outcome, fault: Fault, want: tuple[list[int], str]) -> list[str]:
    want_ids, want_text = want
    found = []
    if out.bad is not None:
        found.append(out.bad)
    elif not out.completed and fault.kind != "router":
        found.append(f"lost to a {fault.kind} fault: {out.error or out.broken}")
    if out.completed:
        if out.text != want_text:
            found.append(f"text differs from offline at char {_first_difference(out.text, want_text)}")
        if out.token_ids is not None and out.token_ids != want_ids:
            found.append(f"token ids differ from offline at index {_first_difference(out.token_ids, want_ids)} "
                         f"({len(out.token_ids)} tokens)")
        if out.completion_tokens is not None and out.completion_tokens != MAX_TOKENS:
            found.append(f"{out.completion_tokens} completion tokens counted, not {MAX_TOKENS}")
        if out.finish_reason != "length":
            found.append(f"finish_reason {out.finish_reason!r}, not 'length'")
    else:  # what reached the client before the failure is still the offline output's beginning
        if not want_text.startswith(out.text):
            at = _first_difference(out.text, want_text)
            found.append(f"partial text is not a prefix of offline (differs at char {at})")
        if out.token_ids is not None and out.token_ids != want_ids[:len(out.token_ids)]:
            found.append("partial token ids are not a prefix of offline")
    return found


def _first_difference(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGSTOP"])
@pytest.mark.parametrize("kind", ["decode", "prefill", "router"])
@settings(max_examples=EXAMPLES, deadline=None, print_blob=True, report_multiple_bugs=False,
          phases=(Phase.explicit, Phase.reuse, Phase.generate))
@given(data=st.data())
def test_cluster_rides_through_a_fault(cluster, offline, kind, sig, data):
    load = data.draw(loads(), label="load")
    fault = data.draw(faults(kind, sig), label="fault")
    # Hypothesis tries the simplest example first: with one example per case, every run would be that one.
    assume(not (all(r.prompt == 0 for r in load) and fault.trigger == 0 and fault.after_tokens == 1))
    chaos_example(cluster, offline, load, fault)


def chaos_example(cluster: ServiceProcess, offline: dict, load: list[Req], fault: Fault) -> None:
    wait_until(lambda: all_healthy(cluster), 60, "every worker healthy before the example")
    counted = counters(cluster)
    trigger = Event()
    futures = run_load(cluster, load, fault, trigger)
    name = ""
    try:
        assert trigger.wait(LOAD_DEADLINE_S), "the trigger stream neither reached its token count nor ended"
        name = victim(cluster, fault)
        before = restarts(cluster, name)
        signalled = time.monotonic()
        inject(cluster, fault, name)
    finally:
        done, hung = wait(futures, timeout=LOAD_DEADLINE_S)
    assert not hung, f"{len(hung)} request(s) did not end within {LOAD_DEADLINE_S:.0f}s"
    outcomes = [f.result() for f in futures]
    recover(cluster, fault, name, before)
    recovery_s = time.monotonic() - signalled
    found = [f"{o.req}: {p}" for o in outcomes for p in problems(o, fault, offline[(o.req.prompt, o.req.seeded)])]
    after = counters(cluster)  # a restarted router counts from 0 again
    failed = sum(not o.completed for o in outcomes)
    report = [f"{fault.signal} {name} after {fault.after_tokens} tokens of a stream"
              + (f", held {fault.hold_s:.0f}s" if fault.signal == "SIGSTOP" else ""),
              f"recovered {recovery_s:.1f}s after the signal (every worker healthy, a fresh request served)",
              f"{len(outcomes) - failed} requests completed, {failed} failed",
              f"slowest {max(o.seconds for o in outcomes):.1f}s"]
    if fault.kind != "router":
        report += [f"{k} +{after[k] - counted[k]:.0f}" for k in sorted(after)]
    print("\n" + "; ".join(report))

    def leftovers() -> list[str]:
        return [f"{worker}: {holds}" for role, names in WORKERS.items() for worker in names
                if (holds := what_is_held(load_of(WorkerAt(role, current(cluster, worker)["address"]))))]

    deadline = time.monotonic() + FREE_WITHIN_S
    while (left := leftovers()) and time.monotonic() < deadline:
        time.sleep(0.1)
    found += [f"pools not back to their free counts {FREE_WITHIN_S}s after recovery: {x}" for x in left]
    assert not found, f"{len(found)} problem(s):\n  " + "\n  ".join(found)
