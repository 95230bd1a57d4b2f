"""`SwaWindow`: SWA pages, which positions still need one, and the page map from full pages to them.

Raw KV (one shared K=V latent per token, every layer) lives only for the positions a request still reads: the
window of its next query (W - 1 rows before it; W with a drafter, whose block at the computed length reads W
context rows) and, with CSA layers, the previous group's overlap rows, kept in the page-scoped compressor state of
the SWA page holding them. With the prefix cache, also the window before the last cacheable boundary, so that the
pages inserted into the tree can be matched there. An SWA page is tied to one full page; `full_to_swa_page` maps
each full page to its SWA page, or to the dummy page once it has none.
"""

from __future__ import annotations

import torch

from pdspark.cache.index_arrays import Indices
from pdspark.cache.page_allocator import PageAllocator, PoolUsage
from pdspark.cache.pool_sizes import PoolSizes
from pdspark.model.model_config import ModelConfig


class SwaWindow:
    def __init__(self, model: ModelConfig, sizes: PoolSizes, dummy_page: int, has_draft: bool,
                 cache_unit: int | None):
        """`cache_unit`: the tokens a prefix-cache entry is a whole number of (None when the cache is off)."""
        self.page_size = sizes.page_size
        self.sliding_window = model.sliding_window
        self.csa_ratio = model.csa_ratio if model.csa_layers else None
        self.has_draft = has_draft
        self.cache_unit = cache_unit
        self.dummy_page = dummy_page
        self._pages = PageAllocator(sizes.num_swa_pages, "swa")
        # [full pages + 1] SWA page of each full page; the dummy page where there is none
        self.full_to_swa_page = torch.full((sizes.num_full_pages + 1,), dummy_page, dtype=torch.long)

    # ---- which positions keep their SWA page --------------------------------------------------------------------
    @property
    def window_rows(self) -> int:
        """Window rows before the computed length the next step reads: W - 1 for the target's query there; W
        with a drafter, whose block there reads W context rows."""
        return self.sliding_window - (0 if self.has_draft else 1)

    @property
    def window_tokens(self) -> int:
        """Tokens before a page boundary whose SWA pages a request starting there needs: the window rows and,
        with CSA layers, the previous group's overlap rows. The prefix tree SWA-locks exactly these, which covers
        every SWA page `keep_from` keeps at a cached boundary."""
        return max(self.window_rows, self.csa_ratio or 0)

    def keep_from(self, computed_len: int) -> int:
        """First position whose SWA page the request still needs after `computed_len` tokens are computed."""
        keep = computed_len - self.window_rows
        if self.csa_ratio is not None:
            R = self.csa_ratio  # the next closing group reads the previous group's overlap rows
            keep = min(keep, (computed_len // R) * R - R)
        if self.cache_unit is not None:
            # What a later match ending at the last cacheable boundary needs, so that the pages inserted when the
            # request ends can be matched there.
            keep = min(keep, computed_len // self.cache_unit * self.cache_unit - self.window_tokens)
        return max(0, keep)

    @property
    def keep_margin(self) -> int:
        """The most tokens before a request's computed length whose SWA pages `keep_from` keeps."""
        margin = self.sliding_window
        if self.csa_ratio is not None:
            margin = max(margin, 2 * self.csa_ratio)
        if self.cache_unit is not None:
            margin = max(margin, self.cache_unit + self.window_tokens)
        return margin

    # ---- pages and the page map ---------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return self._pages.num_free

    def can_allocate(self, n: int) -> bool:
        return self._pages.can_allocate(n)

    def allocate_for(self, full_pages: list[int]) -> list[int]:
        """One new SWA page for each of `full_pages`, mapped."""
        swa_pages = self._pages.allocate(len(full_pages))
        self.map(full_pages, swa_pages)
        return swa_pages

    def map(self, full_pages: list[int], swa_pages: list[int]) -> None:
        if full_pages:
            self.full_to_swa_page[torch.tensor(full_pages, dtype=torch.long)] = torch.tensor(swa_pages,
                                                                                           dtype=torch.long)

    def unmap(self, full_pages: list[int]) -> None:
        """`full_pages` have no SWA page any more (their SWA page may live on, adopted by the tree)."""
        if full_pages:
            self.full_to_swa_page[torch.tensor(full_pages, dtype=torch.long)] = self.dummy_page

    def free(self, full_pages: list[int], swa_pages: list[int]) -> None:
        """Free the SWA pages of `full_pages`."""
        self._pages.free(swa_pages)
        self.unmap(full_pages)

    def slots(self, full_slots: Indices, page_map: Indices) -> Indices:
        """SWA slot of each full slot (the dummy page's slots where it has none); `page_map`: `full_to_swa_page`,
        or a NumPy view of it for NumPy slots."""
        P = self.page_size
        slots: Indices = page_map[full_slots // P] * P + full_slots % P
        return slots

    def usage(self) -> PoolUsage:
        return self._pages.usage()

    # ---- checks -------------------------------------------------------------------------------------------------
    def check_integrity(self, held: list[int]) -> None:
        """`held`: every SWA page each holder (request or tree node) owns."""
        self._pages.check_integrity()
        self._pages.check_holders(held)

    def check_map(self, full_pages: list[int], swa_pages: list[int | None] | None, what: str) -> None:
        """`full_pages` map to `swa_pages` (None entries, or None for all: to the dummy page)."""
        for i, page in enumerate(full_pages):
            expect = self.dummy_page if swa_pages is None or swa_pages[i] is None else swa_pages[i]
            assert int(self.full_to_swa_page[page]) == expect, f"{what} full->SWA map out of date"
