"""`BlockedRows`: one layer's view of the indexer's key pool of a float cache, kept in blocks of rows.

The lightning indexer scores a decode token against every compressed entry of its request (O(context) by design),
and its C kernel computes eight entries' scores at once, one vector lane each, every lane summing its own entry's
channels in order. Over row-major keys it must first transpose each group of 8 rows to put an entry per lane: at
long context that transposition cost as much as reading the keys (v4-shape's 64k decode step: 22% of its samples
in `transpose8`, 6% in the scores). Here the rows are stored as the kernel reads them: blocks of `ROW_BLOCK` rows,
channel-major within a block (`[blocks, dim, ROW_BLOCK]`: row r's channel d at `blocks[r // 8, d, r % 8]`), so 8
entries whose rows fill a block in order (a page's entries do: pages hold whole blocks) are read in place, with the
same products and sums, so the same scores and picks (`hardware/cpu/ops.c`, `index_scores_from`).

The attention and compressor code index it as a float pool `[R, dim]`: `index_select(0, rows)` (what
`batch.gather_rows` calls) and `pool[rows]` gather rows, `pool[rows] = values` scatters them. A block of every layer
is one contiguous span of the page-major storage (`cache/kv_pools.py`), as a row of every layer is in the row
layout, so a page's bytes are one span either way: transfers and the prefix cache, which move whole pages, are
unchanged.
"""

from __future__ import annotations

import torch

from pdspark.hardware.cpu.kernel_abi import ROW_BLOCK


class BlockedRows:
    def __init__(self, blocks: torch.Tensor):
        """`blocks [B, dim, ROW_BLOCK]`: a per-layer view of the page-major storage (blocks are strided: the other
        layers' blocks lie between)."""
        assert blocks.dim() == 3 and blocks.shape[2] == ROW_BLOCK and blocks.stride(2) == 1, (
            blocks.shape, blocks.stride())
        self.blocks = blocks

    @property
    def shape(self) -> torch.Size:
        return torch.Size([self.blocks.shape[0] * ROW_BLOCK, self.blocks.shape[1]])

    @property
    def dtype(self) -> torch.dtype:
        return self.blocks.dtype

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    @property
    def is_cpu(self) -> bool:
        return self.blocks.is_cpu

    def dim(self) -> int:
        return 2

    def block_stride(self) -> int:
        """Elements from one block to the next (what the C kernels take as the pool's stride)."""
        return self.blocks.stride(0)

    def data_ptr(self) -> int:
        return self.blocks.data_ptr()

    def index_select(self, axis: int, rows: torch.Tensor) -> torch.Tensor:
        """Rows `rows [n]` -> `[n, dim]`."""
        assert axis == 0
        return self[rows]

    def __getitem__(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows of any shape -> `[*rows.shape, dim]` (the two indices around the channel slice put their dimensions
        first)."""
        return self.blocks[rows // ROW_BLOCK, :, rows % ROW_BLOCK]

    def __setitem__(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        """`values [n, dim]` into rows `rows [n]`."""
        self.blocks[rows // ROW_BLOCK, :, rows % ROW_BLOCK] = values.to(self.blocks.dtype)


def blocks_fit(rows_per_page: int) -> bool:
    """Whether a pool whose pages hold `rows_per_page` rows can keep them in blocks: every page whole blocks (a
    transfer or the prefix cache moves a page's span of bytes, which must then be its rows and nothing else)."""
    return rows_per_page % ROW_BLOCK == 0
