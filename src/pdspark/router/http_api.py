"""The router's HTTP API (aiohttp): OpenAI-compatible completions and chat completions (JSON or SSE), native
`/generate`, models, the OpenAPI document, health, metrics and the worker list (GET to list, POST/DELETE to
add/remove at run time). Request bodies are validated by the pydantic request models (see `openai_protocol`); every
error is OpenAI's error object (`error_middleware`)."""

from __future__ import annotations

import json
import logging
import uuid

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pdspark.errors import RequestFailed
from pdspark.router import openai_protocol as oai
from pdspark.router.api_error import ApiError, error_body
from pdspark.router.chat_completion_request import ChatCompletionRequest
from pdspark.router.completion_request import CompletionRequest
from pdspark.router.error_middleware import error_middleware, json_error, mark_started
from pdspark.router.generate_request import GenerateRequest
from pdspark.router.openapi_document import openapi_document
from pdspark.router.router_core import RouterCore, Totals

logger = logging.getLogger(__name__)

# The largest request body read (413 beyond). A prompt of DSV4's full 1M-token context fits, as text or as token ids
# in JSON (about 7 bytes each); anything larger cannot be served anyway.
DEFAULT_MAX_BODY_BYTES = 8 << 20


def build_app(core: RouterCore, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> web.Application:
    """The router's HTTP application. Every error it answers is OpenAI's error object (`error_middleware`)."""
    api = HttpApi(core)
    app = web.Application(client_max_size=max_body_bytes, middlewares=[error_middleware])
    app.on_response_prepare.append(mark_started)
    app.add_routes([
        web.post("/v1/completions", api.completions),
        web.post("/v1/chat/completions", api.chat_completions),
        web.get("/v1/models", api.models),
        web.post("/generate", api.generate),
        web.get("/openapi.json", api.openapi),
        web.get("/health", api.health),
        web.get("/metrics", api.metrics),
        web.get("/workers", api.workers),
        web.post("/workers", api.add_worker),
        web.delete("/workers", api.remove_worker),
    ])
    return app


def _failure(e: RequestFailed) -> web.Response:
    return web.json_response(_failure_body(e), status=e.code.http_status)


def _failure_body(e: RequestFailed) -> dict:
    """OpenAI's error object for a failed request (also sent as the last SSE event of a broken stream)."""
    return error_body(e.message, e.code.openai_type, None, e.code.value)


def _internal_error_event(where: str) -> bytes:
    """The last SSE event of a stream broken by a bug: headers are out, so the error travels as data."""
    logger.exception("unexpected error while streaming %s", where)
    body = error_body("internal server error; the router's log has the details", "server_error", None,
                      "internal_error")
    return f"data: {json.dumps(body)}\n\n".encode()


async def _body(request: web.Request) -> bytes:
    """The raw JSON body. An absent Content-Type is read as JSON (minimal clients send none); any other type is
    refused, `curl -d` without `-H 'Content-Type: application/json'` (a form) included, with a message saying so."""
    if "Content-Type" in request.headers:
        ctype = request.content_type
        if ctype != "application/json" and not ctype.endswith("+json"):
            raise ApiError(415, f"`Content-Type` must be application/json (got {ctype})",
                           code="unsupported_media_type")
    return await request.read()  # over `client_max_size`: HTTPRequestEntityTooLarge, a 413 from the middleware


class HttpApi:
    def __init__(self, core: RouterCore):
        self.core = core
        self.served = oai.ServedModel(core.served_name, core.max_model_len, core.model_config.vocab_size,
                                      core.tokenizer, core.chat_template)

    # ---- OpenAI -----------------------------------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._openai(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._openai(request, chat=True)

    async def _openai(self, request: web.Request, chat: bool) -> web.StreamResponse:
        core = self.core
        try:
            raw = await _body(request)
            if chat:
                parsed = oai.parse_chat(oai.validate(ChatCompletionRequest, raw), self.served)
            else:
                parsed = oai.parse_completion(oai.validate(CompletionRequest, raw), self.served)
        except ApiError as e:
            core.metrics.requests.labels(api="chat" if chat else "completions", outcome="invalid").inc()
            return json_error(e)
        rid = oai.new_id(chat)
        totals = Totals(len(parsed.prompt_ids))
        stream = core.run("chat" if chat else "completions", rid, parsed.prompt_ids, parsed.params, totals)
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
                # With `continuous_usage_stats` every chunk carries the usage so far (`totals` is updated before
                # each chunk is yielded).
                use = (oai.usage(totals.prompt_tokens, totals.completion_tokens, totals.cached_tokens)
                       if parsed.continuous_usage else None)
                body = oai.completion_body(rid, core.served_name, chat, chunk.text, chunk.finish_reason, lps, use,
                                           stream=True, first=first)
                first = False
                await resp.write(f"data: {json.dumps(body)}\n\n".encode())
        except RequestFailed as e:
            if first:  # nothing sent yet: a normal error response
                return _failure(e)
            await resp.write(f"data: {json.dumps(_failure_body(e))}\n\n".encode())
        except ConnectionResetError:
            raise  # the client went away: nobody to tell
        except Exception:
            if first:
                raise  # nothing sent yet: the middleware answers 500
            await resp.write(_internal_error_event(rid))
        finally:
            await stream.aclose()  # client gone (ConnectionResetError) or done: cancels both legs if still running
        if first:  # a stream that ended without a chunk still gets its events
            await resp.prepare(request)
        if parsed.include_usage:
            use = oai.usage(totals.prompt_tokens, totals.completion_tokens, totals.cached_tokens)
            await resp.write(f"data: {json.dumps(oai.usage_chunk(rid, core.served_name, chat, use))}\n\n".encode())
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
            req = oai.validate(GenerateRequest, await _body(request))
            parsed = oai.parse_generate(req, self.served)
        except ApiError as e:
            core.metrics.requests.labels(api="generate", outcome="invalid").inc()
            return json_error(e)
        rid = req.rid or uuid.uuid4().hex
        totals = Totals(len(parsed.prompt_ids))
        stream = core.run("generate", rid, parsed.prompt_ids, parsed.params, totals)

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
        await resp.prepare(request)
        try:
            async for chunk in stream:
                event = {"text": chunk.text, "output_ids": chunk.token_ids, "meta_info": meta()}
                await resp.write(f"data: {json.dumps(event)}\n\n".encode())
        except RequestFailed as e:
            await resp.write(f"data: {json.dumps(_failure_body(e))}\n\n".encode())
        except ConnectionResetError:
            raise
        except Exception:
            await resp.write(_internal_error_event(rid))
        finally:
            await stream.aclose()
        await resp.write(b"data: [DONE]\n\n")
        return resp

    # ---- operations --------------------------------------------------------------------------------------------------
    async def openapi(self, request: web.Request) -> web.Response:
        return web.json_response(openapi_document())

    async def health(self, request: web.Request) -> web.Response:
        reg = self.core.registry
        ok = bool(reg.healthy("prefill")) and bool(reg.healthy("decode"))
        return web.json_response({"status": "ok" if ok else "degraded",
                                  "prefill": len(reg.healthy("prefill")), "decode": len(reg.healthy("decode"))},
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
            body = json.loads(await _body(request))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"malformed JSON body: {e}", code="invalid_json") from e
        if not isinstance(body, dict) or not isinstance(body.get("address"), str):
            raise ApiError(422, "`address` (host:port) and `role` (prefill or decode) are required", "address")
        try:
            w = self.core.registry.add(str(body.get("role")), body["address"], str(body.get("metrics_url", "")))
        except ValueError as e:
            raise ApiError(400, str(e), "role") from e
        await self.core.registry.check(w)
        return web.json_response(w.to_json(), status=201)

    async def remove_worker(self, request: web.Request) -> web.Response:
        address = request.query.get("address", "")
        if address not in self.core.registry.workers:
            raise ApiError(404, f"no worker {address!r}", "address")
        w = self.core.registry.remove(address)
        self.core.dispatcher.prefill_policy.forget(address)
        self.core.dispatcher.decode_policy.forget(address)
        return web.json_response(w.to_json())
