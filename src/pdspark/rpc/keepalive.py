"""HTTP/2 keepalive settings for every channel a pdspark service opens, and the server settings that allow them.

Every call between two pdspark processes is a lease on what the callee holds for it: the router's `Generate`
stream holds a running request on a decode worker, its `Prefill` call a prompt on a prefill worker, and a decode
worker's `SubmitPlan` call holds the prefill worker's prefilled pages (and the decode worker's reserved ones).
Both ends ping: a peer that stops answering without closing its socket (a hung or stopped process, a dropped
network path) is noticed by the pings, not only by the calls' deadlines. The connection breaks at most `LEASE_S`
after the peer's last sign of life (a ping goes out once `KEEPALIVE_TIME_MS` passed without incoming data, calls
in flight or not; its ack must come within `KEEPALIVE_TIMEOUT_MS`): every call on it ends, UNAVAILABLE at the
caller and cancelled at the callee, which releases what the call held. A peer whose process died closes its
sockets and is noticed at once.

Measured on loopback (grpc 1.85.3, 2 cores; SIGSTOP of one side): the other side's call ended 2.2-3.9 s later,
whether it was waiting or streaming and whichever side stopped; a channel without calls broke after 3.5 s.
tests/cluster/test_leases.py shows it between real workers and the router.

NOTE: gRPC core waits for a keepalive ping's ack `grpc.http2.ping_timeout_ms` (default 60 s), not
`grpc.keepalive_timeout_ms` alone: without the former, a stopped peer was noticed only after 10 + 60 s with the
old 10 s / 5 s settings. Servers accept pings that often, with or without calls in flight; otherwise gRPC answers
frequent pings with GOAWAY ("too_many_pings") and the client loses the connection instead. gRPC ignores a key it
does not know without a word: tests/unit/test_grpc_options.py checks each one against gRPC core.
"""

from __future__ import annotations

KEEPALIVE_TIME_MS = 2_000
# The ack of any ping (keepalive or BDP) is awaited this long. gRPC core answers pings on its own threads, without
# the GIL, so a worker busy in Python still answers: busy is not mistaken for hung.
KEEPALIVE_TIMEOUT_MS = 2_000
# The longest a peer's calls outlive its last sign of life: pings every KEEPALIVE_TIME_MS, each answered within
# KEEPALIVE_TIMEOUT_MS.
LEASE_S = (KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS) / 1000
_MESSAGE_BYTES = 64 << 20  # a plan or a load report is far smaller; this only keeps big prompts from failing

_PINGS: list[tuple[str, int]] = [
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),  # what gRPC core actually waits for (see the NOTE)
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),  # 0: no limit on pings between data frames
]

CHANNEL_OPTIONS: list[tuple[str, int]] = [
    *_PINGS,
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
    *_PINGS,
    ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),  # pings it accepts without data
    ("grpc.http2.max_ping_strikes", 0),  # 0: never GOAWAY a client for pinging
    ("grpc.max_receive_message_length", _MESSAGE_BYTES),
    ("grpc.max_send_message_length", _MESSAGE_BYTES),
]
