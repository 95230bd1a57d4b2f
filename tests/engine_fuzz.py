"""A differential fuzz of the engine: random valid DSV4 configs x random batch compositions.

Each case is a random DeepSeek-V4 checkpoint written by transformers and a random batch (1-8 prompts of 1-600
tokens, shared prefixes for prefix-cache hits, small step budgets for chunked prefill, requests joining while others
run, different lengths so some finish early), run these ways:
- the engine with its C fast path, and again with the C library off (the PyTorch path): the same tokens and logprobs
  within `LOGPROB_TOL` on every step (beyond it, the C path must be no farther from transformers than twice the
  PyTorch path: rounding, not a wrong computation);
- with a random DSpark draft (models of 3+ layers): the same greedy tokens as plain decoding, no excuse allowed;
- transformers' greedy `generate` per prompt, its CSA indexer's top-k given the engine's documented tie rule
  (`stable_indexer_topk`: a test-only patch of the reference, never of the engine). A token may differ only at a
  genuine near-tie of the reference, counted: its top-2 logit gap at that step below `NEAR_TIE`, or a top-k cut
  (indexer entries, routed experts) within `NEAR_CUT` before it (`CutGaps`). The same excuse, and only it, covers
  C-vs-PyTorch token differences.

`run_case` returns a `CaseResult`; the suite runs a few examples (tests/integration/test_engine_fuzz.py), and
`python tests/engine_fuzz.py --cases 500` runs many by hand and prints the tally.

`--kv-cache-dtype fp8_e4m3` runs the same cases over the FP8 cache (`run_packed_case`): the C path, which reads and
writes the packed rows in place, against the PyTorch path, which decodes and encodes them in PyTorch; no transformers
reference (it has no such cache). The two encode the same bytes from the same floats, but their floats before the
encode differ in the last bits (their sums' orders), and an e4m3 rounding that flips there moves a value by up to
1/8 of its size: so the two paths may part at a close call ("parted", counted with its top-2 logit gap, not a
failure). DSpark must still give the plain tokens exactly (a verify step encodes each row as a decode step does).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import logging
import random
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from hf_reference import CSA, HCA, SLIDING, randomize_small_parameters, write_byte_tokenizer

# The C path and the PyTorch path sum in different orders (16 partial sums vs BLAS blocking), so their fp32 logprobs
# differ by rounding: on these random models (sharpened heads, up to 5 layers) by up to ~2e-5, each path about as
# far from transformers' own fp32 logprobs (measured: C 1.7e-5, PyTorch 1.0e-5 at worst over the first cases). A
# bound 2.5x that separates rounding from a wrong computation (a wrong row, mask or weight moves logprobs by >1e-2).
LOGPROB_TOL = 5e-5
NEAR_TIE = 1e-4
# A top-k choice (indexer entries, routed experts) whose kept and dropped scores differ by less than this, relative:
# fp32 rounding (~1e-7 relative per op, accumulated over the layers before) can order them either way.
NEAR_CUT = 1e-5
VOCAB = 256


@dataclass(frozen=True)
class FuzzCase:
    """One random model and one batch."""

    config: dict  # DeepseekV4Config keyword arguments
    weight_dtype: str  # how the checkpoint stores its weights: float32 / bfloat16 / float16
    tid2eid: str  # hash tables: "perm" (distinct experts per row), "random" (repeats allowed), "zeros" (as HF inits)
    prompts: tuple[tuple[int, ...], ...]
    max_tokens: tuple[int, ...]
    join_after: int  # engine steps before the second half of the prompts is added (0: all at once)
    engine: dict  # EngineConfig options
    seed: int
    draft_gamma: int = 0  # a random DSpark draft of this many tokens (0: none): DSpark must give the plain tokens

    def describe(self) -> str:
        c = self.config
        kinds = "".join({SLIDING: "S", CSA: "C", HCA: "H"}[t] for t in c["layer_types"])
        return (f"seed={self.seed} layers={kinds} D={c['hidden_size']} H={c['num_attention_heads']}x"
                f"{c['head_dim']} hc={c['hc_mult']} win={c['sliding_window']} rates={c['compress_rates']} "
                f"topk={c['index_topk']} E={c['n_routed_experts']}/{c['num_experts_per_tok']} "
                f"{self.weight_dtype} tid2eid={self.tid2eid} lens={[len(p) for p in self.prompts]} "
                f"engine={self.engine}" + (f" dspark gamma={self.draft_gamma}" if self.draft_gamma else ""))


def random_case(seed: int, max_prompt: int = 600, max_prompts: int = 8) -> FuzzCase:
    """A random valid config and batch, drawn from `seed` (the same case on every machine)."""
    rng = random.Random(seed)
    heads = rng.randint(1, 8)
    head_dim = rng.choice([16, 32, 48, 64, 96, 128])
    rope_dim = rng.choice([d for d in (2, 4, 8, 16, 32, 64) if d <= head_dim])
    hidden = rng.choice(range(32, 257, 16))
    n_layers = rng.randint(1, 5)
    layer_types = [rng.choice([SLIDING, CSA, HCA]) for _ in range(n_layers)]
    hca_ratio = rng.choice([8, 16, 32, 64, 128])
    # Drawn from a stream of their own (added later): the cases of the seeds pinned in the suite stay what they were.
    ratios = random.Random(f"ratios-{seed}")
    csa_ratio = ratios.choice([4, 4, 4, 8, 16])
    if ratios.random() < 0.15:
        hca_ratio = 4
    experts = rng.randint(2, 16)
    index_dim = rng.choice([d for d in (16, 32, 64, 128) if d >= rope_dim])
    n_hash = rng.randint(0, n_layers)
    config = dict(
        vocab_size=VOCAB, hidden_size=hidden, moe_intermediate_size=rng.choice([16, 32, 48, 64]),
        num_hidden_layers=n_layers, num_attention_heads=heads, head_dim=head_dim,
        q_lora_rank=rng.choice([16, 32, 64]), o_groups=rng.choice([g for g in (1, 2, 4, 8) if heads % g == 0]),
        o_lora_rank=rng.choice([8, 16, 32]), sliding_window=rng.randint(4, 128), layer_types=layer_types,
        compress_rates={CSA: csa_ratio, HCA: hca_ratio}, index_n_heads=rng.randint(1, 8), index_head_dim=index_dim,
        index_topk=rng.choice([1, 2, 3, 4, 8, 16, 32, 64, 512]), n_routed_experts=experts,
        num_experts_per_tok=rng.randint(1, min(4, experts)), hc_mult=rng.randint(1, 4),
        hc_sinkhorn_iters=rng.randint(1, 20), mlp_layer_types=["hash_moe"] * n_hash + ["moe"] * (n_layers - n_hash),
        partial_rotary_factor=rope_dim / head_dim, scoring_func=rng.choice(["sqrtsoftplus", "sigmoid"]),
        initializer_range=0.1, max_position_embeddings=4096, eos_token_id=1, bos_token_id=0,
        tie_word_embeddings=rng.random() < 0.2,
    )
    n = rng.randint(1, max_prompts)
    prompts: list[tuple[int, ...]] = []
    for _ in range(n):
        length = rng.choice([rng.randint(1, 40), rng.randint(1, max_prompt)])
        if prompts and rng.random() < 0.3:  # a shared prefix: a prefix-cache hit once the first is cached
            base = rng.choice(prompts)
            cut = rng.randint(0, len(base))
            prompts.append(base[:cut] + tuple(rng.randint(2, VOCAB - 1) for _ in range(length)))
        else:
            prompts.append(tuple(rng.randint(2, VOCAB - 1) for _ in range(length)))
    page = max(64, hca_ratio, csa_ratio)
    engine = dict(page_size=page, max_model_len=max(len(p) for p in prompts) + 40, max_num_seqs=rng.randint(1, 8),
                  max_num_batched_tokens=rng.choice([page, 2 * page, 512, 1024]),
                  enable_prefix_cache=rng.random() < 0.8)
    return FuzzCase(
        config=config, weight_dtype=rng.choice(["float32", "float32", "bfloat16", "float16"]),
        tid2eid=rng.choice(["perm", "random", "zeros"]), prompts=tuple(prompts),
        max_tokens=tuple(rng.randint(1, 24) for _ in prompts), join_after=rng.choice([0, 0, 1, 3]), engine=engine,
        seed=seed, draft_gamma=rng.choice([0, 2, 3, 5]) if n_layers >= 3 else 0,
    )


def build_checkpoint(case: FuzzCase, path: Path):
    """transformers' model of `case` with every parameter non-trivial, saved to `path`; returns the fp32 reference
    whose weights are the stored ones (a bf16/fp16 checkpoint's values, widened)."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    torch.manual_seed(case.seed)
    model = DeepseekV4ForCausalLM(DeepseekV4Config(**case.config)).eval()
    g = torch.Generator().manual_seed(case.seed)
    with torch.no_grad():
        randomize_small_parameters(model)
        E, k = case.config["n_routed_experts"], case.config["num_experts_per_tok"]
        for layer in model.model.layers:
            if layer.mlp.is_hash and case.tid2eid != "zeros":
                if case.tid2eid == "perm":
                    table = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(VOCAB)])
                else:
                    table = torch.randint(0, E, (VOCAB, k), generator=g)
                layer.mlp.gate.tid2eid.copy_(table)
        model.lm_head.weight.mul_(4.0)  # sharper next-token distributions: fewer near-ties
        # The stored values, widened: the reference computes in fp32 on exactly what the checkpoint holds. (Not
        # `model.to(dtype).float()`: that would also round the rotary tables' inverse frequencies, which are
        # buffers computed at init, never stored.)
        stored = getattr(torch, case.weight_dtype)
        for p in model.parameters():
            p.copy_(p.to(stored).float())
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # a stored buffer
                b.copy_(b.to(stored).float())
    copy.deepcopy(model).to(stored).save_pretrained(path)
    write_byte_tokenizer(path)
    return model


class CutGaps:
    """The smallest non-zero gap, per forward call of the reference, between the last score a top-k keeps and the
    first it drops (the CSA indexer's and the routed MoE's): below `NEAR_CUT` (relative) the choice depends on float
    rounding, and two correct implementations may keep different entries or experts. (Equal scores are no such
    case: the tie rule decides them.)"""

    def __init__(self) -> None:
        self.per_call: list[float] = []

    def record(self, values: torch.Tensor, k: int) -> None:
        """`values`: scores sorted descending along the last dim (-inf: not selectable)."""
        if values.shape[-1] <= k or k == 0:
            return
        kept, dropped = values[..., k - 1].flatten(), values[..., k].flatten()
        ok = torch.isfinite(kept) & torch.isfinite(dropped) & (kept != dropped)
        if ok.any():
            rel = (kept[ok] - dropped[ok]) / kept[ok].abs().clamp_min(1.0)
            if self.per_call:
                self.per_call[-1] = min(self.per_call[-1], float(rel.min()))

    def near_cut_before(self, step: int) -> bool:
        """A choice within `NEAR_CUT` of its cut in some forward call up to `step` (0: the prefill)."""
        return any(g < NEAR_CUT for g in self.per_call[: step + 1])


@contextlib.contextmanager
def stable_indexer_topk(gaps: CutGaps | None = None) -> Iterator[None]:
    """transformers' CSA indexer with the engine's tie rule: among equal scores the lowest entry first (a stable
    descending sort). Plain CPU `torch.topk` picks among ties arbitrarily. Patches only the indexer's `topk` calls;
    with `gaps`, records the indexer's and the routed MoE's cut gaps of every forward call."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

    original_forward = hf.DeepseekV4Indexer.forward
    original_router = hf.DeepseekV4TopKRouter.forward
    original_model = hf.DeepseekV4Model.forward
    original_topk = torch.Tensor.topk

    def stable_topk(self, k, dim=-1, largest=True, sorted=True):
        assert largest
        values, indices = torch.sort(self, dim=dim, descending=True, stable=True)
        if gaps is not None:
            gaps.record(values, k)
        return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))

    def forward(self, *args, **kwargs):
        torch.Tensor.topk = stable_topk  # type: ignore[method-assign]
        try:
            return original_forward(self, *args, **kwargs)
        finally:
            torch.Tensor.topk = original_topk  # type: ignore[method-assign]

    def router(self, hidden_states):
        out = original_router(self, hidden_states)
        if gaps is not None:
            scores = self.score_fn(F.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight))
            gaps.record((scores + self.e_score_correction_bias).sort(dim=-1, descending=True).values, self.top_k)
        return out

    def model_forward(self, *args, **kwargs):
        if gaps is not None:
            gaps.per_call.append(float("inf"))
        return original_model(self, *args, **kwargs)

    hf.DeepseekV4Indexer.forward = forward
    hf.DeepseekV4TopKRouter.forward = router
    hf.DeepseekV4Model.forward = model_forward
    try:
        yield
    finally:
        hf.DeepseekV4Indexer.forward = original_forward
        hf.DeepseekV4TopKRouter.forward = original_router
        hf.DeepseekV4Model.forward = original_model


@dataclass
class CaseResult:
    """`run_case`'s verdict. `outcome`: exact / near-tie / differ / refused (the engine refused the config:
    reported, a finding to look at) / crash (an exception; a SIGSEGV kills the process instead)."""

    outcome: str
    detail: str = ""
    near_ties: int = 0  # sequences whose first mismatch with transformers sits at a near-tie
    topk_active: bool = False  # some CSA query saw more entries than `index_topk`
    logprob_gap: float = 0.0  # the largest |C - PyTorch| logprob difference
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)


def _engine_outputs(path: Path, case: FuzzCase, c_path: bool, speculative: bool = False,
                   logprobs: int = 1, fallbacks: Counter[str] | None = None):
    """Every request's tokens and chosen-token logprobs (with `logprobs` 2, also the top-2 gap of each step),
    driven step by step so later prompts join mid-batch; `fallbacks` gets the engine's decode steps that left the C
    path, by reason."""
    from helpers import assert_no_leaks
    from pdspark import LLM, SamplingParams
    from pdspark.hardware.cpu import kernels

    with contextlib.ExitStack() as stack:
        if not c_path:
            original = kernels.load
            kernels.load = lambda: None  # type: ignore[assignment]  # as PDSPARK_NO_C_KERNELS=1
            stack.callback(setattr, kernels, "load", original)
        llm = LLM(str(path), **case.engine, **({"speculative": "dspark"} if speculative else {}))
        engine = llm.engine
        half = (len(case.prompts) + 1) // 2 if case.join_after else len(case.prompts)
        params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, logprobs=logprobs)
                  for m in case.max_tokens]
        ids = [engine.add_request(list(p), s) for p, s in zip(case.prompts[:half], params[:half])]
        steps = 0
        while engine.has_unfinished or len(ids) < len(case.prompts):
            if len(ids) < len(case.prompts) and (steps >= case.join_after or not engine.has_unfinished):
                ids += [engine.add_request(list(p), s) for p, s in zip(case.prompts[half:], params[half:])]
            engine.step()
            steps += 1
        outs = [engine.output(engine.requests[r]) for r in ids]
        if fallbacks is not None:
            fallbacks.update(engine.stats.fast_path_fallback_steps)
        for r in ids:
            engine.release(r)
        assert_no_leaks(llm)
        if logprobs == 2:
            return [(o.token_ids, [lp.logprob for lp in o.logprobs or []],
                     [_top2_gap(lp.top) for lp in o.logprobs or []]) for o in outs]
        return [(o.token_ids, [lp.logprob for lp in o.logprobs or []]) for o in outs]


def _top2_gap(top: dict[int, float]) -> float:
    best = sorted(top.values(), reverse=True)
    return best[0] - best[1] if len(best) > 1 else float("inf")


def _parting_step(fast: tuple[list[int], list[float]], slow: tuple[list[int], list[float]]) -> int | None:
    """The first step where the C path and the PyTorch path part, a token or a logprob beyond `LOGPROB_TOL` apart
    (None: they agree)."""
    for j, (a, b, la, lb) in enumerate(zip(fast[0], slow[0], fast[1], slow[1])):
        if a != b or abs(la - lb) > LOGPROB_TOL:
            return j
    return None if len(fast[0]) == len(slow[0]) else min(len(fast[0]), len(slow[0]))


def _rounding_only(fast, slow, ref: Reference) -> bool:
    """Whether the C path's logprobs, as far as its tokens are the PyTorch path's and the reference's, are no
    farther from transformers' fp32 logprobs than twice the PyTorch path's (plus `LOGPROB_TOL`): rounding."""
    n = _first_difference(fast[0], ref.tokens)
    if n == 0 or fast[0][:n] != slow[0][:n]:
        return False
    ref_lp = ref.logprobs[:n]
    err_c = max(abs(a - b) for a, b in zip(fast[1], ref_lp))
    err_t = max(abs(a - b) for a, b in zip(slow[1], ref_lp))
    return err_c <= 2 * err_t + LOGPROB_TOL and _parting_step((fast[0][n:], fast[1][n:]),
                                                               (slow[0][n:], slow[1][n:])) is None


def _topk_active(case: FuzzCase) -> bool:
    c = case.config
    if CSA not in c["layer_types"]:
        return False
    longest = max(len(p) + m for p, m in zip(case.prompts, case.max_tokens))
    return longest // c["compress_rates"][CSA] > c["index_topk"]


class Reference(NamedTuple):
    """transformers' greedy run of one prompt, its indexer under the tie rule."""

    tokens: list[int]
    logprobs: list[float]  # of its own tokens
    gaps: list[float]  # per step, between its two largest logits
    cuts: CutGaps  # its top-k cut gaps, per forward call


def _reference(model, prompt: tuple[int, ...], max_tokens: int) -> Reference:
    from hf_reference import hf_generate

    cuts = CutGaps()
    with stable_indexer_topk(cuts):
        out = hf_generate(model, list(prompt), max_tokens, output_scores=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    scores = [s[0].float() for s in out.scores]
    top2 = [s.topk(2).values for s in scores]
    logprobs = [float(torch.log_softmax(s, -1)[t]) for s, t in zip(scores, tokens)]
    return Reference(tokens, logprobs, [float(t[0] - t[1]) for t in top2], cuts)


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _dspark_difference(path: Path, case: FuzzCase, plain: list) -> str:
    """With the case's random DSpark draft (none: ""), the first prompt whose C-path DSpark tokens are not `plain`'s
    (the C path's plain outputs), described; "" when all agree. DSpark verifies every draft with the target: a
    near-tie cannot excuse a difference."""
    if not case.draft_gamma:
        return ""
    from pdspark.testing.random_draft import write_random_draft

    write_random_draft(path, gamma=case.draft_gamma, seed=case.seed)
    spec = _engine_outputs(path, case, c_path=True, speculative=True, logprobs=1)
    for i, (out, (spec_tokens, _)) in enumerate(zip(plain, spec)):
        if spec_tokens != out[0]:
            return f"DSpark vs plain: prompt {i}: {spec_tokens} != {out[0]}"
    return ""


def run_case(case: FuzzCase, workdir: Path) -> CaseResult:
    from pdspark.errors import ConfigError

    start = time.monotonic()
    result = CaseResult("exact", topk_active=_topk_active(case))
    path = workdir / f"case{case.seed}"
    model = build_checkpoint(case, path)
    try:
        fast = _engine_outputs(path, case, c_path=True)
    except ConfigError as e:
        result.outcome, result.detail = "refused", str(e)
        result.seconds = time.monotonic() - start
        return result
    slow = _engine_outputs(path, case, c_path=False)
    spec_differs = _dspark_difference(path, case, fast)
    if spec_differs:
        result.outcome, result.detail = "differ", spec_differs
        result.seconds = time.monotonic() - start
        return result
    result.logprob_gap = max((abs(a - b) for f, w in zip(fast, slow) for a, b in zip(f[1], w[1])), default=0.0)
    for i, (prompt, m) in enumerate(zip(case.prompts, case.max_tokens)):
        at = _parting_step(fast[i], slow[i])
        if at is None:
            continue
        ref = _reference(model, prompt, m)
        if fast[i][0] == slow[i][0] and _rounding_only(fast[i], slow[i], ref):
            result.notes.append(f"C vs PyTorch, prompt {i}: logprobs {result.logprob_gap:.2g} apart (rounding: "
                                "as close to transformers as PyTorch)")
            continue
        # Otherwise explained only by a near-tie of the reference before the two paths part.
        if not (at < len(ref.gaps) and (ref.gaps[at] < NEAR_TIE or ref.cuts.near_cut_before(at))):
            result.outcome = "differ"
            result.detail = (f"C vs PyTorch: prompt {i} step {at}: tokens {fast[i][0]} vs {slow[i][0]}, logprobs "
                             f"{fast[i][1][at:at + 1]} vs {slow[i][1][at:at + 1]}")
            result.seconds = time.monotonic() - start
            return result
        result.near_ties += 1
        result.notes.append(f"C vs PyTorch, prompt {i} step {at}: a near-tie of the reference")
        fast[i] = slow[i] = ([], [])  # (the paths parted at a near-tie: nothing more to compare for it)
    for i, (prompt, m, (tokens, _)) in enumerate(zip(case.prompts, case.max_tokens, fast)):
        if not tokens:
            continue
        ref = _reference(model, prompt, m)
        if tokens == ref.tokens:
            continue
        at = _first_difference(tokens, ref.tokens)
        if ref.gaps[at] < NEAR_TIE or ref.cuts.near_cut_before(at):
            result.near_ties += 1
            result.notes.append(f"prompt {i} step {at}: near-tie (logit gap {ref.gaps[at]:.2e})")
            continue
        result.outcome = "differ"
        result.detail = (f"vs transformers: prompt {i} (len {len(prompt)}) step {at}: {tokens[at]} != "
                         f"{ref.tokens[at]} (reference gap {ref.gaps[at]:.3g})")
        break
    if result.outcome == "exact" and result.near_ties:
        result.outcome = "near-tie"
    result.seconds = time.monotonic() - start
    return result


def run_packed_case(case: FuzzCase, workdir: Path) -> CaseResult:
    """`case` over the FP8 cache: C path against PyTorch path (see the module's docstring), and DSpark against
    plain decoding on the C path. Outcomes: exact, parted (the paths' tokens part at a step; `detail` gives its top-2
    logprob gap), differ (DSpark's tokens are not plain decoding's), off-c-path (the C engine's decode steps took the
    module path: nothing compared), refused."""
    import dataclasses

    from pdspark.errors import ConfigError

    start = time.monotonic()
    case = dataclasses.replace(case, engine={**case.engine, "kv_cache_dtype": "fp8_e4m3"})
    result = CaseResult("exact", topk_active=_topk_active(case))
    path = workdir / f"case{case.seed}"
    build_checkpoint(case, path)
    fallbacks: Counter[str] = Counter()
    try:
        fast = _engine_outputs(path, case, c_path=True, logprobs=2, fallbacks=fallbacks)
    except ConfigError as e:
        result.outcome, result.detail = "refused", str(e)
        result.seconds = time.monotonic() - start
        return result
    if fallbacks["pools"] or fallbacks["model"]:  # (then this case compares the PyTorch path with itself)
        result.outcome = "off-c-path"
        result.detail = f"decode steps off the C path: {dict(+fallbacks)}"
    slow = _engine_outputs(path, case, c_path=False, logprobs=2)
    result.logprob_gap = max((abs(a - b) for f, w in zip(fast, slow) for a, b in zip(f[1], w[1])), default=0.0)
    for i, (f, w) in enumerate(zip(fast, slow)):
        at = _first_difference(f[0], w[0])
        if at < min(len(f[0]), len(w[0])):
            result.outcome = "parted"
            result.detail += (f"prompt {i} step {at}: top-2 logprob gap {min(f[2][at], w[2][at]):.2g} "
                              f"(C {f[0][at]}, PyTorch {w[0][at]}); ")
    spec_differs = _dspark_difference(path, case, fast)
    if spec_differs:
        result.outcome, result.detail = "differ", spec_differs
    result.seconds = time.monotonic() - start
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=50)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--max-prompt", type=int, default=600)
    parser.add_argument("--json", type=Path, help="write every case's result here (one JSON object a line)")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "fp8_e4m3"), default="auto",
                        help="fp8_e4m3: the cases over the FP8 cache, C path against PyTorch path (`run_packed_case`)")
    args = parser.parse_args()
    run = run_packed_case if args.kv_cache_dtype == "fp8_e4m3" else run_case
    torch.set_num_threads(1)
    # (the PyTorch-path engines' once-per-reason notes would interleave with the tally)
    logging.getLogger("pdspark.engine.fast_path_fallbacks").setLevel(logging.ERROR)
    tally: Counter[str] = Counter()
    active = 0
    sink = args.json.open("w") if args.json else None
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.first_seed, args.first_seed + args.cases):
            case = random_case(seed, max_prompt=args.max_prompt)
            try:
                res = run(case, Path(tmp))
            except Exception:
                res = CaseResult("crash", traceback.format_exc(limit=3))
            tally[res.outcome] += 1
            active += res.topk_active
            line = f"[{seed - args.first_seed + 1}/{args.cases}] {res.outcome:8s} {res.seconds:5.1f}s {case.describe()}"
            print(line + (f"\n    {res.detail}" if res.detail else ""), flush=True)
            if sink:
                sink.write(json.dumps({"seed": seed, "outcome": res.outcome, "detail": res.detail,
                                       "near_ties": res.near_ties, "topk_active": res.topk_active,
                                       "logprob_gap": res.logprob_gap,
                                       "seconds": round(res.seconds, 2), "case": case.describe()}) + "\n")
                sink.flush()
    print(f"\n{sum(tally.values())} cases: " + ", ".join(f"{k} {v}" for k, v in sorted(tally.items()))
          + f"; top-k active in {active}")
    return 0 if set(tally) <= {"exact", "near-tie", "parted"} else 1


if __name__ == "__main__":
    sys.exit(main())
