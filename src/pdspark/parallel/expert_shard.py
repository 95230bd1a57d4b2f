"""`ExpertShard`: the routed experts one rank of an expert-parallel group holds."""

from __future__ import annotations

from dataclasses import dataclass

from pdspark.errors import ConfigError


@dataclass(frozen=True)
class ExpertShard:
    """Rank `rank` of `size` holds experts `[first, first + count)` of the `n_experts` every MoE layer routes over:
    `[rank * E / size, (rank + 1) * E / size)`. The router, the shared expert and `tid2eid` are not split."""

    rank: int
    size: int
    n_experts: int

    def __post_init__(self) -> None:
        if self.size < 1 or self.n_experts % self.size:
            allowed = [d for d in range(1, self.n_experts + 1) if self.n_experts % d == 0]
            raise ConfigError(f"`ep_size` is {self.size}; allowed: a divisor of the model's {self.n_experts} routed "
                              f"experts ({allowed})")
        if not 0 <= self.rank < self.size:
            raise ConfigError(f"rank {self.rank} of an expert-parallel group of {self.size}; allowed: "
                              f"0..{self.size - 1}")

    @classmethod
    def whole(cls, n_experts: int) -> ExpertShard:
        """One process holding every expert."""
        return cls(0, 1, n_experts)

    @property
    def count(self) -> int:
        return self.n_experts // self.size

    @property
    def first(self) -> int:
        return self.rank * self.count

    @property
    def is_whole(self) -> bool:
        return self.size == 1

    def holds(self, expert: int) -> bool:
        return self.first <= expert < self.first + self.count
