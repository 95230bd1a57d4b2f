"""`CompatDescriptor`: what a prefill and a decode worker must share before any cache bytes move between them."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass

import torch

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


def describe_engine(engine) -> CompatDescriptor:
    """The descriptor of an `Engine` (its model, pool geometry and draft)."""
    model = engine.runner.model
    cfg, sizes = model.cfg, engine.sizes
    drafter = engine.drafter
    draft = json.dumps(drafter.draft.dcfg.to_dict(), sort_keys=True) if drafter is not None else ""
    return CompatDescriptor(
        schema_version=SCHEMA_VERSION,
        model_fingerprint=model_fingerprint(model),
        layer_types=tuple(cfg.layer_types),
        csa_ratio=cfg.csa_ratio,
        hca_ratio=cfg.hca_ratio,
        head_dim=cfg.head_dim,
        index_head_dim=cfg.index_head_dim,
        kv_dtype=str(engine.kv.pools.swa_kv.dtype).removeprefix("torch."),
        state_dtype=str(engine.kv.pools.c4_state.dtype).removeprefix("torch."),
        page_size=sizes.page_size,
        c128_page_size=sizes.c128_page_size,
        csa_ring=sizes.csa_ring,
        hca_ring=sizes.hca_ring,
        sliding_window=cfg.sliding_window,
        draft_config=draft,
    )


def model_fingerprint(model: torch.nn.Module) -> str:
    """A digest of the architecture and every weight (names, shapes, dtypes, values)."""
    h = hashlib.sha256(json.dumps(model.cfg.fingerprint_dict(), sort_keys=True, default=str).encode())
    with torch.no_grad():
        for name, p in sorted(model.state_dict().items()):
            h.update(f"{name}:{tuple(p.shape)}:{p.dtype}".encode())
            h.update(p.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:32]
