"""`PoolMetrics`: how full each cache pool of a worker is: pages (full, SWA, C4, C128), compressor-state ring rows
(C4, C128) and request slots, each used and in all.

NOTE: the geometry (`cache/kv_pools.py`): a full page's C4 rows live in the C4 pools at the page's own index, so C4
pages are taken and freed with full pages (same counts; a model without CSA layers has none). C4 state rings are
per SWA page (`csa_ring` rows each), C128 state rings per request slot (`hca_ring` rows each).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Gauge

if TYPE_CHECKING:
    from pdspark.cache.kv_cache import KVCache
    from pdspark.serving.engine_load import EngineLoad

POOLS = ("full", "swa", "c4", "c128")
RINGS = ("c4", "c128")


class PoolMetrics:
    def __init__(self, registry: CollectorRegistry):
        r = registry
        self.used_pages = Gauge("pdspark_pool_used_pages", "Pages in use, by pool (full, swa, c4, c128; pages the "
                                "prefix cache holds count as used)", ["pool"], registry=r)
        self.capacity_pages = Gauge("pdspark_pool_capacity_pages", "Pages, by pool (full, swa, c4, c128)", ["pool"],
                                    registry=r)
        self.cached_pages = Gauge("pdspark_pool_cached_pages", "Of the used pages, those only the prefix cache "
                                  "holds (evictable)", ["pool"], registry=r)
        self.used_state_rows = Gauge("pdspark_pool_used_state_rows", "Compressor-state ring rows in use, by ring "
                                     "(c4: per SWA page; c128: per request slot)", ["ring"], registry=r)
        self.capacity_state_rows = Gauge("pdspark_pool_capacity_state_rows", "Compressor-state ring rows, by ring "
                                         "(c4, c128)", ["ring"], registry=r)
        self.used_slots = Gauge("pdspark_pool_used_request_slots", "Request slots in use (one per request the "
                                "engine holds pages for)", registry=r)
        self.capacity_slots = Gauge("pdspark_pool_capacity_request_slots", "Request slots (max_num_seqs)",
                                    registry=r)
        for pool in POOLS:
            self.used_pages.labels(pool=pool)
            self.capacity_pages.labels(pool=pool)
            self.cached_pages.labels(pool=pool)
        for ring in RINGS:
            self.used_state_rows.labels(ring=ring)
            self.capacity_state_rows.labels(ring=ring)

    def sample(self, kv: KVCache, load: EngineLoad) -> None:
        used, total, cached = load.pages_used, load.pages_total, load.pages_cached
        has_c4, has_c128 = bool(kv.model.csa_layers), bool(kv.model.hca_layers)
        pages = {
            "full": (used["full"], total["full"], cached["full"]),
            "swa": (used["swa"], total["swa"], cached["swa"]),
            "c4": (used["full"], total["full"], cached["full"]) if has_c4 else (0, 0, 0),
            "c128": (used["c128"], total["c128"], cached["c128"]),
        }
        for pool, (u, t, c) in pages.items():
            self.used_pages.labels(pool=pool).set(u)
            self.capacity_pages.labels(pool=pool).set(t)
            self.cached_pages.labels(pool=pool).set(c)
        sizes = kv.sizes
        rings = {
            "c4": (used["swa"] * sizes.csa_ring, total["swa"] * sizes.csa_ring) if has_c4 else (0, 0),
            "c128": (used["req_slots"] * sizes.hca_ring, total["req_slots"] * sizes.hca_ring) if has_c128 else (0, 0),
        }
        for ring, (u, t) in rings.items():
            self.used_state_rows.labels(ring=ring).set(u)
            self.capacity_state_rows.labels(ring=ring).set(t)
        self.used_slots.set(used["req_slots"])
        self.capacity_slots.set(total["req_slots"])
