"""What the router does with a prompt before its tokens exist: refuse one too long for the context by its length
alone (`too_long_for_context`), and tokenize it, chat template included, off the event loop (`PromptWork`).

NOTE: why off the loop. Tokenizing costs about 1 us a character (seconds for the 4 Mi characters a request may
hold), and the front ends share one event loop: tokenized there, one long prompt stalls every other request's
stream for as long. A small bounded pool of threads does it instead. The tokenizer releases the GIL for long texts
(`Tokenizer.encode`) and the rest of the parsing (a chat template, the token-id checks) is Python, which yields the
GIL to the loop every switch interval, so the loop keeps serving meanwhile. A small prompt is parsed on the loop:
the hop to a thread would cost more than its tokens do.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

# A prompt of at most this many characters (or token ids) is parsed on the loop: about 2 ms of tokenizing.
OFF_LOOP_WEIGHT = 2048
# Threads parsing long prompts at once; more wait for one. A core is left to the event loop (the tokenizer's Rust
# code runs beside it, GIL released), and a few suffice: a long prompt is rare, and its parsing is seconds at most.
PROMPT_THREADS = max(1, min(4, (os.cpu_count() or 2) - 1))


def fewest_tokens(chars: int, max_token_chars: int | None) -> int:
    """The fewest tokens a text of `chars` characters can be, for a tokenizer whose token stands for at most
    `max_token_chars` characters (`Tokenizer.max_token_chars`; None: no bound, 0)."""
    return -(-chars // max_token_chars) if max_token_chars else 0


def too_long_for_context(param: str, chars: int, max_token_chars: int | None, max_model_len: int) -> str | None:
    """Why a prompt of `chars` characters, given in the field `param`, is refused whatever its tokens (as a prompt
    of `max_model_len` tokens or more is, once tokenized); None when its length alone does not settle it."""
    fewest = fewest_tokens(chars, max_token_chars)
    if fewest < max_model_len:
        return None
    return (f"This model's maximum context length is {max_model_len} tokens; the prompt (`{param}`) has {chars} "
            f"characters, at least {fewest} tokens for its tokenizer (a token stands for at most {max_token_chars} "
            f"characters), which leaves no room to generate")


class PromptWork:
    """The bounded pool that parses long prompts (tokenizing, rendering a chat template) off the event loop."""

    def __init__(self, threads: int = PROMPT_THREADS):
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="pdspark-prompt")

    async def run(self, weight: int, parse: Callable[..., T], *args: object) -> T:
        """`parse(*args)`: on the loop when `weight` (the prompt's characters or token ids) is small, else on the
        pool. `parse` must touch nothing the loop's thread changes meanwhile (it reads its arguments only)."""
        if weight <= OFF_LOOP_WEIGHT:
            return parse(*args)
        return await asyncio.get_running_loop().run_in_executor(self._pool, parse, *args)

    def close(self) -> None:
        """Stop the pool: queued work is dropped, work under way finishes on its thread."""
        self._pool.shutdown(wait=False, cancel_futures=True)
