"""Keepalive: every channel a worker opens pings its peer, and every server accepts those pings (a server that
thinks a client pings too often answers GOAWAY "too_many_pings", which would break the channel instead)."""

from __future__ import annotations

from pathlib import Path

import pytest
from grpc._cython import cygrpc

from pdspark.rpc.keepalive import CHANNEL_OPTIONS, SERVER_OPTIONS


@pytest.mark.parametrize("key", sorted({k for k, _ in (*CHANNEL_OPTIONS, *SERVER_OPTIONS)}))
def test_each_option_is_one_grpc_knows(key):
    # gRPC ignores an unknown channel argument silently; the known names are strings compiled into gRPC core.
    assert key.encode() + b"\0" in Path(cygrpc.__file__).read_bytes(), f"gRPC has no channel argument {key!r}"


def test_servers_accept_the_pings_channels_send():
    channel, server = dict(CHANNEL_OPTIONS), dict(SERVER_OPTIONS)
    assert channel["grpc.keepalive_permit_without_calls"] == 1  # an idle channel to a hung peer breaks too
    assert server["grpc.keepalive_permit_without_calls"] == 1
    assert channel["grpc.keepalive_time_ms"] >= server["grpc.http2.min_ping_interval_without_data_ms"]
    assert server["grpc.http2.max_ping_strikes"] == 0 and channel["grpc.http2.max_pings_without_data"] == 0
