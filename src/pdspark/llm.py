"""`LLM`: the offline API. Load a checkpoint once, then `generate` batches of prompts.

```python
llm = LLM("/path/to/checkpoint")
outs = llm.generate(["def fib(n):"], SamplingParams(temperature=0.0, max_tokens=64))
```
"""

from __future__ import annotations

from collections.abc import Sequence

from pdspark.assets import resolve_model  # noqa: F401  (public helper)
from pdspark.config import EngineConfig
from pdspark.engine.engine import Engine
from pdspark.engine.engine_group import start_engine_group
from pdspark.engine.factory import create_engine
from pdspark.engine.lockstep import LockstepEngine
from pdspark.errors import InvalidRequestError
from pdspark.options import build
from pdspark.types import RequestOutput, SamplingParams


class LLM:
    """Keyword options are the fields of `pdspark.config.EngineConfig` and the cache and scheduler configs it
    composes, flat (pool sizes, scheduler limits, dtype, seed, `speculative="dspark"`, `enable_prefix_cache`, ...);
    `pdspark generate --help` lists them all. Or pass a whole `config=EngineConfig(...)`.

    `ep_size=N` (> 1) runs the engine as an expert-parallel group: this process is rank 0 and N - 1 child processes
    hold the other shares of the routed experts (the same tokens and logits as one process). By default every rank
    runs the same batch; `dp_attention=True` places each request on one rank (its attention, pages and sampling
    there) and the ranks exchange token rows at each MoE layer. One group per process; `close()` (or
    `with LLM(...) as llm:`) ends it."""

    def __init__(self, model: str, *, progress: bool = False, config: EngineConfig | None = None, **options):
        self.engine: Engine | LockstepEngine
        if build(EngineConfig, options, base=config).parallel.ep_size > 1:
            # A group: this process is rank 0, the other ranks are child processes (`close` ends them).
            self.engine = start_engine_group(model, progress, config, options)
        else:
            self.engine = create_engine(model, progress=progress, config=config, **options)
        self.config = self.engine.config
        self.tokenizer = self.engine.tokenizer

    def close(self) -> None:
        """End the worker group's other ranks (`ep_size` > 1); nothing to do for one process. Also run when the
        object is collected or the interpreter exits."""
        if isinstance(self.engine, LockstepEngine):
            self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
        req_ids: list[str] = []
        try:
            for i, p, t in zip(ids, params_list, texts):
                req_ids.append(self.engine.add_request(i, p, prompt=t))
            while self.engine.has_unfinished:
                self.engine.step()
        except BaseException:
            for r in req_ids:  # (a failed group's ranks are gone: only rank 0's own requests remain to tidy)
                self.engine.abort(r)
                self.engine.release(r)
            raise
        outputs = [self.engine.final_output(r) for r in req_ids]
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
        if not all(isinstance(t, str) for t in texts):
            raise InvalidRequestError("`prompts` must be strings; pass token ids as `prompt_token_ids` instead")
        if self.tokenizer is None:
            raise InvalidRequestError("this checkpoint ships no tokenizer; pass `prompt_token_ids` instead")
        ids = [self.tokenizer.encode(t) for t in texts]
        return list[str | None](texts), ids
