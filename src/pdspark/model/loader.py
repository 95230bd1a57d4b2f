"""`load_checkpoint`: a DSV4 model (and its tokenizer, when shipped) from an HF-format directory."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from pdspark.model.dsv4 import DSV4Model
from pdspark.model.model_config import ModelConfig
from pdspark.model.tokenizer import Tokenizer
from pdspark.model.weights import load_weights


@dataclass
class Checkpoint:
    model: DSV4Model
    tokenizer: Tokenizer | None
    extra: dict[str, torch.Tensor]  # mtp.* tensors (the speculative draft)
    path: Path


def load_checkpoint(
    path: str | Path, max_len: int, dtype: str = "float32", device: str = "cpu", progress: bool = False
) -> Checkpoint:
    path = Path(path)
    cfg = ModelConfig.from_dir(path)
    model = DSV4Model(cfg, max_len)
    report = load_weights(model, path, progress=progress)
    model = model.to(device=device, dtype=getattr(torch, dtype))
    # The compressor state, sinks and norms stay fp32 in DSV4; tid2eid stays integer.
    model.requires_grad_(False)
    model.eval()
    return Checkpoint(model, Tokenizer.from_dir(path, cfg.eos_token_ids), report.extra, path)
