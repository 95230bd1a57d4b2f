"""`PoolSizes`: the concrete pool geometry the cache allocates for one model and engine configuration."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdspark.config import CacheConfig, SchedulerConfig
from pdspark.errors import ConfigError
from pdspark.model.model_config import ModelConfig


@dataclass(frozen=True)
class PoolSizes:
    """Concrete pool geometry for one model + engine config. All counts exclude the dummy rows."""

    page_size: int
    num_full_pages: int
    num_swa_pages: int
    c128_page_size: int
    num_c128_pages: int
    num_req_slots: int
    max_model_len: int
    # Compressor-state ring rows: per SWA page for CSA (page-scoped), per request slot for HCA.
    csa_ring: int
    hca_ring: int

    @property
    def num_full_slots(self) -> int:
        return self.num_full_pages * self.page_size

    @property
    def max_pages_per_req(self) -> int:
        return math.ceil(self.max_model_len / self.page_size)

    @staticmethod
    def derive(model: ModelConfig, cache: CacheConfig, sched: SchedulerConfig) -> PoolSizes:
        P = cache.page_size
        if model.csa_layers and P % model.csa_ratio:
            raise ConfigError(f"`page_size` ({P}) must be a multiple of the CSA ratio ({model.csa_ratio})")
        max_len = sched.max_model_len
        if max_len is None:
            raise ConfigError("`max_model_len` is unresolved (EngineConfig.for_model fills it in from the model)")
        if max_len > model.max_position_embeddings:
            raise ConfigError(
                f"`max_model_len` ({max_len}) exceeds the model's "
                f"`max_position_embeddings` ({model.max_position_embeddings})"
            )
        # Rings keep the open group, the previous group (CSA overlap) and room for draft writes ahead.
        csa_ring = _pow2_at_least(2 * model.csa_ratio + cache.max_draft_tokens)
        hca_ring = model.hca_ratio + cache.max_draft_tokens
        if model.csa_layers and P % csa_ring:
            raise ConfigError(f"`page_size` ({P}) must be a multiple of the CSA state ring ({csa_ring} rows)")
        c128_page = cache.c128_page_size or max(1, math.ceil(P / model.hca_ratio))
        group_tokens = model.hca_ratio * c128_page
        if model.hca_layers and group_tokens % P:
            raise ConfigError(
                f"a C128 page covers {group_tokens} tokens (hca ratio {model.hca_ratio} x c128_page_size "
                f"{c128_page}); it must be a multiple of `page_size` ({P})"
            )
        pages_per_req = math.ceil(max_len / P)
        num_full = cache.num_full_pages or sched.max_num_seqs * pages_per_req
        # A running request holds the window plus one step's chunk, rounded out to pages, plus the page the CSA
        # overlap rows may still live on.
        swa_per_req = math.ceil(model.sliding_window / P) + 2
        unit = (model.hca_ratio * (cache.c128_page_size or max(1, math.ceil(P / model.hca_ratio)))
                if model.hca_layers else P)
        if cache.enable_prefix_cache:
            swa_per_req += math.ceil(unit / P)  # the window before the last cacheable boundary stays
        chunk_pages = math.ceil(sched.max_num_batched_tokens / P) + 1
        num_swa = cache.num_swa_pages or sched.max_num_seqs * swa_per_req + chunk_pages
        if cache.enable_prefix_cache and not cache.num_swa_pages:
            num_swa += (cache.num_full_pages or sched.max_num_seqs * math.ceil(max_len / P)) // 8
        c128_per_req = math.ceil(max_len / group_tokens)
        num_c128 = cache.num_c128_pages or max(1, sched.max_num_seqs * c128_per_req)
        return PoolSizes(
            page_size=P,
            num_full_pages=num_full,
            num_swa_pages=num_swa,
            c128_page_size=c128_page,
            num_c128_pages=num_c128,
            num_req_slots=sched.max_num_seqs,
            max_model_len=max_len,
            csa_ring=csa_ring,
            hca_ring=hca_ring,
        )


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
