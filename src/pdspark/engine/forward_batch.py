"""`ForwardBatch`: one step's tokens, flattened, with every index the DSV4 layers gather through.

Tokens of one request are contiguous and in position order. Each request contributes a chunk
`[start, start + n)`; a decode step is a chunk of one token (a verify step, of several).

The indices are computed with NumPy on views of the host-side page tables (a decode step needs ~100 tiny index
operations, each several times cheaper in NumPy than as a tensor op) and handed over as tensors at the end.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import numpy as np
import torch

from pdspark.cache.kv_cache import HostTables, KVCache
from pdspark.hardware.prepare_streams import StepKind
from pdspark.model.batch import CompressedIndex, CompressPlan, ForwardBatch, Segment, WindowIndex


@dataclass(frozen=True)
class Chunk:
    """One request's part of a step."""

    slot: int
    start: int
    token_ids: list[int]
    # Return logits for these trailing rows of the chunk (1 to sample the next token, 0 mid-prefill).
    num_logits: int = 1
    # What the chunk computes (prompt rows, one generated token, a verify window): picks the multi-stream prepare.
    kind: StepKind = "extend"


# Chunks at least this long attend densely over their window's union (one gather per chunk instead of one window
# per token); shorter ones (decode tokens, verify windows) gather each token's own window.
DENSE_MIN_TOKENS = 16


def build_forward_batch(chunks: list[Chunk], kv: KVCache) -> ForwardBatch:
    """Flatten `chunks` and derive every gather index from `kv`'s tables. Pages must already be grown."""
    model = kv.model
    tables = kv.host_tables()
    lens = np.array([len(c.token_ids) for c in chunks], dtype=np.int64)
    starts = np.array([c.start for c in chunks], dtype=np.int64)
    slots = np.array([c.slot for c in chunks], dtype=np.int64)
    ends = starts + lens
    offsets = np.cumsum(lens) - lens  # first token row of each chunk
    T = int(lens.sum())
    token_slot = np.repeat(slots, lens)
    token_start = np.repeat(starts, lens)
    token_end = np.repeat(ends, lens)
    positions = token_start + np.arange(T) - np.repeat(offsets, lens)
    input_ids = np.array([t for c in chunks for t in c.token_ids], dtype=np.int64)
    full_slots = tables.req_to_token[token_slot, positions]

    csa = hca = csa_plan = hca_plan = None
    if model.csa_layers:
        csa = _csa_index(kv, tables, token_slot, positions)
        csa_plan = _csa_plan(kv, tables, token_slot, token_start, token_end, positions)
    if model.hca_layers:
        hca = _hca_index(kv, tables, token_slot, positions)
        hca_plan = _hca_plan(kv, tables, token_slot, token_start, token_end, positions)

    n_logits = np.array([c.num_logits for c in chunks], dtype=np.int64)
    first_logit = np.repeat(offsets + lens - n_logits, n_logits)
    logits_rows = first_logit + np.arange(len(first_logit)) - np.repeat(np.cumsum(n_logits) - n_logits, n_logits)
    dense = [i for i, c in enumerate(chunks) if len(c.token_ids) >= DENSE_MIN_TOKENS]
    segments = [_segment(kv, tables, chunks[i], int(offsets[i])) for i in dense]
    gather_rows = None
    if dense:
        keep = np.ones(T, dtype=bool)
        for seg in segments:
            keep[seg.offset : seg.offset + seg.length] = False
        gather_rows = np.nonzero(keep)[0]
    if gather_rows is None:
        window = _window_index(kv, tables, token_slot, positions)
    else:
        window = _window_index(kv, tables, token_slot[gather_rows], positions[gather_rows])
    batch = ForwardBatch(
        input_ids=_t(input_ids),
        positions=_t(positions),
        swa_slots=_t(kv.full_to_swa(full_slots, tables)),
        window=window,
        gather_rows=None if gather_rows is None else _t(gather_rows),
        segments=segments,
        csa=csa,
        hca=hca,
        csa_plan=csa_plan,
        hca_plan=hca_plan,
        logits_rows=_t(logits_rows),
    )
    device = kv.pools.swa_kv.device
    return batch if device.type == "cpu" else _to_device(batch, device)


def index_layout(kv: KVCache) -> tuple[int, ...]:
    """The cache's part of the C index builder's layout (`kernel_abi.DECODE_LAYOUT` up to the rotary tables): the page
    tables' pointers and row strides, the geometry and the dummy rows `build_forward_batch` uses. The tables are
    never reallocated, so this holds for the cache's lifetime."""
    t, m, s, p = kv.host_tables(), kv.model, kv.sizes, kv.pools
    return (t.req_to_token.ctypes.data, t.req_to_token.strides[0] // 8, t.req_to_c128.ctypes.data,
            t.req_to_c128.strides[0] // 8, t.full_to_swa_page.ctypes.data, s.page_size, m.sliding_window,
            m.csa_ratio if m.csa_layers else 0, m.hca_ratio if m.hca_layers else 0, s.c128_page_size, s.csa_ring,
            s.hca_ring, p.swa_dummy_page, p.swa_dummy_slot, p.c4_dummy_row, p.c128_dummy_row, p.c4_state_dummy_row,
            p.c128_state_dummy_row)


def index_request(chunks: list[Chunk]) -> list[int]:
    """The chunks as the C index builder reads them: `[n, (slot, start, length) per chunk, every token id]`."""
    out = [len(chunks)]
    for c in chunks:
        out += (c.slot, c.start, len(c.token_ids))
    for c in chunks:
        out += c.token_ids
    return out


def logits_rows(chunks: list[Chunk]) -> list[int]:
    """Token rows whose logits the step returns: each chunk's last `num_logits` rows."""
    rows: list[int] = []
    offset = 0
    for c in chunks:
        n = len(c.token_ids)
        rows += range(offset + n - c.num_logits, offset + n)
        offset += n
    return rows


def _t(a: np.ndarray) -> torch.Tensor:
    """A NumPy index array as a tensor (int64 or bool; shares memory, which the batch owns from here on)."""
    return torch.from_numpy(np.ascontiguousarray(a))


T = TypeVar("T")


def _to_device(obj: T, device: torch.device) -> T:
    """Index tensors are built on the CPU (they come from host-side tables); move them next to the pools."""
    moved: Any = obj
    if isinstance(obj, torch.Tensor):
        moved = obj.to(device, non_blocking=True)
    elif isinstance(obj, list):
        moved = [_to_device(x, device) for x in obj]
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        moved = dataclasses.replace(obj, **{f.name: _to_device(getattr(obj, f.name), device)
                                            for f in dataclasses.fields(obj)})
    return cast(T, moved)


def _segment(kv: KVCache, tables: HostTables, chunk: Chunk, offset: int) -> Segment:
    W, n = kv.model.sliding_window, len(chunk.token_ids)
    pos = np.arange(chunk.start - W + 1, chunk.start + n)  # [n + W - 1]
    valid = pos >= 0
    full = tables.req_to_token[chunk.slot, np.maximum(pos, 0)]
    rows = np.where(valid, kv.full_to_swa(full, tables), kv.pools.swa_dummy_slot)
    i = np.arange(n)[:, None]
    u = np.arange(n + W - 1)[None, :]
    band = (u >= i) & (u <= i + W - 1) & valid[None, :]
    return Segment(offset, n, chunk.start, _t(rows), _t(band))


def _window_index(kv: KVCache, tables: HostTables, token_slot: np.ndarray, positions: np.ndarray) -> WindowIndex:
    W = kv.model.sliding_window
    pos = positions[:, None] + np.arange(-(W - 1), 1)[None, :]  # [T, W]
    valid = pos >= 0
    full = tables.req_to_token[token_slot[:, None], np.maximum(pos, 0)]
    rows = np.where(valid, kv.full_to_swa(full, tables), kv.pools.swa_dummy_slot)
    return WindowIndex(_t(rows), _t(valid))


def _visible(positions: np.ndarray, ratio: int) -> tuple[np.ndarray, int]:
    visible = (positions + 1) // ratio
    return visible, int(visible.max()) if visible.size else 0


def _csa_index(kv: KVCache, tables: HostTables, token_slot: np.ndarray, positions: np.ndarray) -> CompressedIndex:
    R = kv.model.csa_ratio
    visible, V = _visible(positions, R)
    g = np.arange(V)
    valid = g[None, :] < visible[:, None]
    # An entry's C4 row derives from the full slot of its group (pages are multiples of R, so any position of
    # the group gives the same row): computed once per request, then spread over its queries. A long prefill chunk
    # has [T, V] entries (2,048 x 16,384 at 64k tokens): one array of that shape, not the four that per-query
    # lookups, division and selection made (each a fresh 256 MiB the kernel zeroes page by page).
    slots, of_slot = np.unique(token_slot, return_inverse=True)
    per_request = tables.req_to_token[slots[:, None], (g * R)[None, :]] // R  # [requests, V]
    rows = per_request[of_slot.reshape(-1)]  # [T, V]
    np.copyto(rows, kv.pools.c4_dummy_row, where=~valid)
    return CompressedIndex(_t(rows), _t(valid), V)


def _hca_index(kv: KVCache, tables: HostTables, token_slot: np.ndarray, positions: np.ndarray) -> CompressedIndex:
    visible, V = _visible(positions, kv.model.hca_ratio)
    cps = kv.sizes.c128_page_size
    g = np.arange(V)
    valid = g[None, :] < visible[:, None]
    pages = tables.req_to_c128[token_slot[:, None], (g // cps)[None, :]]
    rows = np.where(valid, pages * cps + (g % cps)[None, :], kv.pools.c128_dummy_row)
    return CompressedIndex(_t(rows), _t(valid), V)


def _plan_columns(
    ratio: int, overlap: bool, positions: np.ndarray, token_start: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Closing tokens and the source positions of their groups.

    Returns `(tok [G], group_start [G], src_pos [G, span], use_cur [G, span], cur_rows [G, span])`.
    """
    tok = np.nonzero((positions + 1) % ratio == 0)[0]
    group_start = (positions[tok] // ratio) * ratio
    span = 2 * ratio if overlap else ratio
    first = group_start - ratio if overlap else group_start
    src_pos = first[:, None] + np.arange(span)[None, :]
    use_cur = src_pos >= token_start[tok][:, None]
    cur_rows = tok[:, None] - (positions[tok][:, None] - src_pos)
    cur_rows = np.where(use_cur, cur_rows, 0)
    return tok, group_start, src_pos, use_cur, cur_rows


def _csa_plan(kv: KVCache, tables: HostTables, token_slot: np.ndarray, token_start: np.ndarray, token_end: np.ndarray,
              positions: np.ndarray) -> CompressPlan:
    R = kv.model.csa_ratio
    tok, group_start, src_pos, use_cur, cur_rows = _plan_columns(R, True, positions, token_start)
    slot = np.broadcast_to(token_slot[tok][:, None], src_pos.shape)
    hist_pos = np.maximum(src_pos, 0)
    hist_rows = kv.c4_state_rows(tables.req_to_token[slot, hist_pos], hist_pos, tables)
    hist_rows = np.where((src_pos >= 0) & ~use_cur, hist_rows, kv.pools.c4_state_dummy_row)
    out_rows = tables.req_to_token[token_slot[tok], group_start] // R
    # Persist the previous (overlap) group and the open group of every possible next start: speculative verify
    # chunks may commit only their first row, so keep from the group before the chunk's start (bounded by the ring);
    # and the last group of every page, which a request starting from a prefix-cache match there overlaps with.
    P, ring = kv.sizes.page_size, kv.sizes.csa_ring
    keep = np.maximum((token_start // R) * R - R, token_end - ring)
    write = np.nonzero((positions >= keep) | (positions % P >= P - R))[0]
    wpos = positions[write]
    write_rows = kv.c4_state_rows(tables.req_to_token[token_slot[write], wpos], wpos, tables)
    return CompressPlan(*map(_t, (out_rows, group_start, use_cur, cur_rows, hist_rows, write, write_rows)))


def _hca_plan(kv: KVCache, tables: HostTables, token_slot: np.ndarray, token_start: np.ndarray, token_end: np.ndarray,
              positions: np.ndarray) -> CompressPlan:
    R = kv.model.hca_ratio
    cps = kv.sizes.c128_page_size
    tok, group_start, src_pos, use_cur, cur_rows = _plan_columns(R, False, positions, token_start)
    slot = np.broadcast_to(token_slot[tok][:, None], src_pos.shape)
    hist_rows = np.where(~use_cur, kv.c128_state_rows(slot, src_pos), kv.pools.c128_state_dummy_row)
    g = group_start // R
    out_rows = tables.req_to_c128[token_slot[tok], g // cps] * cps + g % cps
    # The open group of every possible next start (see `_csa_plan`), bounded by the ring.
    keep = np.maximum((token_start // R) * R, token_end - kv.sizes.hca_ring)
    write = np.nonzero(positions >= keep)[0]
    write_rows = kv.c128_state_rows(token_slot[write], positions[write])
    return CompressPlan(*map(_t, (out_rows, group_start, use_cur, cur_rows, hist_rows, write, write_rows)))
