"""`OfflineReference`: the bottom rung of the equality ladder, built once and asked many times.

Every serving path (P/D, DSpark, migration, the router's APIs) must produce the tokens of one offline engine run on
the same prompt and sampling. Building that engine costs a model load and generating costs real steps, so one
reference serves a whole test session: engines are kept per (model, engine options), outputs per (engine, prompt,
sampling). An output does not depend on the batch it ran in (the engine's row-exact kernels), so a cached one is the
one a fresh run would give.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdspark.llm import LLM
from pdspark.types import SamplingParams

# Small pools and a short context: the references are short prompts, and several engines may be alive at once.
DEFAULT_OPTIONS: dict[str, Any] = dict(page_size=16, max_model_len=256, max_num_seqs=16, max_num_batched_tokens=256)


@dataclass(frozen=True)
class Reference:
    """One prompt's uninterrupted output."""

    token_ids: list[int]
    text: str


class OfflineReference:
    def __init__(self) -> None:
        self._engines: dict[tuple, LLM] = {}
        self._outputs: dict[tuple, Reference] = {}

    def engine(self, model: str, **options: Any) -> LLM:
        """The offline engine of `model` with `options` over `DEFAULT_OPTIONS`, built on first use."""
        key = _engine_key(model, options)
        if key not in self._engines:
            self._engines[key] = LLM(str(model), **{**DEFAULT_OPTIONS, **options})
        return self._engines[key]

    def outputs(self, model: str, prompts: Sequence[str | Sequence[int]],
                params: SamplingParams | Sequence[SamplingParams], **options: Any) -> list[Reference]:
        """Each prompt's output (text, or token ids) under its `params` (one for all, or one per prompt)."""
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        assert len(params_list) == len(prompts), f"{len(params_list)} sampling params for {len(prompts)} prompts"
        engine_key = _engine_key(model, options)
        keys = [(engine_key, p if isinstance(p, str) else tuple(p), repr(sp)) for p, sp in zip(prompts, params_list)]
        missing = [i for i, k in enumerate(keys) if k not in self._outputs]
        if missing:
            llm = self.engine(model, **options)
            for i, out in zip(missing, self._generate(llm, [prompts[i] for i in missing],
                                                      [params_list[i] for i in missing])):
                self._outputs[keys[i]] = Reference(list(out.token_ids), out.text or "")
        return [self._outputs[k] for k in keys]

    @staticmethod
    def _generate(llm: LLM, prompts: list[str | Sequence[int]], params: list[SamplingParams]) -> list:
        """One batch: texts and token-id prompts go apart (`LLM.generate` takes one kind per call)."""
        outs: list = [None] * len(prompts)
        texts = {i: p for i, p in enumerate(prompts) if isinstance(p, str)}
        ids = {i: list(p) for i, p in enumerate(prompts) if not isinstance(p, str)}
        if texts:
            for i, out in zip(texts, llm.generate(list(texts.values()), [params[i] for i in texts])):
                outs[i] = out
        if ids:
            for i, out in zip(ids, llm.generate(prompt_token_ids=list(ids.values()),
                                                sampling_params=[params[i] for i in ids])):
                outs[i] = out
        return outs

    def output(self, model: str, prompt: str | Sequence[int], params: SamplingParams, **options: Any) -> Reference:
        return self.outputs(model, [prompt], params, **options)[0]


def _engine_key(model: str, options: dict[str, Any]) -> tuple:
    return (str(model), tuple(sorted({**DEFAULT_OPTIONS, **options}.items())))
