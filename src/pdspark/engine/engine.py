"""`Engine`: the offline serving loop. One `step()` is `schedule -> run -> sample -> update`."""

from __future__ import annotations

import itertools
import math

import torch

from pdspark.cache.kv_cache import KVCache
from pdspark.config import EngineConfig, PoolSizes
from pdspark.engine.model_runner import ModelRunner
from pdspark.engine.request import Request, RequestStatus
from pdspark.engine.sampler import Sampler
from pdspark.engine.scheduler import ScheduledChunk, Scheduler
from pdspark.engine.stop_checker import StopChecker
from pdspark.errors import CapacityError, InvalidRequestError
from pdspark.model.dsv4 import DSV4Model
from pdspark.model.tokenizer import Tokenizer
from pdspark.types import FINISH_ABORT, RequestOutput, SamplingParams


class Engine:
    def __init__(self, model: DSV4Model, config: EngineConfig, tokenizer: Tokenizer | None = None):
        self.config = config
        self.model_config = model.cfg
        self.tokenizer = tokenizer
        self.sizes = PoolSizes.derive(model.cfg, config.cache, config.scheduler)
        dtype = getattr(torch, config.dtype)
        self.kv = KVCache(model.cfg, self.sizes, dtype, config.device, config.cache.enable_prefix_cache)
        self.scheduler = Scheduler(config.scheduler, self.kv)
        self.runner = ModelRunner(model, self.kv)
        self.sampler = Sampler(config.seed)
        self.stop_checker = StopChecker(tokenizer, model.cfg.eos_token_ids, config.scheduler.max_model_len)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()

    # ---- requests ---------------------------------------------------------------------------------------------------
    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        prompt: str | None = None,
    ) -> str:
        """Queue a request; raises `InvalidRequestError` / `CapacityError` for one that can never be served."""
        req_id = request_id if request_id is not None else str(next(self._ids))
        if req_id in self.requests:
            raise InvalidRequestError(f"duplicate request id {req_id!r}")
        self._validate(prompt_token_ids, params)
        req = Request(req_id, list(prompt_token_ids), params, prompt=prompt)
        self.requests[req_id] = req
        self.scheduler.add(req)
        return req_id

    def _validate(self, ids: list[int], params: SamplingParams) -> None:
        max_len = self.config.scheduler.max_model_len
        vocab = self.model_config.vocab_size
        if not ids:
            raise InvalidRequestError("empty prompt: a request needs at least one token")
        if len(ids) >= max_len:
            raise InvalidRequestError(
                f"prompt has {len(ids)} tokens; `max_model_len` is {max_len} (prompt must be shorter, to leave "
                "room for at least one generated token)"
            )
        bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise InvalidRequestError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        total = min(len(ids) + params.max_tokens, max_len)
        need = math.ceil(total / self.sizes.page_size)
        if need > self.sizes.num_full_pages:
            raise CapacityError(
                f"request needs {need} pages of {self.sizes.page_size} tokens; the pool has "
                f"{self.sizes.num_full_pages} in all"
            )

    def abort(self, request_id: str) -> bool:
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return False
        req.finish_reason = FINISH_ABORT
        self.scheduler.finish(req)
        return True

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    # ---- the loop ---------------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One forward pass; returns outputs of requests that got a token this step (finished ones flagged)."""
        sched = self.scheduler.schedule()
        if sched.empty:
            assert not self.scheduler.running, "running requests but nothing scheduled"
            return []
        logits = self.runner.run(sched.chunks)
        self.scheduler.update(sched.chunks)
        return self._append_tokens([c for c in sched.chunks if c.samples], logits)

    def _append_tokens(self, chunks: list[ScheduledChunk], logits: torch.Tensor) -> list[RequestOutput]:
        reqs = [c.request for c in chunks]
        tokens = self.sampler.sample(logits, [r.params for r in reqs], [r.generator for r in reqs])
        outputs = []
        for i, (req, token) in enumerate(zip(reqs, tokens)):
            req.output_token_ids.append(token)
            if req.logprobs is not None:
                req.logprobs += Sampler.logprobs(logits[i : i + 1], [token], req.params.logprobs or 0)
            if self.stop_checker.check(req):
                self.scheduler.finish(req)
            outputs.append(self.output(req))
        return outputs

    def output(self, req: Request) -> RequestOutput:
        return RequestOutput(
            request_id=req.req_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            token_ids=list(req.output_token_ids),
            text=req.text,
            finished=req.status == RequestStatus.FINISHED,
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
            num_cached_tokens=req.num_cached_tokens,
            logprobs=list(req.logprobs) if req.logprobs is not None else None,
        )

    def release(self, request_id: str) -> None:
        """Forget a finished request."""
        req = self.requests.pop(request_id)
        assert req.finished

    def flush_cache(self) -> None:
        """Drop every prefix-cache entry no running request is using."""
        self.kv.flush_prefix_cache()

    def check_integrity(self) -> None:
        self.kv.check_integrity()
