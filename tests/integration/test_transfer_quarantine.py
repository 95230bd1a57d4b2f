"""When a decode worker frees the destination pages of a transfer that did not complete (serving/decode_worker.py):
at once when the prefill worker answered; once it answered when the decode side gave up first (it asks the prefill
worker to drop the transfer rather than cancel the call); and only after the plan's deadline plus the backend's
write grace when the prefill worker never answered, since it may still write until then (and never sooner than
that grace after the decode worker learns of it); at once again when the plan never left (the prefill worker was
unreachable when it was due). Quarantined slots and pages show in the load report, and a worker whose every slot is
quarantined refuses at once.

A real engine and `DecodeWorker` on the in-process backend; the prefill worker is played by the test, which
answers each plan (or not) when it chooses. Every free is observed on the pools, with a deadline.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from conftest import random_prompts
from helpers import GREEDY
from pdspark import SamplingParams
from pdspark.deadline import Deadline
from pdspark.engine.factory import create_engine
from pdspark.errors import ErrorCode, NotSent, RequestFailed, Unanswered
from pdspark.serving.decode_worker import DecodeWorker
from pdspark.serving.engine_descriptor import describe_engine
from pdspark.serving.engine_loop import EngineLoop
from pdspark.serving.grpc_services import DecodeServicer
from pdspark.serving.reservation_queue import no_room
from pdspark.testing.time_scale import scaled
from pdspark.testing.waiting import async_seen_at, until
from pdspark.transfer.inprocess_backend import InProcessBackend
from pdspark.transfer.plan import TransferResult, TransferStats
from pdspark.transfer.transfer_plan import registered_regions
from pdspark.v1 import worker_pb2

GRACE_S = 0.3
PARAMS = SamplingParams(max_tokens=4, **GREEDY)
PROMPT = random_prompts(1, [40], seed=70)[0]
SLACK_S = scaled(1.0)  # how late a free may be observed on a loaded machine (timers, engine-loop turns, polling)


@pytest.fixture(scope="module")
def loop(draft_ckpt):
    engine = create_engine(str(draft_ckpt), page_size=16, max_model_len=256, max_num_seqs=4, c128_page_size=2,
                           enable_prefix_cache=False)
    loop = EngineLoop(engine)
    loop.start()
    yield loop
    loop.stop()


class FakePrefill:
    """Plays the prefill worker of one transfer: records the plan, answers when the test resolves `answer`."""

    def __init__(self) -> None:
        self.plan = None
        self.sent_at = 0.0
        self.answer: asyncio.Future = asyncio.get_running_loop().create_future()
        self.cancelled = False
        self.aborts: list[str] = []
        self.on_abort = None  # what an abort does (as the prefill worker would: fail the transfer)

    async def send_plan(self, address, plan, timeout_s):
        self.plan = plan
        try:
            return await asyncio.shield(self.answer)
        except asyncio.CancelledError:
            self.cancelled = True
            raise

    async def abort_plan(self, address, request_id):
        self.aborts.append(request_id)
        if self.on_abort is not None:
            self.on_abort()
        return True


def make_worker(loop, prefill: FakePrefill, with_abort: bool = True) -> DecodeWorker:
    backend = InProcessBackend(write_grace_s=GRACE_S)
    for addr, n in registered_regions(loop.engine.kv.pools):
        backend.register(addr, n)
    return DecodeWorker(loop, backend, describe_engine(loop.engine), prefill.send_plan,
                        abort_plan=prefill.abort_plan if with_abort else None)


async def used(loop) -> dict[str, int]:
    def read():
        loop.engine.check_integrity()
        return {pool: n for pool, (n, _) in loop.engine.kv.usage().items()}

    return await asyncio.wrap_future(loop.submit(read))


async def restored(loop, before: dict[str, int]) -> bool:
    return await used(loop) == before


async def start(worker: DecodeWorker, prefill: FakePrefill, deadline_s: float) -> asyncio.Task:
    """A request whose plan is out (the fake prefill holds it)."""
    async def consume():
        return [out async for out in worker.generate("r", "t", PROMPT, PARAMS, "peer", Deadline.after(deadline_s))]

    task = asyncio.ensure_future(consume())
    await until(lambda: prefill.plan is not None, 10, "the plan sent")
    return task


def test_an_unanswered_transfer_quarantines_its_pages_until_no_write_can_land(loop):
    async def scenario():
        prefill = FakePrefill()
        worker = make_worker(loop, prefill)
        before = await used(loop)
        t0 = time.monotonic()  # before the plan went out: a lower bound of its send time
        task = await start(worker, prefill, deadline_s=1.5)
        held = await used(loop)
        prefill.answer.set_exception(Unanswered(ErrorCode.UNAVAILABLE, "the prefill worker's lease lapsed"))
        with pytest.raises(RequestFailed) as failed:
            await task
        assert failed.value.code is ErrorCode.UNAVAILABLE
        quarantined = dict(worker.quarantined_pages)
        freed_at = await async_seen_at(lambda: restored(loop, before), 10, "the quarantined pages freed")
        return prefill.plan, t0, held, before, quarantined, freed_at, worker

    plan, t0, held, before, quarantined, freed_at, worker = asyncio.run(scenario())
    # The reservation, and nothing else, is what the quarantine counts.
    assert quarantined == {pool: held[pool] - before[pool] for pool in before}
    assert quarantined["req_slots"] == 1 and quarantined["full"] > 0
    release_at = t0 + plan.timeout_s + GRACE_S
    assert freed_at >= release_at, "freed while the prefill worker could still write"
    assert freed_at < release_at + SLACK_S
    assert all(n == 0 for n in worker.quarantined_pages.values()) and worker.transfers_in_flight == 0


@pytest.mark.parametrize("answer", ["bad_checksum", "reported_failure", "never_sent"])
def test_a_transfer_the_prefill_worker_answered_frees_at_once(loop, answer):
    """Also a plan that never left (`never_sent`: the prefill worker was unreachable when it was due, `NotSent`):
    nothing can have been written, so nothing is quarantined."""
    async def scenario():
        prefill = FakePrefill()
        worker = make_worker(loop, prefill)
        before = await used(loop)
        task = await start(worker, prefill, deadline_s=scaled(20))
        t0 = time.monotonic()
        if answer == "reported_failure":
            prefill.answer.set_exception(RequestFailed(ErrorCode.TRANSFER, "the prefill worker's writes failed"))
        elif answer == "never_sent":
            prefill.answer.set_exception(NotSent(ErrorCode.UNAVAILABLE, "prefill worker unreachable; not sent"))
        else:  # a result whose cache does not check out (a CRC32 is never -1): all of it landed already
            prefill.answer.set_result(TransferResult("t", first_token=5, num_cached_tokens=0, checksum=-1,
                                                     stats=TransferStats()))
        with pytest.raises(RequestFailed):
            await task
        freed_at = await async_seen_at(lambda: restored(loop, before), 10, "the pages freed")
        return freed_at - t0, worker

    seconds, worker = asyncio.run(scenario())
    assert seconds < SLACK_S  # not the (20 s) deadline: nothing is quarantined
    assert all(n == 0 for n in worker.quarantined_pages.values()) and worker.transfers_in_flight == 0


def test_giving_up_asks_the_prefill_worker_and_frees_once_it_answers(loop):
    """An abort ends the request at once; the pages wait for the prefill worker's answer (its writes stopping)."""
    async def scenario():
        prefill = FakePrefill()
        worker = make_worker(loop, prefill)
        before = await used(loop)
        task = await start(worker, prefill, deadline_s=scaled(20))
        assert worker.abort("r")
        with pytest.raises(RequestFailed) as failed:
            await task
        assert failed.value.code is ErrorCode.ABORTED
        await until(lambda: prefill.aborts == ["r"], 5, "the abort sent to the prefill worker")
        # The prefill worker is still writing: the pages stay, and so does the transfer.
        assert await used(loop) != before and worker.transfers_in_flight == 1 and not prefill.cancelled
        t0 = time.monotonic()
        prefill.answer.set_exception(RequestFailed(ErrorCode.ABORTED, "request 'r' aborted"))  # writes stopped
        freed_at = await async_seen_at(lambda: restored(loop, before), 10, "the pages freed")
        return freed_at - t0, worker

    seconds, worker = asyncio.run(scenario())
    assert seconds < SLACK_S
    assert worker.transfers_in_flight == 0 and all(n == 0 for n in worker.quarantined_pages.values())


@pytest.mark.parametrize("how", ["abort_unanswered", "cancel_without_abort_plan"])
def test_giving_up_on_a_prefill_worker_that_does_not_answer_quarantines(loop, how):
    """The caller goes away (the router's lease lapsed) while the plan is out, and the prefill worker gives no
    answer: either its call ends unanswered, or (no way to ask it) the call is cancelled."""
    async def scenario():
        prefill = FakePrefill()
        if how == "abort_unanswered":
            prefill.on_abort = lambda: prefill.answer.set_exception(Unanswered(ErrorCode.UNAVAILABLE, "lease lapsed"))
        worker = make_worker(loop, prefill, with_abort=how == "abort_unanswered")
        before = await used(loop)
        t0 = time.monotonic()
        task = await start(worker, prefill, deadline_s=1.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await until(lambda: any(worker.quarantined_pages.values()), 5, "the pages quarantined")
        freed_at = await async_seen_at(lambda: restored(loop, before), 10, "the quarantined pages freed")
        return prefill, t0, freed_at, worker

    prefill, t0, freed_at, worker = asyncio.run(scenario())
    assert prefill.cancelled == (how == "cancel_without_abort_plan")
    release_at = t0 + prefill.plan.timeout_s + GRACE_S
    assert release_at <= freed_at < release_at + SLACK_S
    assert worker.transfers_in_flight == 0 and all(n == 0 for n in worker.quarantined_pages.values())


def test_a_failure_learnt_late_quarantines_for_the_grace_from_then(loop):
    """A decode worker that was stopped itself learns of the failure only on resuming, after the plan's deadline and
    grace passed; writes held up by it land just then, so the grace counts from when it learns of the failure."""
    async def scenario():
        prefill = FakePrefill()
        worker = make_worker(loop, prefill)
        before = await used(loop)
        t0 = time.monotonic()
        task = await start(worker, prefill, deadline_s=0.5)
        # The scenario's time passing (not a synchronisation): past when the pages would be freed by the deadline.
        await asyncio.sleep(max(0.0, t0 + prefill.plan.timeout_s + GRACE_S + 0.2 - time.monotonic()))
        learnt_at = time.monotonic()
        prefill.answer.set_exception(Unanswered(ErrorCode.UNAVAILABLE, "the connection broke"))
        with pytest.raises(RequestFailed):
            await task
        freed_at = await async_seen_at(lambda: restored(loop, before), 10, "the quarantined pages freed")
        return learnt_at, freed_at, worker

    learnt_at, freed_at, worker = asyncio.run(scenario())
    assert learnt_at + GRACE_S <= freed_at < learnt_at + GRACE_S + SLACK_S
    assert all(n == 0 for n in worker.quarantined_pages.values())


class UnansweredPrefill:
    """A prefill worker whose lease lapses as each plan reaches it: every plan ends `Unanswered`."""

    def __init__(self) -> None:
        self.plans: list = []

    async def send_plan(self, address, plan, timeout_s):
        self.plans.append(plan)
        raise Unanswered(ErrorCode.UNAVAILABLE, "the prefill worker's lease lapsed")

    async def abort_plan(self, address, request_id):
        return False


async def _fails(worker: DecodeWorker, request_id: str, deadline_s: float) -> RequestFailed:
    with pytest.raises(RequestFailed) as failed:
        async for _ in worker.generate(request_id, f"t-{request_id}", PROMPT, PARAMS, "peer",
                                       Deadline.after(deadline_s)):
            pass
    return failed.value


def test_a_worker_whose_slots_are_all_quarantined_reports_them_and_refuses_at_once(loop):
    """Every request slot (4) is quarantined: the load report shows them (slots and pages), and a request that
    could only wait for the quarantines to end (after its deadline) is refused with OVERLOADED at once, so the
    router tries another decode worker, instead of waiting in line until its deadline."""
    async def scenario():
        worker = make_worker(loop, UnansweredPrefill())
        servicer = DecodeServicer(worker)
        before = await used(loop)
        slots = loop.engine.kv.usage()["req_slots"].total
        quarantine_s = scaled(3.0)  # each plan's deadline: how long its slot stays quarantined (the behaviour)
        for i in range(slots):
            assert (await _fails(worker, f"q{i}", quarantine_s)).code is ErrorCode.UNAVAILABLE
        await until(lambda: worker.quarantined_pages["req_slots"] == slots, 5, "every slot quarantined")
        report = await servicer.GetLoad(worker_pb2.LoadRequest(), None)
        t0 = time.monotonic()
        refused = await _fails(worker, "late", scaled(20))
        refused_s = time.monotonic() - t0
        await async_seen_at(lambda: restored(loop, before), 10, "the quarantined pages freed")
        after = await servicer.GetLoad(worker_pb2.LoadRequest(), None)
        return slots, report, refused, refused_s, after

    slots, report, refused, refused_s, after = asyncio.run(scenario())
    assert report.quarantined_slots == slots
    assert report.quarantined_pages["req_slots"] == slots and report.quarantined_pages["full"] > 0
    assert refused.code is ErrorCode.OVERLOADED and "quarantined" in refused.message
    assert refused_s < SLACK_S  # at once, not at its 20 s deadline
    assert after.quarantined_slots == 0 and not any(after.quarantined_pages.values())


def test_a_request_gives_up_waiting_for_room_before_the_prefill_side_gives_up_on_its_plan(loop):
    """No room for the prompt's cache before the deadline is this decode worker's own shortage: it ends the wait a
    margin before the deadline (the prefill worker fails the rendezvous at the deadline, which the router would
    blame on the prefill worker), and reports OVERLOADED, which the router blames on this worker."""
    async def scenario():
        worker = make_worker(loop, FakePrefill())
        waited_until: list[float] = []

        async def full(prompt_ids, params, deadline_at):  # every slot busy: the wait ends with no room
            waited_until.append(deadline_at)
            raise no_room()

        worker.engine.reserve = full
        deadline = Deadline.after(scaled(20))
        with pytest.raises(RequestFailed) as failed:
            async for _ in worker.generate("r", "t", PROMPT, PARAMS, "peer", deadline):
                pass
        return deadline, waited_until, failed.value

    deadline, waited_until, failure = asyncio.run(scenario())
    assert failure.code is ErrorCode.OVERLOADED
    # 10% of what is left, at most a second (here a second): the plan's own answer margin.
    assert deadline.at - waited_until[0] == pytest.approx(1.0)
