"""`DraftBacklog`: committed rows whose DSpark draft context is not written yet (the data; `DSparkDrafter` owns it).

With `speculative_policy="when-faster"` the engine may decode without drafts for long stretches; writing each
step's draft context rows (`DSparkDrafter.inject`: ~45 µs a step, ~10% of a plain decode step of dsv4-tiny) only
to keep them ready would tax the very mode that was chosen for speed. So a decode step without drafts keeps its
committed rows' features here (`DSparkDrafter.keep`: one copy per step), and the drafter writes all kept rows in one
call before its next write (`inject`) or proposal, before a request finishes or is aborted (`flush`: the prefix
cache may keep its pages), or once `MAX_ROWS` are waiting. Written in commit order, the rows end as eager writes
would leave them (nothing else writes draft rows meanwhile). A row kept for pages its request no longer holds (it
was preempted) is dropped: the slot is not its.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdspark.cache.kv_cache import ReqPages
from pdspark.engine.request import Request

MAX_ROWS = 256  # rows kept before they are written anyway (each `features` row is D * captured layers floats)


@dataclass
class _Step:
    features: torch.Tensor  # [B, F] a copy (the step's buffers are reused)
    positions: torch.Tensor  # [B] int64
    slots: torch.Tensor  # [B] int64 SWA slots
    owners: list[tuple[Request, ReqPages | None]]  # per row: (request, the pages it held then)


@dataclass
class DraftBacklog:
    steps: list[_Step] = field(default_factory=list)
    rows: int = 0

    def keep(self, features: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
             owners: list[tuple[Request, ReqPages | None]]) -> None:
        self.steps.append(_Step(features.clone(), positions.clone(), slots.clone(), owners))
        self.rows += len(owners)

    def take(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """`(features [N, F], positions [N], slots [N])` of every kept row whose request still holds the pages it
        was kept for, in commit order; None when there is none. The backlog is empty after."""
        steps, self.steps, self.rows = self.steps, [], 0
        parts = []
        for s in steps:
            live = [i for i, (req, pages) in enumerate(s.owners) if req.pages is pages]
            if len(live) == len(s.owners):
                parts.append((s.features, s.positions, s.slots))
            elif live:
                idx = torch.tensor(live, dtype=torch.long)
                parts.append((s.features[idx], s.positions[idx], s.slots[idx]))
        if not parts:
            return None
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), torch.cat([p[2] for p in parts])
