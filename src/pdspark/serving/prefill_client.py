"""`PrefillClients`: the decode worker's gRPC clients of prefill workers (one channel per address)."""

from __future__ import annotations

import threading

import grpc

from pdspark.rpc import convert
from pdspark.rpc.status import failure_from_rpc_error
from pdspark.transfer.plan import TransferPlan, TransferResult
from pdspark.v1 import worker_pb2_grpc

_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]


class PrefillClients:
    def __init__(self) -> None:
        self._stubs: dict[str, worker_pb2_grpc.PrefillWorkerStub] = {}
        self._lock = threading.Lock()

    def stub(self, address: str) -> worker_pb2_grpc.PrefillWorkerStub:
        with self._lock:
            if address not in self._stubs:
                self._stubs[address] = worker_pb2_grpc.PrefillWorkerStub(grpc.insecure_channel(address, _OPTIONS))
            return self._stubs[address]

    def submit_plan(self, address: str, plan: TransferPlan, timeout_s: float) -> TransferResult:
        """Send the plan and wait for the result; raises `RequestFailed` (the prefill side's, or DEADLINE)."""
        try:
            msg = self.stub(address).SubmitPlan(convert.plan_to_pb(plan), timeout=max(timeout_s, 0.001))
        except grpc.RpcError as e:
            raise failure_from_rpc_error(e) from e
        return convert.result_from_pb(msg)
