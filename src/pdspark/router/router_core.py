"""`RouterCore`: what the HTTP and gRPC front ends share: the model's tokenizer and limits, the dispatcher and
the per-request accounting (metrics)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from pdspark.errors import RequestFailed
from pdspark.model.model_config import ModelConfig
from pdspark.model.tokenizer import Tokenizer
from pdspark.router.chat_template import ChatTemplate
from pdspark.router.dispatcher import DispatchChunk, Dispatcher
from pdspark.router.router_metrics import RouterMetrics
from pdspark.router.worker_registry import WorkerRegistry
from pdspark.types import FinishReason, SamplingParams


@dataclass
class Totals:
    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: FinishReason | None = None
    prefill_worker: str = ""
    decode_worker: str = ""


class RouterCore:
    def __init__(self, model_path: str, served_name: str, max_model_len: int, registry: WorkerRegistry,
                 dispatcher: Dispatcher, metrics: RouterMetrics):
        cfg = ModelConfig.from_dir(model_path)
        self.model_config = cfg
        self.served_name = served_name
        self.max_model_len = max_model_len
        self.tokenizer = Tokenizer.from_dir(Path(model_path), cfg.eos_token_ids)
        self.chat_template = ChatTemplate(self.tokenizer.chat_template if self.tokenizer else None)
        self.registry = registry
        self.dispatcher = dispatcher
        self.metrics = metrics

    async def run(self, api: str, request_id: str, prompt_ids: list[int], params: SamplingParams,
                  totals: Totals, timeout_s: float | None = None) -> AsyncIterator[DispatchChunk]:
        """Dispatch and account: TTFT, latency, tokens, outcome."""
        m = self.metrics
        t0 = time.perf_counter()
        m.in_flight.inc()
        outcome = "error"
        try:
            first = True
            async for chunk in self.dispatcher.generate(request_id, prompt_ids, params, timeout_s):
                if first:
                    m.ttft.observe(time.perf_counter() - t0)
                    first = False
                totals.completion_tokens = chunk.completion_tokens
                totals.cached_tokens = chunk.cached_tokens
                totals.prefill_worker, totals.decode_worker = chunk.prefill_worker, chunk.decode_worker
                if chunk.finished:
                    totals.finish_reason = chunk.finish_reason
                yield chunk
            outcome = "ok"
        except RequestFailed as e:
            outcome = e.code.value
            raise
        except (GeneratorExit, asyncio.CancelledError):
            outcome = "cancelled"  # the client went away; the dispatcher cancels both legs
            raise
        finally:
            m.in_flight.dec()
            m.e2e.observe(time.perf_counter() - t0)
            m.requests.labels(api=api, outcome=outcome).inc()
            m.prompt_tokens.inc(totals.prompt_tokens)
            m.completion_tokens.inc(totals.completion_tokens)
            m.cached_tokens.inc(totals.cached_tokens)
