"""A worker's load as it reports it (`GetLoad`), and the one definition of a worker holding nothing: no request
running, waiting or queued, no transfer in flight, no page beyond the prefix cache's."""

from __future__ import annotations

from typing import NamedTuple, Protocol

import grpc

from pdspark.testing.time_scale import scaled
from pdspark.testing.waiting import wait_until
from pdspark.v1 import worker_pb2, worker_pb2_grpc


class Worker(Protocol):
    @property
    def role(self) -> str: ...  # "prefill" or "decode"

    @property
    def address(self) -> str: ...  # host:port of its gRPC service


class WorkerAt(NamedTuple):
    """A worker known by its role and address only (e.g. one a router lists)."""

    role: str
    address: str


def load_of(worker: Worker, timeout_s: float = 5.0) -> worker_pb2.LoadReport:
    """The worker's `GetLoad` answer, within `timeout_s` (scaled)."""
    stub = worker_pb2_grpc.PrefillWorkerStub if worker.role == "prefill" else worker_pb2_grpc.DecodeWorkerStub
    with grpc.insecure_channel(worker.address) as channel:
        return stub(channel).GetLoad(worker_pb2.LoadRequest(), timeout=scaled(timeout_s))


def pages_held(report: worker_pb2.LoadReport) -> dict[str, int]:
    """Pages in use beyond the prefix cache's, per pool (all zero: back to the free counts)."""
    return {pool: report.pages_used[pool] - report.pages_cached[pool] for pool in report.pages_used}


def what_is_held(report: worker_pb2.LoadReport) -> str:
    """"" when the report shows nothing held, else what is."""
    parts = [f"{n} {what}" for what in ("running", "waiting", "queued", "transfers_in_flight", "quarantined_slots")
             if (n := getattr(report, what))]
    parts += [f"{pool}: {n} pages beyond the prefix cache's" for pool, n in pages_held(report).items() if n]
    return ", ".join(parts)


def is_idle(worker: Worker) -> bool:
    return not what_is_held(load_of(worker))


def assert_idle(*workers: Worker, within_s: float) -> None:
    """Every one of `workers` holds nothing within `within_s` (scaled): requests that ended, however they ended,
    give back their pages, slots and transfers. The failure names what each worker still holds."""
    def held() -> str:
        return "; ".join(f"{w.role} worker {w.address}: {h}" for w in workers if (h := what_is_held(load_of(w))))

    wait_until(lambda: not held(), within_s, "every worker holds nothing", describe=lambda: f"(still held: {held()})")
