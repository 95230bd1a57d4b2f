"""`LockstepEngine`: rank 0 of a replicated worker group, driving the other ranks' engines in lockstep.

Every rank holds a whole `Engine` (attention is not sharded: DSV4's KV is one shared latent) and its share of the
routed experts. An engine is a deterministic function of the calls made on it, so rank 0 sends each call that
changes state (a request added, aborted or released, a step, a cache flush) to the other ranks before making it
itself, and every rank then schedules the same batches, allocates the same pages and runs the same forward passes;
inside them the MoE layers exchange their experts' slots (`pdspark.parallel.slot_exchange`). Logits are the same
bits on every rank, so the ranks sample the same tokens and nothing flows back.

The calls travel over a local pipe per rank, not a collective: an idle group waits without any deadline, and a
group whose rank 0 is gone ends at once (the pipe closes). What must not differ between ranks is chosen on rank 0
and sent: the engine seed (for requests without a seed); step-time policies (`speculative_policy='when-faster'`)
are refused.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for
from typing import Any, Protocol, TypeVar

from pdspark.engine.engine import Engine
from pdspark.engine.rank_service import ServiceChannel
from pdspark.errors import WorkerGroupError
from pdspark.parallel.rank_stats import RankStats
from pdspark.types import RequestOutput, SamplingParams

# The calls a follower may be asked to make, by name: the engine's state-changing API.
_CALLS = frozenset({"add_request", "abort", "release", "release_held", "flush_cache", "step"})
STOP = "stop"  # the message that ends a follower's loop
PING = "ping"  # the message a follower answers at once (`PONG`): is it there, between steps?
PONG = "pong"
# State changes of the engine API a group does not send yet: refused, not made on rank 0 alone.
_NOT_MIRRORED = frozenset({"adopt", "reserve_transfer", "cancel_transfer"})
_T = TypeVar("_T")


# A rank killed as the group fails closes its sockets (whose error fails the call here) and its pipe in the same exit,
# and its exit status can be read microseconds later, once it is a zombie. A failure's message waits at most this long
# for the ranks whose process is already going away, so that it says "exited (-9)" and not "running" (which the
# SIGKILL test saw once on a busy 2-core VM). A rank that is alive, even stopped, costs this once: in a failed
# group's message, never in a step.
EXITING_RANK_WAIT_S = 0.1


class RankProcess(Protocol):
    """Another rank as rank 0 sees it: a local process (`multiprocessing`'s), or a rank on another machine
    (`group_nodes.RemoteRank`)."""

    @property
    def pid(self) -> int | None: ...

    @property
    def exitcode(self) -> int | None: ...

    @property
    def sentinel(self) -> Any: ...

    def kill(self) -> None: ...


class LockstepEngine:
    """Rank 0's engine: the `Engine` API (reads go to the local engine; state changes to every rank). Once a call
    fails (a rank died, a collective failed or timed out) the group is over: every later call that would need the
    other ranks raises `WorkerGroupError`; aborts and releases still tidy rank 0's own engine."""

    def __init__(self, engine: Engine, followers: list[Connection], ranks: Sequence[RankProcess] | None = None,
                 close: Callable[[], None] = lambda: None, stats: RankStats | None = None):
        self.engine = engine
        self._followers = followers
        self._ranks = list(ranks or [])  # the other ranks' processes (rank r at index r - 1), for error messages
        self._close = close  # ends the group once the followers are told to stop (joins them, leaves the group)
        self.failure: WorkerGroupError | None = None
        # Every rank's step and collective figures (rank 0 records its own here; the metrics read them all).
        self.rank_stats = stats if stats is not None else RankStats(len(followers) + 1)
        self._timed = self.rank_stats.timer(0, engine.runner.model.expert_exchange)
        # Channels to a service each other rank runs beside its engine (`start_engine_group(rank_service=...)`).
        self.rank_services: list[ServiceChannel] = []

    @property
    def rank_pids(self) -> list[int | None]:
        """The process ids of ranks 1.. (rank 0 is this process)."""
        return [p.pid for p in self._ranks]

    def rank_states(self) -> list[str]:
        """Each rank's state, rank 0 first: "running", "failed" (rank 0 once a call failed), "exited (code)"."""
        return ["failed" if self.failure is not None else "running"] + [
            "running" if p.exitcode is None else f"exited ({p.exitcode})" for p in self._ranks]

    def watch(self, on_lost: Callable[[str], None]) -> None:
        """Call `on_lost(states)` from a daemon thread as soon as another rank exits before `close` (a serving
        group fails as a unit: its rank 0 then exits too, so the supervisor restarts the whole group)."""

        def wait() -> None:
            wait_for([p.sentinel for p in self._ranks])
            if self._followers:  # (not closed on purpose)
                on_lost(self._states())

        if self._ranks:
            threading.Thread(target=wait, name="rank-watch", daemon=True).start()

    def close(self) -> None:
        """Stop the other ranks and leave the group (idempotent). A failed group's ranks are killed: a hung one
        would not hear the stop."""
        self._followers = []
        if self.failure is not None:
            for p in self._ranks:
                if p.exitcode is None:
                    p.kill()
        self._close()

    def __getattr__(self, name: str) -> Any:  # reads: config, tokenizer, requests, output, validate, ...
        if name in _NOT_MIRRORED:
            raise NotImplementedError(f"`{name}` on a worker group (the decode side's transfers are not mirrored to "
                                      "the other ranks yet)")
        return getattr(self.engine, name)

    @property
    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished

    def ping(self) -> None:
        """Check, between steps, that every other rank answers (a rank hung while the group is idle would
        otherwise be noticed only by the next step's collective). Raises `WorkerGroupError` (and the group has
        failed) when one does not answer within `dist_timeout_s` (the patience of a collective: an answer takes
        a pipe round trip) or has exited."""
        self._check()
        timeout_s = self.engine.config.parallel.dist_timeout_s

        def ask() -> None:
            for conn in self._followers:
                conn.send((PING, ()))
            for rank, conn in enumerate(self._followers, start=1):
                self._await_answer(rank, conn, timeout_s)
                if conn.recv() != PONG:
                    raise WorkerGroupError(f"rank {rank} answered a ping out of step")

        try:
            ask()
        except Exception as e:
            self.failure = WorkerGroupError(f"the worker group failed a liveness check ({self._states()}): {e}")
            raise self.failure from e

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                    prompt: str | None = None, hold_pages: bool = False) -> str:
        self._check()
        # Locally first: a refused request (bad input, a duplicate id) never reaches the other ranks.
        req_id = self.engine.add_request(prompt_token_ids, params, request_id, prompt, hold_pages)
        self._together(lambda: None, "add_request", prompt_token_ids, params, req_id, prompt, hold_pages)
        return req_id

    def abort(self, request_id: str) -> bool:
        if self.failure is None:
            self._together(lambda: None, "abort", request_id)
        return self.engine.abort(request_id)

    def release(self, request_id: str) -> None:
        if self.failure is None:
            self._together(lambda: None, "release", request_id)
        self.engine.release(request_id)

    def release_held(self, request_id: str) -> None:
        self._check()
        self._together(lambda: self.engine.release_held(request_id), "release_held", request_id)

    def flush_cache(self) -> None:
        self._check()
        self._together(self.engine.flush_cache, "flush_cache")

    def step(self) -> list[RequestOutput]:
        self._check()
        return self._together(lambda: self._timed(self.engine.step), "step")

    def _together(self, local: Callable[[], _T], name: str, *args: Any) -> _T:
        """Send the call to every other rank, then make it here; any failure ends the group."""
        try:
            for conn in self._followers:
                conn.send((name, args))
            return local()
        except Exception as e:
            # Whatever failed, the ranks may now hold different states: the group cannot go on.
            cause = f" (from {type(e.__cause__).__name__}: {e.__cause__})" if e.__cause__ is not None else ""
            self.failure = WorkerGroupError(f"the worker group failed in `{name}` ({self._states()}): "
                                            f"{type(e).__name__}: {e}{cause}")
            raise self.failure from e

    def _await_answer(self, rank: int, conn: Connection, timeout_s: float) -> None:
        """Wait (at most `timeout_s`) until rank `rank`'s answer can be read from `conn`; raises
        `WorkerGroupError` once the rank has exited (its process, or a remote rank's sentinel) or at the deadline."""
        proc = self._ranks[rank - 1] if len(self._ranks) >= rank else None
        ready = wait_for([conn] + ([proc.sentinel] if proc is not None else []), timeout=timeout_s)
        if conn not in ready:
            raise WorkerGroupError(f"rank {rank} " + ("exited" if ready else
                                                      f"did not answer within {timeout_s:.0f} s"))

    def _states(self) -> str:
        """The other ranks' states, for messages (ranks already going away are given `EXITING_RANK_WAIT_S` to be
        reaped first: see there)."""
        running = [p.sentinel for p in self._ranks if p.exitcode is None]
        exiting = wait_for(running, timeout=EXITING_RANK_WAIT_S) if running else []
        deadline = time.monotonic() + EXITING_RANK_WAIT_S
        for p in self._ranks:
            # (the exit status appears microseconds after the sentinel: polled, not waited on, within the bound)
            while p.sentinel in exiting and p.exitcode is None and time.monotonic() < deadline:
                time.sleep(0.001)
        return ", ".join(f"rank {r}: {state}" for r, state in enumerate(self.rank_states()[1:], start=1)) or \
            "rank 0 only"

    def _check(self) -> None:
        if self.failure is not None:
            raise WorkerGroupError(f"this worker group has failed ({self.failure}); start a new one")


def calls_from(conn: Connection, allowed: frozenset[str]) -> Iterator[tuple[str, tuple[Any, ...]]]:
    """Rank 0's calls on a follower rank's channel, until it says stop or is gone (it exited: the group is over)."""
    while True:
        try:
            name, args = conn.recv()
        except EOFError:
            return
        if name == STOP:
            return
        if name == PING:
            conn.send(PONG)
            continue
        if name not in allowed:
            raise ValueError(f"a follower rank was asked to call {name!r}; allowed: {sorted(allowed)}")
        yield name, args


def follow(engine: Engine, conn: Connection, timed: Callable[[Callable[[], Any]], Any] = lambda f: f()) -> None:
    """A follower rank's loop: make rank 0's calls on this rank's engine until told to stop or rank 0 is gone
    (`timed` records each step: `RankStats.timer`)."""
    for name, args in calls_from(conn, _CALLS):
        if name == "step":
            timed(engine.step)
        else:
            getattr(engine, name)(*args)
