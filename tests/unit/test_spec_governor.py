"""`SpecGovernor` picks, per batch size, the decode mode that measured fewer seconds per token, and keeps probing the
other one with a bounded share of the time."""

from __future__ import annotations

import math

import pytest

from pdspark.engine.spec_governor import (
    GAP_S,
    MIN_STEPS,
    PREDICTED_LOSS,
    PROBE_COUNTED,
    PROBE_SHARE,
    SETTLE_S,
    SETTLE_STEPS,
    SpecGovernor,
)

GAMMA = 5


def settling(step_seconds: float) -> int:
    """Steps of `step_seconds` after a switch that are not counted: those that begin before `SETTLE_STEPS` steps and
    `SETTLE_S` seconds of the mode have passed."""
    return max(SETTLE_STEPS, math.ceil(SETTLE_S / step_seconds - 1e-9))


def governor(**kwargs) -> SpecGovernor:
    """A governor whose steps come back to back (a frozen clock: no pause settles a mode again, whatever this
    machine's load while the test runs)."""
    return SpecGovernor(GAMMA, clock=lambda: 0.0, **kwargs)


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
    gov = governor()
    assert gov.drafts(1) == 0  # plain decoding is measured first
    # DSpark pays here: 2.2 ms for 4.3 tokens against 1 ms for one.
    seen = run(gov, 1, 2000, spec_cost=(2.2e-3, 4), plain_cost=(1.0e-3, 1))
    assert gov.chosen() == {1: True}
    assert seen["plain_s"] <= 1.5 * PROBE_SHARE * (seen["spec_s"] + seen["plain_s"]), seen
    assert seen["plain_steps"] > 2  # still probed, not just measured once


def test_a_verify_step_many_times_a_decode_step_is_probed_rarely():
    """A batch of 8 on the module path: a verify step 15x a decode step, 0.3x plain's tokens per second."""
    gov = governor()
    seen = run(gov, 8, 3000, spec_cost=(30e-3, 34), plain_cost=(2e-3, 8))
    assert gov.chosen() == {8: False}
    total = seen["spec_s"] + seen["plain_s"]
    explore = (MIN_STEPS + 1) * 30e-3  # drafting measured once, at once (nothing predicts it here)
    assert seen["spec_s"] - explore <= 1.5 * PROBE_SHARE * total, seen
    assert seen["spec_steps"] > 2


def test_batch_sizes_are_measured_apart_and_a_change_in_costs_is_followed():
    gov = governor()
    run(gov, 1, 500, spec_cost=(2e-3, 4), plain_cost=(1e-3, 1))
    run(gov, 8, 500, spec_cost=(30e-3, 34), plain_cost=(2e-3, 8))
    assert gov.chosen() == {1: True, 8: False}
    # The drafts stop paying at batch 1 (another prompt mix, a longer context): the probes see it.
    run(gov, 1, 2000, spec_cost=(4e-3, 2), plain_cost=(1e-3, 1))
    assert gov.chosen() == {1: False, 8: False}


def test_the_steps_just_after_a_switch_and_a_few_slow_steps_do_not_decide():
    """A mode runs slower for a while after the other one (a plain step of dsv4-tiny after verify steps: 2-3x, then
    1.6x for ~5 ms on a Zen 4 VM): the steps that begin within `SETTLE_S` of a switch are not counted. And the
    median step makes the estimate: slow steps (a GC pause, a neighbour's burst) move it only once they are most of
    the window."""
    gov = governor()
    for _ in range(settling(2e-3) + MIN_STEPS):  # (the first steps at a batch size settle it too)
        gov.record(1, True, 2e-3, 4)  # 0.5 ms a token
    assert gov.chosen() == {}  # plain decoding not measured yet
    for _ in range(SETTLE_STEPS):  # the steps that settle plain decoding after the switch, SETTLE_S and more
        gov.record(1, False, 1.1 * SETTLE_S / SETTLE_STEPS, 1)  # ~1 ms a token: dearer than drafting
    for seconds in (9e-3, 0.4e-3, 9e-3, 0.4e-3, 0.4e-3):
        gov.record(1, False, seconds, 1)  # 0.4 ms a token, two slow steps among them
    assert gov.chosen() == {1: False}
    for _ in range(2):
        gov.record(1, False, 9e-3, 1)  # slow steps are now most of the window: they count
    assert gov.chosen() == {1: True}


def test_a_probe_runs_the_steps_that_settle_its_mode_then_the_counted_ones():
    """Drafting chosen (2 ms for 4 tokens against 0.9 ms for one): each probe of plain decoding is a burst of the
    steps that settle it after the switch, then `PROBE_COUNTED` more."""
    gov = governor()
    run(gov, 1, 40, spec_cost=(2e-3, 4), plain_cost=(0.9e-3, 1))
    assert gov.chosen() == {1: True}
    modes = []
    for _ in range(3000):
        speculate = gov.drafts(1) > 0
        modes.append(speculate)
        gov.record(1, speculate, *((2e-3, 4) if speculate else (0.9e-3, 1)))
    bursts, run_length = [], 0
    for a, b in zip(modes, modes[1:] + [True]):
        run_length = 0 if a else run_length + 1
        if not a and b:
            bursts.append(run_length)
    assert len(bursts) > 3 and set(bursts) == {settling(0.9e-3) + PROBE_COUNTED}, bursts


def test_a_plain_estimate_taken_while_the_engine_warmed_up_is_corrected_by_the_probes():
    """An engine's first plain steps run slow (cold caches, first calls): 1.2 ms against 0.3 ms once warm. Drafting
    (0.5 ms a token) is chosen on that estimate; the probes of plain decoding then run until they count steady
    steps, however long its settling takes at the true step time, and plain decoding is chosen."""
    gov = governor()
    plain_steps = 0
    for _ in range(3000):
        speculate = gov.drafts(1) > 0
        if speculate:
            gov.record(1, True, 2e-3, 4)
        else:
            gov.record(1, False, 1.2e-3 if plain_steps < settling(1.2e-3) + MIN_STEPS else 0.3e-3, 1)
            plain_steps += 1
        if plain_steps == settling(1.2e-3) + MIN_STEPS:
            assert gov.chosen() in ({}, {1: True})  # measured slow: drafting looks cheaper
    assert gov.chosen() == {1: False}


def test_a_pause_between_steps_settles_the_mode_again():
    """After a pause (no request, other work: the machine cools) a mode runs slow for a while, as after a switch:
    the steps after a pause of more than `GAP_S` are not counted until the mode has settled again."""
    now = [0.0]
    gov = SpecGovernor(GAMMA, clock=lambda: now[0])

    def step() -> bool:
        speculate = gov.drafts(1) > 0
        seconds = 2e-3 if speculate else 1e-3
        now[0] += seconds
        gov.record(1, speculate, seconds, 4 if speculate else 1)
        return speculate

    while gov.chosen() != {1: True}:  # plain decoding measured, then drafting (0.5 ms a token against 1)
        step()
    spec = gov._batches[1].speculate.seconds
    counted = len(spec)
    assert step() and len(spec) == counted + 1  # back to back: counted
    now[0] += 2 * GAP_S
    assert all(step() for _ in range(settling(2e-3))) and len(spec) == counted + 1  # settling after the pause
    assert step() and len(spec) == counted + 2


def test_a_step_with_prompts_in_it_follows_the_choice_without_exploring():
    """Such steps are not timed: exploring there would draft (at large verify cost) and never learn."""
    gov = governor()
    assert gov.drafts(3, steady=False) == 0  # nothing known at 3 yet: no drafts
    assert gov.drafts(0, steady=False) == 0 and 0 not in gov._batches  # a step of prompts alone
    run(gov, 3, 200, spec_cost=(2e-3, 4), plain_cost=(1e-3, 1))
    assert gov.chosen() == {3: True}
    assert all(gov.drafts(3, steady=False) == GAMMA for _ in range(100))  # and no probe among them


def test_a_new_batch_size_measures_plain_decoding_first_and_probes_drafting_within_its_share():
    """Batch sizes come and go as requests start and end: a new one does not pay for exploring a bad mode first."""
    gov = governor()
    run(gov, 8, 500, spec_cost=(30e-3, 34), plain_cost=(2e-3, 8))
    assert gov.drafts(6) == 0  # plain first (a larger size predicts nothing here)
    seen = run(gov, 6, 3000, spec_cost=(25e-3, 26), plain_cost=(1.6e-3, 6))
    assert gov.chosen() == {6: False, 8: False}  # measured at 6 too
    assert seen["spec_s"] <= 1.5 * PROBE_SHARE * (seen["spec_s"] + seen["plain_s"]), seen


def test_a_batch_size_where_drafting_is_predicted_to_lose_is_not_explored():
    """A Zen 4 VM where dsv4-tiny's weights sit in cache (bench_dspark): at 1 request a verify step and its proposal
    cost 2.0 ms for 4.3 tokens against 0.45 ms for one; a plain step of 8 requests costs 1.5 ms, so a verify step of
    8 would cost at least 2.0 + 6 x (1.5 - 0.45) ms for 34.7 tokens, 1.28x plain's time a token (it measured 10.6 ms:
    1.6x). A 128-step batch-8 run then drafts at no step: the five verify steps that measure drafting there cost a
    quarter of such a run."""
    gov = governor()
    run(gov, 1, 300, spec_cost=(2.0e-3, 4.34), plain_cost=(0.45e-3, 1))
    assert gov.chosen() == {1: False}
    seen = run(gov, 8, 128, spec_cost=(10.6e-3, 34.7), plain_cost=(1.5e-3, 8))
    assert seen["spec_steps"] == 0, seen
    # Probes still come, within their share: a long run measures drafting there and keeps plain decoding.
    seen = run(gov, 8, 6000, spec_cost=(10.6e-3, 34.7), plain_cost=(1.5e-3, 8))
    assert gov.chosen() == {1: False, 8: False}
    assert 0 < seen["spec_s"] <= 1.5 * PROBE_SHARE * (seen["spec_s"] + seen["plain_s"]), seen


def test_a_batch_size_where_drafting_may_pay_is_measured_at_once():
    """A host where decode reads its weights from memory (a Xeon VM: 1.7 ms a plain step at 1 request, 2.5 ms at 8,
    a verify step and its proposal 3.7 ms for 4.3 tokens): drafting at 8 is predicted at most 0.8x plain's time a
    token, so it is measured once plain decoding is, and kept where it pays."""
    gov = governor()
    run(gov, 1, 300, spec_cost=(3.7e-3, 4.34), plain_cost=(1.7e-3, 1))
    assert gov.chosen() == {1: True}
    seen = run(gov, 8, 60, spec_cost=(8e-3, 34.7), plain_cost=(2.5e-3, 8))
    assert seen["plain_steps"] <= settling(2.5e-3) + MIN_STEPS, seen
    assert gov.chosen() == {1: True, 8: True}


@pytest.mark.parametrize("verify_ms, explored", [(1.6, False), (0.5, True)])
def test_the_prediction_counts_gamma_plus_one_rows_a_request_against_the_margin(verify_ms, explored):
    """Drafting at 4 predicted from 2: the verify step grows by (gamma + 1) x what the plain step grew (0.4 ms), for
    twice the tokens. 1.6 ms at 2 predicts (1.6 + 2.4) / 8.6 = 0.47 ms a token against plain's 0.325 (over the
    margin); 0.5 ms predicts 0.34, within it."""
    gov = governor()
    run(gov, 2, 300, spec_cost=(verify_ms * 1e-3, 4.3), plain_cost=(0.9e-3, 2))
    run(gov, 4, settling(1.3e-3) + MIN_STEPS, spec_cost=(1.0, 1), plain_cost=(1.3e-3, 4))
    predicted = (verify_ms + 6 * 0.4) / 8.6
    assert (predicted > PREDICTED_LOSS * 1.3 / 4) == (not explored)
    assert (gov.drafts(4) > 0) == explored


def test_steps_with_no_tokens_do_not_divide_by_zero_and_bad_shares_are_refused():
    gov = governor()
    for _ in range(settling(1e-3) + 1 + MIN_STEPS):  # (the first steps settle the mode)
        gov.record(2, True, 1e-3, 0)
    assert gov.drafts(2) == 0  # speculation measured (no tokens yet); plain decoding next
    for _ in range(settling(1e-3) + 1 + MIN_STEPS):
        gov.record(2, False, 1e-3, 0)
    assert gov.chosen() == {2: True}  # neither gave a token: the same cost, and no division by zero
    with pytest.raises(ValueError, match="probe_share"):
        governor(probe_share=0)
