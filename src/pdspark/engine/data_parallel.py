"""`DataParallelEngine`: rank 0 of a DP-attention group, the `Engine` API over every rank's requests.

Each rank holds a whole `Engine` over its own requests (scheduler, pages, compressor states) and its share of the
routed experts. Rank 0 places each new request on the rank with the fewest unfinished ones, sends calls to the owning
rank over that rank's pipe, and runs every step on every rank at once: the MoE layers inside the ranks' forwards
exchange token rows (`parallel/token_exchange.py`), and a rank whose step is done joins the others' remaining forwards
with no tokens (`DSV4Model.finish_group_step`). Sampling happens on the owning rank; outputs come back over the pipe.

What must not differ from one process is chosen on rank 0: a request without a seed gets one drawn there, in the
order requests arrive (the same seeds as one engine of the same `seed`). A pipe reply is awaited at most
`dist_timeout_s` + 1 s after rank 0's own part of the call is done (a rank's step ends in the same collective as
rank 0's); a rank that exits or does not answer fails the group (`WorkerGroupError`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import replace
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for
from typing import Any

from pdspark.engine.engine import Engine
from pdspark.engine.lockstep import LockstepEngine, RankProcess, calls_from
from pdspark.errors import ErrorCode, RequestFailed, WorkerGroupError
from pdspark.parallel.rank_stats import RankStats
from pdspark.types import RequestOutput, SamplingParams

# The calls rank 0 makes on a follower rank's engine, by name (each answered over the pipe).
_CALLS = frozenset({"add_request", "abort", "release", "flush_cache", "step", "final_output"})
# A reply's slack beyond the group's collective timeout: the pipe write and the unpickling of a step's outputs.
_REPLY_SLACK_S = 1.0


class DataParallelEngine(LockstepEngine):
    """The `Engine` API for callers (`LLM`): requests live on their owning rank; reads of the configuration, the
    tokenizer and validation go to rank 0's engine."""

    def __init__(self, engine: Engine, followers: list[Connection], ranks: Sequence[RankProcess] | None = None,
                 stats: RankStats | None = None):
        super().__init__(engine, followers, ranks, stats=stats)
        self.owner: dict[str, int] = {}  # request id -> the rank it runs on, until released
        self._running: dict[str, int] = {}  # the unfinished ones (placement counts them)
        self._unfinished = [False] * (len(followers) + 1)  # each rank's engine has unfinished requests
        self._ids = itertools.count()
        self._reply_s = engine.config.parallel.dist_timeout_s + _REPLY_SLACK_S

    @property
    def size(self) -> int:
        return len(self._unfinished)

    @property
    def rank_loads(self) -> list[int]:
        """Unfinished requests per rank, as rank 0 counts them (placement goes by these)."""
        load = [0] * self.size
        for rank in self._running.values():
            load[rank] += 1
        return load

    @property
    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished or any(self._unfinished[1:])

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
        self._unfinished[rank] = True
        return req_id

    def abort(self, request_id: str) -> bool:
        rank = self.owner.get(request_id)
        if rank is None:
            return False
        self._running.pop(request_id, None)
        if rank == 0:
            return self.engine.abort(request_id)
        if self.failure is not None:  # (that rank is gone or out of step: what it ran is over)
            self._unfinished[rank] = rank in self._running.values()
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
            self._unfinished[0] = self.engine.has_unfinished
            return mine, [self._answer(rank, conn) for rank, conn in enumerate(conns, start=1)]

        result: tuple[Any, list[Any]] = self._guarded(name, run)
        return result

    def _send(self, rank: int, name: str, args: tuple[Any, ...]) -> Connection:
        conn = self._followers[rank - 1]
        conn.send((name, args))
        return conn

    def _answer(self, rank: int, conn: Connection) -> Any:
        proc = self._ranks[rank - 1] if len(self._ranks) >= rank else None
        # (A rank on another machine has no process here: its sentinel is this connection.)
        watched = [conn] + ([proc.sentinel] if proc is not None and proc.sentinel is not conn else [])
        ready = wait_for(watched, timeout=self._reply_s)
        if conn not in ready:
            raise WorkerGroupError(f"rank {rank} " + ("exited" if ready else f"gave no answer within "
                                                      f"{self._reply_s:.0f} s"))
        ok, value, unfinished = conn.recv()
        self._unfinished[rank] = unfinished
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


def serve_rank(engine: Engine, conn: Connection,
               timed: Callable[[Callable[[], Any]], Any] = lambda f: f()) -> None:
    """A follower rank's loop in a DP-attention group: answer rank 0's calls on this rank's engine until told to
    stop or rank 0 is gone. A step ends by joining the other ranks' remaining forwards. A failed call ends the rank
    (after its answer, which names the error): rank 0 checked the call first, and a failed step's collectives may
    have left the group out of step. `timed` records each step (`RankStats.timer`)."""
    for name, args in calls_from(conn, _CALLS):
        try:
            value = timed(lambda: _group_step(engine)) if name == "step" else getattr(engine, name)(*args)
        except Exception as e:
            conn.send((False, f"{type(e).__name__}: {e}", engine.has_unfinished))  # (any exception pickles so)
            raise
        conn.send((True, value, engine.has_unfinished))
