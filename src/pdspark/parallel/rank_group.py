"""`RankGroup`: this process's place in a worker group, and the torch.distributed process group behind it."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from pdspark.errors import ConfigError

# The least time the ranks of a group are given to meet (a spawned rank starts an interpreter and imports torch
# before it joins, seconds on a loaded machine), whatever the collectives' timeout.
JOIN_FLOOR_S = 60.0


@dataclass(frozen=True)
class RankGroup:
    """Rank `rank` of `size` processes that act as one worker. `backend` is the device's communication backend
    (the hardware backend's `dist_backend`: gloo, nccl, hccl); `host` is a gloo group over the same ranks for
    host-side coordination (the world group itself where the backend is gloo). Every collective of either group
    fails after `timeout_s` instead of torch's default 30 minutes: a hung peer becomes an error, not a hang."""

    rank: int
    size: int
    backend: str
    timeout_s: float
    host: dist.ProcessGroup | None = None  # None: the default (world) group
    # The group the steps' exchanges use, with `timeout_s` (None: the world, before `join`).
    collectives: dist.ProcessGroup | None = None

    @classmethod
    def join(cls, rank: int, size: int, init_method: str, timeout_s: float, backend: str = "gloo") -> RankGroup:
        """Join the group at `init_method` (`tcp://host:port`, rank 0 listening; or `file:///path` on one machine);
        returns once all `size` ranks have joined, or raises after `max(timeout_s, JOIN_FLOOR_S)`."""
        if size < 2 or not 0 <= rank < size:
            raise ConfigError(f"rank {rank} of a group of {size}; allowed: a group of >= 2, ranks 0..{size - 1}")
        if timeout_s <= 0:
            raise ConfigError(f"`dist_timeout_s` is {timeout_s}; allowed: > 0")
        # The world's timeout bounds the rendezvous, which waits for ranks still starting (a spawned rank imports
        # torch first); the steps' collectives run on groups over the same ranks with the group's own timeout.
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                                timeout=timedelta(seconds=max(timeout_s, JOIN_FLOOR_S)))
        timeout = timedelta(seconds=timeout_s)
        collectives = dist.new_group(backend=backend, timeout=timeout)
        host = collectives if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
        return cls(rank, size, backend, timeout_s, host, collectives)

    def all_gather(self, value: object) -> list:
        """Every rank's `value` (picklable), in rank order, over the host group (a start-up exchange, not a step)."""
        out: list = [None] * self.size
        dist.all_gather_object(out, value, group=self.host)
        return out

    def close(self) -> None:
        """Leave the group (every rank calls it; a rank whose peer died may find it already broken)."""
        if dist.is_initialized():
            dist.destroy_process_group()
