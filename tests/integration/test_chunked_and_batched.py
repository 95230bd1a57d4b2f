"""Rungs 2 and 3: chunked prefill and batching produce the same greedy tokens as a one-shot prefill."""

from __future__ import annotations

import pytest

from conftest import HC4, MIXED, random_prompts
from helpers import assert_no_leaks, greedy, make_llm

# Prompts long enough to cross several HCA (16) groups; chunk budgets put boundaries inside C4 and HCA groups.
LENGTHS = [45, 77, 130]


@pytest.mark.parametrize("spec", [MIXED, HC4], ids=["mixed", "hc4"])
@pytest.mark.parametrize("budget", [5, 7, 13, 30])
def test_chunked_prefill_matches_one_shot(checkpoints, spec, budget):
    path, _ = checkpoints(spec)
    prompts = random_prompts(3, LENGTHS, seed=5)
    one_shot = [greedy(make_llm(path, max_num_batched_tokens=256), [p], 20)[0] for p in prompts]
    chunked_llm = make_llm(path, max_num_batched_tokens=budget, max_num_seqs=min(budget, 4))
    chunked = [greedy(chunked_llm, [p], 20)[0] for p in prompts]
    assert chunked == one_shot
    assert_no_leaks(chunked_llm)


@pytest.mark.parametrize("spec", [MIXED, HC4], ids=["mixed", "hc4"])
def test_batch_of_16_matches_alone(checkpoints, spec):
    path, _ = checkpoints(spec)
    lengths = [3, 9, 17, 33, 48, 64, 65, 81, 96, 110, 127, 128, 140, 150, 23, 70]
    prompts = random_prompts(16, lengths, seed=9)
    alone_llm = make_llm(path)
    alone = [greedy(alone_llm, [p], 24)[0] for p in prompts]
    # A small budget forces mixed steps: some requests decode while others are still prefilling.
    batched_llm = make_llm(path, max_num_seqs=16, max_num_batched_tokens=64)
    assert greedy(batched_llm, prompts, 24) == alone
    assert_no_leaks(batched_llm)
    assert_no_leaks(alone_llm)
