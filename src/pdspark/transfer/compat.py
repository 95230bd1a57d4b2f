"""`CompatDescriptor`: what a prefill and a decode worker must share before any cache bytes move between them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# 2: relative timeouts instead of wall-clock deadlines on the wire; the prefix-cache setting in the descriptor.
# 3: page-major pools: one buffer per pool kind (layer 0) whose items hold every layer, not one buffer per layer.
# 4: an fp32 cache's indexer keys in blocks of 8 rows, channel-major, where pages hold whole blocks
#    (`model/blocked_rows.py`): a page's C4_INDEX bytes are laid out otherwise than version 3's rows.
SCHEMA_VERSION = 4


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
    # NOTE: with the prefix cache on, a worker keeps the SWA pages of a longer tail (`KVCache.keep_from`: what a
    # later match at the last cacheable boundary needs), and a decode worker asks for that whole tail. A prefill
    # worker without the cache has already freed the start of it, so the pair could never transfer a prompt
    # longer than the window; the other way round (the prefill side keeps more than asked) works.
    prefix_cache: bool

    def mismatches(self, decode: CompatDescriptor) -> list[str]:
        """Names of the fields that keep this (prefill) worker from transferring into `decode`: every field that
        differs, except `prefix_cache`, which matters only when the decode side has the cache and we do not."""
        names = [f.name for f in dataclasses.fields(self) if f.name != "prefix_cache"
                 and getattr(self, f.name) != getattr(decode, f.name)]
        if decode.prefix_cache and not self.prefix_cache:
            names.append("prefix_cache")
        return names
