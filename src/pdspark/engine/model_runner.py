"""`ModelRunner`: one forward pass of the target over a step's chunks."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from pdspark.cache.kv_cache import KVCache
from pdspark.engine.fast_path_fallbacks import FastPathFallbacks
from pdspark.engine.forward_batch import (
    DENSE_MIN_TOKENS,
    Chunk,
    build_forward_batch,
    index_layout,
    index_request,
    logits_rows,
)
from pdspark.hardware.cpu import kernels as cpu_kernels
from pdspark.hardware.prepare_streams import PrepareStreams, use_prepare_streams
from pdspark.model.cpu.decode_step import MAX_TOKENS
from pdspark.model.dsv4 import DSV4Model
from pdspark.parallel.token_exchange import TokenExchange


class RunOutput(NamedTuple):
    logits: torch.Tensor  # [sum of num_logits, vocab] fp32, chunk by chunk
    features: torch.Tensor | None  # [T, D * L] drafter features of every token row (when captured)
    positions: torch.Tensor  # [T] int64 position of every token row
    # [T] int64 SWA slot of every token row (where the drafter's context row goes). Where the step's indices were
    # built in C, these and `features` are views of buffers the next step overwrites: use them before it runs.
    swa_slots: torch.Tensor


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
        self.fallbacks = FastPathFallbacks()  # decode/verify steps the C step did not run, by reason
        exchange = model.expert_exchange
        if isinstance(exchange, TokenExchange):  # DP-attention: other ranks' rows on the threads of their steps
            exchange.threads_for = self.threads_for
        # Small steps on the CPU (decode, and DSpark verify steps with their captured features): indices built in C
        # from the page tables and every layer in one call.
        self.layout = index_layout(kv) if kv.pools.swa_kv.device.type == "cpu" else None
        if self.layout is not None:
            # The C steps run on the engine's threads too: MKL's for long chunks, the kernels' helper for the weight
            # GEMMs of decode and verify steps (run below with one torch thread: MKL's threads cost more than they
            # give on a few rows).
            cpu_kernels.set_threads(self.threads)

    @torch.inference_mode()
    def run(self, chunks: list[Chunk]) -> RunOutput:
        if self.kv.pools.swa_kv.device.type == "cpu":
            want = self.threads_for(sum(len(c.token_ids) for c in chunks))
            if torch.get_num_threads() != want:
                torch.set_num_threads(want)
        if self.layout is not None:
            out = self._run_indexed(chunks)
            if isinstance(out, RunOutput):
                return out
            fallback = out
        else:
            fallback = "device"
        if fallback is not None and all(c.kind != "extend" for c in chunks):
            self.fallbacks.note(fallback, lambda: self._fallback_detail(fallback, chunks))
        batch = build_forward_batch(chunks, self.kv)
        if self.streams is not None and use_prepare_streams([c.kind for c in chunks], batch.num_tokens,
                                                            self.stream_rows):
            batch = dataclasses.replace(batch, prepare_streams=self.streams)
        out = self.model(batch, self.kv.pools, self.capture)
        return RunOutput(self.model.logits(out.hidden[batch.logits_rows]), out.features, batch.positions,
                         batch.swa_slots)

    def threads_for(self, tokens: int) -> int:
        """The intra-op threads a step of `tokens` rows runs on."""
        return 1 if tokens <= SMALL_STEP_TOKENS else self.threads

    def _fallback_detail(self, reason: str, chunks: list[Chunk]) -> str:
        tokens = sum(len(c.token_ids) for c in chunks)
        return {
            "model": f"the model has no C decode step: {self.model.decode_step_off}",
            "step_tokens": f"a step of {tokens} token rows (the C step takes at most {MAX_TOKENS})",
            "pools": "the KV pools are neither fp32 CPU rows (the indexer's keys in blocks or not) nor the FP8 "
                     "cache's packed rows, or the drafter captures a layer twice",
            "device": f"the engine runs on {self.kv.pools.swa_kv.device.type}, not the CPU",
            "multi_stream": f"the multi-stream prepare takes steps of at most {self.stream_rows} rows",
        }[reason]

    def _run_indexed(self, chunks: list[Chunk]) -> RunOutput | str | None:
        """A decode/verify step through `DSV4Model.forward_indexed`; else why not (a `FastPathFallbacks` reason),
        or None for a step the C path is not meant for (a long chunk: BLAS serves it better)."""
        tokens = 0
        for c in chunks:
            if len(c.token_ids) >= DENSE_MIN_TOKENS:
                return None
            tokens += len(c.token_ids)
        if tokens > MAX_TOKENS:
            return "step_tokens"
        if self.streams is not None and use_prepare_streams([c.kind for c in chunks], tokens, self.stream_rows):
            return "multi_stream"
        assert self.layout is not None
        out = self.model.forward_indexed(index_request(chunks), self.layout, self.kv.pools, self.capture)
        if out is None:
            return "model" if self.model.decode_step_off is not None else "pools"
        hidden = out.hidden
        rows = logits_rows(chunks)
        first = rows[0] if rows else 0
        picked = hidden[first : first + len(rows)] if rows == list(range(first, first + len(rows))) else hidden[rows]
        return RunOutput(self.model.logits(picked), out.features, out.positions, out.swa_slots)
