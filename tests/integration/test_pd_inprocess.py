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
from pdspark.deadline import Deadline
from pdspark.engine.factory import create_engine
from pdspark.errors import ErrorCode, RequestFailed
from pdspark.serving.decode_worker import DecodeWorker
from pdspark.serving.engine_descriptor import describe_engine
from pdspark.serving.engine_loop import EngineLoop
from pdspark.serving.prefill_worker import PrefillWorker
from pdspark.testing.time_scale import scaled
from pdspark.testing.waiting import until
from pdspark.transfer.backend import create_backend
from pdspark.transfer.transfer_plan import PoolKind, cache_buffers, item_pairs, registered_regions
from pdspark.types import FinishReason

OPTS = dict(page_size=16, max_model_len=256, max_num_seqs=4, c128_page_size=2, speculative="dspark")
SAMPLED = dict(temperature=0.9, top_k=40, top_p=0.95, ignore_eos=True)
DEADLINE_S = scaled(20.0)  # a request's deadline where the test needs none in particular: a bound


@pytest.fixture(scope="module")
def ckpt(draft_ckpt):
    return draft_ckpt


class Pair:
    """A prefill and a decode worker over the in-process backend, on one asyncio loop of their own thread (as in a
    worker process); the decode worker's plans (and its aborts of them) reach the prefill worker directly, with the
    relative timeout turned into a deadline on receipt as the servicer does."""

    def __init__(self, path, decode_opts: dict | None = None, opts: dict | None = None, **decode_kw):
        opts = opts or OPTS
        self.p_engine, self.p_loop, p_backend = self._side(path, opts)
        self.d_engine, self.d_loop, d_backend = self._side(path, {**opts, "enable_prefix_cache": False,
                                                                  **(decode_opts or {})})
        self.prefill = PrefillWorker(self.p_loop, p_backend, describe_engine(self.p_engine))
        self.decode = DecodeWorker(self.d_loop, d_backend, describe_engine(self.d_engine), self.send_plan,
                                   abort_plan=self.abort_plan, **decode_kw)
        self.aio = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.aio.run_forever, daemon=True)
        self._thread.start()
        self.plan_hook = None  # tests may rewrite a plan on its way to the prefill worker

    async def send_plan(self, address, plan, timeout_s):
        if self.plan_hook is not None:
            plan = self.plan_hook(plan)
        return await self.prefill.submit_plan(plan, Deadline.on_receipt(plan.timeout_s, timeout_s))

    async def abort_plan(self, address, request_id):
        return self.prefill.abort(request_id)

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
        return asyncio.run_coroutine_threadsafe(coro, self.aio).result(scaled(timeout_s))

    def run(self, prompt, params, request_id="r", deadline_s=DEADLINE_S, skip_prefill=False, skip_decode=False,
            generated=()):
        return self.call(self.dispatch(prompt, params, request_id, deadline_s, skip_prefill, skip_decode,
                                       generated=generated), deadline_s + 30)

    async def dispatch(self, prompt, params, request_id="r", deadline_s=DEADLINE_S, skip_prefill=False,
                       skip_decode=False, transfer_id=None, generated=()) -> dict:
        """Both legs concurrently, tied by one transfer id, as the router sends them (`generated`: a migrated
        stream's tokens so far: the prefill gets prompt + them, the decode continues after them)."""
        deadline = Deadline.after(deadline_s)
        tid = transfer_id or f"t-{request_id}"
        result: dict = {}
        if params.seed is None:  # whoever makes the pair gives both legs one seed (the router does the same)
            params = replace(params, seed=secrets.randbits(63))

        async def prefill():
            try:
                result["prefill"] = await self.prefill.prefill(request_id, tid, [*prompt, *generated], params,
                                                               deadline, num_generated=len(generated))
            except RequestFailed as e:
                result["prefill_error"] = e

        async def decode():
            try:
                result["outputs"] = [out async for out in self.decode.generate(
                    request_id, tid, prompt, params, "peer", deadline, generated=generated)]
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
        self._thread.join(scaled(10))
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


def test_a_transfer_writes_one_span_per_pool_kind(pair):
    """The pools are page-major and freed pages come back in ascending order, so each request's pages of every
    layer form one run per pool kind on both sides: one write per kind (not one per layer and kind), also for the
    requests that reuse the pages an earlier one freed."""
    kinds = {b.pool.name for b in cache_buffers(pair.p_engine.kv.pools) if b.num_items}
    params = SamplingParams(max_tokens=2, **GREEDY)
    for i, prompt in enumerate(random_prompts(3, [101, 64, 101], seed=35)):
        stats = pair.run(prompt, params, request_id=f"w{i}")["prefill"].stats
        assert stats.num_writes == len(kinds) == len(stats.bytes_by_pool), f"request {i}"
        assert 0 < stats.write_s <= stats.transfer_s
    assert pair.free_counts_restored()


@pytest.mark.parametrize("speculative", [None, "dspark"], ids=["plain", "dspark"])
def test_seeded_disaggregated_equals_offline(ckpt, speculative):
    """The prefill worker draws token 1, the decode worker every later one: with one seed the tokens are the
    offline engine's without DSpark, whether the decode worker speculates or not."""
    opts = {**OPTS, "speculative": speculative}
    prompts = random_prompts(3, [37, 64, 101], seed=33)
    params = [SamplingParams(max_tokens=24, seed=900 + i, **SAMPLED) for i in range(3)]
    plain = make_llm(ckpt, **{**OPTS, "speculative": None})
    offline = plain.generate(prompt_token_ids=prompts, sampling_params=params)
    pair = Pair(ckpt, opts=opts)
    try:
        for i, (prompt, p, ref) in enumerate(zip(prompts, params, offline)):
            out = pair.run(prompt, p, request_id=str(i))["outputs"][-1]
            assert out.token_ids == ref.token_ids
            assert (out.spec_verify_steps > 0) == (speculative is not None)
        assert pair.free_counts_restored()
    finally:
        pair.close()


@pytest.mark.parametrize("sampling", [GREEDY, dict(SAMPLED, seed=77)], ids=["greedy", "seeded"])
def test_a_migrated_stream_continues_exactly_where_the_first_decode_stopped(ckpt, pair, sampling):
    """The rung under live migration: a new pair given prompt + the first k generated tokens produces the rest of
    the uninterrupted output (DSpark on), and its outputs count the k tokens as output (max_tokens, text) while
    their logprobs cover only the new ones."""
    prompt = random_prompts(1, [45], seed=8)[0]
    params = SamplingParams(max_tokens=40, logprobs=2, **sampling)
    offline = make_llm(ckpt, **{k: v for k, v in OPTS.items() if k != "speculative"})
    want = offline.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
    for k in (1, 17, 39):
        got = pair.run(prompt, params, request_id=f"m{k}", generated=want.token_ids[:k])["outputs"][-1]
        assert got.token_ids == want.token_ids, f"migrated after {k} tokens"
        assert got.text == want.text and got.finish_reason == FinishReason.LENGTH
        assert len(got.logprobs) == len(want.token_ids) - k
        for a, b in zip(got.logprobs, want.logprobs[k:]):  # verify rows vs one-row decode: float noise only
            assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert a.top == pytest.approx(b.top, abs=1e-4)
    assert pair.free_counts_restored()


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
        out = pair.run(random_prompts(1, [40])[0], SamplingParams(max_tokens=4, **GREEDY), deadline_s=scaled(10))
        assert out["decode_error"].code == ErrorCode.INCOMPATIBLE
        assert "page_size" in out["decode_error"].message
        assert out["prefill_error"].code == ErrorCode.INCOMPATIBLE
        assert time.monotonic() - t0 < scaled(10)
        assert pair.free_counts_restored()
    finally:
        pair.close()


def test_decode_frees_its_pages_when_prefill_never_answers(pair):
    t0 = time.monotonic()
    out = pair.run(random_prompts(1, [40])[0], SamplingParams(max_tokens=4, **GREEDY), deadline_s=1.0,
                   skip_prefill=True)
    assert out["decode_error"].code == ErrorCode.DEADLINE
    assert time.monotonic() - t0 < scaled(3.0)
    assert pair.free_counts_restored()


def test_prefill_drops_the_request_when_no_plan_arrives(pair):
    t0 = time.monotonic()
    out = pair.run(random_prompts(1, [40])[0], SamplingParams(max_tokens=4, **GREEDY), deadline_s=1.0,
                   skip_decode=True)
    assert out["prefill_error"].code == ErrorCode.DEADLINE and "plan" in out["prefill_error"].message
    assert time.monotonic() - t0 < scaled(3.0)
    assert pair.free_counts_restored()


@pytest.mark.parametrize("prefill_cache, decode_cache", [(True, True), (True, False), (False, False), (False, True)],
                         ids=["both", "prefill-only", "neither", "decode-only"])
def test_prefix_cache_settings_of_a_pair(ckpt, prefill_cache, decode_cache):
    """A decode worker with the prefix cache asks for the SWA tail a later prefix match would need, longer than
    the one a prefill worker without the cache still holds once the prompt is computed: every prompt longer
    than the window failed its transfer. That pair is refused at the rendezvous, naming the setting, as the plan
    arrives (a prompt that started early on the idle engine is dropped with its pages); every other pair transfers
    such a prompt."""
    pair = Pair(ckpt, decode_opts={"enable_prefix_cache": decode_cache},
                opts={**OPTS, "enable_prefix_cache": prefill_cache})
    try:
        out = pair.run(random_prompts(1, [150], seed=35)[0], SamplingParams(max_tokens=4, **GREEDY),
                       deadline_s=scaled(10))
        if prefill_cache or not decode_cache:
            assert "decode_error" not in out, out["decode_error"]
            assert len(out["outputs"][-1].token_ids) == 4
        else:
            for leg in ("decode_error", "prefill_error"):
                assert out[leg].code == ErrorCode.INCOMPATIBLE and "prefix_cache" in out[leg].message
        assert pair.free_counts_restored()
    finally:
        pair.close()


def test_one_prompt_starts_before_its_plan_while_the_engine_is_idle(ckpt, pair):
    """At most `early_prefills` (1) prompts start on their prefill leg's arrival, before their plans, while the
    engine has nothing queued: of two prefill legs, the first is computed and waits for its plan, the second waits
    for its own plan to start. The plans start both transfers, and both requests give the offline engine's tokens,
    as does one whose prompt waited for its plan (early starts off)."""
    prompts = random_prompts(3, [40, 33, 57], seed=44)
    params = SamplingParams(max_tokens=6, seed=5, **GREEDY)
    offline = make_llm(ckpt, page_size=16, max_model_len=256).generate(prompt_token_ids=prompts,
                                                                       sampling_params=params)

    def engine_has(rid: str, finished: bool) -> bool:  # read on the engine's loop thread
        req = pair.p_engine.requests.get(rid)
        return req is not None and (req.finished or not finished)

    async def on_engine(rid: str, finished: bool = False) -> bool:
        return await asyncio.to_thread(pair.p_loop.call, engine_has, rid, finished)

    async def scenario():
        legs = [asyncio.ensure_future(pair.prefill.prefill(rid, f"t-{rid}", prompt, params, Deadline.after(scaled(20))))
                for rid, prompt in (("a", prompts[0]), ("b", prompts[1]))]
        await until(lambda: on_engine("a", finished=True), 20, "the first prompt computed without its plan",
                    interval_s=0.005)
        early_b = await on_engine("b")
        decoded = await asyncio.gather(*(pair.dispatch(prompt, params, rid, transfer_id=f"t-{rid}", skip_prefill=True)
                                         for rid, prompt in (("a", prompts[0]), ("b", prompts[1]))))
        return early_b, decoded, await asyncio.gather(*legs)

    early_b, decoded, results = pair.call(scenario())
    assert not early_b, "a second prompt started before its plan"
    for out, result, ref in zip(decoded, results, offline):
        assert out["outputs"][-1].token_ids == ref.token_ids
        assert result.stats.bytes > 0
    pair.prefill.early_prefills = 0
    assert pair.run(prompts[2], params, request_id="c")["outputs"][-1].token_ids == offline[2].token_ids
    assert pair.free_counts_restored()


@pytest.mark.parametrize("field", ["full_pages", "swa_pages", "c128_pages", "req_slot"])
def test_a_plan_naming_items_outside_the_decode_pools_writes_nothing(pair, field):
    def out_of_range(plan):
        items = getattr(plan, field)
        bad = 10_000 if field == "req_slot" else (items[0] + 10_000,) + items[1:]
        return replace(plan, **{field: bad})

    pair.plan_hook = out_of_range
    # The prompt waits for its plan (no early start on the idle engine, which would race the plan): the refusal
    # then comes before the prompt is computed, so before any write.
    pair.prefill.early_prefills = 0
    out = pair.run(random_prompts(1, [101], seed=37)[0], SamplingParams(max_tokens=4, **GREEDY),
                   deadline_s=scaled(10))
    for leg in ("decode_error", "prefill_error"):
        assert out[leg].code == ErrorCode.INVALID_REQUEST and f"TransferPlan.{field}" in out[leg].message
    assert pair.p_loop.steps == 0
    assert pair.free_counts_restored()


def test_a_plan_with_an_unknown_payload_kind_fails_both_legs_at_once(pair):
    from pdspark.rpc import convert
    from pdspark.serving.grpc_services import PrefillServicer
    from pdspark.v1 import worker_pb2

    class Context:  # what the servicer reads of a grpc.aio call
        def time_remaining(self):
            return None

    prompt = random_prompts(1, [40], seed=38)[0]
    bad = worker_pb2.TransferPlan(transfer_id="t-bad", prompt_len=len(prompt), timeout_ms=10_000,
                                  buffers=[worker_pb2.BufferDescriptor(pool=99, item_bytes=64, num_items=4)])

    async def scenario():
        answer = await PrefillServicer(pair.prefill).SubmitPlan(bad, Context())
        t0 = time.monotonic()
        with pytest.raises(RequestFailed) as e:  # the router's leg, arriving after the refused plan
            await pair.prefill.prefill("r", "t-bad", prompt, SamplingParams(**GREEDY), Deadline.after(scaled(10)))
        return convert.failure_from_pb(answer.error), e.value, time.monotonic() - t0

    refused, prefill_error, seconds = pair.call(scenario())
    assert refused.code == prefill_error.code == ErrorCode.INCOMPATIBLE
    assert "TransferPlan.buffers[0].pool" in refused.message and seconds < scaled(1.0)
    assert pair.free_counts_restored()


def test_a_request_id_in_flight_is_refused_by_either_worker(pair):
    prompt = random_prompts(1, [40], seed=39)[0]
    params = SamplingParams(max_tokens=4, seed=1, **GREEDY)

    async def scenario():
        # The first request waits (no prefill leg for it) until its 2 s deadline.
        first = asyncio.ensure_future(pair.dispatch(prompt, params, "dup", deadline_s=2.0, skip_prefill=True))
        await until(lambda: pair.decode.transfers_in_flight == 1, 10, "the transfer in flight at the decode worker")
        t0 = time.monotonic()
        second = await pair.dispatch(prompt, params, "dup", deadline_s=scaled(10), transfer_id="t-other",
                                     skip_prefill=True)
        refused_in = time.monotonic() - t0
        return await first, second, refused_in

    first, second, refused_in = pair.call(scenario())
    assert second["decode_error"].code == ErrorCode.ALREADY_EXISTS and refused_in < scaled(1.0)
    assert first["decode_error"].code == ErrorCode.DEADLINE  # the first request is not disturbed by it
    # The prefill side: a second prefill leg under the same id (another transfer) while the first is in flight.
    deadline = Deadline.after(1.0)

    async def prefill_legs():
        return await asyncio.gather(pair.prefill.prefill("p", "t1", prompt, params, deadline),
                                    pair.prefill.prefill("p", "t2", prompt, params, deadline),
                                    return_exceptions=True)

    a, b = pair.call(prefill_legs())
    assert a.code == ErrorCode.DEADLINE and b.code == ErrorCode.ALREADY_EXISTS
    assert pair.free_counts_restored()


def test_requests_wait_in_line_for_destination_pages(ckpt):
    """One request slot on the decode side: the second request waits (no polling: the engine loop grants it when
    the first lets go) and both complete; a third whose deadline passes in line fails (OVERLOADED: this worker is
    full), and frees nothing twice."""
    pair = Pair(ckpt, decode_opts={"max_num_seqs": 1})
    prompts = random_prompts(3, [37, 50, 20], seed=40)
    params = SamplingParams(max_tokens=8, **GREEDY)
    try:
        async def scenario():
            most_waiting = 0

            async def watch():  # sampling an observable count, not synchronising
                nonlocal most_waiting
                while True:
                    most_waiting = max(most_waiting, pair.decode.waiting)
                    await asyncio.sleep(0.002)

            watcher = asyncio.ensure_future(watch())
            outs = await asyncio.gather(pair.dispatch(prompts[0], params, "a"), pair.dispatch(prompts[1], params, "b"))
            watcher.cancel()
            # The slot held by a request whose prefill never comes: the next one waits in line past its deadline
            # (the holder's, scaled, stays far beyond the next one's own 0.3 s on a slow machine too).
            holder = asyncio.ensure_future(pair.dispatch(prompts[0], params, "c", deadline_s=scaled(2.0),
                                                         skip_prefill=True))
            await until(lambda: pair.decode.transfers_in_flight == 1, 10, "the transfer in flight at the decode worker")
            t0 = time.monotonic()
            late = await pair.dispatch(prompts[2], params, "d", deadline_s=0.3)
            return outs, most_waiting, late, time.monotonic() - t0, await holder

        outs, most_waiting, late, late_s, holder = pair.call(scenario())
        # The second waited for the slot (both count as waiting until the engine loop grants the first its pages).
        assert 1 <= most_waiting <= 2
        assert all(len(o["outputs"][-1].token_ids) == 8 for o in outs)
        assert late["decode_error"].code == ErrorCode.OVERLOADED and "no room" in late["decode_error"].message
        # Its own deadline, not the holder's (a shared 2-core machine adds delay); the decode worker stops waiting a
        # margin (10%) before it, so that its refusal reaches the router before the prefill leg's DEADLINE.
        assert 0.27 <= late_s < scaled(2.0)
        assert holder["decode_error"].code == ErrorCode.DEADLINE
        assert pair.free_counts_restored()
    finally:
        pair.close()


def test_abort_ends_a_waiting_request_at_once_on_either_worker(pair):
    prompt = random_prompts(1, [40], seed=41)[0]
    params = SamplingParams(max_tokens=4, seed=2, **GREEDY)

    async def scenario():
        waiting = asyncio.ensure_future(pair.dispatch(prompt, params, "a", deadline_s=scaled(10), skip_prefill=True))
        await until(lambda: pair.decode.transfers_in_flight == 1, 10, "the transfer in flight at the decode worker")
        t0 = time.monotonic()
        assert pair.decode.abort("a") and not pair.decode.abort("unknown")
        decode_out = await waiting
        decode_s = time.monotonic() - t0
        waiting = asyncio.ensure_future(pair.dispatch(prompt, params, "b", deadline_s=scaled(10), skip_decode=True))
        await until(lambda: pair.prefill.in_flight == 1, 10, "the request at the prefill worker")
        t0 = time.monotonic()
        assert pair.prefill.abort("b")
        return decode_out, decode_s, await waiting, time.monotonic() - t0

    decode_out, decode_s, prefill_out, prefill_s = pair.call(scenario())
    assert decode_out["decode_error"].code == ErrorCode.ABORTED and decode_s < scaled(1.0)
    assert prefill_out["prefill_error"].code == ErrorCode.ABORTED and prefill_s < scaled(1.0)
    assert pair.free_counts_restored()


def test_abort_stops_a_running_request_with_an_abort_output(pair):
    prompt = random_prompts(1, [40], seed=42)[0]
    params = SamplingParams(max_tokens=200, seed=3, **GREEDY)  # long enough to be still running when aborted
    deadline = Deadline.after(scaled(20))

    async def scenario():
        prefill = asyncio.ensure_future(pair.prefill.prefill("a", "t-a", prompt, params, deadline))
        outputs = []
        async for out in pair.decode.generate("a", "t-a", prompt, params, "peer", deadline):
            outputs.append(out)
            if len(outputs) == 2:
                t0 = time.monotonic()
                assert pair.decode.abort("a")  # answered at once: the engine is told between two steps
        await prefill
        return outputs, time.monotonic() - t0

    outputs, seconds = pair.call(scenario())
    last = outputs[-1]
    assert last.finished and last.finish_reason == FinishReason.ABORT and len(last.token_ids) < 200
    assert seconds < scaled(1.0)
    assert pair.free_counts_restored()


def test_an_fp8_cache_ships_its_packed_rows_and_generates_the_offline_fp8_tokens(ckpt, pair):
    """`kv_cache_dtype='fp8_e4m3'` on both sides: the packed rows ship as they are (under half the fp32 rows' bytes
    at this model's 32-channel heads; the fp32 compressor states and draft rows unchanged), and the pair generates
    the offline FP8 engine's tokens (DSpark on)."""
    fp8 = {**OPTS, "kv_cache_dtype": "fp8_e4m3"}
    prompts = random_prompts(3, [37, 64, 101], seed=36)
    params = SamplingParams(max_tokens=24, **GREEDY)
    offline = make_llm(ckpt, **fp8).generate(prompt_token_ids=prompts, sampling_params=params)
    pair8 = Pair(ckpt, opts=fp8)
    try:
        for i, (prompt, ref) in enumerate(zip(prompts, offline)):
            out = pair8.run(prompt, params, request_id=f"f{i}")
            assert out["outputs"][-1].token_ids == ref.token_ids
            fp8_stats, float_stats = out["prefill"].stats, pair.run(prompt, params, request_id=f"b{i}")["prefill"].stats
            print(f"{len(prompt)}-token prompt: {fp8_stats.bytes} bytes fp8 {fp8_stats.bytes_by_pool}, "
                  f"{float_stats.bytes} fp32 {float_stats.bytes_by_pool}")
            rows = ("SWA_KV", "C4_KV", "C4_INDEX", "C128_KV")  # the packed pools (states and draft rows stay fp32)
            assert sum(fp8_stats.bytes_by_pool[k] for k in rows) < 0.5 * sum(float_stats.bytes_by_pool[k]
                                                                               for k in rows)
            assert all(fp8_stats.bytes_by_pool[k] == float_stats.bytes_by_pool[k]
                       for k in float_stats.bytes_by_pool if k not in rows)
        assert pair8.free_counts_restored()
    finally:
        pair8.close()


@pytest.mark.parametrize("sampling", [GREEDY, dict(SAMPLED, seed=78)], ids=["greedy", "seeded"])
def test_the_sampling_controls_give_the_offline_tokens_through_pd_and_after_a_migration(ckpt, pair, sampling):
    """The prefill worker samples the first token with the prompt as its history, the decode worker the rest (DSpark
    on); a migrated stream's prefill counts the tokens generated before it as output (`num_generated`), as the
    uninterrupted stream did."""
    prompt = random_prompts(1, [45], seed=9)[0]
    params = SamplingParams(max_tokens=30, presence_penalty=0.6, frequency_penalty=0.3, repetition_penalty=1.2,
                            min_tokens=5, logit_bias={5: 2.0}, banned_token_ids=(7,), **sampling)
    offline = make_llm(ckpt, **{k: v for k, v in OPTS.items() if k != "speculative"})
    want = offline.generate(prompt_token_ids=[prompt], sampling_params=params)[0].token_ids
    for k in (0, 1, 17):
        got = pair.run(prompt, params, request_id=f"c{k}", generated=want[:k])["outputs"][-1]
        assert got.token_ids == want, f"migrated after {k} tokens"
    assert pair.free_counts_restored()


def test_the_prefill_worker_returns_the_prompt_logprobs_the_decode_worker_streams_first(ckpt, pair):
    """`prompt_logprobs`: the prefill worker computes them (the head over every prompt position, no prefix-cache
    skip) and ships them with its result; the decode worker's first output carries them; the offline engine's."""
    prompt = random_prompts(1, [70], seed=12)[0]
    params = SamplingParams(max_tokens=4, prompt_logprobs=2, **GREEDY)
    offline = make_llm(ckpt, **{k: v for k, v in OPTS.items() if k != "speculative"})
    want = offline.generate(prompt_token_ids=[prompt], sampling_params=params)[0].prompt_logprobs
    out = pair.run(prompt, params, request_id="plp")
    assert [lp.token_id for lp in out["prefill"].prompt_logprobs] == prompt[1:]
    got = out["outputs"][0].prompt_logprobs
    assert got[0] is None and len(got) == len(prompt)
    for a, b in zip(got[1:], want[1:]):
        assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-5)
        assert a.top.keys() == b.top.keys()
    assert pair.free_counts_restored()


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=0.9, seed=79)], ids=["greedy", "seeded"])
def test_a_structured_output_gives_the_offline_tokens_through_pd_and_after_a_migration(ckpt, pair, sampling):
    """The prefill worker masks the first token, the decode worker every later one and every DSpark verify row; a
    migrated stream's new cursor follows the tokens generated before it: the offline tokens, a matching text. (A
    regex without `"`: this checkpoint's byte tokenizer spends that character on its EOS id, as no real one does;
    JSON through P/D and migration runs on the shipped model in tests/cluster/test_structured_cluster.py.)"""
    import re

    from pdspark.types import StructuredOutputs

    pattern = r"[a-z]{1,6}(,[0-9]{1,2}){1,3};"
    prompt = random_prompts(1, [30], seed=10)[0]
    params = SamplingParams(max_tokens=40, structured_outputs=StructuredOutputs.of(regex=pattern), **sampling)
    offline = make_llm(ckpt, **{k: v for k, v in OPTS.items() if k != "speculative"})
    want = offline.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
    # (the text ends with the EOS id's `"`: this tokenizer does not know it as special)
    assert want.finish_reason == FinishReason.STOP and re.fullmatch(pattern + '"', want.text), want.text
    for k in (0, 1, 5):
        got = pair.run(prompt, params, request_id=f"s{k}", generated=want.token_ids[:k])["outputs"][-1]
        assert got.token_ids == want.token_ids, f"migrated after {k} tokens"
    bad = replace(params, structured_outputs=StructuredOutputs.of(grammar="root ::= "))
    out = pair.run(prompt, bad, request_id="bad")
    assert out["prefill_error"].code is ErrorCode.INVALID_REQUEST and "structured_outputs.grammar" in str(
        out["prefill_error"])
    assert pair.free_counts_restored()
