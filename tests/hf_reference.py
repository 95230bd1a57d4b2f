"""Random tiny DSV4 checkpoints written by transformers' `DeepseekV4ForCausalLM`, the reference for parity tests."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


@dataclass(frozen=True)
class TinySpec:
    layer_types: tuple[str, ...] = (SLIDING, CSA, HCA, CSA)
    hash_layers: int = 1
    hc_mult: int = 2
    csa_ratio: int = 4
    hca_ratio: int = 16
    sliding_window: int = 8
    index_topk: int = 64
    index_n_heads: int = 2
    vocab_size: int = 256
    hidden_size: int = 64
    yarn: bool = True
    tie_word_embeddings: bool = False
    seed: int = 0
    extra: tuple = ()  # extra DeepseekV4Config (key, value) pairs


def hf_config(spec: TinySpec):
    from transformers import DeepseekV4Config

    n = len(spec.layer_types)
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32,
            "beta_slow": 1} if spec.yarn else None
    # `spec.extra` may override any default below (a wider MoE, say).
    return DeepseekV4Config(**{**dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        moe_intermediate_size=32,
        num_hidden_layers=n,
        num_attention_heads=4,
        head_dim=32,
        q_lora_rank=32,
        o_groups=2,
        o_lora_rank=16,
        sliding_window=spec.sliding_window,
        layer_types=list(spec.layer_types),
        compress_rates={CSA: spec.csa_ratio, HCA: spec.hca_ratio},
        index_n_heads=spec.index_n_heads,
        index_head_dim=16,
        index_topk=spec.index_topk,
        n_routed_experts=4,
        num_experts_per_tok=2,
        hc_mult=spec.hc_mult,
        hc_sinkhorn_iters=5,
        mlp_layer_types=["hash_moe"] * spec.hash_layers + ["moe"] * (n - spec.hash_layers),
        partial_rotary_factor=8 / 32,
        initializer_range=0.1,
        rope_parameters=rope,
        tie_word_embeddings=spec.tie_word_embeddings,
        max_position_embeddings=4096,
        eos_token_id=1,
        bos_token_id=0,
    ), **dict(spec.extra)})


@torch.no_grad()
def randomize_small_parameters(model) -> None:
    """Sinks, biases, mHC bases and scales, router score biases: transformers initialises them to constants that
    would hide a wrong index or order; random values make every one of them matter."""
    for name, p in model.named_parameters():
        if any(k in name for k in ("position_bias", "sinks", ".base", "hc_base", "e_score")):
            p.normal_(0, 0.5)
        if name.endswith("scale") and p.numel() <= 3:
            p.uniform_(0.5, 1.5)
    for n, b in model.named_buffers():
        if n.endswith("e_score_correction_bias"):
            b.normal_(0, 0.1)


def build_hf_model(spec: TinySpec):
    """A random model whose every parameter (sinks, biases, gates, hash table) is non-trivial."""
    from transformers import DeepseekV4ForCausalLM

    torch.manual_seed(spec.seed)
    config = hf_config(spec)
    model = DeepseekV4ForCausalLM(config).eval()
    with torch.no_grad():
        randomize_small_parameters(model)
        for layer in model.model.layers:
            if layer.mlp.is_hash:
                g = torch.Generator().manual_seed(spec.seed + 1)
                n, k = config.n_routed_experts, config.num_experts_per_tok
                layer.mlp.gate.tid2eid.copy_(
                    torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(spec.vocab_size)])
                )
        # Sharper next-token distributions keep greedy argmaxes far from ties.
        model.lm_head.weight.mul_(4.0)
    return model


def save_hf_checkpoint(spec: TinySpec, path: Path):
    model = build_hf_model(spec)
    model.save_pretrained(path)
    return model


def hf_generate(model, prompt: list[int], max_new_tokens: int, **kw):
    """transformers' greedy `generate` with EOS disabled (pdspark's `ignore_eos` keeps EOS as a normal token)."""
    model.generation_config.eos_token_id = None  # otherwise merged back in from the model's config
    with torch.no_grad():
        return model.generate(
            torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0, **kw
        )


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    return hf_generate(model, prompt, max_new_tokens)[0, len(prompt) :].tolist()


def write_byte_tokenizer(path: Path) -> None:
    """A byte-level tokenizer with exactly 256 tokens (one per byte), so tiny 256-vocab checkpoints get text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(Path(path) / "tokenizer.json"))
