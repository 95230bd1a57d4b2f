"""`MooncakeBackend`: the Mooncake Transfer Engine (`mooncake-transfer-engine`, or `-non-cuda` on CPU machines).

P2P handshake metadata (no etcd): a peer's session id is `host:rpc_port`. Batches are split at 1,024 entries, the
most one `batch_transfer_sync_write` call takes. That call releases the GIL and waits at most the engine's own
transfer timeout (`MC_TRANSFER_TIMEOUT` seconds, read when the engine is created, at least 5; plus 1 s per GiB of
the batch): measured with 0.3.13, a peer that died fails at once (connection refused) and a stopped one after
that timeout (it busy-polls meanwhile, holding a core). No batch starts after the caller's deadline.

NOTE: security. The data plane has neither TLS nor authentication: a peer that reaches a worker's Mooncake ports can
write into its registered memory. Peers reach it at `host` (the worker's advertised address, the session id), but
Mooncake 0.3.13 listens on every interface whatever `host` is (measured: its handshake port on 0.0.0.0 and its TCP
transport on [::], with or without MC_TCP_BIND_ADDRESS / MC_LEGACY_RPC_PORT_BINDING), and has no option to bind one
address. Only the network can fence these ports: a private network, a host firewall, a NetworkPolicy
(docs/operations.md, "Security").
"""

from __future__ import annotations

import logging
import os

from pdspark.transfer.base import TransferError, Write, check_deadline

logger = logging.getLogger(__name__)
MAX_BATCH = 1024
# Mooncake's default is 30 s; a hung peer should hold a transfer thread (spinning) for less. An operator's own
# MC_TRANSFER_TIMEOUT wins.
BATCH_TIMEOUT_S = 10
_MIN_TIMEOUT_S = 5.0  # the engine waits at least this long, whatever MC_TRANSFER_TIMEOUT says
_SECONDS_PER_BYTE = 1 / (1 << 30)  # and 1 s more per GiB of the batch


class MooncakeBackend:
    def __init__(self, host: str = "127.0.0.1", protocol: str = "tcp", device: str = ""):
        os.environ.setdefault("MC_TRANSFER_TIMEOUT", str(BATCH_TIMEOUT_S))  # read by TransferEngine()
        self._batch_timeout_s = max(_MIN_TIMEOUT_S, float(os.environ["MC_TRANSFER_TIMEOUT"]))
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:  # missing wheel, or Debian's libibverbs1 / libnuma1
            raise TransferError(
                f"the Mooncake transfer engine is unavailable ({e}); install the `engine` extra "
                "(pip install 'pdspark[engine]', which brings `mooncake-transfer-engine-non-cuda` on x86_64) and the "
                "Debian packages libibverbs1 and libnuma1"
            ) from e
        self._engine = TransferEngine()
        rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, device)
        if rc != 0:
            raise TransferError(f"Mooncake initialize({host!r}, P2PHANDSHAKE, {protocol!r}) returned {rc}")
        self._session = f"{host}:{self._engine.get_rpc_port()}"

    @property
    def session_id(self) -> str:
        return self._session

    def register(self, addr: int, nbytes: int) -> None:
        rc = self._engine.register_memory(addr, nbytes)
        if rc != 0:
            raise TransferError(f"Mooncake register_memory({nbytes} bytes) returned {rc}")

    def write(self, session: str, writes: list[Write], deadline: float | None = None) -> None:
        # NOTE: no lock: the engine is thread-safe, and transfers to different peers run side by side (one to a
        # hung peer must not hold up the others for its whole timeout).
        for i in range(0, len(writes), MAX_BATCH):
            check_deadline(deadline, i, len(writes))
            part = writes[i : i + MAX_BATCH]
            rc = self._engine.batch_transfer_sync_write(
                session, [w.src_addr for w in part], [w.dst_addr for w in part], [w.nbytes for w in part]
            )
            if rc != 0:
                raise TransferError(f"Mooncake batch write of {len(part)} entries to {session} returned {rc}")

    def write_grace_s(self, nbytes: int) -> float:
        # A batch is at most the whole transfer: its timeout is at most this.
        return self._batch_timeout_s + nbytes * _SECONDS_PER_BYTE

    def close(self) -> None:
        self._engine = None
