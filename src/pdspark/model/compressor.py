"""`Compressor`: DSV4's gated pooling of `ratio` tokens into one compressed KV entry.

Per token the compressor projects `kv` and a gate `score = wgate(x) + ape[pos % ratio]`, both `[coff * dim]`. A
closing group pools its source rows with a per-channel softmax over the rows:
- no overlap (HCA, coff 1): the group's own `ratio` rows;
- overlap (CSA, coff 2): the previous group's rows through channels `[:dim]` and its own through `[dim:]`
  (`2 * ratio` rows; the previous group of group 0 is the empty dummy row).
The pooled entry is RMS-normalised and rotated at the group's first position.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from pdspark.hardware.cpu import kernels as cpu_kernels
from pdspark.model.batch import CompressPlan
from pdspark.model.blocked_rows import BlockedRows
from pdspark.model.norm import RMSNorm
from pdspark.model.rope import RotaryTable


class Compressor(nn.Module):
    def __init__(self, hidden: int, dim: int, ratio: int, overlap: bool, eps: float, rope: RotaryTable):
        super().__init__()
        coff = 2 if overlap else 1
        self.dim, self.ratio, self.overlap = dim, ratio, overlap
        self.width = coff * dim
        # wkv rows then wgate rows: one matmul projects both.
        self.wkv_gate = nn.Parameter(torch.zeros(2 * self.width, hidden))
        self.ape = nn.Parameter(torch.zeros(ratio, self.width))  # learned position bias per slot in the group
        self.norm = RMSNorm(dim, eps)
        self.rope = rope

    def state_rows(self, projected: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """`projected = x @ wkv_gate.T [T, 2w]` -> state rows `[T, 2w]` fp32: `[kv | score]` (score with ape)."""
        rows = projected.float()  # a fresh (or fused-and-split) projection: safe to update in place
        rows[:, self.width :] += self.ape[positions % self.ratio]
        return rows

    def compress(self, rows: torch.Tensor, plan: CompressPlan, state: torch.Tensor) -> torch.Tensor:
        """Pool every group closing this step. `rows [T, 2w]`, `state [rows, 2w]` -> entries `[G, dim]`."""
        src = torch.where(plan.use_cur[..., None], rows[plan.cur_rows], state[plan.hist_rows])  # [G, span, 2w]
        kv, score = src[..., : self.width], src[..., self.width :]
        if self.overlap:
            R, d = self.ratio, self.dim
            kv = torch.cat([kv[:, :R, :d], kv[:, R:, d:]], dim=1)  # [G, 2R, d]
            score = torch.cat([score[:, :R, :d], score[:, R:, d:]], dim=1)
        pooled = (kv * score.softmax(dim=1)).sum(dim=1)  # [G, d]
        pooled = self.norm(pooled.to(self.wkv_gate.dtype))
        return self.rope.apply(pooled, plan.positions)

    @staticmethod
    def store(rows: torch.Tensor, plan: CompressPlan, state: torch.Tensor) -> None:
        """Persist the rows later groups will read (call after `compress`: writes may reuse ring rows)."""
        if plan.write_tokens.numel():
            state[plan.write_rows] = rows[plan.write_tokens]

    def _run_in_c(self, projected: torch.Tensor, positions: torch.Tensor, plan: CompressPlan, state: torch.Tensor,
                  pool: torch.Tensor) -> bool:
        """The same steps as one C call (fp32 CPU weights and pools, index tensors on the CPU)."""
        if positions.device.type != "cpu":
            return False
        table = self.rope.cos
        if table.device.type != "cpu":
            return False
        if isinstance(pool, BlockedRows):  # (its rows are not rows of floats: written through a staging matrix)
            staged = torch.empty(plan.num_groups, self.dim)
            local = replace(plan, out_rows=torch.arange(plan.num_groups))
            if not cpu_kernels.compressor_run(projected, positions, self.ape, self.ratio, self.dim, self.overlap,
                                              local, self.norm.weight, self.norm.eps, table, self.rope.sin, state,
                                              staged):
                return False
            if plan.num_groups:
                pool[plan.out_rows] = staged
            return True
        return cpu_kernels.compressor_run(projected, positions, self.ape, self.ratio, self.dim, self.overlap, plan,
                                          self.norm.weight, self.norm.eps, table, self.rope.sin, state, pool)

    def run(self, projected: torch.Tensor, positions: torch.Tensor, plan: CompressPlan, state: torch.Tensor,
            pool: torch.Tensor) -> None:
        """From the layer input's projection `x @ wkv_gate.T`: pool closing groups into `pool`, update `state`."""
        if not torch.is_grad_enabled() and self._run_in_c(projected, positions, plan, state, pool):
            return
        rows = self.state_rows(projected, positions)
        if plan.num_groups:
            entries = self.compress(rows, plan, state)
            # (an FP8 cache's `PackedRows` encodes fp32 rows itself: its dtype is its storage's)
            pool[plan.out_rows] = entries.to(pool.dtype) if pool.dtype.is_floating_point else entries
        self.store(rows, plan, state)
