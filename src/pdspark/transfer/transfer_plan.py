"""Transfer plans: where the decode worker wants each piece of a prompt's cache, and the writes that put it there.

Payloads and their item unit (one item = one contiguous region of a registered buffer):
| pool            | item                                 | source -> destination item ids              |
|-----------------|--------------------------------------|---------------------------------------------|
| C4_KV, C4_INDEX | the C4 rows of one full page         | prompt full pages -> plan.full_pages        |
| C128_KV         | one C128 page                        | prompt C128 pages -> plan.c128_pages        |
| SWA_KV, C4_STATE, | one SWA page (rows or state ring)    | window-tail SWA pages -> plan.swa_pages     |
|   C4_INDEX_STATE, DRAFT_KV |                           |                                             |
| C128_STATE      | one request slot's HCA ring          | prefill slot -> plan.req_slot               |
Runs of items contiguous on both sides merge into one write (the transfer engine's cost is per entry); the pools
are page-major, so an item holds every layer and a run of pages is one write per pool kind.
"""

from __future__ import annotations

import ctypes
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from pdspark.cache.kv_cache import KVCache, ReqPages
from pdspark.cache.kv_pools import KVPools
from pdspark.errors import ErrorCode, RequestFailed
from pdspark.transfer.base import Write
from pdspark.transfer.plan import SWA_KINDS, BufferDesc, PoolKind, TransferPlan
from pdspark.transfer.plan_validation import destination_items


@dataclass(frozen=True)
class WriteList:
    writes: list[Write]
    bytes_by_pool: dict[str, int]
    writes_by_pool: dict[str, int] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(self.bytes_by_pool.values())


def cache_buffers(pools: KVPools) -> list[BufferDesc]:
    """Every transferable buffer of `pools`: one per pool kind, covering all of its layers (`layer` 0), since the
    pools are page-major (`cache/kv_pools.py`): an item (a page, a state ring) of every layer is one contiguous
    span, and a run of items too, so a transfer writes one span per pool kind per run of pages."""
    s = pools.sizes
    P = s.page_size
    out: list[BufferDesc] = []

    def add(kind: PoolKind, view, item_rows: int, num_items: int) -> None:
        # `view [layers, rows, width]` over storage `[rows, layers, width]`
        layers, _, width = view.shape
        if layers == 0:
            return  # a pool this model does not have (no HCA layers, no draft)
        assert view.stride(0) == width and view.stride(1) == layers * width and view.stride(2) == 1, (
            f"{kind.name} pool is not page-major")
        out.append(BufferDesc(kind, 0, view.data_ptr(), item_rows * layers * width * view.element_size(), num_items))

    rows_per_page = P // pools.model.csa_ratio
    add(PoolKind.C4_KV, pools.c4_kv, rows_per_page, s.num_full_pages)
    add(PoolKind.C4_INDEX, pools.c4_index, rows_per_page, s.num_full_pages)
    add(PoolKind.C128_KV, pools.c128_kv, s.c128_page_size, s.num_c128_pages)
    add(PoolKind.SWA_KV, pools.swa_kv, P, s.num_swa_pages)
    add(PoolKind.C4_STATE, pools.c4_state, s.csa_ring, s.num_swa_pages)
    add(PoolKind.C4_INDEX_STATE, pools.c4_index_state, s.csa_ring, s.num_swa_pages)
    add(PoolKind.C128_STATE, pools.c128_state, s.hca_ring, s.num_req_slots)
    add(PoolKind.DRAFT_KV, pools.draft_kv, P, s.num_swa_pages)
    return out


def registered_regions(pools: KVPools) -> list[tuple[int, int]]:
    """`(addr, nbytes)` of each pool tensor as a whole, for registration with the transfer engine."""
    tensors = (pools.c4_kv, pools.c4_index, pools.c128_kv, pools.swa_kv, pools.c4_state, pools.c4_index_state,
               pools.c128_state, pools.draft_kv)
    return [(t.data_ptr(), t.numel() * t.element_size()) for t in tensors if t.numel()]


def destination(kv: KVCache, pages: ReqPages, prompt_len: int) -> dict:
    """The decode side's plan fields for a `grow_tail`-ed reservation."""
    P = kv.sizes.page_size
    n = -(-prompt_len // P)
    first = kv.keep_from(prompt_len) // P
    swa = pages.swa_pages[first:n]
    assert all(p is not None for p in swa), "destination SWA tail is incomplete"
    return dict(
        prompt_len=prompt_len,
        full_pages=tuple(pages.full_pages[:n]),
        swa_pages=tuple(swa),
        swa_first_page=first,
        c128_pages=tuple(pages.c128_pages),
        req_slot=pages.slot,
    )


def item_pairs(plan: TransferPlan, src: ReqPages, kind: PoolKind) -> list[tuple[int, int]]:
    """`(source item, destination item)` pairs of one pool kind, in the plan's canonical order. Raises
    `RequestFailed` (naming the plan field) when `src` does not hold an item the plan asks for."""
    if kind in (PoolKind.C4_KV, PoolKind.C4_INDEX):
        return list(zip(_source(src.full_pages, plan.full_pages, "full_pages"), plan.full_pages))
    if kind == PoolKind.C128_KV:
        return list(zip(_source(src.c128_pages, plan.c128_pages, "c128_pages"), plan.c128_pages))
    if kind in SWA_KINDS:
        first = plan.swa_first_page
        tail = src.swa_pages[first : first + len(plan.swa_pages)]
        if len(tail) != len(plan.swa_pages) or any(p is None for p in tail):
            kept = next((i for i, p in enumerate(src.swa_pages) if p is not None), len(src.swa_pages))
            raise RequestFailed(ErrorCode.INCOMPATIBLE, f"TransferPlan.swa_first_page: the plan asks for SWA pages "
                                f"from prompt page {first}; this worker keeps them from page {kept}")
        return list(zip(tail, plan.swa_pages))  # type: ignore[arg-type]
    return [(src.slot, plan.req_slot)]


def _source(held: list[int], wanted: tuple[int, ...], field: str) -> list[int]:
    """Our items for a plan field, which must name exactly as many destinations as we hold (fewer would leave
    part of the prompt's cache behind, unnoticed by the checksum, which covers only the plan's items)."""
    if len(wanted) != len(held):
        raise RequestFailed(ErrorCode.INVALID_REQUEST, f"TransferPlan.{field}: {len(wanted)} destination items "
                            f"for the {len(held)} this worker holds for the prompt")
    return held


def read_memory(addr: int, nbytes: int) -> memoryview:
    """`nbytes` of our own memory at `addr`, without a copy (what the checksums read)."""
    return memoryview((ctypes.c_char * nbytes).from_address(addr)).cast("B")


def plan_writes(local: list[BufferDesc], plan: TransferPlan, src: ReqPages) -> WriteList:
    """The merged writes that copy `src`'s cache into the plan's destination. The plan must have passed
    `validate_plan` against `local`; raises `RequestFailed` when `src` does not match it."""
    remote = {(b.pool, b.layer): b for b in plan.buffers}
    writes: list[Write] = []
    by_pool: dict[str, int] = {}
    writes_by_pool: dict[str, int] = {}
    for buf in local:
        dst_buf = remote.get((buf.pool, buf.layer))
        if dst_buf is None or buf.num_items == 0:
            continue
        assert dst_buf.item_bytes == buf.item_bytes, f"{buf.pool.name} item sizes differ (validate_plan checks)"
        for s, d, n in _runs(item_pairs(plan, src, buf.pool)):
            writes.append(Write(buf.base_addr + s * buf.item_bytes, dst_buf.base_addr + d * buf.item_bytes,
                                n * buf.item_bytes))
            by_pool[buf.pool.name] = by_pool.get(buf.pool.name, 0) + n * buf.item_bytes
            writes_by_pool[buf.pool.name] = writes_by_pool.get(buf.pool.name, 0) + 1
    return WriteList(writes, by_pool, writes_by_pool)


def source_checksum(local: list[BufferDesc], plan: TransferPlan, src: ReqPages,
                    read: Callable[[int, int], bytes | memoryview] = read_memory) -> int:
    """CRC32 of the source bytes `plan_writes` copies, over items in the plan's canonical order (the destination
    recomputes it over what arrived: `destination_checksum`)."""
    remote = {(b.pool, b.layer) for b in plan.buffers}
    crc = 0
    for buf in local:
        if (buf.pool, buf.layer) in remote and buf.num_items:
            crc = _crc_items(buf, [s for s, _ in item_pairs(plan, src, buf.pool)], read, crc)
    return crc


def destination_checksum(local: list[BufferDesc], plan: TransferPlan,
                         read: Callable[[int, int], bytes | memoryview] = read_memory) -> int:
    """The decode side's CRC32 over the destination items, in the same canonical order as `plan_writes`."""
    crc = 0
    for buf in local:
        if buf.num_items == 0 or not any(b.pool == buf.pool and b.layer == buf.layer for b in plan.buffers):
            continue
        crc = _crc_items(buf, list(destination_items(plan, buf.pool)), read, crc)
    return crc


def _crc_items(buf: BufferDesc, items: list[int], read: Callable[[int, int], bytes | memoryview], crc: int) -> int:
    """CRC32 of `buf`'s items in the given order, continuing `crc`: one call per run of consecutive items (the
    same value as item by item, since CRC32 streams)."""
    i = 0
    while i < len(items):
        j = i + 1
        while j < len(items) and items[j] == items[j - 1] + 1:
            j += 1
        crc = zlib.crc32(read(buf.base_addr + items[i] * buf.item_bytes, (j - i) * buf.item_bytes), crc)
        i = j
    return crc


def plan_nbytes(plan: TransferPlan) -> int:
    """Bytes the plan asks to be written, over every buffer it names."""
    return sum(len(destination_items(plan, b.pool)) * b.item_bytes for b in plan.buffers if b.num_items)


def _runs(pairs: list[tuple[int, int]]) -> Iterator[tuple[int, int, int]]:
    """Merge `(src, dst)` item pairs into `(src, dst, count)` runs contiguous on both sides."""
    run = None
    for s, d in sorted(pairs):
        if run is not None and s == run[0] + run[2] and d == run[1] + run[2]:
            run[2] += 1
            continue
        if run is not None:
            yield tuple(run)  # type: ignore[misc]
        run = [s, d, 1]
    if run is not None:
        yield tuple(run)  # type: ignore[misc]
