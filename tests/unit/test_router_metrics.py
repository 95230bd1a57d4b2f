"""`RouterMetrics`: names, types and every label set created at start; the inter-token latency and the per-worker
series."""

from __future__ import annotations

import pytest

from helpers import sample_value
from pdspark.errors import ErrorCode
from pdspark.router.router_metrics import APIS, OUTCOMES, REJECTIONS, RouterMetrics


def test_every_label_set_exists_at_zero_before_any_event():
    m = RouterMetrics()
    for api in APIS:
        for outcome in OUTCOMES:
            assert sample_value(m.registry, "pdspark_router_requests_total", api=api, outcome=outcome) == 0
    for reason in REJECTIONS:
        assert sample_value(m.registry, "pdspark_router_rejected_requests_total", reason=reason) == 0
    for role in ("prefill", "decode"):
        for healthy in ("true", "false"):
            assert sample_value(m.registry, "pdspark_router_workers", worker_role=role, healthy=healthy) == 0
    assert sample_value(m.registry, "pdspark_router_auth_failures_total", api="grpc", reason="forbidden") == 0
    # What a request can fail with at the workers is an outcome; the key checks are counted apart (auth_failures).
    assert {"ok", "invalid", "cancelled", "error", "overloaded", "deadline", "transfer"} <= set(OUTCOMES)
    assert ErrorCode.UNAUTHENTICATED.value not in OUTCOMES


def test_types_and_names():
    m = RouterMetrics()
    types = {f.name: f.type for f in m.registry.collect()}
    assert types["pdspark_router_requests"] == "counter"  # exposed as pdspark_router_requests_total
    assert types["pdspark_router_inter_token_latency_seconds"] == "histogram"
    assert types["pdspark_router_time_to_first_token_seconds"] == "histogram"
    assert types["pdspark_router_request_seconds"] == "histogram"
    assert types["pdspark_router_queue_time_seconds"] == "histogram"
    assert types["pdspark_router_requests_in_flight"] == types["pdspark_router_requests_queued"] == "gauge"
    assert types["pdspark_router_rejected_requests"] == types["pdspark_router_migrations"] == "counter"
    assert all(name.startswith("pdspark_router_") and ":" not in name for name in types)
    # Transfers are counted by the prefill workers, which write them: not a third time here.
    assert not any("transfer" in name for name in types)


def test_inter_token_latency_is_one_observation_per_token():
    m = RouterMetrics()
    m.observe_tokens(0.3, 3)  # a chunk of 3 tokens, 0.3 s after the previous one
    m.observe_tokens(0.02, 1)
    assert sample_value(m.registry, "pdspark_router_inter_token_latency_seconds_count") == 4
    assert sample_value(m.registry, "pdspark_router_inter_token_latency_seconds_sum") == pytest.approx(0.32)
    assert sample_value(m.registry, "pdspark_router_inter_token_latency_seconds_bucket", le="0.1") == 4


def test_a_worker_has_its_series_from_registration_to_removal():
    m = RouterMetrics()
    m.worker_added("decode", "decode-1")
    selected = dict(worker_role="decode", worker="decode-1")
    assert sample_value(m.registry, "pdspark_router_worker_selected_total", **selected) == 0
    m.selected.labels(worker_role="decode", worker="decode-1").inc()
    m.worker_removed("decode", "decode-1")
    assert sample_value(m.registry, "pdspark_router_worker_selected_total", **selected) is None
    m.worker_removed("decode", "decode-1")  # twice: nothing to drop, no error
