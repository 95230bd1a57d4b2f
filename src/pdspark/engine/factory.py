"""`create_engine`: an `Engine` from a checkpoint name or path and flat options (LLM, workers, benchmarks)."""

from __future__ import annotations

import gc
from typing import Any

from pdspark.assets import resolve_model
from pdspark.config import EngineConfig
from pdspark.engine.engine import Engine
from pdspark.hardware.extra_ops import load_extra_ops
from pdspark.hardware.registry import select_backend
from pdspark.model.loader import load_checkpoint, load_draft
from pdspark.model.model_config import ModelConfig
from pdspark.options import build


def create_engine(model: str, progress: bool = False, config: EngineConfig | None = None, **options: Any) -> Engine:
    """Load the checkpoint (and its DSpark draft when `speculative` is set) and build the engine.

    `options` are `EngineConfig`'s flat keyword options (`page_size=16`, `max_num_seqs=4`, `speculative="dspark"`,
    ...), applied over `config` when both are given; an unknown one raises ConfigError listing the allowed ones."""
    path = resolve_model(model)
    config = build(EngineConfig, options, base=config).for_model(ModelConfig.from_dir(path).max_position_embeddings)
    max_len = config.scheduler.max_model_len
    assert max_len is not None  # for_model resolved it
    # The device is checked before anything loads: `--device cuda` without a GPU fails here, naming what is missing.
    # So are the extra operator libraries, and the operators the backend's features need from them.
    backend = select_backend(config.device)
    load_extra_ops(config.extra_ops_so, {f: backend.required_ops(f) for f in backend.op_features}, backend.name)
    device = str(backend.device)
    ckpt = load_checkpoint(path, max_len, dtype=config.dtype, device=device, progress=progress,
                           quantization=config.quantization)
    draft = load_draft(ckpt, max_len, config.dtype, device) if config.speculative else None
    engine = Engine(ckpt.model, config, ckpt.tokenizer, draft)
    # What is loaded now lives as long as the process: move it out of the collector's generations, so that the
    # full collections that steps trigger do not walk the model and its tables again and again.
    gc.collect()
    gc.freeze()
    return engine
