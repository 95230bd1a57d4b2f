"""Property tests of the page allocators and the KV cache bookkeeping."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdspark.cache.kv_cache import KVCache
from pdspark.cache.page_allocator import PageAllocator, RefCountedPageAllocator
from pdspark.cache.pool_sizes import PoolSizes
from pdspark.config import CacheConfig, SchedulerConfig
from pdspark.model.model_config import ModelConfig

ops = st.lists(st.tuples(st.sampled_from(["alloc", "free", "retain", "release"]), st.integers(0, 5)), max_size=60)


@given(ops)
def test_page_allocator_never_loses_pages(actions):
    alloc = PageAllocator(16)
    held: list[int] = []
    for op, n in actions:
        if op == "alloc" and alloc.can_allocate(n):
            pages = alloc.allocate(n)
            assert not set(pages) & set(held)
            held += pages
        elif op == "free" and held:
            k = min(n, len(held))
            alloc.free(held[:k])
            held = held[k:]
        alloc.check_integrity()
        assert alloc.num_used == len(held)
    alloc.free(held)
    assert alloc.num_free == 16


def test_allocations_take_the_lowest_free_pages_in_order():
    """One request's pages form few contiguous runs (one transfer write per run), also when it reuses pages others
    freed, in whatever order they freed them."""
    alloc = PageAllocator(16)
    assert alloc.allocate(6) == list(range(6))
    held = alloc.allocate(3)
    alloc.free([3, 0, 5, 1, 4, 2])
    assert alloc.allocate(8) == [0, 1, 2, 3, 4, 5, 9, 10]
    alloc.free(held)
    assert alloc.allocate(2) == [6, 7]


@given(ops)
def test_refcounted_pages_free_only_at_zero(actions):
    alloc = RefCountedPageAllocator(8)
    holders: dict[int, int] = {}
    for op, n in actions:
        if op == "alloc" and alloc.can_allocate(n):
            for p in alloc.allocate(n):
                holders[p] = 1
        elif op == "retain" and holders:
            p = sorted(holders)[n % len(holders)]
            alloc.retain([p])
            holders[p] += 1
        elif op in ("release", "free") and holders:
            p = sorted(holders)[n % len(holders)]
            freed = alloc.release([p])
            holders[p] -= 1
            assert freed == ([p] if holders[p] == 0 else [])
            if holders[p] == 0:
                del holders[p]
        alloc.check_integrity()
        assert alloc.refcount == holders


TINY = ModelConfig.from_dict(
    dict(
        vocab_size=32, hidden_size=16, num_hidden_layers=3, num_attention_heads=2, head_dim=8,
        partial_rotary_factor=0.5, q_lora_rank=8, o_groups=1, o_lora_rank=8, sliding_window=8,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        index_n_heads=1, index_head_dim=8, index_topk=4, n_routed_experts=2, num_experts_per_tok=1,
        moe_intermediate_size=8, hc_mult=2,
    )
)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 40)), max_size=40))
def test_kv_cache_grow_release_close(steps):
    """Random growth of up to 4 requests; window release and close keep every pool consistent."""
    sizes = PoolSizes.derive(TINY, CacheConfig(page_size=16), SchedulerConfig(max_num_seqs=4, max_model_len=256))
    kv = KVCache(TINY, sizes, torch.float32, "cpu")
    reqs: dict[int, tuple] = {}
    for who, n in steps:
        if who not in reqs:
            pages = kv.open()
            if pages is None:
                continue
            reqs[who] = (pages, 0)
        pages, length = reqs[who]
        new_len = min(length + n, 256)
        if kv.can_grow(pages, new_len):
            kv.grow(pages, new_len)
            kv.release_window(pages, new_len)
            reqs[who] = (pages, new_len)
            # Positions still in the window keep their SWA slots.
            keep = kv.keep_from(new_len)
            live = torch.arange(keep, new_len)
            assert (kv.full_to_swa(kv.req_to_token[pages.slot, live]) < kv.pools.swa_dummy_slot).all()
        elif n % 3 == 0:
            kv.close(pages)
            del reqs[who]
        kv.check_integrity()
    for pages, _ in reqs.values():
        kv.close(pages)
    kv.check_integrity()
    assert all(u.used == 0 for u in kv.usage().values())
