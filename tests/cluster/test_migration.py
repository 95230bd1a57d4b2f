"""Live migration of a decode stream (the equality ladder's last rung): SIGKILL the decode worker serving a stream,
right after its first token or in the middle, and the client's stream goes on on the other decode worker with exactly
the tokens an uninterrupted offline run produces: greedy and seeded, DSpark on, over HTTP SSE (the official `openai`
client) and the gRPC SDK. The launcher restarts the killed worker. Three decode workers: a case needs two healthy
ones (one to kill, one to migrate to) and no request running, so the worker killed by the case before may still be
restarting (each case checks the router does not count a decode worker healthy that does not answer).
"""

from __future__ import annotations

import json
import os
import signal
import urllib.request
from collections.abc import Iterator

import grpc
import openai
import pytest

from helpers import make_llm
from pdspark import SamplingParams
from pdspark.client import Client
from pdspark.launch.service_process import ServiceProcess, start_service
from pdspark.testing.waiting import wait_until
from pdspark.v1 import worker_pb2, worker_pb2_grpc

ENGINE = ["--page-size", "16", "--max-model-len", "256", "--max-num-seqs", "8"]
# A killed decode worker is back quickly (same port); the others serve meanwhile.
DECODE_WORKERS = 3
SUPERVISION = ["--restart-backoff-s", "0.5", "--max-restart-backoff-s", "1"]
PROMPT = "def fibonacci(n):"
MAX_TOKENS = 96
GREEDY = dict(temperature=0.0)
SEEDED = dict(temperature=0.9, top_p=0.95, seed=1234)
SAMPLINGS = {"greedy": GREEDY, "seeded": SEEDED}

@pytest.fixture(scope="module")
def cluster(draft_ckpt) -> Iterator[ServiceProcess]:
    service = start_service("pdspark up", ["up", "--model", str(draft_ckpt), "--prefill", "1",
                                           "--decode", str(DECODE_WORKERS),
                                           "--port", "0", "--grpc-port", "0", *ENGINE, *SUPERVISION],
                            timeout=240, env={"OMP_NUM_THREADS": "1"})
    try:
        yield service
    finally:
        assert service.stop() == 0


@pytest.fixture(scope="module")
def offline(draft_ckpt) -> dict[str, tuple[list[int], str]]:
    """The uninterrupted references, sampling id -> (token ids, text): one engine, no P/D, DSpark off (DSpark and
    plain give the same tokens). Computed once for the module: every case of a sampling compares with the same."""
    llm = make_llm(draft_ckpt, page_size=16, max_model_len=256)
    outs = {name: llm.generate([PROMPT], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **sampling))[0]
            for name, sampling in SAMPLINGS.items()}
    return {name: (out.token_ids, out.text) for name, out in outs.items()}


def decodes(cluster: ServiceProcess) -> dict[str, dict]:
    """name -> the decode worker's current `{"pid", "address"}` (after any restart)."""
    out = {}
    for name, first in cluster.info["services"].items():
        if name.startswith("decode"):
            restarts = [e for e in cluster.events if e.get("event") == "restarted" and e.get("service") == name]
            out[name] = restarts[-1] if restarts else first
    return out


def running(address: str) -> int | None:
    """The decode worker's running requests; None while it does not answer (killed, not restarted yet)."""
    try:
        with grpc.insecure_channel(address) as channel:
            return worker_pb2_grpc.DecodeWorkerStub(channel).GetLoad(worker_pb2.LoadRequest(), timeout=5).running
    except grpc.RpcError:
        return None


def ready_for_a_case(cluster: ServiceProcess) -> bool:
    """The prefill worker healthy, at least two decode workers healthy in the router's view, and every decode
    worker the router counts healthy answering itself with no request running (its view of a worker killed a moment
    ago may not have caught up yet: the case must neither be routed to it nor migrate to it). A worker still
    restarting is left to come back meanwhile."""
    with urllib.request.urlopen(cluster.info["http"] + "/workers", timeout=10) as r:
        healthy = {w["address"]: w["healthy"] for w in json.loads(r.read())}
    loads = {w["address"]: running(w["address"]) for w in decodes(cluster).values()}
    serving = [address for address in loads if healthy[address]]
    prefill_healthy = all(ok for address, ok in healthy.items() if address not in loads)
    return prefill_healthy and len(serving) >= 2 and all(loads[address] == 0 for address in serving)


def migrations(cluster: ServiceProcess) -> float:
    with urllib.request.urlopen(cluster.info["http"] + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("pdspark_router_migrations_total "):
                return float(line.split()[1])
    raise AssertionError("pdspark_router_migrations_total is not exported")


def kill_serving_decode(cluster: ServiceProcess) -> str:
    """SIGKILL the decode worker that runs the (one) request in flight; its name."""
    serving = wait_until(lambda: [n for n, w in decodes(cluster).items() if running(w["address"])], 10,
                         "a decode worker runs the request")
    (name,) = serving
    os.kill(decodes(cluster)[name]["pid"], signal.SIGKILL)
    return name


def openai_stream(cluster, sampling: dict, kill_after: int) -> tuple[str, str | None]:
    client = openai.OpenAI(base_url=cluster.info["http"] + "/v1", api_key="none", max_retries=0, timeout=120)
    extra = {"ignore_eos": True, **({"seed": sampling["seed"]} if "seed" in sampling else {})}
    kw = {k: v for k, v in sampling.items() if k != "seed"}
    pieces, finish, received = [], None, 0
    for chunk in client.completions.create(model=cluster.info["model"], prompt=PROMPT, max_tokens=MAX_TOKENS,
                                           stream=True, extra_body=extra, **kw):
        if not chunk.choices:
            continue
        pieces.append(chunk.choices[0].text)
        finish = chunk.choices[0].finish_reason or finish
        received += 1
        if received == kill_after:
            kill_serving_decode(cluster)
    return "".join(pieces), finish


def sdk_stream(cluster, sampling: dict, kill_after: int) -> tuple[list[int], str]:
    token_ids, text = [], []
    with Client(cluster.info["grpc"], timeout=120) as client:
        for chunk in client.stream(PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True, **sampling):
            before = len(token_ids)
            token_ids += chunk.token_ids
            text.append(chunk.text)
            if before < kill_after <= len(token_ids):
                kill_serving_decode(cluster)
    return token_ids, "".join(text)


@pytest.mark.parametrize("sampling_id", list(SAMPLINGS))
@pytest.mark.parametrize("kill_after", [1, 24], ids=["after-first-token", "mid-stream"])
@pytest.mark.parametrize("api", ["openai-sse", "grpc-sdk"])
def test_stream_survives_decode_sigkill_and_equals_offline(cluster, offline, api, sampling_id, kill_after):
    sampling = SAMPLINGS[sampling_id]
    wait_until(lambda: ready_for_a_case(cluster), 60, "two decode workers healthy and idle before the case")
    before = migrations(cluster)
    want_ids, want_text = offline[sampling_id]
    if api == "openai-sse":
        text, finish = openai_stream(cluster, sampling, kill_after)
        assert finish == "length"
    else:
        ids, text = sdk_stream(cluster, sampling, kill_after)
        assert ids == want_ids
    assert text == want_text
    assert migrations(cluster) == before + 1
