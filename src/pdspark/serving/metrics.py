"""Every Prometheus metric a worker exports (names without colons; `_total` counters)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_BYTES = (1e3, 1e4, 1e5, 3e5, 1e6, 3e6, 1e7, 3e7, 1e8, 1e9)
_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class WorkerMetrics:
    def __init__(self, role: str, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.role = role
        self.transfer_bytes = Histogram("pdspark_transfer_bytes", "Bytes of one cache transfer", buckets=_BYTES,
                                        registry=r)
        self.transfer_seconds = Histogram("pdspark_transfer_seconds", "Seconds spent writing one cache transfer",
                                          buckets=_SECONDS, registry=r)
        self.transfer_failures = Counter("pdspark_transfer_failures_total", "Transfers that failed, by reason",
                                         ["reason"], registry=r)
        self.requests = Counter("pdspark_requests_total", "Requests handled, by outcome", ["outcome"], registry=r)
        self.refused = Counter("pdspark_requests_refused_total",
                               "Requests refused at once (OVERLOADED) because the worker's queue was full", registry=r)
        self.queue_size = Gauge("pdspark_queue_size", "Requests waiting, by queue", ["queue"], registry=r)
        self.running = Gauge("pdspark_running_requests", "Requests in the running batch", registry=r)
        self.pages_used = Gauge("pdspark_pool_pages_used", "Pages in use per pool", ["pool"], registry=r)
        self.pages_total = Gauge("pdspark_pool_pages_total", "Pages per pool", ["pool"], registry=r)
        self.pages_quarantined = Gauge(
            "pdspark_pool_pages_quarantined", "Of the pages in use, those of transfers whose prefill worker did not "
            "answer, held until no write of theirs can land (decode workers)", ["pool"], registry=r)
        self.spec_verify_steps = Counter("pdspark_spec_verify_steps_total", "Speculative verify steps", registry=r)
        self.spec_accepted = Counter("pdspark_spec_accepted_tokens_total", "Draft tokens accepted", registry=r)
        self.spec_draft_tokens = Counter("pdspark_spec_draft_tokens_total", "Draft tokens proposed", registry=r)
        self._spec_seen = (0, 0, 0)

    def observe_transfer(self, stats) -> None:
        self.transfer_bytes.observe(stats.bytes)
        self.transfer_seconds.observe(stats.transfer_s)

    def sample_engine(self, engine, transfers_in_flight: int = 0) -> None:
        """Refresh the gauges from the engine (called on the engine thread between steps)."""
        self.running.set(len(engine.scheduler.running))
        self.queue_size.labels(queue="waiting").set(len(engine.scheduler.waiting))
        self.queue_size.labels(queue="transfer").set(transfers_in_flight)
        for pool, (used, total) in engine.kv.usage().items():
            self.pages_used.labels(pool=pool).set(used)
            self.pages_total.labels(pool=pool).set(total)
        spec = engine.spec
        now = (spec.verify_steps, spec.accepted_tokens, spec.draft_tokens)
        for counter, new, old in zip((self.spec_verify_steps, self.spec_accepted, self.spec_draft_tokens), now,
                                     self._spec_seen):
            if new > old:
                counter.inc(new - old)
        self._spec_seen = now
