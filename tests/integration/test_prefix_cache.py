"""Rung 4: prefix-cache hits give the same tokens as cold runs; the cache's bookkeeping stays exact."""

from __future__ import annotations

import pytest

from conftest import HC4, MIXED, random_prompts
from helpers import GREEDY, assert_no_leaks, make_llm
from pdspark import SamplingParams

# c128_page_size 2: one C128 page covers 32 tokens (two 16-token pages), so page and C128 boundaries differ.
OPTS = dict(c128_page_size=2, max_model_len=512)


def run(llm, prompts, max_tokens=16, logprobs=None):
    params = SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **GREEDY)
    return llm.generate(prompt_token_ids=prompts, sampling_params=params)


def cold(path, prompts, max_tokens=16):
    llm = make_llm(path, enable_prefix_cache=False, **OPTS)
    return [o.token_ids for o in run(llm, prompts, max_tokens)]


@pytest.mark.parametrize("spec", [MIXED, HC4], ids=["mixed", "hc4"])
def test_shared_system_prompt_many_suffixes(checkpoints, spec):
    path, _ = checkpoints(spec)
    (system,) = random_prompts(1, [150], seed=1)
    suffixes = random_prompts(8, [5, 12, 20, 33], seed=2)
    prompts = [system + s for s in suffixes]
    llm = make_llm(path, **OPTS)
    warm = [run(llm, [p])[0] for p in prompts]  # one at a time: every request after the first hits the cache
    assert [o.token_ids for o in warm] == cold(path, prompts)
    assert warm[0].num_cached_tokens == 0
    for o in warm[1:]:
        assert o.num_cached_tokens == 128  # the last C128 (32-token) boundary inside the 150 shared tokens
    assert_no_leaks(llm)


def test_multi_turn_chat_extends_each_turn(checkpoints):
    path, _ = checkpoints(MIXED)
    llm = make_llm(path, **OPTS)
    turns = random_prompts(5, [9, 17, 30], seed=3)
    history: list[int] = []
    warm_tokens, prompts = [], []
    for i, user in enumerate(turns):
        prompt = history + user
        out = run(llm, [prompt], max_tokens=12)[0]
        if i:
            # The previous turn's prompt and reply are cached, up to the last C128 boundary before its end.
            assert out.num_cached_tokens == (len(history) - 1) // 32 * 32
        prompts.append(prompt)
        warm_tokens.append(out.token_ids)
        history = prompt + out.token_ids
    assert warm_tokens == cold(path, prompts, max_tokens=12)
    assert_no_leaks(llm)


@pytest.mark.parametrize("shared", [31, 32, 33, 47, 48, 49, 64, 65])
def test_boundaries_of_the_shared_part(checkpoints, shared):
    """The shared part ends just before, at, and after a C128 boundary (32, 64) and a page boundary (48)."""
    path, _ = checkpoints(MIXED)
    (base,) = random_prompts(1, [shared], seed=4)
    a, b = random_prompts(2, [20], seed=5)
    prompts = [base + a, base + b]
    llm = make_llm(path, **OPTS)
    first, second = run(llm, [prompts[0]])[0], run(llm, [prompts[1]])[0]
    assert [first.token_ids, second.token_ids] == cold(path, prompts)
    assert second.num_cached_tokens == shared // 32 * 32
    assert second.num_cached_tokens % 32 == 0  # C128-aligned, hence page-aligned
    assert_no_leaks(llm)


def test_logprobs_equal_with_and_without_cache(checkpoints):
    path, _ = checkpoints(HC4)
    (system,) = random_prompts(1, [100], seed=6)
    prompts = [system + s for s in random_prompts(3, [7, 19], seed=7)]
    llm = make_llm(path, **OPTS)
    warm = [run(llm, [p], logprobs=2)[0] for p in prompts]
    ref = run(make_llm(path, enable_prefix_cache=False, **OPTS), prompts, logprobs=2)
    assert warm[1].num_cached_tokens > 0
    for w, r in zip(warm, ref):
        for lw, lr in zip(w.logprobs, r.logprobs):
            assert lw.token_id == lr.token_id and abs(lw.logprob - lr.logprob) < 1e-5


def test_eviction_between_turns(checkpoints):
    path, _ = checkpoints(MIXED)
    # A small pool: each new conversation must evict older cached turns to fit.
    llm = make_llm(path, num_full_pages=24, num_swa_pages=16, max_num_seqs=2, max_num_batched_tokens=64, **OPTS)
    convs = [random_prompts(1, [100], seed=10 + i)[0] for i in range(4)]
    prompts, outs = [], []
    for turn in range(2):
        for c in convs:
            prompt = c + [7] * (turn * 5 + 1)
            prompts.append(prompt)
            outs.append(run(llm, [prompt], max_tokens=8)[0].token_ids)
            llm.engine.check_integrity()
    assert outs == cold(path, prompts, max_tokens=8)
    assert llm.engine.kv.tree is not None and llm.engine.kv.usage()["full"].used > 0  # of 24
    assert_no_leaks(llm)


def test_batched_requests_share_a_prefix(checkpoints):
    """Requests admitted together, one of them cached: everything stays exact and leak-free."""
    path, _ = checkpoints(MIXED)
    (system,) = random_prompts(1, [90], seed=8)
    prompts = [system + s for s in random_prompts(6, [4, 11, 26], seed=9)]
    llm = make_llm(path, max_num_batched_tokens=48, **OPTS)
    run(llm, prompts[:1])
    warm = [o.token_ids for o in run(llm, prompts)]
    assert warm == cold(path, prompts)
    assert_no_leaks(llm)
