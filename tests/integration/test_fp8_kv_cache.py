"""The FP8 KV cache (`kv_cache_dtype='fp8_e4m3'`) in the engine: the shipped model's logits stay within a cosine of
0.999 of the unquantized cache's on held-out text; DSpark is lossless on it (greedy on and off agree), both on the C
decode step; a prefix-cache hit reads the packed rows a cold prefill wrote (the same tokens); no page leaks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from conftest import random_prompts
from helpers import assert_no_leaks, greedy, make_llm, prompt_logits
from pdspark import SamplingParams
from pdspark.assets import resolve_model

FP8 = dict(kv_cache_dtype="fp8_e4m3")
RECIPE = Path(__file__).resolve().parents[2] / "scripts" / "train_dspark_draft.py"


def test_the_shipped_models_logits_keep_a_cosine_of_0_999_on_held_out_text():
    model = resolve_model("dsv4-tiny")
    out = subprocess.run([sys.executable, str(RECIPE), "--out", str(model), "--stage", "heldout", "--prompts", "4",
                          "--prompt-len", "160", "--seed", "3"], check=True, capture_output=True, text=True)
    prompts = json.loads(out.stdout)
    with make_llm(model) as plain, make_llm(model, **FP8) as fp8:
        cos = torch.cat([torch.nn.functional.cosine_similarity(prompt_logits(plain, p), prompt_logits(fp8, p), dim=-1)
                         for p in prompts])
        print(f"logit cosine over {cos.numel()} positions: mean {cos.mean():.6f}, min {cos.min():.6f}")
        assert cos.mean() >= 0.999
        assert_no_leaks(fp8)


def test_dspark_and_the_prefix_cache_work_on_the_packed_rows(draft_ckpt):
    prompts = random_prompts(3, [40, 70, 101], seed=61)
    with make_llm(draft_ckpt, **FP8) as plain, make_llm(draft_ckpt, speculative="dspark", **FP8) as spec:
        want = greedy(plain, prompts, 24)
        assert greedy(spec, prompts, 24) == want
        assert spec.engine.spec.verify_steps > 0
        # Decode and verify steps read and write the packed rows in C (`packed_rows.c`), not in the module path.
        assert plain.engine.stats.fast_path_fallback_steps["pools"] == 0
        assert spec.engine.stats.fast_path_fallback_steps["pools"] == 0
        # The same prompts again: their whole pages come from the prefix cache, written packed by the first run.
        again = spec.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=24, temperature=0,
                                                                                       ignore_eos=True))
        assert [o.token_ids for o in again] == want and all(o.num_cached_tokens > 0 for o in again)
        params = SamplingParams(max_tokens=24, temperature=0.8, top_k=40, seed=5, ignore_eos=True)
        seeded = [o.token_ids for o in plain.generate(prompt_token_ids=prompts, sampling_params=params)]
        assert [o.token_ids for o in spec.generate(prompt_token_ids=prompts, sampling_params=params)] == seeded
        assert_no_leaks(spec)
