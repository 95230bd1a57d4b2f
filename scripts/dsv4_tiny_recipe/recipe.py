"""The recipe's fixed choices: where the model is written, its vocabulary and special tokens, its chat template,
the target architecture, the asset directory's size budget and the evaluation's sample prompt."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO / "src" / "pdspark" / "assets" / "dsv4-tiny"

SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>", "<|mask|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
BOS, EOS, PAD, MASK = 0, 1, 2, 3
VOCAB_SIZE = 4096
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SIZE_BUDGET = 15_000_000  # bytes for the whole asset directory; the draft gets the rest of 25 MB later
SAMPLE_PROMPT = "def fibonacci(n):"

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_TYPES = [SLIDING, CSA, HCA, CSA, HCA, CSA]
TARGET_ARCH = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 192,
    "num_hidden_layers": len(LAYER_TYPES),
    "layer_types": LAYER_TYPES,
    "compress_rates": {CSA: 4, HCA: 128},
    "sliding_window": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "partial_rotary_factor": 16 / 64,
    "q_lora_rank": 128,
    "o_groups": 2,
    "o_lora_rank": 64,
    "index_n_heads": 4,
    "index_head_dim": 32,
    # 512-token windows hold 128 CSA entries and 2048-token ones 512, so top-64 is a real selection.
    "index_topk": 64,
    "mlp_layer_types": ["hash_moe"] + ["moe"] * (len(LAYER_TYPES) - 1),
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 128,
    "scoring_func": "sqrtsoftplus",
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "max_position_embeddings": 4096,
    "bos_token_id": BOS,
    "eos_token_id": EOS,
    "pad_token_id": PAD,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    "num_nextn_predict_layers": 0,  # no MTP/draft weights in the target checkpoint
}
