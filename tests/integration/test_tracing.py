"""Tracing: a request's spans across router, prefill, transfer and decode, linked by the W3C trace context the
services send each other in gRPC metadata, checked with the SDK's in-memory exporter; with no endpoint, nothing
of OpenTelemetry is even imported and calls carry no trace context."""

from __future__ import annotations

import subprocess
import sys

import aiohttp
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from otlp_collector import OtlpCollector
from pdspark.errors import ErrorCode, RequestFailed
from pdspark.rpc import tracing
from pdspark.testing.time_scale import scaled
from pdspark.testing.waiting import run_within, until
from pdspark.testing.worker_stubs import OK, Delayed
from router_harness import RouterHarness, completion

BODY = {"prompt": [5, 6, 7], "max_tokens": 4}


@pytest.fixture
def spans():
    """Tracing on, into memory, for one test."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(provider)
    yield exporter
    tracing.install(None)
    provider.shutdown()


def named(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name == name]


def one(exporter: InMemorySpanExporter, name: str) -> ReadableSpan:
    found = named(exporter, name)
    assert len(found) == 1, (name, [s.name for s in exporter.get_finished_spans()])
    return found[0]


def child_of(span: ReadableSpan, parent: ReadableSpan) -> bool:
    assert span.parent is not None and span.context is not None and parent.context is not None
    return span.context.trace_id == parent.context.trace_id and span.parent.span_id == parent.context.span_id


def carries(traceparent: str, span: ReadableSpan) -> bool:
    """A call's `traceparent` header names `span` as the parent of the callee's spans."""
    assert span.context is not None
    version, trace_id, parent_id, _flags = traceparent.split("-")
    return (version, int(trace_id, 16), int(parent_id, 16)) == ("00", span.context.trace_id, span.context.span_id)


def test_router_spans_and_the_context_the_workers_receive(spans):
    async def scenario():
        async with await RouterHarness.start() as h:
            reply = await completion(h)
            await until(lambda: named(spans, "request"), 5, "the request span")
            request, attempt = one(spans, "request"), one(spans, "attempt")
            assert request.parent is None and child_of(attempt, request)
            assert request.attributes is not None and attempt.attributes is not None
            assert dict(request.attributes) == {
                "pdspark.request_id": request.attributes["pdspark.request_id"], "pdspark.api": "completions",
                "pdspark.prompt_tokens": 3, "pdspark.completion_tokens": 4, "pdspark.cached_tokens": 0,
                "pdspark.finish_reason": "length", "pdspark.outcome": "ok", "pdspark.migrations": 0,
                "pdspark.retries": 0}
            assert reply["usage"]["completion_tokens"] == 4
            # Workers by name, never by address.
            assert attempt.attributes["pdspark.prefill_worker"] == "prefill-0"
            assert attempt.attributes["pdspark.decode_worker"] == "decode-1"
            assert attempt.attributes["pdspark.worker_request_id"] == request.attributes["pdspark.request_id"]
            assert request.status.status_code is StatusCode.UNSET and attempt.status.status_code is StatusCode.UNSET
            # Both legs carry the attempt's context: the workers' spans become its children.
            assert carries(h.prefill[0].calls[0].traceparent, attempt)
            assert carries(h.decode[0].calls[0].traceparent, attempt)
            assert [e.name for e in request.events] == ["admitted"]

    run_within(scenario())


def test_a_retry_and_a_migration_are_events_of_the_request(spans):
    async def scenario():
        async with await RouterHarness.start(prefills=2, decodes=2) as h:
            h.prefill[0].script = [RequestFailed(ErrorCode.UNAVAILABLE, "stub prefill down")]
            # Long enough for the failed prefill leg to end the attempt (a call cancelled before it arrived leaves
            # the delay to the next one, which then only waits).
            h.decode[0].script = [Delayed(1.0, OK)]
            await completion(h)
            await until(lambda: named(spans, "request"), 5, "the request span")
            request = one(spans, "request")
            assert request.attributes is not None
            assert request.attributes["pdspark.retries"] == 1 and request.attributes["pdspark.migrations"] == 0
            (retry,) = [e for e in request.events if e.name == "retry"]
            assert retry.attributes == {"pdspark.avoid": "prefill-0", "pdspark.reason": "unavailable"}
            failed, served = sorted(named(spans, "attempt"), key=lambda s: s.attributes["pdspark.attempt"])
            assert failed.status.status_code is StatusCode.ERROR and "stub prefill down" in failed.status.description
            assert served.status.status_code is StatusCode.UNSET
            assert served.attributes["pdspark.prefill_worker"] == "prefill-1"
            assert all(child_of(a, request) for a in (failed, served))

            spans.clear()
            h.decode[0].breaks = [1]  # the stream breaks after its first token: migrated to decode-3
            await completion(h, {**BODY, "max_tokens": 4})
            await until(lambda: named(spans, "request"), 5, "the request span")
            request = one(spans, "request")
            assert request.attributes is not None and request.attributes["pdspark.migrations"] == 1
            (migration,) = [e for e in request.events if e.name == "migration"]
            assert migration.attributes == {"pdspark.from_decode_worker": "decode-2", "pdspark.generated_tokens": 1,
                                            "pdspark.reason": "unavailable"}
            second = max(named(spans, "attempt"), key=lambda s: s.attributes["pdspark.attempt"])
            assert second.attributes["pdspark.decode_worker"] == "decode-3"
            assert second.attributes["pdspark.generated_tokens"] == 1

    run_within(scenario())


def test_calls_carry_no_trace_context_while_tracing_is_off():
    async def scenario():
        async with await RouterHarness.start() as h:
            await completion(h)
            await until(lambda: h.prefill[0].calls, 5, "the prefill call")  # it can trail the last token
            assert h.prefill[0].calls[0].traceparent == "" and h.decode[0].calls[0].traceparent == ""

    assert not tracing.enabled()
    run_within(scenario())


def test_off_without_an_endpoint_nothing_of_opentelemetry_is_loaded():
    """No `--otlp-endpoint`: no SDK provider (nothing of OpenTelemetry imported at all), spans are the no-op one."""
    code = """
import sys
from pdspark.rpc import tracing
import pdspark.router.router_server, pdspark.serving.grpc_services, pdspark.serving.prefill_worker
assert tracing.configure(None, "pdspark-router") is False and tracing.configure("", "pdspark-router") is False
span = tracing.start("request", attributes={"pdspark.request_id": "r"})
assert span is tracing.NO_SPAN and not span.is_recording() and tracing.metadata_of(span) is None
assert tracing.parent_of(None) is None  # not even read
with tracing.calls_under(span):
    assert tracing.outgoing_metadata() is None
tracing.finish(span, "error")
loaded = sorted(m for m in sys.modules if m.startswith("opentelemetry"))
assert not loaded, loaded
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
assert not isinstance(trace.get_tracer_provider(), TracerProvider)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=scaled(120))
    assert out.returncode == 0, out.stderr[-3000:]


def test_an_endpoint_installs_the_sdk_provider_with_the_service_name():
    code = """
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from pdspark.rpc import tracing
assert tracing.configure("http://127.0.0.1:1", "pdspark-decode")
provider = trace.get_tracer_provider()
assert isinstance(provider, TracerProvider), provider
assert provider.resource.attributes["service.name"] == "pdspark-decode"
span = tracing.start("decode")
assert span.is_recording()
(key, value), = [kv for kv in tracing.metadata_of(span) if kv[0] == "traceparent"]
assert value.split("-")[2] == format(span.get_span_context().span_id, "016x")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=scaled(120))
    assert out.returncode == 0, out.stderr[-3000:]


OPTS = dict(model="dsv4-tiny", transfer_backend="inprocess", metrics_port=None, page_size=16, max_model_len=256,
            max_num_seqs=4, speculative="dspark")


@pytest.mark.parametrize("worker_calls", ["per-request", "multiplexed"])
def test_one_trace_across_router_prefill_transfer_and_decode(spans, worker_calls):
    """Real prefill and decode workers (gRPC servers, engines, in-process transfer) behind the router's core, all in
    this process: one trace, each span the child of the one that called it, across the three services, whether the
    router's calls to the workers are gRPC calls of their own or multiplexed on a stream per worker."""
    from pdspark.assets import resolve_model
    from pdspark.config import RouterConfig, WorkerConfig
    from pdspark.options import build
    from pdspark.router.dispatcher import Dispatcher
    from pdspark.router.router_core import RouterCore, Totals
    from pdspark.router.router_metrics import RouterMetrics
    from pdspark.router.workers.worker_registry import WorkerRegistry
    from pdspark.serving.worker_server import WorkerServer
    from pdspark.types import SamplingParams
    from router_harness import LowestAddress

    prefill = WorkerServer(build(WorkerConfig, OPTS, fixed={"role": "prefill"}))
    decode = WorkerServer(build(WorkerConfig, {**OPTS, "enable_prefix_cache": False}, fixed={"role": "decode"}))
    prompt = list(range(5, 45))

    async def scenario():
        registry = WorkerRegistry(multiplexed=worker_calls == "multiplexed")
        for server in (prefill, decode):
            registry.add(server.cfg.role, (await server.start())["address"])
        metrics = RouterMetrics()
        core = RouterCore(resolve_model("dsv4-tiny"), "tiny", 256, registry,
                          Dispatcher(registry, LowestAddress(), LowestAddress(), metrics=metrics), metrics,
                          RouterConfig())
        try:
            rid, totals = core.new_request_id(), Totals(prompt_tokens=len(prompt))
            params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
            tokens = [t async for chunk in core.run("generate", rid, prompt, params, totals) for t in chunk.token_ids]
            assert len(tokens) == 12
            names = {"request", "attempt", "prefill", "transfer", "decode", "submit_plan"}
            await until(lambda: {s.name for s in spans.get_finished_spans()} >= names, 10, "every span")
            return rid
        finally:
            for w in registry.workers.values():
                if w.channel is not None:
                    await w.channel.close()
            for server in (prefill, decode):
                await server.stop(0.5)

    rid = run_within(scenario(), 120)
    request, attempt = one(spans, "request"), one(spans, "attempt")
    prefill_span, transfer, decode_span, plan = (one(spans, n) for n in ("prefill", "transfer", "decode",
                                                                         "submit_plan"))
    # The tree: request -> attempt -> {prefill -> transfer, decode -> submit_plan}.
    assert request.parent is None
    assert child_of(attempt, request)
    assert child_of(prefill_span, attempt) and child_of(transfer, prefill_span)
    assert child_of(decode_span, attempt) and child_of(plan, decode_span)
    assert all(s.status.status_code is StatusCode.UNSET for s in spans.get_finished_spans())
    r, p, t, d = (dict(s.attributes or {}) for s in (request, prefill_span, transfer, decode_span))
    assert r["pdspark.request_id"] == rid and r["pdspark.prompt_tokens"] == 40
    assert r["pdspark.completion_tokens"] == 12 and r["pdspark.finish_reason"] == "length"
    assert p["pdspark.request_id"] == rid and p["pdspark.prompt_tokens"] == 40
    assert p["pdspark.cached_tokens"] == 0 and p["pdspark.prefill_seconds"] > 0
    assert t["pdspark.transfer.bytes"] > 0 and t["pdspark.transfer.writes"] > 0 and t["pdspark.transfer.seconds"] >= 0
    assert d["pdspark.request_id"] == rid and d["pdspark.completion_tokens"] == 12
    # DSpark: the decode worker verified drafts; each verify step commits 1 to 1 + (draft tokens) tokens.
    gamma = decode.loop.engine.scheduler.num_drafts
    assert d["pdspark.spec.verify_steps"] > 0 and d["pdspark.spec.accepted_tokens"] >= 0
    assert 1.0 <= d["pdspark.spec.acceptance_length"] <= 1 + gamma
    assert plan.attributes is not None and plan.attributes["pdspark.transfer_id"] == t["pdspark.transfer_id"]


def test_spans_reach_an_otlp_collector():
    """`configure` exports over OTLP/gRPC: a collector (this test's) receives the span, with the service's name."""
    code = """
from opentelemetry import trace
from pdspark.rpc import tracing
import sys
assert tracing.configure(sys.argv[1], "pdspark-prefill")
tracing.finish(tracing.start("prefill", attributes={"pdspark.request_id": "r-1", "pdspark.prompt_tokens": 7}))
assert trace.get_tracer_provider().force_flush(10_000)
"""
    with OtlpCollector() as collector:
        out = subprocess.run([sys.executable, "-c", code, collector.endpoint], capture_output=True, text=True,
                             timeout=scaled(120))
        assert out.returncode == 0, out.stderr[-3000:]
        (span,) = collector.spans
    assert (span.service, span.name, span.parent_span_id) == ("pdspark-prefill", "prefill", "")
    assert span.attributes == {"pdspark.request_id": "r-1", "pdspark.prompt_tokens": 7}


def test_a_clients_traceparent_makes_the_request_span_its_child(spans):
    """A client tracing its own work sends W3C `traceparent`: the router's request span continues that trace (its
    parent is the client's span). (The gRPC API reads the same context from the call's metadata.)"""
    trace_id, parent_id = 0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331
    header = f"00-{trace_id:032x}-{parent_id:016x}-01"

    async def scenario():
        async with await RouterHarness.start() as h, aiohttp.ClientSession() as s:
            async with s.post(h.http_url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2},
                              headers={"traceparent": header}) as r:
                assert r.status == 200, await r.text()
            await until(lambda: named(spans, "request"), 5, "the request span")
            request = one(spans, "request")
            assert request.context is not None and request.parent is not None
            assert (request.context.trace_id, request.parent.span_id) == (trace_id, parent_id)

    run_within(scenario())
