"""Seeded sampling climbs the equality ladder offline: one seed gives the same tokens alone, batched with seven
others, through chunked prefill and after a preemption, DSpark on as off; requests without a seed get their own."""

from __future__ import annotations

import pytest

from conftest import MIXED, random_prompts
from pdspark import SamplingParams
from pdspark.engine.factory import create_engine

BASE = dict(page_size=16, max_model_len=256, c128_page_size=2)
SAMPLED = dict(temperature=0.9, top_k=40, top_p=0.95, max_tokens=24, ignore_eos=True)


def run(engine, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[list[list[int]], list[int]]:
    """Every request to completion: `(tokens, times preempted)`, one entry per request."""
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    while engine.has_unfinished:
        engine.step()
    reqs = [engine.requests[i] for i in ids]
    out = [list(r.output_token_ids) for r in reqs], [r.num_preemptions for r in reqs]
    for i in ids:
        engine.release(i)
    return out


def others(n: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Companions of every kind: seeded, unseeded, greedy, another temperature."""
    prompts = random_prompts(n, [9, 50, 33, 90], seed=61)
    kinds = [dict(seed=5), dict(), dict(temperature=0.0), dict(temperature=1.3, seed=6)]
    params = [SamplingParams(**{**SAMPLED, "max_tokens": 30, **kinds[i % len(kinds)]}) for i in range(n)]
    return prompts, params


@pytest.mark.parametrize("speculative", [None, "dspark"], ids=["plain", "dspark"])
def test_seeded_tokens_do_not_depend_on_the_batch(draft_ckpt, speculative):
    """Alone, first of eight, last of eight (its prompt then comes from the prefix cache), and last of eight with its
    prompt computed in chunks beside the others' decode steps."""
    (prompt,) = random_prompts(1, [70], seed=60)
    params = SamplingParams(seed=1234, **SAMPLED)
    companions, companion_params = others(7)
    engine = create_engine(str(draft_ckpt), speculative=speculative, **BASE)
    (alone,), _ = run(engine, [prompt], [params])
    (batched, *_), _ = run(engine, [prompt, *companions], [params, *companion_params])
    *_, last = run(engine, [*companions, prompt], [*companion_params, params])[0]
    assert batched == alone and last == alone
    # Seven decoding companions take 7 x (1 + 3 drafts) = 28 of the 48-token budget, so the prompt is computed in
    # chunks of about 20 tokens; the budget still leaves every decoding request its full draft window (with DSpark,
    # the tokens of a seed depend on the window length: a bonus draw and an accept test are different draws).
    chunked = create_engine(str(draft_ckpt), speculative=speculative, max_num_batched_tokens=48, max_num_seqs=8,
                            enable_prefix_cache=False, **BASE)
    *_, last = run(chunked, [*companions, prompt], [*companion_params, params])[0]
    assert last == alone
    other_seed = run(engine, [prompt], [SamplingParams(**{**SAMPLED, "seed": 4321})])[0][0]
    assert other_seed != alone


def test_seeded_tokens_survive_a_preemption(checkpoints):
    """12 pages of 16 tokens for eight requests of ~100 tokens: the newest running request (the one under test) is
    preempted, later recomputes its prompt and the tokens it had, and its next draws are the ones it would have made
    anyway."""
    path, _ = checkpoints(MIXED)
    (prompt,) = random_prompts(1, [70], seed=60)
    params = SamplingParams(seed=1234, **SAMPLED)
    companions, companion_params = others(7)
    roomy = create_engine(str(path), **BASE)
    (alone,), _ = run(roomy, [prompt], [params])
    tight = create_engine(str(path), num_full_pages=12, enable_prefix_cache=False, **BASE)
    tokens, preemptions = run(tight, [*companions, prompt], [*companion_params, params])
    assert preemptions[-1] > 0
    assert tokens[-1] == alone


def test_the_effective_seed_is_the_clients_or_a_drawn_one(checkpoints):
    path, _ = checkpoints(MIXED)
    engine = create_engine(str(path), seed=None, **BASE)
    seeded = engine.add_request([5, 6, 7], SamplingParams(seed=77))
    unseeded = [engine.add_request([5, 6, 7], SamplingParams()) for _ in range(2)]
    assert engine.requests[seeded].seed == 77
    a, b = (engine.requests[i].seed for i in unseeded)
    assert isinstance(a, int) and a != b


def test_unseeded_requests_differ_across_engines(checkpoints):
    """Without an engine seed, each engine draws request seeds from OS entropy: two workers given the same request
    do not produce the same 'random' stream (and neither do two requests in one engine)."""
    path, _ = checkpoints(MIXED)
    prompt = random_prompts(1, [30], seed=62)[0]
    params = SamplingParams(temperature=3.0, max_tokens=16, ignore_eos=True)  # flat: streams rarely collide
    a = run(create_engine(str(path), seed=None, **BASE), [prompt, prompt], [params, params])[0]
    b = run(create_engine(str(path), seed=None, **BASE), [prompt, prompt], [params, params])[0]
    assert len({tuple(t) for t in a + b}) == 4


def test_an_engine_seed_makes_unseeded_requests_reproducible(checkpoints):
    """An explicit engine seed is the deterministic mode (tests, benchmarks): request seeds derive from it."""
    path, _ = checkpoints(MIXED)
    prompt = random_prompts(1, [30], seed=62)[0]
    params = SamplingParams(temperature=3.0, max_tokens=16, ignore_eos=True)  # flat: streams rarely collide
    a = run(create_engine(str(path), seed=11, **BASE), [prompt, prompt], [params, params])[0]
    b = run(create_engine(str(path), seed=11, **BASE), [prompt, prompt], [params, params])[0]
    c = run(create_engine(str(path), seed=12, **BASE), [prompt, prompt], [params, params])[0]
    assert a == b
    assert a[0] != a[1] and a != c
