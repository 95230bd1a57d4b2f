"""The failure matrix: one process of the shared `faults` cluster (2 prefill + 3 decode workers, DSpark on) is
SIGKILLed, or SIGSTOPped and SIGCONTed after a hold of 1-3 s, while a mixed load runs: 8 requests, greedy and seeded,
streamed and not, through the OpenAI HTTP API and the gRPC SDK (`pdspark.client.Client`), sent 0.15 s apart.

The fault hits work, never an idle process: a worker is stopped first and signalled only if the router's books show
it holding an unanswered leg of a request (a prefill worker until it answered, a decode worker until its stream
ended); otherwise it is resumed and another moment is taken. The test fails if no worker of the kind held work while
the load ran. Each example asserts:

- every request ends within its deadline (nothing hangs), with its full answer or a clean error: an HTTP status
  with OpenAI's error body (or the error event of a broken SSE stream), a `ClientError` with its `error_code`; and
  when the router itself is killed, a broken connection (its streams are lost by design). A worker fault loses no
  request: every one completes (decode streams migrate, prefill failures before the first token are retried), and
  each unanswered leg of a killed worker, and of a stopped decode worker that the router marked down while it was
  stopped, cost its request a retry or a migration (the router's counters);
- no streamed token is lost or repeated: the chunks add up to the answer (token ids for the SDK; the text and the
  usage count for SSE), which equals the offline engine's (one engine, no P/D, DSpark off), greedy and seeded alike;
  what a killed router cut short is a prefix of it;
- supervision: a killed service is restarted at its address (a new pid), the router re-admits it and every worker
  is healthy again; a stopped one is the same process afterwards (nothing restarted);
- afterwards every worker's pools are back to their free counts (GetLoad: nothing running, waiting, queued or in
  transfer; every used page is a prefix-cache page), and the cluster serves again.

Every (process kind, signal) pair is a parametrized case, so each run covers all six; hypothesis draws the rest per
example (the load's order and prompts, which stream triggers a decode or router fault and after how many of its
tokens, the hold) and prints the falsifying example and its reproduction blob on failure. Shrinking is off: an
example costs seconds of real processes. `PDSPARK_CHAOS_EXAMPLES=N` runs N examples per case (default 1), for a
longer soak. The cases that must always run are explicit: a single stream whose decode worker is killed after its
first token or in its middle migrates with exactly one migration, over SSE and the SDK, greedy and seeded.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from threading import Event
from typing import Any

import grpc
import openai
import pytest
from hypothesis import Phase, assume, given, settings
from hypothesis import strategies as st

from cluster_pool import FAULT_MC_TIMEOUT_S, FAULT_TRANSFER_TIMEOUT_S
from pdspark import SamplingParams
from pdspark.client import Client, ClientError
from pdspark.errors import ErrorCode
from pdspark.launch.service_process import ServiceProcess
from pdspark.rpc.status import reported_failure
from pdspark.testing.time_scale import scaled
from pdspark.testing.waiting import wait_until
from pdspark.testing.worker_load import WorkerAt, load_of, what_is_held

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
REQUEST_TIMEOUT_S = scaled(30.0)  # the router's bound on each request (X-Request-Timeout, the SDK's timeout)
LOAD_DEADLINE_S = scaled(45.0)  # a request not over by then hangs
EXAMPLES = int(os.environ.get("PDSPARK_CHAOS_EXAMPLES", "1"))
WORKERS = {"prefill": ("prefill-0", "prefill-1"), "decode": ("decode-2", "decode-3", "decode-4")}
# Pages quarantined after a stopped or killed prefill worker come back once no write of its can land: the plan's
# deadline (the cluster's transfer timeout) + the transfer engine's timeout; 10 s more for the sweep and the load.
# (Bounds given to `wait_until` are scaled there.)
FREE_WITHIN_S = FAULT_TRANSFER_TIMEOUT_S + FAULT_MC_TIMEOUT_S + 10
RESTART_WITHIN_S = 60  # a killed service is restarted (0.5-1 s backoff) and loaded again within this
HEALTHY_WITHIN_S = 30  # ... and the router counts every worker healthy, and serves, within this
# An answer a worker sent just before it was stopped reaches the router's books within this (loopback, then a turn of
# the router's event loop; a loop behind a busy core takes tens of milliseconds).
SETTLE_S = scaled(0.2)


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
    after_tokens: int  # ... once it received this many tokens (or ended); a prefill fault does not wait for one
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


def fault_cases(kind: str, sig: str) -> st.SearchStrategy[Fault]:
    # A prefill worker is hit while it holds a leg (whenever that is: `freeze_busy`); a decode worker or the router
    # once the trigger stream has this many tokens.
    after = st.just(0) if kind == "prefill" else st.integers(1, 48)
    return st.builds(Fault, st.just(kind), st.just(sig), st.integers(0, 3), after, st.sampled_from([1.0, 2.0, 3.0]))


# ---- the cluster's state -----------------------------------------------------------------------------------------
def current(cluster: ServiceProcess, name: str) -> dict:
    """`{"pid", "address"}` of the service's current run (after any restart)."""
    restarts = [e for e in cluster.events if e.get("event") == "restarted" and e.get("service") == name]
    return restarts[-1] if restarts else cluster.info["services"][name]


def restarts(cluster: ServiceProcess, name: str) -> int:
    return sum(1 for e in cluster.events if e.get("event") == "restarted" and e.get("service") == name)


def workers(cluster: ServiceProcess, admin: dict) -> list[dict] | None:
    """/workers, or None while the router does not answer (killed, restarting)."""
    try:
        request = urllib.request.Request(cluster.info["http"] + "/workers", headers=admin)
        with urllib.request.urlopen(request, timeout=scaled(5)) as r:
            return json.loads(r.read())
    except (OSError, http.client.HTTPException):
        return None


def all_healthy(cluster: ServiceProcess, admin: dict) -> bool:
    ws = workers(cluster, admin)
    return ws is not None and len(ws) == sum(map(len, WORKERS.values())) and all(w["healthy"] for w in ws)


def legs_held(cluster: ServiceProcess, admin: dict, kind: str) -> dict[str, int]:
    """Worker name -> the unanswered legs the router has on it (its books: `in_flight` in /workers), for `kind`."""
    by_address = {w["address"]: w["in_flight"] for w in workers(cluster, admin) or []}
    return {name: by_address.get(current(cluster, name)["address"], 0) for name in WORKERS[kind]}


def counters(cluster: ServiceProcess) -> dict[str, float]:
    """The router's migration and retry counters (empty while it does not answer)."""
    try:
        with urllib.request.urlopen(cluster.info["http"] + "/metrics", timeout=scaled(5)) as r:
            text = r.read().decode()
    except (OSError, http.client.HTTPException):
        return {}
    names = {"pdspark_router_migrations_total": "migrations", "pdspark_router_retries_total": "retries"}
    return {names[k]: float(v) for k, _, v in (line.partition(" ") for line in text.splitlines()) if k in names}


def serves(cluster: ServiceProcess) -> bool:
    """A fresh small request succeeds."""
    try:
        with Client(cluster.info["grpc"], timeout=scaled(10)) as client:
            return len(client.generate("x = 1", max_tokens=4, temperature=0, ignore_eos=True).token_ids) == 4
    except ClientError:
        return False


def leftovers(cluster: ServiceProcess, among: set[str] | None = None) -> list[str]:
    """What the workers (those at the addresses `among`, if given) still hold (GetLoad), by worker; empty when
    every pool is back to its free counts. A worker that does not answer (killed, restarting) is listed too."""
    found = []
    for role, names in WORKERS.items():
        for worker in names:
            address = current(cluster, worker)["address"]
            if among is not None and address not in among:
                continue
            try:
                holds = what_is_held(load_of(WorkerAt(role, address)))
            except grpc.RpcError as e:
                holds = f"no answer to GetLoad ({e.code()})"
            if holds:
                found.append(f"{worker}: {holds}")
    return found


def ready_for_a_case(cluster: ServiceProcess, admin: dict) -> bool:
    """Every worker healthy in the router's view and holding nothing itself."""
    return all_healthy(cluster, admin) and not leftovers(cluster)


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
@dataclass(frozen=True)
class Hit:
    """The service a fault hit: its name, its run before the fault (`{"pid", "address"}`) and its restarts then; a
    worker's unanswered legs on the router's books when it was hit, and whether the router had marked a stopped one
    down by the end of the hold (it answers no health check while stopped, so it was marked down during it)."""

    name: str
    before: dict
    restarts: int
    legs: int = 0
    marked_down: bool = False


def freeze_busy(cluster: ServiceProcess, admin: dict, kind: str, until: float) -> tuple[str, int]:
    """SIGSTOP a worker of `kind` that holds an unanswered leg on the router's books; its name (it stays stopped) and
    how many legs it holds.
    The worker is stopped before its legs are read again, for `SETTLE_S`: a stopped worker answers nothing, so the
    count can only fall by an answer sent before the stop, and that is on the books within `SETTLE_S`. What is read
    then is what the fault hits. Fails the test when no worker of the kind held a leg before `until`: the fault
    would have hit an idle worker, and proven nothing."""
    while time.monotonic() < until:
        books = legs_held(cluster, admin, kind)
        name = max(books, key=lambda n: books[n])
        if books[name] > 0:
            pid = current(cluster, name)["pid"]
            os.kill(pid, signal.SIGSTOP)
            settled = time.monotonic() + SETTLE_S
            while (held := legs_held(cluster, admin, kind)[name]) and time.monotonic() < settled:
                time.sleep(0.01)  # the polling interval
            if held:
                return name, held
            os.kill(pid, signal.SIGCONT)  # it answered just before: another moment
        time.sleep(0.005)  # the polling interval, not a synchronisation
    raise AssertionError(f"no {kind} worker held a leg of a request while the load ran: the fault would hit an idle "
                         "worker")


def hit(cluster: ServiceProcess, admin: dict, fault: Fault, until: float) -> Hit:
    """Stop the fault's victim (the router, or a busy worker of the kind), then kill it, or resume it after the
    hold."""
    legs = 0
    if fault.kind == "router":
        name = "router"
        os.kill(current(cluster, name)["pid"], signal.SIGSTOP)
    else:
        name, legs = freeze_busy(cluster, admin, fault.kind, until)
    before = current(cluster, name)
    pid = before["pid"]
    if fault.signal == "SIGKILL":
        os.kill(pid, signal.SIGKILL)
        return Hit(name, before, restarts(cluster, name), legs)
    try:
        time.sleep(fault.hold_s)  # the fault itself: the process stays stopped this long
        marked_down = fault.kind != "router" and not any(
            w["healthy"] for w in workers(cluster, admin) or [] if w["address"] == before["address"])
    finally:
        os.kill(pid, signal.SIGCONT)
    return Hit(name, before, restarts(cluster, name), legs, marked_down)


def recover(cluster: ServiceProcess, admin: dict, fault: Fault, victim: Hit) -> None:
    """Supervision: a killed service is restarted at its address (a new pid), a stopped one is the same process
    (nothing restarted); then every worker is healthy in /workers and a fresh request is served."""
    name = victim.name
    if fault.signal == "SIGKILL":
        wait_until(lambda: restarts(cluster, name) > victim.restarts, RESTART_WITHIN_S, f"the launcher restarts {name}")
        after = current(cluster, name)
        assert after["address"] == victim.before["address"] and after["pid"] != victim.before["pid"], after
    else:
        assert restarts(cluster, name) == victim.restarts and current(cluster, name) == victim.before
    wait_until(lambda: all_healthy(cluster, admin), HEALTHY_WITHIN_S, "every worker healthy in /workers")
    wait_until(lambda: serves(cluster), HEALTHY_WITHIN_S, "a fresh request served")


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


@pytest.fixture(scope="module")
def offline(offline_reference, draft_ckpt) -> dict[tuple[int, bool], tuple[list[int], str]]:
    """(prompt, seeded) -> the uninterrupted output: one engine, no P/D, DSpark off (the equality ladder's bottom)."""
    keys = [(p, seeded) for p in range(len(PROMPTS)) for seeded in (False, True)]
    params = [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **Req("sdk", True, s, p).sampling())
              for p, s in keys]
    refs = offline_reference.outputs(draft_ckpt, [PROMPTS[p] for p, _ in keys], params)
    return {k: (r.token_ids, r.text) for k, r in zip(keys, refs)}


@pytest.mark.kills
@pytest.mark.parametrize("sig", ["SIGKILL", "SIGSTOP"])
@pytest.mark.parametrize("kind", ["decode", "prefill", "router"])
@settings(max_examples=EXAMPLES, deadline=None, print_blob=True, report_multiple_bugs=False,
          phases=(Phase.explicit, Phase.reuse, Phase.generate))
@given(data=st.data())
def test_cluster_rides_through_a_fault(faults, admin_headers, offline, kind, sig, data):
    load = data.draw(loads(), label="load")
    fault = data.draw(fault_cases(kind, sig), label="fault")
    # Hypothesis tries the simplest example first: with one example per case, every run would be that one.
    assume(not (all(r.prompt == 0 for r in load) and fault.trigger == 0 and fault.after_tokens <= 1))
    chaos_example(faults, admin_headers, offline, load, fault)


def chaos_example(cluster: ServiceProcess, admin: dict, offline: dict, load: list[Req], fault: Fault) -> None:
    wait_until(lambda: ready_for_a_case(cluster, admin), FREE_WITHIN_S,
               "every worker healthy and holding nothing before the example", describe=lambda: str(leftovers(cluster)))
    counted = counters(cluster)
    trigger = Event()
    futures = run_load(cluster, load, fault, trigger)
    until = time.monotonic() + LOAD_DEADLINE_S
    try:
        if fault.kind != "prefill":
            assert trigger.wait(LOAD_DEADLINE_S), "the trigger stream neither reached its token count nor ended"
        victim = hit(cluster, admin, fault, until)
        signalled = time.monotonic()
    finally:
        done, hung = wait(futures, timeout=LOAD_DEADLINE_S)
    assert not hung, f"{len(hung)} request(s) did not end within {LOAD_DEADLINE_S:.0f}s"
    outcomes = [f.result() for f in futures]
    recover(cluster, admin, fault, victim)
    recovery_s = time.monotonic() - signalled
    found = [f"{o.req}: {p}" for o in outcomes for p in problems(o, fault, offline[(o.req.prompt, o.req.seeded)])]
    cost: dict[str, float] = {}
    if fault.kind != "router":  # (a restarted router counts from 0 again)
        after = counters(cluster)
        cost = {k: after[k] - counted[k] for k in sorted(after)}
        # Each leg the victim held ends its request's attempt: a retry before the first token, a migration after.
        # A killed worker's at once; a stopped decode worker's when the router marks it down. (Not a stopped
        # prefill worker's: a leg whose transfer it handed over just before the stop streams on, and is answered
        # once the worker resumes.) More is possible (a request sent to the killed worker before it was marked
        # down), fewer is not.
        ended = fault.signal == "SIGKILL" or (fault.kind == "decode" and victim.marked_down)
        if ended and sum(cost.values()) < victim.legs:
            found.append(f"{victim.name} was {'killed' if fault.signal == 'SIGKILL' else 'marked down'} holding "
                         f"{victim.legs} leg(s), yet the router counted {cost}")
    failed = sum(not o.completed for o in outcomes)
    print(f"\n{fault.signal} {victim.name}" + (f" held {fault.hold_s:.0f}s" if fault.signal == "SIGSTOP" else "")
          + (f" holding {victim.legs} leg(s)" if fault.kind != "router" else "")
          + (" (marked down)" if victim.marked_down else "") + (f", cost {cost}" if cost else "")
          + f"; recovered {recovery_s:.1f}s after the signal; {len(outcomes) - failed} requests completed, "
          f"{failed} failed; slowest {max(o.seconds for o in outcomes):.1f}s")
    assert not found, f"{len(found)} problem(s):\n  " + "\n  ".join(found)
    wait_until(lambda: not leftovers(cluster), FREE_WITHIN_S, "every worker's pools back to their free counts",
               describe=lambda: str(leftovers(cluster)))


# ---- the cases that always run: one stream, its decode worker killed at a chosen token -----------------------------
STREAM_PROMPT = "def fibonacci(n):"
STREAM_TOKENS = 96
SAMPLINGS = {"greedy": dict(temperature=0.0), "seeded": dict(temperature=0.9, top_p=0.95, seed=1234)}


@pytest.fixture(scope="module")
def offline_stream(offline_reference, draft_ckpt) -> dict[str, tuple[list[int], str]]:
    """Sampling id -> the uninterrupted output of `STREAM_PROMPT` (DSpark and plain give the same tokens)."""
    refs = offline_reference.outputs(draft_ckpt, [STREAM_PROMPT] * len(SAMPLINGS), [
        SamplingParams(max_tokens=STREAM_TOKENS, ignore_eos=True, **sampling) for sampling in SAMPLINGS.values()])
    return {name: (r.token_ids, r.text) for name, r in zip(SAMPLINGS, refs)}


def ready_for_a_stream(cluster: ServiceProcess, admin: dict) -> bool:
    """Both prefill workers and at least two decode workers healthy (one to kill, one to migrate to), and no
    worker holding anything. A decode worker killed by the case before may still be restarting meanwhile."""
    ws = workers(cluster, admin)
    if ws is None:
        return False
    healthy = {w["address"] for w in ws if w["healthy"]}
    decodes = [current(cluster, n)["address"] in healthy for n in WORKERS["decode"]]
    prefills = [current(cluster, n)["address"] in healthy for n in WORKERS["prefill"]]
    return all(prefills) and sum(decodes) >= 2 and not leftovers(cluster, among=healthy)


def kill_busy_decode(cluster: ServiceProcess, admin: dict) -> str:
    """SIGKILL the decode worker that holds the (one) stream in flight; its name."""
    name, _ = freeze_busy(cluster, admin, "decode", time.monotonic() + scaled(10))
    os.kill(current(cluster, name)["pid"], signal.SIGKILL)
    return name


def openai_stream(cluster: ServiceProcess, admin: dict, sampling: dict, kill_after: int) -> tuple[str, str | None]:
    client = openai.OpenAI(base_url=cluster.info["http"] + "/v1", api_key="none", max_retries=0,
                           timeout=scaled(120))
    extra = {"ignore_eos": True, **({"seed": sampling["seed"]} if "seed" in sampling else {})}
    kw = {k: v for k, v in sampling.items() if k != "seed"}
    pieces, finish, received = [], None, 0
    for chunk in client.completions.create(model=cluster.info["model"], prompt=STREAM_PROMPT,
                                           max_tokens=STREAM_TOKENS, stream=True, extra_body=extra, **kw):
        if not chunk.choices:
            continue
        pieces.append(chunk.choices[0].text)
        finish = chunk.choices[0].finish_reason or finish
        received += 1
        if received == kill_after:
            kill_busy_decode(cluster, admin)
    return "".join(pieces), finish


def sdk_stream(cluster: ServiceProcess, admin: dict, sampling: dict, kill_after: int) -> tuple[list[int], str]:
    token_ids, text = [], []
    with Client(cluster.info["grpc"], timeout=scaled(120)) as client:
        for chunk in client.stream(STREAM_PROMPT, max_tokens=STREAM_TOKENS, ignore_eos=True, **sampling):
            before = len(token_ids)
            token_ids += chunk.token_ids
            text.append(chunk.text)
            if before < kill_after <= len(token_ids):
                kill_busy_decode(cluster, admin)
    return token_ids, "".join(text)


@pytest.mark.kills
@pytest.mark.parametrize("sampling_id", list(SAMPLINGS))
@pytest.mark.parametrize("kill_after", [1, 24], ids=["after-first-token", "mid-stream"])
@pytest.mark.parametrize("api", ["openai-sse", "grpc-sdk"])
def test_a_stream_whose_decode_worker_is_killed_migrates_once_and_equals_offline(
        faults, admin_headers, offline_stream, api, sampling_id, kill_after):
    sampling = SAMPLINGS[sampling_id]
    wait_until(lambda: ready_for_a_stream(faults, admin_headers), RESTART_WITHIN_S,
               "two decode workers healthy and every healthy worker idle before the case")
    before = counters(faults)
    want_ids, want_text = offline_stream[sampling_id]
    if api == "openai-sse":
        text, finish = openai_stream(faults, admin_headers, sampling, kill_after)
        assert finish == "length"
    else:
        ids, text = sdk_stream(faults, admin_headers, sampling, kill_after)
        assert ids == want_ids
    assert text == want_text
    assert counters(faults) == {**before, "migrations": before["migrations"] + 1}
