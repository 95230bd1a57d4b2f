"""A router of several processes (`--processes 2`, `router_group`) as a real process tree over stub workers: both
processes serve the same ports, `/metrics` counts every process's requests, worker changes reach every process
before they are answered, the per-key limit holds across processes, an abort reaches the process serving the
request, a killed process is started again, and SIGTERM stops them all.

Connections are spread by the kernel (SO_REUSEPORT hashes each connection's addresses): each check opens fresh
connections, `CONNECTIONS` of them, so that both processes take some (all on one: probability 2^-(CONNECTIONS-1))."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path

import aiohttp
import grpc
import pytest

from pdspark.client.client import request_id_of
from pdspark.testing.services import start_router
from pdspark.testing.time_scale import scaled
from pdspark.testing.waiting import until
from pdspark.testing.worker_stubs import HOLD, StubDecode, StubPrefill, serve_stub
from pdspark.v1 import common_pb2, router_pb2, router_pb2_grpc

CONNECTIONS = 24
ADMIN = "admin-key-of-the-group-test"
CLIENT = "client-key-of-the-group-test-0123"
BODY = {"model": "dsv4-tiny", "prompt": [5, 6, 7], "max_tokens": 2}


class _Address:
    def __init__(self, address: str):
        self.address = address


def _children(pid: int) -> set[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return {int(p) for p in f.read().split()}


@contextlib.asynccontextmanager
async def group(tmp_path: Path, *args: str, env: dict | None = None):
    """Stub workers on this loop, and a 2-process router over them: (router process, prefill stub, decode stub)."""
    prefill, decode = StubPrefill(), StubDecode(tokens=2)
    servers = []
    addresses = []
    for stub in (prefill, decode):
        server, _, address = await serve_stub(stub)
        servers.append(server)
        addresses.append(address)
    router = await asyncio.to_thread(start_router, "dsv4-tiny", [_Address(addresses[0])], [_Address(addresses[1])],
                                     "--processes", "2", *args, env={"PDSPARK_ADMIN_API_KEY": ADMIN, **(env or {})})
    try:
        yield router, prefill, decode
    finally:
        await asyncio.to_thread(router.stop)
        for server in servers:
            await server.stop(None)


@contextlib.asynccontextmanager
async def keyed_group(tmp_path: Path, per_key: int):
    """`group` with the client key and `--max-in-flight-per-key per_key`, its decode stub holding every request:
    (router, decode stub, a coroutine function posting one keyed completion on a connection of its own)."""
    keys = tmp_path / "keys"
    keys.write_text(CLIENT + "\n")
    async with group(tmp_path, "--api-key-file", str(keys), "--max-in-flight-per-key", str(per_key)) as (router, _, d):
        d.mode = HOLD
        url = router.info["http"] + "/v1/completions"

        async def post() -> tuple[int, object]:
            return await fresh("POST", url, json=BODY, headers={"Authorization": f"Bearer {CLIENT}"})
        yield router, d, post


async def fresh(method: str, url: str, **kw) -> tuple[int, object]:
    """One request on a connection of its own: (status, JSON body or text)."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s, \
            s.request(method, url, **kw) as r:
        body = await r.json() if r.content_type == "application/json" else await r.text()
        return r.status, body


def _sample(metrics: str, name: str) -> float:
    for line in metrics.splitlines():
        if line.startswith(name + " "):  # `name`: a series' full name, its labels included
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_both_processes_serve_the_port_and_metrics_count_every_request(tmp_path):
    async def scenario():
        async with group(tmp_path) as (router, _, _):
            info = router.info
            assert info["processes"] == 2 and len(info["pids"]) == 2
            assert set(info["pids"]) <= _children(router.pid)  # (and multiprocessing's resource tracker)
            lives = await asyncio.gather(*(fresh("GET", info["http"] + "/live") for _ in range(CONNECTIONS)))
            assert {body["process"] for _, body in lives} == {0, 1}
            answers = await asyncio.gather(*(fresh("POST", info["http"] + "/v1/completions", json=BODY)
                                             for _ in range(CONNECTIONS)))
            assert [status for status, _ in answers] == [200] * CONNECTIONS
            _, metrics = await fresh("GET", info["http"] + "/metrics")
            assert _sample(metrics, 'pdspark_router_requests_total{api="completions",outcome="ok"}') == CONNECTIONS
            assert _sample(metrics, "pdspark_router_max_in_flight_requests") == 128  # the shares, summed
            assert _sample(metrics, 'pdspark_router_workers{healthy="true",worker_role="decode"}') == 1
    asyncio.run(scenario())


def test_a_worker_change_reaches_every_process_before_it_is_answered(tmp_path):
    async def scenario():
        async with group(tmp_path) as (router, _, _):
            url = router.info["http"] + "/workers"
            admin = {"Authorization": f"Bearer {ADMIN}"}
            extra, _, address = await serve_stub(StubDecode())
            try:
                status, added = await fresh("POST", url, json={"role": "decode", "address": address}, headers=admin)
                assert status == 201, added
                lists = await asyncio.gather(*(fresh("GET", url, headers=admin) for _ in range(CONNECTIONS)))
                for _, workers in lists:  # every process lists it, by the same name
                    assert {w["address"]: w["name"] for w in workers}[address] == added["name"]
                status, _ = await fresh("POST", url, json={"role": "decode", "address": address}, headers=admin)
                assert status == 409
                status, _ = await fresh("DELETE", url, params={"address": address}, headers=admin)
                assert status == 200
                lists = await asyncio.gather(*(fresh("GET", url, headers=admin) for _ in range(CONNECTIONS)))
                assert all(address not in {w["address"] for w in workers} for _, workers in lists)
            finally:
                await extra.stop(None)
    asyncio.run(scenario())


def test_the_per_key_limit_holds_across_processes(tmp_path):
    async def scenario():
        async with keyed_group(tmp_path, 2) as (_, d, post):
            calls = [asyncio.create_task(post()) for _ in range(CONNECTIONS)]
            await until(lambda: sum(c.done() for c in calls) == CONNECTIONS - 2 and d.running == 2, 10,
                        "all but the key's 2 requests refused, those 2 at the decode stub")
            for status, body in (c.result() for c in calls if c.done()):
                assert status == 429 and "max_in_flight_per_key 2" in body["error"]["message"], body
            d.release.set()
            assert [status for status, _ in await asyncio.gather(*(c for c in calls if not c.done()))] == [200, 200]
    asyncio.run(scenario())


def test_an_abort_from_another_connection_reaches_the_process_serving_the_request(tmp_path):
    """Each request is aborted from a connection of its own: about half of them land on the other process (all
    on the serving one, 6 times in a row: probability 1/64)."""
    async def scenario():
        async with group(tmp_path) as (router, _, d):
            d.mode = HOLD
            target = router.info["grpc"]
            request = router_pb2.RouterGenerateRequest(token_ids=router_pb2.TokenIds(ids=[5, 6, 7]),
                                                       sampling=common_pb2.SamplingParams(max_tokens=2))
            async with grpc.aio.insecure_channel(target) as channel:
                for _ in range(6):
                    call = router_pb2_grpc.RouterStub(channel).Generate(request)
                    request_id = request_id_of(await call.initial_metadata())
                    await until(lambda: d.running == 1, 10, "the request at the decode stub")
                    # A channel of its own: a connection of its own (not the process-wide subchannel pool's).
                    async with grpc.aio.insecure_channel(target, options=(("grpc.use_local_subchannel_pool", 1),)) \
                            as other:
                        reply = await router_pb2_grpc.RouterStub(other).Abort(
                            router_pb2.RouterAbortRequest(request_id=request_id))
                    assert reply.found
                    with pytest.raises(grpc.aio.AioRpcError) as failed:
                        async for _ in call:
                            pass
                    assert failed.value.code() == grpc.StatusCode.CANCELLED
                    await until(lambda: d.running == 0, 10, "the aborted request's decode call ended")
    asyncio.run(scenario())


def test_a_killed_process_is_started_again_and_sigterm_stops_them_all(tmp_path):
    async def scenario():
        async with group(tmp_path) as (router, _, _):
            info = router.info
            first, second = info["pids"]
            before = _children(router.pid)
            os.kill(second, signal.SIGKILL)
            await until(lambda: second not in _children(router.pid) and len(_children(router.pid) - before) == 1,
                        20, "a new process in place of the killed one")
            url = info["http"] + "/live"

            async def both() -> bool:
                lives = await asyncio.gather(*(fresh("GET", url) for _ in range(CONNECTIONS)),
                                             return_exceptions=True)
                return {body["process"] for body in (r[1] for r in lives if isinstance(r, tuple))} == {0, 1}
            deadline = asyncio.get_running_loop().time() + scaled(60)
            while not await both():  # the new process's start: its tokenizer and worker channels
                assert asyncio.get_running_loop().time() < deadline, "the started process never served"
            # (multiprocessing's resource tracker, a child too, ends on its own once the supervisor is gone)
            routers = _children(router.pid) - (before - set(info["pids"]))
        for pid in routers:  # the group stopped (router.stop waited for the supervisor): no router process left
            assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    asyncio.run(scenario())


def test_a_killed_process_s_requests_stop_counting_against_their_key(tmp_path):
    """The key's one request dies with its process (both are killed: which one serves it is the kernel's choice):
    once the processes are back, the key may send again (its count went with the dead process's column)."""
    async def scenario():
        async with keyed_group(tmp_path, 1) as (router, d, post):
            held = asyncio.create_task(post())
            await until(lambda: d.running == 1, 10, "the key's request at the decode stub")
            before = _children(router.pid)
            for pid in router.info["pids"]:
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(aiohttp.ClientError):
                await held
            await until(lambda: len(_children(router.pid) - before) == 2, 20, "both processes started again")
            await until(lambda: d.running == 0, 10, "the dead request's decode call ended")
            again = asyncio.create_task(post())
            # Polled: the new processes answer once their start is done (a refused connection is retried).
            deadline = asyncio.get_running_loop().time() + scaled(60)
            while d.running == 0:
                if again.done():
                    status, body = again.result() if again.exception() is None else (None, again.exception())
                    assert status != 429, body  # refused for its key: the dead request still counted
                    again = asyncio.create_task(post())
                assert asyncio.get_running_loop().time() < deadline, "the key's new request never reached a worker"
                await asyncio.sleep(0.01)
            d.release.set()
            status, _ = await again
            assert status == 200
    asyncio.run(scenario())
