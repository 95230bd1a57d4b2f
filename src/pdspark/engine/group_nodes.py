"""A worker group that spans machines (`--nnodes N --node-rank K`, as SGLang's flags): machine K runs ranks
`[K*L, (K+1)*L)` of the group (L = ep_size / N); machine 0 runs rank 0, which drives them all.

The ranks of other machines reach rank 0 over a control channel that stands for the local pipes: a TCP connection
to `--dist-init-addr`'s host at its port + 1, authenticated with the secret in `--dist-secret-file` (an HMAC
challenge both ways: `multiprocessing.connection`'s authkey; the calls it carries are pickles, so no one without the
secret may speak on it). Each such rank first joins the torch.distributed group, then connects, names its rank and
receives rank 0's model and engine configuration, so every rank runs rank 0's (the same seed and options, whatever
flags its machine was given). `join_engine_group` runs a machine's ranks and returns when they end.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, Listener
from multiprocessing.connection import wait as wait_for
from pathlib import Path
from typing import Any

import torch

from pdspark.config import EngineConfig, ParallelConfig
from pdspark.errors import ConfigError, WorkerGroupError
from pdspark.hardware.registry import bind_local_device, select_backend
from pdspark.options import build
from pdspark.parallel.rank_group import RankGroup

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


class RemoteRank:
    """A rank on another machine, where rank 0 keeps its local ranks' processes: no process here; its sentinel is
    its connection (which turns readable when the connection closes: a lockstep rank never sends)."""

    def __init__(self, rank: int, conn: Connection):
        self.rank = rank
        self.sentinel = conn
        self.pid: int | None = None
        self.exitcode: int | None = None  # (unknown here: "running" while its connection is open)

    def is_alive(self) -> bool:
        return False  # (nothing to join or kill here: it ends when its connection closes)

    def join(self, timeout: float | None = None) -> None:
        pass

    def kill(self) -> None:
        pass


def listen(layout: NodeLayout) -> Listener | None:
    """Rank 0's control channel for the other machines' ranks (None: one machine)."""
    if layout.control is None:
        return None
    return Listener(layout.control, authkey=layout.secret)


def accept_remote_ranks(listener: Listener, layout: NodeLayout, model: str, cfg: EngineConfig,
                        within_s: float) -> list[RemoteRank]:
    """The other machines' ranks, each connected and given `model` and `cfg`, in rank order; raises
    `WorkerGroupError` naming those that did not connect within `within_s`. A connection without the secret is
    refused and logged (the wait goes on)."""
    expected = set(range(layout.size)) - set(layout.local_ranks)
    got: dict[int, Connection] = {}

    def accept() -> None:
        while len(got) < len(expected):
            try:
                conn = listener.accept()
            except mp.AuthenticationError as e:
                logger.warning("refused a connection to the group's control channel: %s", e)
                continue
            except OSError:
                return  # (closed: the wait is over)
            rank = conn.recv()
            if not isinstance(rank, int) or rank not in expected or rank in got:
                logger.warning("refused a control connection naming rank %r (expected one of %s, not yet "
                               "connected)", rank, sorted(expected - set(got)))
                conn.close()
                continue
            got[rank] = conn

    thread = threading.Thread(target=accept, name="group-accept", daemon=True)
    thread.start()
    thread.join(within_s)
    listener.close()
    thread.join(within_s)  # (the accept ends as the listener closes)
    missing = sorted(expected - set(got))
    if missing:
        for conn in got.values():
            conn.close()
        raise WorkerGroupError(f"ranks {missing} of the group did not connect to rank 0's control channel within "
                               f"{within_s:.0f} s (check --dist-secret-file and that the port after "
                               "--dist-init-addr's is reachable)")
    for conn in got.values():
        conn.send((model, cfg))
    return [RemoteRank(rank, got[rank]) for rank in sorted(got)]


def join_engine_group(model: str, config: EngineConfig | None, options: dict[str, Any]) -> int:
    """Run this machine's ranks of a group whose rank 0 runs on machine 0 (`node_rank` > 0); returns 0 when they
    end as the group ends, 1 when one of them failed (the others are then stopped)."""
    cfg = build(EngineConfig, options, base=config)
    layout = NodeLayout.of(cfg.parallel)
    if layout.node_rank == 0:
        raise ConfigError("`node_rank` is 0: machine 0 runs rank 0 (`LLM`, `pdspark generate`, a worker); allowed "
                          "here: 1..nnodes - 1")
    backend = select_backend(cfg.device).dist_backend
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_remote_rank_main, name=f"pdspark-rank{rank}", daemon=True,
                         args=(rank, layout, f"tcp://{cfg.parallel.dist_init_addr}", backend,
                               cfg.parallel.dist_timeout_s, torch.get_num_threads(), cfg.device))
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
                      threads: int, device: str) -> None:
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
        conn.send(rank)
        model, cfg = conn.recv()  # rank 0's: every rank runs one configuration
        engine = create_engine(model, False, cfg, group=group)
        (serve_rank if cfg.parallel.dp_attention else follow)(engine, conn)
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
