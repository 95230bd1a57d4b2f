"""A decode worker whose engine is a DP-attention group of 2 rank processes (`--ep-size 2 --dp-attention`): each rank
owns whole requests, receives their caches through its own Mooncake session into its own pools, and the MoE layers
exchange tokens between the ranks. Beside it a one-process decode worker, both fed by one one-process prefill worker
(P/D ep 1 -> ep 2 and ep 1 -> ep 1): the same tokens as offline, the same transfer bytes, one writer per request."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import uuid

import grpc
import pytest
from test_dsv4_tiny import streams_through
from test_pd_cluster import ARGS, C128, dispatch, stubs
from test_prefill_group import PROMPT, _exit_status_within, _rank_processes, _sample, _workers, complete
from test_supervision import ENGINE, ENV, current, events, health

from conftest import random_prompts
from helpers import GREEDY, make_llm, two_free_ports
from pdspark import LLM, SamplingParams
from pdspark.launch.service_process import start_service
from pdspark.rpc import convert
from pdspark.serving.engine_loop import GROUP_FAILED_EXIT
from pdspark.testing.services import ready, spawn_worker
from pdspark.testing.time_scale import scaled
from pdspark.testing.waiting import wait_until
from pdspark.testing.worker_load import assert_idle
from pdspark.v1 import worker_pb2

GROUP = ["--ep-size", "2", "--dp-attention"]
PING_EVERY_S = 1.0  # an idle group's liveness ping (`worker_server._PING_EVERY_S`)


@pytest.fixture(scope="module")
def workers(draft_ckpt):
    prefill, group, single = ready(
        spawn_worker("prefill", str(draft_ckpt), *ARGS, *C128),
        spawn_worker("decode", str(draft_ckpt), *ARGS, *C128, "--no-prefix-cache", *GROUP),
        spawn_worker("decode", str(draft_ckpt), *ARGS, *C128, "--no-prefix-cache"))
    yield prefill, group, single
    assert single.stop() == 0 and group.stop() == 0 and prefill.stop() == 0  # the group ends cleanly on SIGTERM


def test_a_decode_group_serves_the_one_process_tokens_and_bytes(draft_ckpt, workers):
    """4 requests at once (greedy and seeded, DSpark on): their plans all go out before any prefill starts, so the
    group places them on ranks 0, 1, 0, 1 (the least-loaded rank). Each equals offline, its transfer is as large as
    into the one-process worker, and the prefill stats name the rank written into."""
    prefill, group, single = workers
    prompts = random_prompts(4, [64, 100, 131, 77], seed=61)
    params = [SamplingParams(max_tokens=16, **GREEDY), SamplingParams(max_tokens=16, **GREEDY),
              SamplingParams(max_tokens=16, temperature=0.9, top_k=40, seed=901, ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=0.9, top_k=40, seed=902, ignore_eos=True)]
    with make_llm(draft_ckpt, page_size=16, max_model_len=256, speculative="dspark") as llm:
        want = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    by_group = _plans_first(prefill, group, prompts, params)
    for out, ref in zip(by_group, want):
        assert "decode_error" not in out, out.get("decode_error")
        assert out["tokens"] == ref
    assert [out["prefill"].stats.destination_rank for out in by_group] == [0, 1, 0, 1]
    assert {out["prefill"].stats.source_rank for out in by_group} == {0}
    for prompt, p, out in zip(prompts, params, by_group):
        by_one = dispatch(prefill, single, prompt, p)
        assert by_one["tokens"] == out["tokens"]
        assert by_one["prefill"].stats.bytes == out["prefill"].stats.bytes > 0
        assert by_one["prefill"].stats.destination_rank == 0
    assert_idle(prefill, group, single, within_s=2.0)  # every rank's pages back (the load adds up the ranks')
    # The group's engine counters add up its ranks': the tokens both workers sampled for the same requests.
    generated = "pdspark_engine_generated_tokens_total"
    wait_until(lambda: _sample(group, generated) == _sample(single, generated) > 0, 5, "the same tokens counted",
               lambda: f"{_sample(group, generated)} != {_sample(single, generated)}")


def _plans_first(prefill, decode, prompts, params) -> list[dict]:
    """The router's dual dispatch for every request at once, but each request's Generate first: once the decode
    worker has sent every plan (its transfers in flight), the Prefill calls go."""
    p_stub, d_stub = stubs(prefill, decode)
    timeout_ms = int(scaled(60.0) * 1000)
    results: list[dict] = [{"chunks": []} for _ in prompts]
    ids = [(uuid.uuid4().hex, uuid.uuid4().hex) for _ in prompts]

    def generate(i: int) -> None:
        tid, rid = ids[i]
        req = worker_pb2.GenerateRequest(request_id=rid, transfer_id=tid, prompt_token_ids=prompts[i],
                                         sampling=convert.sampling_to_pb(params[i]), prefill_address=prefill.address,
                                         timeout_ms=timeout_ms)
        try:
            for chunk in d_stub.Generate(req, timeout=scaled(90)):
                results[i]["chunks"].append(chunk)
        except grpc.RpcError as e:
            results[i]["decode_error"] = e

    def prefill_one(i: int) -> None:
        tid, rid = ids[i]
        req = worker_pb2.PrefillRequest(request_id=rid, transfer_id=tid, prompt_token_ids=prompts[i],
                                        sampling=convert.sampling_to_pb(params[i]), timeout_ms=timeout_ms)
        results[i]["prefill"] = p_stub.Prefill(req, timeout=scaled(90)).result

    def plans_out() -> int:
        return d_stub.GetLoad(worker_pb2.LoadRequest(), timeout=scaled(10)).transfers_in_flight

    decoding = []
    for i in range(len(prompts)):  # one at a time: each plan is placed before the next request arrives
        decoding.append(threading.Thread(target=generate, args=(i,)))
        decoding[-1].start()
        wait_until(lambda n=i + 1: plans_out() == n, 30, f"plan {i} out")
    prefilling = [threading.Thread(target=prefill_one, args=(i,)) for i in range(len(prompts))]
    for t in prefilling:
        t.start()
    for t in prefilling + decoding:
        t.join(scaled(120))
        assert not t.is_alive(), "a request did not end"
    for r in results:
        r["tokens"] = [t for c in r["chunks"] for t in c.token_ids]
    return results


def test_a_killed_or_stopped_rank_takes_its_decode_group_down(draft_ckpt):
    """Rank 1 of an idle decode group SIGKILLed: rank 0 exits with the group-failure status within 2 s. Rank 1 of a
    decoding group SIGSTOPped: the next step's exchange fails at the collective timeout, and rank 0 exits within
    that + 1 s, killing the stopped rank on its way (it would never see its pipe close). Rank 1 of an idle group
    SIGSTOPped: the idle liveness ping fails it as well."""
    timeout_s = 3.0
    worker, prefill = ready(
        spawn_worker("decode", str(draft_ckpt), *ARGS, *C128, "--no-prefix-cache", *GROUP),
        spawn_worker("prefill", str(draft_ckpt), *ARGS, *C128))
    try:
        (rank1,) = _rank_processes(worker.pid)
        os.kill(rank1, signal.SIGKILL)
        assert _exit_status_within(worker, 2.0) == GROUP_FAILED_EXIT
        (worker,) = ready(spawn_worker("decode", str(draft_ckpt), *ARGS, *C128, "--no-prefix-cache", *GROUP,
                                       "--dist-timeout-s", str(timeout_s)))
        (rank1,) = _rank_processes(worker.pid)
        stream = threading.Thread(target=dispatch, args=(prefill, worker, random_prompts(1, [40], seed=62)[0],
                                                         SamplingParams(max_tokens=200, **GREEDY)))
        stream.start()
        wait_until(lambda: worker_load(worker).running == 1, 30, "the request decoding")
        os.kill(rank1, signal.SIGSTOP)
        assert _exit_status_within(worker, timeout_s + 1.0) == GROUP_FAILED_EXIT
        wait_until(lambda: not os.path.exists(f"/proc/{rank1}") or _zombie(rank1), 10, "the stopped rank killed")
        stream.join(scaled(60))
        # Stopped while idle: the worker's liveness ping (every second while idle) notices it within the timeout +
        # 1 s of the ping that finds it.
        (worker,) = ready(spawn_worker("decode", str(draft_ckpt), *ARGS, *C128, "--no-prefix-cache", *GROUP,
                                       "--dist-timeout-s", str(timeout_s)))
        (rank1,) = _rank_processes(worker.pid)
        os.kill(rank1, signal.SIGSTOP)
        assert _exit_status_within(worker, PING_EVERY_S + timeout_s + 1.0) == GROUP_FAILED_EXIT
    finally:
        worker.stop()
        prefill.stop()


def worker_load(worker):
    _, d_stub = stubs(worker, worker)
    return d_stub.GetLoad(worker_pb2.LoadRequest(), timeout=scaled(10))


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


@pytest.mark.kills
def test_pdspark_up_runs_a_decode_group_and_its_streams_migrate_when_a_rank_dies():
    """`pdspark up --decode-ep-size 2`: completions through the router equal offline; rank 1 of the decode group is
    SIGKILLed while 3 streams run: the group exits (status 3), the supervisor restarts it whole, the router migrates
    the streams to it, and each completes equal to offline."""
    cluster = start_service("pdspark up", ["up", *ENGINE, "--decode-ep-size", "2", "--restart-backoff-s", "0.1"],
                            timeout=scaled(240), env=ENV)
    try:
        info = cluster.info
        texts = ["def fibonacci(n):\n", "import os\nimport sys\n", "class Stack:\n"]
        params = SamplingParams(temperature=0, max_tokens=MIGRATED_TOKENS, ignore_eos=True)
        with LLM("dsv4-tiny", max_model_len=512, max_num_seqs=4) as llm:
            offline = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].text
            want = [o.token_ids for o in llm.generate(texts, params)]
            seeded = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.9, top_k=40, seed=903,
                                                           ignore_eos=True))[0].text
        assert complete(info) == offline
        assert complete(info, temperature=0.9, top_k=40, seed=903) == seeded
        wait_until(lambda: {w["role"]: w["ranks"] for w in _workers(info)} == {
            "prefill": ["running"], "decode": ["running", "running"]}, 10, "ranks in /workers",
            lambda: str(_workers(info)))
        rank1 = _rank_processes(current(cluster, "decode-1")["pid"])[0]
        assert streams_through(info, texts, MIGRATED_TOKENS, lambda: os.kill(rank1, signal.SIGKILL)) == want
        (exited,) = events(cluster, "exited", "decode-1")
        assert exited["returncode"] == GROUP_FAILED_EXIT, exited
        wait_until(lambda: all(health(info).values()), 60, "every worker healthy again")
        assert complete(info) == offline
    finally:
        cluster.stop()


MIGRATED_TOKENS = 256


def test_a_decode_group_across_two_machines_receives_on_each_machines_ranks(draft_ckpt, tmp_path):
    """`--nnodes 2`, the machines played by two processes on loopback: machine 1's `pdspark serve decode --node-rank
    1` runs rank 1 with its own transfer engine (advertised at its own address) and side channel; requests placed on
    rank 1 arrive there and equal offline. Machine 1's rank killed: the worker exits with the group-failure status
    within 2 s."""
    secret = tmp_path / "secret"
    secret.write_text("the-decode-group-secret")
    port = two_free_ports()
    group = [*ARGS, *C128, "--no-prefix-cache", *GROUP, "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{port}",
             "--dist-secret-file", str(secret)]
    machine1 = subprocess.Popen([sys.executable, "-m", "pdspark.cli", "serve", "decode", "--model", str(draft_ckpt),
                                 *group, "--node-rank", "1"], stderr=subprocess.PIPE, text=True)
    try:
        leader, prefill = ready(spawn_worker("decode", str(draft_ckpt), *group),
                                spawn_worker("prefill", str(draft_ckpt), *ARGS, *C128))
        try:
            prompts = random_prompts(2, [77, 40], seed=63)
            params = [SamplingParams(max_tokens=12, **GREEDY)] * 2
            with make_llm(draft_ckpt, page_size=16, max_model_len=256, speculative="dspark") as llm:
                want = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
            outs = _plans_first(prefill, leader, prompts, params)
            assert [out.get("decode_error") for out in outs] == [None, None]
            assert [out["tokens"] for out in outs] == want
            assert [out["prefill"].stats.destination_rank for out in outs] == [0, 1]
            (rank1,) = _rank_processes(machine1.pid)
            os.kill(rank1, signal.SIGKILL)
            assert _exit_status_within(leader, 2.0) == GROUP_FAILED_EXIT
            assert machine1.wait(timeout=scaled(30)) != 0  # its rank failed: the machine's process says so
        finally:
            prefill.stop()
            leader.stop()
    finally:
        if machine1.poll() is None:
            machine1.kill()
            machine1.wait()
