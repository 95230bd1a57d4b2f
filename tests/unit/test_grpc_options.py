"""Every gRPC channel argument pdspark sets is one gRPC knows (gRPC ignores an unknown key without a word, so a
misspelt keepalive or ping-policy option would silently leave the default in place), and every worker server
accepts the pings the channels send (a server that thinks a client pings too often answers GOAWAY
"too_many_pings", which would break the channel instead), and a peer that stops answering is dropped within the
lease (tests/cluster/test_leases.py measures it)."""

from __future__ import annotations

from pathlib import Path

import pytest
from grpc._cython import cygrpc

from pdspark.client.client import KEEPALIVE_OPTIONS as SDK_KEEPALIVE
from pdspark.router.router_server import SERVER_OPTIONS as ROUTER_SERVER
from pdspark.rpc.keepalive import CHANNEL_OPTIONS, LEASE_S, SERVER_OPTIONS

ALL_KEYS = sorted({k for k, _ in (*CHANNEL_OPTIONS, *SERVER_OPTIONS, *ROUTER_SERVER, *SDK_KEEPALIVE)})


@pytest.fixture(scope="module")
def known_keys() -> bytes:
    # The channel-argument names are string constants in gRPC core, compiled into this extension.
    return Path(cygrpc.__file__).read_bytes()


@pytest.mark.parametrize("key", ALL_KEYS)
def test_the_option_is_one_grpc_knows(known_keys, key):
    assert key.encode() + b"\0" in known_keys, f"gRPC has no channel argument {key!r}"


def test_a_misspelt_option_would_be_caught(known_keys):
    assert b"grpc.http2.min_recv_ping_interval_without_data_ms\0" not in known_keys


def test_servers_accept_the_pings_channels_send():
    channel, server = dict(CHANNEL_OPTIONS), dict(SERVER_OPTIONS)
    assert channel["grpc.keepalive_permit_without_calls"] == 1  # an idle channel to a hung peer breaks too
    assert server["grpc.keepalive_permit_without_calls"] == 1
    assert channel["grpc.keepalive_time_ms"] >= server["grpc.http2.min_ping_interval_without_data_ms"]
    assert server["grpc.http2.max_ping_strikes"] == 0 and channel["grpc.http2.max_pings_without_data"] == 0


def test_a_silent_peer_breaks_the_connection_within_the_lease():
    # gRPC core waits for a ping's ack `ping_timeout_ms` (60 s by default), whatever `keepalive_timeout_ms` says:
    # both sides must set it, or a stopped peer holds its calls for a minute more than the lease.
    for options in (dict(CHANNEL_OPTIONS), dict(SERVER_OPTIONS)):
        assert options["grpc.http2.ping_timeout_ms"] == options["grpc.keepalive_timeout_ms"]
        assert (options["grpc.keepalive_time_ms"] + options["grpc.http2.ping_timeout_ms"]) / 1000 == LEASE_S
    assert LEASE_S <= 5, "a vanished peer must be noticed within a few seconds"
