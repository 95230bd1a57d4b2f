"""DP-attention: two rank processes over gloo on loopback, each owning whole requests and half of the routed experts,
exchanging token rows at every MoE layer. A rank's requests get the bits of one process running that rank's batch
(the same forms: the module path), and the tokens of one process running everything."""

from __future__ import annotations

import os
import signal
import time

import pytest

from conftest import random_prompts
from helpers import make_llm
from pdspark import LLM, SamplingParams
from pdspark.assets import resolve_model
from pdspark.engine.data_parallel import DataParallelEngine
from pdspark.errors import ConfigError, WorkerGroupError
from pdspark.parallel.token_exchange import TokenExchange

MODEL = str(resolve_model("dsv4-tiny"))
GREEDY = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, logprobs=2)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=64, ignore_eos=True, logprobs=2)


def _results(outs) -> list:
    return [(o.token_ids, [(x.logprob, x.top) for x in o.logprobs]) for o in outs]


def _on_the_module_path(llm: LLM) -> LLM:
    """A one-process engine computing as a DP rank does: every forward through the module path (a DP rank's C
    decode step is off: it does not exchange token rows yet)."""
    model = llm.engine.runner.model
    model._decode_step, model.decode_step_off = None, "off: the forms of a DP-attention rank"
    for layer in model.layers:
        layer.ffn.c_decode = None
    return llm


def test_each_rank_gives_one_process_bits_for_its_batch_and_the_tokens_of_one_process():
    """8 prompts x 64 tokens with DSpark, greedy and seeded: placed 4 + 4 (the least-loaded rank, lowest first);
    each rank's tokens and logprobs equal, bit for bit, one process running that rank's four prompts in the same
    forms, and the tokens equal one process running all eight (its C decode step included)."""
    prompts = random_prompts(8, [5, 17, 40, 64, 9, 23, 33, 70], seed=11, vocab=4096)
    with make_llm(MODEL, speculative="dspark", ep_size=2, dp_attention=True) as llm:
        assert isinstance(llm.engine, DataParallelEngine)
        dp = {}
        for name, params in (("greedy", GREEDY), ("seeded", SEEDED)):
            ids = [llm.engine.add_request(p, params) for p in prompts]
            assert [llm.engine.owner[i] for i in ids] == [0, 1] * 4
            while llm.engine.has_unfinished:
                llm.engine.step()
            dp[name] = _results(llm.engine.final_output(i) for i in ids)
            for i in ids:
                llm.engine.release(i)
        exchange = llm.engine.engine.runner.model.expert_exchange
        assert isinstance(exchange, TokenExchange) and exchange.forwards > 0
    with make_llm(MODEL, speculative="dspark") as one:
        assert one.engine.runner.model.decode_step_off is None
        for name, params in (("greedy", GREEDY), ("seeded", SEEDED)):
            whole = _results(one.generate(prompt_token_ids=prompts, sampling_params=params))
            assert [t for t, _ in dp[name]] == [t for t, _ in whole], name
    with make_llm(MODEL, speculative="dspark") as one:
        _on_the_module_path(one)
        for name, params in (("greedy", GREEDY), ("seeded", SEEDED)):
            for rank in (0, 1):
                alone = _results(one.generate(prompt_token_ids=prompts[rank::2], sampling_params=params))
                assert dp[name][rank::2] == alone, (name, rank)


def test_uneven_load_idle_ranks_and_a_prefill_beside_decodes():
    """Four requests spread 2 + 2; rank 1's finish early, so rank 1 idles (joining rank 0's forwards with no
    tokens) for many steps; then a new request is placed on rank 1 and prefills while rank 0 decodes; rank 0 then
    finishes first and idles in turn. Every request's bits equal one process replaying its rank's calls."""
    prompts = random_prompts(5, [30, 12, 7, 20, 70], seed=21, vocab=4096)
    budgets = [24, 4, 4, 3, 32]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=2) for n in budgets]
    late = 12  # the step before which the fifth request arrives
    with make_llm(MODEL, ep_size=2, dp_attention=True) as llm:
        eng = llm.engine
        ids = [eng.add_request(p, sp) for p, sp in zip(prompts[:4], params[:4])]
        steps = 0
        while steps < late:
            eng.step()
            steps += 1
        assert eng.rank_loads == [1, 0]  # rank 1 idle, rank 0 decoding
        ids.append(eng.add_request(prompts[4], params[4]))
        assert [eng.owner[i] for i in ids] == [0, 1, 0, 1, 1]
        exchange = eng.engine.runner.model.expert_exchange
        idle_before = exchange.idle_forwards
        while eng.has_unfinished:
            eng.step()
        assert exchange.idle_forwards > idle_before  # rank 0 joined rank 1's last forwards with no tokens
        dp = _results(eng.final_output(i) for i in ids)
    # One process per rank, replaying that rank's calls: rank 0 gets requests 0 and 2; rank 1 gets 1 and 3, then 4
    # before step `late`.
    with make_llm(MODEL) as one:
        _on_the_module_path(one)
        engine = one.engine
        for rank, first, later in ((0, [0, 2], []), (1, [1, 3], [4])):
            got = {i: engine.add_request(prompts[i], params[i]) for i in first}
            for _ in range(late):
                engine.step()
            got |= {i: engine.add_request(prompts[i], params[i]) for i in later}
            while engine.has_unfinished:
                engine.step()
            for i, rid in got.items():
                assert _results([engine.final_output(rid)]) == [dp[i]], (rank, i)
                engine.release(rid)


def test_a_killed_rank_fails_the_group_at_its_next_step():
    """A DP-attention group fails as a unit too: `generate` raises `WorkerGroupError` naming the rank, at once (its
    pipe and sockets close), later calls refuse, and the requests are no longer counted as unfinished."""
    timeout_s = 2.0  # the group's collective timeout
    llm = LLM(MODEL, ep_size=2, dp_attention=True, dist_timeout_s=timeout_s, page_size=16, max_model_len=256)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        assert len(llm.generate(prompt_token_ids=[[5, 6, 7], [8, 9]], sampling_params=params)) == 2
        (pid,) = llm.engine.rank_pids
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerGroupError, match="the worker group failed"):
            llm.generate(prompt_token_ids=[[5, 6, 7], [8, 9]], sampling_params=params)
        took = time.monotonic() - start
        assert took <= timeout_s + 1.0, took  # the bound for a lost rank (the behaviour under test)
        with pytest.raises(WorkerGroupError, match="has failed"):
            llm.generate(prompt_token_ids=[[8, 9]], sampling_params=params)
        assert not llm.engine.has_unfinished
    finally:
        llm.close()


def test_workers_refuse_the_group_modes_they_do_not_serve_before_any_rank_starts():
    from pdspark.config import WorkerConfig
    from pdspark.options import build
    from pdspark.serving.worker_server import WorkerServer

    for role, options, message in (
            ("prefill", {"dp_attention": True}, "`dp_attention` for a prefill worker; allowed: off"),
            ("decode", {}, "without `dp_attention`; allowed: `dp_attention` on"),
            ("decode", {"dp_attention": True, "transfer_backend": "inprocess"},
             "`transfer_backend` 'inprocess' for a decode group; allowed: 'mooncake'")):
        cfg = build(WorkerConfig, {"model": MODEL, "ep_size": 2, **options}, fixed={"role": role})
        with pytest.raises(ConfigError, match=message):
            WorkerServer(cfg)


def test_transfer_reservations_go_to_the_least_loaded_rank_and_the_group_adds_up_its_ranks():
    """The decode worker's calls on a group: a reservation lands on the rank with the fewest requests and
    reservations (rank 0 on a tie), in that rank's pools; adopting it runs the request there; the group's pool usage
    and token counts are every rank's added up; cancelled or finished, every page is back."""
    with make_llm(MODEL, ep_size=2, dp_attention=True, page_size=16, max_model_len=256) as llm:
        group = llm.engine
        assert isinstance(group, DataParallelEngine)
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        one_rank = group.engine.pool_usage()["req_slots"].total
        assert group.pool_usage()["req_slots"] == (0, 2 * one_rank)
        first, second, third = (group.reserve_transfer([5, 6, 7, 8], params) for _ in range(3))
        assert [p.rank for p in (first, second, third)] == [0, 1, 0]
        assert group.pool_usage()["req_slots"].used == 3
        assert [ld.usage["req_slots"].used for ld in group.rank_pool_loads()] == [2, 1]
        group.cancel_transfer(third)
        # (The cache would arrive by transfer; the pages' contents do not matter to where the request runs.)
        out = group.adopt("r1", [5, 6, 7, 8], params, second, first_token=9)
        assert group.owner["r1"] == 1 and out.token_ids == [9]
        group.cancel_transfer(first)
        while group.has_unfinished:
            group.step()
        assert len(group.final_output("r1").token_ids) == 4
        assert group.stats.generated_tokens == 3  # rank 1's (the adopted first token is not sampled here)
        group.release("r1")
        assert group.pool_usage()["req_slots"].used == 0
        assert [ld.usage["req_slots"].used for ld in group.rank_pool_loads()] == [0, 0]
