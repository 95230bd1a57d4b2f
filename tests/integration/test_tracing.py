"""Tracing: a request's spans across router, prefill, transfer and decode, linked by the W3C trace context the
services send each other in gRPC metadata, checked with the SDK's in-memory exporter; with no endpoint, nothing
of OpenTelemetry is even imported and calls carry no trace context."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import aiohttp
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from pdspark.errors import ErrorCode, RequestFailed
from pdspark.rpc import tracing
from router_harness import RouterHarness, until
from worker_stubs import HOLD

BODY = {"prompt": [5, 6, 7], "max_tokens": 4}


def run(coro, timeout_s: float = 60):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


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


async def complete(h: RouterHarness, body=BODY) -> dict:
    async with aiohttp.ClientSession() as s, s.post(h.http_url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json()


def test_router_spans_and_the_context_the_workers_receive(spans):
    async def scenario():
        async with await RouterHarness.start() as h:
            reply = await complete(h)
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

    run(scenario())


def test_a_retry_and_a_migration_are_events_of_the_request(spans):
    async def scenario():
        async with await RouterHarness.start(prefills=2, decodes=2) as h:
            h.prefill[0].script = [RequestFailed(ErrorCode.UNAVAILABLE, "stub prefill down")]
            h.decode[0].script = [HOLD]  # until the failed prefill leg ends the attempt
            await complete(h)
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
            await complete(h, {**BODY, "max_tokens": 4})
            await until(lambda: named(spans, "request"), 5, "the request span")
            request = one(spans, "request")
            assert request.attributes is not None and request.attributes["pdspark.migrations"] == 1
            (migration,) = [e for e in request.events if e.name == "migration"]
            assert migration.attributes == {"pdspark.from_decode_worker": "decode-2", "pdspark.generated_tokens": 1,
                                            "pdspark.reason": "unavailable"}
            second = max(named(spans, "attempt"), key=lambda s: s.attributes["pdspark.attempt"])
            assert second.attributes["pdspark.decode_worker"] == "decode-3"
            assert second.attributes["pdspark.generated_tokens"] == 1

    run(scenario())


def test_calls_carry_no_trace_context_while_tracing_is_off():
    async def scenario():
        async with await RouterHarness.start() as h:
            await complete(h)
            assert h.prefill[0].calls[0].traceparent == "" and h.decode[0].calls[0].traceparent == ""

    assert not tracing.enabled()
    run(scenario())


def test_off_without_an_endpoint_nothing_of_opentelemetry_is_loaded():
    """No `--otlp-endpoint`: no SDK provider (nothing of OpenTelemetry imported at all), spans are the no-op one."""
    code = """
import sys
from pdspark.rpc import tracing
import pdspark.router.router_server, pdspark.serving.grpc_services, pdspark.serving.prefill_worker
assert tracing.configure(None, "pdspark-router") is False and tracing.configure("", "pdspark-router") is False
span = tracing.start("request", attributes={"pdspark.request_id": "r"})
assert span is tracing.NO_SPAN and not span.is_recording() and tracing.metadata_of(span) is None
assert tracing.parent_of((("traceparent", "00-" + "1" * 32 + "-" + "2" * 16 + "-01"),)) is None
with tracing.calls_under(span):
    assert tracing.outgoing_metadata() is None
tracing.finish(span, "error")
loaded = sorted(m for m in sys.modules if m.startswith("opentelemetry"))
assert not loaded, loaded
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
assert not isinstance(trace.get_tracer_provider(), TracerProvider)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
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
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
