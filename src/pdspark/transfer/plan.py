"""The transfer plan and result types, shared by the workers and the wire conversion (no torch here).

`transfer_plan.py` turns a plan into writes; `rpc/convert.py` turns these into protobuf and back.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from pdspark.transfer.compat import CompatDescriptor
from pdspark.types import TokenLogprobs


class PoolKind(enum.IntEnum):  # values match the protobuf enum
    C4_KV = 1
    C4_INDEX = 2
    C128_KV = 3
    SWA_KV = 4
    C4_STATE = 5
    C4_INDEX_STATE = 6
    C128_STATE = 7
    DRAFT_KV = 8


SWA_KINDS = (PoolKind.SWA_KV, PoolKind.C4_STATE, PoolKind.C4_INDEX_STATE, PoolKind.DRAFT_KV)


@dataclass(frozen=True)
class BufferDesc:
    """One registered buffer of a pool kind. The pools are page-major (`cache/kv_pools.py`), so one buffer holds
    every layer of its kind (`layer` 0) and an item is a page (or ring) of all of them."""

    pool: PoolKind
    layer: int
    base_addr: int
    item_bytes: int
    num_items: int

    @property
    def nbytes(self) -> int:
        return self.item_bytes * self.num_items


@dataclass(frozen=True)
class TransferPlan:
    transfer_id: str
    request_id: str
    session: str
    compat: CompatDescriptor
    buffers: tuple[BufferDesc, ...]
    prompt_len: int
    full_pages: tuple[int, ...]
    swa_pages: tuple[int, ...]
    swa_first_page: int
    c128_pages: tuple[int, ...]
    req_slot: int
    # Relative, as on the wire: seconds from the plan's arrival within which its last write must start. The
    # receiver turns it into a deadline on its own clock.
    timeout_s: float
    # The rank of the decode worker's group whose memory `session` and `buffers` are (for stats and logs).
    destination_rank: int = 0


@dataclass(frozen=True)
class TransferStats:
    bytes: int = 0
    num_writes: int = 0
    transfer_s: float = 0.0
    prefill_s: float = 0.0
    plan_wait_s: float = 0.0
    bytes_by_pool: dict[str, int] | None = None
    # Seconds inside the transfer backend's write calls; `transfer_s` also covers planning the writes and waiting
    # for the source checksum (computed while the writes run) and the hops between threads.
    write_s: float = 0.0
    source_rank: int = 0  # the rank of the prefill group that wrote (its rank 0: the one writer)
    destination_rank: int = 0  # the rank of the decode group written into


@dataclass(frozen=True)
class TransferResult:
    """What the prefill side reports once the cache is in the decode worker's memory."""

    transfer_id: str
    first_token: int
    num_cached_tokens: int
    checksum: int
    stats: TransferStats
    first_logprob: TokenLogprobs | None = None  # when the request asked for logprobs
    # With `prompt_logprobs`: the prompt's tokens' logprobs from its second token on (the first has no context).
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()
