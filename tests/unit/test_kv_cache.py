"""`KVCache` with the prefix cache: deterministic scenarios the property test once found, and index invariants."""

from __future__ import annotations

import torch
from cache_builders import make_kv


def _run(kv, pages, tokens: list[int], computed: int) -> None:
    """Grow a request to `computed` tokens and account for them the way the scheduler does."""
    assert kv.reserve(pages, computed)
    kv.grow(pages, computed)
    kv.cache_computed(pages, tokens[:computed])
    kv.release_window(pages, computed)
    kv.check_integrity()


def _keeps_its_window(kv, pages, computed: int) -> bool:
    """Every position from `keep_from(computed)` on still maps to a real SWA slot (the drafter reads them)."""
    kept = torch.arange(kv.keep_from(computed), computed)
    return bool((kv.full_to_swa(kv.req_to_token[pages.slot, kept]) < kv.pools.swa_dummy_slot).all())


def test_draft_window_of_a_borrowed_prefix_stays_locked():
    """Window 17, pages of 16, a drafter: the request keeps position `L - 17` (the draft block's extra context
    row), one more than the target's window. That position sits on a tree page the SWA lock must cover too;
    otherwise the tree evicts its SWA page while the request still lists it, the page is handed to another
    request, and a later insert adopts the stale id (one SWA page owned twice)."""
    kv = make_kv(sliding_window=17, page_size=16, draft_stages=1)
    a = [1] * 32 + [5]
    first = kv.open()
    _run(kv, first, a, len(a))
    kv.close(first, a)  # the tree holds one node for [0, 32)

    b = [1] * 64 + [6]
    second = kv.open()
    assert kv.attach_prefix(second, b) == 32
    _run(kv, second, b, 48)  # a chunk ending mid-prompt: [32, 48) becomes the tree's second node
    assert _keeps_its_window(kv, second, 48)

    kv.tree.evict(swa_pages=2)  # only unlocked SWA pages may go
    kv.check_integrity()
    assert _keeps_its_window(kv, second, 48)

    third = kv.open()  # takes whatever SWA pages were freed
    c = [3] * 32 + [7]
    _run(kv, third, c, len(c))
    _run(kv, second, b, 64)  # inserts [0, 64) over the (possibly evicted) first node
    assert _keeps_its_window(kv, second, 64)
    kv.close(third, c)
    kv.close(second, b)
    kv.flush_prefix_cache()
    kv.check_integrity()
    assert all(u.used == 0 for u in kv.usage().values())


def test_reinsert_over_an_swa_evicted_node_adopts_the_request_pages():
    """A request re-inserting tokens whose tree node lost its SWA pages (a tombstone) gives the node its own SWA
    pages and locks only the window it needs; this once left an SWA-locked tombstone and leaked a page."""
    kv = make_kv(sliding_window=8, page_size=16, group_pages=1)
    a = [1] * 31 + [7]
    first = kv.open()
    _run(kv, first, a, len(a))
    kv.close(first, a)
    kv.tree.evict(full_pages=0, swa_pages=1)
    kv.check_integrity()
    b = [1] * 16 + [7]
    second = kv.open()
    cached = kv.attach_prefix(second, b)
    _run(kv, second, b, len(b))
    assert _keeps_its_window(kv, second, len(b))
    kv.close(second, b)
    kv.check_integrity()
    kv.flush_prefix_cache()
    kv.check_integrity()
    assert cached == 0  # the first 16 tokens' SWA page was evicted: no match can end there
    assert all(u.used == 0 for u in kv.usage().values())


def test_c4_state_rows_of_released_pages_are_the_dummy_row():
    """Positions whose SWA page was released map to the state pool's dummy row (a positive index), never past the
    pool and never to -1; positions still in the window map to their page's ring."""
    kv = make_kv(sliding_window=8, page_size=16, prefix_cache=False)  # released pages are freed, not cached
    pages = kv.open()
    tokens = list(range(2, 102))
    for computed in range(10, 101, 10):
        _run(kv, pages, tokens, computed)
    pos = torch.arange(100)
    full = kv.req_to_token[pages.slot, pos]
    dummy = kv.pools.c4_state_dummy_row
    assert dummy == kv.pools.c4_state.shape[1] - 1 > 0
    released = kv.full_to_swa(full) >= kv.pools.swa_dummy_slot  # [100] True where the SWA page is gone
    assert released[:32].all() and not released[kv.keep_from(100) :].any()  # the window moved past two pages
    for rows in (kv.c4_state_rows(full, pos), torch.from_numpy(kv.c4_state_rows(full.numpy(), pos.numpy(),
                                                                                 kv.host_tables()))):
        assert ((rows >= 0) & (rows <= dummy)).all()
        assert (rows[released] == dummy).all()
        live_page = kv.full_to_swa(full[~released]) // kv.sizes.page_size
        assert (rows[~released] == live_page * kv.sizes.csa_ring + pos[~released] % kv.sizes.csa_ring).all()
    kv.close(pages, tokens)


def test_usage_and_tree_pages_are_named():
    kv = make_kv(sliding_window=8, page_size=16, num_full_pages=40, num_swa_pages=24)
    pages = kv.open()
    tokens = [1] * 40 + [2]
    _run(kv, pages, tokens, len(tokens))  # 3 full pages; the tree holds the first 2 (whole C128 groups)
    usage = kv.usage()
    assert set(usage) == {"full", "swa", "c128", "req_slots"}
    assert (usage["full"].used, usage["full"].total) == (3, 40)
    assert usage["req_slots"].used == 1
    held = kv.tree.held()
    assert held.full_pages == pages.full_pages[:2] and len(held.c128_pages) == 2
    assert kv.cached_pages()["full"] == 2
    kv.close(pages, tokens)
    kv.flush_prefix_cache()
    assert kv.usage()["full"] == (0, 40) and kv.usage()["swa"].used == 0
