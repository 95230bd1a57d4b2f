"""Stateful property test of the prefix cache's bookkeeping: random admissions, prefill chunks, speculative decode
steps, preemption, finish/abort, eviction and flushes, driven the way the scheduler drives `KVCache`.

One state machine per cache geometry. `W - 1` (the target's window rows) or `W` (with a drafter, whose block
reads one more context row) falls on a page boundary in some geometries and not in others: that is where the
SWA lock and what a request keeps can disagree by a page.

Examples per geometry: `PDSPARK_HYPOTHESIS_EXAMPLES`. The suite runs 100 (~15 s for the five geometries on a
shared 2-core machine); the acceptance run is 500 (~75 s there):
    PDSPARK_HYPOTHESIS_EXAMPLES=500 pytest -q tests/unit/test_prefix_cache_properties.py
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch
from cache_builders import make_kv
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

MAX_LEN = 256
running = precondition(lambda machine: machine.reqs)
PREFIXES = [[1] * MAX_LEN, [1] * 40 + [2] * (MAX_LEN - 40), [3] * MAX_LEN]  # overlapping families of prompts
EXAMPLES = int(os.environ.get("PDSPARK_HYPOTHESIS_EXAMPLES", "100"))


@dataclass(frozen=True)
class Geometry:
    sliding_window: int
    page_size: int
    group_pages: int  # pages per C128 group
    draft_stages: int

    def __str__(self) -> str:
        draft = "draft" if self.draft_stages else "nodraft"
        return f"W{self.sliding_window}-P{self.page_size}-G{self.group_pages}-{draft}"


GEOMETRIES = [
    Geometry(17, 16, 1, 1),  # drafter: it keeps W = 17 rows, the target W - 1 = 16 (one page)
    Geometry(33, 16, 2, 1),  # drafter: it keeps 33 rows, the target 32 (two pages); C128 groups of two pages
    Geometry(16, 16, 2, 1),  # drafter: it keeps 16 rows (one page), the target 15
    Geometry(8, 16, 1, 0),  # no drafter, the window inside one page
    Geometry(9, 8, 2, 0),  # no drafter: W - 1 = 8 is one page
]


@dataclass
class Req:
    pages: object  # ReqPages
    tokens: list[int]  # prompt + generated tokens so far
    prompt_len: int
    computed: int


class PrefixCacheMachine(RuleBasedStateMachine):
    """Drives `KVCache` as the scheduler does, without running a model. Small pools put allocation under
    pressure, so `reserve` evicts from the tree while requests hold locks."""

    geometry: Geometry = GEOMETRIES[0]

    def __init__(self):
        super().__init__()
        g = self.geometry
        self.kv = make_kv(g.sliding_window, g.page_size, g.group_pages, g.draft_stages, num_full_pages=40,
                          num_swa_pages=24, num_c128_pages=12, max_num_seqs=6, max_model_len=MAX_LEN)
        self.P = g.page_size
        self.reqs: list[Req] = []
        self.next_token = 100  # generated tokens differ from every prompt token

    @initialize()
    def record_initial_free_counts(self):
        self.initial_free = self._free_counts()

    # ---- the scheduler's moves ------------------------------------------------------------------------------------
    @rule(family=st.integers(0, 2), pages=st.integers(0, 24), extra=st.integers(0, 15), chunk=st.integers(1, 96),
          chunk_pages=st.integers(0, 3))
    def admit(self, family, pages, extra, chunk, chunk_pages):
        """Admit a prompt of `pages` pages and `extra` tokens (shrinks towards page boundaries, where the tree's
        nodes end) with its first chunk: `chunk_pages` whole pages (as `_fit` cuts it), or `chunk` tokens."""
        length = min(pages * self.P + extra % self.P, 200)
        tokens = PREFIXES[family][:length] + [7 + len(self.reqs) % 3]
        self._admit(tokens, len(tokens), chunk_pages * self.P or chunk)

    def _admit(self, tokens: list[int], prompt_len: int, chunk: int) -> None:
        pages = self.kv.open()
        if pages is None:
            return
        cached = self.kv.attach_prefix(pages, tokens)
        assert cached % self.P == 0 and cached < len(tokens)
        if self.kv.model.hca_layers:
            assert cached % self.kv.group_tokens == 0
        n = min(len(tokens) - cached, chunk)
        if not self.kv.reserve(pages, cached + n):
            self.kv.close(pages)
            return
        self.kv.grow(pages, cached + n)
        req = Req(pages, list(tokens), prompt_len, cached)
        self.reqs.append(req)
        self._commit(req, n, 0)

    @running
    @rule(i=st.integers(0, 7), chunk=st.integers(1, 64), chunk_pages=st.integers(0, 3), drafts=st.integers(0, 3),
          accepted=st.integers(0, 3))
    def step(self, i, chunk, chunk_pages, drafts, accepted):
        """One step of a running request: a prefill chunk (up to the `chunk_pages`-th page boundary, or `chunk`
        tokens), or a decode step that verifies `drafts` draft tokens (pages grown for all of them) and commits
        the anchor plus `accepted` of them."""
        req = self.reqs[i % len(self.reqs)]
        pending = len(req.tokens) - req.computed
        if pending == 0:  # at max_model_len: the engine would have finished it
            return
        if pending > 1 or not self.geometry.draft_stages:
            if chunk_pages:
                chunk = (req.computed // self.P + chunk_pages) * self.P - req.computed
            n, drafts = min(pending, chunk), 0
        else:
            # As the scheduler's `_drafts_for`: never past max_model_len.
            drafts = max(0, min(drafts, MAX_LEN - len(req.tokens) - 1))
            n = 1
        if not self.kv.reserve(req.pages, req.computed + n + drafts):
            return
        self.kv.grow(req.pages, req.computed + n + drafts)
        self._commit(req, n, min(accepted, drafts))

    def _commit(self, req: Req, n: int, accepted: int) -> None:
        """`n` rows plus `accepted` draft rows are computed. A step reaching the last known token samples: the
        accepted drafts and one more token join the request."""
        samples = req.computed + n == len(req.tokens)
        req.computed += n + accepted
        if samples:
            room = MAX_LEN - len(req.tokens)
            req.tokens += [self._token() for _ in range(min(accepted + 1, room))]
        if req.computed <= req.prompt_len:
            # Prompt pages enter the prefix cache as they are computed, before their SWA pages slide out.
            self.kv.cache_computed(req.pages, req.tokens[: req.computed])
        self.kv.release_window(req.pages, req.computed)

    def _token(self) -> int:
        self.next_token += 1
        return self.next_token

    @running
    @rule(i=st.integers(0, 7))
    def finish(self, i):
        req = self.reqs.pop(i % len(self.reqs))
        self.kv.close(req.pages, req.tokens[: req.computed])

    @running
    @rule(i=st.integers(0, 7))
    def abort(self, i):
        self.kv.close(self.reqs.pop(i % len(self.reqs)).pages)

    @running
    @rule(i=st.integers(0, 7), chunk=st.integers(1, 96))
    def preempt_and_readmit(self, i, chunk):
        """Preemption leaves the computed tokens in the tree; re-admission starts from them."""
        req = self.reqs.pop(i % len(self.reqs))
        self.kv.close(req.pages, req.tokens[: req.computed])
        self._admit(req.tokens, req.prompt_len, chunk)

    @rule(full=st.integers(0, 6), swa=st.integers(0, 6))
    def evict(self, full, swa):
        self.kv.tree.evict(full_pages=full, swa_pages=swa)

    @rule(c128=st.integers(1, 4))
    def evict_c128(self, c128):
        self.kv.tree.evict_c128(c128)

    @rule()
    def flush(self):
        self.kv.flush_prefix_cache()

    @rule()
    def drain(self):
        """Everything closes and the tree is flushed: every pool is back to its initial free count."""
        self._close_all()
        assert self._free_counts() == self.initial_free

    # ---- invariants -----------------------------------------------------------------------------------------------
    @invariant()
    def books_balance(self):
        # Owners == used pages (borrowed SWA entries included), refcounts == holders, maps current, dummy rows
        # untouched.
        self.kv.check_integrity()

    @invariant()
    def running_requests_keep_their_window(self):
        """The window rows the next step (and draft block) reads still map to real SWA slots."""
        for req in self.reqs:
            kept = torch.arange(self.kv.keep_from(req.computed), req.computed)
            swa = self.kv.full_to_swa(self.kv.req_to_token[req.pages.slot, kept])
            assert (swa < self.kv.pools.swa_dummy_slot).all(), "a kept window row lost its SWA page"

    @invariant()
    def borrowed_window_pages_are_swa_locked(self):
        """A kept window page the request borrowed from the tree is SWA-locked there (so the tree cannot evict
        it under the request)."""
        node_of = {page: node for node in self.kv.tree.nodes() for page in node.full_pages}
        for req in self.reqs:
            first_kept = self.kv.keep_from(req.computed) // self.P
            for page in req.pages.full_pages[first_kept : req.pages.num_borrowed]:
                assert node_of[page].swa_lock_ref > 0, "a borrowed window page is not SWA-locked"

    def teardown(self):
        self._close_all()
        assert self._free_counts() == self.initial_free

    def _close_all(self) -> None:
        while self.reqs:
            req = self.reqs.pop()
            self.kv.close(req.pages, req.tokens[: req.computed])
        self.kv.flush_prefix_cache()
        self.kv.check_integrity()

    def _free_counts(self) -> dict[str, int]:
        return {name: u.total - u.used for name, u in self.kv.usage().items()}


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=str)
def test_prefix_cache_books_balance(geometry):
    machine = type(f"PrefixCache_{geometry}", (PrefixCacheMachine,), {"geometry": geometry})
    run_state_machine_as_test(
        machine,
        settings=settings(max_examples=EXAMPLES, stateful_step_count=40, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]),
    )
