"""A bigger random DSV4 checkpoint for the engine benchmarks: dsv4-tiny's architecture, wider and with more
experts, random weights written by transformers' `DeepseekV4ForCausalLM` (so both systems load the same file),
rounded to bf16 numbers as a real DSV4 checkpoint's are (stored as fp32: both systems compute in fp32).

`big`: hidden 256, 16 routed experts (top-2) of intermediate 256, vocab 4,096, 6 layers.
`v4-shape`: a layer whose parts weigh what V4-Flash's do against each other, small enough for a CPU: hidden 1,024,
8 heads of 128 (queries and outputs through ranks of 256), 8 routed experts (top-2 and a shared one) of
intermediate 512, and the lightning indexer at 2 heads of 128, as V4's 64 heads of 128 are to its layers: ~256
multiply-adds an entry against ~7.5M a CSA layer's token (V4-Flash: 8,192 against ~290M), positions to 128k for
the long-context benchmark (dsv4-tiny's indexer is ~11x heavier against its layers: 128 against ~0.4M).
Built once into `~/.cache/pdspark-bench/<name>-bf16` (seeded: the same weights every time) and reused.
"""

from __future__ import annotations

import json
from pathlib import Path

CONFIGS = {
    "big": {"hidden_size": 256, "n_routed_experts": 16, "num_experts_per_tok": 2, "moe_intermediate_size": 256,
            "vocab_size": 4096, "q_lora_rank": 192, "o_lora_rank": 96},
    "v4-shape": {"hidden_size": 1024, "num_attention_heads": 8, "head_dim": 128, "q_lora_rank": 256,
                 "o_lora_rank": 256, "o_groups": 2, "n_routed_experts": 8, "num_experts_per_tok": 2,
                 "moe_intermediate_size": 512, "index_n_heads": 2, "index_head_dim": 128, "vocab_size": 4096,
                 "max_position_embeddings": 131072},
}
_CACHE = Path.home() / ".cache" / "pdspark-bench"


def random_checkpoint(name: str, seed: int = 0) -> Path:
    """The directory of the random checkpoint `name` (one of `CONFIGS`), built on first use."""
    out = _CACHE / f"{name}-bf16"  # (an earlier build kept full fp32 values under `name`)
    if (out / "model.safetensors").exists():
        return out
    from pdspark.assets import resolve_model

    import torch
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    base = json.loads((Path(resolve_model("dsv4-tiny")) / "config.json").read_text())
    base.pop("dspark", None)
    base.update(CONFIGS[name])
    base["dtype"] = "float32"
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(DeepseekV4Config(**base)).eval()
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed + 1)
        for layer in model.model.layers:
            if layer.mlp.is_hash:  # distinct experts per token id, as the trained table has
                E, k = base["n_routed_experts"], base["num_experts_per_tok"]
                layer.mlp.gate.tid2eid.copy_(
                    torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(base["vocab_size"])]))
        for p in model.parameters():
            if p.is_floating_point():
                p.copy_(p.bfloat16().float())
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tmp.rename(out)
    return out
