"""A worker's connected handle (channel, stubs, `Calls` client) is built as the router admits it, never on a
request's path: the first request to a new worker makes nothing."""

from __future__ import annotations

import asyncio

import pytest

from pdspark.router.workers.worker_registry import WorkerRegistry


@pytest.mark.parametrize("multiplexed", [False, True])
def test_adding_a_worker_builds_its_handle(multiplexed):
    async def scenario():
        registry = WorkerRegistry(multiplexed=multiplexed)
        for role, address in (("prefill", "127.0.0.1:1"), ("decode", "127.0.0.1:2")):
            w = registry.add(role, address)
            assert w.channel is not None and len(w.stubs) == 2  # health + the role's service
            assert (w.calls is not None) == multiplexed
            channel, stubs, calls = w.channel, dict(w.stubs), w.calls
            # What a request uses is what admission built.
            stub = registry.prefill_stub(w) if role == "prefill" else registry.decode_stub(w)
            assert registry.channel(w) is channel and stub in stubs.values() and len(w.stubs) == 2
            assert not multiplexed or registry._calls(w) is calls
            await channel.close()

    asyncio.run(scenario())


def test_a_registry_used_before_an_event_loop_runs_builds_handles_on_first_use():
    registry = WorkerRegistry()
    w = registry.add("decode", "127.0.0.1:2")
    assert w.channel is None  # a grpc.aio channel belongs to the loop it is made on
