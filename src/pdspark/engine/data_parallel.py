"""`DataParallelEngine`: rank 0 of a DP-attention group, the `Engine` API over every rank's requests.

Each rank holds a whole `Engine` over its own requests (scheduler, pages, compressor states) and its share of the
routed experts. Rank 0 places each new request on the rank with the fewest unfinished ones, sends calls to the owning
rank over that rank's pipe, and runs every step on every rank at once: the MoE layers inside the ranks' forwards
exchange token rows (`parallel/token_exchange.py`), and a rank whose step is done joins the others' remaining forwards
with no tokens (`DSV4Model.finish_group_step`). Sampling happens on the owning rank; outputs come back over the pipe.

What must not differ from one process is chosen on rank 0: a request without a seed gets one drawn there, in the
order requests arrive (the same seeds as one engine of the same `seed`).

A decode worker's requests arrive by transfer: `reserve_transfer` places the reservation (pages in one rank's pools,
the least-loaded rank that has room), the transfer writes into that rank's memory (the worker's plan names that
rank's session and buffers), and `adopt` continues the request there. Every answer of a rank carries its load
(`RankLoad`: requests and pool usage), so rank 0 knows the group's pages without asking between steps.

A pipe reply is awaited at most `dist_timeout_s` after rank 0's own part of the call is done: a rank's step ends in the
same collective as rank 0's (only its reply's pickling and pipe write are left), and a call without a collective is
quicker still. A rank that exits or does not answer fails the group (`WorkerGroupError`), so a rank that hangs fails it
within the timeout (stopped before a collective: rank 0's collective times out; after the step's last one: its reply
does), and the worker exits within the timeout + 1 s.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, NamedTuple

from pdspark.cache.page_allocator import PoolUsage
from pdspark.engine.engine import Engine, EngineStats, SpecStats
from pdspark.engine.lockstep import LockstepEngine, RankProcess, calls_from
from pdspark.errors import ErrorCode, RequestFailed, WorkerGroupError
from pdspark.parallel.rank_stats import RankStats
from pdspark.types import RequestOutput, SamplingParams, TokenLogprobs

if TYPE_CHECKING:
    from pdspark.cache.req_pages import ReqPages

# The calls rank 0 makes on a follower rank's engine, by name (each answered over the pipe).
_CALLS = frozenset({"add_request", "abort", "release", "flush_cache", "step", "final_output", "reserve_transfer",
                    "cancel_transfer", "adopt"})


class RankLoad(NamedTuple):
    """A rank's requests and pages, as its last answer left them (rank 0's: now)."""

    unfinished: bool
    running: int
    waiting: int
    usage: dict[str, PoolUsage]  # `KVCache.usage`
    cached: dict[str, int]  # `KVCache.cached_pages`
    stats: EngineStats  # its step counters (the group's metrics add every rank's up)
    spec: SpecStats


def rank_load(engine: Engine) -> RankLoad:
    return RankLoad(engine.has_unfinished, len(engine.scheduler.running), len(engine.scheduler.waiting),
                    engine.kv.usage(), engine.kv.cached_pages(), engine.stats, engine.spec)


def summed(loads: Sequence[RankLoad]) -> RankLoad:
    """The group's load: every count added up, pool by pool."""
    return RankLoad(any(ld.unfinished for ld in loads), sum(ld.running for ld in loads),
                    sum(ld.waiting for ld in loads), summed_usage([ld.usage for ld in loads]),
                    {k: sum(ld.cached.get(k, 0) for ld in loads) for k in loads[0].cached},
                    summed_stats([ld.stats for ld in loads]), summed_spec([ld.spec for ld in loads]))


def summed_usage(usages: Sequence[dict[str, PoolUsage]]) -> dict[str, PoolUsage]:
    return {k: PoolUsage(sum(u[k].used for u in usages), sum(u[k].total for u in usages)) for k in usages[0]}


def summed_stats(stats: Sequence[EngineStats]) -> EngineStats:
    return EngineStats(generated_tokens=sum(s.generated_tokens for s in stats),
                       last_batch_size=sum(s.last_batch_size for s in stats),
                       fast_path_fallback_steps=sum((s.fast_path_fallback_steps for s in stats), Counter()))


def summed_spec(specs: Sequence[SpecStats]) -> SpecStats:
    return SpecStats(verify_steps=sum(s.verify_steps for s in specs), draft_tokens=sum(s.draft_tokens for s in specs),
                     accepted_tokens=sum(s.accepted_tokens for s in specs),
                     steps_by_drafts=[sum(k) for k in zip(*(s.steps_by_drafts for s in specs))],
                     steps_by_accepted=[sum(k) for k in zip(*(s.steps_by_accepted for s in specs))])


class DataParallelEngine(LockstepEngine):
    """The `Engine` API for callers (`LLM`): requests live on their owning rank; reads of the configuration, the
    tokenizer and validation go to rank 0's engine."""

    def __init__(self, engine: Engine, followers: list[Connection], ranks: Sequence[RankProcess] | None = None,
                 stats: RankStats | None = None):
        super().__init__(engine, followers, ranks, stats=stats)
        self.owner: dict[str, int] = {}  # request id -> the rank it runs on, until released
        self._running: dict[str, int] = {}  # the unfinished ones (placement counts them)
        self._reserved: set[tuple[int, int]] = set()  # (rank, slot) of outstanding transfer reservations
        # Each other rank's load as of its last answer (rank r at r - 1); they start as rank 0 does, with nothing.
        idle = rank_load(engine)._replace(stats=EngineStats(), spec=SpecStats.for_drafts(engine.scheduler.num_drafts))
        self._loads = [idle] * len(followers)
        self._ids = itertools.count()
        self._reply_s = engine.config.parallel.dist_timeout_s

    @property
    def size(self) -> int:
        return len(self._loads) + 1

    @property
    def rank_loads(self) -> list[int]:
        """Unfinished requests and outstanding transfer reservations per rank, as rank 0 counts them (placement
        goes by these)."""
        load = [0] * self.size
        for rank in self._running.values():
            load[rank] += 1
        for rank, _ in self._reserved:
            load[rank] += 1
        return load

    def rank_pool_loads(self) -> list[RankLoad]:
        """Every rank's load, rank 0's now and the others' as of their last answer."""
        return [rank_load(self.engine), *self._loads]

    def group_load(self) -> RankLoad:
        return summed(self.rank_pool_loads())

    def pool_usage(self) -> dict[str, PoolUsage]:
        return summed_usage([self.engine.kv.usage(), *(ld.usage for ld in self._loads)])

    @property
    def stats(self) -> EngineStats:
        """Every rank's step counters added up (`last_batch_size`: the group's last step's requests)."""
        return summed_stats([self.engine.stats, *(ld.stats for ld in self._loads)])

    @property
    def spec(self) -> SpecStats:
        """Every rank's speculation counters added up."""
        return summed_spec([self.engine.spec, *(ld.spec for ld in self._loads)])

    @property
    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished or any(ld.unfinished for ld in self._loads)

    @property
    def has_running(self) -> bool:
        return self.engine.has_running or any(ld.running for ld in self._loads)

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                    prompt: str | None = None, hold_pages: bool = False) -> str:
        self._check()
        if hold_pages:
            raise NotImplementedError("`hold_pages` in a DP-attention group (prefill workers run replicated groups)")
        req_id = request_id if request_id is not None else str(next(self._ids))
        if req_id in self.owner:
            raise RequestFailed(ErrorCode.ALREADY_EXISTS, f"request id {req_id!r} is already in flight")
        self.engine.validate(prompt_token_ids, params)  # (the same limits on every rank: refused here)
        if params.seed is None:
            params = replace(params, seed=self.engine.effective_seed(params))
        load = self.rank_loads
        rank = min(range(self.size), key=lambda r: (load[r], r))
        self._on(rank, "add_request", prompt_token_ids, params, req_id, prompt)
        self.owner[req_id] = self._running[req_id] = rank
        return req_id

    def abort(self, request_id: str) -> bool:
        rank = self.owner.get(request_id)
        if rank is None:
            return False
        self._running.pop(request_id, None)
        if rank == 0:
            return self.engine.abort(request_id)
        if self.failure is not None:  # (that rank is gone or out of step: what it ran is over)
            return False
        return bool(self._on(rank, "abort", request_id))

    def release(self, request_id: str) -> None:
        rank = self.owner.pop(request_id)
        if rank == 0:
            self.engine.release(request_id)
        elif self.failure is None:
            self._on(rank, "release", request_id)

    def release_held(self, request_id: str) -> None:
        raise NotImplementedError("`release_held` in a DP-attention group (no request holds pages here)")

    # ---- decode role: requests whose prompt cache arrives by transfer (into one rank's pools) ------------------------
    def reserve_transfer(self, prompt_token_ids: list[int], params: SamplingParams) -> ReqPages | None:
        """Destination pages on the least-loaded rank with room (`pages.rank` names it); None while every rank's
        pools are too full."""
        self._check()
        load = self.rank_loads
        for rank in sorted(range(self.size), key=lambda r: (load[r], r)):
            pages: ReqPages | None = self._on(rank, "reserve_transfer", prompt_token_ids, params)
            if pages is not None:
                pages.rank = rank
                self._reserved.add((rank, pages.slot))
                return pages
        return None

    def cancel_transfer(self, pages: ReqPages) -> None:
        self._reserved.discard((pages.rank, pages.slot))
        if pages.rank == 0:
            self.engine.cancel_transfer(pages)
        elif self.failure is None:
            self._on(pages.rank, "cancel_transfer", pages.slot)

    def adopt(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, pages: ReqPages,
              first_token: int, num_cached_tokens: int = 0, first_logprob: TokenLogprobs | None = None,
              prompt: str | None = None, generated: list[int] | tuple[int, ...] = ()) -> RequestOutput:
        """`Engine.adopt` on the rank whose pools hold `pages` (the reservation's rank owns the request)."""
        self._check()
        if request_id in self.owner:
            raise RequestFailed(ErrorCode.ALREADY_EXISTS, f"request id {request_id!r} is already in flight")
        if params.seed is None:
            params = replace(params, seed=self.engine.effective_seed(params))
        rank = pages.rank
        out: RequestOutput = self._on(rank, "adopt", request_id, prompt_token_ids, params,
                                      pages if rank == 0 else pages.slot, first_token, num_cached_tokens,
                                      first_logprob, prompt, generated)
        self._reserved.discard((rank, pages.slot))
        self.owner[request_id] = rank
        if not out.finished:
            self._running[request_id] = rank
        return out

    def final_output(self, request_id: str) -> RequestOutput:
        rank = self.owner[request_id]
        return self.engine.final_output(request_id) if rank == 0 else self._on(rank, "final_output", request_id)

    def flush_cache(self) -> None:
        self._check()
        self._all("flush_cache", self.engine.flush_cache)

    def step(self) -> list[RequestOutput]:
        """One step on every rank (rank 0's here, the others' in their processes, their MoE exchanges together);
        every rank's outputs."""
        self._check()
        mine, theirs = self._all("step", lambda: self._timed(lambda: _group_step(self.engine)))
        outs = list(mine)
        for got in theirs:
            outs.extend(got)
        for o in outs:
            if o.finished:
                self._running.pop(o.request_id, None)
        return outs

    # ---- calls to the ranks ------------------------------------------------------------------------------------------
    def _on(self, rank: int, name: str, *args: Any) -> Any:
        """Make a call on rank `rank`'s engine (0: here)."""
        if rank == 0:
            return getattr(self.engine, name)(*args)
        self._check()
        return self._guarded(name, lambda: self._answer(rank, self._send(rank, name, args)))

    def _all(self, name: str, local: Any) -> tuple[Any, list[Any]]:
        """`local()` here and the call `name` on every other rank, at once; rank 0's result and theirs."""

        def run() -> tuple[Any, list[Any]]:
            conns = [self._send(rank, name, ()) for rank in range(1, self.size)]
            mine = local()
            return mine, [self._answer(rank, conn) for rank, conn in enumerate(conns, start=1)]

        result: tuple[Any, list[Any]] = self._guarded(name, run)
        return result

    def _send(self, rank: int, name: str, args: tuple[Any, ...]) -> Connection:
        conn = self._followers[rank - 1]
        conn.send((name, args))
        return conn

    def _answer(self, rank: int, conn: Connection) -> Any:
        self._await_answer(rank, conn, self._reply_s)
        ok, value, load = conn.recv()
        self._loads[rank - 1] = load
        if not ok:  # (rank 0 checked the call first: a rank's engine refusing it is the group out of step)
            raise WorkerGroupError(f"rank {rank} failed: {value}")
        return value

    def _guarded(self, name: str, call: Any) -> Any:
        """`call()`; any failure ends the group (the ranks' states may now differ), an interrupt too (the other
        ranks may be inside a step whose answer would be taken for the next call's)."""
        try:
            return call()
        except BaseException as e:
            cause = f" (from {type(e.__cause__).__name__}: {e.__cause__})" if e.__cause__ is not None else ""
            self.failure = WorkerGroupError(f"the worker group failed in `{name}` ({self._states()}): "
                                            f"{type(e).__name__}: {e}{cause}")
            if not isinstance(e, Exception):
                raise
            raise self.failure from e


def _group_step(engine: Engine) -> list[RequestOutput]:
    """This rank's step, then the other ranks' remaining forwards joined (with no tokens of its own)."""
    outs = engine.step()
    engine.runner.model.finish_group_step()
    return outs


class _RankCalls:
    """A follower's engine as rank 0's calls reach it. Transfer reservations are kept here by request slot: rank 0
    holds copies (what a plan names), and the engine needs its own objects back (they hold the pages)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._reserved: dict[int, ReqPages] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def reserve_transfer(self, prompt_token_ids: list[int], params: SamplingParams) -> ReqPages | None:
        pages = self.engine.reserve_transfer(prompt_token_ids, params)
        if pages is not None:
            self._reserved[pages.slot] = pages
        return pages

    def cancel_transfer(self, slot: int) -> None:
        self.engine.cancel_transfer(self._reserved.pop(slot))

    def adopt(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, slot: int,
              *rest: Any) -> RequestOutput:
        out = self.engine.adopt(request_id, prompt_token_ids, params, self._reserved[slot], *rest)
        del self._reserved[slot]  # (the request holds them now)
        return out


def serve_rank(engine: Engine, conn: Connection,
               timed: Callable[[Callable[[], Any]], Any] = lambda f: f()) -> None:
    """A follower rank's loop in a DP-attention group: answer rank 0's calls on this rank's engine until told to
    stop or rank 0 is gone. A step ends by joining the other ranks' remaining forwards. A failed call ends the rank
    (after its answer, which names the error): rank 0 checked the call first, and a failed step's collectives may
    have left the group out of step. `timed` records each step (`RankStats.timer`)."""
    calls = _RankCalls(engine)
    for name, args in calls_from(conn, _CALLS):
        try:
            value = timed(lambda: _group_step(engine)) if name == "step" else getattr(calls, name)(*args)
        except Exception as e:
            conn.send((False, f"{type(e).__name__}: {e}", rank_load(engine)))  # (any exception pickles so)
            raise
        conn.send((True, value, rank_load(engine)))
