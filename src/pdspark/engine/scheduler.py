"""`Scheduler`: continuous batching with chunked prefill under a per-step token budget.

NOTE: token accounting, not phases. A request computes positions `[num_computed_tokens, num_tokens)`; prefill,
a prefill chunk, a decode token and the recompute after preemption differ only in how many of those positions fit
this step. Running requests go first (oldest first), then waiting requests are admitted FIFO while the budget,
`max_num_seqs`, request slots and pages allow. Pages are grown lazily, step by step. When a running request cannot
grow, the most recently admitted request is preempted (its pages freed, recomputed later from its tokens so far);
a waiting request that does not fit simply waits. With the prefix cache, admission starts a request from its
longest cached prefix (`num_computed_tokens = num_cached_tokens`), growth evicts unlocked cache pages before it
preempts anyone, and a request that ends or is preempted leaves its computed pages in the cache.

A request that asks for its prompt's logprobs (a scoring request: lm-eval's loglikelihoods) computes its prompt
alone, one step per chunk with nothing else in it, the others pausing meanwhile: a float's bits may depend on the
rows it is computed with (BLAS blocking), and a score must be the same number whatever traffic the worker shares,
the offline engine's bit for bit.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from pdspark.cache.kv_cache import KVCache, ReqPages
from pdspark.config import SchedulerConfig
from pdspark.engine.request import Request, RequestStatus
from pdspark.types import FinishReason


@dataclass(frozen=True)
class ScheduledChunk:
    request: Request
    start: int
    num_tokens: int  # window rows, draft slots included
    num_drafts: int = 0  # speculative verify: the window is [last token, d_1 .. d_num_drafts]

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the request's last known token (so its last row picks the next one)."""
        return self.start + self.num_tokens - self.num_drafts == self.request.num_tokens


@dataclass(frozen=True)
class ScheduleOutput:
    chunks: list[ScheduledChunk]

    @property
    def empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, kv: KVCache, num_drafts: int = 0):
        assert cfg.max_model_len is not None, "resolve it first (EngineConfig.for_model)"
        self.cfg = cfg
        self.max_model_len: int = cfg.max_model_len
        self.kv = kv
        self.num_drafts = num_drafts  # draft tokens per verify step (0: no speculation)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def schedule(self) -> ScheduleOutput:
        alone = self._scoring_alone()
        if alone is not None:
            return ScheduleOutput([alone])
        budget = self.cfg.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[Request] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            chunk = self._grow_running(req, budget, preempted)
            if chunk is None:  # req itself was preempted; everything after it already was
                break
            chunks.append(chunk)
            budget -= chunk.num_tokens
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs and not preempted:
            if _scoring(self.waiting[0]):
                break  # (it starts next step, alone)
            chunk = self._admit(self.waiting[0], budget)
            if chunk is None:
                break
            self.waiting.popleft()
            chunks.append(chunk)
            budget -= chunk.num_tokens
        return ScheduleOutput(chunks)

    def _scoring_alone(self) -> ScheduledChunk | None:
        """This step's chunk when a scoring request computes its prompt: one already running first, else one at
        the head of the queue (admitted if it fits: otherwise the step goes on without it)."""
        for req in self.running:
            if _scoring(req):
                assert req.pages is not None
                start = req.num_computed_tokens
                n = self._fit(req.pages, start, min(req.num_pending_tokens, self.cfg.max_num_batched_tokens))
                if n > 0:
                    self.kv.grow(req.pages, start + n)
                    return ScheduledChunk(req, start, n)
                return None  # (no room to grow: the normal schedule preempts for it)
        if self.waiting and _scoring(self.waiting[0]) and len(self.running) < self.cfg.max_num_seqs:
            chunk = self._admit(self.waiting[0], self.cfg.max_num_batched_tokens)
            if chunk is not None:
                self.waiting.popleft()
                return chunk
        return None

    def _grow_running(self, req: Request, budget: int, preempted: list[Request]) -> ScheduledChunk | None:
        assert req.pages is not None
        start = req.num_computed_tokens
        drafts = self._drafts_for(req, budget)
        while True:
            n = self._fit(req.pages, start, min(req.num_pending_tokens + drafts, budget))
            if n > 0:
                break
            victim = self.running[-1]
            self.preempt(victim)
            preempted.append(victim)
            if victim is req:
                return None
        self.kv.grow(req.pages, start + n)
        return ScheduledChunk(req, start, n, num_drafts=max(0, n - req.num_pending_tokens))

    def _drafts_for(self, req: Request, budget: int) -> int:
        """Draft slots for a decoding request: never past max_tokens, max_model_len or the step budget."""
        if not self.num_drafts or req.num_pending_tokens != 1:
            return 0
        left = min(req.params.max_tokens - len(req.output_token_ids), self.max_model_len - req.num_tokens)
        return max(0, min(self.num_drafts, left - 1, budget - 1))

    def _admit(self, req: Request, budget: int) -> ScheduledChunk | None:
        pages = self.kv.open()
        if pages is None:
            return None
        # A request that wants its prompt's logprobs computes the whole prompt (the cache would skip positions).
        cached = self.kv.attach_prefix(pages, req.all_token_ids) if req.params.prompt_logprobs is None else 0
        n = self._fit(pages, cached, min(req.num_tokens - cached, budget))
        if n <= 0:
            self.kv.close(pages)
            return None
        self.kv.grow(pages, cached + n)
        req.pages = pages
        req.num_cached_tokens = req.num_computed_tokens = cached
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        return ScheduledChunk(req, cached, n)

    def _fit(self, pages: ReqPages, start: int, want: int) -> int:
        """The most tokens (up to `want`) the request can grow by now: all of them when the pools (after evicting
        unlocked prefix-cache pages) have room, else the longest run of them whose pages are free."""
        if self.kv.reserve(pages, start + want):
            return want
        # A pool's page boundary can fall on any token of the step (full/SWA pages every `page_size` tokens, C128
        # pages where a group closes), so search token by token; `can_grow` is monotone in the length.
        lo, hi = 0, want - 1  # `start + lo` fits (nothing to add), `start + want` does not
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.kv.can_grow(pages, start + mid):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def update(self, chunks: list[ScheduledChunk], committed: list[int]) -> None:
        """Account for a finished forward pass: `committed[i]` rows of chunk i are now computed (a verify step
        commits its anchor and accepted drafts), window pages released."""
        for c, n in zip(chunks, committed):
            req = c.request
            req.num_computed_tokens = c.start + n
            assert req.pages is not None
            if req.num_computed_tokens <= len(req.prompt_token_ids):
                # Prompt pages enter the prefix cache as they are computed, before their SWA pages slide out.
                self.kv.cache_computed(req.pages, req.tokens_between(0, req.num_computed_tokens))
            self.kv.release_window(req.pages, req.num_computed_tokens)

    def preempt(self, req: Request) -> None:
        self._release(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    def finish(self, req: Request) -> None:
        """Free everything the request holds (running or waiting), unless it holds its pages for a transfer."""
        if req.status == RequestStatus.WAITING and req in self.waiting:
            self.waiting.remove(req)
        if req.hold_pages and req.pages is not None and req.finish_reason != FinishReason.ABORT:
            self.running.remove(req)
        elif req.pages is not None:
            self._release(req)
        req.status = RequestStatus.FINISHED

    def release_held(self, req: Request) -> None:
        """Free the pages a finished `hold_pages` request kept (its computed prompt stays in the prefix cache)."""
        req.hold_pages = False
        if req.pages is not None:
            self._release(req)

    def adopt(self, req: Request) -> None:
        """Add a request whose cache was filled from elsewhere (a transfer) straight into the running batch."""
        assert req.pages is not None and req.num_computed_tokens > 0
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def _release(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        if req.pages is not None:
            # What was computed stays reusable: a later request (or this one, after preemption) can match it.
            self.kv.close(req.pages, cache_tokens=req.all_token_ids[: req.num_computed_tokens])
            req.pages = None


def _scoring(req: Request) -> bool:
    """A request whose prompt's logprobs are wanted, while it computes its prompt."""
    return req.prompt_logprobs is not None and req.num_computed_tokens < len(req.prompt_token_ids)
