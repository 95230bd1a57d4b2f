"""`apply_controls`: a request's sampling controls on one position's logits, before the temperature and the filters
(the order of vLLM's sampler): the logit bias, banned tokens and `min_tokens` first, then the penalties.

- `logit_bias`: added to the token's logit; `banned_token_ids`: -inf.
- `min_tokens`: while fewer output tokens than that precede the position, EOS and the stop token ids are -inf.
- `repetition_penalty` r (CTRL's, as HF/vLLM apply it): every token in the prompt or the output so far gets its
  logit divided by r when positive, multiplied by r otherwise.
- `frequency_penalty` f and `presence_penalty` p (OpenAI's): minus `f * count + p * (count > 0)` for each token's
  count in the output so far (the prompt does not count).

Each depends only on the logits row and the tokens before its position, so a DSpark verify row (whose history is the
committed tokens plus the drafts before it) gets exactly what plain decoding would give that position: outputs stay
equal with speculation on and off, and across P/D and migration (the prefill worker samples the first output token
with the prompt as its history, the decode worker the rest).
"""

from __future__ import annotations

import torch

from pdspark.types import SamplingParams


def apply_controls(logits: torch.Tensor, params: SamplingParams, history: list[int], prompt_len: int,
                   eos_ids: tuple[int, ...]) -> torch.Tensor:
    """`logits [V]` fp32 for the position after `history` (the prompt's `prompt_len` tokens, then the output so
    far) -> a new `[V]` tensor with `params`' controls applied."""
    out = logits.clone()
    V = out.shape[0]
    if params.logit_bias:
        ids = torch.tensor([t for t in params.logit_bias if t < V], dtype=torch.long)
        out[ids] += torch.tensor([params.logit_bias[t] for t in ids.tolist()], dtype=out.dtype)
    if params.banned_token_ids:
        out[torch.tensor([t for t in params.banned_token_ids if t < V], dtype=torch.long)] = float("-inf")
    output = history[prompt_len:]
    if params.min_tokens and len(output) < params.min_tokens:
        ends = [t for t in (*eos_ids, *params.stop_token_ids) if t < V]
        out[torch.tensor(ends, dtype=torch.long)] = float("-inf")
    if params.repetition_penalty != 1.0 and history:
        seen = torch.tensor(sorted(set(history)), dtype=torch.long)
        vals = out[seen]
        out[seen] = torch.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
    if (params.frequency_penalty or params.presence_penalty) and output:
        counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=V)[:V].to(out.dtype)
        out -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(out.dtype)
    return out
