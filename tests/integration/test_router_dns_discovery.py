"""DNS discovery (`--prefill-dns`/`--decode-dns`) against stub workers on their own loopback addresses (127.0.0.2,
127.0.0.3, ...), the names resolved through a hosts file (`--hosts-file`) the test rewrites: addresses that appear
are admitted and serve, one that vanishes is retired (a stream on it finishes), a name that stops resolving keeps
its last addresses (logged once), a worker that comes back keeps its name, and the interval is honoured."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

import aiohttp
import grpc

from pdspark.router.router_server import build_discovery
from pdspark.testing.time_scale import scaled
from pdspark.testing.waiting import run_within, until
from pdspark.testing.worker_stubs import HOLD, StubDecode, StubPrefill, serve_stub
from router_harness import RouterHarness, completion

INTERVAL_S = 0.1


async def serve_on_one_port(stubs: list, hosts: list[str]) -> tuple[list[grpc.aio.Server], int]:
    """Serve `stubs[i]` on `hosts[i]`, all on one port (as the pods behind a headless Service)."""
    for _ in range(20):
        servers = []
        server, _, address = await serve_stub(stubs[0], host=hosts[0])
        servers.append(server)
        port = int(address.rsplit(":", 1)[1])
        try:
            for stub, host in zip(stubs[1:], hosts[1:], strict=True):
                servers.append((await serve_stub(stub, port, host))[0])
            return servers, port
        except RuntimeError:  # the port is taken on another address: try another
            for s in servers:
                await s.stop(None)
    raise AssertionError("no port free on every address")


def write_hosts(path: Path, entries: dict[str, list[str]]) -> None:
    lines = ["# rewritten by the test", "127.0.0.1 localhost"]
    lines += [f"{ip} {name}" for name, ips in entries.items() for ip in ips]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(path)  # atomic: discovery never reads half a file


@contextlib.asynccontextmanager
async def cluster(tmp_path: Path):
    """1 prefill stub on 127.0.0.2 (pf.test), 2 decode stubs on 127.0.0.3 and 127.0.0.4 (dc.test, one port); the
    router knows only the names. Yields (harness, discovery, prefill, decodes, hosts file, decode port)."""
    prefill, decodes = StubPrefill(), [StubDecode(), StubDecode()]
    pf_servers, pf_port = await serve_on_one_port([prefill], ["127.0.0.2"])
    dc_servers, dc_port = await serve_on_one_port(decodes, ["127.0.0.3", "127.0.0.4"])
    hosts = tmp_path / "hosts"
    write_hosts(hosts, {})
    h = await RouterHarness.start(prefills=0, decodes=0, poll=True, health_interval_s=0.1, health_timeout_s=0.5,
                                  prefill_dns=(f"pf.test:{pf_port}",), decode_dns=(f"dc.test:{dc_port}",),
                                  dns_interval_s=INTERVAL_S, hosts_file=str(hosts))
    discovery = build_discovery(h.core.options, h.core)
    assert discovery is not None
    discovery.drain_s = 10.0
    task = asyncio.create_task(discovery.run())
    try:
        yield h, discovery, prefill, decodes, hosts, dc_port
    finally:
        task.cancel()
        await h.close()
        for server in pf_servers + dc_servers:
            await server.stop(None)


def test_workers_that_appear_are_admitted_and_serve_and_one_that_vanishes_is_retired(tmp_path):
    async def scenario():
        async with cluster(tmp_path) as (h, discovery, prefill, decodes, hosts, port), \
                aiohttp.ClientSession() as s:
            a, b = f"127.0.0.3:{port}", f"127.0.0.4:{port}"
            write_hosts(hosts, {"pf.test": ["127.0.0.2"], "dc.test": ["127.0.0.3", "127.0.0.4"]})
            await until(lambda: len(h.registry.healthy("prefill")) == 1 and len(h.registry.healthy("decode")) == 2,
                        10, "workers admitted and healthy")
            name_a = h.registry.workers[a].name
            assert (await completion(h, session=s))["usage"]["completion_tokens"] == 4
            assert len(prefill.calls) == 1 and len(decodes[0].calls) == 1  # the policy picks the lowest address

            # A stream on 127.0.0.3 as it vanishes: retired (no new picks), the stream still finishes.
            decodes[0].script = [HOLD]
            held = asyncio.create_task(completion(h, session=s))
            await until(lambda: decodes[0].running == 1, 10, "the stream reached 127.0.0.3")
            write_hosts(hosts, {"pf.test": ["127.0.0.2"], "dc.test": ["127.0.0.4"]})
            await until(lambda: a not in h.registry.workers, 10, "127.0.0.3 retired")
            assert (await completion(h, session=s))["usage"]["completion_tokens"] == 4
            assert len(decodes[1].calls) == 1  # the new request went to the one left
            decodes[0].release.set()
            assert (await held)["usage"]["completion_tokens"] == 4  # the in-flight stream was not cut
            assert decodes[0].cancelled == []

            # It comes back: admitted again, under the same name.
            write_hosts(hosts, {"pf.test": ["127.0.0.2"], "dc.test": ["127.0.0.3", "127.0.0.4"]})
            await until(lambda: a in h.registry.workers and h.registry.workers[a].healthy, 10, "127.0.0.3 back")
            assert h.registry.workers[a].name == name_a
            assert h.registry.workers[b].name != name_a
            assert (await completion(h, session=s))["usage"]["completion_tokens"] == 4
            assert len(decodes[0].calls) == 3

    run_within(scenario())


def test_a_name_that_stops_resolving_keeps_its_workers_and_says_so_once(tmp_path, caplog):
    async def scenario():
        async with cluster(tmp_path) as (h, discovery, prefill, decodes, hosts, port), \
                aiohttp.ClientSession() as s:
            write_hosts(hosts, {"pf.test": ["127.0.0.2"], "dc.test": ["127.0.0.3", "127.0.0.4"]})
            await until(lambda: len(h.registry.healthy("decode")) == 2 and h.registry.healthy("prefill"), 10,
                        "workers admitted")
            before = set(h.registry.workers)
            caplog.set_level(logging.INFO, logger="pdspark.router.workers.dns_discovery")
            hosts.unlink()  # every resolution fails now
            polls = discovery.polls
            await until(lambda: discovery.polls >= polls + 5, 10, "five failed rounds")
            assert set(h.registry.workers) == before
            assert (await completion(h, session=s))["usage"]["completion_tokens"] == 4
            warnings = [r for r in caplog.records if "does not resolve" in r.getMessage()]
            assert len(warnings) == 2, warnings  # pf.test and dc.test, once each
            write_hosts(hosts, {"pf.test": ["127.0.0.2"], "dc.test": ["127.0.0.4"]})
            await until(lambda: f"127.0.0.3:{port}" not in h.registry.workers, 10, "resolving again")
            assert sum("resolves again" in r.getMessage() for r in caplog.records) == 2

    run_within(scenario())


def test_the_interval_is_honoured(tmp_path):
    async def scenario():
        async with cluster(tmp_path) as (h, discovery, prefill, decodes, hosts, port):
            loop = asyncio.get_running_loop()
            await until(lambda: discovery.polls >= 1, 10, "a first round")
            polls, t0 = discovery.polls, loop.time()
            await until(lambda: discovery.polls >= polls + 5, 10, "five rounds")
            elapsed = loop.time() - t0
            assert elapsed >= 4 * INTERVAL_S, f"5 rounds in {elapsed:.3f} s: faster than every {INTERVAL_S} s"
            # A change is seen within about one interval.
            write_hosts(hosts, {"pf.test": ["127.0.0.2"]})
            took = await until(lambda: h.registry.workers, 10, "the prefill worker admitted", interval_s=0.005)
            assert took < INTERVAL_S + scaled(1.0)

    run_within(scenario())
