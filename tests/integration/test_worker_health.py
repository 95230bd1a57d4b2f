"""Busy is not unhealthy: the registry's liveness (gRPC health checks) and load (GetLoad) are watched apart, on
stub workers with the router's default intervals. A worker whose load report hangs stays healthy and keeps
serving; one whose health check hangs, answers NOT_SERVING or dies is skipped within 2 s, and comes back (at once
the first time, after a growing wait when it keeps falling). Requests waiting on a worker that is marked down
before their first token are retried on another one then."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from pdspark.config import RouterConfig
from pdspark.testing.time_scale import scaled
from pdspark.testing.waiting import run_within, until
from pdspark.testing.worker_stubs import HANG, OK
from router_harness import RouterHarness, completion

DETECT_S = 2.0  # the bound for noticing a dead or hung worker (docs/operations.md)


def test_the_defaults_promise_detection_within_2_s():
    cfg = RouterConfig().health
    assert cfg.health_interval_s + 2 * cfg.health_timeout_s <= DETECT_S


def test_a_worker_whose_load_report_hangs_stays_healthy_and_serves():
    async def scenario():
        # Short intervals: the test watches several load polls go unanswered.
        async with await RouterHarness.start(poll=True, load_interval_s=0.25, health_interval_s=0.2,
                                             health_timeout_s=0.2) as h, aiohttp.ClientSession() as s:
            decode = h.worker(h.decode[0])
            h.decode[0].load_mode = HANG
            t0 = time.time()
            # Several load intervals and liveness checks pass; health never wavers.
            loop = asyncio.get_running_loop()
            start = loop.time()
            while loop.time() - start < 3 * h.registry.load_interval_s:
                assert decode.healthy and decode.failures == 0
                await asyncio.sleep(0.05)
            assert decode.last_check > t0 + 2 * h.registry.load_interval_s  # it was being checked all along
            assert decode.last_load < t0  # ... and never got a load report
            assert h.worker(h.prefill[0]).last_load > t0  # the other worker's reports kept coming
            body = await completion(h, session=s)
            assert body["usage"]["completion_tokens"] == 4

    run_within(scenario())


def test_a_hung_worker_is_skipped_within_2_s_and_back_when_it_answers():
    async def scenario():
        async with await RouterHarness.start(decodes=2, poll=True) as h, aiohttp.ClientSession() as s:
            hung = h.worker(h.decode[0])
            await until(lambda: hung.last_check > 0, 2, "the first health check")
            h.health[id(h.decode[0])].mode = HANG
            took = await until(lambda: not hung.healthy, DETECT_S, "the hung worker marked unhealthy")
            print(f"\nhung worker marked unhealthy after {took * 1e3:.0f} ms")
            await completion(h, session=s)
            assert h.decode[0].calls == [] and len(h.decode[1].calls) == 1  # the policy would pick decode[0]
            h.health[id(h.decode[0])].mode = OK
            await until(lambda: hung.healthy, DETECT_S, "the worker healthy again")
            await completion(h, session=s)
            assert len(h.decode[0].calls) == 1

    run_within(scenario())


def test_a_not_serving_worker_is_skipped_within_2_s():
    async def scenario():
        async with await RouterHarness.start(poll=True) as h:
            w = h.worker(h.prefill[0])
            await until(lambda: w.last_check > 0, 2, "the first health check")
            h.health[id(h.prefill[0])].mode = "not_serving"
            took = await until(lambda: not w.healthy, DETECT_S, "the NOT_SERVING worker marked unhealthy")
            print(f"\nNOT_SERVING worker marked unhealthy after {took * 1e3:.0f} ms")

    run_within(scenario())


def test_a_dead_worker_is_skipped_within_2_s():
    async def scenario():
        async with await RouterHarness.start(poll=True) as h:
            w = h.worker(h.decode[0])
            await until(lambda: w.last_check > 0, 2, "the first health check")
            await h.stop_worker(h.decode[0])
            took = await until(lambda: not w.healthy, DETECT_S, "the dead worker marked unhealthy")
            print(f"\ndead worker marked unhealthy after {took * 1e3:.0f} ms")

    run_within(scenario())


def test_a_worker_added_at_run_time_is_watched():
    async def scenario():
        async with await RouterHarness.start(poll=True) as h:
            w = h.worker(h.decode[0])
            h.registry.remove(w.address)
            again = h.registry.add("decode", w.address)
            await until(lambda: again.last_check > 0 and again.last_load > 0, DETECT_S, "checks of the new entry")

    run_within(scenario())


def test_a_fallen_worker_is_readmitted_at_once_the_first_time_then_with_backoff():
    """A worker back after its first fall is re-admitted at its first answer (a restarted worker serves again at
    once); one that falls again must answer for `readmit_backoff_s`, doubled per fall, before it gets requests;
    one that stays healthy for `stable_s` starts over."""
    async def scenario():
        async with await RouterHarness.start(poll=True, health_interval_s=0.1, health_timeout_s=0.1) as h:
            h.registry.readmit_backoff_s, h.registry.stable_s = 0.5, 2.0
            w, health = h.worker(h.prefill[0]), h.health[id(h.prefill[0])]
            await until(lambda: w.last_check > 0, 2, "the first health check")

            async def fall_and_return() -> float:
                health.mode = HANG
                await until(lambda: not w.healthy, DETECT_S, "the worker marked unhealthy")
                health.mode = OK
                return await until(lambda: w.healthy, 5, "the worker re-admitted")

            waits = [await fall_and_return() for _ in range(3)]
            assert w.downs == 3
            await until(lambda: w.downs == 0, 4, "the fall count reset after stable_s healthy")
            waits.append(await fall_and_return())
            print("\nre-admitted after answering for " + ", ".join(f"{s:.2f}" for s in waits) + " s")
            # One check interval (and the hung check's timeout) of slack on each side.
            assert waits[0] < 0.3 and waits[3] < 0.3
            assert 0.5 <= waits[1] < 0.8 and 1.0 <= waits[2] < 1.3

    run_within(scenario())


def test_on_down_is_called_once_per_fall():
    async def scenario():
        async with await RouterHarness.start(poll=True, health_interval_s=0.1, health_timeout_s=0.1) as h:
            w, health = h.worker(h.decode[0]), h.health[id(h.decode[0])]
            fallen: list[str] = []
            h.registry.on_down.append(lambda worker: fallen.append(worker.address))
            await until(lambda: w.last_check > 0, 2, "the first health check")
            health.mode = "not_serving"
            await until(lambda: not w.healthy, DETECT_S, "the worker marked unhealthy")
            checks = w.last_check
            await until(lambda: w.last_check > checks + 0.3, 2, "more failed checks")
            assert fallen == [w.address]  # told once, not at every missed check
            health.mode = OK
            await until(lambda: w.healthy, DETECT_S, "the worker healthy again")
            health.mode = HANG
            await until(lambda: not w.healthy, DETECT_S, "the worker marked unhealthy again")
            assert fallen == [w.address, w.address]

    run_within(scenario())


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_requests_on_a_hung_worker_are_retried_elsewhere_once_it_is_marked_down(role):
    """A worker that hangs mid-request, before the first token (its calls never answer; for a prefill worker, the
    decode worker waits for a transfer that never comes): the attempts on it end when the registry marks it down,
    within 2 s, and are retried on the other worker of its role, long before keepalive or the transfer timeout
    would end them."""
    async def scenario():
        async with await RouterHarness.start(prefills=2, decodes=2, poll=True, transfer_timeout_s=30) as h, \
                aiohttp.ClientSession() as s:
            hung, other = h.prefill if role == "prefill" else h.decode
            await until(lambda: h.worker(hung).last_check > 0, 2, "the first health check")
            hung.mode = HANG
            if role == "prefill":
                h.decode[0].hang_with = {h.address[id(hung)]}
            requests = [asyncio.ensure_future(completion(h, session=s)) for _ in range(3)]
            await until(lambda: len(hung.calls) == 3, 5, "every request's first attempt on the hung worker")
            t0 = time.monotonic()
            h.health[id(hung)].mode = HANG  # now it stops answering health checks too
            bodies = await asyncio.gather(*requests)
            took = time.monotonic() - t0
            print(f"\n3 requests on a hung {role} worker completed on another {took:.2f} s after it hung")
            assert all(b["usage"]["completion_tokens"] == 4 for b in bodies)
            assert took < scaled(DETECT_S + 0.5), "the attempts waited on the hung worker past its detection"
            first = sorted(c.request_id for c in hung.calls)
            # The retries' calls on the other worker: a response can end (its decode leg streamed every token)
            # before its prefill leg's call reached a stub.
            await until(lambda: sorted(c.request_id for c in other.calls) == sorted(f"{r}-1" for r in first), 2,
                        "the retries on the other worker")
            await until(lambda: sorted(hung.cancelled) == first, 1, "the hung worker's calls cancelled")
            if role == "prefill":
                assert sorted(h.decode[0].cancelled) == first  # the first attempts' decode legs too
                await until(lambda: sorted(hung.aborted) == first, 1, "Abort sent to the hung worker, not awaited")

    run_within(scenario())
