"""Busy is not unhealthy: the registry's liveness (gRPC health checks) and load (GetLoad) are watched apart, on
stub workers with the router's default intervals. A worker whose load report hangs stays healthy and keeps
serving; one whose health check hangs, answers NOT_SERVING or dies is skipped within 2 s, and comes back."""

from __future__ import annotations

import asyncio
import time

import aiohttp

from pdspark.config import RouterConfig
from router_harness import RouterHarness, until
from worker_stubs import HANG, OK

DETECT_S = 2.0  # the bound the design promises for a dead or hung worker
BODY = {"prompt": [5, 6, 7], "max_tokens": 4}


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


async def completion(s: aiohttp.ClientSession, h: RouterHarness) -> dict:
    async with s.post(h.http_url + "/v1/completions", json=BODY) as r:
        assert r.status == 200
        return await r.json()


def test_the_defaults_promise_detection_within_2_s():
    cfg = RouterConfig()
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
            body = await completion(s, h)
            assert body["usage"]["completion_tokens"] == 4

    run(scenario())


def test_a_hung_worker_is_skipped_within_2_s_and_back_when_it_answers():
    async def scenario():
        async with await RouterHarness.start(decodes=2, poll=True) as h, aiohttp.ClientSession() as s:
            hung = h.worker(h.decode[0])
            await until(lambda: hung.last_check > 0, 2, "the first health check")
            h.health[id(h.decode[0])].mode = HANG
            took = await until(lambda: not hung.healthy, DETECT_S, "the hung worker marked unhealthy")
            print(f"\nhung worker marked unhealthy after {took * 1e3:.0f} ms")
            await completion(s, h)
            assert h.decode[0].calls == [] and len(h.decode[1].calls) == 1  # the policy would pick decode[0]
            h.health[id(h.decode[0])].mode = OK
            await until(lambda: hung.healthy, DETECT_S, "the worker healthy again")
            await completion(s, h)
            assert len(h.decode[0].calls) == 1

    run(scenario())


def test_a_not_serving_worker_is_skipped_within_2_s():
    async def scenario():
        async with await RouterHarness.start(poll=True) as h:
            w = h.worker(h.prefill[0])
            await until(lambda: w.last_check > 0, 2, "the first health check")
            h.health[id(h.prefill[0])].mode = "not_serving"
            took = await until(lambda: not w.healthy, DETECT_S, "the NOT_SERVING worker marked unhealthy")
            print(f"\nNOT_SERVING worker marked unhealthy after {took * 1e3:.0f} ms")

    run(scenario())


def test_a_dead_worker_is_skipped_within_2_s():
    async def scenario():
        async with await RouterHarness.start(poll=True) as h:
            w = h.worker(h.decode[0])
            await until(lambda: w.last_check > 0, 2, "the first health check")
            await h.stop_worker(h.decode[0])
            took = await until(lambda: not w.healthy, DETECT_S, "the dead worker marked unhealthy")
            print(f"\ndead worker marked unhealthy after {took * 1e3:.0f} ms")

    run(scenario())


def test_a_worker_added_at_run_time_is_watched():
    async def scenario():
        async with await RouterHarness.start(poll=True) as h:
            w = h.worker(h.decode[0])
            h.registry.remove(w.address)
            again = h.registry.add("decode", w.address)
            await until(lambda: again.last_check > 0 and again.last_load > 0, DETECT_S, "checks of the new entry")

    run(scenario())
