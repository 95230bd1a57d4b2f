"""`start_engine_group`: an expert-parallel group of `ep_size` rank processes on this machine, driven from the
calling process as rank 0 (the offline API: `LLM(model, ep_size=N)`, `pdspark generate --ep-size N`).

The other ranks are spawned children (a fresh interpreter each: torch and a forked parent's threads do not mix);
each joins the torch.distributed group, loads its share of the routed experts and follows rank 0's calls
(`lockstep.follow`; with `dp_attention`, `data_parallel.serve_rank`). They end when rank 0 closes the group, or exits
(their pipe closes), or a collective fails.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import secrets
import shutil
import tempfile
import weakref
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import torch

from pdspark.assets import resolve_model
from pdspark.config import EngineConfig
from pdspark.engine.data_parallel import DataParallelEngine, serve_rank
from pdspark.engine.factory import create_engine
from pdspark.engine.group_nodes import NodeLayout, RemoteRank, accept_remote_ranks, copy_figures, listen
from pdspark.engine.lockstep import STOP, LockstepEngine, follow
from pdspark.engine.rank_service import RankService, ServiceChannel, serve_side_calls
from pdspark.errors import ConfigError
from pdspark.hardware.registry import bind_local_device, select_backend
from pdspark.model.model_config import ModelConfig
from pdspark.options import build
from pdspark.parallel.expert_shard import ExpertShard
from pdspark.parallel.rank_group import RankGroup
from pdspark.parallel.rank_stats import RankStats

# A follower that was told to stop leaves at once; this bounds the wait for one that does not (then it is killed).
_JOIN_S = 10.0


def start_engine_group(model: str, progress: bool, config: EngineConfig | None, options: dict[str, Any],
                       rank_service: RankService | None = None) -> LockstepEngine:
    """`rank_service`: run beside every other rank's engine (`engine/rank_service.py`); the group is returned once
    each rank's has started (their channels: `rank_services`, rank 1 first)."""
    cfg = build(EngineConfig, options, base=config)
    if cfg.seed is None:  # one seed for every rank: requests without a seed must draw the same streams everywhere
        cfg = build(EngineConfig, {"seed": secrets.randbits(63)}, base=cfg)
    size, par = cfg.parallel.ep_size, cfg.parallel
    # Refused before any rank starts: a size that does not divide the experts, a device this machine lacks, a group
    # across machines without its address or secret.
    ExpertShard(0, size, ModelConfig.from_dir(resolve_model(model)).n_routed_experts)
    layout = NodeLayout.of(par)
    if layout.node_rank != 0:
        raise ConfigError(f"`node_rank` is {layout.node_rank}: this machine runs only its ranks (`pdspark serve` or "
                          "`pdspark generate` with --node-rank); allowed here: 0")
    bind_local_device(cfg.device, 0)  # (one device per rank: rank 0 takes this machine's first)
    backend = select_backend(cfg.device).dist_backend
    rendezvous = tempfile.mkdtemp(prefix="pdspark-group-")
    init = f"tcp://{par.dist_init_addr}" if par.dist_init_addr else f"file://{rendezvous}/store"
    ctx = mp.get_context("spawn")
    stats = RankStats(size)  # (shared memory every rank writes its row of)
    conns: list[Connection] = []
    channels: list[ServiceChannel] = []
    procs: list[BaseProcess | RemoteRank] = []
    group: RankGroup | None = None
    listener = listen(layout)  # (the other machines' ranks connect once the group is joined)
    try:
        for rank in layout.local_ranks[1:]:
            ours, theirs = ctx.Pipe()
            side_ours, side_theirs = ctx.Pipe() if rank_service is not None else (None, None)
            proc = ctx.Process(target=_follower_main, name=f"pdspark-rank{rank}", daemon=True,
                               args=(rank, size, init, backend, model, cfg, torch.get_num_threads(), theirs,
                                     stats.shared, rank_service, side_theirs))
            proc.start()
            theirs.close()
            conns.append(ours)
            procs.append(proc)
            if side_ours is not None and side_theirs is not None:
                side_theirs.close()
                channels.append(ServiceChannel(rank, side_ours, proc.sentinel))
        group = RankGroup.join(0, size, init, par.dist_timeout_s, backend)
        if listener is not None:
            remote = accept_remote_ranks(listener, layout, model, cfg, par.dist_timeout_s,
                                         side=rank_service is not None)
            conns += [r.conn for r in remote]
            procs += remote
            channels += [ServiceChannel(r.rank, r.side, r.side) for r in remote if r.side is not None]
            for r in remote:
                copy_figures(r, stats)
        engine = create_engine(model, progress, cfg, group=group)
        for channel in channels:  # (the ranks load at once: theirs is done about when ours is)
            channel.receive_info(par.dist_timeout_s)
    except BaseException:
        if listener is not None:
            listener.close()
        _end_group(conns, procs, group, rendezvous, channels)
        raise
    lockstep = (DataParallelEngine(engine, conns, procs, stats) if par.dp_attention
                else LockstepEngine(engine, conns, procs, stats=stats))
    # Run by `close`, or when the engine is collected, or at exit: a dropped LLM does not leave ranks behind.
    lockstep.rank_services = channels
    lockstep._close = weakref.finalize(lockstep, _end_group, conns, procs, group, rendezvous, channels)
    return lockstep


def _end_group(conns: list[Connection], procs: list[BaseProcess | RemoteRank], group: RankGroup | None,
               rendezvous: str, channels: list[ServiceChannel]) -> None:
    for channel in channels:
        channel.close()
    for conn in conns:
        with contextlib.suppress(OSError):  # (that rank is gone already)
            conn.send((STOP, ()))
        conn.close()
    for proc in procs:
        proc.join(_JOIN_S)
        if proc.is_alive():
            proc.kill()
            proc.join(_JOIN_S)
    if group is not None:
        group.close()
    shutil.rmtree(rendezvous, ignore_errors=True)


def _follower_main(rank: int, size: int, init: str, backend: str, model: str, cfg: EngineConfig, threads: int,
                   conn: Connection, stats: Any, service: RankService | None, side: Connection | None) -> None:
    torch.set_num_threads(threads)  # as rank 0: the group's ranks share the machine's cores
    bind_local_device(cfg.device, rank)  # (machine 0 runs ranks 0..L-1: its local index is its rank)
    group = RankGroup.join(rank, size, init, cfg.parallel.dist_timeout_s, backend)
    try:
        engine = create_engine(model, False, cfg, group=group)
        if service is not None and side is not None:
            serve_side_calls(service, engine, side)
        timed = RankStats(size, stats).timer(rank, engine.runner.model.expert_exchange)
        (serve_rank if cfg.parallel.dp_attention else follow)(engine, conn, timed)
    finally:
        group.close()
