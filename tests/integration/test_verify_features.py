"""DSpark verify steps on the indexed C path (`decode_index` + `decode_layers` with captured layers): the drafter
features, positions and SWA slots of `DSV4Model.forward` over a `ForwardBatch`, and the engine's tokens and
proposals unchanged."""

from __future__ import annotations

import pytest
import torch

from conftest import HC4, MIXED
from helpers import make_llm
from pdspark import LLM, SamplingParams
from pdspark.engine.forward_batch import Chunk, build_forward_batch, index_layout, index_request
from pdspark.hardware.cpu import kernels as cpu_kernels
from pdspark.llm import resolve_model

needs_c = pytest.mark.skipif(cpu_kernels.load() is None, reason="needs the C kernels (a C compiler)")

# (request, first position, length): verify windows (gamma + 1 rows) that close C4 / C128 groups mid-window, a
# decode token, two requests in one step.
CASES = [
    [(0, 5, 6)],
    [(1, 118, 6)],
    [(2, 160, 8)],
    [(0, 30, 1)],
    [(0, 14, 4), (2, 181, 4)],
]


def _snapshot(pools: object) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in vars(pools).items() if isinstance(t, torch.Tensor)}


def _restore(pools: object, snapshot: dict[str, torch.Tensor]) -> None:
    for name, t in snapshot.items():
        getattr(pools, name).copy_(t)  # in place: the C tables hold pointers into these


@needs_c
@pytest.mark.parametrize("spec", [MIXED, HC4], ids=["mixed", "hc4"])
def test_indexed_features_equal_the_forward_batch_paths(checkpoints, spec):
    """Bit for bit the per-layer C path's features (the same `decode_layer` calls, the mean in ATen's order), and
    the module path's within float tolerance."""
    path, _ = checkpoints(spec)
    llm = make_llm(path)
    kv, model = llm.engine.kv, llm.engine.runner.model
    assert model._decode_step is not None
    capture = (3, 1, 2)  # out of layer order: the columns follow `capture`
    pages = [kv.open() for _ in range(3)]
    for rp, n in zip(pages, (40, 140, 220)):
        kv.grow(rp, n)
    layout = index_layout(kv)
    try:
        for case in CASES:
            chunks = [Chunk(pages[i].slot, start, [(5 * start + j) % 200 + 2 for j in range(n)], num_logits=n)
                      for i, start, n in case]
            # A step's state-ring writes can land on rows it read (a ring of 2 groups: position 8 takes position
            # 0's row), so each of the three runs starts from the same copy of the pools.
            before = _snapshot(kv.pools)
            with torch.inference_mode():
                out = model.forward_indexed(index_request(chunks), layout, kv.pools, capture)
                assert out is not None and out.features is not None
                got = [t.clone() for t in (out.hidden, out.features, out.positions, out.swa_slots)]
                _restore(kv.pools, before)
                batch = build_forward_batch(chunks, kv)
                ref = model(batch, kv.pools, capture)  # C layer by layer, features by torch's mean
                _restore(kv.pools, before)
                saved, model._decode_step = model._decode_step, None
                try:
                    module = model(batch, kv.pools, capture)  # PyTorch modules throughout
                finally:
                    model._decode_step = saved
            T, D = batch.num_tokens, model.cfg.hidden_size
            assert ref.features is not None and module.features is not None
            assert got[1].shape == (T, D * len(capture))
            assert torch.equal(got[0], ref.hidden), case
            assert torch.equal(got[1], ref.features), case
            assert torch.equal(got[2], batch.positions) and torch.equal(got[3], batch.swa_slots), case
            scale = module.features.abs().max().item()
            torch.testing.assert_close(got[1], module.features, rtol=0, atol=1e-4 * scale)
    finally:
        for rp in pages:
            kv.close(rp)


@needs_c
def test_engine_verify_steps_take_the_indexed_path_with_the_same_tokens_and_proposals():
    """The shipped model and draft (gamma 5: 6-row verify steps): every decode and verify step indexes in C, and
    the tokens, proposals and acceptance equal a run whose steps build a `ForwardBatch`."""
    llm = LLM(resolve_model("dsv4-tiny"), speculative="dspark", max_model_len=256, enable_prefix_cache=False)
    engine = llm.engine
    runner, drafter, model = engine.runner, engine.drafter, engine.runner.model
    assert drafter is not None and runner.layout is not None and runner.capture
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = [torch.randint(4, 4096, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (37, 90)]
    indexed_rows: list[int] = []
    forward_indexed = model.forward_indexed

    def counted(req, *a):
        out = forward_indexed(req, *a)
        if out is not None and out.features is not None:
            indexed_rows.append(out.features.shape[0])
        return out

    model.forward_indexed = counted
    inner = drafter.propose
    runs = {}
    for name in ("indexed", "batch"):
        layout = runner.layout
        if name == "batch":
            runner.layout = None  # every step through `build_forward_batch`
        proposals: list[list[list[int]]] = []

        def recorded(reqs, num_drafts, proposals=proposals):
            out = inner(reqs, num_drafts)
            proposals.append([p.tokens for p in out])
            return out

        drafter.propose = recorded
        accepted = engine.spec.accepted_tokens
        try:
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        finally:
            runner.layout = layout
            del drafter.propose
        runs[name] = ([o.token_ids for o in outs], proposals, engine.spec.accepted_tokens - accepted)
    assert runs["indexed"] == runs["batch"]
    assert len(runs["indexed"][1]) >= 5 and runs["indexed"][2] > 0
    assert 6 in indexed_rows  # 6-row verify steps (gamma 5) went through the C path with their features
