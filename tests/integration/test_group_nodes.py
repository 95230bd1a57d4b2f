"""A worker group across machines (`--nnodes 2`), the two machines played by two processes on loopback: machine 1
runs `pdspark generate --node-rank 1` (its rank only), machine 0 the offline `LLM` as rank 0. The ranks of machine 1
take rank 0's configuration over the authenticated control channel, so the group gives one process's tokens; a
machine without the secret is refused."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import random_prompts
from helpers import two_free_ports
from pdspark import LLM, SamplingParams
from pdspark.assets import resolve_model
from pdspark.errors import ConfigError, WorkerGroupError
from pdspark.testing.time_scale import scaled
from pdspark.testing.waiting import wait_until

MODEL = str(resolve_model("dsv4-tiny"))
OPTS = dict(page_size=16, max_model_len=256)


def _machine_1(port: int, secret_file, *extra: str) -> subprocess.Popen:
    """Machine 1: its rank of a 2-rank group, with its own flags (no seed: it must take rank 0's)."""
    return subprocess.Popen(
        [sys.executable, "-m", "pdspark.cli", "generate", "--model", MODEL, "--ep-size", "2", "--nnodes", "2",
         "--node-rank", "1", "--dist-init-addr", f"127.0.0.1:{port}", "--dist-secret-file", str(secret_file),
         "--dist-timeout-s", "20", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("dp_attention", [False, True], ids=["lockstep", "dp-attention"])
def test_a_group_across_two_machines_gives_one_process_tokens(tmp_path, dp_attention):
    secret = tmp_path / "secret"
    secret.write_text("s3cret-of-this-group\n")
    port = two_free_ports()
    prompts = random_prompts(3, [9, 30, 64], seed=4, vocab=4096)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    unseeded = SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True)  # (the engine seed's streams)
    with LLM(MODEL, seed=1234, **OPTS) as one:
        want = [[o.token_ids for o in one.generate(prompt_token_ids=prompts, sampling_params=p)]
                for p in (greedy, unseeded)]
    node1 = _machine_1(port, secret, *(["--dp-attention"] if dp_attention else []))
    try:
        with LLM(MODEL, seed=1234, ep_size=2, nnodes=2, node_rank=0, dist_init_addr=f"127.0.0.1:{port}",
                 dist_secret_file=str(secret), dist_timeout_s=20, dp_attention=dp_attention, **OPTS) as llm:
            got = [[o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=p)]
                   for p in (greedy, unseeded)]
            assert llm.engine.rank_states() == ["running", "running"]
            # Machine 1's rank sends its figures after each step (the last one may still be on its way).
            stats = llm.engine.rank_stats
            wait_until(lambda: stats.figures(1).steps == stats.figures(0).steps, 10, "machine 1's figures",
                       lambda: f"{stats.figures(1)} vs {stats.figures(0)}")
            assert stats.figures(1).collective_calls == stats.figures(0).collective_calls > 0
        assert got == want
        # Machine 1's rank ends with the group (its control channel closes).
        assert node1.wait(timeout=scaled(30)) == 0, node1.stderr.read() if node1.stderr else ""
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()


def test_a_machine_without_the_secret_is_refused(tmp_path):
    """Machine 1 given another secret: its control connection fails authentication (it exits non-zero, naming
    it), and rank 0 gives up after the group's timeout naming the rank that did not connect."""
    (tmp_path / "ours").write_text("ours")
    (tmp_path / "theirs").write_text("theirs")
    port = two_free_ports()
    timeout_s = 6.0  # the group's timeout: how long rank 0 waits for the other machine's ranks (the behaviour)
    node1 = _machine_1(port, tmp_path / "theirs")
    try:
        with pytest.raises(WorkerGroupError, match=r"ranks \[1\] of the group did not connect"):
            LLM(MODEL, ep_size=2, nnodes=2, node_rank=0, dist_init_addr=f"127.0.0.1:{port}",
                dist_secret_file=str(tmp_path / "ours"), dist_timeout_s=timeout_s, **OPTS)
        assert node1.wait(timeout=scaled(30)) != 0
        assert "AuthenticationError" in (node1.stderr.read() if node1.stderr else "")
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()


def test_a_group_across_machines_is_refused_without_what_it_needs(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("x")
    base = dict(ep_size=2, nnodes=2, dist_init_addr="127.0.0.1:29500", dist_secret_file=str(secret))
    for changed, message in (
            ({"nnodes": 3}, r"`nnodes` is 3; allowed: a divisor of `ep_size` \(2\)"),
            ({"dist_init_addr": None}, "`dist_init_addr` is required with `nnodes` > 1"),
            ({"dist_secret_file": None}, "`dist_secret_file` is required with `nnodes` > 1"),
            ({"dist_secret_file": str(tmp_path / "absent")}, "`dist_secret_file` .* cannot be read"),
            ({"node_rank": 1}, "`node_rank` is 1: this machine runs only its ranks"),
            ({"node_rank": 2}, r"`node_rank` is 2; allowed: 0..1")):
        with pytest.raises(ConfigError, match=message):
            LLM(MODEL, **{**base, **changed}, **OPTS)
