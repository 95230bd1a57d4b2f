"""A worker's probe port, as the kubelet uses it (the Helm chart's probes and preStop): `/health` says whether it
takes work, `/live` whether its event loop turns, `/metrics` stays Prometheus'; the preStop's SIGUSR1 drains it (not
ready, still alive, gRPC health NOT_SERVING) and SIGTERM then stops it within `--drain-timeout-s`."""

from __future__ import annotations

import json
import signal
import time
import urllib.error
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdspark.testing.services import ready, spawn_worker
from pdspark.testing.time_scale import scaled

DRAIN_S = 2.0


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=scaled(10)) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def grpc_health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                          timeout=scaled(10)).status


def test_health_live_and_metrics_then_the_prestop_drain_and_the_stop(draft_ckpt):
    (worker,) = ready(spawn_worker("prefill", str(draft_ckpt), "--page-size", "16", "--max-model-len", "128",
                                   "--drain-timeout-s", str(DRAIN_S)))
    try:
        base = f"http://127.0.0.1:{worker.info['metrics_port']}"
        assert get(base + "/health") == (200, json.dumps({"status": "ok"}).encode())
        assert get(base + "/live")[0] == 200
        status, metrics = get(base + "/metrics")
        assert status == 200 and b"pdspark_engine_running_requests" in metrics
        assert grpc_health(worker.info["address"]) == health_pb2.HealthCheckResponse.SERVING
        # The preStop: stop taking new work, stay alive (the process must not be restarted meanwhile).
        worker.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + scaled(10)
        while get(base + "/health")[0] != 503:
            assert time.monotonic() < deadline, "not drained 10 s after SIGUSR1"
            time.sleep(0.05)
        assert get(base + "/live")[0] == 200
        assert grpc_health(worker.info["address"]) == health_pb2.HealthCheckResponse.NOT_SERVING
        # SIGTERM: nothing runs, so it stops cleanly within the drain timeout and the process's exit (else it would
        # be killed: not 0).
        assert worker.stop(timeout=scaled(DRAIN_S + 15)) == 0
    finally:
        worker.stop()
