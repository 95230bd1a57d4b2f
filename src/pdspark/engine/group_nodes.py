"""A worker group that spans machines (`--nnodes N --node-rank K`, as SGLang's flags): machine K runs ranks
`[K*L, (K+1)*L)` of the group (L = ep_size / N); machine 0 runs rank 0, which drives them all.

The ranks of other machines reach rank 0 over a control channel that stands for the local pipes: a TCP connection
to `--dist-init-addr`'s host at its port + 1, authenticated with the secret in `--dist-secret-file` (an HMAC
challenge both ways: `multiprocessing.connection`'s authkey; the calls it carries are pickles, so no one without the
secret may speak on it). Each such rank first joins the torch.distributed group, then connects, names its rank and
receives rank 0's model and engine configuration, so every rank runs rank 0's (the same seed and options, whatever
flags its machine was given). A rank of a group whose ranks run a service beside their engines (a decode group:
`engine/rank_service.py`) opens a second connection for it, its side channel; the service is its own machine's
(its transfer engine advertises this machine's address). Every rank of another machine also sends its figures row
(`parallel/rank_stats.py`) after each step over a connection of its own, which rank 0 copies into its table.
`join_engine_group` runs a machine's ranks and returns when they end.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, Listener
from multiprocessing.connection import wait as wait_for
from pathlib import Path
from typing import Any

import torch

from pdspark.config import EngineConfig, ParallelConfig
from pdspark.engine.rank_service import RankService, serve_side_calls
from pdspark.errors import ConfigError, WorkerGroupError
from pdspark.hardware.registry import bind_local_device, select_backend
from pdspark.options import build
from pdspark.parallel.rank_group import RankGroup
from pdspark.parallel.rank_stats import RankStats

logger = logging.getLogger(__name__)
# Between connection attempts of a rank whose rank 0 does not listen yet (a poll period; `dist_timeout_s` bounds it).
_RETRY_S = 0.1


@dataclass(frozen=True)
class NodeLayout:
    """Where this machine sits in its group, checked before any rank starts."""

    size: int  # ranks in the group
    nnodes: int
    node_rank: int
    control: tuple[str, int] | None  # rank 0's control channel (host, port); None: one machine
    secret: bytes

    @classmethod
    def of(cls, par: ParallelConfig) -> NodeLayout:
        if par.nnodes == 1:
            if par.node_rank != 0:
                raise ConfigError(f"`node_rank` is {par.node_rank}; allowed: 0 (with `nnodes` 1)")
            return cls(par.ep_size, 1, 0, None, b"")
        if par.ep_size % par.nnodes:
            raise ConfigError(f"`nnodes` is {par.nnodes}; allowed: a divisor of `ep_size` ({par.ep_size}): every "
                              "machine runs as many ranks")
        if not par.node_rank < par.nnodes:
            raise ConfigError(f"`node_rank` is {par.node_rank}; allowed: 0..{par.nnodes - 1} (`nnodes` {par.nnodes})")
        if par.dist_init_addr is None:
            raise ConfigError("`dist_init_addr` is required with `nnodes` > 1: rank 0's host:port, reachable from "
                              "every machine")
        host, _, port = par.dist_init_addr.rpartition(":")
        if int(port) >= 65535:
            raise ConfigError(f"`dist_init_addr` port is {port}; allowed: 1-65534 with `nnodes` > 1 (the control "
                              "channel listens on the next port)")
        if par.dist_secret_file is None:
            raise ConfigError("`dist_secret_file` is required with `nnodes` > 1: the control channel between machines "
                              "carries calls, which only holders of the secret may make")
        try:
            secret = Path(par.dist_secret_file).read_bytes().strip()
        except OSError as e:
            raise ConfigError(f"`dist_secret_file` {par.dist_secret_file!r} cannot be read: {e}") from e
        if not secret:
            raise ConfigError(f"`dist_secret_file` {par.dist_secret_file!r} is empty; allowed: a non-empty secret")
        return cls(par.ep_size, par.nnodes, par.node_rank, (host.strip("[]"), int(port) + 1), secret)

    @property
    def local_ranks(self) -> range:
        per = self.size // self.nnodes
        return range(self.node_rank * per, (self.node_rank + 1) * per)


# What a connection to rank 0's control channel is for (its hello names it): the calls (and their answers), the
# rank's figures after each step, the service's side channel, and one that carries nothing and so turns readable only
# when the rank is gone (its sentinel: the calls' connection turns readable whenever an answer comes).
CONTROL, STATS, SIDE, ALIVE = "control", "stats", "side", "alive"


class RemoteRank:
    """A rank on another machine, where rank 0 keeps its local ranks' processes: no process here. `conn`: its calls;
    `sentinel`: a connection that turns readable only when the rank is gone; `stats`: its figures rows, one per step
    (`copy_figures`); `side`: its service's channel, when the group runs one."""

    def __init__(self, rank: int, conn: Connection, sentinel: Connection, stats: Connection,
                 side: Connection | None = None):
        self.rank = rank
        self.conn = conn
        self.sentinel = sentinel
        self.stats = stats
        self.side = side
        self.pid: int | None = None
        self.exitcode: int | None = None  # (unknown here: "running" while its connections are open)

    def is_alive(self) -> bool:
        return False  # (nothing to kill here: it ends when its calls' connection closes)

    def join(self, timeout: float | None = None) -> None:
        """Wait (at most `timeout`) for the rank to be gone, then close every connection to it."""
        wait_for([self.sentinel], timeout=timeout)
        for conn in (self.conn, self.sentinel, self.stats, self.side):
            if conn is not None:
                conn.close()

    def kill(self) -> None:
        pass


def listen(layout: NodeLayout) -> Listener | None:
    """Rank 0's control channel for the other machines' ranks (None: one machine)."""
    if layout.control is None:
        return None
    return Listener(layout.control, authkey=layout.secret)


def accept_remote_ranks(listener: Listener, layout: NodeLayout, model: str, cfg: EngineConfig,
                        within_s: float, side: bool = False) -> list[RemoteRank]:
    """The other machines' ranks, each connected and given `model` and `cfg`, in rank order (with `side`: each
    with its service's channel too); raises `WorkerGroupError` naming those that did not connect within
    `within_s`. A connection without the secret is refused and logged (the wait goes on)."""
    expected = set(range(layout.size)) - set(layout.local_ranks)
    kinds = (CONTROL, STATS, ALIVE, SIDE) if side else (CONTROL, STATS, ALIVE)
    got: dict[tuple[str, int], Connection] = {}

    def accept() -> None:
        while len(got) < len(expected) * len(kinds):
            try:
                conn = listener.accept()
            except mp.AuthenticationError as e:
                logger.warning("refused a connection to the group's control channel: %s", e)
                continue
            except OSError:
                return  # (closed: the wait is over)
            hello = conn.recv()
            if not (isinstance(hello, tuple) and len(hello) == 2 and hello[0] in kinds and hello[1] in expected
                    and hello not in got):
                logger.warning("refused a control connection saying %r (expected (kind, rank) for kinds %s and "
                               "ranks %s, each once)", hello, kinds, sorted(expected))
                conn.close()
                continue
            got[hello] = conn

    thread = threading.Thread(target=accept, name="group-accept", daemon=True)
    thread.start()
    thread.join(within_s)
    listener.close()
    thread.join(within_s)  # (the accept ends as the listener closes)
    missing = sorted({rank for rank in expected for kind in kinds if (kind, rank) not in got})
    if missing:
        for conn in got.values():
            conn.close()
        service = (" and their service's side channel (a decode group's machines run `pdspark serve decode "
                   "--node-rank K`)") if side else ""
        raise WorkerGroupError(f"ranks {missing} of the group did not connect to rank 0's control channel{service} "
                               f"within {within_s:.0f} s (check --dist-secret-file and that the port after "
                               "--dist-init-addr's is reachable)")
    for rank in expected:
        got[CONTROL, rank].send((model, cfg))
    return [RemoteRank(rank, got[CONTROL, rank], got[ALIVE, rank], got[STATS, rank], got.get((SIDE, rank)))
            for rank in sorted(expected)]


def copy_figures(remote: RemoteRank, stats: RankStats) -> None:
    """Copy the figures rows a rank on another machine sends into rank 0's table, from a daemon thread, until its
    connection closes."""

    def copy() -> None:
        while True:
            try:
                row = remote.stats.recv()
            except (EOFError, OSError):
                return
            stats.set_row(remote.rank, row)

    threading.Thread(target=copy, name=f"rank{remote.rank}-figures", daemon=True).start()


def join_engine_group(model: str, config: EngineConfig | None, options: dict[str, Any],
                      rank_service: RankService | None = None) -> int:
    """Run this machine's ranks of a group whose rank 0 runs on machine 0 (`node_rank` > 0); returns 0 when they
    end as the group ends, 1 when one of them failed (the others are then stopped). `rank_service`: run beside each
    rank's engine (a decode group's transfer destination, this machine's), over a side channel to rank 0."""
    cfg = build(EngineConfig, options, base=config)
    layout = NodeLayout.of(cfg.parallel)
    if layout.node_rank == 0:
        raise ConfigError("`node_rank` is 0: machine 0 runs rank 0 (`LLM`, `pdspark generate`, a worker); allowed "
                          "here: 1..nnodes - 1")
    backend = select_backend(cfg.device).dist_backend
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_remote_rank_main, name=f"pdspark-rank{rank}", daemon=True,
                         args=(rank, layout, f"tcp://{cfg.parallel.dist_init_addr}", backend,
                               cfg.parallel.dist_timeout_s, torch.get_num_threads(), cfg.device, rank_service))
             for rank in layout.local_ranks]
    for p in procs:
        p.start()
    try:
        pending = list(procs)
        while pending:
            wait_for([p.sentinel for p in pending])
            for p in [p for p in pending if p.exitcode is not None]:
                pending.remove(p)
                if p.exitcode != 0:
                    logger.error("rank process %s exited with %s: stopping this machine's ranks", p.name, p.exitcode)
                    return 1
        return 0
    finally:
        for p in procs:
            if p.exitcode is None:
                p.kill()
            p.join()


def _remote_rank_main(rank: int, layout: NodeLayout, init: str, backend: str, timeout_s: float,
                      threads: int, device: str, service: RankService | None) -> None:
    from pdspark.engine.data_parallel import serve_rank
    from pdspark.engine.factory import create_engine
    from pdspark.engine.lockstep import follow

    torch.set_num_threads(threads)
    # This machine's device of the rank's local index (the configuration's device is rank 0's, received below:
    # the local flags name the same one).
    bind_local_device(device, rank - layout.local_ranks.start)
    group = RankGroup.join(rank, layout.size, init, timeout_s, backend)
    try:
        assert layout.control is not None
        conn = _connect(layout.control, layout.secret, timeout_s)
        conn.send((CONTROL, rank))
        figures = _connect(layout.control, layout.secret, timeout_s)
        figures.send((STATS, rank))
        alive = _connect(layout.control, layout.secret, timeout_s)  # (held open, silent, until this rank ends)
        alive.send((ALIVE, rank))
        side = None
        if service is not None:
            side = _connect(layout.control, layout.secret, timeout_s)
            side.send((SIDE, rank))
        model, cfg = conn.recv()  # rank 0's: every rank runs one configuration
        engine = create_engine(model, False, cfg, group=group)
        if service is not None and side is not None:
            serve_side_calls(service, engine, side)
        stats = RankStats(layout.size)  # (this machine's table: only this rank's row is sent)
        timer = stats.timer(rank, engine.runner.model.expert_exchange)

        def timed(step: Callable[[], Any]) -> Any:
            out = timer(step)
            figures.send(stats.row(rank))
            return out

        (serve_rank if cfg.parallel.dp_attention else follow)(engine, conn, timed)
    finally:
        group.close()


def _connect(address: tuple[str, int], secret: bytes, within_s: float) -> Connection:
    """Rank 0's control channel, retried until it listens (it does once every rank joined the group)."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            return Client(address, authkey=secret)
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise WorkerGroupError(f"rank 0's control channel at {address[0]}:{address[1]} refused every "
                                       f"connection for {within_s:.0f} s") from None
            time.sleep(_RETRY_S)
