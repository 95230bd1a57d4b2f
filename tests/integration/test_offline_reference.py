"""The session's offline reference (`pdspark.testing.OfflineReference`): the outputs of a fresh engine, texts and
token ids alike, each computed once."""

from __future__ import annotations

from pdspark import LLM, SamplingParams
from pdspark.testing.offline_reference import OfflineReference

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, seed=7, max_tokens=6, ignore_eos=True)


def test_outputs_equal_a_fresh_engine_and_are_computed_once(draft_ckpt):
    reference = OfflineReference()
    prompts: list = ["def f(x):", [5, 6, 7, 8], "import os"]
    params = [GREEDY, SEEDED, SEEDED]
    got = reference.outputs(draft_ckpt, prompts, params)
    fresh = LLM(str(draft_ckpt), page_size=16, max_model_len=256)
    want = [fresh.generate([prompts[0]], GREEDY)[0], fresh.generate(prompt_token_ids=[prompts[1]],
                                                                     sampling_params=SEEDED)[0],
            fresh.generate([prompts[2]], SEEDED)[0]]
    assert [(r.token_ids, r.text) for r in got] == [(list(w.token_ids), w.text or "") for w in want]
    engine = reference.engine(draft_ckpt)
    steps = engine.engine.stats.generated_tokens
    assert reference.output(draft_ckpt, [5, 6, 7, 8], SEEDED) == got[1]  # cached: no engine step
    assert engine.engine.stats.generated_tokens == steps
    assert reference.engine(draft_ckpt, page_size=32) is not engine  # other options, another engine
