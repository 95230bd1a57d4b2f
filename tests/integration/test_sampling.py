"""Sampling: filters, seeds (alone and batched), stop conditions, logprobs, and no leaks on early stops."""

from __future__ import annotations

import pytest
import torch

from conftest import MIXED, random_prompts
from helpers import assert_no_leaks, make_llm
from pdspark import SamplingParams
from pdspark.engine.sampler import filter_logits


def test_top_k_keeps_exactly_k():
    logits = torch.tensor([1.0, 5.0, 3.0, 4.0, 2.0])
    kept = torch.isfinite(filter_logits(logits, SamplingParams(top_k=2)))
    assert kept.tolist() == [False, True, False, True, False]


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    kept = torch.isfinite(filter_logits(probs.log(), SamplingParams(top_p=0.75)))
    assert kept.tolist() == [True, True, False, False]
    # The most likely token always stays, even when it alone exceeds top_p.
    kept = torch.isfinite(filter_logits(probs.log(), SamplingParams(top_p=0.1)))
    assert kept.tolist() == [True, False, False, False]


def test_temperature_scales_logits():
    logits = torch.tensor([1.0, 2.0])
    assert torch.allclose(filter_logits(logits, SamplingParams(temperature=0.5)), logits * 2)


@pytest.fixture(scope="module")
def llm(checkpoints):
    path, _ = checkpoints(MIXED)
    return make_llm(path)


def test_same_seed_same_tokens_alone_and_batched(llm):
    prompts = random_prompts(6, [12, 40, 70], seed=1)
    params = [SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=100 + i, max_tokens=20) for i in range(6)]
    alone = [llm.generate(prompt_token_ids=[p], sampling_params=sp)[0].token_ids for p, sp in zip(prompts, params)]
    batched = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    assert batched == alone
    again = llm.generate(prompt_token_ids=[prompts[0]], sampling_params=params[0])[0].token_ids
    assert again == alone[0]
    other = llm.generate(prompt_token_ids=[prompts[0]], sampling_params=SamplingParams(
        temperature=0.9, top_p=0.95, top_k=50, seed=7, max_tokens=20))[0].token_ids
    assert other != alone[0]
    assert_no_leaks(llm)


def test_sampling_follows_the_distribution(llm):
    """Empirical next-token frequencies match the model's softmax (temperature 1, many seeds)."""
    prompt = random_prompts(1, [20], seed=4)[0]
    first = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
        temperature=0, max_tokens=1, logprobs=20))[0].logprobs[0]
    n = 400
    outs = llm.generate(
        prompt_token_ids=[prompt] * n,
        sampling_params=[SamplingParams(temperature=1.0, seed=s, max_tokens=1) for s in range(n)],
    )
    counts = torch.bincount(torch.tensor([o.token_ids[0] for o in outs]), minlength=256).float()
    top = max(first.top, key=first.top.get)
    expected = n * torch.tensor(first.top[top]).exp()
    assert abs(counts[top] - expected) < 4 * (expected * (1 - expected / n)).sqrt() + 1


def test_max_tokens_and_finish_reason(llm):
    out = llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(
        temperature=0, max_tokens=7, ignore_eos=True))[0]
    assert len(out.token_ids) == 7 and out.finish_reason == "length"


def test_stop_token_ids(llm):
    prompt = random_prompts(1, [30], seed=2)[0]
    free = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
        temperature=0, max_tokens=20, ignore_eos=True))[0].token_ids
    stop_at = free[5]
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
        temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_at]))[0]
    assert out.token_ids == free[: free.index(stop_at) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at
    assert_no_leaks(llm)


def test_eos_stops_unless_ignored(checkpoints):
    path, _ = checkpoints(MIXED)
    llm = make_llm(path)
    prompts = random_prompts(40, [8, 16, 24], seed=3)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0, max_tokens=40))
    stopped = [o for o in outs if o.finish_reason == "stop"]
    assert stopped, "some greedy continuation should reach EOS (token 1) in this model"
    for o in stopped:
        assert o.token_ids[-1] == 1 and 1 not in o.token_ids[:-1]
    assert_no_leaks(llm)


def test_stop_string_truncates_text_and_frees_pages(llm):
    prompt_ids = random_prompts(1, [25], seed=6)[0]
    free = llm.generate(prompt_token_ids=[prompt_ids], sampling_params=SamplingParams(
        temperature=0, max_tokens=30, ignore_eos=True))[0]
    assert free.text is not None and len(free.text) >= 12
    stop = free.text[8:11]
    cut = free.text.find(stop)
    out = llm.generate(prompt_token_ids=[prompt_ids], sampling_params=SamplingParams(
        temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == free.text[:cut]
    assert len(out.token_ids) < len(free.token_ids)
    assert_no_leaks(llm)


def test_logprobs_are_consistent(llm):
    out = llm.generate(prompt_token_ids=[[9, 8, 7, 6]], sampling_params=SamplingParams(
        temperature=0, max_tokens=5, logprobs=4, ignore_eos=True))[0]
    assert len(out.logprobs) == 5
    for token, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == token and len(lp.top) == 4
        assert lp.logprob == pytest.approx(max(lp.top.values()))  # greedy picks the top token
        assert all(v <= 0 for v in lp.top.values())


def test_text_prompts_round_trip(llm):
    out = llm.generate(["def fib(n):"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert out.prompt == "def fib(n):"
    assert llm.tokenizer.decode(out.prompt_token_ids) == "def fib(n):"
    assert out.text == llm.tokenizer.decode(out.token_ids)
    assert isinstance(out.text, str) and len(out.token_ids) == 8
