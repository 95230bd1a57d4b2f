"""`ExplicitStateTable`: the compressor-state block table of the Atlas A3 compressor ABI (`cache_mode=2`).

The A3 `npu.compressor` kernel reads a request's compressor state through an explicit int32 table `[bs, width]` of
state-pool rows, one column per absolute position (SGLang `_build_explicit_state_block_table`):
- `width = coff * ratio + capacity`: `coff * ratio` history columns (C4: 2 x 4 = 8, the previous group's overlap
  and the open group; C128: 128) followed by `capacity` current-input columns (the longest input of the step);
- column `c` of row `i` is position `p = start_i - history + c`;
- a cell is valid when the row has inputs, `c < history + inputs_i` and `p >= 0`; every other cell is the pool's dummy
  row, a positive index (the kernel reads offsets unsigned, and row 0 is a real row) whose state is empty.
Positions are clamped into the request table before the lookup, so masked cells index safely and are then replaced.

The rows come from pdspark's own state pools through `StateRings`: C4 (CSA) state is page-scoped (the position's SWA
page's ring, row `p % csa_ring`), C128 (HCA) state request-scoped (`slot * hca_ring + p % hca_ring`). `KVPools` keeps
both fp32, as the A3 kernel requires.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from numpy.typing import ArrayLike

from pdspark.cache.kv_cache import HostTables
from pdspark.cache.state_rings import StateRings

C4_RATIO, C128_RATIO = 4, 128  # the compress ratios the A3 kernel supports (CSA overlaps: coff 2; HCA: coff 1)


@dataclass(frozen=True)
class StateTableInputs:
    """One step's rows: which request, where its inputs start, how many there are."""

    slots: np.ndarray  # [bs] request slot (row of `req_to_token`)
    start: np.ndarray  # [bs] position of the first current-input column
    inputs: np.ndarray  # [bs] current-input columns in use (0: a padded row, all dummy)
    capacity: int  # current-input columns of the table (max_input_capacity)

    @classmethod
    def decode(cls, slots: ArrayLike, seq_lens: ArrayLike) -> StateTableInputs:
        """One new token per request at `seq_len - 1` (a padded row has `seq_len` 0)."""
        seq_lens = np.asarray(seq_lens, dtype=np.int64)
        return cls(np.asarray(slots, dtype=np.int64), seq_lens - 1, (seq_lens > 0).astype(np.int64), 1)

    @classmethod
    def verify(cls, slots: ArrayLike, seq_lens: ArrayLike, num_drafts: int) -> StateTableInputs:
        """A verify window of `num_drafts` rows after the committed `seq_lens`."""
        seq_lens = np.asarray(seq_lens, dtype=np.int64)
        return cls(np.asarray(slots, dtype=np.int64), seq_lens, np.full_like(seq_lens, num_drafts),
                   max(1, num_drafts))

    @classmethod
    def prefill(cls, slots: ArrayLike, prefix_lens: ArrayLike, chunk_lens: ArrayLike) -> StateTableInputs:
        """Prompt chunks of `chunk_lens` tokens after cached prefixes of `prefix_lens`."""
        chunks = np.asarray(chunk_lens, dtype=np.int64)
        return cls(np.asarray(slots, dtype=np.int64), np.asarray(prefix_lens, dtype=np.int64), chunks,
                   int(chunks.max(initial=0)))


class ExplicitStateTable:
    """Builds the table of one compressor kind (`ratio` 4 or 128) over the state pools `rings` addresses."""

    def __init__(self, rings: StateRings, ratio: int):
        if ratio not in (C4_RATIO, C128_RATIO):
            raise ValueError(f"the A3 compressor ABI supports compress ratios 4 and 128, not {ratio}")
        self.rings = rings
        self.ratio = ratio
        self.history = (2 if ratio == C4_RATIO else 1) * ratio  # coff * ratio
        pools = rings.pools
        self.dummy = pools.c4_state_dummy_row if ratio == C4_RATIO else pools.c128_state_dummy_row
        assert self.dummy > 0, "the dummy state row must be a positive index (the kernel reads offsets unsigned)"

    def width(self, capacity: int) -> int:
        return self.history + capacity

    def build(self, inputs: StateTableInputs, tables: HostTables) -> torch.Tensor:
        """The int32 table `[bs, history + capacity]` of state-pool rows (dummy where invalid)."""
        bs, width = len(inputs.slots), self.width(inputs.capacity)
        col = np.arange(width)[None, :]  # [1, width]
        pos = inputs.start[:, None] - self.history + col  # [bs, width] absolute positions
        valid = (inputs.inputs[:, None] > 0) & (col < self.history + inputs.inputs[:, None]) & (pos >= 0)
        # Clamp before any lookup: masked cells are indexed too, then replaced by the dummy row.
        pos = np.clip(pos, 0, tables.req_to_token.shape[1] - 1)
        slots = np.broadcast_to(inputs.slots[:, None], (bs, width))
        if self.ratio == C4_RATIO:
            full = tables.req_to_token[slots, pos]
            rows = self.rings.c4_rows(full, pos, tables.full_to_swa_page)
        else:
            rows = self.rings.c128_rows(slots, pos)
        return torch.from_numpy(np.where(valid, rows, self.dummy).astype(np.int32))
