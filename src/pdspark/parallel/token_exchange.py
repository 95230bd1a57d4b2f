"""`TokenExchange`: DP-attention's MoE exchange. Each rank of the group runs its own requests through attention; at
every MoE layer the ranks' token rows meet (one all-gather of the rows with their expert ids), each rank computes its
experts for every rank's rows, and a reduce-scatter gives each rank the (token, slot) outputs of its own rows.

A forward pass is a collective: it opens with a header (`begin_forward`: every rank's row count, all-gathered), then
each MoE layer makes one exchange (two collectives). A rank whose step has no (more) forwards joins the others' with
zero rows (`finish_step`), so every rank makes the same collectives in the same order whatever its load.

Bits: a rank computes the rows of each source rank apart (`compute` once per source), as that rank's one-process
engine would over its own batch, and each (token, slot) element has one nonzero term in the sum that returns it.
A rank's requests therefore get the bits of one process running that rank's batch with every expert.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol

import torch
import torch.distributed as dist

# (rows [R, D], expert ids [R, k]) -> (token, slot) outputs [R, k, D]: zeros for the experts held elsewhere.
SlotsFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
_DONE = -1  # a header's row count: this rank's step has no more forwards


class ExchangeLayer(Protocol):
    def join_exchange(self) -> None:
        """Take part in this layer's exchange with no rows of its own (a zero-token forward)."""


class TokenExchange:
    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group  # None: the default (world) group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.rows: list[int] | None = None  # every rank's row count in the current forward (None: between them)
        # What the exchanges cost on this rank (as `SlotExchange`'s): collectives, bytes sent and received, seconds.
        self.calls = 0
        self.bytes = 0
        self.seconds = 0.0
        self.forwards = 0  # forwards with rows of this rank
        # The intra-op threads a step of that many rows runs on (the engine's rule, `ModelRunner.threads_for`): a
        # source rank's rows are computed here on the threads its own step uses, so that they get the bits its own
        # process would give them (None: leave the threads as they are).
        self.threads_for: Callable[[int], int] | None = None
        self.idle_forwards = 0  # forwards of other ranks joined with zero rows

    def begin_forward(self, rows: int) -> None:
        """Open a forward pass of `rows` token rows on this rank (every rank's MoE layers then exchange)."""
        if rows < 0:
            raise ValueError(f"a forward of {rows} rows")
        self.rows = [max(r, 0) for r in self._header(rows)]  # (a rank that is done joins with none)
        self.forwards += 1

    def finish_step(self, layers: Sequence[ExchangeLayer]) -> None:
        """This rank's step is over: join the other ranks' remaining forwards with zero rows (through `layers`,
        the model's MoE layers in order) until every rank is done."""
        while True:
            rows = self._header(_DONE)
            if all(r == _DONE for r in rows):
                self.rows = None
                return
            self.rows = [max(r, 0) for r in rows]
            self.idle_forwards += 1
            for layer in layers:
                layer.join_exchange()

    def experts(self, x: torch.Tensor, ids: torch.Tensor, compute: SlotsFn) -> torch.Tensor:
        """This rank's rows `x [T, D]` with their experts `ids [T, k]` -> their (token, slot) outputs `[T, k, D]`,
        every expert's slot filled in; `compute` runs this rank's experts over one source rank's rows."""
        rows = self.rows
        if rows is None or rows[self.rank] != x.shape[0]:
            raise RuntimeError(f"a MoE exchange of {x.shape[0]} rows outside its forward (header: {rows})")
        width = max(rows)
        T, k, D = x.shape[0], ids.shape[1], x.shape[1]
        if width == 0:
            return x.new_zeros(0, k, D)
        # Rows and their expert ids travel in one all-gather: each row `[D]` followed by its ids' int64 bits
        # reinterpreted in the rows' dtype (a copy moves bits, it never converts them).
        packed = torch.cat([x, ids.to(torch.int64).contiguous().view(x.dtype)], dim=1)  # [T, D + k * 8 / element size]
        start = time.perf_counter()
        gathered = torch.empty(self.size * width, packed.shape[1], dtype=x.dtype)
        dist.all_gather_single(gathered, _pad(packed, width), group=self.group)
        self.seconds += time.perf_counter() - start
        slots = torch.zeros(self.size, width, k, D, dtype=x.dtype)
        threads = torch.get_num_threads()  # (this rank's step's, restored for the rest of its forward)
        for q, n in enumerate(rows):
            if n:  # one source rank's rows alone, as its own engine runs them
                part = gathered[q * width : q * width + n]
                if self.threads_for is not None and torch.get_num_threads() != (want := self.threads_for(n)):
                    torch.set_num_threads(want)
                slots[q, :n] = compute(part[:, :D].contiguous(), part[:, D:].contiguous().view(torch.int64))
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        start = time.perf_counter()
        mine = torch.empty(width, k, D, dtype=x.dtype)
        dist.reduce_scatter_single(mine, slots.view(self.size * width, k, D), group=self.group)
        self.seconds += time.perf_counter() - start
        self.calls += 2
        self.bytes += gathered.numel() * gathered.element_size() + slots.numel() * slots.element_size()
        return mine[:T]

    def _header(self, rows: int) -> list[int]:
        out = torch.empty(self.size, dtype=torch.int64)
        start = time.perf_counter()
        dist.all_gather_single(out, torch.tensor([rows], dtype=torch.int64), group=self.group)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        self.bytes += out.numel() * 8
        return [int(r) for r in out.tolist()]


def _pad(t: torch.Tensor, rows: int) -> torch.Tensor:
    """`t [n, ...]` -> `[rows, ...]` (zeros below): the all-gather takes one size from every rank."""
    if t.shape[0] == rows:
        return t.contiguous()
    out = t.new_zeros(rows, *t.shape[1:])
    out[: t.shape[0]] = t
    return out
