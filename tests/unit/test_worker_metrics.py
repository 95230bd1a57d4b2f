"""`WorkerMetrics` (what both roles export), `EngineMetrics` and `PoolMetrics`: names, types, every label set
created at start, and the values read off the engine loop and the pools."""

from __future__ import annotations

from types import MappingProxyType, SimpleNamespace

from cache_builders import make_kv
from prometheus_client import CollectorRegistry

from helpers import sample_value
from pdspark.config import EngineConfig, ParallelConfig
from pdspark.engine.engine import EngineStats
from pdspark.serving.engine_load import EngineLoad
from pdspark.serving.engine_metrics import ERROR_STAGES, EngineMetrics
from pdspark.serving.metrics import OUTCOMES, WorkerMetrics
from pdspark.serving.pool_metrics import POOLS, RINGS, PoolMetrics


def load_of(kv, running: int = 0, waiting: int = 0) -> EngineLoad:
    usage = kv.usage()
    return EngineLoad(running, waiting, MappingProxyType({k: u for k, (u, _) in usage.items()}),
                      MappingProxyType({k: t for k, (_, t) in usage.items()}), MappingProxyType(kv.cached_pages()))


class _Engine:
    """What `sample` reads of an engine (`exchange`: a group's slot exchange, as rank 0's model holds it)."""

    def __init__(self, kv, ep_size: int = 1, exchange=None) -> None:
        self.kv = kv
        self.stats = EngineStats()
        self.config = EngineConfig(parallel=ParallelConfig(ep_size=ep_size))
        self.runner = SimpleNamespace(model=SimpleNamespace(expert_exchange=exchange))


def test_common_series_exist_at_zero():
    m = WorkerMetrics("prefill")
    for outcome in OUTCOMES:
        assert sample_value(m.registry, "pdspark_worker_requests_total", outcome=outcome) == 0
    assert {"ok", "cancelled", "error", "overloaded", "deadline", "aborted"} <= set(OUTCOMES)
    assert "unauthenticated" not in OUTCOMES  # the router's key checks never reach a worker
    for stage in ERROR_STAGES:
        assert sample_value(m.registry, "pdspark_engine_errors_total", stage=stage) == 0
    for pool in POOLS:
        assert sample_value(m.registry, "pdspark_pool_used_pages", pool=pool) == 0
        assert sample_value(m.registry, "pdspark_pool_capacity_pages", pool=pool) == 0
    for ring in RINGS:
        assert sample_value(m.registry, "pdspark_pool_used_state_rows", ring=ring) == 0
    assert sample_value(m.registry, "pdspark_worker_rejected_requests_total") == 0
    types = {f.name: f.type for f in m.registry.collect()}
    assert types["pdspark_engine_step_seconds"] == types["pdspark_engine_batch_requests"] == "histogram"
    assert types["pdspark_engine_generated_tokens"] == types["pdspark_worker_requests"] == "counter"
    assert types["pdspark_pool_used_pages"] == types["pdspark_engine_running_requests"] == "gauge"


def test_engine_metrics_observe_steps_and_count_tokens_by_difference():
    registry = CollectorRegistry()
    m = EngineMetrics(registry)
    m.on_step(0.004, 3)
    m.on_step(0.02, 1)
    m.on_error("step")
    assert sample_value(registry, "pdspark_engine_step_seconds_count") == 2
    assert sample_value(registry, "pdspark_engine_batch_requests_sum") == 4
    assert sample_value(registry, "pdspark_engine_batch_requests_bucket", le="2.0") == 1
    assert sample_value(registry, "pdspark_engine_errors_total", stage="step") == 1
    engine = _Engine(make_kv())
    load = load_of(engine.kv, running=2, waiting=5)
    engine.stats.generated_tokens = 7
    m.sample(engine, load)  # type: ignore[arg-type]
    engine.stats.generated_tokens = 10
    m.sample(engine, load)  # type: ignore[arg-type]
    m.sample(engine, load)  # type: ignore[arg-type]
    assert sample_value(registry, "pdspark_engine_generated_tokens_total") == 10
    assert sample_value(registry, "pdspark_engine_running_requests") == 2
    assert sample_value(registry, "pdspark_engine_waiting_requests") == 5
    assert sample_value(registry, "pdspark_engine_fast_path_fallback_steps_total", reason="step_tokens") == 0
    engine.stats.fast_path_fallback_steps["step_tokens"] += 3
    m.sample(engine, load)  # type: ignore[arg-type]
    m.sample(engine, load)  # type: ignore[arg-type]
    assert sample_value(registry, "pdspark_engine_fast_path_fallback_steps_total", reason="step_tokens") == 3


def test_pool_metrics_cover_pages_state_rings_and_slots():
    kv = make_kv()  # SWA + CSA + HCA layers
    rp = kv.open()
    assert rp is not None
    kv.grow_tail(rp, 40)
    registry = CollectorRegistry()
    PoolMetrics(registry).sample(kv, load_of(kv))
    usage, sizes = kv.usage(), kv.sizes
    full_used, swa_used = usage["full"].used, usage["swa"].used
    assert full_used > 0 and swa_used > 0
    assert sample_value(registry, "pdspark_pool_used_pages", pool="full") == full_used
    assert sample_value(registry, "pdspark_pool_capacity_pages", pool="full") == sizes.num_full_pages
    assert sample_value(registry, "pdspark_pool_used_pages", pool="swa") == swa_used
    assert sample_value(registry, "pdspark_pool_capacity_pages", pool="c128") == sizes.num_c128_pages
    # C4 rows live with the full pages; C4 state rings are per SWA page, C128 ones per request slot.
    assert sample_value(registry, "pdspark_pool_used_pages", pool="c4") == full_used
    assert sample_value(registry, "pdspark_pool_used_state_rows", ring="c4") == swa_used * sizes.csa_ring
    assert sample_value(registry, "pdspark_pool_capacity_state_rows", ring="c4") == sizes.num_swa_pages * sizes.csa_ring
    assert sample_value(registry, "pdspark_pool_used_state_rows", ring="c128") == sizes.hca_ring
    assert (sample_value(registry, "pdspark_pool_capacity_state_rows", ring="c128")
            == sizes.num_req_slots * sizes.hca_ring)
    assert sample_value(registry, "pdspark_pool_used_request_slots") == 1
    assert sample_value(registry, "pdspark_pool_capacity_request_slots") == sizes.num_req_slots


def test_the_worker_samples_engine_and_pools_together():
    m = WorkerMetrics("decode")
    engine = _Engine(make_kv())
    engine.stats.generated_tokens = 3
    m.sample_engine(engine, load_of(engine.kv, running=1))  # type: ignore[arg-type]
    assert sample_value(m.registry, "pdspark_engine_generated_tokens_total") == 3
    assert sample_value(m.registry, "pdspark_pool_capacity_request_slots") == engine.kv.sizes.num_req_slots
    assert sample_value(m.registry, "pdspark_worker_group_ranks") == 1
    assert sample_value(m.registry, "pdspark_worker_expert_exchanges_total") == 0


def test_a_groups_exchanges_are_counted_once_each():
    """Rank 0's exchange keeps running totals; each sample adds what is new since the last one."""
    m = WorkerMetrics("prefill")
    exchange = SimpleNamespace(calls=6, seconds=0.5, bytes=4096)
    engine = _Engine(make_kv(), ep_size=2, exchange=exchange)
    load = load_of(engine.kv)
    m.sample_engine(engine, load)  # type: ignore[arg-type]
    exchange.calls, exchange.seconds, exchange.bytes = 10, 0.75, 8192
    m.sample_engine(engine, load)  # type: ignore[arg-type]
    m.sample_engine(engine, load)  # type: ignore[arg-type]  (nothing new)
    assert sample_value(m.registry, "pdspark_worker_group_ranks") == 2
    assert sample_value(m.registry, "pdspark_worker_expert_exchanges_total") == 10
    assert sample_value(m.registry, "pdspark_worker_expert_exchange_seconds_total") == 0.75
    assert sample_value(m.registry, "pdspark_worker_expert_exchange_bytes_total") == 8192
