"""Continuous batching under memory pressure: admission waits, preemption recomputes, results stay exact."""

from __future__ import annotations

import pytest

from conftest import MIXED, random_prompts
from helpers import assert_no_leaks, greedy, make_llm
from pdspark import SamplingParams
from pdspark.engine.request import Request
from pdspark.engine.scheduler import Scheduler


def test_admission_waits_when_pages_run_out(checkpoints):
    path, _ = checkpoints(MIXED)
    prompts = random_prompts(8, [60, 90, 40], seed=12)
    expected = greedy(make_llm(path), prompts, 16)
    # 12 pages of 16 tokens: at most ~2 of these requests fit at once; the rest must wait their turn.
    tight = make_llm(path, num_full_pages=12, num_swa_pages=8, max_num_seqs=8, max_num_batched_tokens=64)
    engine = tight.engine
    ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)) for p in prompts]
    most_running = 0
    while engine.has_unfinished:
        engine.step()
        most_running = max(most_running, len(engine.scheduler.running))
        engine.check_integrity()
    assert most_running < len(prompts)
    assert [engine.requests[i].output_token_ids for i in ids] == expected
    assert_no_leaks(tight)


def test_preemption_recomputes_exactly(checkpoints):
    path, _ = checkpoints(MIXED)
    prompts = random_prompts(4, [30, 45], seed=13)
    expected = greedy(make_llm(path), prompts, 60)
    # Prompts fit together, but their growth does not: decoding must preempt and recompute someone.
    tight = make_llm(path, num_full_pages=13, max_num_seqs=4, max_num_batched_tokens=128)
    engine = tight.engine
    ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)) for p in prompts]
    while engine.has_unfinished:
        engine.step()
    assert sum(engine.requests[i].num_preemptions for i in ids) > 0
    assert [engine.requests[i].output_token_ids for i in ids] == expected
    assert_no_leaks(tight)


@pytest.mark.parametrize("prefix_cache, most", [(False, 2), (True, 3)])
def test_swa_pages_are_released_while_running(checkpoints, prefix_cache, most):
    path, _ = checkpoints(MIXED)
    llm = make_llm(path, max_num_seqs=1, enable_prefix_cache=prefix_cache)
    engine = llm.engine
    engine.add_request(random_prompts(1, [150])[0], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    held = []
    while engine.has_unfinished:
        engine.step()
        if engine.scheduler.running:
            req = engine.scheduler.running[0]
            held.append(sum(p is not None for i, p in enumerate(req.pages.swa_pages) if i >= req.pages.num_borrowed))
            # Window of 8 plus the previous CSA group: two 16-token pages once past the prefill (one more with the
            # prefix cache, which keeps the window before the last cacheable boundary).
            if req.num_computed_tokens > 150:
                assert held[-1] <= most
    assert_no_leaks(llm)


def test_abort_frees_everything(checkpoints):
    path, _ = checkpoints(MIXED)
    llm = make_llm(path)
    engine = llm.engine
    ids = [engine.add_request(p, SamplingParams(max_tokens=50)) for p in random_prompts(5, [20, 70])]
    engine.step()
    engine.step()
    for i in ids:
        assert engine.abort(i)
    assert not engine.has_unfinished
    assert all(engine.requests[i].finish_reason == "abort" for i in ids)
    assert_no_leaks(llm)


def test_a_decode_step_that_fits_runs_instead_of_preempting(checkpoints):
    """With the C128 pool one page short of a full verify window, a request still decodes its one token."""
    path, _ = checkpoints(MIXED)
    # 16-token pages and one C128 page per 16 tokens; 3 C128 pages in all.
    llm = make_llm(path, num_c128_pages=3, enable_prefix_cache=False)
    kv = llm.engine.kv
    sched = Scheduler(llm.engine.config.scheduler, kv, num_drafts=3)
    reqs = [Request(str(i), p, SamplingParams(max_tokens=10)) for i, p in enumerate(random_prompts(2, [30]))]
    for req in reqs:
        sched.add(req)
    out = sched.schedule()  # two 30-token prompts: one C128 page each
    assert [(c.start, c.num_tokens) for c in out.chunks] == [(0, 30), (0, 30)]
    sched.update(out.chunks, [30, 30])
    for req in reqs:
        req.output_token_ids.append(7)

    out = sched.schedule()
    # A's verify window [30, 34) closes its second group and takes the last C128 page. B's would too; what still
    # fits B is positions [30, 31): its plain decode token, without drafts.
    assert [(c.request.req_id, c.start, c.num_tokens, c.num_drafts) for c in out.chunks] == [
        ("0", 30, 4, 3), ("1", 30, 1, 0)
    ]
    assert sched.running == reqs and not sched.waiting
    assert [r.num_preemptions for r in reqs] == [0, 0]
    assert kv.c128.num_free == 0


def test_a_prefill_chunk_is_cut_at_the_last_token_that_fits(checkpoints):
    path, _ = checkpoints(MIXED)
    llm = make_llm(path, num_c128_pages=2, enable_prefix_cache=False)
    sched = Scheduler(llm.engine.config.scheduler, llm.engine.kv)
    (prompt,) = random_prompts(1, [60])
    sched.add(Request("0", prompt, SamplingParams(max_tokens=1)))
    out = sched.schedule()
    # Two C128 pages cover groups 0 and 1; position 47 closes group 2 and would need a third.
    assert [(c.start, c.num_tokens) for c in out.chunks] == [(0, 47)]
