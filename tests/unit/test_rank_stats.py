"""`RankStats` and `GroupCollector`: a rank's step lands in the histogram bucket Prometheus's `le` names (an
observation equal to a bound counts in that bucket), the collector's buckets are cumulative, and each rank's row is
its own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from pdspark.parallel.rank_stats import BUCKETS, RankStats
from pdspark.serving.group_metrics import GroupCollector


class _Group:
    def __init__(self, stats: RankStats, states: list[str]):
        self.rank_stats = stats
        self._states = states

    def rank_states(self) -> list[str]:
        return self._states


def test_a_step_lands_in_the_bucket_whose_bound_holds_it_and_rows_stay_apart():
    stats = RankStats(3)
    stats.record(1, 0.001, 4, 0.0005, 100)  # exactly the first bound
    stats.record(1, 0.0011, 4, 0.3, 100)
    stats.record(1, 1e3, 2, 0.0, 50)  # past every bound: +Inf
    one = stats.figures(1)
    assert one.steps == 3 and one.collective_calls == 10 and one.collective_bytes == 250
    assert abs(one.step_seconds - 1000.0021) < 1e-9
    assert one.step_buckets[0] == 1 and one.step_buckets[1] == 1 and one.step_buckets[-1] == 1
    assert one.collective_buckets[0] == 2 and one.collective_buckets[BUCKETS.index(0.5)] == 1
    assert stats.figures(0).steps == stats.figures(2).steps == 0


def test_the_collector_exposes_cumulative_buckets_and_each_ranks_state():
    stats = RankStats(2)
    for took in (0.002, 0.004, 0.2):
        stats.record(0, took, 6, 0.001, 1024)
    registry = CollectorRegistry()
    registry.register(GroupCollector(_Group(stats, ["running", "exited (-9)"])))
    text = generate_latest(registry).decode()
    assert 'pdspark_worker_rank_step_seconds_bucket{le="0.0025",rank="0"} 1.0' in text
    assert 'pdspark_worker_rank_step_seconds_bucket{le="0.005",rank="0"} 2.0' in text
    assert 'pdspark_worker_rank_step_seconds_bucket{le="+Inf",rank="0"} 3.0' in text
    assert 'pdspark_worker_rank_step_seconds_count{rank="1"} 0.0' in text
    assert 'pdspark_worker_rank_collectives_total{rank="0"} 18.0' in text
    assert 'pdspark_worker_rank_collective_bytes_total{rank="0"} 3072.0' in text
    assert 'pdspark_worker_rank_up{rank="0"} 1.0' in text and 'pdspark_worker_rank_up{rank="1"} 0.0' in text
