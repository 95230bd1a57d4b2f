"""`DraftBacklog`: committed rows whose DSpark draft context is not written yet (the data; `DSparkDrafter` owns it).

With `speculative_policy="when-faster"` the engine may decode without drafts for long stretches; writing each
step's draft context rows (`DSparkDrafter.inject`: ~45 µs a step, ~10% of a plain decode step of dsv4-tiny) only
to keep them ready would tax the very mode that was chosen for speed. So a decode step without drafts keeps its
committed rows' features here (`DSparkDrafter.keep`: one copy per step), and the drafter writes all kept rows in one
call before its next write (`inject`) or proposal, before a request finishes or is aborted (`flush`: a finished
request's pages may be shipped), before the engine reserves pages for a transfer, or once `MAX_ROWS` are waiting.

Every kept row is written, to the SWA slot it was computed for, in commit order: the pool ends as eager writes
would leave it. That holds even where the row's page has left its request since (a preemption or finish hands it to
the prefix cache, which must hold the row as an eager write left it; a window slide or a cache hit frees it):
every other writer of draft rows comes after the kept rows (the drafter's own writes, or a transfer into pages
reserved after a flush), and every reader after a flush.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

MAX_ROWS = 256  # rows kept before they are written anyway (each `features` row is D * captured layers floats)


@dataclass
class _Step:
    features: torch.Tensor  # [B, F] a copy (the step's buffers are reused)
    positions: torch.Tensor  # [B] int64
    slots: torch.Tensor  # [B] int64 SWA slots


@dataclass
class DraftBacklog:
    steps: list[_Step] = field(default_factory=list)
    rows: int = 0

    def keep(self, features: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        self.steps.append(_Step(features.clone(), positions.clone(), slots.clone()))
        self.rows += features.shape[0]

    def take(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """`(features [N, F], positions [N], slots [N])` of every kept row, in commit order; None when there is
        none. The backlog is empty after."""
        steps, self.steps, self.rows = self.steps, [], 0
        if not steps:
            return None
        return (torch.cat([s.features for s in steps]), torch.cat([s.positions for s in steps]),
                torch.cat([s.slots for s in steps]))
