"""The router's HTTP API (aiohttp): OpenAI-compatible completions and chat completions (JSON or SSE), native
`/generate`, models, health, metrics and the worker list (GET to list, POST/DELETE to add/remove at run time).

A request may set its timeout with the `X-Request-Timeout` header (seconds; at most the router's
`request_timeout_s`, also the default) and name itself with `X-Request-Id` (or the body's `user`): a label the
router logs and echoes back in the `X-Request-Id` response header; the request's id is the router's own. A request
the router has no room for gets 429 with `Retry-After` at once."""

from __future__ import annotations

import json
import logging
import math

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pdspark.errors import ErrorCode, RequestFailed
from pdspark.router import openai_protocol as oai
from pdspark.router.openai_protocol import ApiError
from pdspark.router.router_core import RETRY_AFTER_S, RouterCore, Totals, clean_label

logger = logging.getLogger(__name__)


def build_app(core: RouterCore) -> web.Application:
    api = HttpApi(core)
    app = web.Application(client_max_size=64 << 20)
    app.on_response_prepare.append(_echo_request_id)
    app.add_routes([
        web.post("/v1/completions", api.completions),
        web.post("/v1/chat/completions", api.chat_completions),
        web.get("/v1/models", api.models),
        web.post("/generate", api.generate),
        web.get("/health", api.health),
        web.get("/metrics", api.metrics),
        web.get("/workers", api.workers),
        web.post("/workers", api.add_worker),
        web.delete("/workers", api.remove_worker),
    ])
    return app


def _error(e: ApiError) -> web.Response:
    return web.json_response(e.body(), status=e.status)


def _failure(e: RequestFailed) -> web.Response:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if e.code is ErrorCode.OVERLOADED else None
    return web.json_response(_failure_body(e), status=e.code.http_status, headers=headers)


async def _echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    label = clean_label(request.headers.get("X-Request-Id"))
    if label:
        response.headers["X-Request-Id"] = label


def _label(request: web.Request, body: object) -> str:
    user = body.get("user") if isinstance(body, dict) else None
    return clean_label(request.headers.get("X-Request-Id") or (user if isinstance(user, str) else None))


def _timeout(request: web.Request) -> float | None:
    """The `X-Request-Timeout` header (seconds), if set."""
    text = request.headers.get("X-Request-Timeout")
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0 or math.isinf(value):
        raise ApiError(400, f"the X-Request-Timeout header must be a number of seconds > 0, not {text!r}")
    return value


def _failure_body(e: RequestFailed) -> dict:
    """OpenAI's error object for a failed request (also sent as the last SSE event of a broken stream)."""
    return {"error": {"message": e.message, "type": e.code.openai_type, "param": None, "code": e.code.value}}


async def _json(request: web.Request) -> object:
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"malformed JSON body: {e}") from e


class HttpApi:
    def __init__(self, core: RouterCore):
        self.core = core

    # ---- OpenAI -----------------------------------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._openai(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._openai(request, chat=True)

    async def _openai(self, request: web.Request, chat: bool) -> web.StreamResponse:
        core = self.core
        try:
            body = await _json(request)
            parsed = oai.parse(body, chat=chat, served_model=core.served_name, tokenizer=core.tokenizer,
                               chat_template=core.chat_template, max_model_len=core.max_model_len,
                               vocab_size=core.model_config.vocab_size)
            timeout = _timeout(request)
        except ApiError as e:
            core.metrics.requests.labels(api="chat" if chat else "completions", outcome="invalid").inc()
            return _error(e)
        rid = oai.new_id(chat)  # minted here: the router's id (uuid4-based), also the response's `id`
        totals = Totals(len(parsed.prompt_ids))
        stream = core.run("chat" if chat else "completions", rid, parsed.prompt_ids, parsed.params, totals,
                          timeout_s=timeout, label=_label(request, body))
        if parsed.stream:
            return await self._sse(request, rid, chat, parsed, stream, totals)
        text, lps = [], []
        try:
            async for chunk in stream:
                text.append(chunk.text)
                lps += chunk.logprobs
        except RequestFailed as e:
            return _failure(e)
        use = oai.usage(totals.prompt_tokens, totals.completion_tokens, totals.cached_tokens)
        logprobs = oai.logprobs_json(lps, core.tokenizer, chat) if parsed.logprobs is not None else None
        return web.json_response(oai.completion_body(rid, core.served_name, chat, "".join(text),
                                                     totals.finish_reason, logprobs, use, stream=False))

    async def _sse(self, request, rid, chat, parsed, stream, totals) -> web.StreamResponse:
        core = self.core
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        first = True
        try:
            async for chunk in stream:
                if first:
                    await resp.prepare(request)
                lps = oai.logprobs_json(chunk.logprobs, core.tokenizer, chat) if parsed.logprobs is not None else None
                body = oai.completion_body(rid, core.served_name, chat, chunk.text, chunk.finish_reason, lps, None,
                                           stream=True, first=first)
                first = False
                await resp.write(f"data: {json.dumps(body)}\n\n".encode())
        except RequestFailed as e:
            if first:  # nothing sent yet: a normal error response
                return _failure(e)
            await resp.write(f"data: {json.dumps(_failure_body(e))}\n\n".encode())
        finally:
            await stream.aclose()  # client gone (ConnectionResetError) or done: cancels both legs if still running
        if parsed.include_usage:
            use = oai.usage(totals.prompt_tokens, totals.completion_tokens, totals.cached_tokens)
            body = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                    "created": 0, "model": core.served_name, "choices": [], "usage": use}
            await resp.write(f"data: {json.dumps(body)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.core.served_name, "object": "model", "created": 0, "owned_by": "pdspark",
             "max_model_len": self.core.max_model_len}]})

    # ---- native ------------------------------------------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.StreamResponse:
        """`{"text" | "input_ids", "sampling_params": {...}, "stream"}` -> `{"text", "output_ids", "meta_info"}`."""
        core = self.core
        try:
            body = await _json(request)
            if not isinstance(body, dict):
                raise ApiError(400, "the request body must be a JSON object")
            ids = body.get("input_ids")
            if ids is None:
                if not isinstance(body.get("text"), str) or core.tokenizer is None:
                    raise ApiError(422, "`text` (a string) or `input_ids` (token ids) is required", "text")
                ids = core.tokenizer.encode(body["text"])
            sp = dict(body.get("sampling_params") or {})
            if "max_new_tokens" in sp:
                sp["max_tokens"] = sp.pop("max_new_tokens")
            parsed = oai.parse({"prompt": ids, "stream": body.get("stream", False), **sp}, chat=False,
                               served_model=core.served_name, tokenizer=core.tokenizer,
                               chat_template=core.chat_template, max_model_len=core.max_model_len,
                               vocab_size=core.model_config.vocab_size)
            timeout = _timeout(request)
        except ApiError as e:
            return _error(e)
        rid = core.new_request_id()
        # The body's `rid` is a label like X-Request-Id: a client's name never becomes the request's id.
        label = clean_label(request.headers.get("X-Request-Id") or str(body.get("rid") or ""))
        totals = Totals(len(parsed.prompt_ids))
        stream = core.run("generate", rid, parsed.prompt_ids, parsed.params, totals, timeout_s=timeout, label=label)

        def meta() -> dict:
            return {"id": rid, "prompt_tokens": totals.prompt_tokens, "completion_tokens": totals.completion_tokens,
                    "cached_tokens": totals.cached_tokens,
                    "finish_reason": totals.finish_reason.value if totals.finish_reason is not None else None,
                    "prefill_worker": totals.prefill_worker, "decode_worker": totals.decode_worker}

        if not parsed.stream:
            text, ids_out = [], []
            try:
                async for chunk in stream:
                    text.append(chunk.text)
                    ids_out += chunk.token_ids
            except RequestFailed as e:
                return _failure(e)
            return web.json_response({"text": "".join(text), "output_ids": ids_out, "meta_info": meta()})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        try:
            async for chunk in stream:
                if not resp.prepared:  # after the first chunk: a request refused or failed before it gets a status
                    await resp.prepare(request)
                event = {"text": chunk.text, "output_ids": chunk.token_ids, "meta_info": meta()}
                await resp.write(f"data: {json.dumps(event)}\n\n".encode())
        except RequestFailed as e:
            if not resp.prepared:
                return _failure(e)
            await resp.write(f"data: {json.dumps({'error': e.message, 'code': e.code.value})}\n\n".encode())
        finally:
            await stream.aclose()
        if not resp.prepared:
            await resp.prepare(request)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    # ---- operations --------------------------------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        reg, adm = self.core.registry, self.core.admission
        ok = bool(reg.healthy("prefill")) and bool(reg.healthy("decode"))
        # Busy is not unhealthy: a full queue is reported here, with status ok.
        return web.json_response({"status": "ok" if ok else "degraded",
                                  "prefill": len(reg.healthy("prefill")), "decode": len(reg.healthy("decode")),
                                  "in_flight": adm.in_flight, "queued": adm.queued,
                                  "max_in_flight": adm.max_in_flight, "max_queued": adm.max_queued},
                                 status=200 if ok else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        reg = self.core.registry
        for role in ("prefill", "decode"):
            healthy = len(reg.healthy(role))
            total = sum(1 for w in reg.workers.values() if w.role == role)
            self.core.metrics.workers.labels(role=role, healthy="true").set(healthy)
            self.core.metrics.workers.labels(role=role, healthy="false").set(total - healthy)
        body = generate_latest(self.core.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def workers(self, request: web.Request) -> web.Response:
        return web.json_response([w.to_json() for w in self.core.registry.workers.values()])

    async def add_worker(self, request: web.Request) -> web.Response:
        try:
            body = await _json(request)
            if not isinstance(body, dict) or not isinstance(body.get("address"), str):
                raise ApiError(422, "`address` (host:port) and `role` (prefill or decode) are required", "address")
            w = self.core.registry.add(str(body.get("role")), body["address"], str(body.get("metrics_url", "")))
        except ApiError as e:
            return _error(e)
        except ValueError as e:
            return _error(ApiError(400, str(e), "role"))
        await self.core.registry.check(w)
        return web.json_response(w.to_json(), status=201)

    async def remove_worker(self, request: web.Request) -> web.Response:
        address = request.query.get("address", "")
        if address not in self.core.registry.workers:
            return _error(ApiError(404, f"no worker {address!r}", "address"))
        w = self.core.registry.remove(address)
        self.core.dispatcher.prefill_policy.forget(address)
        self.core.dispatcher.decode_policy.forget(address)
        return web.json_response(w.to_json())

