"""`auth_middleware`: every HTTP request is checked against the router's keys (`ApiKeys`) before its handler runs,
and so before its body is read: a caller without a valid key costs the router a header, not a body.

What a route needs (`access_of`): generation (`/v1/*`, `/generate`) an API key, `/workers` an admin key (reading
it: see `api_keys` for a development router), `/prometheus/targets` what reading `/workers` needs (it lists the
workers' addresses), the rest nothing. A refused request gets OpenAI's error object: 401
(`authentication_error`, with `WWW-Authenticate: Bearer`) or 403 (`permission_error`). The handler finds who called
with `current_caller()`.

NOTE: no key is ever logged: a refusal logs (at debug level) the route and the peer's address only, and counts in
`pdspark_router_auth_failures_total`.
"""

from __future__ import annotations

import logging
from contextvars import ContextVar

from aiohttp import web

from pdspark.errors import ErrorCode
from pdspark.router.auth.api_keys import ANONYMOUS, Access, ApiKeys, Caller
from pdspark.router.error_middleware import Handler, json_error
from pdspark.router.openai.api_error import ApiError
from pdspark.router.router_metrics import RouterMetrics

logger = logging.getLogger(__name__)

# Who sent the request being handled (set per request; a context variable for the reason `error_middleware` gives).
_caller: ContextVar[Caller] = ContextVar("pdspark_caller")


def current_caller() -> Caller:
    """The caller of the request this handler serves."""
    return _caller.get(ANONYMOUS)


# Outside `/v1/`, the routes that use the model (its workers, or its tokenizer's work): keyed as generation is (vLLM
# leaves its tokenizer routes open; they cost the router's threads, and a keyed router lends them to its callers only).
_MODEL_ROUTES = frozenset({"/generate", "/tokenize", "/detokenize", "/tokenizer_info"})


def access_of(request: web.Request, admin_routes: bool = True) -> Access:
    """What `request`'s route needs: by the route it matched (the path as registered, whatever the spelling of the
    request's), else by its path (an unknown `/v1/...` is refused before it is found missing). `admin_routes`: False
    on an application without them (the main port, with `--admin-port`), where their paths are unknown to everyone
    (404), as any other."""
    resource = request.match_info.route.resource
    path = resource.canonical if resource is not None else request.path
    if path in _MODEL_ROUTES or path.startswith("/v1/") or path == "/v1":
        return Access.GENERATE
    if not admin_routes:
        return Access.OPEN
    if path == "/workers":
        return Access.LIST_WORKERS if request.method in ("GET", "HEAD") else Access.MANAGE_WORKERS
    if path == "/prometheus/targets":
        return Access.LIST_WORKERS
    return Access.OPEN


def auth_middleware(keys: ApiKeys, metrics: RouterMetrics, admin_routes: bool = True):
    """The key check of an application; `admin_routes`: whether it serves them (see `access_of`)."""

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        caller = keys.identify(request.headers.get("Authorization"))
        failure = keys.refusal(caller, access_of(request, admin_routes))
        if failure is not None:
            unauthenticated = failure.code is ErrorCode.UNAUTHENTICATED
            reason = ("invalid_key" if caller.presented else "missing_key") if unauthenticated else "forbidden"
            metrics.auth_failures.labels(api="http", reason=reason).inc()
            logger.debug("refused %s %s from %s: %s", request.method, request.path, request.remote, reason)
            error = ApiError(failure.code.http_status, failure.message, code=failure.code.value,
                             type_=failure.code.openai_type)
            return json_error(error, {"WWW-Authenticate": "Bearer"} if unauthenticated else None)
        token = _caller.set(caller)
        try:
            return await handler(request)
        finally:
            _caller.reset(token)

    return check
