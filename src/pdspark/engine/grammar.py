"""`Grammars` and `GrammarCursor`: structured outputs as a token mask, with xgrammar.

Why xgrammar (and not llguidance): it is what vLLM and SGLang ship by default, it compiles a JSON schema, regex,
EBNF or structural tag once into a grammar whose per-token masks are precomputed for the vocabulary (a step costs a
bitmask fill, ~0.1 ms for dsv4-tiny's 4k tokens), its matcher rolls back accepted tokens (what a rejected DSpark draft
needs), and it carries DeepSeek-V4's tool-call format as a structural tag. llguidance computes masks lazily (cheaper
compiles, no rollback of the same kind) and would serve as well; one library is enough.

A cursor is a matcher that follows one request's output. The mask for a position is a pure function of the output
tokens before it: the cursor's matcher stands after the committed output (it only ever moves forward), and a row
that also sees drafts is masked by a fork of it that accepts them. So the same code serves a decode step (one new
token), a DSpark verify window (row j sees the committed tokens and drafts `< j`), the drafter's own rows, the
prefill worker's first token (no output yet) and a migrated or adopted stream (a fresh cursor accepts everything
generated so far). Outputs are therefore equal across those paths, as the plain controls' are (`logits_controls`).
NOTE: forks, not `rollback`, and a mask computed at every position before its token is accepted: xgrammar 0.2.9
counts a token budget (`any_text.max_tokens`, the thinking budget) as masks are computed and does not restore it on
rollback, so every matcher is driven as plain decoding drives one (mask, accept, mask, accept, ...) whatever
DSpark's rows skip; otherwise DSpark's outputs would differ from plain decoding's (measured: by one token at the
budget's end).

JSON is generated in one fixed layout (`", "` and `": "` separators, no other whitespace; vLLM's
`disable_any_whitespace`): free whitespace lets a small model pad forever instead of closing the object.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch

from pdspark.errors import InvalidRequestError
from pdspark.types import StructuredOutputs

if TYPE_CHECKING:
    from pdspark.model.tokenizer import Tokenizer

# Compiled grammars kept per engine (a compiled JSON schema over a 4k vocabulary is tens of KiB; a real model's
# 128k vocabulary makes it MiBs): the least recently used goes first.
CACHE_ENTRIES = 64


class Grammars:
    """Compiles `StructuredOutputs` for one tokenizer and vocabulary (cached; thread-safe: workers compile on a
    helper thread ahead of the engine loop, which then finds the grammar compiled)."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, eos_ids: tuple[int, ...]):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos_ids = eos_ids
        self._compiler: Any = None
        self._cache: OrderedDict[StructuredOutputs, Any] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, so: StructuredOutputs) -> Any:
        """`so` as an xgrammar `CompiledGrammar`; raises `InvalidRequestError` naming the field for a schema,
        regex or grammar that does not compile."""
        with self._lock:
            hit = self._cache.get(so)
            if hit is not None:
                self._cache.move_to_end(so)
                return hit
            compiler = self._compiler or self._new_compiler()
        compiled = _compile(compiler, so)  # (outside the lock: a long compile holds up no other request)
        with self._lock:
            self._cache[so] = compiled
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return compiled

    def cursor(self, so: StructuredOutputs) -> GrammarCursor:
        return GrammarCursor(self.compile(so), self.vocab_size)

    def _new_compiler(self) -> Any:
        """xgrammar's compiler for this vocabulary (imported here: it loads transformers, ~2 s, which a worker that
        never sees a structured request should not pay)."""
        if self._tokenizer is None:
            raise InvalidRequestError("structured outputs need the model's tokenizer, and this engine has none",
                                      field="structured_outputs")
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        raw = self._tokenizer.backend
        # xgrammar reads the vocabulary's kind (byte-level, byte-fallback, raw) from a transformers tokenizer.
        stops = [t for t in self._eos_ids if t < self.vocab_size]
        detected = xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=raw),  # type: ignore[no-untyped-call]
                                                      vocab_size=self.vocab_size, stop_token_ids=stops)
        # Special tokens spelled as empty strings: xgrammar then never lets one stand for its text (`<|end|>` inside a
        # JSON string); the model's EOS ids end a completed grammar.
        special = {i for i, t in raw.get_added_tokens_decoder().items() if t.special}
        vocab = [""] * self.vocab_size
        for token, i in raw.get_vocab(with_added_tokens=True).items():
            if i < self.vocab_size and i not in special:
                vocab[i] = token
        info = xgr.TokenizerInfo(vocab, detected.vocab_type, vocab_size=self.vocab_size,
                                 stop_token_ids=stops,
                                 add_prefix_space=detected.add_prefix_space)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler


def _compile(compiler: Any, so: StructuredOutputs) -> Any:
    field = f"structured_outputs.{so.kind}"
    try:
        if so.kind == "json":
            return compiler.compile_json_schema(so.spec, any_whitespace=False, strict_mode=True)
        if so.kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if so.kind == "regex":
            return compiler.compile_regex(so.spec)
        if so.kind == "choice":
            return compiler.compile_regex("|".join(_regex_literal(c) for c in json.loads(so.spec)))
        if so.kind == "grammar":
            return compiler.compile_grammar(so.spec)
        import xgrammar as xgr

        return compiler.compile_structural_tag(xgr.StructuralTag.model_validate_json(so.spec))
    except (RuntimeError, ValueError, TypeError) as e:
        # xgrammar reports a bad schema / regex / grammar as a RuntimeError that starts with its C++ source location.
        message = str(e).split("] ", 1)[-1].splitlines()[0] if str(e) else type(e).__name__
        raise InvalidRequestError(f"invalid `{field}`: {message[:300]}", field=field) from e


def _regex_literal(text: str) -> str:
    """`text` as a regex that matches exactly it."""
    return "".join("\\" + c if c in r"\^$.|?*+()[]{}/" else c for c in text)


class GrammarCursor:
    """One request's matcher, following its output (see the module doc)."""

    def __init__(self, compiled: Any, vocab_size: int):
        import xgrammar as xgr

        self._xgr = xgr
        self._compiled = compiled
        self._matcher = xgr.GrammarMatcher(compiled)  # after `_committed`
        self._committed: list[int] = []
        self._masked = False  # the matcher's mask at its position has been computed
        self._broken = False  # a committed token the grammar refuses (past its end with `ignore_eos`): no more masks
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)  # [1, ceil(V / 32)] int32
        self._scratch = xgr.allocate_token_bitmask(1, vocab_size)

    def constrain(self, logits: torch.Tensor, output: list[int], committed: int) -> None:
        """Set to -inf, in place, the `logits [1, V]` of every token the grammar does not allow after `output`, of
        which the first `committed` tokens are the request's committed output (they never change; the rest are
        drafts). An `output` the grammar rejects (a verify row after a draft it refuses: that row's token is
        discarded whatever it is) or that it has ended (a row after a draft EOS, discarded too) leaves the logits
        as they are."""
        if not self._commit(output[:committed]) or self._matcher.is_terminated():
            return
        if not self._masked:
            self._matcher.fill_next_token_bitmask(self._bitmask)
            self._masked = True
        if len(output) == committed:
            self._xgr.apply_token_bitmask_inplace(logits, self._bitmask)
            return
        fork = self._matcher.fork()
        for k, token in enumerate(output[committed:]):
            if k:  # (the mask of every position before its token, as plain decoding computes them)
                if fork.is_terminated():
                    return
                fork.fill_next_token_bitmask(self._scratch)
            if not fork.accept_token(token):
                return
        if fork.is_terminated():
            return
        fork.fill_next_token_bitmask(self._scratch)
        self._xgr.apply_token_bitmask_inplace(logits, self._scratch)

    def _commit(self, committed: list[int]) -> bool:
        """Move the matcher forward through the newly committed tokens; False once one was refused."""
        done = self._committed
        if committed[: len(done)] != done:  # (committed tokens never change: a new cursor's job, kept as a guard)
            self._matcher, self._committed, self._masked, self._broken = (
                self._xgr.GrammarMatcher(self._compiled), [], False, False)
            done = self._committed
        for token in committed[len(done):]:
            if self._broken:
                break
            if not self._masked and not self._matcher.is_terminated():
                self._matcher.fill_next_token_bitmask(self._scratch)
            self._masked = False
            if not self._matcher.accept_token(token):
                self._broken = True
            done.append(token)
        return not self._broken
