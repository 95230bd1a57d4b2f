"""`LLM`: the offline API. Load a checkpoint once, then `generate` batches of prompts.

```python
llm = LLM("/path/to/checkpoint")
outs = llm.generate(["def fib(n):"], SamplingParams(temperature=0.0, max_tokens=64))
```
"""

from __future__ import annotations

import importlib.resources
from collections.abc import Sequence

from pdspark.config import CacheConfig, EngineConfig, SchedulerConfig
from pdspark.engine.engine import Engine
from pdspark.errors import InvalidRequestError
from pdspark.model.loader import load_checkpoint, load_draft
from pdspark.types import RequestOutput, SamplingParams


class LLM:
    def __init__(
        self,
        model: str,
        *,
        max_model_len: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        page_size: int = 64,
        c128_page_size: int = 0,
        num_full_pages: int | None = None,
        num_swa_pages: int | None = None,
        num_c128_pages: int | None = None,
        enable_prefix_cache: bool = True,
        dtype: str = "float32",
        device: str = "cpu",
        seed: int = 0,
        speculative: str | None = None,
        num_speculative_tokens: int | None = None,
        progress: bool = False,
    ):
        from pdspark.model.model_config import ModelConfig

        path = resolve_model(model)
        model_cfg = ModelConfig.from_dir(path)
        max_len = max_model_len or min(4096, model_cfg.max_position_embeddings)
        self.config = EngineConfig(
            cache=CacheConfig(
                page_size=page_size,
                c128_page_size=c128_page_size,
                num_full_pages=num_full_pages,
                num_swa_pages=num_swa_pages,
                num_c128_pages=num_c128_pages,
                enable_prefix_cache=enable_prefix_cache,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_len
            ),
            device=device,
            dtype=dtype,
            seed=seed,
            speculative=speculative,
            num_speculative_tokens=num_speculative_tokens,
        )
        ckpt = load_checkpoint(path, max_len, dtype=dtype, device=device, progress=progress)
        draft = load_draft(ckpt, max_len, dtype, device) if speculative else None
        self.tokenizer = ckpt.tokenizer
        self.engine = Engine(ckpt.model, self.config, ckpt.tokenizer, draft)

    def generate(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order."""
        texts, ids = self._prompts(prompts, prompt_token_ids)
        params = sampling_params if sampling_params is not None else SamplingParams()
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(ids)
        if len(params_list) != len(ids):
            raise InvalidRequestError(f"{len(params_list)} sampling params for {len(ids)} prompts")
        for p_ids, p in zip(ids, params_list):
            self.engine.validate(p_ids, p)
        req_ids = [self.engine.add_request(i, p, prompt=t) for i, p, t in zip(ids, params_list, texts)]
        try:
            while self.engine.has_unfinished:
                self.engine.step()
        except BaseException:
            for r in req_ids:
                self.engine.abort(r)
            raise
        outputs = [self.engine.output(self.engine.requests[r]) for r in req_ids]
        for r in req_ids:
            self.engine.release(r)
        return outputs

    def flush_cache(self) -> None:
        """Empty the prefix cache (entries in use by running requests stay)."""
        self.engine.flush_cache()

    def _prompts(self, prompts, prompt_token_ids) -> tuple[list[str | None], list[list[int]]]:
        if (prompts is None) == (prompt_token_ids is None):
            raise InvalidRequestError("pass exactly one of `prompts` or `prompt_token_ids`")
        if prompt_token_ids is not None:
            ids = [list(p) for p in prompt_token_ids]
            return [None] * len(ids), ids
        texts = [prompts] if isinstance(prompts, str) else list(prompts)
        if self.tokenizer is None:
            raise InvalidRequestError("this checkpoint ships no tokenizer; pass `prompt_token_ids` instead")
        return texts, [self.tokenizer.encode(t) for t in texts]


SHIPPED_MODELS = ("dsv4-tiny",)


def resolve_model(model: str) -> str:
    """A checkpoint directory for `model`: a path, or the name of a model shipped inside the package."""
    if model in SHIPPED_MODELS:
        return str(importlib.resources.files("pdspark") / "assets" / model)
    return model
