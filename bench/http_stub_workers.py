"""Stub SGLang-style HTTP workers (aiohttp, no model) for the router benchmark's peer, sglang-router in PD mode:
a prefill and a decode server in one process (as `stub_workers.py` runs pdspark's gRPC pair), answering at once.

They answer what sglang-router asks of a worker: `POST /generate` and `/v1/completions` (one token, SGLang's
response shape), `GET /health`, `/health_generate`, `/get_server_info`, `/get_model_info`, `/v1/models` and
`/get_load`. Every other path is 404. `python bench/http_stub_workers.py` prints one JSON ready line with both URLs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal

from aiohttp import web

MODEL = "stub"


def _generate_body(tokens: int) -> dict:
    return {"text": "x" * tokens, "output_ids": list(range(tokens)),
            "meta_info": {"id": "stub", "prompt_tokens": 32, "completion_tokens": tokens, "cached_tokens": 0,
                          "finish_reason": {"type": "length", "length": tokens}}}


def _completion_body(tokens: int) -> dict:
    return {"id": "cmpl-stub", "object": "text_completion", "created": 0, "model": MODEL,
            "choices": [{"index": 0, "text": "x" * tokens, "logprobs": None, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 32, "completion_tokens": tokens, "total_tokens": 32 + tokens}}


def build_app(tokens: int) -> web.Application:
    # Bodies serialised once: the stub's own cost stays out of what is measured.
    generate = json.dumps(_generate_body(tokens)).encode()
    completion = json.dumps(_completion_body(tokens)).encode()
    info = json.dumps({"model_path": MODEL, "tokenizer_path": MODEL, "is_generation": True,
                       "disaggregation_mode": "null", "max_total_num_tokens": 65536}).encode()
    models = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "stub"}]}).encode()
    load = json.dumps([{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]).encode()

    def answer(body: bytes):
        async def handler(request: web.Request) -> web.Response:
            await request.read()
            return web.Response(body=body, content_type="application/json")
        return handler

    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="OK")

    app = web.Application()
    app.add_routes([web.post("/generate", answer(generate)), web.post("/v1/completions", answer(completion)),
                    web.get("/health", ok), web.get("/health_generate", ok),
                    web.get("/get_server_info", answer(info)), web.get("/get_model_info", answer(info)),
                    web.get("/v1/models", answer(models)), web.get("/get_load", answer(load))])
    return app


async def main(tokens: int, host: str) -> None:
    # sglang-router probes each worker with gRPC first: the HTTP/2 preface it sends is a harmless 400 here, not
    # worth a traceback per probe.
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
    runners, urls = [], []
    for _ in ("prefill", "decode"):
        runner = web.AppRunner(build_app(tokens), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        runners.append(runner)
        urls.append(f"http://{host}:{port}")
    print(json.dumps({"event": "ready", "prefill": urls[0], "decode": urls[1]}), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for runner in runners:
        await runner.cleanup()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args()
    asyncio.run(main(args.tokens, args.host))
