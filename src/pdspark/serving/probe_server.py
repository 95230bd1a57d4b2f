"""`ProbeServer`: a worker's plain HTTP port: Prometheus `/metrics`, and the kubelet's probes, `/health` (ready: the
worker takes work; 503 while it loads, drains or has every transfer thread stuck) and `/live` (the process's event
loop still turns; 503 once it has not for `LIVE_STALE_S`).

Plain HTTP whatever the gRPC port's TLS: under mutual TLS a kubelet cannot present a client certificate, so a gRPC
health probe would fail the handshake and the probes would degrade to a bare TCP check; here they ask the worker.
The answers come from the worker's own state, read from this server's threads (a bool and a timestamp), so a busy
engine or event loop never delays them beyond what they report.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

# A worker's event loop that has not turned for this long is stuck (every wait in it has a shorter deadline; a step
# of the engine runs on its own thread): the liveness probe fails and the kubelet restarts the pod.
LIVE_STALE_S = 30.0


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _V6Server(_Server):
    address_family = socket.AF_INET6


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
        pass  # (a probe every few seconds would fill the log)


class ProbeServer:
    def __init__(self, registry: CollectorRegistry, ready: Callable[[], bool], alive: Callable[[], bool]):
        self._metrics = make_wsgi_app(registry)
        self._ready, self._alive = ready, alive
        self._server: WSGIServer | None = None

    def start(self, host: str, port: int) -> int:
        """Serve on `host:port` (0: any free port) from a thread of its own; returns the bound port."""
        server_class = _V6Server if ":" in host else _Server
        self._server = make_server(host, port, self._app, server_class, _Quiet)
        threading.Thread(target=self._server.serve_forever, name="probe-server", daemon=True).start()
        return self._server.server_port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def _app(self, environ: dict, start_response: Callable) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/health":
            return _answer(start_response, self._ready(), "ok", "not serving")
        if path == "/live":
            return _answer(start_response, self._alive(), "alive", "event loop stalled")
        return self._metrics(environ, start_response)


def _answer(start_response: Callable, ok: bool, good: str, bad: str) -> list[bytes]:
    body = json.dumps({"status": good if ok else bad}).encode()
    start_response("200 OK" if ok else "503 Service Unavailable",
                   [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
    return [body]
