"""The tokenizer endpoints in vLLM's shapes: `POST /tokenize`, `POST /detokenize`, `GET /tokenizer_info` (what
lm-evaluation-harness's `tokenizer_backend=remote` and other clients of vLLM call to count and split text the way the
served model does). Each answer is the router's own tokenizer's (the one its completions use); a text too long for
any request, an unknown model or token ids outside the vocabulary are a 400/404 naming the field."""

from __future__ import annotations

from typing import Any

from pdspark.router.openai.api_error import ApiError
from pdspark.router.openai.openai_protocol import ServedModel, check_model
from pdspark.router.openai.tokenize_request import DetokenizeRequest, TokenizeRequest

# `tokenizer_config.json` entries `/tokenizer_info` passes on (special tokens as their text, flags, the class).
_INFO_KEYS = ("tokenizer_class", "bos_token", "eos_token", "pad_token", "unk_token", "mask_token",
              "additional_special_tokens", "add_bos_token", "add_eos_token", "clean_up_tokenization_spaces")


def _tokenizer(served: ServedModel, param: str):
    if served.tokenizer is None:
        raise ApiError(400, "this model has no tokenizer (its checkpoint ships no tokenizer.json)", param)
    return served.tokenizer


def tokenize(req: TokenizeRequest, served: ServedModel) -> dict[str, Any]:
    """`{"count", "max_model_len", "tokens", "token_strs"}` for a text or chat messages."""
    check_model(req.model, served)
    if (req.prompt is None) == (req.messages is None):
        raise ApiError(400, "give `prompt` (a text) or `messages` (chat messages), one of them", "prompt")
    param = "prompt" if req.prompt is not None else "messages"
    tok = _tokenizer(served, param)
    if req.messages is not None:
        assert served.chat_template is not None  # (a router with a tokenizer has a template, its own or the default)
        text = served.chat_template.render([{"role": m.role, "content": m.text()} for m in req.messages],
                                           add_generation_prompt=req.add_generation_prompt)
        special = bool(req.add_special_tokens)  # the template writes its own special tokens
    else:
        assert req.prompt is not None
        text, special = req.prompt, req.add_special_tokens is not False
    ids = tok.encode(text, add_special_tokens=special)
    strs = [tok.id_to_token(i) for i in ids] if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": served.max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(req: DetokenizeRequest, served: ServedModel) -> dict[str, Any]:
    """`{"prompt"}`: the text of token ids (special tokens kept: what was tokenized comes back whole)."""
    check_model(req.model, served)
    tok = _tokenizer(served, "tokens")
    bad = [t for t in req.tokens if t >= served.vocab_size]
    if bad:
        raise ApiError(400, f"`tokens`: token ids {bad[:5]} are outside the vocabulary [0, {served.vocab_size})",
                       "tokens")
    return {"prompt": tok.decode(list(req.tokens), skip_special_tokens=False)}


def tokenizer_info(served: ServedModel) -> dict[str, Any]:
    """The tokenizer's configuration: special tokens (as text), its chat template, the context it serves."""
    tok = _tokenizer(served, "tokenizer")
    info: dict[str, Any] = {}
    for key in _INFO_KEYS:
        value = tok.config.get(key)
        if isinstance(value, dict):  # an AddedToken spelled out: its text
            value = value.get("content")
        if value is not None:
            info[key] = value
    if "eos_token" not in info and tok.eos_token_ids:
        info["eos_token"] = tok.id_to_token(tok.eos_token_ids[0])
    info.update(chat_template=served.chat_template.source if served.chat_template is not None else None,
                model_max_length=served.max_model_len, vocab_size=served.vocab_size,
                eos_token_ids=list(tok.eos_token_ids))
    return info
