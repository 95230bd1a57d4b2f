"""`TransferDestinations`: where a decode worker's transfers land, per rank of its group (one entry in one process).

A DP-attention decode group keeps each request's cache whole in the pools of the rank that owns it, so a plan names
that rank's transfer session and buffers, and the integrity check reads that rank's memory. Rank 0's destination is
this process's backend and pools; every other rank runs a `DestinationService` beside its engine (its own transfer
engine, registered over its own pools) and answers the checksums over its side channel
(`engine/rank_service.py`). A checksum waits on a rank at most the group's collective timeout + 1 s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdspark.transfer.backend import create_backend
from pdspark.transfer.plan import BufferDesc, TransferPlan
from pdspark.transfer.transfer_plan import cache_buffers, destination_checksum, registered_regions

if TYPE_CHECKING:
    from pdspark.engine.engine import Engine
    from pdspark.engine.rank_service import ServiceChannel
    from pdspark.transfer.base import TransferBackend

CHECKSUM = "checksum"  # the side call: CRC32 of a plan's destination items (`destination_checksum`)


@dataclass(frozen=True)
class RankDestination:
    """What a plan names to land in one rank's memory."""

    session: str
    buffers: tuple[BufferDesc, ...]


class DestinationService:
    """On each other rank of a decode group: its transfer engine over its pools; answers checksums. Picklable
    until started (the backend is created on the rank)."""

    def __init__(self, backend: str, host: str, protocol: str, device: str = ""):
        self.args = (backend, host, protocol, device)
        self._backend: TransferBackend | None = None
        self._buffers: list[BufferDesc] = []

    def start(self, engine: Engine) -> RankDestination:
        backend, host, protocol, device = self.args
        self._backend = create_backend(backend, host=host, protocol=protocol, device=device)
        for addr, nbytes in registered_regions(engine.kv.pools):
            self._backend.register(addr, nbytes)
        self._buffers = cache_buffers(engine.kv.pools)  # fixed at start: the pools never move
        return RankDestination(self._backend.session_id, tuple(self._buffers))

    def call(self, name: str, *args: Any) -> Any:
        if name != CHECKSUM:
            raise ValueError(f"unknown side call {name!r}; allowed: {CHECKSUM!r}")
        return destination_checksum(self._buffers, args[0])


def local_destination(backend: TransferBackend, engine: Engine) -> RankDestination:
    """This process's: its transfer engine's session over its engine's pools (one process, or a group's rank 0)."""
    return RankDestination(backend.session_id, tuple(cache_buffers(engine.kv.pools)))


class TransferDestinations:
    """Per rank (rank 0 first): the session and buffers a plan names, and the checksum over what arrived there."""

    def __init__(self, local: RankDestination, others: Sequence[ServiceChannel] = (), timeout_s: float = 0.0):
        self._ranks = [local, *(c.info for c in others)]
        self._channels = list(others)
        self._timeout_s = timeout_s

    def __getitem__(self, rank: int) -> RankDestination:
        return self._ranks[rank]

    def checksum(self, rank: int, plan: TransferPlan) -> int:
        """(Blocking: run it on a worker thread.) CRC32 of the plan's destination items in rank `rank`'s memory."""
        if rank == 0:
            return destination_checksum(list(self._ranks[0].buffers), plan)
        crc: int = self._channels[rank - 1].call(CHECKSUM, plan, timeout_s=self._timeout_s)
        return crc
