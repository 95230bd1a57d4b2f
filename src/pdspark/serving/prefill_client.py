"""`PrefillClients`: the decode worker's asyncio gRPC clients of prefill workers (one channel per address, with
keepalive: a prefill worker that hangs without closing its socket breaks the channel instead of holding calls; mutual
TLS with the worker's own certificate when it has one).

A channel no call used for `idle_s` is closed and forgotten (made again on the next call to that address): prefill
addresses come and go (DNS discovery, a pod restarted under a new IP), and one channel per address ever seen would
grow without bound. A channel with a call on it is never closed. Once the worker's certificate files changed
(`PeerCredentials.refresh`, looked at by each call at most every second), a call gets a new channel presenting the
new certificate, and each older channel closes as its last call ends.

A plan is sent only on a connected channel, so that a plan that never left can be told from one that may have
reached the prefill worker (`submit_plan`): the decode worker quarantines the pages of the latter only."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc

from pdspark.errors import ErrorCode, NotSent, Unanswered
from pdspark.rpc import convert, tracing
from pdspark.rpc.keepalive import CHANNEL_OPTIONS, LEASE_S
from pdspark.rpc.status import failure_from_rpc_error, reported_failure
from pdspark.rpc.tls_credentials import PeerCredentials, aio_channel
from pdspark.transfer.plan import TransferPlan, TransferResult
from pdspark.v1 import worker_pb2, worker_pb2_grpc

IDLE_S = 300.0  # a channel to a prefill worker that no call used for this long is closed


@dataclass
class _Channel:
    channel: grpc.aio.Channel
    stub: worker_pb2_grpc.PrefillWorkerStub
    calls: int = 0  # calls on it now
    last_used: float = 0.0  # clock() when its last call ended (or it was made)
    generation: int = 0  # the `PeerCredentials.generation` it was made with


class PrefillClients:
    """Channels are made on first use, on the asyncio loop that uses them (a grpc.aio channel belongs to one)."""

    def __init__(self, peer: PeerCredentials | None = None, idle_s: float = IDLE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`peer`: mutual TLS (made at start, where a bad file is a configuration error); None: plain text.
        `clock`: the time idleness is measured on (tests)."""
        self._peer = peer
        self.idle_s = idle_s
        self._clock = clock
        self._channels: dict[str, _Channel] = {}
        self._next_sweep = 0.0  # clock() from when idle channels are looked for again
        self._closing: set[asyncio.Future] = set()  # closes of idle and replaced channels under way

    @property
    def addresses(self) -> list[str]:
        """The prefill workers this decode worker holds a channel to."""
        return list(self._channels)

    @contextlib.contextmanager
    def _in_use(self, address: str) -> Iterator[_Channel]:
        """The channel and stub for `address`, the channel counted as in use while the block runs."""
        self._close_idle()
        generation = self._generation()
        entry = self._channels.get(address)
        if entry is not None and entry.generation != generation:  # made with a certificate rotated since
            del self._channels[address]
            if entry.calls == 0:
                self._close_later(entry.channel)
            entry = None
        if entry is None:
            channel = aio_channel(address, "prefill", CHANNEL_OPTIONS, self._peer)
            entry = self._channels[address] = _Channel(channel, worker_pb2_grpc.PrefillWorkerStub(channel),
                                                       last_used=self._clock(), generation=generation)
        entry.calls += 1
        try:
            yield entry
        finally:
            entry.calls -= 1
            entry.last_used = self._clock()
            if entry.calls == 0 and self._channels.get(address) is not entry:  # replaced: its last call ended
                self._close_later(entry.channel)

    def _generation(self) -> int:
        """The certificate generation channels are made with now (the files looked at again first)."""
        if self._peer is None:
            return 0
        self._peer.refresh()
        return self._peer.generation

    def _close_later(self, channel: grpc.aio.Channel) -> None:
        closing = asyncio.ensure_future(channel.close())
        self._closing.add(closing)
        closing.add_done_callback(self._closing.discard)

    def _close_idle(self) -> None:
        """Close the channels no call used for `idle_s` (looked for at most every quarter of it)."""
        now = self._clock()
        if now < self._next_sweep:
            return
        self._next_sweep = now + self.idle_s / 4
        for address, entry in list(self._channels.items()):
            if entry.calls == 0 and now - entry.last_used >= self.idle_s:
                del self._channels[address]
                self._close_later(entry.channel)

    async def submit_plan(self, address: str, plan: TransferPlan, timeout_s: float) -> TransferResult:
        """Send the plan and wait (at most `timeout_s`) for the result; raises `RequestFailed` (the prefill
        side's), `NotSent` (UNAVAILABLE, or DEADLINE: the prefill worker could not be reached, so the plan never
        left), or `Unanswered` (DEADLINE / UNAVAILABLE from the transport once the plan was sent: the prefill
        worker may still be writing). Cancelling the caller cancels the call, which the prefill worker sees."""
        deadline = time.monotonic() + timeout_s
        try:
            with self._in_use(address) as entry:
                await _connected(entry.channel, address, deadline)
                msg = await entry.stub.SubmitPlan(convert.plan_to_pb(plan),
                                                  timeout=max(deadline - time.monotonic(), 0.001),
                                                  metadata=tracing.outgoing_metadata())
        except grpc.RpcError as e:
            if (reported := reported_failure(e)) is not None:
                raise reported from e
            failure = failure_from_rpc_error(e)  # the transport's (no answer in time, unreachable): say from whom
            raise Unanswered(failure.code, f"prefill worker {address}: {failure.message}") from e
        return convert.result_from_pb(msg)

    async def abort(self, address: str, request_id: str) -> bool:
        """Ask the prefill worker to fail the transfer of `request_id` (its plan's `SubmitPlan` call then answers
        once no more writes can land); True when it had one. Raises `RequestFailed` when it does not answer within
        a lease."""
        try:
            with self._in_use(address) as entry:
                reply = await entry.stub.Abort(worker_pb2.AbortRequest(request_id=request_id), timeout=LEASE_S)
        except grpc.RpcError as e:
            raise failure_from_rpc_error(e) from e
        return reply.found

    async def close(self) -> None:
        for entry in self._channels.values():
            await entry.channel.close()
        self._channels.clear()
        if self._closing:
            await asyncio.wait(self._closing)


async def _connected(channel: grpc.aio.Channel, address: str, deadline: float) -> None:
    """Return once `channel` is connected (READY: at once, most often); raise `NotSent` when it is unreachable
    (TRANSIENT_FAILURE: a connection failed, e.g. refused by a dead prefill worker's host) or has not connected by
    `deadline` (`time.monotonic()`).

    Why a plan waits for this instead of going out and reading the failure: a failed call may have been sent or
    not, and nothing gRPC reports tells the two apart. Its status codes do not: UNAVAILABLE is both a connection
    that broke after "some data transmitted" (gRPC's doc/statuscodes.md) and a call failed fast on a channel that
    never connected (doc/wait-for-ready.md, doc/fail_fast.md), and DEADLINE_EXCEEDED may come "either when the
    client is unable to send the request to the server or when the server fails to respond in time"
    (statuscodes.md). Its error texts are no interface. Only not making the call is proof that the plan never left,
    so the call is made only once the channel is READY: a channel in TRANSIENT_FAILURE would fail it at once anyway
    ("fail fast"), while one still connecting (IDLE, CONNECTING) would hold it until the connection is made or
    fails, which this wait does instead. A plan that goes out on a READY channel and fails is `Unanswered`,
    as before: the connection may have broken after the plan reached the prefill worker. (The plan is one unary
    call of its own on this channel, never a multiplexed `Calls` stream, whose frames share a connection that may
    be up for one call and gone for the next.)"""
    state = channel.get_state(try_to_connect=True)
    while state is not grpc.ChannelConnectivity.READY:
        if state in (grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.SHUTDOWN):
            raise NotSent(ErrorCode.UNAVAILABLE, f"prefill worker {address}: unreachable (its channel is "
                                                 f"{state.name}); the plan was not sent")
        try:
            await asyncio.wait_for(channel.wait_for_state_change(state), max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise NotSent(ErrorCode.DEADLINE, f"prefill worker {address}: not connected before the deadline "
                                              f"(its channel is {state.name}); the plan was not sent") from None
        state = channel.get_state(try_to_connect=True)
