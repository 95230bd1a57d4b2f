"""Bad input gets a clear exception that names the problem."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import MIXED, random_prompts
from helpers import assert_no_leaks, make_llm
from pdspark import LLM, SamplingParams
from pdspark.errors import CapacityError, CheckpointError, ConfigError, InvalidRequestError


@pytest.fixture(scope="module")
def llm(checkpoints):
    path, _ = checkpoints(MIXED)
    return make_llm(path, max_model_len=128)


def test_empty_prompt(llm):
    with pytest.raises(InvalidRequestError, match="empty prompt"):
        llm.generate(prompt_token_ids=[[]])
    with pytest.raises(InvalidRequestError, match="empty prompt"):
        llm.generate("")


def test_token_ids_passed_as_prompts_name_the_right_argument(llm):
    with pytest.raises(InvalidRequestError, match="pass token ids as `prompt_token_ids`"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))


def test_prompt_longer_than_max_model_len(llm):
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        llm.generate(prompt_token_ids=[[5] * 128])


def test_token_outside_vocabulary(llm):
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        llm.generate(prompt_token_ids=[[5, 256]])


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(max_tokens=-1), "max_tokens"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-0.1), "temperature"),
        (dict(top_k=0), "top_k"),
        (dict(logprobs=-2), "logprobs"),
        (dict(stop=[""]), "stop"),
    ],
)
def test_invalid_sampling_params(kwargs, field):
    with pytest.raises(InvalidRequestError, match=f"`{field}`"):
        SamplingParams(**kwargs)


def test_bad_request_in_a_batch_queues_nothing(llm):
    prompts = random_prompts(2, [10]) + [[]]
    with pytest.raises(InvalidRequestError):
        llm.generate(prompt_token_ids=prompts)
    assert_no_leaks(llm)


def test_request_that_can_never_fit(checkpoints):
    path, _ = checkpoints(MIXED)
    small = make_llm(path, max_model_len=256, num_full_pages=4, max_num_seqs=2, max_num_batched_tokens=64)
    with pytest.raises(CapacityError, match="pages"):
        small.generate(prompt_token_ids=[[5] * 100], sampling_params=SamplingParams(max_tokens=10))


def _copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_checkpoint_missing_a_tensor(checkpoints, tmp_path):
    path, _ = checkpoints(MIXED)
    bad = _copy_checkpoint(path, tmp_path / "ckpt")
    tensors = load_file(bad / "model.safetensors")
    del tensors["model.layers.1.attn.indexer.wq_b.weight"]
    save_file(tensors, bad / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing 1 tensor\(s\): layers.1.attn.indexer.wq_b.weight"):
        LLM(str(bad))


def test_checkpoint_tensor_with_wrong_shape(checkpoints, tmp_path):
    path, _ = checkpoints(MIXED)
    bad = _copy_checkpoint(path, tmp_path / "ckpt")
    tensors = load_file(bad / "model.safetensors")
    tensors["model.layers.0.attn.wkv.weight"] = torch.zeros(3, 3)
    save_file(tensors, bad / "model.safetensors")
    with pytest.raises(CheckpointError, match="wkv.weight.*shape"):
        LLM(str(bad))


@pytest.mark.parametrize(
    "key, value, allowed",
    [
        ("hidden_act", "gelu", "silu"),
        ("num_key_value_heads", 2, "1"),
        ("scoring_func", "softmax", "sqrtsoftplus"),
        ("quantization_config", {"quant_method": "awq"}, "'fp8'"),
        ("expert_dtype", "int4", "'fp4'"),
        ("layer_types", ["full_attention"] * 4, "sliding_attention"),
        ("n_shared_experts", 2, "1"),
    ],
)
def test_unsupported_config_value(checkpoints, tmp_path, key, value, allowed):
    path, _ = checkpoints(MIXED)
    bad = _copy_checkpoint(path, tmp_path / "ckpt")
    cfg = json.loads((bad / "config.json").read_text())
    cfg[key] = value
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=f"{key}.*allowed: .*{allowed}"):
        LLM(str(bad))


def test_page_size_not_multiple_of_csa_ratio(checkpoints):
    path, _ = checkpoints(MIXED)
    with pytest.raises(ConfigError, match="page_size"):
        make_llm(path, page_size=18)


def test_prompt_text_without_tokenizer(checkpoints):
    path, _ = checkpoints(MIXED, tokenizer=False)
    with pytest.raises(InvalidRequestError, match="no tokenizer"):
        make_llm(path).generate("hello")


def test_swa_pool_too_small_for_any_request(checkpoints):
    path, _ = checkpoints(MIXED)
    small = make_llm(path, num_swa_pages=1, max_num_seqs=2, max_num_batched_tokens=16)
    with pytest.raises(CapacityError, match="SWA pages"):
        small.generate(prompt_token_ids=[[5] * 20], sampling_params=SamplingParams(max_tokens=4))
    assert_no_leaks(small)
