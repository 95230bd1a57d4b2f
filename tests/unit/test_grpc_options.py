"""Every gRPC channel argument the router and the SDK set is one gRPC knows: gRPC ignores an unknown key without a
word, so a misspelt keepalive or ping-policy option would silently leave the default in place."""

from __future__ import annotations

from pathlib import Path

import pytest
from grpc._cython import cygrpc

from pdspark.client.client import KEEPALIVE_OPTIONS as SDK_KEEPALIVE
from pdspark.router.router_server import SERVER_OPTIONS
from pdspark.router.worker_registry import KEEPALIVE_OPTIONS as WORKER_CHANNEL_KEEPALIVE


@pytest.fixture(scope="module")
def known_keys() -> bytes:
    # The channel-argument names are string constants in gRPC core, compiled into this extension.
    return Path(cygrpc.__file__).read_bytes()


@pytest.mark.parametrize("key", sorted({k for k, _ in (*SERVER_OPTIONS, *WORKER_CHANNEL_KEEPALIVE, *SDK_KEEPALIVE)}))
def test_the_option_is_one_grpc_knows(known_keys, key):
    assert key.encode() + b"\0" in known_keys, f"gRPC has no channel argument {key!r}"


def test_a_misspelt_option_would_be_caught(known_keys):
    assert b"grpc.http2.min_recv_ping_interval_without_data_ms\0" not in known_keys
