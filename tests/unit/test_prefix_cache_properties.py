"""Property test of the prefix cache's bookkeeping under random submit/step/finish/abort/evict/flush sequences."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_page_allocator import TINY  # SWA + CSA (4) + HCA (16) layers

from pdspark.cache.kv_cache import KVCache
from pdspark.cache.pool_sizes import PoolSizes
from pdspark.config import CacheConfig, SchedulerConfig

P = 16
PREFIXES = [[1] * 200, [1] * 40 + [2] * 160, [3] * 200]  # overlapping families of prompts

actions = st.lists(
    st.one_of(
        st.tuples(st.just("submit"), st.integers(0, 2), st.integers(1, 120)),
        st.tuples(st.just("step"), st.integers(0, 7), st.integers(1, 40)),
        st.tuples(st.just("finish"), st.integers(0, 7), st.just(0)),
        st.tuples(st.just("abort"), st.integers(0, 7), st.just(0)),
        st.tuples(st.just("evict"), st.integers(0, 6), st.integers(0, 6)),
        st.tuples(st.just("flush"), st.just(0), st.just(0)),
    ),
    max_size=45,
)


class Sim:
    """Drives `KVCache` the way the scheduler does, without running a model."""

    def __init__(self, group_pages: int):
        cache = CacheConfig(page_size=P, c128_page_size=group_pages, num_full_pages=40, num_swa_pages=24,
                            num_c128_pages=12)
        sizes = PoolSizes.derive(TINY, cache, SchedulerConfig(max_num_seqs=6, max_model_len=256))
        self.kv = KVCache(TINY, sizes, torch.float32, "cpu", enable_prefix_cache=True)
        self.reqs: list[dict] = []
        self.initial = {k: total for k, (_, total) in self.kv.usage().items()}

    def submit(self, family: int, length: int) -> None:
        pages = self.kv.open()
        if pages is None:
            return
        tokens = PREFIXES[family][:length] + [7 + len(self.reqs) % 3]
        cached = self.kv.attach_prefix(pages, tokens)
        assert cached % P == 0 and cached % self.kv.group_tokens == 0 and cached < len(tokens)
        if not self.kv.reserve(pages, len(tokens)):
            self.kv.close(pages)
            return
        self.kv.grow(pages, len(tokens))
        self.reqs.append(dict(pages=pages, tokens=tokens, computed=len(tokens), prompt=len(tokens)))
        self._update(self.reqs[-1])

    def step(self, i: int, n: int) -> None:
        if not self.reqs:
            return
        r = self.reqs[i % len(self.reqs)]
        new_len = min(r["computed"] + n, 256)
        if not self.kv.reserve(r["pages"], new_len):
            return
        self.kv.grow(r["pages"], new_len)
        r["tokens"] += [9] * (new_len - len(r["tokens"]))
        r["computed"] = new_len
        self._update(r)

    def _update(self, r: dict) -> None:
        if r["computed"] <= r["prompt"]:
            self.kv.cache_computed(r["pages"], r["tokens"][: r["computed"]])
        self.kv.release_window(r["pages"], r["computed"])

    def end(self, i: int, cache: bool) -> None:
        if self.reqs:
            r = self.reqs.pop(i % len(self.reqs))
            self.kv.close(r["pages"], r["tokens"][: r["computed"]] if cache else None)

    def check(self) -> None:
        kv = self.kv
        kv.check_integrity()  # owners == used pages, refcounts == holders, maps current, dummy rows untouched
        tree_full, tree_swa, tree_c128 = kv.tree.held()
        for name, alloc in (("full", kv.full), ("swa", kv.swa), ("c128", kv.c128)):
            assert alloc.num_free + alloc.num_used == alloc.num_pages, name
        for p in tree_c128 + [p for r in self.reqs for p in r["pages"].c128_pages]:
            assert kv.c128.refcount.get(p, 0) > 0, "a referenced C128 page is free"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(actions, st.sampled_from([1, 2]))
# Regression: a request re-inserting over an SWA-evicted tombstone must adopt its SWA pages and lock only the
# window it needs; this once left an SWA-locked tombstone and leaked a page.
@example([("submit", 0, 31), ("finish", 0, 0), ("evict", 0, 1), ("submit", 0, 16), ("finish", 0, 0)], 1)
def test_random_interleavings_keep_the_books(ops, group_pages):
    sim = Sim(group_pages)
    for op, a, b in ops:
        if op == "submit":
            sim.submit(a, b)
        elif op == "step":
            sim.step(a, b)
        elif op == "finish":
            sim.end(a, cache=True)
        elif op == "abort":
            sim.end(a, cache=False)
        elif op == "evict":
            sim.kv.tree.evict(full_pages=a, swa_pages=b)
        else:
            sim.kv.flush_prefix_cache()
        sim.check()
    while sim.reqs:
        sim.end(0, cache=True)
    sim.kv.flush_prefix_cache()
    sim.check()
    assert {k: total - used for k, (used, total) in sim.kv.usage().items()} == sim.initial
