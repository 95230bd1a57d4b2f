"""`ModelRunner`: turns scheduled chunks into one forward pass and returns the logits rows."""

from __future__ import annotations

import torch

from pdspark.cache.kv_cache import KVCache
from pdspark.engine.forward_batch import Chunk, build_forward_batch
from pdspark.engine.scheduler import ScheduledChunk
from pdspark.model.dsv4 import DSV4Model


class ModelRunner:
    def __init__(self, model: DSV4Model, kv: KVCache):
        self.model = model
        self.kv = kv

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Forward the step; returns fp32 logits `[number of sampling chunks, vocab]`, in chunk order."""
        batch = build_forward_batch(
            [
                Chunk(
                    c.request.pages.slot,  # type: ignore[union-attr]
                    c.start,
                    c.request.all_token_ids[c.start : c.start + c.num_tokens],
                    num_logits=1 if c.samples else 0,
                )
                for c in chunks
            ],
            self.kv,
        )
        h = self.model(batch, self.kv.pools)
        return self.model.logits(h[batch.logits_rows])
