"""`MooncakeBackend`: the Mooncake Transfer Engine (`mooncake-transfer-engine`, or `-non-cuda` on CPU machines).

P2P handshake metadata (no etcd): a peer's session id is `host:rpc_port`. Batches are split at 1,024 entries, the
most one `batch_transfer_sync_write` call takes.
"""

from __future__ import annotations

import logging
import threading

from pdspark.transfer.base import TransferError, Write

logger = logging.getLogger(__name__)
MAX_BATCH = 1024


class MooncakeBackend:
    def __init__(self, host: str = "127.0.0.1", protocol: str = "tcp", device: str = ""):
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:  # missing wheel, or Debian's libibverbs1 / libnuma1
            raise TransferError(
                f"the Mooncake transfer engine is unavailable ({e}); install `mooncake-transfer-engine-non-cuda` "
                "and the Debian packages libibverbs1 and libnuma1"
            ) from e
        self._engine = TransferEngine()
        rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, device)
        if rc != 0:
            raise TransferError(f"Mooncake initialize({host!r}, P2PHANDSHAKE, {protocol!r}) returned {rc}")
        self._session = f"{host}:{self._engine.get_rpc_port()}"
        self._lock = threading.Lock()  # the engine's sync calls are used from several server threads

    @property
    def session_id(self) -> str:
        return self._session

    def register(self, addr: int, nbytes: int) -> None:
        rc = self._engine.register_memory(addr, nbytes)
        if rc != 0:
            raise TransferError(f"Mooncake register_memory({nbytes} bytes) returned {rc}")

    def write(self, session: str, writes: list[Write]) -> None:
        for i in range(0, len(writes), MAX_BATCH):
            part = writes[i : i + MAX_BATCH]
            with self._lock:
                rc = self._engine.batch_transfer_sync_write(
                    session, [w.src_addr for w in part], [w.dst_addr for w in part], [w.nbytes for w in part]
                )
            if rc != 0:
                raise TransferError(f"Mooncake batch write of {len(part)} entries to {session} returned {rc}")

    def close(self) -> None:
        self._engine = None
