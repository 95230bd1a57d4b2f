"""`create_engine`: an `Engine` from a checkpoint name or path and flat options (LLM, workers, benchmarks)."""

from __future__ import annotations

import gc
from typing import Any

from pdspark import omp_wait_policy
from pdspark.assets import resolve_model
from pdspark.config import EngineConfig
from pdspark.engine.engine import Engine
from pdspark.errors import ConfigError
from pdspark.hardware.cpu.cpu_budget import fit_threads
from pdspark.hardware.extra_ops import load_extra_ops
from pdspark.hardware.registry import select_backend
from pdspark.model.fingerprint import expert_digests
from pdspark.model.loader import load_checkpoint, load_draft
from pdspark.model.model_config import ModelConfig
from pdspark.options import build
from pdspark.parallel.expert_shard import ExpertShard
from pdspark.parallel.rank_group import RankGroup
from pdspark.parallel.slot_exchange import SlotExchange
from pdspark.parallel.token_exchange import TokenExchange


def create_engine(model: str, progress: bool = False, config: EngineConfig | None = None,
                  group: RankGroup | None = None, **options: Any) -> Engine:
    """Load the checkpoint (and its DSpark draft when `speculative` is set) and build the engine.

    `options` are `EngineConfig`'s flat keyword options (`page_size=16`, `max_num_seqs=4`, `speculative="dspark"`,
    ...), applied over `config` when both are given; an unknown one raises ConfigError listing the allowed ones.
    `group`: this process is one rank of an expert-parallel group (it holds and reads only its share of the routed
    experts, and every MoE layer exchanges slots with the other ranks, which must run the same steps; with
    `dp_attention`, each rank its own requests and every step a collective one: `DSV4Model.finish_group_step`)."""
    path = resolve_model(model)
    model_cfg = ModelConfig.from_dir(path)
    config = build(EngineConfig, options, base=config).for_model(model_cfg.max_position_embeddings)
    if (group.size if group is not None else 1) != config.parallel.ep_size:
        raise ConfigError(f"`ep_size` is {config.parallel.ep_size}: a group of that many ranks runs through `LLM`, "
                          "`pdspark generate` and prefill workers; allowed here (one engine process): 1")
    if group is not None and config.speculative_policy == "when-faster":
        # The policy decides from step times, which differ between the ranks that must take the same steps.
        raise ConfigError("`speculative_policy` 'when-faster' with `ep_size` > 1; allowed: 'always'")
    max_len = config.scheduler.max_model_len
    assert max_len is not None  # for_model resolved it
    # The device is checked before anything loads: `--device cuda` without a GPU fails here, naming what is missing.
    # So are the extra operator libraries, and the operators the backend's features need from them.
    backend = select_backend(config.device)
    load_extra_ops(config.extra_ops_so, {f: backend.required_ops(f) for f in backend.op_features}, backend.name)
    device = str(backend.device)
    if device == "cpu":
        fit_threads()  # (a pod's CPU limit, not the node's cores)
        omp_wait_policy.check()
    shard = None if group is None else ExpertShard(group.rank, group.size, model_cfg.n_routed_experts)
    ckpt = load_checkpoint(path, max_len, dtype=config.dtype, device=device, progress=progress,
                           quantization=config.quantization, experts=shard, weight_format=config.weight_format,
                           draft=config.speculative is not None)
    if group is not None:
        exchange = TokenExchange if config.parallel.dp_attention else SlotExchange
        ckpt.model.use_expert_exchange(exchange(group.collectives))
        # The fingerprint a peer compares is the whole model's: every rank's expert digests, pooled.
        ckpt.model.group_expert_digests = [d for part in group.all_gather(expert_digests(ckpt.model)) for d in part]
    draft = load_draft(ckpt, max_len, config.dtype, device) if config.speculative else None
    engine = Engine(ckpt.model, config, ckpt.tokenizer, draft)
    # What is loaded now lives as long as the process: move it out of the collector's generations, so that the
    # full collections that steps trigger do not walk the model and its tables again and again.
    gc.collect()
    gc.freeze()
    return engine
