"""Random DSpark drafts written beside a checkpoint (config `dspark` entry + `mtp.*` tensors): for tests, and for the
benchmarks that time verify steps on a model without a trained draft (what a verify costs does not depend on what
its drafts are)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from pdspark.model.dspark import DSparkDraft
from pdspark.model.dspark_config import DSparkConfig
from pdspark.model.dspark_weights import draft_state_dict
from pdspark.model.model_config import ModelConfig


def add_random_draft(src: Path, dst: Path, gamma: int = 3, own_vocab: bool = False, moe: bool = False,
                     seed: int = 0) -> DSparkDraft:
    """Copy the checkpoint at `src` to `dst` and give it a random draft; returns the draft module."""
    shutil.copytree(src, dst)
    return write_random_draft(dst, gamma, own_vocab, moe, seed)


def write_random_draft(dst: Path, gamma: int = 3, own_vocab: bool = False, moe: bool = False,
                       seed: int = 0) -> DSparkDraft:
    """Give the checkpoint at `dst` a random draft: a `dspark` entry in its config.json (rewritten: a real file, not
    a link into a shared fixture) and the `mtp.*` tensors in `dspark.safetensors`; returns the draft module."""
    cfg = json.loads((dst / "config.json").read_text())
    target = ModelConfig.from_dict(cfg)
    layers = target.num_hidden_layers
    dcfg = DSparkConfig(
        num_stages=2, target_layer_ids=(1, layers - 1), gamma=gamma, mask_token_id=2, markov_rank=8,
        intermediate_size=32, n_routed_experts=4 if moe else 0, num_experts_per_tok=2 if moe else 0,
        uses_own_vocab_modules=own_vocab,
    )
    cfg["dspark"] = dcfg.to_dict()
    (dst / "config.json").unlink()  # never write through a link
    (dst / "config.json").write_text(json.dumps(cfg))
    draft = DSparkDraft(target, dcfg, 64)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.endswith(("norm.weight", "scale")):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    save_file(draft_state_dict(draft), dst / "dspark.safetensors")
    return draft
