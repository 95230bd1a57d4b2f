"""`PrefillMetrics`: prompts, prefix-cache hits and the transfers the prefill side writes (counted here, once)."""

from __future__ import annotations

import pytest

from helpers import sample_value
from pdspark.serving.metrics import WORKER_FAILURES
from pdspark.serving.prefill_metrics import PAYLOAD_KINDS, PrefillMetrics
from pdspark.transfer.plan import TransferStats


def test_every_label_set_exists_at_zero():
    m = PrefillMetrics()
    assert set(PAYLOAD_KINDS) == {"c4_kv", "c4_index", "c128_kv", "swa_kv", "c4_state", "c4_index_state",
                                  "c128_state", "draft_kv"}
    for kind in PAYLOAD_KINDS:
        assert sample_value(m.registry, "pdspark_transfer_payload_bytes_total", kind=kind) == 0
        assert sample_value(m.registry, "pdspark_transfer_writes_total", kind=kind) == 0
    for reason in WORKER_FAILURES:
        assert sample_value(m.registry, "pdspark_transfer_failures_total", reason=reason) == 0
    # The decode side's check:
    assert sample_value(m.registry, "pdspark_transfer_failures_total", reason="checksum") is None
    assert sample_value(m.registry, "pdspark_prefill_prompt_tokens_total") == 0
    assert sample_value(m.registry, "pdspark_prefill_stuck_transfers") == 0
    types = {f.name: f.type for f in m.registry.collect()}
    assert types["pdspark_transfer_bytes"] == types["pdspark_transfer_seconds"] == "histogram"
    assert types["pdspark_prefill_seconds"] == types["pdspark_prefill_plan_wait_seconds"] == "histogram"
    assert types["pdspark_prefill_prefix_cache_hit_ratio"] == types["pdspark_prefill_stuck_transfers"] == "gauge"
    assert not any(name.startswith("pdspark_spec_") for name in types)  # speculation is the decode side's


def test_prompts_and_prefix_cache_hits():
    m = PrefillMetrics()
    assert sample_value(m.registry, "pdspark_prefill_prefix_cache_hit_ratio") == 0
    m.observe_prefill(100, 0, 0.05)
    m.observe_prefill(100, 60, 0.02)
    assert sample_value(m.registry, "pdspark_prefill_prompt_tokens_total") == 200
    assert sample_value(m.registry, "pdspark_prefill_prefix_cache_hit_tokens_total") == 60
    assert sample_value(m.registry, "pdspark_prefill_prefix_cache_hit_ratio") == pytest.approx(0.3)
    assert sample_value(m.registry, "pdspark_prefill_seconds_count") == 2


def test_a_transfer_by_payload_kind():
    m = PrefillMetrics()
    stats = TransferStats(bytes=5000, num_writes=3, transfer_s=0.01, plan_wait_s=0.2,
                          bytes_by_pool={"SWA_KV": 4000, "C128_STATE": 1000})
    m.observe_transfer(stats, {"SWA_KV": 2, "C128_STATE": 1})
    assert sample_value(m.registry, "pdspark_transfer_bytes_sum") == 5000
    assert sample_value(m.registry, "pdspark_transfer_seconds_count") == 1
    assert sample_value(m.registry, "pdspark_transfer_payload_bytes_total", kind="swa_kv") == 4000
    assert sample_value(m.registry, "pdspark_transfer_writes_total", kind="c128_state") == 1
    assert sample_value(m.registry, "pdspark_transfer_writes_total", kind="c4_kv") == 0
    assert sample_value(m.registry, "pdspark_prefill_plan_wait_seconds_sum") == pytest.approx(0.2)
