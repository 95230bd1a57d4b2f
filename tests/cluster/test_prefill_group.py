"""A prefill worker whose engine is a group of 2 rank processes (`--ep-size 2`, each holding half of the routed
experts) beside a one-process prefill worker, both serving one decode worker over Mooncake: the same tokens as
offline, and the same transfer bytes (only rank 0 writes, and every rank holds the same cache)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from test_pd_cluster import ARGS, C128, dispatch
from test_supervision import ENGINE, ENV, current, events, health

from conftest import random_prompts
from helpers import GREEDY, make_llm, two_free_ports
from pdspark import LLM, SamplingParams
from pdspark.launch.service_process import start_service
from pdspark.serving.engine_loop import GROUP_FAILED_EXIT
from pdspark.testing.services import ready, spawn_worker
from pdspark.testing.time_scale import scaled
from pdspark.testing.waiting import wait_until
from pdspark.testing.worker_load import assert_idle

PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def workers(draft_ckpt):
    group, single, decode = ready(
        spawn_worker("prefill", str(draft_ckpt), *ARGS, *C128, "--ep-size", "2"),
        spawn_worker("prefill", str(draft_ckpt), *ARGS, *C128),
        spawn_worker("decode", str(draft_ckpt), *ARGS, *C128, "--no-prefix-cache"))
    yield group, single, decode
    assert decode.stop() == 0 and single.stop() == 0 and group.stop() == 0  # the group ends cleanly on SIGTERM


def test_a_prefill_group_serves_the_one_process_tokens_and_bytes(draft_ckpt, workers):
    group, single, decode = workers
    prompts = random_prompts(3, [64, 100, 131], seed=51)
    greedy = SamplingParams(max_tokens=16, **GREEDY)
    seeded = [SamplingParams(max_tokens=16, temperature=0.9, top_k=40, seed=900 + i, ignore_eos=True)
              for i in range(3)]
    llm = make_llm(draft_ckpt, page_size=16, max_model_len=256, speculative="dspark")
    offline = llm.generate(prompt_token_ids=prompts, sampling_params=greedy) + \
        llm.generate(prompt_token_ids=prompts, sampling_params=seeded)
    for prompt, params, ref in zip(prompts * 2, [greedy] * 3 + seeded, offline):
        by_group, by_one = dispatch(group, decode, prompt, params), dispatch(single, decode, prompt, params)
        for out in (by_group, by_one):
            assert "decode_error" not in out, out.get("decode_error")
            assert out["tokens"] == ref.token_ids
        assert by_group["prefill"].stats.bytes == by_one["prefill"].stats.bytes > 0
    assert_idle(group, single, decode, within_s=2.0)
    # The group's metrics: its size, and rank 0's slot exchanges (one per MoE layer of each step it ran).
    exchanges = wait_until(lambda: _sample(group, "pdspark_worker_expert_exchanges_total"), 5, "exchanges counted")
    assert _sample(group, "pdspark_worker_group_ranks") == 2 and exchanges % 4 == 0  # 4 MoE layers a forward
    assert _sample(group, "pdspark_worker_expert_exchange_bytes_total") > 0
    assert _sample(single, "pdspark_worker_group_ranks") == 1
    assert _sample(single, "pdspark_worker_expert_exchanges_total") == 0
    # Every rank's figures, served by rank 0 from the group's shared table: in lockstep each rank ran every step and
    # made the same collectives, and both run.
    def ranks() -> dict:
        return {r: {name: _sample(group, f'pdspark_worker_rank_{name}{{rank="{r}"}}') for name in
                    ("step_seconds_count", "collectives_total", "collective_bytes_total", "up")} for r in (0, 1)}

    # (Rank 1 records a step as it ends it, which may be after rank 0 did: wait for the two to agree.)
    rank = wait_until(lambda: (got := ranks())[0] == got[1] and got, 5, "both ranks' figures recorded")
    assert rank[1]["step_seconds_count"] > 0 and rank[1]["up"] == 1, rank


def test_a_killed_rank_takes_its_prefill_group_down_for_a_restart(draft_ckpt):
    """Rank 1 killed while the worker is idle: rank 0 sees it through the process sentinel and exits with the
    group-failure status within 2 s (a restart brings the whole group back; the supervisor tests cover restarts)."""
    (worker,) = ready(spawn_worker("prefill", str(draft_ckpt), *ARGS, *C128, "--ep-size", "2"))
    try:
        (rank1,) = _rank_processes(worker.pid)
        os.kill(rank1, signal.SIGKILL)
        assert _exit_status_within(worker, 2.0) == GROUP_FAILED_EXIT
    finally:
        worker.stop()


def _exit_status_within(worker, bound_s: float) -> int | None:
    """The worker's exit status once it exits, polled for `bound_s` (scaled): the issue's bound for a group to go
    down with a lost rank (None: it did not)."""
    start = time.monotonic()
    while worker.returncode is None and time.monotonic() - start < scaled(bound_s):
        time.sleep(0.01)  # (a poll of the exit status, not a wait for an effect)
    return worker.returncode


def _rank_processes(pid: int) -> list[int]:
    """The spawned rank processes among `pid`'s children (not multiprocessing's resource tracker)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(c) for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]


def test_pdspark_up_runs_a_prefill_group_and_restarts_it_whole():
    """`pdspark up --prefill-ep-size 2`: completions through the router equal offline; a killed rank takes its
    worker down (status 3) and the supervisor restarts the whole group on the same port, serving the same tokens."""
    cluster = start_service("pdspark up", ["up", *ENGINE, "--prefill-ep-size", "2", "--restart-backoff-s", "0.1"],
                            timeout=scaled(240), env=ENV)
    try:
        info = cluster.info
        with LLM("dsv4-tiny", max_model_len=512, max_num_seqs=4) as llm:
            offline = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].text
            seeded = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.9, top_k=40, seed=904,
                                                           ignore_eos=True))[0].text
        assert complete(info) == offline
        assert complete(info, temperature=0.9, top_k=40, seed=904) == seeded
        # The router lists each worker's rank processes (from its load reports): the group's two, decode's one.
        wait_until(lambda: {w["role"]: w["ranks"] for w in _workers(info)} == {
            "prefill": ["running", "running"], "decode": ["running"]}, 10, "ranks in /workers",
            lambda: str(_workers(info)))
        worker = current(cluster, "prefill-0")
        (rank1,) = _rank_processes(worker["pid"])
        os.kill(rank1, signal.SIGKILL)
        wait_until(lambda: events(cluster, "restarted", "prefill-0"), 60, "the prefill group restarted")
        (exited,) = events(cluster, "exited", "prefill-0")
        assert exited["returncode"] == GROUP_FAILED_EXIT, exited
        wait_until(lambda: all(health(info).values()), 60, "every worker healthy again")
        assert complete(info) == offline
    finally:
        cluster.stop()


def complete(info: dict, **sampling) -> str:
    """`PROMPT`'s 8-token completion through the router (greedy unless `sampling` says otherwise)."""
    body = json.dumps({"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                       **sampling}).encode()
    req = urllib.request.Request(info["http"] + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=scaled(60)) as r:
        return json.loads(r.read())["choices"][0]["text"]


def _workers(info: dict) -> list[dict]:
    with urllib.request.urlopen(info["http"] + "/workers", timeout=scaled(10)) as r:
        return json.loads(r.read())


def _sample(worker, name: str) -> float:
    """A worker's metric sample without labels, from its metrics port."""
    url = f"http://127.0.0.1:{worker.info['metrics_port']}/metrics"
    with urllib.request.urlopen(url, timeout=scaled(10)) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"{name} not exported by {url}")


def test_a_prefill_group_across_two_machines_serves_and_fails_as_a_unit(draft_ckpt, tmp_path):
    """`--nnodes 2`, the machines played by two processes on loopback: machine 0's worker is rank 0 (gRPC,
    transfers), machine 1's `pdspark serve prefill --node-rank 1` runs rank 1 (no port). The group serves the
    offline tokens through P/D; machine 1's rank killed, the worker sees its control connection close and exits
    with the group-failure status within 2 s."""
    secret = tmp_path / "secret"
    secret.write_text("the-group-secret")
    port = two_free_ports()
    group = [*ARGS, *C128, "--ep-size", "2", "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{port}",
             "--dist-secret-file", str(secret)]
    machine1 = subprocess.Popen([sys.executable, "-m", "pdspark.cli", "serve", "prefill", "--model", str(draft_ckpt),
                                 *group, "--node-rank", "1"], stderr=subprocess.PIPE, text=True)
    try:
        leader, decode = ready(spawn_worker("prefill", str(draft_ckpt), *group),
                               spawn_worker("decode", str(draft_ckpt), *ARGS, *C128, "--no-prefix-cache"))
        try:
            prompt = random_prompts(1, [77], seed=52)[0]
            greedy = SamplingParams(max_tokens=12, **GREEDY)
            with make_llm(draft_ckpt, page_size=16, max_model_len=256, speculative="dspark") as llm:
                want = llm.generate(prompt_token_ids=[prompt], sampling_params=greedy)[0].token_ids
            out = dispatch(leader, decode, prompt, greedy)
            assert "decode_error" not in out, out.get("decode_error")
            assert out["tokens"] == want
            (rank1,) = _rank_processes(machine1.pid)
            os.kill(rank1, signal.SIGKILL)
            assert _exit_status_within(leader, 2.0) == GROUP_FAILED_EXIT
            assert machine1.wait(timeout=scaled(30)) != 0  # its rank failed: the machine's process says so
        finally:
            decode.stop()
            leader.stop()
    finally:
        if machine1.poll() is None:
            machine1.kill()
            machine1.wait()
