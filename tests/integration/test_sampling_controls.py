"""The sampling controls through the engine (penalties, min-p, min_tokens, logit bias, banned tokens): the equality
ladder holds with them, since each position's controls read only the tokens before it: DSpark on equals off, greedy
and seeded, and the controls do change what is generated."""

from __future__ import annotations

from dataclasses import replace

from conftest import random_prompts
from helpers import make_llm
from pdspark import SamplingParams

CONTROLS = dict(presence_penalty=0.5, frequency_penalty=0.4, repetition_penalty=1.3, min_tokens=8,
                logit_bias={5: 3.0, 9: -2.0}, banned_token_ids=(7, 11))
PARAMS = [SamplingParams(max_tokens=32, temperature=0, **CONTROLS),
          SamplingParams(max_tokens=32, temperature=0.8, top_k=40, min_p=0.05, seed=17, **CONTROLS)]


def _tokens(llm, prompts, params):
    return [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]


def test_dspark_gives_the_plain_tokens_with_every_control_on(draft_ckpt):
    prompts = random_prompts(4, [12, 40, 70, 33], seed=81)
    with make_llm(draft_ckpt) as plain, make_llm(draft_ckpt, speculative="dspark") as spec:
        for params in PARAMS:
            want = _tokens(plain, prompts, params)
            assert _tokens(spec, prompts, params) == want
            assert not {7, 11} & {t for out in want for t in out}  # banned, never sampled
            neutral = replace(params, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0,
                              min_tokens=0, logit_bias=None, banned_token_ids=(), min_p=0.0)
            assert _tokens(plain, prompts, neutral) != want  # (the controls do something)
        assert spec.engine.spec.verify_steps > 0


def test_a_stop_string_is_kept_in_the_text_when_asked_and_sixteen_are_allowed(draft_ckpt):
    with make_llm(draft_ckpt) as llm:
        plain = llm.generate(prompt_token_ids=[[5, 6, 7, 8]], sampling_params=SamplingParams(
            max_tokens=24, temperature=0, ignore_eos=True))[0]
        stop = plain.text[6:9]  # three characters the greedy text holds
        assert stop and plain.text.find(stop) >= 0
        stops = [stop] + [f"\x00never{i}" for i in range(15)]
        cut, kept = (llm.generate(prompt_token_ids=[[5, 6, 7, 8]], sampling_params=SamplingParams(
            max_tokens=24, temperature=0, ignore_eos=True, stop=stops, include_stop_str_in_output=keep))[0]
            for keep in (False, True))
    end = plain.text.find(stop)
    assert cut.text == plain.text[:end] and kept.text == plain.text[:end + len(stop)]
    assert cut.stop_reason == kept.stop_reason == stop
