"""`StateRings`: where the compressor states of a position live in `KVPools`' state pools.

- C4 (CSA) state is page-scoped: each SWA page has a ring of `csa_ring` rows, row `pos % csa_ring`, so the state
  follows the SWA page (into the prefix tree, across a transfer) and goes when the page is released.
- C128 (HCA) state is request-scoped: each request slot has a ring of `hca_ring` rows, row `pos % hca_ring`.
Invalid positions map to each pool's dummy row (a positive index, `kv = 0, score = -inf`), never past the pool.
"""

from __future__ import annotations

import numpy as np
import torch

from pdspark.cache.kv_pools import KVPools
from pdspark.cache.pool_sizes import PoolSizes


class StateRings:
    def __init__(self, sizes: PoolSizes, pools: KVPools):
        self.page_size = sizes.page_size
        self.csa_ring = sizes.csa_ring
        self.hca_ring = sizes.hca_ring
        self.pools = pools

    def c4_rows(self, full_slots, positions, page_map):
        """C4 state row of each position: its SWA page's ring (`page_map`: full page -> SWA page, a tensor or a
        NumPy array like the other arguments). A position whose SWA page was released maps to the dummy row."""
        page = page_map[full_slots // self.page_size]
        rows = page * self.csa_ring + positions % self.csa_ring
        # The dummy SWA page has no ring, only the pool's one dummy row.
        released = page == self.pools.swa_dummy_page
        where = np.where if isinstance(rows, np.ndarray) else torch.where
        return where(released, self.pools.c4_state_dummy_row, rows)

    def c128_rows(self, slots, positions):
        """C128 state row of each position of the request in `slots` (tensors or NumPy arrays)."""
        return slots * self.hca_ring + positions % self.hca_ring

    def clear_request(self, slot: int) -> None:
        """A fresh request's C128 ring starts empty (the previous holder of the slot left its rows)."""
        self.pools.clear_c128_state_rows(torch.arange(slot * self.hca_ring, (slot + 1) * self.hca_ring))
