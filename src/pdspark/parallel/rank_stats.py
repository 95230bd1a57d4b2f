"""`RankStats`: every rank's step and collective figures in one shared-memory table that rank 0 reads (its metrics),
with no message and no collective: a stuck rank never blocks the reading, and its figures simply stop growing.

Each rank writes only its own row, after each engine step: the step's seconds (in a histogram), and the collectives
its MoE exchanges made during it (calls, seconds, bytes; the seconds per step in a histogram). The reader may see a
row mid-update (a count one ahead of its sum): fine for metrics, which are read again half a second later. A rank on
another machine writes its row in its own machine's table and sends it to rank 0 after each step (`row`, `set_row`:
`engine/group_nodes.py`), which copies it into this one.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import time
from bisect import bisect_left
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol, TypeVar

# Upper bounds (seconds) of the histograms' buckets, for a step and for its collectives: a decode step of a few
# milliseconds on a CPU up to a long prefill chunk.
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_B = len(BUCKETS) + 1  # (+Inf)
# A row: steps, step seconds, collective calls, collective seconds, collective bytes, then the two histograms.
_STEPS, _STEP_S, _CALLS, _COLL_S, _BYTES, _STEP_HIST = range(6)
_COLL_HIST = _STEP_HIST + _B
_WIDTH = _COLL_HIST + _B
_T = TypeVar("_T")


class ExchangeCounters(Protocol):
    """What a rank's MoE exchange counts (`SlotExchange`, `TokenExchange`)."""

    calls: int
    seconds: float
    bytes: int


class RankFigures(NamedTuple):
    steps: int
    step_seconds: float
    step_buckets: list[int]  # observations per bucket of `BUCKETS` (+Inf last), not cumulative
    collective_calls: int
    collective_seconds: float
    collective_bytes: int
    collective_buckets: list[int]  # a step's collective seconds, per bucket


class RankStats:
    def __init__(self, size: int, shared: Any = None):
        """`shared`: the table another rank created (`RankStats.shared`, passed to a spawned rank); None: a new one."""
        self.size = size
        self.shared = shared if shared is not None else mp.get_context("spawn").RawArray(ctypes.c_double,
                                                                                         size * _WIDTH)

    def timer(self, rank: int, exchange: ExchangeCounters | None) -> Callable[[Callable[[], _T]], _T]:
        """`timed(step)`: run `step()` and record it as rank `rank`'s, with what `exchange` counted meanwhile."""

        def timed(step: Callable[[], _T]) -> _T:
            before = (exchange.calls, exchange.seconds, exchange.bytes) if exchange is not None else (0, 0.0, 0)
            start = time.perf_counter()
            out = step()
            took = time.perf_counter() - start
            after = (exchange.calls, exchange.seconds, exchange.bytes) if exchange is not None else (0, 0.0, 0)
            self.record(rank, took, after[0] - before[0], after[1] - before[1], after[2] - before[2])
            return out

        return timed

    def record(self, rank: int, step_s: float, calls: int, seconds: float, nbytes: int) -> None:
        a, row = self.shared, rank * _WIDTH
        a[row + _STEP_HIST + bisect_left(BUCKETS, step_s)] += 1
        a[row + _COLL_HIST + bisect_left(BUCKETS, seconds)] += 1
        a[row + _STEP_S] += step_s
        a[row + _CALLS] += calls
        a[row + _COLL_S] += seconds
        a[row + _BYTES] += nbytes
        a[row + _STEPS] += 1

    def row(self, rank: int) -> list[float]:
        """Rank `rank`'s row as it stands (what a rank on another machine sends to rank 0)."""
        return list(self.shared[rank * _WIDTH : (rank + 1) * _WIDTH])

    def set_row(self, rank: int, row: list[float]) -> None:
        if len(row) != _WIDTH:
            raise ValueError(f"a figures row of {len(row)} values; allowed: {_WIDTH}")
        self.shared[rank * _WIDTH : (rank + 1) * _WIDTH] = row

    def figures(self, rank: int) -> RankFigures:
        row = list(self.shared[rank * _WIDTH : (rank + 1) * _WIDTH])
        return RankFigures(int(row[_STEPS]), row[_STEP_S], [int(v) for v in row[_STEP_HIST:_COLL_HIST]],
                           int(row[_CALLS]), row[_COLL_S], int(row[_BYTES]), [int(v) for v in row[_COLL_HIST:]])
