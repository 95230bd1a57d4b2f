"""`EngineLoad`: an immutable snapshot of an engine's queues and pools, taken on the engine-loop thread.

The loop publishes a fresh one between steps (`EngineLoop.load`); `GetLoad` and the metrics read the latest
without waiting for the engine, however busy it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING

from pdspark.engine.data_parallel import DataParallelEngine, rank_load

if TYPE_CHECKING:
    from collections.abc import Mapping

    from pdspark.engine.engine import Engine


@dataclass(frozen=True)
class EngineLoad:
    running: int
    waiting: int
    pages_used: Mapping[str, int]
    pages_total: Mapping[str, int]
    pages_cached: Mapping[str, int]  # of pages_used, those held only by the prefix cache

    @classmethod
    def of(cls, engine: Engine) -> EngineLoad:
        """The engine's load now (loop thread only: it reads the scheduler and the pools). A DP-attention group's:
        every rank's, added up (the other ranks' as of their last answer)."""
        load = engine.group_load() if isinstance(engine, DataParallelEngine) else rank_load(engine)
        return cls(
            running=load.running,
            waiting=load.waiting,
            pages_used=MappingProxyType({k: used for k, (used, _) in load.usage.items()}),
            pages_total=MappingProxyType({k: total for k, (_, total) in load.usage.items()}),
            pages_cached=MappingProxyType(dict(load.cached)),
        )
