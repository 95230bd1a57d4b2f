"""`DecodeMetrics` and `SpecMetrics`: the decode side counts only the checks it makes, and DSpark's acceptance
by draft position, read off the engine's `SpecStats` by difference."""

from __future__ import annotations

import pytest

from helpers import sample_value
from pdspark.engine.engine import SpecStats
from pdspark.serving.decode_metrics import DecodeMetrics


def test_every_label_set_exists_at_zero():
    m = DecodeMetrics(num_drafts=3)
    for position in ("1", "2", "3"):
        assert sample_value(m.registry, "pdspark_spec_draft_tokens_total", position=position) == 0
        assert sample_value(m.registry, "pdspark_spec_accepted_tokens_total", position=position) == 0
    assert sample_value(m.registry, "pdspark_spec_verify_steps_total") == 0
    assert sample_value(m.registry, "pdspark_transfer_failures_total", reason="checksum") == 0
    types = {f.name: f.type for f in m.registry.collect()}
    # Transfers are the prefill side's to count: here only the integrity check on arrival.
    assert not {"pdspark_transfer_bytes", "pdspark_transfer_seconds", "pdspark_transfer_writes"} & set(types)
    assert types["pdspark_spec_mean_acceptance_length_tokens"] == "gauge"
    assert types["pdspark_decode_waiting_for_pages_requests"] == "gauge"


def test_no_speculation_no_position_series():
    m = DecodeMetrics(num_drafts=0)
    assert sample_value(m.registry, "pdspark_spec_draft_tokens_total", position="1") is None
    assert sample_value(m.registry, "pdspark_spec_verify_steps_total") == 0


def verify(spec: SpecStats, drafts: int, accepted: int) -> None:
    """What `Engine._count` does for one verify step."""
    spec.verify_steps += 1
    spec.draft_tokens += drafts
    spec.accepted_tokens += accepted
    spec.steps_by_drafts[drafts] += 1
    spec.steps_by_accepted[accepted] += 1


def test_acceptance_by_position_and_mean_length():
    spec = SpecStats.for_drafts(3)
    m = DecodeMetrics(num_drafts=3)
    verify(spec, 3, 3)
    verify(spec, 3, 1)
    m.spec.sample(spec)
    verify(spec, 2, 0)  # near max_tokens a step proposes fewer drafts
    m.spec.sample(spec)
    m.spec.sample(spec)  # nothing new: nothing moves
    assert spec.accepted_per_position == [2, 1, 1] and spec.drafted_per_position == [3, 3, 2]
    assert sample_value(m.registry, "pdspark_spec_verify_steps_total") == 3
    assert [sample_value(m.registry, "pdspark_spec_accepted_tokens_total", position=p) for p in "123"] == [2, 1, 1]
    assert [sample_value(m.registry, "pdspark_spec_draft_tokens_total", position=p) for p in "123"] == [3, 3, 2]
    assert sample_value(m.registry, "pdspark_spec_mean_acceptance_length_tokens") == pytest.approx((4 + 3) / 3)
