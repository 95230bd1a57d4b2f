"""`describe_engine`: the compatibility descriptor of a loaded engine, exchanged at every transfer rendezvous."""

from __future__ import annotations

import json

from pdspark.engine.engine import Engine
from pdspark.model.fingerprint import model_fingerprint
from pdspark.transfer.compat import SCHEMA_VERSION, CompatDescriptor


def describe_engine(engine: Engine) -> CompatDescriptor:
    """The descriptor of an `Engine` (its model, pool geometry and draft)."""
    model = engine.runner.model
    cfg, sizes = model.cfg, engine.sizes
    drafter = engine.drafter
    draft = json.dumps(drafter.draft.dcfg.to_dict(), sort_keys=True) if drafter is not None else ""
    return CompatDescriptor(
        schema_version=SCHEMA_VERSION,
        model_fingerprint=model_fingerprint(model, model.group_expert_digests),
        layer_types=tuple(cfg.layer_types),
        csa_ratio=cfg.csa_ratio,
        hca_ratio=cfg.hca_ratio,
        head_dim=cfg.head_dim,
        index_head_dim=cfg.index_head_dim,
        kv_dtype=engine.kv.pools.kv_dtype,
        state_dtype=str(engine.kv.pools.c4_state.dtype).removeprefix("torch."),
        page_size=sizes.page_size,
        c128_page_size=sizes.c128_page_size,
        csa_ring=sizes.csa_ring,
        hca_ring=sizes.hca_ring,
        sliding_window=cfg.sliding_window,
        draft_config=draft,
        prefix_cache=engine.kv.tree is not None,
    )
