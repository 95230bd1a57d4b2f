"""`PrefillMetrics`: a prefill worker's metrics: its prompts (tokens, prefix-cache hits, seconds) and the cache
transfers it writes.

NOTE: transfers are counted here, once, by the side that writes them (bytes, seconds, writes per payload kind and
failures by reason); the decode side counts only what it checks itself (`DecodeMetrics`).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdspark.serving.engine_metrics import STEP_SECONDS
from pdspark.serving.metrics import WORKER_FAILURES, WorkerMetrics
from pdspark.transfer.plan import PoolKind, TransferStats

TRANSFER_BYTES = (1e3, 1e4, 1e5, 3e5, 1e6, 3e6, 1e7, 3e7, 1e8, 1e9)
PAYLOAD_KINDS = tuple(kind.name.lower() for kind in PoolKind)
_KINDS = ", ".join(PAYLOAD_KINDS)


class PrefillMetrics(WorkerMetrics):
    def __init__(self, registry: CollectorRegistry | None = None):
        super().__init__("prefill", registry)
        r = self.registry
        self.prompt_tokens = Counter("pdspark_prefill_prompt_tokens_total", "Prompt tokens of the prompts "
                                     "prefilled (prefix-cache hits included)", registry=r)
        self.prefix_cache_hit_tokens = Counter(
            "pdspark_prefill_prefix_cache_hit_tokens_total", "Prompt tokens served from the prefix cache (not "
            "computed)", registry=r)
        self.prefix_cache_hit_ratio = Gauge(
            "pdspark_prefill_prefix_cache_hit_ratio", "Share of prompt tokens served from the prefix cache since "
            "the worker started (over a window: the ratio of the two counters' rates)", registry=r)
        self.prefill_seconds = Histogram("pdspark_prefill_seconds", "Seconds from a prompt entering the engine to "
                                         "its first token (time queued in the engine included)",
                                         buckets=STEP_SECONDS, registry=r)
        self.plan_wait_seconds = Histogram(
            "pdspark_prefill_plan_wait_seconds", "Seconds a transfer waited for the decode worker's plan (its "
            "reservation of pages), of the transfers that succeeded", buckets=STEP_SECONDS, registry=r)
        self.transfer_bytes = Histogram("pdspark_transfer_bytes", "Bytes written by one cache transfer",
                                        buckets=TRANSFER_BYTES, registry=r)
        self.transfer_seconds = Histogram("pdspark_transfer_seconds", "Seconds writing one cache transfer (its "
                                          "count: transfers that succeeded)", buckets=STEP_SECONDS, registry=r)
        self.transfer_payload_bytes = Counter(
            "pdspark_transfer_payload_bytes_total", f"Bytes written by cache transfers, by payload kind ({_KINDS})",
            ["kind"], registry=r)
        self.transfer_writes = Counter(
            "pdspark_transfer_writes_total", "Writes issued by cache transfers (contiguous runs merged), by "
            f"payload kind ({_KINDS})", ["kind"], registry=r)
        self.stuck_transfers = Gauge(
            "pdspark_prefill_stuck_transfers", "Cache transfers given up on (their writes still running past the "
            "deadline and the transfer engine's timeout: a peer that does not answer) whose transfer thread is still "
            "blocked; once they hold every transfer thread the worker answers NOT_SERVING and refuses prefills",
            registry=r)
        for kind in PAYLOAD_KINDS:
            self.transfer_payload_bytes.labels(kind=kind)
            self.transfer_writes.labels(kind=kind)
        for reason in WORKER_FAILURES:
            self.transfer_failures.labels(reason=reason)
        self._prompt_total = self._hit_total = 0

    def observe_prefill(self, prompt_tokens: int, cached_tokens: int, seconds: float) -> None:
        """A prompt was computed and its first token sampled."""
        self.prompt_tokens.inc(prompt_tokens)
        self.prefix_cache_hit_tokens.inc(cached_tokens)
        self.prefill_seconds.observe(seconds)
        self._prompt_total += prompt_tokens
        self._hit_total += cached_tokens
        self.prefix_cache_hit_ratio.set(self._hit_total / max(self._prompt_total, 1))

    def observe_transfer(self, stats: TransferStats, writes_by_pool: dict[str, int]) -> None:
        """A transfer succeeded. `writes_by_pool`/`stats.bytes_by_pool`: by `PoolKind` name."""
        self.transfer_bytes.observe(stats.bytes)
        self.transfer_seconds.observe(stats.transfer_s)
        self.plan_wait_seconds.observe(stats.plan_wait_s)
        for pool, nbytes in (stats.bytes_by_pool or {}).items():
            self.transfer_payload_bytes.labels(kind=pool.lower()).inc(nbytes)
        for pool, n in writes_by_pool.items():
            self.transfer_writes.labels(kind=pool.lower()).inc(n)
