"""Blocking HTTP calls at a router's OpenAI API, for the load that the observability test and the dashboards
preview (bench/plot_dashboards.py) drive: a request whose status is all that matters, and a client that walks away
from its stream."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request

from pdspark.testing.time_scale import scaled


def post(http: str, path: str, body: dict, timeout: float = 60) -> int:
    """POST `body` as JSON to `http + path`, read the whole answer (within `timeout`, scaled); its HTTP status."""
    req = urllib.request.Request(http + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=scaled(timeout)) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def drop_a_stream(http: str, timeout: float = 30) -> None:
    """A client that reads its stream's first events (each read within `timeout`, scaled) and goes away (a cancel
    the router and workers must see)."""
    host, port = http.removeprefix("http://").split(":")
    body = json.dumps({"prompt": [7] * 8, "max_tokens": 200, "stream": True, "ignore_eos": True}).encode()
    with socket.create_connection((host, int(port)), timeout=scaled(timeout)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        received = b""
        while received.count(b"data:") < 2 and (chunk := sock.recv(4096)):
            received += chunk
