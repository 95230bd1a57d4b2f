"""The shipped model: it loads by name from anywhere, matches transformers, keeps every DSV4 mechanism, speculates
losslessly, and goes through the disaggregated cluster unchanged (prompts spanning several 128-token C128 pages,
ending on and inside C4 and C128 groups)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_pd_cluster import dispatch

from pdspark import LLM, SamplingParams
from pdspark.assets import resolve_model
from pdspark.model.model_config import CSA, HCA, SLIDING, ModelConfig
from pdspark.testing.time_scale import scaled
from pdspark.testing.worker_load import WorkerAt

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.7, top_p=0.95, seed=5, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny() -> LLM:
    return LLM("dsv4-tiny", max_model_len=1024, max_num_seqs=8)


@pytest.fixture(scope="module")
def prompts(tiny) -> list[list[int]]:
    import pdspark.engine.scheduler as source

    ids = tiny.tokenizer.encode(Path(source.__file__).read_text())
    # 256 and 384: on C128 (and C4) boundaries; 300: on a C4 boundary inside a C128 group; 301, 517: inside both.
    return [ids[:n] for n in (256, 300, 301, 384, 517)]


def test_loads_by_name_from_any_directory(tmp_path):
    code = "from pdspark import LLM; print(LLM('dsv4-tiny', max_model_len=256).engine.model_config.vocab_size)"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         timeout=scaled(120))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "4096"


def test_config_keeps_every_mechanism():
    cfg = ModelConfig.from_dir(resolve_model("dsv4-tiny"))
    assert {SLIDING, CSA, HCA} <= set(cfg.layer_types)
    assert cfg.csa_ratio == 4 and cfg.hca_ratio == 128 and cfg.hc_mult > 1
    assert any(cfg.hash_layers) and not all(cfg.hash_layers)
    assert cfg.max_position_embeddings >= 2048
    assert "dspark" in cfg.raw


def test_greedy_matches_transformers(tiny, prompts):
    from transformers import DeepseekV4ForCausalLM

    hf = DeepseekV4ForCausalLM.from_pretrained(resolve_model("dsv4-tiny")).eval()
    hf.generation_config.eos_token_id = None
    prompt = prompts[1]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, pad_token_id=2)
    ours = tiny.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
        temperature=0, max_tokens=16, ignore_eos=True))[0].token_ids
    assert ours == ref[0, len(prompt):].tolist()


@pytest.mark.parametrize("params, drafts_per_step", [(GREEDY, 1.0), (SEEDED, 0.75)], ids=["greedy", "seeded"])
def test_speculative_equals_plain_and_accepts_drafts(tiny, prompts, params, drafts_per_step):
    """Seeded too: the trained draft's races against the target's noise agree often enough to keep drafts (measured
    1.07 drafts per verify step with seed 5, 0.88-1.43 over 13 seeds; the inverse-CDF coupling got 0.54)."""
    spec = LLM("dsv4-tiny", speculative="dspark", max_model_len=1024, max_num_seqs=8)
    plain = [o.token_ids for o in tiny.generate(prompt_token_ids=prompts, sampling_params=params)]
    outs = spec.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in outs] == plain
    assert sum(o.spec_accepted_tokens for o in outs) > drafts_per_step * sum(o.spec_verify_steps for o in outs)


def test_disaggregated_cluster_equals_offline(tiny, prompts, dsv4_tiny_cluster):
    """The shared cluster's workers (DSpark on), called as the router calls them."""
    services = dsv4_tiny_cluster.info["services"]
    prefill, decode = (WorkerAt(role, services[name]["address"]) for role, name in (("prefill", "prefill-0"),
                                                                                     ("decode", "decode-1")))
    offline = tiny.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    for prompt, ref in zip(prompts, offline):
        out = dispatch(prefill, decode, prompt, GREEDY, deadline_s=scaled(60))
        assert out["tokens"] == ref.token_ids
        stats = out["prefill"].stats
        assert stats.bytes_by_pool["C128_KV"] > 0 and stats.bytes_by_pool["DRAFT_KV"] > 0


def test_pdspark_up_serves_dsv4_tiny_like_offline(tiny, prompts, dsv4_tiny_cluster):
    import openai

    from pdspark.client import Client

    info = dsv4_tiny_cluster.info
    client = openai.OpenAI(base_url=info["http"] + "/v1", api_key="none", max_retries=0)
    text = "def fibonacci(n):\n"
    ref = tiny.generate([text], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))[0].text
    got = client.completions.create(model="dsv4-tiny", prompt=text, max_tokens=32, temperature=0,
                                    extra_body={"ignore_eos": True}).choices[0].text
    assert got == ref
    streamed = "".join(c.text for c in Client(info["grpc"]).stream(text, max_tokens=32, temperature=0,
                                                                    ignore_eos=True))
    assert streamed == ref
    long = client.completions.create(model="dsv4-tiny", prompt=prompts[4], max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert long.choices[0].text == tiny.generate(prompt_token_ids=[prompts[4]], sampling_params=SamplingParams(
        temperature=0, max_tokens=16, ignore_eos=True))[0].text


def test_n_choices_a_batch_of_prompts_and_the_controls_through_the_cluster_equal_offline(tiny, dsv4_tiny_cluster):
    """`n` seeded choices of a batch of two prompts, with penalties: choice j of prompt i is the offline engine's
    generation with `choice_seed(seed, j)`, at index `i * n + j`; the usage counts each prompt once."""
    import openai

    from pdspark.router.openai.openai_protocol import choice_seed

    client = openai.OpenAI(base_url=dsv4_tiny_cluster.info["http"] + "/v1", api_key="none", max_retries=0)
    texts = ["def fibonacci(n):\n", "class Stack:\n"]
    controls = dict(presence_penalty=0.4, frequency_penalty=0.2)
    got = client.completions.create(model="dsv4-tiny", prompt=texts, n=3, max_tokens=12, temperature=0.8,
                                    seed=11, extra_body={"ignore_eos": True, "repetition_penalty": 1.1}, **controls)
    assert [c.index for c in got.choices] == list(range(6))
    for i, text in enumerate(texts):
        for j in range(3):
            want = tiny.generate([text], SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True,
                                                        seed=choice_seed(11, j), repetition_penalty=1.1,
                                                        **controls))[0].text
            assert got.choices[i * 3 + j].text == want, (i, j)
    assert got.usage.completion_tokens == 6 * 12
    assert got.usage.prompt_tokens == sum(len(tiny.tokenizer.encode(t)) for t in texts)


def test_echo_with_logprobs_scores_a_batch_of_token_id_prompts_as_lm_eval_asks(tiny, dsv4_tiny_cluster):
    """lm-evaluation-harness's loglikelihood request (`echo`, `logprobs: 1`, `max_tokens: 1`, a batch of token-id
    prompts): each choice's text starts with its prompt, its `token_logprobs` are null for the first prompt token and
    the offline engine's prompt logprobs after it, bit for bit, with one `top_logprobs` entry per position."""
    import json
    import urllib.request

    prompts = [tiny.tokenizer.encode("def fibonacci(n):\n    return n"), tiny.tokenizer.encode("class Stack:\n")]
    body = {"model": "dsv4-tiny", "prompt": prompts, "max_tokens": 1, "logprobs": 1, "echo": True,
            "temperature": 0, "seed": 1234}
    req = urllib.request.Request(dsv4_tiny_cluster.info["http"] + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=scaled(60)) as r:
        got = json.loads(r.read())
    for i, ids in enumerate(prompts):
        choice = got["choices"][i]
        lps = choice["logprobs"]
        want = tiny.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(
            max_tokens=1, temperature=0, prompt_logprobs=1))[0]
        assert choice["index"] == i and choice["text"].startswith(tiny.tokenizer.decode(ids, skip_special_tokens=False))
        assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None
        assert len(lps["tokens"]) == len(lps["token_logprobs"]) == len(ids) + 1  # the prompt, then one token
        # Bit for bit: a scoring request computes its prompt alone on the prefill worker, as offline.
        assert lps["token_logprobs"][1:len(ids)] == [lp.logprob for lp in want.prompt_logprobs[1:]]
        assert all(len(top) >= 1 for top in lps["top_logprobs"][1:])
    # `max_tokens: 0`: the prompt alone, the same logprobs.
    req = urllib.request.Request(dsv4_tiny_cluster.info["http"] + "/v1/completions",
                                 data=json.dumps({**body, "max_tokens": 0}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=scaled(60)) as r:
        scored = json.loads(r.read())
    assert scored["usage"]["completion_tokens"] == 0
    for i, ids in enumerate(prompts):
        lps = scored["choices"][i]["logprobs"]
        assert scored["choices"][i]["text"] == tiny.tokenizer.decode(ids, skip_special_tokens=False)
        assert lps["token_logprobs"] == got["choices"][i]["logprobs"]["token_logprobs"][: len(ids)]
    # The gRPC SDK's field: the same logprobs, one entry per prompt token.
    from pdspark.client import Client

    with Client(dsv4_tiny_cluster.info["grpc"]) as client:
        sdk = client.generate(token_ids=prompts[0], max_tokens=1, temperature=0, prompt_logprobs=1).prompt_logprobs
    assert sdk is not None and sdk[0] is None and len(sdk) == len(prompts[0])
    assert [lp.logprob for lp in sdk[1:]] == got["choices"][0]["logprobs"]["token_logprobs"][1:len(prompts[0])]


@pytest.mark.kills
def test_the_only_decode_worker_killed_mid_stream_every_stream_completes_after_its_restart(tiny, dsv4_tiny_cluster):
    """`pdspark up`'s one decode worker is SIGKILLed while 3 streams run: no other decode worker can take them, so
    the router waits for the restarted one (`max_role_outage_wait_s`) and migrates them there: each completes equal
    to offline (DSpark off, one engine), nothing lost or repeated."""
    import os
    import signal

    info = dsv4_tiny_cluster.info
    texts = ["def fibonacci(n):\n", "import os\nimport sys\n", "class Stack:\n"]
    # Long enough that every stream is still running when the kill comes (the test checks that it migrated).
    params = SamplingParams(temperature=0, max_tokens=MIGRATED_TOKENS, ignore_eos=True)
    want = [o.token_ids for o in tiny.generate(texts, params)]
    got = streams_through(info, texts, MIGRATED_TOKENS,
                          lambda: os.kill(current_pid(dsv4_tiny_cluster, "decode-1"), signal.SIGKILL))
    assert got == want
    assert any(e.get("event") == "restarted" and e.get("service") == "decode-1" for e in dsv4_tiny_cluster.events)


MIGRATED_TOKENS = 256


def current_pid(cluster, name: str) -> int:
    """A service's pid now: its last restart's, else its first (the cluster is shared: an earlier test may have
    killed it)."""
    restarts = [e for e in cluster.events if e.get("event") == "restarted" and e.get("service") == name]
    return (restarts[-1] if restarts else cluster.info["services"][name])["pid"]


def streams_through(info: dict, texts: list[str], max_tokens: int, kill, **sampling) -> list[list[int]]:
    """Greedy SDK streams of `texts` through the cluster's router (`sampling`: more `SamplingParams` fields, or
    others than `ignore_eos=True`); once each has its first token, `kill()` (a worker under them); every stream's
    tokens once all ended. Fails unless each ended without an error and the router counted a migration (the kill
    hit running streams)."""
    import threading

    from pdspark.client import Client

    got: list[list[int]] = [[] for _ in texts]
    failures: list[BaseException] = []
    first_tokens = threading.Semaphore(0)

    def stream(i: int) -> None:
        try:
            client = Client(info["grpc"], timeout=scaled(180))
            for chunk in client.stream(texts[i], max_tokens=max_tokens, temperature=0,
                                       **{"ignore_eos": True, **sampling}):
                if not got[i]:
                    first_tokens.release()
                got[i] += chunk.token_ids
        except BaseException as e:  # reported below, with the others' outcomes
            failures.append(e)
            first_tokens.release()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(texts))]
    for t in threads:
        t.start()
    for _ in threads:  # every stream under way (or failed: reported below)
        assert first_tokens.acquire(timeout=scaled(60)), "a stream got no first token"
    migrated_before = _migrations(info["http"])
    kill()
    for t in threads:
        t.join(scaled(180))
        assert not t.is_alive(), "a stream did not end"
    assert not failures, failures
    assert _migrations(info["http"]) > migrated_before  # the kill hit running streams
    return got


def _migrations(http: str) -> float:
    """The router's `pdspark_router_migrations_total`."""
    import urllib.request

    with urllib.request.urlopen(http + "/metrics", timeout=scaled(10)) as r:
        return next(float(line.split()[1]) for line in r.read().decode().splitlines()
                    if line.startswith("pdspark_router_migrations_total "))
