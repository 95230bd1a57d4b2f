"""OpenTelemetry tracing of a request across the services: router -> prefill -> transfer -> decode.

Off unless a service is started with `--otlp-endpoint`: then `configure` installs the SDK's `TracerProvider`
exporting over OTLP/gRPC, and `start` makes real spans. Off, nothing of OpenTelemetry is even imported: `start`
returns `NO_SPAN` (whose methods do nothing), `metadata_of` returns None (calls go out as before) and `parent_of`
reads nothing; a request pays some 17 µs for the no-op calls, router and workers together.

Spans (their attributes in docs/operations.md, "Tracing"):

    request (router)                       one per client request; migration and retry events
      attempt (router)                     one per (prefill, decode) pair tried
        prefill (prefill worker)           the Prefill call: prompt computed, its cache written
          transfer (prefill worker)        the writes into the decode worker's memory
        decode (decode worker)             the Generate stream
          submit_plan (prefill worker)     the decode worker's SubmitPlan call

Context crosses a process in gRPC metadata, as W3C trace context (`traceparent`, `tracestate`): the router sends
its attempt's on Prefill and Generate; a decode worker sends its decode span's on SubmitPlan. A client's own context
(HTTP headers, or the gRPC API's metadata) is the parent of the router's request span. Parents are passed
explicitly (`start(..., parent=)`), never made current with `context.attach`: a span that outlives a `yield` of an
async generator would be detached in another context. The one implicit link is `calls_under`: a servicer names
the span that the outgoing calls of its task (and the tasks it starts) belong to.

NOTE: one tracer per process, kept here: the OpenTelemetry API sets its global provider once per process, and
tests install an in-memory exporter (`install`) without touching it.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

# W3C trace context headers: lower case, as gRPC metadata keys must be.
_HEADERS = ("traceparent", "tracestate")
TRACER_NAME = "pdspark"

Attributes = Mapping[str, str | bool | int | float]


class Span(Protocol):
    """What pdspark calls on a span: an OpenTelemetry SDK span, or `NO_SPAN`."""

    def set_attribute(self, key: str, value: Any) -> Any: ...

    def add_event(self, name: str, attributes: Any = None, timestamp: int | None = None) -> Any: ...

    def end(self, end_time: int | None = None) -> Any: ...

    def is_recording(self) -> bool: ...


class _NoSpan:
    """The span of a service that does not trace: every call does nothing."""

    def set_attribute(self, key: str, value: Any) -> None:
        pass

    def add_event(self, name: str, attributes: Any = None, timestamp: int | None = None) -> None:
        pass

    def end(self, end_time: int | None = None) -> None:
        pass

    def is_recording(self) -> bool:
        return False


NO_SPAN: Span = _NoSpan()
_tracer: Any = None  # the SDK tracer while tracing is on
_calls_under: contextvars.ContextVar[Span] = contextvars.ContextVar("pdspark_calls_under", default=NO_SPAN)


def configure(endpoint: str | None, service_name: str) -> bool:
    """Export spans over OTLP/gRPC to `endpoint` (e.g. `http://collector:4317`); None or "": tracing stays off and
    nothing is imported. Call once, at a service's start. Returns whether tracing is on.

    Args:
        endpoint: the OTLP collector's gRPC address; `https://` for TLS, else plain text.
        service_name: the resource's `service.name` (`pdspark-router`, `pdspark-prefill`, `pdspark-decode`).
    """
    if not endpoint:
        return False
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    # Spans leave in batches on the processor's own thread; at exit the provider flushes what is left.
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint,
                                                                    insecure=not endpoint.startswith("https://"))))
    trace.set_tracer_provider(provider)
    install(provider)
    return True


def install(provider: Any) -> None:
    """Trace into `provider` (an SDK `TracerProvider`); None: stop tracing. `configure` calls it; tests call it with
    a provider of their own (an in-memory exporter) and None after."""
    global _tracer
    _tracer = provider.get_tracer(TRACER_NAME) if provider is not None else None


def enabled() -> bool:
    return _tracer is not None


def start(name: str, parent: Any = None, attributes: Attributes | None = None) -> Span:
    """A started span (end it with `end`, or `finish`): a child of `parent` (a span of this process, or the
    context `parent_of` read from a call), a root without one. `NO_SPAN` while tracing is off."""
    if _tracer is None:
        return NO_SPAN
    from opentelemetry import trace

    if isinstance(parent, _NoSpan):
        parent = None
    elif hasattr(parent, "get_span_context"):
        parent = trace.set_span_in_context(parent)  # a span of this process: its context
    return _tracer.start_span(name, context=parent, attributes=attributes)


def finish(span: Span, error: str | None = None, attributes: Attributes | None = None) -> None:
    """Set `attributes`, mark the span failed with `error` (when given) and end it."""
    if not span.is_recording():
        return
    for key, value in (attributes or {}).items():
        span.set_attribute(key, value)
    if error is not None:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, error))  # type: ignore[attr-defined]
    span.end()


def metadata_of(span: Span) -> tuple[tuple[str, str], ...] | None:
    """The gRPC metadata that makes a call's spans children of `span` (W3C trace context); None when it does not
    record (tracing off)."""
    if not span.is_recording():
        return None
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, context=trace.set_span_in_context(span))  # type: ignore[arg-type]
    return tuple(carrier.items())


def parent_of_headers(headers: Mapping[str, str]) -> Any:
    """The W3C trace context a client sent in its HTTP headers (`traceparent`, `tracestate`), for `start(parent=)`:
    the router's request span then continues the client's trace. None when tracing is off or none was sent."""
    if _tracer is None:
        return None
    carrier = {k: headers[k] for k in _HEADERS if k in headers}
    if "traceparent" not in carrier:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract(carrier)


def parent_of(call: Any) -> Any:
    """The trace context a call carried in its metadata (for `start(parent=)`), read from the servicer's context
    of the call; None when tracing is off (the metadata is not even read) or the caller sent none."""
    if _tracer is None:
        return None
    metadata: Sequence[tuple[str, str | bytes]] = call.invocation_metadata() or ()
    carrier = {k: v for k, v in metadata if k in _HEADERS and isinstance(v, str)}
    if "traceparent" not in carrier:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract(carrier)


class calls_under:  # noqa: N801 (a context manager, named as the function it reads as)
    """The gRPC calls made meanwhile by this task (and the tasks it starts) carry `span`'s context
    (`outgoing_metadata`). A servicer wraps a handler's work in it, with `with` or beside other async context
    managers in an `async with`; a no-op while tracing is off."""

    def __init__(self, span: Span):
        self.span = span
        self._token: contextvars.Token[Span] | None = None

    def __enter__(self) -> None:
        if self.span.is_recording():
            self._token = _calls_under.set(self.span)

    def __exit__(self, *exc: object) -> None:
        if self._token is not None:
            with contextlib.suppress(ValueError):  # reset from another context (a generator closed elsewhere)
                _calls_under.reset(self._token)
            self._token = None

    async def __aenter__(self) -> None:
        self.__enter__()

    async def __aexit__(self, *exc: object) -> None:
        self.__exit__(*exc)


def outgoing_metadata() -> tuple[tuple[str, str], ...] | None:
    """The metadata of a call made under `calls_under` (None outside one, or while tracing is off)."""
    return metadata_of(_calls_under.get())
