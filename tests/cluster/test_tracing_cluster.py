"""Tracing end to end: `pdspark up --otlp-endpoint` (router, prefill and decode worker in their own processes)
exports one trace per request to an OTLP collector (this test's): the spans of the three services share the trace
id, and each names the span that called it as its parent, across the gRPC hops."""

from __future__ import annotations

import json
import time
import urllib.request

from otlp_collector import OtlpCollector
from pdspark.launch.service_process import start_service
from pdspark.testing.time_scale import scaled

ENGINE = ["--page-size", "16", "--max-model-len", "256", "--max-num-seqs", "4"]
BATCH_DELAY_MS = 200  # OpenTelemetry's batch span processor, in every service (its environment variable)
NAMES = {"request", "attempt", "prefill", "transfer", "decode", "submit_plan"}


def test_one_trace_across_the_processes_of_pdspark_up():
    with OtlpCollector() as collector:
        cluster = start_service("pdspark up", ["up", "--model", "dsv4-tiny", "--port", "0", "--grpc-port", "0",
                                               "--otlp-endpoint", collector.endpoint, *ENGINE], timeout=scaled(240),
                                env={"OTEL_BSP_SCHEDULE_DELAY": str(BATCH_DELAY_MS)})
        try:
            body = {"prompt": list(range(10, 42)), "max_tokens": 8, "ignore_eos": True}
            req = urllib.request.Request(cluster.info["http"] + "/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=scaled(60)) as r:
                reply = json.loads(r.read())
            # Spans leave in batches, every `BATCH_DELAY_MS` here (5 s by default).
            deadline = time.monotonic() + scaled(30)
            while {s.name for s in collector.spans} < NAMES and time.monotonic() < deadline:
                time.sleep(0.2)
        finally:
            assert cluster.stop() == 0
        spans = {s.name: s for s in collector.spans}
    assert set(spans) >= NAMES, sorted(spans)
    assert len({spans[n].trace_id for n in NAMES}) == 1
    parents = {"attempt": "request", "prefill": "attempt", "transfer": "prefill", "decode": "attempt",
               "submit_plan": "decode"}
    for child, parent in parents.items():
        assert spans[child].parent_span_id == spans[parent].span_id, (child, parent)
    assert spans["request"].parent_span_id == ""
    assert {n: spans[n].service for n in NAMES} == {
        "request": "pdspark-router", "attempt": "pdspark-router", "prefill": "pdspark-prefill",
        "transfer": "pdspark-prefill", "submit_plan": "pdspark-prefill", "decode": "pdspark-decode"}
    assert spans["request"].attributes["pdspark.completion_tokens"] == reply["usage"]["completion_tokens"] == 8
    assert spans["attempt"].attributes["pdspark.prefill_worker"] == "prefill-0"
    assert spans["attempt"].attributes["pdspark.decode_worker"] == "decode-1"
    assert spans["transfer"].attributes["pdspark.transfer.bytes"] > 0
    assert spans["decode"].attributes["pdspark.spec.verify_steps"] > 0
