"""Stop strings through the whole serving path, in one process: the router's gRPC and HTTP front ends over its real
dispatcher, a prefill and two decode workers (gRPC servers, `dsv4-tiny` engines with DSpark, in-process transfer).
Streamed or not, over the SDK, completions or chat SSE, and across a migration, the text a client puts together is
exactly the offline engine's text for the same request: no part of a matched stop string, nothing held back lost
or sent twice; the token ids come as generated.

The stop strings are cut out of the request's own greedy output, many tokens long and starting inside a token, so
that the decode worker's outputs end inside them (a DSpark step commits at most gamma + 1 tokens).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading

import openai
import pytest

from pdspark import SamplingParams
from pdspark.assets import resolve_model
from pdspark.client import Client
from pdspark.config import RouterConfig, WorkerConfig
from pdspark.errors import ErrorCode, RequestFailed
from pdspark.options import build
from pdspark.router.dispatcher import Dispatcher
from pdspark.router.router_core import RouterCore
from pdspark.router.router_metrics import RouterMetrics
from pdspark.router.workers.worker_registry import WorkerRegistry
from pdspark.serving.worker_server import WorkerServer
from pdspark.testing.time_scale import scaled
from router_harness import LowestAddress, serve_front_ends

MODEL = "dsv4-tiny"
ENGINE = dict(page_size=16, max_model_len=256, speculative="dspark")
WORKER = dict(model=MODEL, transfer_backend="inprocess", metrics_port=None, max_num_seqs=4, **ENGINE)
MAX_TOKENS = 64
PROMPT = "class Stack:\n    def push(self, item):"  # a greedy output that does not repeat itself at once
MESSAGES = [{"role": "user", "content": "a stack class"}]
SPAN = 14  # tokens a stop string covers: more than two DSpark steps
HELD = 8  # characters of a stop string a stream holds back when the first decode worker breaks
NEVER = "\u2603"  # a character the model does not write: a stop string ending in it never matches


class BreakWhileHeld:
    """Wraps a decode worker's `generate`: once armed with a request's stop strings, its next stream fails
    (UNAVAILABLE, as a worker that died) right after an output whose text ends in HELD characters or more of a stop
    string, so the router migrates the stream with that text held back."""

    def __init__(self, worker):
        self.inner = worker.generate
        self.stops: tuple[str, ...] = ()
        self.broke_after: list[int] | None = None  # the token ids of the stream when it broke
        worker.generate = self.generate

    async def generate(self, *args, **kwargs):
        stops, self.stops = self.stops, ()
        async with contextlib.aclosing(self.inner(*args, **kwargs)) as outputs:
            async for out in outputs:
                yield out
                if stops and not out.finished and ends_in_a_start_of(out.text or "", stops):
                    self.broke_after = list(out.token_ids)
                    raise RequestFailed(ErrorCode.UNAVAILABLE, "the decode worker broke (test)")


def ends_in_a_start_of(text: str, stops: tuple[str, ...]) -> bool:
    """Whether `text` ends in the first HELD characters (or more) of one of `stops`: inside the stop string where it
    stands in the output, not in a character or two that happen to start it."""
    text = text.rstrip("\ufffd")
    return any(text.endswith(s[:n]) for s in stops for n in range(HELD, len(s)))


class Served:
    """The router and its workers on an asyncio loop of their own thread."""

    def __init__(self):
        self.workers = [WorkerServer(build(WorkerConfig, {**WORKER, "enable_prefix_cache": role == "prefill"},
                                           fixed={"role": role})) for role in ("prefill", "decode", "decode")]
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.run(self._start())

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(scaled(120))

    async def _start(self) -> None:
        # `PDSPARK_WORKER_CALLS` picks how the router calls the workers, as in a router process (default: multiplexed).
        calls = os.environ.get("PDSPARK_WORKER_CALLS")
        cfg = build(RouterConfig, {"worker_calls": calls} if calls else {})
        # No health polling: every worker counts as healthy.
        self.registry = WorkerRegistry(multiplexed=cfg.worker_calls == "multiplexed")
        addresses = {}
        for server in self.workers:
            addresses[id(server)] = (await server.start())["address"]
            self.registry.add(server.cfg.role, addresses[id(server)])
        # `LowestAddress` picks the decode worker of the lowest address first: the one that breaks.
        first = min((s for s in self.workers if s.cfg.role == "decode"), key=lambda s: addresses[id(s)])
        self.breaker = BreakWhileHeld(first.worker)
        self.metrics = RouterMetrics()
        dispatcher = Dispatcher(self.registry, LowestAddress(), LowestAddress(), metrics=self.metrics)
        self.core = RouterCore(resolve_model(MODEL), "tiny", 256, self.registry, dispatcher, self.metrics, cfg)
        self.grpc, self.grpc_address, self.runner, self.http_url = await serve_front_ends(self.core)

    async def _stop(self) -> None:
        await self.grpc.stop(None)
        await self.runner.cleanup()
        for w in self.registry.workers.values():
            if w.channel is not None:
                await w.channel.close()
        for server in self.workers:
            await server.stop(0.5)

    def close(self) -> None:
        self.run(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(scaled(10))


@pytest.fixture(scope="module")
def served():
    s = Served()
    yield s
    s.close()


def stop_strings(case: str, text: str, offsets: list[int]) -> list[str]:
    """`case`'s stop strings for a request whose greedy output is `text` (`offsets`: where each token's text
    starts): SPAN tokens of it, from inside one of its tokens after the 16th, starting where it first occurs."""
    first = next(i for i in range(16, len(offsets) - SPAN) if offsets[i + 1] - offsets[i] > 1
                 and text.find(text[offsets[i] + 1:offsets[i + SPAN]]) == offsets[i] + 1)
    stop = text[offsets[first] + 1:offsets[first + SPAN]]
    return {
        "one": [stop],
        # Sharing prefixes: the held tail starts all three; the longest one matches.
        "shared prefixes": [stop[:4] + NEVER, stop[:-3] + NEVER, stop],
        "never matched": [stop + NEVER],  # held to the end, which releases it
    }[case]


def expected(prompt_ids: list[int], offline_reference, case: str):
    """The stop strings of `case` for `prompt_ids`, and the offline engine's output with them."""
    llm = offline_reference.engine(MODEL, **ENGINE)
    free = offline_reference.output(MODEL, prompt_ids, SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True), **ENGINE)
    offsets = [len(llm.tokenizer.decode(free.token_ids[:i])) for i in range(len(free.token_ids))]
    stops = stop_strings(case, free.text, offsets)
    ref = offline_reference.output(MODEL, prompt_ids, SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, stop=stops), **ENGINE)
    if case == "never matched":
        assert ref.token_ids == free.token_ids
    else:
        assert len(ref.token_ids) < MAX_TOKENS and ref.text == free.text[:free.text.find(stops[-1])]
    return stops, ref


CASES = ["one", "shared prefixes", "never matched"]


@pytest.mark.parametrize("case", CASES)
def test_the_sdk_stream_and_completions_sse_put_together_the_offline_text(served, offline_reference, case):
    prompt_ids = served.core.tokenizer.encode(PROMPT)
    stops, ref = expected(prompt_ids, offline_reference, case)
    sampling = dict(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, stop=stops)
    with Client(served.grpc_address, timeout=scaled(60)) as client:
        chunks = list(client.stream(PROMPT, **sampling))
        assert "".join(c.text for c in chunks) == ref.text
        assert [t for c in chunks for t in c.token_ids] == ref.token_ids
        assert client.generate(PROMPT, **sampling).text == ref.text
    oai = openai.OpenAI(base_url=served.http_url + "/v1", api_key="none", max_retries=0, timeout=scaled(60))
    body = dict(model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stop=stops,
                extra_body={"ignore_eos": True})
    pieces = [c.choices[0].text for c in oai.completions.create(stream=True, **body)]
    assert len(pieces) > 2 and "".join(pieces) == ref.text
    assert oai.completions.create(**body).choices[0].text == ref.text


@pytest.mark.parametrize("case", ["one", "shared prefixes"])
def test_chat_sse_puts_together_the_offline_text(served, offline_reference, case):
    prompt_ids = served.core.tokenizer.encode(served.core.chat_template.render(MESSAGES))
    stops, ref = expected(prompt_ids, offline_reference, case)
    oai = openai.OpenAI(base_url=served.http_url + "/v1", api_key="none", max_retries=0, timeout=scaled(60))
    body = dict(model="tiny", messages=MESSAGES, max_completion_tokens=MAX_TOKENS, temperature=0, stop=stops,
                extra_body={"ignore_eos": True})
    pieces = [c.choices[0].delta.content or "" for c in oai.chat.completions.create(stream=True, **body)
              if c.choices]
    assert "".join(pieces) == ref.text
    assert oai.chat.completions.create(**body).choices[0].message.content == ref.text


@pytest.mark.parametrize("case", ["one", "never matched"])
@pytest.mark.parametrize("api", ["sdk", "sse"])
def test_a_stream_migrated_while_it_holds_text_back_puts_together_the_offline_text(served, offline_reference,
                                                                                     case, api):
    """The first decode worker breaks after an output whose text ends in the start of a stop string (the stream
    held that back); the next one goes on from the tokens the client got, and the text comes out once: cut at the
    stop string, or released when it did not complete one."""
    prompt_ids = served.core.tokenizer.encode(PROMPT)
    stops, ref = expected(prompt_ids, offline_reference, case)
    migrations = served.metrics.migrations._value.get()
    served.breaker.broke_after, served.breaker.stops = None, tuple(stops)
    if api == "sdk":
        with Client(served.grpc_address, timeout=scaled(60)) as client:
            chunks = [(c.text, c.token_ids) for c in client.stream(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0,
                                                                   ignore_eos=True, stop=stops)]
    else:
        oai = openai.OpenAI(base_url=served.http_url + "/v1", api_key="none", max_retries=0, timeout=scaled(60))
        chunks = [(c.choices[0].text, []) for c in oai.completions.create(
            stream=True, model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stop=stops,
            extra_body={"ignore_eos": True})]
    broke_after = served.breaker.broke_after
    assert broke_after is not None, "the first decode worker never held text back"
    assert served.metrics.migrations._value.get() == migrations + 1
    assert "".join(text for text, _ in chunks) == ref.text
    if api == "sdk":
        assert [t for _, ids in chunks for t in ids] == ref.token_ids
    assert ref.token_ids[:len(broke_after)] == broke_after
