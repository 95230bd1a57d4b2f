"""The shipped model rewritten in DeepSeek-V4's released format (FP8 weights, MXFP4 experts, native names, 2 shards)
served by `pdspark up` (P/D over Mooncake, DSpark on): completions equal its dequantized twin's, offline."""

from __future__ import annotations

import pytest
from test_prefill_group import PROMPT, complete
from test_supervision import ENV

from pdspark import LLM, SamplingParams
from pdspark.assets import resolve_model
from pdspark.launch.service_process import start_service
from pdspark.testing.release_checkpoint import write_release_checkpoint
from pdspark.testing.time_scale import scaled


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    root = tmp_path_factory.mktemp("release-tiny")
    return write_release_checkpoint(resolve_model("dsv4-tiny"), root / "fixture", root / "twin")


def test_pdspark_up_serves_a_released_format_checkpoint_as_its_twin(release):
    sampling = [dict(temperature=0), dict(temperature=0.9, top_k=40, seed=905)]
    with LLM(str(release.twin), max_model_len=512, max_num_seqs=4, speculative="dspark") as twin:
        want = [twin.generate([PROMPT], SamplingParams(max_tokens=8, ignore_eos=True, **s))[0].text for s in sampling]
    cluster = start_service("pdspark up", ["up", "--model", str(release.path), "--max-model-len", "512",
                                           "--max-num-seqs", "4", "--port", "0", "--grpc-port", "0"],
                            timeout=scaled(180), env=ENV)
    try:
        assert "(speculative: dspark)" in cluster.tail(200)  # (the draft's quantized tensors loaded too)
        assert [complete(cluster.info, **s) for s in sampling] == want
    finally:
        cluster.stop()


def test_pdspark_up_serves_it_compact_with_an_fp8_cache_as_offline(release):
    """The acceptance path with both memory savings on: weights as stored (the default) and `--kv-cache-dtype
    fp8_e4m3` on both workers; P/D (the packed rows over Mooncake) and DSpark give the offline FP8 engine's text."""
    sampling = [dict(temperature=0), dict(temperature=0.9, top_k=40, seed=906)]
    with LLM(str(release.path), max_model_len=512, max_num_seqs=4, speculative="dspark",
             kv_cache_dtype="fp8_e4m3") as offline:
        want = [offline.generate([PROMPT], SamplingParams(max_tokens=8, ignore_eos=True, **s))[0].text
                for s in sampling]
    cluster = start_service("pdspark up", ["up", "--model", str(release.path), "--max-model-len", "512",
                                           "--max-num-seqs", "4", "--port", "0", "--grpc-port", "0",
                                           "--kv-cache-dtype", "fp8_e4m3"], timeout=scaled(180), env=ENV)
    try:
        assert [complete(cluster.info, **s) for s in sampling] == want
    finally:
        cluster.stop()
