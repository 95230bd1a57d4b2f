"""Prefill/decode workers in one process (in-process transfer backend): the transferred cache equals a colocated
run's, bit for bit, for every payload kind; seeded sampling gives the offline engine's tokens; failures, deadlines,
refused plans and duplicate ids free everything."""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from dataclasses import replace

import pytest
import torch

from conftest import random_prompts
from helpers import GREEDY, make_llm
from pdspark import SamplingParams
from pdspark.engine.factory import create_engine
from pdspark.errors import ErrorCode, RequestFailed
from pdspark.serving.deadline import Deadline
from pdspark.serving.decode_worker import DecodeWorker
from pdspark.serving.engine_descriptor import describe_engine
from pdspark.serving.engine_loop import EngineLoop
from pdspark.serving.prefill_worker import PrefillWorker
from pdspark.transfer.backend import create_backend
from pdspark.transfer.transfer_plan import PoolKind, cache_buffers, item_pairs, registered_regions

OPTS = dict(page_size=16, max_model_len=256, max_num_seqs=4, c128_page_size=2, speculative="dspark")
SAMPLED = dict(temperature=0.9, top_k=40, top_p=0.95, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(draft_ckpt):
    return draft_ckpt


class Pair:
    """A prefill and a decode worker over the in-process backend, on one asyncio loop of their own thread (as in a
    worker process); the decode worker's plans reach the prefill worker directly, with the relative timeout turned
    into a deadline on receipt as the servicer does."""

    def __init__(self, path, decode_opts: dict | None = None, opts: dict | None = None, **decode_kw):
        opts = opts or OPTS
        self.p_engine, self.p_loop, p_backend = self._side(path, opts)
        self.d_engine, self.d_loop, d_backend = self._side(path, {**opts, "enable_prefix_cache": False,
                                                                  **(decode_opts or {})})
        self.prefill = PrefillWorker(self.p_loop, p_backend, describe_engine(self.p_engine))
        self.decode = DecodeWorker(self.d_loop, d_backend, describe_engine(self.d_engine), self.send_plan,
                                   **decode_kw)
        self.aio = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.aio.run_forever, daemon=True)
        self._thread.start()
        self.plan_hook = None  # tests may rewrite a plan on its way to the prefill worker

    async def send_plan(self, address, plan, timeout_s):
        if self.plan_hook is not None:
            plan = self.plan_hook(plan)
        return await self.prefill.submit_plan(plan, Deadline.on_receipt(plan.timeout_s, timeout_s))

    @staticmethod
    def _side(path, opts):
        engine = create_engine(str(path), **opts)
        backend = create_backend("inprocess")
        for addr, n in registered_regions(engine.kv.pools):
            backend.register(addr, n)
        loop = EngineLoop(engine)
        loop.start()
        return engine, loop, backend

    def call(self, coro, timeout_s: float = 60.0):
        """Run a coroutine on the pair's asyncio loop and wait (bounded) for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.aio).result(timeout_s)

    def run(self, prompt, params, request_id="r", deadline_s=20.0, skip_prefill=False, skip_decode=False):
        return self.call(self.dispatch(prompt, params, request_id, deadline_s, skip_prefill, skip_decode),
                         deadline_s + 30)

    async def dispatch(self, prompt, params, request_id="r", deadline_s=20.0, skip_prefill=False,
                       skip_decode=False) -> dict:
        """Both legs concurrently, tied by one transfer id, as the router sends them."""
        deadline = Deadline.after(deadline_s)
        tid = f"t-{request_id}"
        result: dict = {}
        if params.seed is None:  # whoever makes the pair gives both legs one seed (the router does the same)
            params = replace(params, seed=secrets.randbits(63))

        async def prefill():
            try:
                result["prefill"] = await self.prefill.prefill(request_id, tid, prompt, params, deadline)
            except RequestFailed as e:
                result["prefill_error"] = e

        async def decode():
            try:
                result["outputs"] = [out async for out in self.decode.generate(request_id, tid, prompt, params,
                                                                               "peer", deadline)]
            except RequestFailed as e:
                result["decode_error"] = e

        legs = ([] if skip_prefill else [prefill()]) + ([] if skip_decode else [decode()])
        await asyncio.gather(*legs)
        return result

    def free_counts_restored(self) -> bool:
        def ok(engine):
            engine.check_integrity()
            cached = engine.kv.cached_pages()
            return all(used == cached[name] for name, (used, _) in engine.kv.usage().items())

        # Clean-ups are queued on each loop before the calls they end return: these checks run after them.
        return self.p_loop.call(lambda: ok(self.p_engine)) and self.d_loop.call(lambda: ok(self.d_engine))

    def close(self):
        self.aio.call_soon_threadsafe(self.aio.stop)
        self._thread.join(10)
        self.p_loop.stop()
        self.d_loop.stop()


@pytest.fixture
def pair(ckpt):
    p = Pair(ckpt)
    yield p
    p.close()


def test_disaggregated_greedy_equals_offline(ckpt, pair):
    prompts = random_prompts(3, [37, 64, 101], seed=31)
    params = SamplingParams(max_tokens=24, **GREEDY)
    offline = make_llm(ckpt, page_size=16, max_model_len=256).generate(prompt_token_ids=prompts,
                                                                       sampling_params=params)
    for i, (prompt, ref) in enumerate(zip(prompts, offline)):
        out = pair.run(prompt, params, request_id=str(i))
        assert out["outputs"][-1].token_ids == ref.token_ids
        assert out["prefill"].stats.bytes > 0
    assert pair.free_counts_restored()


@pytest.mark.parametrize("speculative", [None, "dspark"], ids=["plain", "dspark"])
def test_seeded_disaggregated_equals_offline(ckpt, speculative):
    """The prefill worker draws token 1, the decode worker every later one: with one seed the tokens are the
    offline engine's (DSpark against offline DSpark: speculation draws differently, with the same distribution)."""
    opts = {**OPTS, "speculative": speculative}
    prompts = random_prompts(3, [37, 64, 101], seed=33)
    params = [SamplingParams(max_tokens=24, seed=900 + i, **SAMPLED) for i in range(3)]
    offline = make_llm(ckpt, **opts).generate(prompt_token_ids=prompts, sampling_params=params)
    pair = Pair(ckpt, opts=opts)
    try:
        for i, (prompt, p, ref) in enumerate(zip(prompts, params, offline)):
            out = pair.run(prompt, p, request_id=str(i))["outputs"][-1]
            assert out.token_ids == ref.token_ids
            assert (out.spec_verify_steps > 0) == (speculative is not None)
        assert pair.free_counts_restored()
    finally:
        pair.close()


def test_decode_draws_fresh_randomness_after_the_prefill_token(ckpt):
    """Token 1 (drawn by the prefill worker) and token 2 (by the decode worker) must come from independent draws.
    At temperature 30 this model's next-token distribution is close to uniform over 256 tokens (no token above
    0.6%), so independent draws coincide about once in 200 seeds. A decode worker that starts a fresh generator
    from the request's seed reuses token 1's draw for token 2, and the two coincide for most seeds."""
    pair = Pair(ckpt, opts={**OPTS, "speculative": None})
    prompt = random_prompts(1, [20], seed=34)[0]
    n = 100
    try:
        outs = [pair.run(prompt, SamplingParams(temperature=30.0, max_tokens=2, seed=s, ignore_eos=True),
                         request_id=str(s))["outputs"][-1].token_ids for s in range(n)]
    finally:
        pair.close()
    same = sum(t[0] == t[1] for t in outs)
    assert same <= 6, f"token 2 equals token 1 for {same} of {n} seeds"  # P(>= 7) < 1e-5 for independent draws
    assert len({t[0] for t in outs}) > n // 2  # and the draws are spread out at all


def test_transferred_rows_equal_a_colocated_run(ckpt, pair, monkeypatch):
    """Snapshot the decode worker's destination rows right after the transfer and compare them with the rows a
    colocated engine computes for the same prompt, for each payload kind."""
    prompt = random_prompts(1, [101], seed=32)[0]  # inside a C4 group and a C128 page; 4 C128 pages
    params = SamplingParams(max_tokens=1, **GREEDY)
    captured = {}
    original = pair.d_engine.adopt

    def capture(request_id, prompt_ids, p, pages, *args, **kw):
        captured.update(rows_by_kind(pair.d_engine, pages, len(prompt_ids)))
        return original(request_id, prompt_ids, p, pages, *args, **kw)

    monkeypatch.setattr(pair.d_engine, "adopt", capture)
    pair.run(prompt, params)

    colocated = create_engine(str(ckpt), **{**OPTS, "enable_prefix_cache": False})
    colocated.add_request(prompt, SamplingParams(max_tokens=1, **GREEDY), request_id="c", hold_pages=True)
    while colocated.has_unfinished:
        colocated.step()
    expected = rows_by_kind(colocated, colocated.requests["c"].pages, len(prompt))
    assert set(expected) == {k.name for k in PoolKind}
    for kind, rows in expected.items():
        assert torch.equal(rows, captured[kind]), kind


def rows_by_kind(engine, pages, prompt_len) -> dict[str, torch.Tensor]:
    """The bytes of every transferable item of a request, per payload kind, in the plan's canonical order."""
    from pdspark.transfer import transfer_plan

    dst = transfer_plan.destination(engine.kv, pages, prompt_len)
    plan = transfer_plan.TransferPlan("t", "r", "", None, (), timeout_s=0, **dst)  # type: ignore[arg-type]
    out: dict[str, list[torch.Tensor]] = {}
    import ctypes

    for buf in cache_buffers(engine.kv.pools):
        for _, item in item_pairs(plan, pages, buf.pool):
            raw = ctypes.string_at(buf.base_addr + item * buf.item_bytes, buf.item_bytes)
            out.setdefault(buf.pool.name, []).append(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    return {k: torch.cat(v) for k, v in out.items()}


def test_incompatible_pair_refuses_before_any_byte_moves(ckpt):
    pair = Pair(ckpt, decode_opts={"page_size": 32})
    try:
        t0 = time.monotonic()
        out = pair.run(random_prompts(1, [40])[0], SamplingParams(max_tokens=4, **GREEDY), deadline_s=10)
        assert out["decode_error"].code == ErrorCode.INCOMPATIBLE
        assert "page_size" in out["decode_error"].message
        assert out["prefill_error"].code == ErrorCode.INCOMPATIBLE
        assert time.monotonic() - t0 < 10
        assert pair.free_counts_restored()
    finally:
        pair.close()


def test_decode_frees_its_pages_when_prefill_never_answers(pair):
    t0 = time.monotonic()
    out = pair.run(random_prompts(1, [40])[0], SamplingParams(max_tokens=4, **GREEDY), deadline_s=1.0,
                   skip_prefill=True)
    assert out["decode_error"].code == ErrorCode.DEADLINE
    assert time.monotonic() - t0 < 3.0
    assert pair.free_counts_restored()


def test_prefill_drops_the_request_when_no_plan_arrives(pair):
    t0 = time.monotonic()
    out = pair.run(random_prompts(1, [40])[0], SamplingParams(max_tokens=4, **GREEDY), deadline_s=1.0,
                   skip_decode=True)
    assert out["prefill_error"].code == ErrorCode.DEADLINE and "plan" in out["prefill_error"].message
    assert time.monotonic() - t0 < 3.0
    assert pair.free_counts_restored()
