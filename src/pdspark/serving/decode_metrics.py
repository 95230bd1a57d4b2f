"""`DecodeMetrics`: a decode worker's metrics: the streams waiting for destination pages, the integrity checks of
arriving caches, and DSpark speculation (`SpecMetrics`).

NOTE: transfers themselves (bytes, seconds, writes, their failures) are counted by the prefill side, which writes
them (`PrefillMetrics`); here only what this side checks: a cache whose checksum does not match on arrival.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Gauge

from pdspark.serving.metrics import WorkerMetrics
from pdspark.serving.spec_metrics import SpecMetrics

if TYPE_CHECKING:
    from pdspark.engine.engine import Engine
    from pdspark.serving.engine_load import EngineLoad

CHECKSUM = "checksum"


class DecodeMetrics(WorkerMetrics):
    def __init__(self, num_drafts: int = 0, registry: CollectorRegistry | None = None):
        super().__init__("decode", registry)
        self.waiting_for_pages = Gauge(
            "pdspark_decode_waiting_for_pages_requests", "Streams waiting for destination pages (a reservation) "
            "before their transfer can start", registry=self.registry)
        self.transfer_failures.labels(reason=CHECKSUM)
        self.quarantined_pages = Gauge(
            "pdspark_pool_quarantined_pages", "Of the pages in use, those of transfers whose prefill worker did not "
            "answer, held until no write of theirs can land", ["pool"], registry=self.registry)
        self.spec = SpecMetrics(self.registry, num_drafts)

    def sample_engine(self, engine: Engine, load: EngineLoad) -> None:
        super().sample_engine(engine, load)
        self.spec.sample(engine.spec)
