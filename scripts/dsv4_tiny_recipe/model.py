"""The target model: built from the recipe's architecture with a seeded hash-routing table, checked, counted, and
saved in the dtype that fits the size budget."""

from __future__ import annotations

from pathlib import Path

import torch

from .recipe import SIZE_BUDGET, TARGET_ARCH


def build_target(seed: int):
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(DeepseekV4Config(**TARGET_ARCH))
    init_hash_routing(model, seed)
    return model


def init_hash_routing(model, seed: int) -> None:
    """transformers initialises `tid2eid` to zeros (real tables come from checkpoints), which would send every token
    to expert 0 twice. Give each token `num_experts_per_tok` distinct experts from a seeded table; it is a buffer, so
    the optimizer never touches it."""
    gen = torch.Generator().manual_seed(seed + 1)
    for layer in model.model.layers:
        if layer.mlp.is_hash:
            gate = layer.mlp.gate
            table = torch.rand(gate.tid2eid.shape[0], gate.num_experts, generator=gen).argsort(dim=-1)
            gate.tid2eid.copy_(table[:, : gate.top_k])


def check_hash_routing(model) -> None:
    for layer in model.model.layers:
        if layer.mlp.is_hash:
            table = layer.mlp.gate.tid2eid
            if (table.sort(dim=-1).values.diff(dim=-1) == 0).any():
                raise RuntimeError("tid2eid routes some token to the same expert twice (zero-initialised table?)")


def count_params(model) -> dict:
    total = sum(p.numel() for p in model.parameters())
    cfg = model.config
    expert = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    inactive = expert * (cfg.n_routed_experts - cfg.num_experts_per_tok) // cfg.n_routed_experts
    return {"total": total, "routed_experts": expert, "active_per_token": total - inactive}


def save_target(model, outdir: Path, dtype: torch.dtype) -> None:
    """`save_pretrained` in `dtype`, except the modules DSV4 keeps in fp32 (norms, mHC, sinks, compressor position
    bias, router bias): transformers upcasts them on load anyway, so storing them rounded would only lose accuracy."""
    keep_fp32 = set(model._keep_in_fp32_modules_strict)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if tensor.is_floating_point() and not keep_fp32 & set(name.split(".")):
                tensor.data = tensor.data.to(dtype)
    model.save_pretrained(outdir)
    # safetensors writes the file owner-only; package data must be readable by whoever installs pdspark.
    (outdir / "model.safetensors").chmod(0o644)


def weights_dtype(model, outdir: Path) -> torch.dtype:
    """fp32 when the whole directory fits the size budget that way, else bf16."""
    fp32_bytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    other = sum(f.stat().st_size for f in outdir.iterdir() if f.name.startswith("tokenizer"))
    return torch.float32 if fp32_bytes + other + 100_000 <= SIZE_BUDGET else torch.bfloat16
