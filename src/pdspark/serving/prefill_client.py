"""`PrefillClients`: the decode worker's asyncio gRPC clients of prefill workers (one channel per address, with
keepalive: a prefill worker that hangs without closing its socket breaks the channel instead of holding calls; mutual
TLS with the worker's own certificate when it has one)."""

from __future__ import annotations

import grpc

from pdspark.config import TLSConfig
from pdspark.errors import Unanswered
from pdspark.rpc import convert, tracing
from pdspark.rpc.keepalive import CHANNEL_OPTIONS, LEASE_S
from pdspark.rpc.status import failure_from_rpc_error, reported_failure
from pdspark.rpc.tls_credentials import aio_channel
from pdspark.transfer.plan import TransferPlan, TransferResult
from pdspark.v1 import worker_pb2, worker_pb2_grpc


class PrefillClients:
    """Channels are made on first use, on the asyncio loop that uses them (a grpc.aio channel belongs to one)."""

    def __init__(self, tls: TLSConfig | None = None, credentials: grpc.ChannelCredentials | None = None) -> None:
        """`credentials`: made from `tls` once (at start, where a bad file is a configuration error)."""
        self._tls, self._credentials = tls, credentials
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, worker_pb2_grpc.PrefillWorkerStub] = {}

    def stub(self, address: str) -> worker_pb2_grpc.PrefillWorkerStub:
        if address not in self._stubs:
            self._channels[address] = aio_channel(address, self._tls, CHANNEL_OPTIONS, self._credentials)
            self._stubs[address] = worker_pb2_grpc.PrefillWorkerStub(self._channels[address])
        return self._stubs[address]

    async def submit_plan(self, address: str, plan: TransferPlan, timeout_s: float) -> TransferResult:
        """Send the plan and wait (at most `timeout_s`) for the result; raises `RequestFailed` (the prefill
        side's), or `Unanswered` (DEADLINE / UNAVAILABLE from the transport: the prefill worker may still be
        writing). Cancelling the caller cancels the call, which the prefill worker sees."""
        try:
            msg = await self.stub(address).SubmitPlan(convert.plan_to_pb(plan), timeout=max(timeout_s, 0.001),
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
            reply = await self.stub(address).Abort(worker_pb2.AbortRequest(request_id=request_id), timeout=LEASE_S)
        except grpc.RpcError as e:
            raise failure_from_rpc_error(e) from e
        return reply.found

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
        self._stubs.clear()
