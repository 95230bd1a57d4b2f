"""`ReqPages`: the pages one running request holds, in every pool, and its prefix-cache locks."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdspark.cache.radix_cache import RadixNode, SwaLock


@dataclass
class ReqPages:
    """Pages held by one request. `swa_pages[i]` is None once full page `i` left the window.

    The first `num_borrowed` full pages (and their SWA pages) belong to the prefix tree; the request owns the rest.
    """

    slot: int
    full_pages: list[int] = field(default_factory=list)
    swa_pages: list[int | None] = field(default_factory=list)
    c128_pages: list[int] = field(default_factory=list)
    num_released: int = 0  # leading full pages whose SWA page has been released
    num_borrowed: int = 0  # leading full pages (and their SWA pages) owned by the prefix tree
    match_node: RadixNode | None = None  # FULL-locked while the request runs
    swa_lock: SwaLock | None = None  # the SWA lock on the window before match_node's end
    # The rank of a DP-attention group whose pools these pages are in (0 in one process). A transfer reservation on
    # another rank reaches rank 0 as a copy of that rank's `ReqPages` (what the plan names), with its rank set.
    rank: int = 0

    @property
    def place(self) -> tuple[int, int]:
        """(rank, request slot): where these pages are across a group (a slot number alone repeats per rank)."""
        return self.rank, self.slot

    @property
    def owned_full_pages(self) -> list[int]:
        return self.full_pages[self.num_borrowed :]

    @property
    def owned_swa_pages(self) -> list[int]:
        return [p for p in self.swa_pages[self.num_borrowed :] if p is not None]
