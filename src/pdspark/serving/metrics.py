"""`WorkerMetrics`: what every worker exports, whatever its role; `PrefillMetrics` and `DecodeMetrics` add their
role's part. Each worker has its own registry, served on its metrics port.

Rules (the metrics catalogue in docs/operations.md lists every metric; `tests/unit/test_metrics_catalogue.py` keeps
the two equal): `pdspark_` prefix, the unit last in the name (`_seconds`, `_bytes`, `_tokens`, `_pages`,
`_requests`), counters end in `_total`, no colons, and every label value a series can take is created at start, so
that each series exists (at zero) before its first event and `rate()` sees that event.

Threads: the engine's statistics are taken on the engine-loop thread (`sample_engine` as a ticker, `EngineMetrics`
as the loop's step observer); the workers count on the asyncio thread; the metrics server reads on its own.
prometheus_client's metrics are thread-safe.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge

from pdspark.errors import ErrorCode
from pdspark.serving.engine_metrics import EngineMetrics
from pdspark.serving.pool_metrics import PoolMetrics

if TYPE_CHECKING:
    from pdspark.engine.engine import Engine
    from pdspark.serving.engine_load import EngineLoad

# What a worker can fail a request with (the router's key checks never reach a worker).
WORKER_FAILURES = tuple(c.value for c in ErrorCode if c not in (ErrorCode.UNAUTHENTICATED,
                                                                 ErrorCode.PERMISSION_DENIED))
OUTCOMES = ("ok", "cancelled", "error", *WORKER_FAILURES)  # error: an unexpected exception (a bug)


class WorkerMetrics:
    def __init__(self, role: str, registry: CollectorRegistry | None = None):
        self.registry = r = registry or CollectorRegistry()
        self.role = role
        self.requests = Counter(
            "pdspark_worker_requests_total", "Requests this worker ended (prefill: Prefill calls; decode: Generate "
            "streams), by outcome: ok, cancelled (the caller went away before the end), the failure's error code, or "
            "error (an unexpected exception)", ["outcome"],
            registry=r)
        self.refused = Counter(
            "pdspark_worker_rejected_requests_total", "Requests refused at once (overloaded) because the worker's "
            "queue was full (backpressure)", registry=r)
        self.transfers_in_flight = Gauge(
            "pdspark_worker_transfers_in_flight", "Cache transfers in flight (prefill: rendezvous waiting or "
            "writing; decode: transfers being received)", registry=r)
        # Each side counts what it sees, once: the prefill side every transfer that failed there (by error code),
        # the decode side the integrity checks that failed on arrival (which the prefill side took for a success).
        self.transfer_failures = Counter(
            "pdspark_transfer_failures_total", "Cache transfers that failed, by reason (prefill: the error code; "
            "decode: checksum, the integrity check on arrival)", ["reason"], registry=r)
        # Expert-parallel groups (`--ep-size`): rank 0's view, counted from its slot exchange.
        self.group_ranks = Gauge(
            "pdspark_worker_group_ranks", "Rank processes of this worker's engine (an expert-parallel group of "
            "--ep-size ranks; 1: one process)", registry=r)
        self.expert_exchanges = Counter(
            "pdspark_worker_expert_exchanges_total", "MoE slot exchanges rank 0 of this worker's group took part in "
            "(one all-reduce per MoE layer of a step)", registry=r)
        self.expert_exchange_seconds = Counter(
            "pdspark_worker_expert_exchange_seconds_total", "Seconds rank 0 spent in its MoE slot exchanges, the wait "
            "for the slowest rank included", registry=r)
        self.expert_exchange_bytes = Counter(
            "pdspark_worker_expert_exchange_bytes_total", "Bytes of (token, slot) rows rank 0 all-reduced", registry=r)
        self._exchanged = (0, 0.0, 0)  # (calls, seconds, bytes) already counted
        self.engine = EngineMetrics(r)
        self.pools = PoolMetrics(r)
        for outcome in OUTCOMES:
            self.requests.labels(outcome=outcome)

    def sample_engine(self, engine: Engine, load: EngineLoad) -> None:
        """Refresh the gauges and counters read off the engine (on the engine thread, between steps; `load`: the
        loop's latest published snapshot)."""
        self.engine.sample(engine, load)
        self.pools.sample(engine.kv, load)
        self.group_ranks.set(engine.config.parallel.ep_size)
        ex = engine.runner.model.expert_exchange
        if ex is not None:
            calls, seconds, nbytes = self._exchanged
            self.expert_exchanges.inc(ex.calls - calls)
            self.expert_exchange_seconds.inc(ex.seconds - seconds)
            self.expert_exchange_bytes.inc(ex.bytes - nbytes)
            self._exchanged = (ex.calls, ex.seconds, ex.bytes)
