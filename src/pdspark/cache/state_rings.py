"""`StateRings`: where the compressor states of a position live in `KVPools`' state pools.

- C4 (CSA) state is page-scoped: each SWA page has a ring of `csa_ring` rows, row `pos % csa_ring`, so the state
  follows the SWA page (into the prefix tree, across a transfer) and goes when the page is released.
- C128 (HCA) state is request-scoped: each request slot has a ring of `hca_ring` rows, row `pos % hca_ring`.
Invalid positions map to each pool's dummy row (a positive index, `kv = 0, score = -inf`), never past the pool.
"""

from __future__ import annotations

import numpy as np
import torch

from pdspark.cache.index_arrays import Indices
from pdspark.cache.kv_pools import KVPools
from pdspark.cache.pool_sizes import PoolSizes


class StateRings:
    def __init__(self, sizes: PoolSizes, pools: KVPools):
        self.page_size = sizes.page_size
        self.csa_ring = sizes.csa_ring
        self.hca_ring = sizes.hca_ring
        self.pools = pools

    def c4_rows(self, full_slots: Indices, positions: Indices, page_map: Indices) -> Indices:
        """C4 state row of each position: its SWA page's ring (`page_map`: full page -> SWA page, a tensor or a
        NumPy array like the other arguments). A position whose SWA page was released maps to the dummy row."""
        page = page_map[full_slots // self.page_size]
        rows: Indices = page * self.csa_ring + positions % self.csa_ring
        # The dummy SWA page has no ring, only the pool's one dummy row.
        released = page == self.pools.swa_dummy_page
        if isinstance(rows, np.ndarray):
            return np.where(released, self.pools.c4_state_dummy_row, rows)
        return torch.where(released, self.pools.c4_state_dummy_row, rows)

    def c128_rows(self, slots: Indices, positions: Indices) -> Indices:
        """C128 state row of each position of the request in `slots` (tensors or NumPy arrays)."""
        rows: Indices = slots * self.hca_ring + positions % self.hca_ring
        return rows

    def clear_request(self, slot: int) -> None:
        """A fresh request's C128 ring starts empty (the previous holder of the slot left its rows)."""
        self.pools.clear_c128_state_rows(torch.arange(slot * self.hca_ring, (slot + 1) * self.hca_ring))
