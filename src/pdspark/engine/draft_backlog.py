"""`DraftBacklog`: one request's committed rows whose DSpark draft context is not written yet.

With `speculative_policy="when-faster"` the engine may decode without drafts for long stretches; writing each
step's draft context rows (`DSparkDrafter.inject`: ~45 µs a step, ~10% of a plain decode step of dsv4-tiny) only
to keep them ready would tax the very mode that was chosen for speed. So a decode step without drafts keeps its
committed rows' features here, and they are written in one call when the request is next drafted for, before its
pages leave it (a finish, an abort: the prefix cache may keep them), or once `MAX_ROWS` are waiting. Written in
commit order, the rows end as eager writes would leave them (nothing else writes a request's draft rows meanwhile).
Rows kept under pages the request no longer holds (it was preempted) are dropped: those slots are not its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

MAX_ROWS = 256  # rows a request may keep (each `features` row is D * captured layers floats)


@dataclass
class DraftBacklog:
    pages: object  # the request's `ReqPages` when the rows were kept
    features: list[torch.Tensor] = field(default_factory=list)  # [n_i, F] copies (the step's buffers are reused)
    positions: list[torch.Tensor] = field(default_factory=list)  # [n_i] int64
    slots: list[torch.Tensor] = field(default_factory=list)  # [n_i] int64 SWA slots
    rows: int = 0

    def keep(self, features: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        self.features.append(features.clone())
        self.positions.append(positions.clone())
        self.slots.append(slots.clone())
        self.rows += features.shape[0]

    def rows_to_write(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(features [N, F], positions [N], slots [N])` in commit order."""
        return torch.cat(self.features), torch.cat(self.positions), torch.cat(self.slots)
