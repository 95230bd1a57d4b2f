"""`prompt_logits`: the logits at every position of a prompt from one prefill through an engine's paged cache (the
cache the prefill writes is read back by its later positions), for tests and benchmarks that compare two engines."""

from __future__ import annotations

from typing import Any

import torch

from pdspark.engine.forward_batch import Chunk, build_forward_batch


@torch.inference_mode()
def prompt_logits(llm: Any, ids: list[int]) -> torch.Tensor:
    """Logits `[len(ids), vocab]` of `llm.engine`'s model (an `LLM`, or anything with an `engine`); frees what it
    took."""
    kv = llm.engine.kv
    pages = kv.open()
    kv.grow(pages, len(ids))
    try:
        batch = build_forward_batch([Chunk(pages.slot, 0, ids, num_logits=len(ids))], kv)
        model = llm.engine.runner.model
        return model.logits(model(batch, kv.pools).hidden[batch.logits_rows]).cpu()  # beside the references
    finally:
        kv.close(pages)
