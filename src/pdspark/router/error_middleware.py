"""`error_middleware`: every error the router's HTTP API answers is OpenAI's error object, whatever raised it.

- `ApiError` (a refused request): its own status and body.
- aiohttp's HTTP errors: 404 unknown route, 405 wrong method (its `Allow` header kept), 413 body over the size
  limit, and any other 4xx/5xx aiohttp raises: same status, OpenAI body.
- Anything else: logged with its traceback, answered 500 `internal_error` without it.

A response whose headers already went out (an SSE stream) cannot be replaced: such an error propagates and aiohttp
closes the connection; the streaming handlers report their own failures as a last event instead.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from contextvars import ContextVar

from aiohttp import web

from pdspark.router.openai.api_error import ApiError

logger = logging.getLogger(__name__)

# Whether the request being handled has a response on the wire: a fresh flag per request, set by `mark_started`.
# NOTE: a context variable rather than request storage (string keys there warn, `web.RequestKey` needs aiohttp 3.14);
# `prepare` runs in the handler's own task, which sees the middleware's value.
_started: ContextVar[list[bool]] = ContextVar("pdspark_response_started")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large", 415: "unsupported_media_type"}


def json_error(e: ApiError, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(e.body(), status=e.status, headers=headers)


async def mark_started(request: web.Request, response: web.StreamResponse) -> None:
    """`on_response_prepare` hook: remembers that the current request has a response on the wire."""
    flag = _started.get(None)
    if flag is not None:
        flag[0] = True


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    started = [False]
    token = _started.set(started)
    try:
        return await _answer(request, handler, started)
    finally:
        _started.reset(token)


async def _answer(request: web.Request, handler: Handler, started: list[bool]) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as e:
        return json_error(e)
    except web.HTTPException as e:
        if e.status < 400:
            raise  # redirects and the like are not errors
        return json_error(_from_http(request, e), _kept_headers(e))
    except ConnectionResetError:
        raise  # the client went away: nobody to answer
    except Exception:
        if started[0]:
            raise
        logger.exception("unexpected error serving %s %s", request.method, request.path)
        return json_error(ApiError(500, "internal server error; the router's log has the details",
                                   code="internal_error"))


def _from_http(request: web.Request, e: web.HTTPException) -> ApiError:
    if e.status == 404:
        message = f"no route {request.path}; see /openapi.json for the API"
    elif e.status == 405:
        allowed = e.headers.get("Allow", "")
        message = f"method {request.method} is not allowed on {request.path}; allowed: {allowed}"
    elif e.status == 413:
        # aiohttp's text names the limit and the size it saw.
        message = f"request body too large: {e.text}"
    else:
        text = e.text or ""
        message = e.reason if not text or text.startswith(f"{e.status}:") else text
    code = _CODES.get(e.status, e.reason.lower().replace(" ", "_"))
    return ApiError(e.status, message, code=code)


def _kept_headers(e: web.HTTPException) -> dict[str, str]:
    return {k: v for k, v in e.headers.items() if k in ("Allow", "Retry-After")}

