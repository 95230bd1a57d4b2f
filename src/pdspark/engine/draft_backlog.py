"""`DraftBacklog`: committed rows whose DSpark draft context is not written yet (the data; `DSparkDrafter` owns it).

With `speculative_policy="when-faster"` the engine may decode without drafts for long stretches; writing each
step's draft context rows (`DSparkDrafter.inject`: the draft's context projection, ~7 µs a row on a Zen 4 core,
~10% of a plain decode step of dsv4-tiny with the rest of the upkeep) only to keep them ready would tax the very
mode that was chosen for speed. So a decode step without drafts keeps its committed rows' features here
(`DSparkDrafter.keep`: a copy into buffers made once), and the drafter writes all kept rows in one call before its
next write (`inject`) or proposal, before a finished or aborted request's pages go to the prefix cache or a
transfer (`flush`), before the engine reserves pages for a transfer, or once the buffers are full (`capacity`).
A finished request whose pages are freed (no prefix cache, nothing shipped) has its kept rows dropped instead
(`forget`): nothing reads them, and a plain decode then costs no draft arithmetic at all.

Every kept row still held is written, to the SWA slot it was computed for, in commit order: the pool ends as eager
writes would leave it, except in the pages of a forgotten request (free pages, written by their next owner before
it reads them). That holds even where the row's page has left its request since (a preemption or finish hands it
to the prefix cache, which must hold the row as an eager write left it; a window slide or a cache hit frees it):
every other writer of draft rows comes after the kept rows (the drafter's own writes, or a transfer into pages
reserved after a flush), and every reader after a flush.
"""

from __future__ import annotations

import numpy as np
import torch

MAX_ROWS = 4096  # rows kept at most before they are written anyway
MAX_BYTES = 16 << 20  # and at most this many bytes of features (V4-Flash: 3 x 4,096 floats a row, 341 rows)


def capacity(row_floats: int) -> int:
    """Rows a backlog of `row_floats`-float feature rows holds (at least one step of 256 requests, whatever the
    bytes: a step's rows are kept together)."""
    return max(256, min(MAX_ROWS, MAX_BYTES // (4 * row_floats)))


class DraftBacklog:
    """Kept rows in numpy buffers made at the first `keep` (features `[capacity, F]` fp32, positions and SWA slots
    `[capacity]` int64, and each row's request slot, -1 once forgotten), filled from the front; `take` empties them.
    Numpy, not torch: `keep` costs ~3.7 µs where three torch clones cost ~7.5 (measured alone, warm; a plain step of
    dsv4-tiny is ~450 µs)."""

    def __init__(self) -> None:
        self.rows = 0
        self._width = 0  # F of the buffers (0: none made yet)
        self._features = np.empty((0, 0), dtype=np.float32)
        self._positions = np.empty(0, dtype=np.int64)
        self._slots = np.empty(0, dtype=np.int64)
        self._owners = np.empty(0, dtype=np.int64)
        self._forgotten = 0

    def room(self, n: int, width: int) -> bool:
        """Whether `n` more rows of `width` floats fit (False: `take` them first, or write them at once)."""
        if width != self._width:
            if self.rows:
                return False
            size = capacity(width)
            self._features = np.empty((size, width), dtype=np.float32)
            self._positions = np.empty(size, dtype=np.int64)
            self._slots = np.empty(size, dtype=np.int64)
            self._owners = np.empty(size, dtype=np.int64)
            self._width = width
        return self.rows + n <= self._features.shape[0]

    def keep(self, features: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, n: int,
             owners: list[int]) -> None:
        """Copy the first `n` rows of `features [>=n, F]` fp32, `positions` and `slots` (int64; a step's reused
        buffers) and the rows' request slots `owners`; `room(n, F)` must have said yes."""
        at = self.rows
        self._features[at : at + n] = features.numpy()[:n]
        self._positions[at : at + n] = positions.numpy()[:n]
        self._slots[at : at + n] = slots.numpy()[:n]
        self._owners[at : at + n] = owners
        self.rows = at + n

    def forget(self, owner: int) -> None:
        """Drop the kept rows of request slot `owner` (its pages are being freed: nothing will read them)."""
        if self.rows:
            owners = self._owners[: self.rows]
            mine = owners == owner
            if mine.any():
                owners[mine] = -1
                self._forgotten += int(mine.sum())
                if self._forgotten == self.rows:
                    self.rows = self._forgotten = 0

    def take(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """`(features [N, F], positions [N], slots [N])` of every kept row not forgotten, in commit order (views of
        the buffers, valid until the next `keep`); None when there is none. The backlog is empty after."""
        rows, forgotten = self.rows, self._forgotten
        self.rows = self._forgotten = 0
        if rows == forgotten:
            return None
        if forgotten:
            held = np.flatnonzero(self._owners[:rows] >= 0)
            return (torch.from_numpy(self._features[held]), torch.from_numpy(self._positions[held]),
                    torch.from_numpy(self._slots[held]))
        return (torch.from_numpy(self._features[:rows]), torch.from_numpy(self._positions[:rows]),
                torch.from_numpy(self._slots[:rows]))
