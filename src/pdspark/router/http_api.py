"""The router's HTTP API (aiohttp): OpenAI-compatible completions and chat completions (JSON or SSE), native
`/generate`, models, the tokenizer (`/tokenize`, `/detokenize`, `/tokenizer_info`, vLLM's shapes), the OpenAPI
document, health, metrics, Prometheus service discovery (`/prometheus/targets`) and the worker list (GET to list,
POST/DELETE to add/remove at run time). Request bodies are validated by the pydantic request models (see
`openai_protocol`); every error is OpenAI's error object (`error_middleware`).

A request may set its timeout with the `X-Request-Timeout` header (seconds; at most the router's
`request_timeout_s`, also the default) and name itself with `X-Request-Id` (or the body's `user`, `/generate`'s
`rid`): a label the router logs and echoes back in the `X-Request-Id` response header; the request's id is the
router's own. A request the router has no room for gets 429 with `Retry-After` at once.

Keys (`auth_middleware`, rules in `api_keys`): generation and the tokenizer need an API key when the router has
any, `/workers` and `/prometheus/targets` an admin key; a caller who may not list workers sees no worker address in a
response either.

With `--admin-port` those two admin routes are an application of their own (`build_app(core, "admin")`), served on
that port and absent (404) from the main one; `router_server.start_http` starts both."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import re
from collections.abc import Sequence
from dataclasses import replace
from typing import Literal

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pdspark.errors import ErrorCode, RequestFailed
from pdspark.router.auth.auth_middleware import auth_middleware, current_caller
from pdspark.router.error_middleware import error_middleware, json_error, mark_started
from pdspark.router.openai import openai_protocol as oai
from pdspark.router.openai import tokenization
from pdspark.router.openai.api_error import ApiError, error_body
from pdspark.router.openai.chat_completion_request import ChatCompletionRequest
from pdspark.router.openai.completion_request import CompletionRequest
from pdspark.router.openai.generate_request import GenerateRequest
from pdspark.router.openai.openapi_document import openapi_document
from pdspark.router.openai.tokenize_request import DetokenizeRequest, TokenizeRequest
from pdspark.router.router_core import RETRY_AFTER_S, RouterCore, Totals, clean_label
from pdspark.router.workers.prometheus_targets import prometheus_targets
from pdspark.router.workers.worker_address import address_problem
from pdspark.rpc import tracing
from pdspark.types import FinishReason, SamplingParams

logger = logging.getLogger(__name__)

Routes = Literal["all", "public", "admin"]


def build_app(core: RouterCore, routes: Routes = "all", metrics_port: int | None = None) -> web.Application:
    """The router's HTTP application: every route, or only the public ones or only the admin ones (`/workers`,
    `/prometheus/targets`) when they are served on ports of their own. Every error it answers is OpenAI's error
    object (`error_middleware`); every request is checked against the router's keys first (`auth_middleware`).

    Args:
        metrics_port: where the router's own `/metrics` is, when not on this application's port (the admin one):
            what `/prometheus/targets` lists for it.
    """
    api = HttpApi(core, metrics_port)
    app = web.Application(client_max_size=core.options.admission.max_body_bytes,
                          middlewares=[error_middleware,
                                       auth_middleware(core.keys, core.metrics, admin_routes=routes != "public")])
    app.on_response_prepare.append(mark_started)
    app.on_response_prepare.append(_echo_request_id)
    public = [
        web.post("/v1/completions", api.completions),
        web.post("/v1/chat/completions", api.chat_completions),
        web.get("/v1/models", api.models),
        web.post("/generate", api.generate),
        web.post("/tokenize", api.tokenize),
        web.post("/detokenize", api.detokenize),
        web.get("/tokenizer_info", api.tokenizer_info),
        web.get("/openapi.json", api.openapi),
        web.get("/health", api.health),
        web.get("/live", api.live),
        web.get("/metrics", api.metrics),
    ]
    admin = [
        web.get("/prometheus/targets", api.prometheus_targets),
        web.get("/workers", api.workers),
        web.post("/workers", api.add_worker),
        web.delete("/workers", api.remove_worker),
    ]
    app.add_routes({"all": public + admin, "public": public, "admin": admin}[routes])
    return app


def _with_port(host: str, port: int) -> str:
    """A `Host` header's value (name, name:port, [v6] or [v6]:port) with `port` for its port."""
    # A name or an IPv4 address holds no colon; an IPv6 address is in brackets.
    name = host[:host.index("]") + 1] if host.startswith("[") and "]" in host else host.partition(":")[0]
    return f"{name}:{port}"


_NAMED_FIELD = re.compile(r"invalid `([\w.\[\]]+)`")


def _failure(e: RequestFailed) -> web.Response:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if e.code is ErrorCode.OVERLOADED else None
    return web.json_response(_failure_body(e), status=e.code.http_status, headers=headers)


async def _echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    label = clean_label(request.headers.get("X-Request-Id"))
    if label:
        response.headers["X-Request-Id"] = label


def _label(request: web.Request, body_label: str | None) -> str:
    """The client's name for a request: the `X-Request-Id` header, else the body's (`user`, `rid`)."""
    return clean_label(request.headers.get("X-Request-Id") or body_label)


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
        raise ApiError(400, f"the X-Request-Timeout header must be a number of seconds > 0, not {text!r}",
                       param="X-Request-Timeout")
    return value


def _held_back(body: dict) -> bool:
    """A chat chunk with nothing to say yet: its text is held back by its `AssistantOutput` (it may be the start of
    `</think>` or of a call block), no finish, no logprobs, no usage."""
    only = body["choices"][0]
    return ("delta" in only and not only["delta"] and only["finish_reason"] is None and only["logprobs"] is None
            and "usage" not in body)


def _failure_body(e: RequestFailed) -> dict:
    """OpenAI's error object for a failed request (also sent as the last SSE event of a broken stream). A worker's
    refusal of a field (``invalid `name`: ...``, `InvalidRequestError`) names it as `param`."""
    named = _NAMED_FIELD.match(e.message) if e.code is ErrorCode.INVALID_REQUEST else None
    return error_body(e.message, e.code.openai_type, named.group(1) if named else None, e.code.value)


def _internal_error_event(where: str) -> bytes:
    """The last SSE event of a stream broken by a bug: headers are out, so the error travels as data."""
    logger.exception("unexpected error while streaming %s", where)
    body = error_body("internal server error; the router's log has the details", "server_error", None,
                      "internal_error")
    return f"data: {json.dumps(body)}\n\n".encode()


async def _body(request: web.Request, max_bytes: int) -> bytes:
    """The raw JSON body. An absent Content-Type is read as JSON (minimal clients send none); any other type is
    refused, `curl -d` without `-H 'Content-Type: application/json'` (a form) included, with a message saying so."""
    if "Content-Type" in request.headers:
        ctype = request.content_type
        if ctype != "application/json" and not ctype.endswith("+json"):
            raise ApiError(415, f"`Content-Type` must be application/json (got {ctype})",
                           code="unsupported_media_type")
    # A body announced too large is refused before a byte of it is read; one sent without a length (chunked) is
    # refused by `read` once it passes the limit (`client_max_size`). Both: a 413 from the middleware.
    if request.content_length is not None and request.content_length > max_bytes:
        raise web.HTTPRequestEntityTooLarge(max_size=max_bytes, actual_size=request.content_length)
    return await request.read()


async def _collect(stream) -> tuple[str, list, tuple]:
    """A candidate's whole text, logprobs and prompt logprobs (with `prompt_logprobs`)."""
    text, lps, prompt_lps = [], [], ()
    async for chunk in stream:
        text.append(chunk.text)
        lps += chunk.logprobs
        prompt_lps = chunk.prompt_logprobs or prompt_lps
    return "".join(text), lps, prompt_lps


async def _end_all(tasks: Sequence[asyncio.Future], streams: list) -> None:
    """Stop the candidates still running (one failed, or the client left) and close every stream (which cancels
    their legs): the tasks end first, so that no stream is closed while a task still iterates it."""
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for s in streams:
        await s.aclose()


def _choices_usage(parsed: oai.ParsedRequest, runs: list, totals: list[Totals]) -> dict:
    """A fanned-out request's usage: each prompt counted once (with its first candidate's cached tokens), every
    candidate's completion tokens (the ones `best_of` leaves out included, as OpenAI bills them)."""
    first = {i: k for k, (i, *_rest) in reversed(list(enumerate(runs)))}
    prompt = sum(totals[k].prompt_tokens for k in first.values())
    cached = sum(totals[k].cached_tokens for k in first.values())
    return oai.usage(prompt, sum(t.completion_tokens for t in totals), cached)


class HttpApi:
    def __init__(self, core: RouterCore, metrics_port: int | None = None):
        self.core = core
        self.metrics_port = metrics_port
        self.served = oai.ServedModel(core.served_name, core.max_model_len, core.model_config.vocab_size,
                                      core.tokenizer, core.chat_template, core.max_token_chars)

    # ---- OpenAI -----------------------------------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._openai(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._openai(request, chat=True)

    async def _openai(self, request: web.Request, chat: bool) -> web.StreamResponse:
        core = self.core
        try:
            raw = await _body(request, core.options.admission.max_body_bytes)
            req: ChatCompletionRequest | CompletionRequest
            # A long prompt is tokenized (its chat template rendered) off the event loop: see `prompt_work`. A text
            # that cannot fit is refused by its length first, here (a chat prompt's once its template is rendered).
            if chat:
                req = oai.validate(ChatCompletionRequest, raw)
                weight = sum(len(m.text()) for m in req.messages)
                parsed = await core.prompt_work.run(weight, oai.parse_chat, req, self.served)
            else:
                req = oai.validate(CompletionRequest, raw)
                values = req.prompt_values()
                for i, prompt in enumerate(values):
                    oai.check_text_fits(prompt, self.served, "prompt" if len(values) == 1 else f"prompt[{i}]")
                parsed = await core.prompt_work.run(sum(map(len, values)), oai.parse_completion, req, self.served)
            timeout = _timeout(request)
        except ApiError as e:
            core.metrics.count_request("chat" if chat else "completions", "invalid")
            return json_error(e)
        rid = oai.new_id(chat)  # minted here: the router's id (uuid4-based), also the response's `id`
        if parsed.candidates > 1 or parsed.echo is not None:
            return await self._choices(request, rid, chat, parsed, timeout, _label(request, req.user))
        totals = Totals(len(parsed.prompt_ids))
        stream = core.run("chat" if chat else "completions", rid, parsed.prompt_ids, parsed.params, totals,
                          timeout_s=timeout, label=_label(request, req.user), caller=current_caller(),
                          trace_parent=tracing.parent_of_headers(request.headers))
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
                                                     totals.finish_reason, logprobs, use, stream=False,
                                                     reader=oai.assistant_reader(parsed.shape)))

    async def _sse(self, request, rid, chat, parsed, stream, totals) -> web.StreamResponse:
        core = self.core
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        first = True
        reader = oai.assistant_reader(parsed.shape)
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
                                           stream=True, first=first, reader=reader)
                first = False
                if _held_back(body):
                    continue
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

    async def _choices(self, request: web.Request, rid: str, chat: bool, parsed: oai.ParsedRequest,
                       timeout: float | None, label: str) -> web.StreamResponse:
        """A batch of prompts and/or `n` > 1 (or `best_of`), or an `echo`: one request per candidate, all at once
        (request ids `<rid>-<k>`), candidate j of a prompt seeded with `choice_seed(seed, j)`; the choices of prompt
        i are indexed `i * n + j`. With `best_of` > n each prompt keeps its n candidates of highest cumulative
        logprob; with `echo` each choice's text (and logprobs) start with its prompt's."""
        core = self.core
        per_prompt = max(parsed.n, parsed.best_of)
        ranked = parsed.best_of > parsed.n
        runs: list[tuple[int, int, list[int], SamplingParams]] = []  # (prompt index, candidate j, prompt, params)
        for i, ids in enumerate(parsed.prompts):
            for j in range(per_prompt):
                params = replace(parsed.params, seed=oai.choice_seed(parsed.params.seed, j))
                if ranked and params.logprobs is None:
                    params = replace(params, logprobs=0)  # (the sampled tokens' logprobs rank the candidates)
                runs.append((i, j, ids, params))
        totals = [Totals(len(ids)) for _, _, ids, _ in runs]
        parent = tracing.parent_of_headers(request.headers)
        streams = [core.run("chat" if chat else "completions", f"{rid}-{k}", ids, params, totals[k],
                            timeout_s=timeout, label=label, caller=current_caller(), trace_parent=parent)
                   for k, (_, _, ids, params) in enumerate(runs)]
        use = functools.partial(_choices_usage, parsed, runs, totals)
        if parsed.stream:
            indices = [i * parsed.n + j for i, j, _, _ in runs]
            echoes = [(parsed.echo[i], ids) if parsed.echo is not None else None for i, _, ids, _ in runs]
            return await self._sse_choices(request, rid, chat, parsed, streams, indices, use, echoes, totals)
        tasks = [asyncio.ensure_future(_collect(s)) for s in streams]
        try:
            results = await asyncio.gather(*tasks)
        except RequestFailed as e:
            return _failure(e)
        finally:
            await _end_all(tasks, streams)
        choices = []
        for i in range(len(parsed.prompts)):
            mine = [k for k, run in enumerate(runs) if run[0] == i]
            if ranked:  # (stable: equal scores keep candidate order)
                mine.sort(key=lambda k: -sum(lp.logprob for lp in results[k][1]))
            for j, k in enumerate(mine[: parsed.n]):
                text, lps, prompt_lps = results[k]
                reason = totals[k].finish_reason
                if parsed.score_only:  # (the one token generated for the prompt's logprobs is not returned)
                    text, lps, reason = "", [], FinishReason.LENGTH
                    totals[k].completion_tokens = 0
                logprobs = oai.logprobs_json(lps, core.tokenizer, chat) if parsed.logprobs is not None else None
                if parsed.echo is not None:  # the prompt first: its text, and its tokens' logprobs
                    text = parsed.echo[i] + text
                    if parsed.logprobs is not None:
                        logprobs = oai.echo_logprobs_json(runs[k][2], prompt_lps, lps, core.tokenizer)
                choices.append(oai.choice(chat, text, reason, logprobs, stream=False,
                                          reader=oai.assistant_reader(parsed.shape),
                                          index=i * parsed.n + j))
        body = oai.completion_body(rid, core.served_name, chat, "", None, None, use(), stream=False)
        body["choices"] = choices
        return web.json_response(body)

    async def _sse_choices(self, request: web.Request, rid: str, chat: bool, parsed: oai.ParsedRequest,
                           streams: list, indices: list[int], use, echoes: list[tuple[str, list[int]] | None],
                           totals: list[Totals]) -> web.StreamResponse:
        """The candidates' chunks as they come, each with its choice's `index` (each choice's first chunk opens its
        assistant message in chat, or with `echo` starts with its prompt's text and logprobs); one failure ends the
        whole stream."""
        core = self.core
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(k: int, stream) -> None:
            try:
                async for chunk in stream:
                    await queue.put((k, chunk, None))
                await queue.put((k, None, None))
            except Exception as e:  # noqa: BLE001 (handed to the writer: a failure, or a bug it re-raises)
                await queue.put((k, None, e))

        tasks = [asyncio.ensure_future(pump(k, s)) for k, s in enumerate(streams)]
        readers = [oai.assistant_reader(parsed.shape) for _ in streams]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        started, opened, done = False, set(), 0
        try:
            while done < len(streams):
                k, chunk, failure = await queue.get()
                if isinstance(failure, RequestFailed):
                    if not started:
                        return _failure(failure)
                    await resp.write(f"data: {json.dumps(_failure_body(failure))}\n\n".encode())
                    break
                if failure is not None:  # a bug: before any chunk, the middleware's 500; after, the error event
                    if not started:
                        raise failure
                    await resp.write(_internal_error_event(rid))
                    break
                if chunk is None:
                    done += 1
                    continue
                if not started:
                    await resp.prepare(request)
                    started = True
                text, token_lps, reason = chunk.text, chunk.logprobs, chunk.finish_reason
                if parsed.score_only:  # (the one token generated for the prompt's logprobs is not returned)
                    text, token_lps, reason = "", [], FinishReason.LENGTH if chunk.finished else None
                    totals[k].completion_tokens = 0
                lps = oai.logprobs_json(token_lps, core.tokenizer, chat) if parsed.logprobs is not None else None
                echo = echoes[k] if k not in opened else None
                if echo is not None:  # the choice's first chunk: its prompt first
                    text = echo[0] + text
                    if parsed.logprobs is not None:
                        lps = oai.echo_logprobs_json(echo[1], chunk.prompt_logprobs, token_lps, core.tokenizer)
                body = oai.completion_body(rid, core.served_name, chat, text, reason, lps,
                                           use() if parsed.continuous_usage else None, stream=True,
                                           first=k not in opened, index=indices[k], reader=readers[k])
                opened.add(k)
                if _held_back(body):
                    continue
                await resp.write(f"data: {json.dumps(body)}\n\n".encode())
            else:
                if not started:
                    await resp.prepare(request)
                    started = True
                if parsed.include_usage:
                    chunk_body = oai.usage_chunk(rid, core.served_name, chat, use())
                    await resp.write(f"data: {json.dumps(chunk_body)}\n\n".encode())
                await resp.write(b"data: [DONE]\n\n")
        finally:
            await _end_all(tasks, streams)
        await resp.write_eof()
        return resp

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.core.served_name, "object": "model", "created": 0, "owned_by": "pdspark",
             "max_model_len": self.core.max_model_len}]})

    # ---- the tokenizer (vLLM's shapes) -------------------------------------------------------------------------------
    async def tokenize(self, request: web.Request) -> web.Response:
        core = self.core
        try:
            req = oai.validate(TokenizeRequest, await _body(request, core.options.admission.max_body_bytes))
            weight = len(req.prompt or "") + sum(len(m.text()) for m in req.messages or ())
            # (off the event loop, as a prompt is: `prompt_work`)
            return web.json_response(await core.prompt_work.run(weight, tokenization.tokenize, req, self.served))
        except ApiError as e:
            return json_error(e)

    async def detokenize(self, request: web.Request) -> web.Response:
        core = self.core
        try:
            req = oai.validate(DetokenizeRequest, await _body(request, core.options.admission.max_body_bytes))
            return web.json_response(await core.prompt_work.run(len(req.tokens), tokenization.detokenize, req,
                                                                self.served))
        except ApiError as e:
            return json_error(e)

    async def tokenizer_info(self, request: web.Request) -> web.Response:
        try:
            return web.json_response(tokenization.tokenizer_info(self.served))
        except ApiError as e:
            return json_error(e)

    # ---- native ------------------------------------------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.StreamResponse:
        """`{"text" | "input_ids", "sampling_params": {...}, "stream"}` -> `{"text", "output_ids", "meta_info"}`."""
        core = self.core
        try:
            req = oai.validate(GenerateRequest, await _body(request, core.options.admission.max_body_bytes))
            oai.check_text_fits(req.text, self.served, "text")  # as `_openai` does
            weight = len(req.text or "") + len(req.input_ids or ())
            parsed = await core.prompt_work.run(weight, oai.parse_generate, req, self.served)
            timeout = _timeout(request)
        except ApiError as e:
            core.metrics.count_request("generate", "invalid")
            return json_error(e)
        rid = core.new_request_id()
        # The body's `rid` is a label like X-Request-Id: a client's name never becomes the request's id.
        totals = Totals(len(parsed.prompt_ids))
        stream = core.run("generate", rid, parsed.prompt_ids, parsed.params, totals, timeout_s=timeout,
                          label=_label(request, req.rid), caller=current_caller(),
                          trace_parent=tracing.parent_of_headers(request.headers))

        # The workers' addresses: empty unless the caller may list workers (`RouterCore.run` leaves them out).
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
            await resp.write(f"data: {json.dumps(_failure_body(e))}\n\n".encode())
        except ConnectionResetError:
            raise
        except Exception:
            if not resp.prepared:
                raise  # nothing sent yet: the middleware answers 500
            await resp.write(_internal_error_event(rid))
        finally:
            await stream.aclose()
        if not resp.prepared:
            await resp.prepare(request)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    # ---- operations --------------------------------------------------------------------------------------------------
    async def openapi(self, request: web.Request) -> web.Response:
        return web.json_response(openapi_document(self.core.keys.generation_needs_key))

    async def live(self, request: web.Request) -> web.Response:
        """The liveness (and startup) probe's answer: this event loop turns. It does not depend on the workers (a
        router restarted because its workers load slowly or a decode pod is lost would only add an outage)."""
        if self.core.peers is None:
            return web.json_response({"status": "alive"})
        return web.json_response({"status": "alive", "process": self.core.peers.index})  # which of the group

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
        if self.core.peers is None:
            self.core.publish_gauges()
            body = generate_latest(self.core.metrics.registry)
        else:  # every process's gauges written now, then every process's files read
            await self.core.peers.ask("publish_gauges", {})
            body = self.core.metrics.group_exposition()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def prometheus_targets(self, request: web.Request) -> web.Response:
        """Prometheus HTTP service discovery: every metrics endpoint of the cluster (see `prometheus_targets`)."""
        # The router at its advertised address, else as the scraper reached it; on the port of its `/metrics` when
        # that is another one.
        opts = self.core.options
        host = request.host
        if opts.advertise_host is not None:  # (the port this router listens on, where the request arrived)
            sock = request.transport.get_extra_info("sockname") if request.transport is not None else None
            host = f"[{opts.advertise_host}]" if ":" in opts.advertise_host else opts.advertise_host
            host = _with_port(host, sock[1]) if sock else host
        router = host if self.metrics_port is None else _with_port(host, self.metrics_port)
        return web.json_response(prometheus_targets(self.core.registry.workers.values(), self.core.served_name,
                                                    router, request.scheme, opts.instance_name))

    async def workers(self, request: web.Request) -> web.Response:
        return web.json_response([w.to_json() for w in self.core.registry.workers.values()])

    async def add_worker(self, request: web.Request) -> web.Response:
        try:
            body = json.loads(await _body(request, self.core.options.admission.max_body_bytes))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"malformed JSON body: {e}", code="invalid_json") from e
        if not isinstance(body, dict) or not isinstance(body.get("address"), str):
            raise ApiError(422, "`address` (host:port) and `role` (prefill or decode) are required", "address")
        problem = address_problem(body["address"])
        if problem is not None:
            raise ApiError(400, problem, "address", "invalid_address")
        if body["address"] in self.core.registry.workers:
            raise ApiError(409, f"worker {body['address']} is already registered (DELETE it first to add it anew)",
                           "address", "already_exists")
        answer = await self.core.change_workers("add_worker", {
            "role": str(body.get("role")), "address": body["address"], "metrics_url": str(body.get("metrics_url", ""))})
        if "error" in answer:  # (the address is new: what is left to refuse is the role)
            raise ApiError(400, answer["error"], answer["field"])
        return web.json_response(answer["worker"], status=201)

    async def remove_worker(self, request: web.Request) -> web.Response:
        address = request.query.get("address", "")
        if address not in self.core.registry.workers:
            raise ApiError(404, f"no worker {address!r}", "address")
        answer = await self.core.change_workers("remove_worker", {"address": address})
        if "error" in answer:  # removed meanwhile by another request
            raise ApiError(404, f"no worker {address!r}", "address")
        return web.json_response(answer["worker"])
