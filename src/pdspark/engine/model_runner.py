"""`ModelRunner`: one forward pass of the target over a step's chunks."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from pdspark.cache.kv_cache import KVCache
from pdspark.engine.forward_batch import Chunk, build_forward_batch
from pdspark.hardware.prepare_streams import PrepareStreams, use_prepare_streams
from pdspark.model.batch import ForwardBatch
from pdspark.model.dsv4 import DSV4Model


class RunOutput(NamedTuple):
    logits: torch.Tensor  # [sum of num_logits, vocab] fp32, chunk by chunk
    features: torch.Tensor | None  # [T, D * L] drafter features of every token row (when captured)
    batch: ForwardBatch


# Steps of at most this many tokens run on one intra-op thread: their ops are too small to split, and waking a
# second thread costs more than it saves (measured on 2-core CPUs; larger steps use every configured thread).
SMALL_STEP_TOKENS = 32


class ModelRunner:
    def __init__(self, model: DSV4Model, kv: KVCache, capture: tuple[int, ...] = (),
                 streams: PrepareStreams | None = None, stream_rows: int = 0):
        self.model = model
        self.kv = kv
        self.capture = capture
        self.threads = torch.get_num_threads()
        self.streams = streams  # side streams of the multi-stream prepare (None: off)
        self.stream_rows = stream_rows  # its row limit

    @torch.inference_mode()
    def run(self, chunks: list[Chunk]) -> RunOutput:
        if self.kv.pools.swa_kv.device.type == "cpu":
            tokens = sum(len(c.token_ids) for c in chunks)
            want = 1 if tokens <= SMALL_STEP_TOKENS else self.threads
            if torch.get_num_threads() != want:
                torch.set_num_threads(want)
        batch = build_forward_batch(chunks, self.kv)
        if self.streams is not None and use_prepare_streams([c.kind for c in chunks], batch.num_tokens,
                                                            self.stream_rows):
            batch = dataclasses.replace(batch, prepare_streams=self.streams)
        out = self.model(batch, self.kv.pools, self.capture)
        return RunOutput(self.model.logits(out.hidden[batch.logits_rows]), out.features, batch)
