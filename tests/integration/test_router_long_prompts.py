"""A prompt of megabytes does not stall the router (router harness, stub workers): one that cannot fit the context is
refused by its length alone, at once, on either front end; one that might is tokenized off the event loop while
another request's stream goes on."""

from __future__ import annotations

import asyncio
import re
import time

import aiohttp
import pytest

from pdspark.client import AsyncClient, ClientError
from pdspark.errors import ErrorCode
from pdspark.router.openai.sampling_fields import MAX_PROMPT_CHARS
from pdspark.testing.time_scale import scaled
from pdspark.testing.waiting import run_within, until
from router_harness import RouterHarness

# Seconds between the streamed tokens of the request that runs beside the long prompt.
TOKEN_GAP_S = 0.02


def long_prompt(chars: int = MAX_PROMPT_CHARS - 64) -> str:
    """About `chars` characters of distinct-looking words: the dsv4-tiny tokenizer takes seconds over it (about 1 us a
    character), and makes it about 0.7 tokens a character (far beyond a 1 Mi-token context)."""
    words = [format(i * 2654435761 % (1 << 32), "x") for i in range(4096)]
    text = " ".join(words)
    return (text + " ") * (chars // (len(text) + 1))


async def stream(session: aiohttp.ClientSession, h: RouterHarness, arrivals: list[float]) -> None:
    """Stream a long completion, noting when each chunk arrives."""
    body = {"prompt": [5, 6, 7], "max_tokens": 8, "stream": True}
    async with session.post(h.http_url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if line.startswith(b"data: "):
                arrivals.append(time.perf_counter())


def test_a_long_prompt_is_tokenized_off_the_event_loop_while_another_request_streams():
    prompt = long_prompt()
    body = f'{{"prompt": "{prompt}", "max_tokens": 4}}'.encode()  # the words need no JSON escaping

    async def scenario():
        # A 1 Mi-token context: the prompt's length alone cannot refuse it, so it is tokenized.
        async with await RouterHarness.start(tokens=100_000, max_model_len=1 << 20) as h, \
                aiohttp.ClientSession() as s:
            h.decode[0].delay_s = TOKEN_GAP_S
            arrivals: list[float] = []
            streaming = asyncio.create_task(stream(s, h, arrivals))
            await until(lambda: arrivals, 10, "the first streamed token")
            t0 = time.perf_counter()
            async with s.post(h.http_url + "/v1/completions", data=body,
                              headers={"Content-Type": "application/json"}) as r:
                status, error = r.status, (await r.json())["error"]
            t1 = time.perf_counter()
            await until(lambda: arrivals[-1] > t1, 10, "a streamed token after the long prompt's answer")
            streaming.cancel()
            # Tokenized, and then refused by its tokens (no stub worker takes a prompt of megabytes).
            assert (status, error["param"], error["code"]) == (400, "prompt", "context_length_exceeded"), error
            assert "characters" not in error["message"] and "1048576 tokens" in error["message"], error
            # The chunks from the last one before the long prompt was sent to the first one after its answer.
            around = [t for t in arrivals if t < t0][-1:] + [t for t in arrivals if t0 <= t <= t1] + \
                [t for t in arrivals if t > t1][:1]
            gap = max(b - a for a, b in zip(around, around[1:]))
            print(f"\nthe long prompt took {t1 - t0:.2f} s; {len(around) - 2} chunks streamed meanwhile, the "
                  f"largest gap {gap * 1e3:.0f} ms")
            assert gap < scaled(0.5), f"the stream stood still for {gap:.2f} s ({t1 - t0:.2f} s of parsing)"

    run_within(scenario(), 60)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", lambda text: {"prompt": text}, "prompt"),
    ("/v1/chat/completions", lambda text: {"messages": [{"role": "user", "content": text}]}, "messages"),
    ("/generate", lambda text: {"text": text}, "text"),
])
def test_a_prompt_too_long_for_the_context_is_refused_at_once_by_its_length(path, body, param):
    prompt = long_prompt()

    async def scenario():
        async with await RouterHarness.start() as h, aiohttp.ClientSession() as s:  # a 4096-token context
            t0 = time.perf_counter()
            async with s.post(h.http_url + path, json=body(prompt)) as r:
                status, error = r.status, (await r.json())["error"]
            took = time.perf_counter() - t0
            assert (status, error["param"], error["code"]) == (400, param, "context_length_exceeded"), error
            # A chat prompt is counted as its template renders it: a few characters more than its message's.
            assert re.search(rf"\(`{param}`\) has {len(prompt) // 1000}\d{{3}} characters", error["message"]), error
            assert took < scaled(0.5), f"refused after {took:.2f} s: tokenized first?"
            assert not h.prefill[0].calls

    run_within(scenario(), 60)


def test_grpc_refuses_a_text_too_long_for_the_context_at_once_by_its_length():
    prompt = long_prompt()

    async def scenario():
        async with await RouterHarness.start() as h, AsyncClient(h.grpc_address, timeout=scaled(30)) as client:
            t0 = time.perf_counter()
            with pytest.raises(ClientError) as e:
                await client.generate(prompt, max_tokens=4)
            took = time.perf_counter() - t0
            assert (e.value.code, e.value.error_code) == ("INVALID_ARGUMENT", ErrorCode.INVALID_REQUEST), e.value
            assert f"(`text`) has {len(prompt)} characters" in e.value.message
            assert took < scaled(0.5), f"refused after {took:.2f} s: tokenized first?"
            await until(lambda: h.sample("pdspark_router_requests_total", api="grpc", outcome="invalid") == 1, 5,
                        "the refusal counted")

    run_within(scenario(), 60)
