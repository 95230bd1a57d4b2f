"""`CompatDescriptor`: what a prefill and a decode worker must share before any cache bytes move between them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class CompatDescriptor:
    schema_version: int
    model_fingerprint: str
    layer_types: tuple[str, ...]
    csa_ratio: int
    hca_ratio: int
    head_dim: int
    index_head_dim: int
    kv_dtype: str
    state_dtype: str
    page_size: int
    c128_page_size: int
    csa_ring: int
    hca_ring: int
    sliding_window: int
    draft_config: str

    def diff(self, other: CompatDescriptor) -> list[str]:
        """Names of the fields that differ."""
        return [f.name for f in dataclasses.fields(self) if getattr(self, f.name) != getattr(other, f.name)]
