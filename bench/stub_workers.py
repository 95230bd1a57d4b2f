"""Stub prefill and decode workers (gRPC, no model): they answer at once, so a benchmark through them measures
only the router. `python bench/stub_workers.py --tokens 16` prints one JSON ready line with both addresses."""

from __future__ import annotations

import argparse
import json
import signal
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdspark.v1 import common_pb2, worker_pb2, worker_pb2_grpc


class StubPrefill(worker_pb2_grpc.PrefillWorkerServicer):
    def Prefill(self, request, context):
        return worker_pb2.PrefillResponse(result=worker_pb2.TransferResult(transfer_id=request.transfer_id,
                                                                           first_token_id=9))

    def Abort(self, request, context):
        return worker_pb2.AbortResponse(found=False)

    def GetLoad(self, request, context):
        return worker_pb2.LoadReport()


class StubDecode(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, tokens: int):
        self.tokens = tokens

    def Generate(self, request, context):
        for i in range(self.tokens):
            yield worker_pb2.GenerateChunk(request_id=request.request_id, token_ids=[9], text="x",
                                           finished=i == self.tokens - 1,
                                           finish_reason=common_pb2.FINISH_REASON_LENGTH if i == self.tokens - 1
                                           else common_pb2.FINISH_REASON_UNSPECIFIED)

    def Abort(self, request, context):
        return worker_pb2.AbortResponse(found=False)

    def GetLoad(self, request, context):
        return worker_pb2.LoadReport()


def serve(servicer, add) -> tuple[grpc.Server, int]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=32))
    add(servicer, server)
    h = health.HealthServicer()
    h.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(h, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()
    p, p_port = serve(StubPrefill(), worker_pb2_grpc.add_PrefillWorkerServicer_to_server)
    d, d_port = serve(StubDecode(args.tokens), worker_pb2_grpc.add_DecodeWorkerServicer_to_server)
    print(json.dumps({"event": "ready", "prefill": f"127.0.0.1:{p_port}", "decode": f"127.0.0.1:{d_port}"}),
          flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    p.stop(1)
    d.stop(1)


if __name__ == "__main__":
    main()
