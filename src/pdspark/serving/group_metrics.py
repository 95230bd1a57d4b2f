"""`GroupCollector`: a worker group's per-rank figures on the worker's `/metrics` (rank 0 serves them for every rank).

Read at each scrape from the group's shared `RankStats` table and its ranks' process states: no call reaches another
rank, so a hung rank still shows (its step counts stop, or it is down), and the scrape never waits for it. A
one-process worker is a group of one (`OneProcessGroup`): every worker exports the same series, rank 0 at least.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from pdspark.parallel.rank_stats import BUCKETS, RankStats
from pdspark.serving.engine_loop import StepObserver


class GroupSource(Protocol):
    """What the collector reads (`LockstepEngine`, `DataParallelEngine`)."""

    rank_stats: RankStats

    def rank_states(self) -> list[str]: ...


class OneProcessGroup:
    """A one-process worker as a group of one: rank 0 is this process, its steps the engine loop's (observed here,
    then passed on to `then`), with no collectives."""

    def __init__(self, then: StepObserver):
        self.rank_stats = RankStats(1)
        self._then = then

    def rank_states(self) -> list[str]:
        return ["running"]

    def on_step(self, seconds: float, batch_size: int) -> None:
        self.rank_stats.record(0, seconds, 0, 0.0, 0)
        self._then.on_step(seconds, batch_size)

    def on_error(self, stage: str) -> None:
        self._then.on_error(stage)


class GroupCollector(Collector):
    def __init__(self, group: GroupSource):
        self.group = group

    def collect(self) -> Iterator[Metric]:
        stats = self.group.rank_stats
        step = HistogramMetricFamily(
            "pdspark_worker_rank_step_seconds", "Seconds of each engine step on each rank of this worker's group "
            "(--ep-size; a one-process worker: rank 0), the waits in its collectives included", labels=["rank"])
        collective = HistogramMetricFamily(
            "pdspark_worker_rank_collective_seconds", "Seconds each rank of this worker's group spent in its MoE "
            "exchanges' collectives during one step (the wait for the slowest rank included)", labels=["rank"])
        calls = CounterMetricFamily("pdspark_worker_rank_collectives", "Collectives each rank of this worker's group "
                                    "made in its MoE exchanges", labels=["rank"])
        nbytes = CounterMetricFamily("pdspark_worker_rank_collective_bytes", "Bytes each rank of this worker's group "
                                     "sent and received in its MoE exchanges' collectives", labels=["rank"])
        up = GaugeMetricFamily("pdspark_worker_rank_up", "Whether each rank process of this worker's group runs (1) "
                               "or has exited or failed (0)", labels=["rank"])
        for rank, state in enumerate(self.group.rank_states()):
            f = stats.figures(rank)
            label = [str(rank)]
            step.add_metric(label, _cumulative(f.step_buckets), f.step_seconds)
            collective.add_metric(label, _cumulative(f.collective_buckets), f.collective_seconds)
            calls.add_metric(label, f.collective_calls)
            nbytes.add_metric(label, f.collective_bytes)
            up.add_metric(label, 1.0 if state == "running" else 0.0)
        yield from (step, collective, calls, nbytes, up)


def _cumulative(counts: list[int]) -> list[tuple[str, float]]:
    """Per-bucket counts (+Inf last) -> Prometheus's cumulative `le` buckets."""
    out, total = [], 0
    for le, n in zip([*map(str, BUCKETS), "+Inf"], counts):
        total += n
        out.append((le, float(total)))
    return out
