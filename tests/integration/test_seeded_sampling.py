"""Seeded sampling climbs the equality ladder offline: one seed gives the same tokens alone, batched with seven
others, through chunked prefill and after a preemption; with DSpark on they are the tokens of DSpark off, whatever
the number of drafts per verify step and wherever a stream restarts; requests without a seed get their own."""

from __future__ import annotations

from dataclasses import replace

import pytest

from conftest import MIXED, random_prompts
from pdspark import SamplingParams
from pdspark.engine.factory import create_engine
from pdspark.testing.random_draft import add_random_draft

BASE = dict(page_size=16, max_model_len=256, c128_page_size=2)
SAMPLED = dict(temperature=0.9, top_k=40, top_p=0.95, max_tokens=24, ignore_eos=True)
# The DSpark-on-equals-off rung: plain temperatures, each filter alone, and both together.
VARIANTS = {
    "t1.0": dict(temperature=1.0),
    "t0.8-top_p": dict(temperature=0.8, top_p=0.9),
    "t0.8-top_k": dict(temperature=0.8, top_k=20),
    "t0.7-both": dict(temperature=0.7, top_k=40, top_p=0.95),
}


@pytest.fixture(scope="module")
def draft5(checkpoints, tmp_path_factory):
    """MIXED with a random 5-token draft: verify windows of 1 to 5 drafts."""
    path, _ = checkpoints(MIXED)
    dst = tmp_path_factory.mktemp("draft5") / "ckpt"
    add_random_draft(path, dst, gamma=5)
    return dst


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
    # chunks of about 20 tokens beside their verify steps.
    chunked = create_engine(str(draft_ckpt), speculative=speculative, max_num_batched_tokens=48, max_num_seqs=8,
                            enable_prefix_cache=False, **BASE)
    *_, last = run(chunked, [*companions, prompt], [*companion_params, params])[0]
    assert last == alone
    other_seed = run(engine, [prompt], [SamplingParams(**{**SAMPLED, "seed": 4321})])[0][0]
    assert other_seed != alone


@pytest.mark.parametrize("sampling", VARIANTS.values(), ids=VARIANTS.keys())
def test_dspark_draws_the_tokens_of_plain_seeded_sampling(draft5, sampling):
    """Several prompts and seeds, batched and one at a time: DSpark on gives DSpark off's tokens, token for token."""
    prompts = random_prompts(4, [9, 33, 70, 101], seed=63)
    params = [SamplingParams(seed=70 + i, max_tokens=32, ignore_eos=True, **sampling) for i in range(4)]
    plain, _ = run(create_engine(str(draft5), **BASE), prompts, params)
    spec = create_engine(str(draft5), speculative="dspark", **BASE)
    batched, _ = run(spec, prompts, params)
    alone = [run(spec, [p], [sp])[0][0] for p, sp in zip(prompts, params)]
    assert batched == plain
    assert alone == plain
    assert spec.spec.verify_steps > 0


def test_drafts_per_verify_step_do_not_change_seeded_tokens(draft5):
    """1, 3 or 5 drafts per verify step group the same positions differently; the tokens are the same."""
    prompts = random_prompts(3, [21, 64, 45], seed=65)
    params = [SamplingParams(seed=80 + i, max_tokens=32, ignore_eos=True, **VARIANTS["t0.7-both"]) for i in range(3)]
    plain, _ = run(create_engine(str(draft5), **BASE), prompts, params)
    for n in (1, 3, 5):
        spec = create_engine(str(draft5), speculative="dspark", num_speculative_tokens=n, **BASE)
        assert run(spec, prompts, params)[0] == plain, n


def test_a_stream_restarted_mid_generation_goes_on_with_the_same_tokens(draft5):
    """A stream moved to another decode worker restarts there from its prompt and the tokens so far: a prefill
    that samples the next token plainly, at whatever position the move happened, then verify steps from there. Its
    tokens are those of the uninterrupted run, DSpark on."""
    (prompt,) = random_prompts(1, [40], seed=66)
    params = SamplingParams(seed=91, max_tokens=40, ignore_eos=True, **VARIANTS["t1.0"])
    (full,), _ = run(create_engine(str(draft5), speculative="dspark", **BASE), [prompt], [params])
    other = create_engine(str(draft5), speculative="dspark", **BASE)
    for cut in (1, 2, 7, 13, 26):
        (rest,), _ = run(other, [prompt + full[:cut]], [replace(params, max_tokens=len(full) - cut)])
        assert rest == full[cut:], cut


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
