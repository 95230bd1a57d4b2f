"""HTTP/2 keepalive settings for every channel a pdspark service opens, and the server settings that allow them.

A peer that stops answering without closing its socket (a hung or stopped process, a dropped network path) is
noticed by the pings, not only by the calls' deadlines: the channel breaks after `KEEPALIVE_TIME_MS +
KEEPALIVE_TIMEOUT_MS` without an answer, failing every call on it (UNAVAILABLE) and reconnecting for the next.
Servers accept pings that often, with or without calls in flight; otherwise gRPC answers frequent pings with
GOAWAY ("too_many_pings") and the client loses the connection instead. gRPC ignores a key it does not know
without a word: tests/unit/test_grpc_options.py checks each one against gRPC core.
"""

from __future__ import annotations

KEEPALIVE_TIME_MS = 10_000
KEEPALIVE_TIMEOUT_MS = 5_000
_MESSAGE_BYTES = 64 << 20  # a plan or a load report is far smaller; this only keeps big prompts from failing

CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),  # 0: no limit on pings between data frames
    # Reconnect to a peer that came back (a restarted worker at its old address) within about a second: gRPC's
    # default backoff grows to 120 s, which would keep a healthy worker out of the router for minutes.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1_000),
    ("grpc.max_receive_message_length", _MESSAGE_BYTES),
    ("grpc.max_send_message_length", _MESSAGE_BYTES),
]

SERVER_OPTIONS: list[tuple[str, int]] = [
    # The server pings its clients too: a caller that hung mid-call is found and its calls cancelled.
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),  # pings it accepts without data
    ("grpc.http2.max_ping_strikes", 0),  # 0: never GOAWAY a client for pinging
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", _MESSAGE_BYTES),
    ("grpc.max_send_message_length", _MESSAGE_BYTES),
]
