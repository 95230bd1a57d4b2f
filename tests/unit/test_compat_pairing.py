"""The router pairs only workers whose reported compatibility allows a transfer (`Dispatcher._pick`, `pairs`): during
a rollout that changes the transfer schema, old prefill workers pair with old decode workers and new with new, before
any request is tried on a mismatched pair; a worker that reported nothing yet pairs with any (the plan's own check
decides); no compatible pair at all is INCOMPATIBLE, naming the fields; the load report carries the descriptor."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from pdspark.errors import ErrorCode, RequestFailed
from pdspark.router.dispatcher import Dispatcher, pairs
from pdspark.router.workers.policies import make_policy
from pdspark.router.workers.worker_registry import WorkerInfo, WorkerRegistry
from pdspark.rpc import convert
from pdspark.transfer.compat import CompatDescriptor

OLD = CompatDescriptor(3, "fp", ("sliding",), 4, 128, 64, 32, "bfloat16", "float32", 16, 2, 8, 2, 128, "", False)
NEW = replace(OLD, schema_version=4)


def _dispatcher(compats: dict[str, CompatDescriptor | None]) -> tuple[Dispatcher, WorkerRegistry]:
    registry = WorkerRegistry()
    for address, compat in compats.items():
        role = "prefill" if address.startswith("p") else "decode"
        registry.add(role, address).compat = compat
    return Dispatcher(registry, make_policy("round_robin"), make_policy("round_robin")), registry


def test_a_rollout_pairs_old_with_old_and_new_with_new():
    async def scenario():
        d, _ = _dispatcher({"p-old:1": OLD, "p-new:1": NEW, "d-old:1": OLD, "d-new:1": NEW})
        seen = {(p.address, dec.address) for p, dec in (d._pick([1, 2], set()) for _ in range(12))}
        assert seen == {("p-old:1", "d-old:1"), ("p-new:1", "d-new:1")}
        # A prefill worker with no compatible decode worker left is not picked at all.
        d, _ = _dispatcher({"p-old:1": OLD, "p-new:1": NEW, "d-new:1": NEW})
        assert {d._pick([1], set())[0].address for _ in range(6)} == {"p-new:1"}

    asyncio.run(scenario())


def test_unknown_compatibility_pairs_and_no_compatible_pair_is_incompatible():
    async def scenario():
        d, registry = _dispatcher({"p-old:1": OLD, "d-new:1": None})
        assert d._pick([1], set())[1].address == "d-new:1"  # (nothing reported yet: tried; the plan decides)
        registry.workers["d-new:1"].compat = NEW
        with pytest.raises(RequestFailed) as e:
            d._pick([1], set())
        assert e.value.code is ErrorCode.INCOMPATIBLE and "schema_version" in str(e.value)

    asyncio.run(scenario())


def test_the_prefix_cache_field_matters_one_way_and_the_descriptor_crosses_the_wire():
    cached, plain = replace(OLD, prefix_cache=True), OLD
    assert pairs(WorkerInfo("prefill", "p", compat=cached), WorkerInfo("decode", "d", compat=plain))
    assert not pairs(WorkerInfo("prefill", "p", compat=plain), WorkerInfo("decode", "d", compat=cached))
    assert convert.compat_from_pb(convert.compat_to_pb(NEW)) == NEW
