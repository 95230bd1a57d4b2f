"""`Engine`: the serving loop. One `step()` is `schedule -> draft -> run -> sample/accept -> update`."""

from __future__ import annotations

import itertools
import math
import random
import secrets
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch

from pdspark.cache.kv_cache import KVCache, ReqPages
from pdspark.cache.page_allocator import PoolUsage
from pdspark.cache.pool_sizes import PoolSizes
from pdspark.config import EngineConfig
from pdspark.engine.drafter import DraftProposal, DSparkDrafter
from pdspark.engine.forward_batch import Chunk
from pdspark.engine.grammar import GrammarCursor, Grammars
from pdspark.engine.model_runner import ModelRunner, RunOutput
from pdspark.engine.random_stream import RandomStream
from pdspark.engine.request import Request, RequestStatus
from pdspark.engine.sampler import History, Sampler
from pdspark.engine.scheduler import ScheduledChunk, ScheduleOutput, Scheduler
from pdspark.engine.spec_governor import SpecGovernor
from pdspark.engine.spec_verifier import accept
from pdspark.engine.stop_checker import StopChecker
from pdspark.errors import CapacityError, ConfigError, ErrorCode, InvalidRequestError, RequestFailed
from pdspark.hardware.prepare_streams import PrepareStreams, StepKind
from pdspark.hardware.registry import select_backend
from pdspark.model.dspark import DSparkDraft
from pdspark.model.dsv4 import DSV4Model
from pdspark.model.tokenizer import Tokenizer
from pdspark.types import FinishReason, RequestOutput, SamplingParams, TokenLogprobs


@dataclass
class SpecStats:
    """Speculative decoding counters since the engine started.

    NOTE: a verify step costs two list adds, whatever its length: per-position counts are derived when read (a
    draft at position k was accepted in every step that accepted at least k drafts)."""

    verify_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    # [num_drafts + 1]: verify steps that proposed (accepted) exactly k drafts
    steps_by_drafts: list[int] = field(default_factory=list)
    steps_by_accepted: list[int] = field(default_factory=list)

    @classmethod
    def for_drafts(cls, num_drafts: int) -> SpecStats:
        return cls(steps_by_drafts=[0] * (num_drafts + 1), steps_by_accepted=[0] * (num_drafts + 1))

    @property
    def accepted_per_position(self) -> list[int]:
        """[num_drafts]: drafts accepted at position k + 1."""
        return _tail_sums(self.steps_by_accepted)[1:]

    @property
    def drafted_per_position(self) -> list[int]:
        """[num_drafts]: drafts proposed at position k + 1 (a step near `max_tokens` proposes fewer)."""
        return _tail_sums(self.steps_by_drafts)[1:]

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens committed per verify step (accepted drafts + the bonus token)."""
        return (self.accepted_tokens + self.verify_steps) / max(self.verify_steps, 1)


@dataclass
class EngineStats:
    """Step counters since the engine started (plain ints, read by the serving layer's metrics between steps)."""

    generated_tokens: int = 0  # tokens sampled and appended to outputs (a decode worker's adopted first token not)
    last_batch_size: int = 0  # requests scheduled by the last step (0: it scheduled nothing)
    # Decode/verify steps the C fast path did not run, by `FastPathFallbacks` reason (the runner's own counter).
    fast_path_fallback_steps: Counter[str] = field(default_factory=Counter)


def _prompt_rows(c: ScheduledChunk) -> int:
    """Logits rows a chunk computes for its request's prompt logprobs: one per prompt position it predicts (its
    rows but a sampling one: the last prompt position predicts the first output token)."""
    req = c.request
    if req.prompt_logprobs is None or c.num_drafts or len(req.prompt_logprobs) >= len(req.prompt_token_ids) or \
            c.start >= len(req.prompt_token_ids) - 1:
        return 0  # (also a preempted request computing its prompt again: its logprobs are recorded)
    return min(c.num_tokens, len(req.prompt_token_ids) - 1 - c.start)


def _tail_sums(counts: list[int]) -> list[int]:
    """`out[k] = sum(counts[k:])`."""
    out, acc = [0] * len(counts), 0
    for k in range(len(counts) - 1, -1, -1):
        acc += counts[k]
        out[k] = acc
    return out


def _decode_only(chunks: list[ScheduledChunk]) -> bool:
    """A decode step: every chunk computes one new token (plus its drafts), no prompt chunk among them."""
    return all(c.num_tokens - c.num_drafts == 1 for c in chunks)


class _GovernedStep(NamedTuple):
    """When a step under the speculation governor began, and its batch then."""

    started: float
    batch: int


@dataclass(frozen=True)
class _StepTokens:
    """What one chunk produced: new tokens, the logits rows they came from, and rows now computed."""

    chunk: ScheduledChunk
    tokens: list[int]
    logits: torch.Tensor  # [len(tokens), V]
    committed: int


class Engine:
    def __init__(
        self,
        model: DSV4Model,
        config: EngineConfig,
        tokenizer: Tokenizer | None = None,
        draft: DSparkDraft | None = None,
    ):
        self.config = config
        self.model_config = model.cfg
        self.tokenizer = tokenizer
        num_drafts = 0
        if config.speculative is not None:
            if draft is None:
                raise ConfigError("`speculative='dspark'` needs a checkpoint with a DSpark draft (a `dspark` config)")
            num_drafts = config.num_speculative_tokens or draft.dcfg.gamma
            if not 1 <= num_drafts <= draft.dcfg.gamma:
                raise ConfigError(f"`num_speculative_tokens` must be in [1, {draft.dcfg.gamma}] for this draft")
        # Verify windows write up to `num_drafts + 1` rows past the committed length into the state rings.
        cache = replace(config.cache, max_draft_tokens=num_drafts + 1 if num_drafts else 0)
        self.sizes = PoolSizes.derive(model.cfg, cache, config.scheduler)
        dtype = getattr(torch, config.dtype)
        stages = draft.dcfg.num_stages if num_drafts and draft is not None else 0
        self.backend = select_backend(config.device)
        self.kv = KVCache(model.cfg, self.sizes, dtype, self.backend.device, config.cache.enable_prefix_cache, stages,
                          config.cache.kv_cache_dtype)
        self.scheduler = Scheduler(config.scheduler, self.kv, num_drafts)
        drafting = draft if num_drafts else None
        capture = drafting.dcfg.target_layer_ids if drafting is not None else ()
        streams = PrepareStreams(self.backend) if config.multi_stream_rows else None
        self.runner = ModelRunner(model, self.kv, capture, streams, config.multi_stream_rows)
        # (the drafter's module-path forwards count with the runner's steps)
        self.drafter = DSparkDrafter(drafting, self.kv, self.runner.fallbacks) if drafting is not None else None
        self.governor = (SpecGovernor(num_drafts) if self.drafter is not None
                         and config.speculative_policy == "when-faster" else None)
        self.sampler = Sampler(model.cfg.eos_token_ids)
        self.grammars = Grammars(tokenizer, model.cfg.vocab_size, model.cfg.eos_token_ids)
        # Seeds for requests that come without one. NOTE: an explicit engine seed is the deterministic mode (tests,
        # benchmarks: the n-th request gets the same seed on every run); without one (None), OS entropy, so that two
        # workers never produce the same "random" streams.
        self._seeds = random.Random(secrets.randbits(128) if config.seed is None else config.seed)
        self.stop_checker = StopChecker(tokenizer, model.cfg.eos_token_ids, self.scheduler.max_model_len)
        self.spec = SpecStats.for_drafts(num_drafts)
        self.stats = EngineStats(fast_path_fallback_steps=self.runner.fallbacks.steps)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()

    # ---- requests ---------------------------------------------------------------------------------------------------
    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        prompt: str | None = None,
        hold_pages: bool = False,
    ) -> str:
        """Queue a request; raises `InvalidRequestError` / `CapacityError` for one that can never be served, and
        `RequestFailed` (ALREADY_EXISTS) for an id already in flight.

        `hold_pages` (prefill role): keep the request's pages after it finishes until `release_held`.
        """
        req_id = request_id if request_id is not None else str(next(self._ids))
        self._check_new_id(req_id)
        self.validate(prompt_token_ids, params)
        req = Request(req_id, list(prompt_token_ids), params, prompt=prompt, hold_pages=hold_pages,
                      seed=self.effective_seed(params), grammar=self._grammar(params))
        self.requests[req_id] = req
        self.scheduler.add(req)
        return req_id

    def validate(self, ids: list[int], params: SamplingParams) -> None:
        max_len = self.scheduler.max_model_len
        vocab = self.model_config.vocab_size
        if not ids:
            raise InvalidRequestError("empty prompt: a request needs at least one token")
        if len(ids) >= max_len:
            raise InvalidRequestError(
                f"prompt has {len(ids)} tokens; `max_model_len` is {max_len} (prompt must be shorter, to leave "
                "room for at least one generated token)"
            )
        bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise InvalidRequestError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if params.structured_outputs is not None:
            self.grammars.compile(params.structured_outputs)  # (a bad schema fails here, before any page is taken)
        total = min(len(ids) + params.max_tokens, max_len)
        sizes, P = self.sizes, self.sizes.page_size
        need = math.ceil(total / P)
        if need > sizes.num_full_pages:
            raise CapacityError(f"request needs {need} pages of {P} tokens; the pool has {sizes.num_full_pages} in all")
        # The window (plus the page being written and the one the overlap rows may sit on) must fit the SWA pool.
        swa_need = math.ceil(self.kv.keep_margin / P) + 2
        if swa_need > sizes.num_swa_pages:
            raise CapacityError(f"a running request needs {swa_need} SWA pages; the pool has {sizes.num_swa_pages}")
        c128_need = math.ceil(total / self.kv.group_tokens) if self.model_config.hca_layers else 0
        if c128_need > sizes.num_c128_pages:
            raise CapacityError(f"request needs {c128_need} C128 pages; the pool has {sizes.num_c128_pages}")

    def _grammar(self, params: SamplingParams) -> GrammarCursor | None:
        """A new cursor for a constrained request (its grammar compiled, or found compiled: workers compile ahead of
        the loop, `EngineClient._compile_grammar`)."""
        return self.grammars.cursor(params.structured_outputs) if params.structured_outputs is not None else None

    def _check_new_id(self, req_id: str) -> None:
        # A request is in flight until `release` forgets it (finished ones too: their outputs or held pages are
        # still being collected). Taking over its id would hand one caller's tokens, abort or pages to another.
        if req_id in self.requests:
            raise RequestFailed(ErrorCode.ALREADY_EXISTS, f"request id {req_id!r} is already in flight")

    def effective_seed(self, params: SamplingParams) -> int:
        """The client's seed, else a fresh one (63 bits: it fits the wire's int64 should it ever travel)."""
        return params.seed if params.seed is not None else self._seeds.getrandbits(63)

    def abort(self, request_id: str) -> bool:
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return False
        req.finish_reason = FinishReason.ABORT
        self._settle_draft_context(req)
        self.scheduler.finish(req)
        return True

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def pool_usage(self) -> dict[str, PoolUsage]:
        """Pages used and in all, per pool (`KVCache.usage`; a DP-attention group sums its ranks')."""
        return self.kv.usage()

    @property
    def has_running(self) -> bool:
        """Some request has been scheduled and is not finished (one that only waits for room is not running)."""
        return bool(self.scheduler.running)

    def release_held(self, request_id: str) -> None:
        """Free the pages of a finished `hold_pages` request (after its cache has been shipped)."""
        self.scheduler.release_held(self.requests[request_id])

    # ---- decode role: requests whose prompt cache arrives by transfer ------------------------------------------------
    def reserve_transfer(self, prompt_token_ids: list[int], params: SamplingParams) -> ReqPages | None:
        """Destination pages for a prompt computed elsewhere; None while the pools are too full."""
        self.validate(prompt_token_ids, params)
        pages = self.kv.open()
        if pages is None:
            return None
        if not self.kv.can_grow_tail(pages, len(prompt_token_ids)):
            self.kv.close(pages)
            return None
        self.kv.grow_tail(pages, len(prompt_token_ids))
        # The transfer writes draft context rows into these pages; a kept row for a slot of theirs (a page freed
        # since) must land before it, not over it.
        self._flush_draft_context()
        return pages

    def cancel_transfer(self, pages: ReqPages) -> None:
        """Free a reservation whose transfer failed or expired."""
        self.kv.close(pages)

    def adopt(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        pages: ReqPages,
        first_token: int,
        num_cached_tokens: int = 0,
        first_logprob: TokenLogprobs | None = None,
        prompt: str | None = None,
        generated: list[int] | tuple[int, ...] = (),
    ) -> RequestOutput:
        """Continue a request whose prompt cache (and first token) arrived by transfer into `pages`. Raises
        `RequestFailed` (ALREADY_EXISTS) for an id already in flight; `pages` then stay the caller's.

        `generated`: a migrated request's tokens produced before (elsewhere), after the prompt; the transferred
        cache covers prompt + generated and `first_token` follows them. They count as output (max_tokens, stop
        strings, text), as if this engine had produced them."""
        self._check_new_id(request_id)
        req = Request(request_id, list(prompt_token_ids), params, prompt=prompt, seed=self.effective_seed(params),
                      output_token_ids=list(generated), grammar=self._grammar(params))
        req.pages = pages
        req.num_computed_tokens = req.num_tokens
        req.num_cached_tokens = num_cached_tokens
        self.requests[request_id] = req
        self.scheduler.adopt(req)
        req.output_token_ids.append(first_token)
        if req.logprobs is not None and first_logprob is not None:
            req.logprobs.append(first_logprob)
        if self.stop_checker.check(req):
            self.scheduler.finish(req)
        return self.output(req)

    # ---- the loop ---------------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One forward pass: schedule -> propose -> run -> decide -> commit -> append. Returns the outputs of the
        requests that got tokens this step (finished ones flagged)."""
        governed = self._govern_drafts()
        sched = self._schedule()
        if sched.empty:
            return self._fail_unadmittable()
        proposals = self._propose(sched.chunks)
        out = self.runner.run([self._chunk(c, proposals.get(c.request.req_id)) for c in sched.chunks])
        produced = self._decide(sched.chunks, out, proposals)
        timed = governed is not None and _decode_only(sched.chunks)
        self._commit(produced, out, keep_context=timed and not proposals)
        if governed is not None:
            self._record_decode_step(governed, timed, bool(proposals), produced)
        return self._append(produced)

    def _schedule(self) -> ScheduleOutput:
        sched = self.scheduler.schedule()
        self.stats.last_batch_size = len(sched.chunks)
        return sched

    def _govern_drafts(self) -> _GovernedStep | None:
        """Under the speculation governor: set how many drafts this step takes, and note when the step began."""
        if self.governor is None:
            return None
        started, batch = time.perf_counter(), len(self.scheduler.running)
        running = self.scheduler.running
        # Saturated (every slot taken): the waiting requests start only once one finishes, so the step is of the
        # running ones alone, as without a queue. A server busy from its start would otherwise never measure (nor
        # probe) speculation.
        full = len(running) >= self.scheduler.cfg.max_num_seqs
        steady = (not self.scheduler.waiting or full) and all(r.num_pending_tokens == 1 for r in running)
        self.scheduler.num_drafts = self.governor.drafts(batch, steady)
        return _GovernedStep(started, batch)

    def _record_decode_step(self, governed: _GovernedStep, timed: bool, drafted: bool,
                            produced: list[_StepTokens]) -> None:
        """A decode step (no prompt chunk in it: `timed`) is timed whole, drafting, forward, sampling and commit:
        what the governor compares drafting with. Not a step the governor wanted drafts for whose requests could take
        none (each at its last token): it is of neither mode. Another step only tells the governor that the engine
        was busy, not idle, until now."""
        assert self.governor is not None
        if not timed or drafted != (self.scheduler.num_drafts > 0):
            self.governor.busy()
            return
        self.governor.record(governed.batch, drafted, time.perf_counter() - governed.started,
                             sum(len(p.tokens) for p in produced))

    def _fail_unadmittable(self) -> list[RequestOutput]:
        """Nothing runs, nothing holds pages, and the next request still cannot start: it never will. End it
        (validation should have caught it; this keeps the loop from spinning forever if it did not)."""
        assert not self.scheduler.running, "running requests but nothing scheduled"
        holding = any(r.pages is not None for r in self.requests.values() if r.finished)
        if not self.scheduler.waiting or holding:
            return []
        req = self.scheduler.waiting[0]
        req.finish_reason, req.stop_reason = FinishReason.ABORT, "the request does not fit the configured pools"
        self.scheduler.finish(req)
        return [self.output(req)]

    def _propose(self, chunks: list[ScheduledChunk]) -> dict[str, DraftProposal]:
        verify = [c for c in chunks if c.num_drafts]
        if not verify or self.drafter is None:
            return {}
        proposals = self.drafter.propose([c.request for c in verify], [c.num_drafts for c in verify])
        return {c.request.req_id: p for c, p in zip(verify, proposals)}

    @staticmethod
    def _chunk(c: ScheduledChunk, proposal: DraftProposal | None) -> Chunk:
        req = c.request
        tokens = req.tokens_between(c.start, c.start + c.num_tokens - c.num_drafts)
        if proposal is not None:
            return Chunk(req.slot, c.start, tokens + proposal.tokens, num_logits=c.num_tokens, kind="verify")
        # One token past the prompt: a generated token (or a transferred first one) being decoded.
        kind: StepKind = "decode" if c.num_tokens == 1 and c.start >= len(req.prompt_token_ids) else "extend"
        return Chunk(req.slot, c.start, tokens, num_logits=int(c.samples) + _prompt_rows(c), kind=kind)

    def _decide(
        self, chunks: list[ScheduledChunk], out: RunOutput, proposals: dict[str, DraftProposal]
    ) -> list[_StepTokens]:
        """Sample every logits row, then keep each verify window's drafts that match its rows' tokens."""
        # Logits rows, chunk by chunk: every window row of a verify chunk, one row of a chunk that samples, none of
        # a prefill chunk that ends before its prompt does. Row j of a chunk predicts position `num_tokens + j` of
        # its request, and is drawn there exactly as plain decoding would draw it (see `spec_verifier`).
        num_rows = [c.num_tokens if c.num_drafts else int(c.samples) for c in chunks]
        # A chunk of a prompt whose logprobs are wanted also has a row for each prompt position it predicts, before
        # its sampling row (`_prompt_rows`): set aside here, the rest sampled.
        prompt_rows = [_prompt_rows(c) for c in chunks]  # (once: recording them changes what it says)
        at = [0, *itertools.accumulate(p + n for p, n in zip(prompt_rows, num_rows))][:-1]  # each chunk's first row
        for c, start, p in zip(chunks, at, prompt_rows):
            if p:
                self._prompt_logprobs(c, out.logits[start : start + p])
        keep = [start + p + j for start, p, n in zip(at, prompt_rows, num_rows) for j in range(n)]
        logits = out.logits if len(keep) == out.logits.shape[0] else out.logits[keep]
        rows = [(c, j) for c, n in zip(chunks, num_rows) for j in range(n)]
        target = self.sampler.sample(
            logits,
            [c.request.params for c, _ in rows],
            [RandomStream(c.request.seed) for c, _ in rows],
            [c.request.num_tokens + j for c, j in rows],
            [self._history(c, j, proposals) if c.request.params.needs_history else None for c, j in rows],
        )
        produced, start = [], 0
        for c, n in zip(chunks, num_rows):
            chunk_logits, tokens = logits[start : start + n], target[start : start + n]
            start += n
            if c.num_drafts:
                acc = accept(proposals[c.request.req_id].tokens, tokens)
                self._count(c.request, c.num_drafts, acc.num_accepted)
                produced.append(_StepTokens(c, acc.tokens, chunk_logits[: len(acc.tokens)], acc.num_accepted + 1))
            else:
                produced.append(_StepTokens(c, tokens, chunk_logits, c.num_tokens))
        return produced

    @staticmethod
    def _prompt_logprobs(c: ScheduledChunk, logits: torch.Tensor) -> None:
        """Record the logprobs of the prompt tokens that `logits` (row j: the position after `c.start + j`)
        predict; a position already recorded (a preempted request computing its prompt again) is left alone."""
        req = c.request
        assert req.prompt_logprobs is not None
        first = c.start + 1  # the position row 0 predicts
        tokens = req.prompt_token_ids[first : first + logits.shape[0]]
        for j, lp in enumerate(Sampler.logprobs(logits, tokens, req.params.prompt_logprobs or 0)):
            if first + j == len(req.prompt_logprobs):
                req.prompt_logprobs.append(lp)

    @staticmethod
    def _history(c: ScheduledChunk, j: int, proposals: dict[str, DraftProposal]) -> History:
        """The tokens before row j's position: the committed ones, then a verify window's drafts before the row."""
        req = c.request
        drafts = proposals[req.req_id].tokens[:j] if c.num_drafts else []
        prompt_len = len(req.prompt_token_ids) - req.params.prompt_output_tokens
        return History(req.all_token_ids[: req.num_tokens] + drafts, prompt_len, req.grammar, req.num_tokens)

    def _count(self, req: Request, drafts: int, accepted: int) -> None:
        req.spec_verify_steps += 1
        req.spec_accepted_tokens += accepted
        self.spec.verify_steps += 1
        self.spec.draft_tokens += drafts
        self.spec.accepted_tokens += accepted
        self.spec.steps_by_drafts[drafts] += 1
        self.spec.steps_by_accepted[accepted] += 1

    def _commit(self, produced: list[_StepTokens], out: RunOutput, keep_context: bool = False) -> None:
        """Make the committed rows the request's computed state: draft context, rolled-back rings, page windows.
        `keep_context`: a decode step without drafts, whose draft context rows the drafter keeps and writes when
        next needed (`DSparkDrafter.keep`)."""
        rows: list[int] = []
        row = 0
        for p in produced:
            rows += range(row, row + p.committed)
            row += p.chunk.num_tokens
            if p.chunk.num_drafts:
                self._clear_rejected_c128_rows(p)
        if self.drafter is not None and out.features is not None:
            if keep_context:  # (row i is chunk i's token)
                self.drafter.keep(out.features, out.positions, out.swa_slots, len(produced),
                                  [p.chunk.request.slot for p in produced])
            else:
                # Committed rows from the first on (one request, or none rejected): views, not gathered copies.
                idx = (slice(0, len(rows)) if rows and rows[-1] == len(rows) - 1
                       else torch.tensor(rows, dtype=torch.long))
                self.drafter.inject(out.features[idx], out.positions[idx], out.swa_slots[idx])
        self.scheduler.update([p.chunk for p in produced], [p.committed for p in produced])

    def _settle_draft_context(self, req: Request) -> None:
        """Before `req` finishes: its kept draft context rows are dropped where its pages are freed unread (no
        prefix cache takes them, no transfer ships them); else every kept row is written."""
        if self.drafter is None:
            return
        held = req.hold_pages and req.finish_reason != FinishReason.ABORT  # (`Scheduler.finish`'s rule)
        if req.pages is not None and self.kv.tree is None and not held:
            self.drafter.forget(req.slot)
        else:
            self.drafter.flush()

    def _flush_draft_context(self) -> None:
        """The drafter writes every draft context row it kept: before a transfer writes pages (`reserve_transfer`; a
        finish or abort goes through `_settle_draft_context`)."""
        if self.drafter is not None:
            self.drafter.flush()

    def _clear_rejected_c128_rows(self, p: _StepTokens) -> None:
        """C128 ring rows written by rejected drafts go back to empty, as if never written."""
        if not self.model_config.hca_layers or p.committed == p.chunk.num_tokens:
            return
        positions = torch.arange(p.chunk.start + p.committed, p.chunk.start + p.chunk.num_tokens)
        slot = torch.full_like(positions, p.chunk.request.slot)
        self.kv.pools.clear_c128_state_rows(self.kv.c128_state_rows(slot, positions))

    def _append(self, produced: list[_StepTokens]) -> list[RequestOutput]:
        outputs = []
        for p in produced:
            req = p.chunk.request
            if not p.tokens or req.finished:
                continue
            for j, token in enumerate(p.tokens):
                req.output_token_ids.append(token)
                if req.logprobs is not None:
                    req.logprobs += Sampler.logprobs(p.logits[j : j + 1], [token], req.params.logprobs or 0)
                if self.stop_checker.check(req):
                    # Rows past the stop token were computed for tokens we drop; keep the books consistent.
                    req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens)
                    self._settle_draft_context(req)
                    self.scheduler.finish(req)
                    break
            self.stats.generated_tokens += j + 1
            outputs.append(self.output(req))
        return outputs

    def output(self, req: Request) -> RequestOutput:
        return RequestOutput(
            request_id=req.req_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            token_ids=list(req.output_token_ids),
            text=req.text,
            finished=req.status == RequestStatus.FINISHED,
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
            num_cached_tokens=req.num_cached_tokens,
            logprobs=list(req.logprobs) if req.logprobs is not None else None,
            prompt_logprobs=list(req.prompt_logprobs) if req.prompt_logprobs is not None else None,
            spec_verify_steps=req.spec_verify_steps,
            spec_accepted_tokens=req.spec_accepted_tokens,
        )

    def final_output(self, request_id: str) -> RequestOutput:
        """A request's output now (the whole of it once finished), by id."""
        return self.output(self.requests[request_id])

    def release(self, request_id: str) -> None:
        """Forget a finished request."""
        req = self.requests.pop(request_id)
        assert req.finished

    def flush_cache(self) -> None:
        """Drop every prefix-cache entry no running request is using."""
        self.kv.flush_prefix_cache()

    def check_integrity(self) -> None:
        self.kv.check_integrity()
