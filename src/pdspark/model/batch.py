"""What the DSV4 layers read in one step: the flattened batch with its gather indices, and one layer's cache views.

The engine builds a `ForwardBatch` (`engine/forward_batch.py`) from its page tables; the cache owns the tensors behind
`LayerCache`. Both live here, below the engine and the cache, so that the model imports neither.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from pdspark.hardware.prepare_streams import PrepareStreams


@dataclass(frozen=True)
class WindowIndex:
    rows: torch.Tensor  # [T, W] SWA slots of positions pos-W+1 .. pos (oldest first; dummy slot where invalid)
    valid: torch.Tensor  # [T, W] bool


@dataclass(frozen=True)
class CompressedIndex:
    """The compressed entries each query may attend to: every visible one, or (CSA decode/verify tokens, after the
    indexer's pick: `model.indexer.picked_entries`) only the picked ones, in entry order either way."""

    rows: torch.Tensor  # [T, V] pool rows of compressed entries g = 0 .. V-1 (dummy row where g >= visible)
    valid: torch.Tensor  # [T, V] bool: the query attends to entry g (visible, and for CSA picked by the indexer)
    max_visible: int  # V (after a pick: index_topk)
    picked: bool = False  # each query's own picked entries (rows differ per query), not the request's visible ones


@dataclass(frozen=True)
class Segment:
    """A long chunk of one request (prefill): its queries share one union of window rows."""

    offset: int  # first token row in the batch
    length: int
    start: int  # first position
    window_rows: torch.Tensor  # [length + W - 1] SWA rows of positions start-W+1 .. start+length-1 (dummy if < 0)
    band: torch.Tensor  # [length, length + W - 1] bool: query i sees union row u iff i <= u <= i + W - 1, pos >= 0


@dataclass(frozen=True)
class CompressPlan:
    """The explicit state block table of one compressor kind for this step.

    Each closing group pools `span` source rows (CSA: the previous group's rows then its own, HCA: its own). A
    source row comes from this step's tokens ("current input columns") or from the state pool ("history columns");
    columns that are neither (before position 0) read the dummy state row.
    """

    out_rows: torch.Tensor  # [G] compressed-pool row of each closing group
    positions: torch.Tensor  # [G] first position of each group (RoPE position of the entry)
    use_cur: torch.Tensor  # [G, span] bool
    cur_rows: torch.Tensor  # [G, span] token row in this step (clamped to 0 where unused)
    hist_rows: torch.Tensor  # [G, span] state row (dummy where unused)
    write_tokens: torch.Tensor  # [N] token rows whose [kv | score] must persist in the state pool
    write_rows: torch.Tensor  # [N] their state rows

    @property
    def num_groups(self) -> int:
        return int(self.out_rows.shape[0])


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    swa_slots: torch.Tensor  # [T] where each token's raw KV is written
    window: WindowIndex  # for the `gather_rows` tokens only
    gather_rows: torch.Tensor | None  # [Tg] token rows outside dense segments (None: all of them)
    segments: list[Segment]  # dense chunks
    csa: CompressedIndex | None
    hca: CompressedIndex | None
    csa_plan: CompressPlan | None
    hca_plan: CompressPlan | None
    logits_rows: torch.Tensor  # [num logits rows] token rows to compute logits for
    # Decode/verify steps within the row limit: the side streams attention prepares on (None: one stream).
    prepare_streams: PrepareStreams | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def gather_rows(pool: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """`pool[rows]` for a pool `[R, d]` and row indices of any shape -> `[*rows.shape, d]`, as one memory gather
    (`index_select` costs a fraction of advanced indexing on the small index tensors of a decode step)."""
    return pool.index_select(0, rows.reshape(-1)).view(*rows.shape, pool.shape[-1])


class LayerCache(NamedTuple):
    """Views of one layer's pools (None where the layer type has no such pool)."""

    swa_kv: torch.Tensor  # [swa_rows + page, head_dim]
    comp_kv: torch.Tensor | None  # c4_kv or c128_kv layer view
    comp_state: torch.Tensor | None  # [rows + 1, 2 * coff * head_dim] fp32
    index_kv: torch.Tensor | None  # [c4 rows + 1, index_head_dim]
    index_state: torch.Tensor | None


class LayerCaches(Protocol):
    """Anything that hands out one layer's cache views (the cache's `KVPools`)."""

    def layer(self, layer_id: int) -> LayerCache: ...
