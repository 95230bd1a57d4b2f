"""`RouterMetrics`: every Prometheus metric the router exports, on its `/metrics`.

The rules are the workers' (`pdspark.serving.metrics`; the catalogue in docs/operations.md lists every metric): the
`pdspark_router_` prefix, units in names, `_total` counters, no colons, and every label value created at start
(per-worker series when the worker is registered), so that every series exists before its first event. Workers are
labelled by name (`prefill-0`), never by address: `/metrics` is open (see `api_keys`). A worker's role is
`worker_role`: `role`, `model` and `instance` are the labels Prometheus gives every series of a target (see
`prometheus_targets`), and a metric's own label of the same name would be renamed `exported_role` at the scrape.
"""

from __future__ import annotations

import contextlib
import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from pdspark.errors import ErrorCode

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_INTER_TOKEN = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)
APIS = ("completions", "chat", "generate", "grpc")
# invalid: refused by the router's own validation; cancelled: the client went away; error: an unexpected exception;
# else the failure's code (the key checks come before a request is counted here: see auth_failures).
OUTCOMES = ("ok", "invalid", "cancelled", "error",
            *(c.value for c in ErrorCode if c not in (ErrorCode.UNAUTHENTICATED, ErrorCode.PERMISSION_DENIED)))
# Why a request was refused at once with 429 (backpressure): its key's in-flight limit, the admission queue, or
# every worker of a role answering that it is full.
REJECTIONS = ("key_limit", "queue_full", "workers_full")
ROLES = ("prefill", "decode")


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = r = registry or CollectorRegistry()
        # A process of a router group (`router_group`): prometheus_client keeps every value in files of this
        # directory (its multiprocess mode, chosen by the same variable at its import), and a scrape reads them
        # all. Counters and histograms add up; each gauge says how its processes' values combine.
        self.multiprocess = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        self.requests = Counter("pdspark_router_requests_total", "Requests by API (completions, chat, generate, "
                                "grpc) and outcome (ok, invalid, cancelled, error or the failure's code)",
                                ["api", "outcome"], registry=r)
        self.rejected = Counter("pdspark_router_rejected_requests_total", "Requests refused at once with 429 "
                                "(backpressure), by reason: key_limit (the key's in-flight limit), queue_full (the "
                                "admission queue) or workers_full (every worker of a role is full)", ["reason"],
                                registry=r)
        self.in_flight = Gauge("pdspark_router_requests_in_flight", "Requests holding an admission slot (at the "
                               "workers)", registry=r, multiprocess_mode="livesum")
        self.queued = Gauge("pdspark_router_requests_queued", "Requests waiting in the admission queue", registry=r,
                            multiprocess_mode="livesum")
        self.max_in_flight = Gauge("pdspark_router_max_in_flight_requests", "Admission slots (max_in_flight)",
                                   registry=r, multiprocess_mode="livesum")
        self.max_queued = Gauge("pdspark_router_max_queued_requests", "Admission queue bound (max_queued)",
                                registry=r, multiprocess_mode="livesum")
        self.queue_time = Histogram("pdspark_router_queue_time_seconds", "Seconds admitted requests waited for a "
                                    "slot", buckets=_LATENCY, registry=r)
        self.ttft = Histogram("pdspark_router_time_to_first_token_seconds", "Seconds from a request's arrival to "
                              "its first token (queueing included)", buckets=_LATENCY, registry=r)
        self.inter_token = Histogram("pdspark_router_inter_token_latency_seconds", "Seconds between a stream's "
                                     "tokens after the first: each chunk's gap from the previous one, spread over "
                                     "its tokens (one observation per token)", buckets=_INTER_TOKEN, registry=r)
        self.e2e = Histogram("pdspark_router_request_seconds", "End-to-end seconds of a request, from arrival to "
                             "its last token or failure", buckets=_LATENCY, registry=r)
        self.prompt_tokens = Counter("pdspark_router_prompt_tokens_total", "Prompt tokens", registry=r)
        self.completion_tokens = Counter("pdspark_router_completion_tokens_total", "Generated tokens sent to "
                                         "clients", registry=r)
        self.cached_tokens = Counter("pdspark_router_cached_tokens_total", "Prompt tokens served from prefix caches",
                                     registry=r)
        self.retries = Counter("pdspark_router_retries_total", "Pair retries before the first token", registry=r)
        self.migrations = Counter("pdspark_router_migrations_total", "Streams moved to another pair after their "
                                  "decode leg failed mid-stream", registry=r)
        self.role_outage_waits = Counter(
            "pdspark_router_role_outage_waits_total", "Requests that waited for a worker of a role to answer again "
            "because no other worker of that role was healthy", registry=r)
        self.selected = Counter("pdspark_router_worker_selected_total", "Routing decisions: a worker picked for an "
                                "attempt, by the worker's role and name", ["worker_role", "worker"], registry=r)
        self.workers = Gauge("pdspark_router_workers", "Registered workers, by role and health", ["worker_role",
                             "healthy"], registry=r, multiprocess_mode="livemostrecent")
        self.incompatible_pairs = Gauge(
            "pdspark_router_incompatible_worker_pairs", "Healthy (prefill, decode) worker pairs whose reported "
            "compatibility rules a transfer between them out (never picked: during a rollout across schema versions, "
            "old and new workers pair among themselves)", registry=r,
            multiprocess_mode="livemostrecent")
        # Requests refused for their key (never the key itself): missing_key, invalid_key, or forbidden (a valid key
        # without the right: an API key on /workers, or worker administration that is off).
        self.auth_failures = Counter("pdspark_router_auth_failures_total", "Requests refused for their key, by "
                                     "API (http, grpc) and reason (missing_key, invalid_key, forbidden)",
                                     ["api", "reason"], registry=r)
        # Bound children of the series counted on every request, looked up once here (or at their first use):
        # `labels()` checks its arguments and takes a lock on each call.
        self._requests = {(api, outcome): self.requests.labels(api=api, outcome=outcome)
                          for api in APIS for outcome in OUTCOMES}
        self._selected: dict[tuple[str, str], Counter] = {}
        for reason in REJECTIONS:
            self.rejected.labels(reason=reason)
        for role in ROLES:
            for healthy in ("true", "false"):
                self.workers.labels(worker_role=role, healthy=healthy)
        for api in ("http", "grpc"):
            for reason in ("missing_key", "invalid_key", "forbidden"):
                self.auth_failures.labels(api=api, reason=reason)

    def group_exposition(self) -> bytes:
        """`/metrics` of a router group: every process's series, combined (see `multiprocess`). A removed worker's
        `worker_selected` series stays (its files are the processes' own until they exit)."""
        registry = CollectorRegistry()
        MultiProcessCollector(registry)
        return generate_latest(registry)

    def worker_added(self, role: str, name: str) -> None:
        """Create a newly registered worker's series (at zero)."""
        self._selected[role, name] = self.selected.labels(worker_role=role, worker=name)

    def worker_removed(self, role: str, name: str) -> None:
        """Drop a removed worker's series (its name returns only with the same address, from zero)."""
        self._selected.pop((role, name), None)
        with contextlib.suppress(KeyError):
            self.selected.remove(role, name)

    def count_request(self, api: str, outcome: str) -> None:
        """One request of `api` ended with `outcome` (`pdspark_router_requests_total`)."""
        child = self._requests.get((api, outcome))
        if child is None:
            child = self._requests[api, outcome] = self.requests.labels(api=api, outcome=outcome)
        child.inc()

    def count_selected(self, role: str, name: str) -> None:
        """The worker `name` of `role` was picked for an attempt (`pdspark_router_worker_selected_total`)."""
        child = self._selected.get((role, name))
        if child is None:
            child = self._selected[role, name] = self.selected.labels(worker_role=role, worker=name)
        child.inc()

    def observe_tokens(self, gap_s: float, num_tokens: int) -> None:
        """A stream chunk of `num_tokens` (> 0) tokens arrived `gap_s` after the previous chunk."""
        per_token = gap_s / num_tokens
        for _ in range(num_tokens):
            self.inter_token.observe(per_token)
