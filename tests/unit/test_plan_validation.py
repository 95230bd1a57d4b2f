"""What a prefill worker refuses in a decode worker's transfer plan before writing a byte: destination ids outside
the buffers the plan describes, destinations named twice, buffers that disagree with ours, payload kinds it does not
know, and a decode worker whose prefix cache asks for more SWA tail than we keep. Each refusal is typed and its
message names the plan field."""

from __future__ import annotations

import dataclasses

import pytest

from pdspark.errors import ErrorCode, RequestFailed
from pdspark.rpc import convert
from pdspark.transfer.compat import SCHEMA_VERSION, CompatDescriptor
from pdspark.transfer.plan import BufferDesc, PoolKind, TransferPlan
from pdspark.transfer.plan_validation import validate_plan

PAGE = 16
COMPAT = CompatDescriptor(SCHEMA_VERSION, "fp", ("sliding_attention",), 4, 16, 8, 4, "float32", "float32", PAGE, 1,
                          8, 16, 32, "", prefix_cache=False)
# Our buffers (one layer each): 8 full pages, 6 C128 pages, 5 SWA pages, 2 request slots.
LOCAL = [
    BufferDesc(PoolKind.C4_KV, 0, 0x1000, 64, 8),
    BufferDesc(PoolKind.C4_INDEX, 0, 0x2000, 32, 8),
    BufferDesc(PoolKind.C128_KV, 0, 0x3000, 128, 6),
    BufferDesc(PoolKind.SWA_KV, 0, 0x4000, 256, 5),
    BufferDesc(PoolKind.C4_STATE, 0, 0x5000, 96, 5),
    BufferDesc(PoolKind.C128_STATE, 0, 0x6000, 512, 2),
    BufferDesc(PoolKind.DRAFT_KV, 0, 0x7000, 256, 0),  # no draft: nothing to move, need not be described
]


def plan(**changes) -> TransferPlan:
    """A valid plan for a 40-token prompt (3 pages), the decode side's buffers at other addresses."""
    remote = tuple(dataclasses.replace(b, base_addr=b.base_addr + 0x100000) for b in LOCAL if b.num_items)
    fields = dict(transfer_id="t", request_id="r", session="peer", compat=COMPAT, buffers=remote, prompt_len=40,
                  full_pages=(5, 6, 7), swa_pages=(3, 4), swa_first_page=1, c128_pages=(2, 0, 5), req_slot=1,
                  timeout_s=5.0)
    return TransferPlan(**{**fields, **changes})


def refusal(p: TransferPlan) -> RequestFailed:
    with pytest.raises(RequestFailed) as e:
        validate_plan(p, LOCAL)
    return e.value


def test_a_valid_plan_passes():
    validate_plan(plan(), LOCAL)


@pytest.mark.parametrize("changes, field", [
    (dict(full_pages=(5, 8, 7)), "full_pages[1]"),  # one past the end of the C4 buffers
    (dict(full_pages=(-1, 6, 7)), "full_pages[0]"),
    (dict(swa_pages=(3, 5)), "swa_pages[1]"),
    (dict(c128_pages=(2, 0, 6)), "c128_pages[2]"),
    (dict(req_slot=2), "req_slot"),
])
def test_an_item_outside_the_described_buffer_is_refused_naming_it(changes, field):
    e = refusal(plan(**changes))
    assert e.code is ErrorCode.INVALID_REQUEST
    assert f"TransferPlan.{field}" in e.message and "outside" in e.message


def test_an_item_is_checked_against_the_buffer_the_plan_describes_not_ours():
    # The decode side's SWA buffers are smaller than ours: page 4 exists here, not there.
    small = tuple(dataclasses.replace(b, num_items=4) if b.pool in (PoolKind.SWA_KV, PoolKind.C4_STATE) else b
                  for b in plan().buffers)
    e = refusal(plan(buffers=small))
    assert e.code is ErrorCode.INVALID_REQUEST and "TransferPlan.swa_pages[1]" in e.message


@pytest.mark.parametrize("change", [
    dict(base_addr=0),  # null
    dict(base_addr=(1 << 64) - 0x80),  # 0x100 bytes: runs past the end of the address space
    dict(item_bytes=0, num_items=8),
])
def test_a_buffer_no_write_can_land_in_is_refused(change):
    buffers = list(plan().buffers)
    buffers[1] = dataclasses.replace(buffers[1], **change)
    e = refusal(plan(buffers=tuple(buffers)))
    assert e.code in (ErrorCode.INVALID_REQUEST, ErrorCode.INCOMPATIBLE) and "TransferPlan.buffers[1]" in e.message


def test_buffers_that_overlap_are_refused():
    buffers = list(plan().buffers)
    # The C4 index buffer starts inside the C4 KV one: KV writes would land on index rows (or the other way).
    buffers[1] = dataclasses.replace(buffers[1], base_addr=buffers[0].base_addr + 64)
    e = refusal(plan(buffers=tuple(buffers)))
    assert e.code is ErrorCode.INVALID_REQUEST and "overlaps" in e.message


def test_a_zero_page_size_is_refused_not_divided_by():
    e = refusal(plan(compat=dataclasses.replace(COMPAT, page_size=0)))
    assert e.code is ErrorCode.INCOMPATIBLE and "page_size" in e.message


def test_huge_and_negative_ids_from_the_wire_are_refused():
    msg = convert.plan_to_pb(plan())
    msg.full_pages[:] = [2**31 - 1, -2**31, 0]
    msg.swa_first_page = 2**32 - 1
    e = refusal(convert.plan_from_pb(msg))
    assert e.code is ErrorCode.INVALID_REQUEST
    msg = convert.plan_to_pb(plan())
    msg.prompt_len = 2**32 - 1  # 2^28 pages: refused by their count, before any is looked at
    assert refusal(convert.plan_from_pb(msg)).code is ErrorCode.INVALID_REQUEST
    msg = convert.plan_to_pb(plan())
    msg.buffers[0].num_items = 2**64 - 1
    assert refusal(convert.plan_from_pb(msg)).code is ErrorCode.INVALID_REQUEST


def test_a_destination_named_twice_is_refused():
    e = refusal(plan(full_pages=(5, 5, 7)))
    assert e.code is ErrorCode.INVALID_REQUEST and "TransferPlan.full_pages" in e.message and "twice" in e.message


def test_buffers_that_disagree_with_ours_are_incompatible():
    missing = tuple(b for b in plan().buffers if b.pool != PoolKind.C128_STATE)
    e = refusal(plan(buffers=missing))
    assert e.code is ErrorCode.INCOMPATIBLE and "C128_STATE" in e.message
    wider = tuple(dataclasses.replace(b, item_bytes=b.item_bytes * 2) if b.pool == PoolKind.SWA_KV else b
                  for b in plan().buffers)
    e = refusal(plan(buffers=wider))
    assert e.code is ErrorCode.INCOMPATIBLE and "item_bytes" in e.message
    doubled = plan().buffers + (plan().buffers[0],)
    assert refusal(plan(buffers=doubled)).code is ErrorCode.INVALID_REQUEST


@pytest.mark.parametrize("changes, field", [
    (dict(full_pages=(5, 6)), "full_pages"),  # 2 pages for a 3-page prompt
    (dict(swa_first_page=0), "swa_pages"),  # the tail would end before the prompt does
    (dict(prompt_len=0), "prompt_len"),
])
def test_a_plan_that_contradicts_itself_is_refused(changes, field):
    e = refusal(plan(**changes))
    assert e.code is ErrorCode.INVALID_REQUEST and f"TransferPlan.{field}" in e.message


@pytest.mark.parametrize("kind", [0, 99])
def test_an_unknown_payload_kind_is_incompatible(kind):
    msg = convert.plan_to_pb(plan())
    msg.buffers[2].pool = kind  # a newer peer's payload (or none): we could neither write nor skip it
    with pytest.raises(RequestFailed) as e:
        convert.plan_from_pb(msg)
    assert e.value.code is ErrorCode.INCOMPATIBLE and "TransferPlan.buffers[2].pool" in e.value.message


def test_a_plan_survives_the_wire():
    assert convert.plan_from_pb(convert.plan_to_pb(plan())) == plan()


def test_the_prefix_cache_setting_is_compared_one_way():
    with_cache = dataclasses.replace(COMPAT, prefix_cache=True)
    # A prefill worker with the cache keeps at least the SWA tail any decode worker asks for...
    assert with_cache.mismatches(COMPAT) == [] and with_cache.mismatches(with_cache) == []
    assert COMPAT.mismatches(COMPAT) == []
    # ...one without it has freed the start of the tail a decode worker with the cache asks for.
    assert COMPAT.mismatches(with_cache) == ["prefix_cache"]
    assert dataclasses.replace(COMPAT, page_size=32).mismatches(with_cache) == ["page_size", "prefix_cache"]
