"""Every Prometheus metric the router exports (no colons in names)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = r = registry or CollectorRegistry()
        self.requests = Counter("pdspark_router_requests_total", "Requests by API and outcome", ["api", "outcome"],
                                registry=r)
        self.in_flight = Gauge("pdspark_router_requests_in_flight", "Requests holding an admission slot (at the "
                               "workers)", registry=r)
        self.queued = Gauge("pdspark_router_requests_queued", "Requests waiting in the admission queue", registry=r)
        self.max_in_flight = Gauge("pdspark_router_max_in_flight_requests", "Admission slots (max_in_flight)",
                                   registry=r)
        self.max_queued = Gauge("pdspark_router_max_queued_requests", "Admission queue bound (max_queued)",
                                registry=r)
        self.queue_time = Histogram("pdspark_router_queue_time_seconds", "Time admitted requests waited for a slot",
                                    buckets=_LATENCY, registry=r)
        self.ttft = Histogram("pdspark_router_time_to_first_token_seconds", "Time to first token", buckets=_LATENCY,
                              registry=r)
        self.e2e = Histogram("pdspark_router_request_seconds", "Whole request latency", buckets=_LATENCY, registry=r)
        self.prompt_tokens = Counter("pdspark_router_prompt_tokens_total", "Prompt tokens", registry=r)
        self.completion_tokens = Counter("pdspark_router_completion_tokens_total", "Generated tokens", registry=r)
        self.cached_tokens = Counter("pdspark_router_cached_tokens_total", "Prompt tokens served from prefix caches",
                                     registry=r)
        self.retries = Counter("pdspark_router_retries_total", "Pair retries before the first token", registry=r)
        self.migrations = Counter("pdspark_router_migrations_total", "Streams moved to another pair after their "
                                  "decode leg failed mid-stream", registry=r)
        self.selected = Counter("pdspark_router_worker_selected_total", "Worker selections", ["role", "worker"],
                                registry=r)
        self.transfer_bytes = Histogram("pdspark_router_transfer_bytes", "Cache bytes moved per request",
                                        buckets=(1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9), registry=r)
        self.workers = Gauge("pdspark_router_workers", "Registered workers", ["role", "healthy"], registry=r)
        # Requests refused for their key (never the key itself): missing_key, invalid_key, or forbidden (a valid key
        # without the right: an API key on /workers, or worker administration that is off).
        self.auth_failures = Counter("pdspark_router_auth_failures_total", "Requests refused for their key",
                                     ["api", "reason"], registry=r)
        for api in ("http", "grpc"):
            for reason in ("missing_key", "invalid_key", "forbidden"):
                self.auth_failures.labels(api=api, reason=reason)
