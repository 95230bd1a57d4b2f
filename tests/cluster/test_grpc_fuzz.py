"""Hypothesis-generated protobuf requests against every RPC of real processes: a prefill and a decode worker on the
shipped model and a router in front of them. Each request is a generated message (every field present or not, its
values over the type's whole range, unknown enum numbers, NaN, repeated fields empty or long, ids that collide
across requests so legs of one transfer meet) or raw bytes. No call may end with a status that means a server bug
(INTERNAL, UNKNOWN, DATA_LOSS), no process may die, bytes that are no message are INVALID_ARGUMENT, and once the
deadlines have passed both workers hold nothing: no request, no transfer, no page but the prefix cache's.

Deterministic (`derandomize`) and bounded: about 30 s on 2 cores, the processes' start included.
"""

from __future__ import annotations

import collections

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdspark.launch.service_process import ServiceProcess, spawn_service, wait_ready
from pdspark.testing.time_scale import scaled
from pdspark.testing.waiting import wait_until
from pdspark.v1 import common_pb2, router_pb2, worker_pb2, worker_pb2_grpc
from proto_strategies import fields, requests

ENGINE = ["--model", "dsv4-tiny", "--max-model-len", "256", "--max-num-seqs", "4", "--port", "0"]
CALL_TIMEOUT_S = 0.3  # a request that waits (for its other leg, for tokens) ends here
EXAMPLES = 30
# What a server bug looks like from outside; every refusal of bad input has a status of its own.
BUG_STATUSES = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DATA_LOSS,
                grpc.StatusCode.UNIMPLEMENTED}
STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}
# Ids drawn from a few values, so that a Prefill and a SubmitPlan (or two of either) meet on one transfer.
IDS = st.one_of(st.sampled_from(["t-1", "t-2", "r-1", ""]), st.text(max_size=12))
# Token ids: a valid prompt half the time, else any int32 (negative, past the vocabulary, none at all).
TOKENS = st.one_of(st.lists(st.integers(2, 300), min_size=1, max_size=40),
                   st.lists(st.integers(-(2**31), 2**31 - 1), max_size=40))
# Sampling options that are valid half the time, so that requests get past the checks into pages and transfers.
SAMPLING = st.one_of(fields(common_pb2.SamplingParams.DESCRIPTOR), st.fixed_dictionaries(
    {"max_tokens": st.integers(1, 8), "temperature": st.sampled_from([0.0, 1.0])},
    optional={"seed": st.integers(0, 2**63 - 1), "logprobs": st.integers(0, 5),
              "stop": st.lists(st.text(max_size=4), max_size=2)}))


@pytest.fixture(scope="module")
def services():
    env = {"OMP_NUM_THREADS": "1"}
    workers = {role: spawn_service(role, ["serve", role, *ENGINE, "--metrics-port", "none"], env)
               for role in ("prefill", "decode")}
    started: list[ServiceProcess] = []
    try:
        for w in workers.values():
            started.append(wait_ready(w, scaled(120)))
        router = wait_ready(spawn_service("router", [
            "serve", "router", "--model", "dsv4-tiny", "--max-model-len", "256", "--port", "0", "--grpc-port", "0",
            "--prefill", workers["prefill"].address, "--decode", workers["decode"].address], env), scaled(60))
        started.append(router)
        yield {"prefill": workers["prefill"].address, "decode": workers["decode"].address,
               "router": router.info["grpc"], "processes": started}
    finally:
        # The router first: a worker stopping waits (its grace) for the router's long-lived `Calls` stream to end.
        for p in (*started[2:], *workers.values()):
            p.stop()


def rpcs(prefill_address: str) -> list[tuple[str, str, type, bool, dict]]:
    """(service, method, request type, streams its answer, field overrides) of every RPC."""
    ids = {"request_id": IDS, "transfer_id": IDS, "prompt_token_ids": TOKENS, "sampling": SAMPLING,
           "generated_token_ids": st.one_of(st.just([]), TOKENS)}
    to_prefill = {**ids, "prefill_address": st.one_of(st.just(prefill_address), st.text(max_size=24))}
    # `Calls` streams: frames whose ids collide (a cancel meets its call, a second call a running one).
    frames = {"call_id": st.one_of(st.sampled_from([0, 1, 2]), st.integers(0, 2**64 - 1)),
              "timeout_ms": st.one_of(st.just(0), st.integers(0, 2**32 - 1))}
    return [
        ("prefill", "/pdspark.v1.PrefillWorker/Prefill", worker_pb2.PrefillRequest, False, ids),
        ("prefill", "/pdspark.v1.PrefillWorker/SubmitPlan", worker_pb2.TransferPlan, False, ids),
        ("prefill", "/pdspark.v1.PrefillWorker/Abort", worker_pb2.AbortRequest, False, ids),
        ("prefill", "/pdspark.v1.PrefillWorker/GetLoad", worker_pb2.LoadRequest, False, {}),
        ("decode", "/pdspark.v1.DecodeWorker/Generate", worker_pb2.GenerateRequest, True, to_prefill),
        ("decode", "/pdspark.v1.DecodeWorker/Abort", worker_pb2.AbortRequest, False, ids),
        ("decode", "/pdspark.v1.DecodeWorker/GetLoad", worker_pb2.LoadRequest, False, {}),
        ("prefill", "/pdspark.v1.PrefillWorker/Calls", worker_pb2.CallFrames, True, {**ids, **frames}),
        ("decode", "/pdspark.v1.DecodeWorker/Calls", worker_pb2.CallFrames, True, {**to_prefill, **frames}),
        ("router", "/pdspark.v1.Router/Generate", router_pb2.RouterGenerateRequest, True,
         {"ids": TOKENS, "sampling": SAMPLING}),
        ("router", "/pdspark.v1.Router/Abort", router_pb2.RouterAbortRequest, False, ids),
    ]


def call(channel: grpc.Channel, method: str, streams: bool, data: bytes) -> grpc.StatusCode:
    """The call's status; on a `Calls` stream, the first bug status a call on it ended with, if any."""
    try:
        if method.endswith("/Calls"):  # one message of frames, then the end of the caller's side
            for reply in channel.stream_stream(method)(iter([data]), timeout=CALL_TIMEOUT_S):
                for frame in worker_pb2.ReplyFrames.FromString(reply).frames:
                    code = STATUS_CODES.get(frame.status_code, grpc.StatusCode.UNKNOWN)
                    if code in BUG_STATUSES:
                        return code
        elif streams:
            for _ in channel.unary_stream(method)(data, timeout=CALL_TIMEOUT_S):
                pass
        else:
            channel.unary_unary(method)(data, timeout=CALL_TIMEOUT_S)
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def test_no_request_crashes_a_service_or_gets_a_server_error(services):
    seen: dict[str, collections.Counter] = {}
    with (grpc.insecure_channel(services["prefill"]) as prefill, grpc.insecure_channel(services["decode"]) as decode,
          grpc.insecure_channel(services["router"]) as router):
        channels = {"prefill": prefill, "decode": decode, "router": router}
        for service, method, request_type, streams, overrides in rpcs(services["prefill"]):
            codes = seen[method] = collections.Counter()

            @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(data=requests(request_type, overrides))
            def fuzz(data: bytes) -> None:
                code = call(channels[service], method, streams, data)  # noqa: B023 (run before the loop moves on)
                codes[code.name] += 1  # noqa: B023
                assert code not in BUG_STATUSES, f"{method}: {code.name} for {data!r}"  # noqa: B023
                dead = [p.name for p in services["processes"] if not p.alive]
                assert not dead, f"{method}: {dead} died on {data!r}"  # noqa: B023

            fuzz()
            # Bytes that are no message of the type are refused as bad input (raw bytes are a quarter of the cases).
            assert codes["INVALID_ARGUMENT"] or request_type is worker_pb2.LoadRequest, (method, codes)
        assert_nothing_held(prefill, decode)
    print({m.rsplit("/", 2)[-2].split(".")[-1] + "/" + m.rsplit("/", 1)[-1]: dict(c) for m, c in seen.items()})


def assert_nothing_held(prefill: grpc.Channel, decode: grpc.Channel, timeout_s: float = 20.0) -> None:
    """Every request ended by its deadline: no request, transfer or waiting stream is left, and every page in use
    is one only the prefix cache holds."""
    stubs = {"prefill": worker_pb2_grpc.PrefillWorkerStub(prefill), "decode": worker_pb2_grpc.DecodeWorkerStub(decode)}
    seen: dict = {}

    def nothing_held() -> bool:
        loads = {name: stub.GetLoad(worker_pb2.LoadRequest(), timeout=scaled(5)) for name, stub in stubs.items()}
        seen.update({name: (r.running, r.waiting, r.queued, r.transfers_in_flight, dict(r.pages_used),
                            dict(r.pages_cached)) for name, r in loads.items()})
        return all(h[:4] == (0, 0, 0, 0) and h[4] == h[5] for h in seen.values())

    wait_until(nothing_held, timeout_s, "nothing held after the fuzz", describe=lambda: f"(still held: {seen})",
               interval_s=0.2)
