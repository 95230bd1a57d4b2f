"""DNS discovery's pieces: the flags, the hosts-file override, resolution through the system resolver, and the
registry's stable names (kept for an address gone for a while, within a bound)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from pdspark.config import DiscoveryConfig, DnsTarget, RouterConfig
from pdspark.errors import ConfigError
from pdspark.options import parse_args
from pdspark.router.workers.dns_discovery import (
    DnsDiscovery,
    EmptyAnswer,
    ResolveError,
    read_hosts_file,
    worker_address,
)
from pdspark.router.workers.worker_registry import WorkerRegistry


def test_dns_flags_repeat_or_take_commas_and_come_from_the_environment():
    cfg = parse_args(RouterConfig, ["--prefill-dns", "pf.a:1,pf.b:2", "--prefill-dns", "pf.c:3",
                                    "--dns-interval-s", "2.5"], {"PDSPARK_DECODE_DNS": "dc:4",
                                                                  "PDSPARK_HOSTS_FILE": "/h"}).discovery
    assert cfg.prefill_dns == ("pf.a:1", "pf.b:2", "pf.c:3")
    assert cfg.dns_targets == (DnsTarget("prefill", "pf.a", 1), DnsTarget("prefill", "pf.b", 2),
                               DnsTarget("prefill", "pf.c", 3), DnsTarget("decode", "dc", 4))
    assert cfg.dns_interval_s == 2.5 and cfg.hosts_file == "/h"
    assert parse_args(RouterConfig, ["--prefill", "a:1", "--prefill", "b:2"]).prefill == ("a:1", "b:2")
    assert DiscoveryConfig().dns_interval_s == 5.0 and RouterConfig().discovery.dns_targets == ()


@pytest.mark.parametrize("bad", ["pf", "pf:", ":80", "pf:0", "pf:65536", "pf:http", "a:b:80"])
def test_a_dns_target_without_name_and_port_is_refused(bad):
    with pytest.raises(ConfigError, match="name:port"):
        DiscoveryConfig(decode_dns=(bad,))


def test_the_dns_interval_must_be_positive():
    with pytest.raises(ConfigError, match="dns_interval_s"):
        DiscoveryConfig(dns_interval_s=0)


def test_the_hosts_file_gives_every_address_of_a_name(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("# comment\n127.0.0.2 pf.test other  # trailing\n127.0.0.3 PF.test\nnot-an-ip pf.test\n"
                    "::1 v6.test\n127.0.0.2 pf.test\n\n")
    assert read_hosts_file(str(path)) == {"pf.test": ["127.0.0.2", "127.0.0.3"], "other": ["127.0.0.2"],
                                          "v6.test": ["::1"]}
    assert worker_address("::1", 9) == "[::1]:9" and worker_address("127.0.0.2", 9) == "127.0.0.2:9"


def test_names_resolve_through_the_hosts_file_first_then_the_system_resolver(tmp_path):
    async def scenario():
        path = tmp_path / "hosts"
        path.write_text("127.0.0.9 localhost\n127.0.0.2 pf.test\n")
        d = DnsDiscovery(WorkerRegistry(), (), interval_s=2.0, hosts_file=str(path))
        assert await d.resolve("localhost", 9) == {"127.0.0.9:9"}  # the override wins
        assert await d.resolve("PF.TEST", 7) == {"127.0.0.2:7"}
        plain = DnsDiscovery(WorkerRegistry(), (), interval_s=2.0)
        assert "127.0.0.1:9" in await plain.resolve("localhost", 9)  # getaddrinfo
        with pytest.raises(ResolveError):
            await plain.resolve("no-such-name.invalid", 9)
        path.unlink()
        with pytest.raises(ResolveError, match="hosts file"):
            await d.resolve("pf.test", 7)

    asyncio.run(scenario())


def test_a_worker_added_again_keeps_its_name_and_new_ones_get_new_names():
    async def scenario():
        r = WorkerRegistry()
        a = r.add("decode", "127.0.0.3:1").name
        b = r.add("decode", "127.0.0.4:1").name
        r.retire("127.0.0.3:1", drain_s=1.0)
        assert "127.0.0.3:1" not in r.workers
        assert r.add("decode", "127.0.0.3:1").name == a
        assert r.add("prefill", "127.0.0.5:1").name not in (a, b)
        assert len({a, b}) == 2

    asyncio.run(scenario())


def test_the_names_of_addresses_gone_are_kept_for_a_while_then_forgotten():
    """DNS churn (every pod restart a new address) must not grow the registry's name map for ever: the names of at
    most `max_gone_names` addresses gone are kept, the most recently gone, and none gone for `name_retention_s`."""
    async def scenario():
        r = WorkerRegistry(max_gone_names=3)
        kept = r.add("prefill", "127.0.0.2:1").name  # registered the whole time: never forgotten
        names = {}
        for i in range(100):
            address = f"10.0.{i // 250}.{i % 250}:1"
            names[address] = r.add("decode", address).name
            if i % 2:
                r.remove(address)
            else:
                r.retire(address, drain_s=1.0)
        assert len(r._names) == 1 + 3  # the registered worker's and the 3 most recently gone
        last, fourth_last = "10.0.0.99:1", "10.0.0.96:1"
        assert r.add("decode", last).name == names[last]  # back within the retention: the same name
        assert r.add("decode", fourth_last).name not in names.values()  # forgotten: a new one
        assert r.workers["127.0.0.2:1"].name == kept

        r = WorkerRegistry(name_retention_s=0.0)  # every name of an address gone is forgotten at once
        a = r.add("decode", "127.0.0.3:1").name
        r.remove("127.0.0.3:1")
        r.add("decode", "127.0.0.4:1")
        assert len(r._names) == 1
        assert r.add("decode", "127.0.0.3:1").name != a

    asyncio.run(scenario())


def test_no_address_is_an_answer_and_a_timeout_is_not(monkeypatch):
    """NXDOMAIN / no data / an empty list: `EmptyAnswer` (the name has no ready pod); a temporary failure: nothing
    known (`ResolveError`, not `EmptyAnswer`)."""
    async def scenario():
        d = DnsDiscovery(WorkerRegistry(), (), interval_s=1.0)
        loop = asyncio.get_running_loop()
        for errno, empty in ((socket.EAI_NONAME, True), (socket.EAI_AGAIN, False)):
            async def fail(*args, errno=errno, **kwargs):
                raise socket.gaierror(errno, "scripted")

            monkeypatch.setattr(loop, "getaddrinfo", fail)
            with pytest.raises(ResolveError) as e:
                await d.resolve("pf.test", 7)
            assert isinstance(e.value, EmptyAnswer) == empty

        async def nothing(*args, **kwargs):
            return []

        monkeypatch.setattr(loop, "getaddrinfo", nothing)
        with pytest.raises(EmptyAnswer):
            await d.resolve("pf.test", 7)

    asyncio.run(scenario())


def test_an_empty_answer_retires_the_workers_once_confirmed_and_an_outage_never_does():
    """A headless Service whose pods all went away answers no address: after `empty_confirm_s` of such answers the
    name has zero workers. A single empty answer in between two good ones, and any outage, keep them."""
    async def scenario():
        r = WorkerRegistry()
        target = DnsTarget("prefill", "pf.test", 7)
        answers: list = []

        class Scripted(DnsDiscovery):
            async def resolve(self, name, port):
                answer = answers.pop(0)
                if isinstance(answer, Exception):
                    raise answer
                return frozenset(answer)

        d = Scripted(r, (target,), interval_s=0.01, empty_confirm_s=0.05)
        answers += [{"127.0.0.2:7"}, EmptyAnswer("nxdomain"), {"127.0.0.2:7"}]
        for _ in range(3):
            await d.poll()
        assert "127.0.0.2:7" in r.workers  # (one empty answer between good ones: nothing changes)
        answers += [ResolveError("timeout")] * 3
        for _ in range(3):
            await d.poll()
            await asyncio.sleep(0.03)
        assert "127.0.0.2:7" in r.workers  # (an outage: kept however long)
        answers += [EmptyAnswer("nxdomain")] * 2
        await d.poll()
        assert "127.0.0.2:7" in r.workers  # (empty, not yet confirmed)
        await asyncio.sleep(0.06)
        await d.poll()
        assert "127.0.0.2:7" not in r.workers  # (confirmed: zero workers)

    asyncio.run(scenario())
