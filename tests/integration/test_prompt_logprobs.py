"""Prompt logprobs (`SamplingParams.prompt_logprobs`) from the engine: position i's entry is the logprob of prompt
token i given the tokens before it (None for the first), with the top-k; chunked prefill gives those of one
prefill; a request that asks for them computes its whole prompt (no prefix-cache hit skips a position), with
DSpark on as off."""

from __future__ import annotations

import pytest
import torch

from conftest import random_prompts
from helpers import make_llm, prompt_logits
from pdspark import SamplingParams


def test_prompt_logprobs_are_the_prefills_and_survive_chunking_the_cache_and_dspark(draft_ckpt):
    prompt = random_prompts(1, [150], seed=91)[0]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, prompt_logprobs=3)
    with make_llm(draft_ckpt) as one_chunk, make_llm(draft_ckpt, max_num_batched_tokens=48,
                                                     speculative="dspark") as chunked:
        ref = torch.log_softmax(prompt_logits(one_chunk, prompt), dim=-1)  # [P, V]: row i predicts token i + 1
        first = one_chunk.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
        plain = one_chunk.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
            max_tokens=6, temperature=0, ignore_eos=True))[0]
        assert first.token_ids == plain.token_ids  # (the extra logits rows leave the sampled row alone)
        lps = first.prompt_logprobs
        assert lps[0] is None and len(lps) == len(prompt)
        for i in range(1, len(prompt)):
            assert lps[i].token_id == prompt[i] and abs(lps[i].logprob - float(ref[i - 1, prompt[i]])) < 1e-5
            assert list(lps[i].top) == torch.topk(ref[i - 1], 3).indices.tolist()
        again = one_chunk.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
        assert again.num_cached_tokens == 0 and again.prompt_logprobs == lps  # recomputed, not taken from the cache
        spec = chunked.generate(prompt_token_ids=[prompt], sampling_params=params)[0]  # 4 chunks, DSpark on
        assert spec.token_ids == first.token_ids
        for a, b in zip(spec.prompt_logprobs[1:], lps[1:]):
            # (chunked: the attention sums run over other blocks; the logits agree to fp32 rounding)
            assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, rel=1e-5, abs=1e-5)


def test_a_scoring_request_computes_its_prompt_alone_so_its_logprobs_are_exactly_its_solo_runs(draft_ckpt):
    """Prompt logprobs must not depend on what the request is batched with (BLAS bits can): a request that asks for
    them runs its prompt's chunks in steps of its own, others pausing. Scored in a batch with other scoring and
    plain requests, each equals its run alone, bit for bit."""
    prompts = random_prompts(4, [90, 40, 130, 60], seed=93)
    score = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=1)
    plain = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    with make_llm(draft_ckpt, max_num_batched_tokens=64) as llm:
        alone = [llm.generate(prompt_token_ids=[p], sampling_params=score)[0].prompt_logprobs for p in prompts]
        engine = llm.engine
        steps: list[list[tuple[str, bool]]] = []  # per step: (request id, computing a scoring prompt) per chunk
        schedule = engine.scheduler.schedule

        def recorded():
            out = schedule()
            steps.append([(c.request.req_id, c.request.prompt_logprobs is not None
                           and c.start < len(c.request.prompt_token_ids)) for c in out.chunks])
            return out

        engine.scheduler.schedule = recorded
        for i, p in enumerate(prompts):
            engine.add_request(p, plain, request_id=f"plain{i}")
            engine.add_request(p, score, request_id=f"score{i}")
        done: dict[str, object] = {}
        while engine.has_unfinished:
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = o
                    engine.release(o.request_id)
    scoring_steps = [s for s in steps if any(scoring for _, scoring in s)]
    assert len(scoring_steps) >= 4 and all(len(s) == 1 for s in scoring_steps)
    assert any(len(s) > 1 for s in steps)  # (the plain requests were batched together)
    for i in range(len(prompts)):
        assert done[f"score{i}"].prompt_logprobs == alone[i]  # (==: TokenLogprobs compare their floats exactly)
