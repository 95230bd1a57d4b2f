"""`SlotExchange`: a MoE layer's per-(token, slot) expert outputs summed over an expert-parallel group.

Each rank computes the slots whose expert it holds and leaves the others zero; one all-reduce then gives every rank
every slot's output. Each element has exactly one nonzero term (x + 0 is x in floating point), so the sum is exact
and the slot-order sum that follows has the bits of one process holding every expert. The C decode step calls the
same exchange through a C function pointer (`c_pointer`), so its layers stay one C call each.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from pdspark.errors import ExpertExchangeError

# `expert_exchange` in kernels.h: int (*)(float *ys, long n), 0 on success.
_EXCHANGE_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_long)


class SlotExchange:
    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group  # None: the default (world) group
        # What the exchanges cost on this rank (benchmarks, and the group's metrics once workers run groups).
        self.calls = 0
        self.bytes = 0
        self.seconds = 0.0
        self.failure: BaseException | None = None  # why the last call from C failed (C gets only a status)
        self._c_fn = _EXCHANGE_FN(self._from_c)  # held here: ctypes frees a callback object that is collected
        self.c_pointer: int = ctypes.cast(self._c_fn, ctypes.c_void_p).value or 0

    def combine(self, ys: torch.Tensor) -> None:
        """`ys [T, k, D]` (any shape): every rank's rows summed in place; raises on a failed or timed-out
        collective (the group's timeout bounds it)."""
        start = time.perf_counter()
        dist.all_reduce(ys, op=dist.ReduceOp.SUM, group=self.group)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        self.bytes += ys.numel() * ys.element_size()

    def _from_c(self, address: int, n: int) -> int:
        # An exception cannot cross into C: keep it for the caller (`ExpertExchangeError` is raised from it).
        try:
            if n:
                self.combine(torch.frombuffer((ctypes.c_float * n).from_address(address), dtype=torch.float32))
            return 0
        except BaseException as e:  # noqa: BLE001 (a KeyboardInterrupt too: C must stop, Python re-raises it)
            self.failure = e
            return 1


@contextmanager
def exchange_errors(exchange: SlotExchange | None) -> Iterator[None]:
    """Around a C call that may run `exchange`: its `ExpertExchangeError` (C gets only a status) raised again from
    the exception the exchange caught (the collective's own error: a timeout, a peer gone)."""
    try:
        yield
    except ExpertExchangeError as e:
        cause = exchange.failure if exchange is not None else None
        if exchange is not None:
            exchange.failure = None
        raise e from cause
