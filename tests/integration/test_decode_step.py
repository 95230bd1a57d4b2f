"""The C decode layer (`model.cpu.decode_step`) is the module path of a small decode step, token for token."""

from __future__ import annotations

import pytest

from conftest import HC4, MIXED, SPARSE, random_prompts
from helpers import make_llm
from pdspark import SamplingParams


@pytest.mark.parametrize("spec,kv_cache_dtype", [(MIXED, "auto"), (HC4, "auto"), (SPARSE, "auto"),
                                                 (SPARSE, "fp8_e4m3"), (HC4, "fp8_e4m3")],
                         ids=["mixed", "hc4", "sparse", "sparse-fp8", "hc4-fp8"])
def test_c_decode_layers_give_the_module_paths_tokens_and_logprobs(checkpoints, spec, kv_cache_dtype):
    """Over fp32 pools and over the FP8 cache's packed rows (written and read by `packed_rows.c` as `quant.kv_fp8`
    does: the same bytes, so the same tokens; a logprob may move by a rounding of a row's e4m3 encode where the two
    paths' fp32 latents differ in their last bit)."""
    path, _ = checkpoints(spec)
    llm = make_llm(path, kv_cache_dtype=kv_cache_dtype)
    model = llm.engine.runner.model
    assert model._decode_step is not None  # fp32 CPU weights: every layer has a table
    calls = []

    def counted(try_run):  # layers the C path ran (every layer in one call on the indexed path: counted per layer)
        def run(*a):
            out = try_run(*a)
            calls.extend([1] * len(model.layers) * (out is not None))
            return out
        return run

    for name in ("try_run_indexed", "try_run"):
        setattr(model._decode_step, name, counted(getattr(model._decode_step, name)))
    # Batches of 1 and of 3 decode tokens; prompts long enough that the sparse indexer picks among more entries.
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    fallbacks = llm.engine.stats.fast_path_fallback_steps
    for prompts in (random_prompts(1, [90], seed=5), random_prompts(3, [70, 100, 53], seed=6)):
        before = sum(fallbacks.values())
        fast = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        assert sum(fallbacks.values()) == before  # (every decode step of the fast run took the C path)
        saved, model._decode_step = model._decode_step, None
        slow = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        model._decode_step = saved
        for a, b in zip(fast, slow):
            assert a.token_ids == b.token_ids
            for la, lb in zip(a.logprobs, b.logprobs):
                assert la.logprob == pytest.approx(lb.logprob, abs=1e-5 if kv_cache_dtype == "auto" else 1e-4)
    assert len(calls) >= 11 * len(model.layers)  # the decode steps went through the C layers


def test_bf16_weights_give_the_fp32_kernels_bits_on_the_shipped_checkpoint():
    """dsv4-tiny's weights are bf16 numbers (its checkpoint's dtype): the C path reads its projections and head as
    bf16 bits, and every logprob equals, bit for bit, the same C path over the fp32 weights (and the tokens the
    module path's). Decode steps of 1 and 3 tokens, and DSpark verify steps."""
    from pdspark.hardware.cpu import kernels as cpu_kernels
    from pdspark.model.cpu.decode_step import DecodeStep

    for speculative in (None, "dspark"):
        llm = make_llm("dsv4-tiny", speculative=speculative)
        model = llm.engine.runner.model
        halves = model._decode_step
        assert {f for t in halves.tables for fs in t.formats.values() for f in fs} == {"bf16"}
        assert model._head_bf16 is not None
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(cpu_kernels, "bf16_copy", lambda w: None)
            fp32 = DecodeStep.build(list(model.layers), model.cfg)
        assert isinstance(fp32, DecodeStep)
        assert {f for t in fp32.tables for fs in t.formats.values() for f in fs} == {"f32"}
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
        for prompts in (random_prompts(1, [90], seed=7, vocab=4096), random_prompts(3, [70, 100, 53], seed=8,
                                                                                     vocab=4096)):
            fast = llm.generate(prompt_token_ids=prompts, sampling_params=params)
            model._decode_step, head = fp32, model._head_bf16
            model._head_bf16 = None
            full = llm.generate(prompt_token_ids=prompts, sampling_params=params)
            model._decode_step = None
            slow = llm.generate(prompt_token_ids=prompts, sampling_params=params)
            model._decode_step, model._head_bf16 = halves, head
            for a, b, c in zip(fast, full, slow):
                assert a.token_ids == b.token_ids == c.token_ids
                assert [x.logprob for x in a.logprobs] == [x.logprob for x in b.logprobs]
                assert [x.top for x in a.logprobs] == [x.top for x in b.logprobs]


def test_the_helper_threads_give_every_step_the_same_bits():
    """With 2, 3 and 4 threads the C steps share their GEMMs (in up to 4 parts), the routed experts and a verify
    step's attention rows (in up to 4 ranges) with helper threads (`pool.c`): tokens and logprobs equal, bit for bit,
    those of one thread, plain and DSpark, batch 1 and 3 (verify steps of 6 and 18 rows)."""
    from pdspark.hardware.cpu import kernels as cpu_kernels

    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    try:
        for speculative in (None, "dspark"):
            llm = make_llm("dsv4-tiny", speculative=speculative)
            for prompts in (random_prompts(1, [90], seed=9, vocab=4096),
                            random_prompts(3, [70, 100, 53], seed=10, vocab=4096)):
                runs = []
                for threads in (1, 2, 3, 4):
                    cpu_kernels.set_threads(threads)
                    runs.append(llm.generate(prompt_token_ids=prompts, sampling_params=params))
                for other in runs[1:]:
                    for a, b in zip(runs[0], other):
                        assert a.token_ids == b.token_ids
                        assert [x.logprob for x in a.logprobs] == [x.logprob for x in b.logprobs]
                        assert [x.top for x in a.logprobs] == [x.top for x in b.logprobs]
    finally:
        cpu_kernels.set_threads(1)


def test_steps_the_c_path_does_not_cover_are_logged_once_per_reason_and_counted(checkpoints, monkeypatch, caplog):
    """The fast path never turns off silently: decode steps of more rows than the C step takes, or of a model with
    no C step (here: the C kernels off), take the PyTorch path with one log line per reason and a count per step;
    small steps of an fp32 model count nothing."""
    from pdspark.hardware.cpu import kernels
    from pdspark.model.cpu.decode_step import MAX_TOKENS

    path, _ = checkpoints(MIXED)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    # (every request of a batch prefilled in one step, then decoding together)
    llm = make_llm(path, max_num_seqs=MAX_TOKENS + 2, max_num_batched_tokens=32 * (MAX_TOKENS + 2))
    steps = llm.engine.stats.fast_path_fallback_steps
    llm.generate(prompt_token_ids=random_prompts(2, [20, 30], seed=8), sampling_params=params)
    assert sum(steps.values()) == 0
    with caplog.at_level("WARNING", logger="pdspark.engine.fast_path_fallbacks"):
        llm.generate(prompt_token_ids=random_prompts(MAX_TOKENS + 1, [20], seed=9), sampling_params=params)
        llm.generate(prompt_token_ids=random_prompts(MAX_TOKENS + 2, [25], seed=10), sampling_params=params)
    assert steps["step_tokens"] >= 2 * 4  # (both batches' decode steps with every request still running)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and f"(the C step takes at most {MAX_TOKENS})" in lines[0]

    monkeypatch.setattr(kernels, "load", lambda: None)  # as PDSPARK_NO_C_KERNELS=1
    off = make_llm(path)
    caplog.clear()
    with caplog.at_level("WARNING", logger="pdspark.engine.fast_path_fallbacks"):
        off.generate(prompt_token_ids=random_prompts(2, [20, 30], seed=8), sampling_params=params)
    assert off.engine.stats.fast_path_fallback_steps["model"] >= 5
    assert [r.getMessage() for r in caplog.records] == [
        "decode/verify steps take the slower PyTorch path: the model has no C decode step: no C kernels "
        "(PDSPARK_NO_C_KERNELS=1, or they could not be built: see the log above) (logged once per reason; counted "
        "in pdspark_engine_fast_path_fallback_steps_total{reason='model'})"]


def test_a_projection_of_another_shape_than_the_layers_sizes_is_refused_naming_it():
    """The C loops trust the sizes they are given: a projection whose rows or inputs differ from what the layer's
    sizes make them read gets no table (the module path runs), with a reason naming the weight and both numbers."""
    import torch

    from pdspark.assets import resolve_model
    from pdspark.model.cpu.decode_step import layer_table
    from pdspark.model.loader import load_checkpoint

    model = load_checkpoint(resolve_model("dsv4-tiny"), 128).model
    layer, cfg = model.layers[1], model.cfg
    assert not isinstance(layer_table(layer, cfg), str)
    for shape, why in (((192, 100), "weight wo_b has rows of 100 inputs where the layer's sizes give 128"),
                       ((100, 128), "weight wo_b has 100 rows where the layer's sizes give 192")):
        layer.attn.wo_b = torch.nn.Parameter(torch.zeros(shape), requires_grad=False)
        assert layer_table(layer, cfg) == why
