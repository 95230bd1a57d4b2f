"""Prefill and decode workers as separate processes on loopback: real gRPC, the cache moved by Mooncake over TCP,
DSpark on. The test plays the router's part (dual dispatch with one transfer id)."""

from __future__ import annotations

import threading
import time
import uuid

import grpc
import pytest

from conftest import random_prompts
from helpers import GREEDY, make_llm
from pdspark import SamplingParams
from pdspark.rpc import convert
from pdspark.testing.services import ready, spawn_worker
from pdspark.testing.time_scale import scaled
from pdspark.testing.worker_load import assert_idle
from pdspark.v1 import common_pb2, worker_pb2, worker_pb2_grpc

ARGS = ["--page-size", "16", "--max-model-len", "256", "--max-num-seqs", "4", "--speculative", "dspark",
        "--transfer-backend", "mooncake"]
C128 = ["--num-full-pages", "64"]  # (c128_page_size follows page_size: 16-token HCA groups, 1 entry per page)


@pytest.fixture(scope="module")
def ckpt(draft_ckpt):
    return draft_ckpt


@pytest.fixture(scope="module")
def workers(ckpt):
    """The pair, and a decode worker with another page size (`test_incompatible_workers_...`), loading at once."""
    prefill, decode, other = ready(spawn_worker("prefill", str(ckpt), *ARGS, *C128),
                                   spawn_worker("decode", str(ckpt), *ARGS, *C128, "--no-prefix-cache"),
                                   spawn_worker("decode", str(ckpt), *ARGS, "--page-size", "32", "--no-prefix-cache"))
    yield prefill, decode, other
    other.stop()
    assert decode.stop() == 0 and prefill.stop() == 0  # clean shutdown on SIGTERM


@pytest.fixture(scope="module")
def cluster(workers):
    return workers[:2]


def stubs(prefill, decode):
    return (worker_pb2_grpc.PrefillWorkerStub(grpc.insecure_channel(prefill.address)),
            worker_pb2_grpc.DecodeWorkerStub(grpc.insecure_channel(decode.address)))


def dispatch(prefill, decode, prompt, params, deadline_s=None, send_prefill=True, send_decode=True):
    """The router's dual dispatch: Prefill and Generate concurrently, tied by a fresh transfer id. `deadline_s`: the
    request's (by default a bound of 30 s, scaled)."""
    if deadline_s is None:
        deadline_s = scaled(30.0)
    p_stub, d_stub = stubs(prefill, decode)
    tid, rid = uuid.uuid4().hex, uuid.uuid4().hex
    timeout_ms = int(deadline_s * 1000)  # relative: each worker times it from receipt
    sampling = convert.sampling_to_pb(params)
    result: dict = {"chunks": []}

    def run_prefill():
        req = worker_pb2.PrefillRequest(request_id=rid, transfer_id=tid, prompt_token_ids=prompt, sampling=sampling,
                                        timeout_ms=timeout_ms)
        result["prefill"] = p_stub.Prefill(req, timeout=deadline_s + scaled(5)).result

    thread = threading.Thread(target=run_prefill)
    if send_prefill:
        thread.start()
    if send_decode:
        req = worker_pb2.GenerateRequest(request_id=rid, transfer_id=tid, prompt_token_ids=prompt, sampling=sampling,
                                         prefill_address=prefill.address, timeout_ms=timeout_ms)
        try:
            for chunk in d_stub.Generate(req, timeout=deadline_s + scaled(30)):
                result["chunks"].append(chunk)
        except grpc.RpcError as e:
            result["decode_error"] = e
    if send_prefill:
        thread.join(deadline_s + scaled(10))
    result["tokens"] = [t for c in result["chunks"] for t in c.token_ids]
    return result


def test_disaggregated_output_equals_offline(ckpt, cluster):
    # Prompt ends on / inside C4 groups (4) and HCA groups (16), spanning several C128 pages.
    prompts = random_prompts(5, [64, 66, 96, 100, 131], seed=41)
    params = SamplingParams(max_tokens=24, **GREEDY)
    offline = make_llm(ckpt, page_size=16, max_model_len=256).generate(prompt_token_ids=prompts,
                                                                       sampling_params=params)
    for prompt, ref in zip(prompts, offline):
        out = dispatch(*cluster, prompt, params)
        assert "decode_error" not in out, out.get("decode_error")
        assert out["tokens"] == ref.token_ids
        assert out["chunks"][-1].finished and out["chunks"][-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert out["prefill"].stats.bytes > 0 and not out["prefill"].HasField("error")
    assert_idle(*cluster, within_s=2.0)


def test_seeded_disaggregated_output_equals_offline(ckpt, cluster):
    """Seeded sampling over gRPC and Mooncake: token 1 from the prefill process, the rest from the decode process's
    DSpark verify steps, all drawn from (seed, position, purpose): the tokens of an offline DSpark engine."""
    prompts = random_prompts(3, [64, 100, 131], seed=44)
    params = [SamplingParams(max_tokens=24, temperature=0.9, top_k=40, seed=700 + i, ignore_eos=True)
              for i in range(3)]
    offline = make_llm(ckpt, page_size=16, max_model_len=256, speculative="dspark").generate(
        prompt_token_ids=prompts, sampling_params=params)
    for prompt, p, ref in zip(prompts, params, offline):
        out = dispatch(*cluster, prompt, p)
        assert "decode_error" not in out, out.get("decode_error")
        assert out["tokens"] == ref.token_ids
    assert_idle(*cluster, within_s=2.0)


def test_shared_prefix_hits_the_prefill_cache(ckpt, cluster):
    (system,) = random_prompts(1, [80], seed=42)
    a, b = [system + s for s in random_prompts(2, [9, 21], seed=43)]
    params = SamplingParams(max_tokens=16, **GREEDY)
    offline = make_llm(ckpt, page_size=16, max_model_len=256).generate(prompt_token_ids=[a, b],
                                                                       sampling_params=params)
    first, second = dispatch(*cluster, a, params), dispatch(*cluster, b, params)
    assert second["prefill"].num_cached_tokens >= 64
    assert second["chunks"][0].num_cached_tokens == second["prefill"].num_cached_tokens
    assert [first["tokens"], second["tokens"]] == [o.token_ids for o in offline]


def test_incompatible_workers_refuse_with_a_clear_error(workers):
    prefill, _, other = workers
    try:
        t0 = time.monotonic()
        out = dispatch(prefill, other, random_prompts(1, [40])[0], SamplingParams(max_tokens=4, **GREEDY),
                       deadline_s=scaled(20))
        assert out["decode_error"].code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "page_size" in out["decode_error"].details()
        assert out["prefill"].error.code == 2 and "page_size" in out["prefill"].error.message  # INCOMPATIBLE
        assert time.monotonic() - t0 < scaled(20)
        assert_idle(prefill, other, within_s=2.0)
    finally:
        other.stop()


def test_decode_gives_up_when_prefill_never_answers(cluster):
    t0 = time.monotonic()
    out = dispatch(*cluster, random_prompts(1, [40])[0], SamplingParams(max_tokens=4, **GREEDY), deadline_s=2.0,
                   send_prefill=False)
    assert out["decode_error"].code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - t0 < scaled(5.0)
    assert_idle(*cluster, within_s=2.0)


def test_prefill_drops_a_request_whose_plan_never_arrives(cluster):
    t0 = time.monotonic()
    out = dispatch(*cluster, random_prompts(1, [40])[0], SamplingParams(max_tokens=4, **GREEDY), deadline_s=2.0,
                   send_decode=False)
    assert out["prefill"].error.code == 3 and "plan" in out["prefill"].error.message  # DEADLINE
    assert time.monotonic() - t0 < scaled(5.0)
    assert_idle(*cluster, within_s=2.0)


def test_workers_serve_health_and_metrics(cluster):
    import urllib.request

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    for w in cluster:
        health = health_pb2_grpc.HealthStub(grpc.insecure_channel(w.address))
        status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=scaled(5)).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        text = urllib.request.urlopen(f"http://127.0.0.1:{w.info['metrics_port']}/metrics",
                                      timeout=scaled(5)).read().decode()
        for name in ("pdspark_pool_used_pages", "pdspark_engine_running_requests", "pdspark_worker_transfers_in_flight",
                     "pdspark_engine_step_seconds_bucket", "pdspark_worker_requests_total"):
            assert name in text, name
        # Transfers are counted once, by the prefill side (which writes them).
        assert ("pdspark_transfer_bytes_bucket" in text) == (w.role == "prefill")
        assert ":" not in "".join(line.split("{")[0].split(" ")[0] for line in text.splitlines()
                                  if line and not line.startswith("#"))
