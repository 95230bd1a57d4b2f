"""`SpecGovernor` picks, per batch size, the decode mode that measured fewer seconds per token, and keeps probing the
other one with a bounded share of the time."""

from __future__ import annotations

import pytest

from pdspark.engine.spec_governor import MIN_STEPS, PROBE_SHARE, SpecGovernor

GAMMA = 5


def run(gov: SpecGovernor, batch: int, steps: int, spec_cost: tuple[float, int], plain_cost: tuple[float, int]
        ) -> dict:
    """`steps` decode steps at `batch`, each mode costing `(seconds, tokens)` a step; time and steps per mode."""
    seen = {"spec_steps": 0, "plain_steps": 0, "spec_s": 0.0, "plain_s": 0.0}
    for _ in range(steps):
        speculate = gov.drafts(batch) > 0
        seconds, tokens = spec_cost if speculate else plain_cost
        gov.record(batch, speculate, seconds, tokens)
        key = "spec" if speculate else "plain"
        seen[f"{key}_steps"] += 1
        seen[f"{key}_s"] += seconds
    return seen


def test_it_measures_both_modes_then_keeps_the_cheaper_one():
    gov = SpecGovernor(GAMMA)
    assert gov.drafts(1) == GAMMA  # speculation is measured first
    # DSpark pays here: 2.2 ms for 4.3 tokens against 1 ms for one.
    seen = run(gov, 1, 2000, spec_cost=(2.2e-3, 4), plain_cost=(1.0e-3, 1))
    assert gov.chosen() == {1: True}
    assert seen["plain_s"] <= 1.5 * PROBE_SHARE * (seen["spec_s"] + seen["plain_s"]), seen
    assert seen["plain_steps"] > 2  # still probed, not just measured once


def test_a_verify_step_many_times_a_decode_step_is_probed_rarely():
    """A batch of 8 on the module path: a verify step 15x a decode step, 0.3x plain's tokens per second."""
    gov = SpecGovernor(GAMMA)
    seen = run(gov, 8, 3000, spec_cost=(30e-3, 34), plain_cost=(2e-3, 8))
    assert gov.chosen() == {8: False}
    total = seen["spec_s"] + seen["plain_s"]
    explore = MIN_STEPS * 30e-3  # the first steps of speculation, before anything is known
    assert seen["spec_s"] - explore <= 1.5 * PROBE_SHARE * total, seen
    assert seen["spec_steps"] > 2


def test_batch_sizes_are_measured_apart_and_a_change_in_costs_is_followed():
    gov = SpecGovernor(GAMMA)
    run(gov, 1, 500, spec_cost=(2e-3, 4), plain_cost=(1e-3, 1))
    run(gov, 8, 500, spec_cost=(30e-3, 34), plain_cost=(2e-3, 8))
    assert gov.chosen() == {1: True, 8: False}
    # The drafts stop paying at batch 1 (another prompt mix, a longer context): the probes see it.
    run(gov, 1, 2000, spec_cost=(4e-3, 2), plain_cost=(1e-3, 1))
    assert gov.chosen() == {1: False, 8: False}


def test_the_step_after_a_switch_and_one_slow_step_do_not_decide():
    """The first step after a switch of mode pays for the switch, which a steady mode does not: it is not counted;
    and the slowest step of a window (a GC pause) is left out of its estimate."""
    gov = SpecGovernor(GAMMA)
    for _ in range(MIN_STEPS):
        gov.record(1, True, 2e-3, 4)  # 0.5 ms a token
    for seconds in (9e-3, 9e-3, 0.4e-3, 0.4e-3, 0.4e-3):
        gov.record(1, False, seconds, 1)  # 0.4 ms a token after the switch and one slow step
    assert gov.chosen() == {1: False}
    gov.record(1, False, 9e-3, 1)  # a second slow step counts
    assert gov.chosen() == {1: True}


def test_a_step_with_prompts_in_it_follows_the_choice_without_exploring():
    """Such steps are not timed: exploring there would draft (at large verify cost) and never learn."""
    gov = SpecGovernor(GAMMA)
    assert gov.drafts(3, steady=False) == 0  # nothing known at 3 yet: no drafts
    run(gov, 3, 200, spec_cost=(2e-3, 4), plain_cost=(1e-3, 1))
    assert gov.chosen() == {3: True}
    assert all(gov.drafts(3, steady=False) == GAMMA for _ in range(100))  # and no probe among them


def test_a_new_batch_size_follows_the_nearest_measured_one_and_probes_the_other_mode_within_its_share():
    """Batch sizes come and go as requests start and end: a new one does not pay for exploring a bad mode first."""
    gov = SpecGovernor(GAMMA)
    run(gov, 8, 500, spec_cost=(30e-3, 34), plain_cost=(2e-3, 8))
    assert gov.drafts(6) == 0  # as at 8
    seen = run(gov, 6, 3000, spec_cost=(25e-3, 26), plain_cost=(1.6e-3, 6))
    assert gov.chosen() == {6: False, 8: False}  # measured at 6 too, by probes
    assert seen["spec_s"] <= 1.5 * PROBE_SHARE * (seen["spec_s"] + seen["plain_s"]), seen


def test_a_new_batch_size_whose_borrowed_choice_is_wrong_corrects_it_within_a_few_steps():
    """Drafting pays at 1 request and costs at 8: batch 8 starts as batch 1 chose, measures plain decoding at once,
    and settles on it after a handful of verify steps instead of drafting until a probe comes round."""
    gov = SpecGovernor(GAMMA)
    run(gov, 1, 200, spec_cost=(2e-3, 4), plain_cost=(1e-3, 1))
    assert gov.chosen() == {1: True}
    seen = run(gov, 8, 40, spec_cost=(30e-3, 34), plain_cost=(2e-3, 8))
    assert gov.chosen() == {1: True, 8: False}
    assert seen["spec_steps"] <= 2 * MIN_STEPS, seen


def test_steps_with_no_tokens_do_not_divide_by_zero_and_bad_shares_are_refused():
    gov = SpecGovernor(GAMMA)
    for _ in range(MIN_STEPS):
        gov.record(2, True, 1e-3, 0)
    assert gov.drafts(2) == 0  # speculation measured (no tokens yet); plain decoding next
    with pytest.raises(ValueError, match="probe_share"):
        SpecGovernor(GAMMA, probe_share=0)
