"""The parts of a router group (`router_group`) that need no process tree: the admission shares, the shared per-key
counts (two handles on one table, and a spawned process beside this one), and the cache-aware policy's choice on a
miss, which must be the same in every process."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdspark.config import AdmissionConfig, RouterConfig
from pdspark.errors import ConfigError, RequestFailed
from pdspark.router.auth import shared_key_quota
from pdspark.router.auth.shared_key_quota import SharedKeyQuota
from pdspark.router.router_group import GroupPorts, member_config, share
from pdspark.router.workers.policies import CacheAware
from pdspark.router.workers.worker_registry import WorkerInfo
from pdspark.testing.time_scale import scaled


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 5000), st.integers(1, 64))
def test_the_shares_sum_to_the_bound_and_differ_by_at_most_one(total, parts):
    shares = [share(total, parts, i) for i in range(parts)]
    assert sum(shares) == total and max(shares) - min(shares) <= 1


def test_a_member_holds_its_share_of_admission_and_the_whole_per_key_limit():
    cfg = RouterConfig(processes=3, admission=AdmissionConfig(max_in_flight=10, max_queued=4))
    members = [member_config(cfg, i, GroupPorts(8000, 9000, None)) for i in range(3)]
    assert [m.admission.max_in_flight for m in members] == [4, 3, 3]
    assert [m.admission.max_queued for m in members] == [2, 1, 1]
    assert {m.admission.key_in_flight_limit for m in members} == {cfg.admission.key_in_flight_limit}
    assert {(m.port, m.grpc_port, m.processes) for m in members} == {(8000, 9000, 1)}
    with pytest.raises(ConfigError, match="processes"):
        RouterConfig(processes=3, admission=AdmissionConfig(max_in_flight=2))


def _quota(tmp_path, limit: int, processes: int = 2) -> SharedKeyQuota:
    return SharedKeyQuota.create(limit, processes, str(tmp_path / "lock"), multiprocessing.get_context("spawn"))


def test_two_processes_handles_count_one_limit(tmp_path):
    a = _quota(tmp_path, 2)
    b = a.for_process(1)  # another process's handle: the same table, its own column
    a.enter("k1")
    b.enter("k1")
    with pytest.raises(RequestFailed, match="max_in_flight_per_key 2"):
        a.enter("k1")
    b.enter("k2")  # another key: its own count
    assert (a.held("k1"), b.held("k2"), a.held("k3")) == (2, 1, 0)
    a.leave("k1")
    b.enter("k1")
    a.enter("")  # no key: not counted
    assert b.held("k1") == 2


def test_a_dead_process_s_requests_stop_counting(tmp_path):
    a = _quota(tmp_path, 3)
    b = a.for_process(1)
    a.enter("k")
    b.enter("k")
    b.enter("k")
    with pytest.raises(RequestFailed):
        a.enter("k")
    a.forget_process(1)  # the supervisor, once process 1 died
    assert a.held("k") == 1
    a.enter("k")
    a.enter("k")
    assert a.held("k") == 3


def test_a_full_table_drops_its_idle_keys_and_keeps_the_counts(tmp_path, monkeypatch):
    monkeypatch.setattr(shared_key_quota, "SLOTS", 8)
    q = _quota(tmp_path, 3, processes=1)
    for i in range(8):
        q.enter(f"idle-{i}")
        if i:
            q.leave(f"idle-{i}")
    q.enter("new")  # no free slot: the rebuild keeps idle-0's count, frees the others
    assert (q.held("idle-0"), q.held("new"), q.held("idle-5")) == (1, 1, 0)
    for i in range(6):
        q.enter(f"more-{i}")
    with pytest.raises(RequestFailed, match="8 API keys"):
        q.enter("one-too-many")


def _enter_twice(quota: SharedKeyQuota, done) -> None:
    quota.enter("key")
    quota.enter("key")
    done.set()


def _die_holding_the_lock(quota: SharedKeyQuota, holding) -> None:
    with quota._locked():
        holding.set()
        signal.pause()  # killed here, the lock held


def test_a_spawned_process_counts_in_the_same_table_and_its_death_frees_the_lock(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    quota = _quota(tmp_path, 3)
    done = ctx.Event()
    child = ctx.Process(target=_enter_twice, args=(quota.for_process(1), done))
    child.start()
    child.join(scaled(60))  # a spawned interpreter's start: seconds
    assert done.is_set() and quota.held("key") == 2
    quota.enter("key")
    with pytest.raises(RequestFailed):
        quota.enter("key")
    holding = ctx.Event()
    holder = ctx.Process(target=_die_holding_the_lock, args=(quota.for_process(1), holding))
    holder.start()
    assert holding.wait(scaled(60))
    os.kill(holder.pid, signal.SIGKILL)
    holder.join(scaled(10))
    quota.leave("key")  # would wait forever on a lock its dead holder kept
    assert quota.held("key") == 2


def _workers(loads: list[int]) -> list[WorkerInfo]:
    out = []
    for i, load in enumerate(loads):
        w = WorkerInfo("prefill", f"10.0.0.{i}:9000", name=f"prefill-{i}")
        w.reported_load = load
        out.append(w)
    return out


def test_processes_with_trees_of_their_own_send_a_new_prefix_to_the_same_worker():
    rng = random.Random(7)
    workers = _workers([0, 0, 0, 0])
    one, other = CacheAware(hash_on_miss=True), CacheAware(hash_on_miss=True)
    picked = []
    for _ in range(64):
        prompt = [rng.randrange(1000) for _ in range(40)]
        a = one.select(workers, prompt)
        # The other process sees the prompt's family later: a longer prompt with the same start.
        assert other.select(workers, prompt + [1, 2, 3]).address == a.address
        picked.append(a.address)
    assert len(set(picked)) == 4  # spread over the workers, not all on the least loaded
    plain = CacheAware()  # a single router: the least loaded on a miss
    assert {plain.select(workers, [rng.randrange(1000) for _ in range(40)]).address for _ in range(8)} == \
        {workers[0].address}


def test_a_miss_never_goes_to_a_worker_busier_than_the_threshold():
    workers = _workers([0, 9, 9, 9])
    policy = CacheAware(hash_on_miss=True, balance_threshold=4)
    rng = random.Random(3)
    assert {policy.select(workers, [rng.randrange(1000) for _ in range(40)]).address for _ in range(32)} == \
        {workers[0].address}
