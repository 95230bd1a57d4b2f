"""Builders for cache tests: tiny model configs of a chosen window and a `KVCache` sized for bookkeeping tests."""

from __future__ import annotations

import dataclasses

import torch
from test_page_allocator import TINY  # SWA + CSA (ratio 4) + HCA (ratio 16) layers, window 8

from pdspark.cache.kv_cache import KVCache
from pdspark.cache.pool_sizes import PoolSizes
from pdspark.config import CacheConfig, SchedulerConfig
from pdspark.model.model_config import ModelConfig


def tiny_model(sliding_window: int = 8) -> ModelConfig:
    return dataclasses.replace(TINY, sliding_window=sliding_window)


def make_kv(
    sliding_window: int = 8,
    page_size: int = 16,
    group_pages: int = 1,
    draft_stages: int = 0,
    num_full_pages: int = 40,
    num_swa_pages: int = 24,
    num_c128_pages: int = 12,
    max_num_seqs: int = 6,
    max_model_len: int = 256,
    prefix_cache: bool = True,
) -> KVCache:
    """A `KVCache` on the CPU, prefix-cached unless told otherwise. `group_pages` pages make one C128 group
    (`c128_page_size` = `group_pages * page_size / hca_ratio`)."""
    model = tiny_model(sliding_window)
    cache = CacheConfig(
        page_size=page_size,
        c128_page_size=group_pages * page_size // model.hca_ratio,
        num_full_pages=num_full_pages,
        num_swa_pages=num_swa_pages,
        num_c128_pages=num_c128_pages,
        max_draft_tokens=3 if draft_stages else 0,
    )
    sizes = PoolSizes.derive(model, cache, SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=max_model_len))
    return KVCache(model, sizes, torch.float32, "cpu", enable_prefix_cache=prefix_cache,
                   draft_stages=draft_stages)
