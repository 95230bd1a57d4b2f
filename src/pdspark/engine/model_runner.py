"""`ModelRunner`: one forward pass of the target over a step's chunks."""

from __future__ import annotations

from typing import NamedTuple

import torch

from pdspark.cache.kv_cache import KVCache
from pdspark.engine.forward_batch import Chunk, ForwardBatch, build_forward_batch
from pdspark.model.dsv4 import DSV4Model


class RunOutput(NamedTuple):
    logits: torch.Tensor  # [sum of num_logits, vocab] fp32, chunk by chunk
    features: torch.Tensor | None  # [T, D * L] drafter features of every token row (when captured)
    batch: ForwardBatch


class ModelRunner:
    def __init__(self, model: DSV4Model, kv: KVCache, capture: tuple[int, ...] = ()):
        self.model = model
        self.kv = kv
        self.capture = capture

    @torch.inference_mode()
    def run(self, chunks: list[Chunk]) -> RunOutput:
        batch = build_forward_batch(chunks, self.kv)
        out = self.model(batch, self.kv.pools, self.capture)
        return RunOutput(self.model.logits(out.hidden[batch.logits_rows]), out.features, batch)
