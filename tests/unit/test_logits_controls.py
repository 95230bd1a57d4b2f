"""The sampling controls against a plain reference written from their definitions (OpenAI's presence and frequency
penalties over the output, CTRL's repetition penalty over prompt and output, vLLM's min-p, logit bias, banned tokens,
min_tokens), and the sampler applying them to greedy rows too."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdspark.engine.logits_controls import apply_controls
from pdspark.engine.random_stream import RandomStream
from pdspark.engine.sampler import History, Sampler, filter_logits
from pdspark.types import SamplingParams

V = 12
EOS = (1,)


def reference(logits: list[float], p: SamplingParams, history: list[int], prompt_len: int) -> list[float]:
    out = list(logits)
    for t, b in (p.logit_bias or {}).items():
        out[t] += b
    for t in p.banned_token_ids:
        out[t] = -math.inf
    output = history[prompt_len:]
    if len(output) < p.min_tokens:
        for t in (*EOS, *p.stop_token_ids):
            out[t] = -math.inf
    for t in set(history):
        if p.repetition_penalty != 1.0:
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t in set(output):
        out[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return out


@settings(max_examples=200, deadline=None, derandomize=True)
@given(logits=st.lists(st.floats(-8, 8), min_size=V, max_size=V),
       history=st.lists(st.integers(0, V - 1), max_size=10), prompt_len=st.integers(0, 10),
       presence=st.sampled_from([0.0, 0.5, -1.0]), frequency=st.sampled_from([0.0, 0.3, 2.0]),
       repetition=st.sampled_from([1.0, 1.3, 0.7]), min_tokens=st.integers(0, 4),
       bias=st.dictionaries(st.integers(0, V - 1), st.floats(-100, 100), max_size=3),
       banned=st.lists(st.integers(0, V - 1), max_size=2), stops=st.lists(st.integers(0, V - 1), max_size=2))
def test_the_controls_are_their_definitions(logits, history, prompt_len, presence, frequency, repetition,
                                             min_tokens, bias, banned, stops):
    p = SamplingParams(presence_penalty=presence, frequency_penalty=frequency, repetition_penalty=repetition,
                       min_tokens=min_tokens, logit_bias=bias or None, banned_token_ids=tuple(banned),
                       stop_token_ids=tuple(stops))
    prompt_len = min(prompt_len, len(history))
    got = apply_controls(torch.tensor(logits, dtype=torch.float64), p, history, prompt_len, EOS)
    want = torch.tensor(reference(logits, p, history, prompt_len), dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_min_p_drops_tokens_under_a_share_of_the_top_ones_probability():
    logits = torch.tensor([2.0, 1.0, 0.0, -3.0])
    kept = filter_logits(logits, SamplingParams(min_p=0.3)).isfinite()
    probs = logits.softmax(-1)
    assert kept.tolist() == (probs >= 0.3 * probs.max()).tolist() == [True, True, False, False]


def test_the_sampler_applies_the_controls_to_greedy_and_sampled_rows_alike():
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0], [0.0, 5.0, 4.0, 1.0]])
    greedy = SamplingParams(temperature=0, frequency_penalty=2.0)
    seeded = SamplingParams(temperature=0.5, top_k=1, frequency_penalty=2.0, seed=3)
    history = History([3, 1, 1], prompt_len=1)  # the output so far: token 1 twice (5 - 2 * 2 = 1 < 4)
    out = Sampler(EOS).sample(logits, [greedy, seeded], [RandomStream(3), RandomStream(3)], [3, 3],
                              [history, history])
    assert out == [2, 2]
    # min_tokens: EOS (1) is held back while the output is shorter.
    held = Sampler(EOS).sample(logits[:1], [SamplingParams(temperature=0, min_tokens=3)], [RandomStream(0)], [2],
                               [History([3, 2], prompt_len=1)])
    assert held == [2]
