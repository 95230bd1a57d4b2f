"""`validate_plan`: what a prefill worker checks in a decode worker's transfer plan before it writes a byte.

The plan names, for each payload, the decode worker's buffers (`BufferDesc`) and the items (pages, slots) to fill.
A write may land only inside the buffer the plan itself describes for that payload, at an item that buffer has:
an id out of range would write into whatever lies beyond it (another pool, or another request's pages), and a
destination named twice would receive two source items. The buffers themselves must be places a write can land:
not at address 0, not running past the end of the 64-bit address space, and not overlapping each other (one
payload's writes would land in another's). The decode side's transfer engine checks on its own that every write
lands in memory it registered. Each refusal is a `RequestFailed` whose message names the
plan field: INCOMPATIBLE where the two workers' pools disagree, INVALID_REQUEST where the plan contradicts itself.
No torch here: the checks read only the plan and our own buffer descriptors.
"""

from __future__ import annotations

import math
from typing import NoReturn

from pdspark.errors import ErrorCode, RequestFailed
from pdspark.transfer.plan import SWA_KINDS, BufferDesc, PoolKind, TransferPlan

_ADDRESS_SPACE = 1 << 64

# The plan field holding the destination items of each payload kind.
ITEM_FIELD = {
    PoolKind.C4_KV: "full_pages",
    PoolKind.C4_INDEX: "full_pages",
    PoolKind.C128_KV: "c128_pages",
    PoolKind.C128_STATE: "req_slot",
    **{kind: "swa_pages" for kind in SWA_KINDS},
}


def destination_items(plan: TransferPlan, kind: PoolKind) -> tuple[int, ...]:
    """The destination item ids of one payload kind, in the plan's canonical order."""
    field = ITEM_FIELD[kind]
    return (plan.req_slot,) if field == "req_slot" else getattr(plan, field)


def validate_plan(plan: TransferPlan, local: list[BufferDesc]) -> None:
    """Raise `RequestFailed` unless every payload we hold has a matching destination buffer in `plan` and every
    destination item lies inside it. `local`: our own buffers (`cache_buffers`), whose geometry the plan's must
    match item for item."""
    _check_shape(plan)
    _check_extents(plan)
    remote: dict[tuple[PoolKind, int], tuple[int, BufferDesc]] = {}
    for i, b in enumerate(plan.buffers):
        if (b.pool, b.layer) in remote:
            _refuse(ErrorCode.INVALID_REQUEST, f"TransferPlan.buffers[{i}]: a second {b.pool.name} buffer for "
                                               f"layer {b.layer}")
        remote[(b.pool, b.layer)] = (i, b)
    for buf in local:
        if buf.num_items == 0:
            continue  # a pool this model does not have (no HCA layers, no draft): nothing to move
        found = remote.get((buf.pool, buf.layer))
        if found is None:
            _refuse(ErrorCode.INCOMPATIBLE, f"TransferPlan.buffers: no {buf.pool.name} buffer for layer {buf.layer}")
        i, dst = found
        if dst.item_bytes != buf.item_bytes:
            _refuse(ErrorCode.INCOMPATIBLE, f"TransferPlan.buffers[{i}].item_bytes: {dst.item_bytes} bytes per "
                                            f"{buf.pool.name} item; ours are {buf.item_bytes}")
        _check_items(plan, buf.pool, dst)


def _check_shape(plan: TransferPlan) -> None:
    """The plan agrees with itself: one destination page per prompt page, the SWA tail ends where they do."""
    if plan.prompt_len <= 0:
        _refuse(ErrorCode.INVALID_REQUEST, f"TransferPlan.prompt_len: {plan.prompt_len}; a prompt has tokens")
    if plan.compat.page_size <= 0:  # the compatibility check refuses it first; never a ZeroDivisionError here
        _refuse(ErrorCode.INCOMPATIBLE, f"TransferPlan.compat.page_size: {plan.compat.page_size}")
    num_pages = math.ceil(plan.prompt_len / plan.compat.page_size)
    if len(plan.full_pages) != num_pages:
        _refuse(ErrorCode.INVALID_REQUEST, f"TransferPlan.full_pages: {len(plan.full_pages)} pages for a "
                                           f"{plan.prompt_len}-token prompt of {num_pages} pages")
    if plan.swa_first_page + len(plan.swa_pages) != num_pages:
        _refuse(ErrorCode.INVALID_REQUEST, f"TransferPlan.swa_pages: {len(plan.swa_pages)} pages from prompt page "
                                           f"{plan.swa_first_page} (swa_first_page) do not end at page {num_pages}")


def _check_extents(plan: TransferPlan) -> None:
    """Every described buffer lies inside the address space, away from 0, apart from the others."""
    spans = []
    for i, b in enumerate(plan.buffers):
        end = b.base_addr + b.num_items * b.item_bytes
        if b.num_items and (b.base_addr <= 0 or b.item_bytes <= 0 or end > _ADDRESS_SPACE):
            _refuse(ErrorCode.INVALID_REQUEST, f"TransferPlan.buffers[{i}]: {b.num_items} items of {b.item_bytes} "
                                               f"bytes at {b.base_addr:#x} is not a buffer")
        if b.num_items:
            spans.append((b.base_addr, end, i))
    spans.sort()
    for (_, end, i), (start, _, j) in zip(spans, spans[1:]):
        if start < end:
            _refuse(ErrorCode.INVALID_REQUEST, f"TransferPlan.buffers[{j}] overlaps TransferPlan.buffers[{i}]")


def _check_items(plan: TransferPlan, kind: PoolKind, dst: BufferDesc) -> None:
    field = ITEM_FIELD[kind]
    items = destination_items(plan, kind)
    for j, item in enumerate(items):
        if not 0 <= item < dst.num_items:
            where = field if field == "req_slot" else f"{field}[{j}]"
            _refuse(ErrorCode.INVALID_REQUEST, f"TransferPlan.{where}: item {item} is outside the decode worker's "
                                               f"{kind.name} buffer of {dst.num_items} items")
    if len(set(items)) != len(items):
        _refuse(ErrorCode.INVALID_REQUEST, f"TransferPlan.{field}: a destination item is named twice")


def _refuse(code: ErrorCode, message: str) -> NoReturn:
    raise RequestFailed(code, message)
