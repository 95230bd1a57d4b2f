"""The cluster tier's shared clusters: a few `pdspark up` shapes, each booted once per session by the first test that
asks for it and stopped after the last one, instead of one boot per module (fixtures and hooks registered by
tests/conftest.py).

- `one_by_one`: 1 prefill + 1 decode on the draft checkpoint (DSpark on), room for a 2,000-token stream, an admin key;
  its router is a group of 2 processes (`--router-processes 2`), so the router's cluster tests
  (`test_router_cluster.py`, `test_observability.py`) run through one; the other shapes' routers are single processes.
- `dsv4_tiny`: the shipped model with `pdspark up`'s defaults (the engine a user gets).
- `keys_tls`: 1 prefill + 1 decode of the shipped model with an API key (`API_KEY`), the admin key, the session's
  key file (`key_file`: `KEY_FILE_TEXT`) and `--tls` (a throwaway CA, its path in the ready event's `ca`): the
  security and TLS tests (`test_security.py`, `test_tls.py`). A test that rewrites the key file puts its text back
  (and has it read again) before it ends.
- `faults`: 2 prefill + 3 decode on the draft checkpoint, restarted within a second, quarantines freed within
  seconds: the failure matrix (`test_chaos.py`) and the tests that need several workers of a role. Tests that kill
  or stop its processes run after its other tests (`KILLS`), so those see it as booted.

A shape's arguments name the session's files by placeholder: `{draft}` the draft checkpoint, `{key_file}` the API
key file (`ClusterPool.files`).

Every shape's tests leave it as they found it: every worker healthy and holding nothing (the fault tests wait for
that before and after each case). A cluster that does not stop cleanly (exit code 0 on SIGTERM), or whose throwaway
CA (`--tls`) outlives it, fails the session.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from pdspark.launch.service_process import ServiceProcess, start_service
from pdspark.testing.time_scale import scaled

# Worker administration (/workers, the admin's `meta_info`) needs the admin key on every shared shape; generation stays
# open (no API key) except on `keys_tls`, where it needs `API_KEY` or a key of the key file.
ADMIN_KEY = "admin-key-of-the-cluster-tier"
API_KEY = "k-client-0123456789abcdef"
FILE_KEY = "k-rotated-0123456789abcdef-old"  # the key file's one key, as the session starts
KEY_FILE_TEXT = f"# the file's keys join --api-key's\n{FILE_KEY}\n"
# Threads: shared 2-core machines; the children inherit the launcher's environment.
QUIET_THREADS = {"OMP_NUM_THREADS": "1"}
BOOT_TIMEOUT_S = scaled(240)  # a boot loads 3-6 processes' models; more is a hung start


@dataclass(frozen=True)
class Shape:
    """One `pdspark up` command line: `args` after `up` (`{draft}`: the draft checkpoint's path; `{key_file}`: the
    session's API key file) and the environment its services inherit."""

    args: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)


# The fault shape's quarantines: pages of a stopped or killed prefill worker come back once no write of its can land,
# the plan's deadline (the router's transfer timeout) + the transfer engine's timeout. Both short: a case waits for it.
FAULT_TRANSFER_TIMEOUT_S = 5
FAULT_MC_TIMEOUT_S = 3

SHAPES = {
    "one_by_one": Shape(("--model", "{draft}", "--page-size", "16", "--max-model-len", "2048", "--max-num-seqs", "8",
                         "--router-processes", "2"),
                        {"PDSPARK_ADMIN_API_KEY": ADMIN_KEY, **QUIET_THREADS}),
    "dsv4_tiny": Shape(()),
    "keys_tls": Shape(("--model", "dsv4-tiny", "--max-model-len", "256", "--max-num-seqs", "4",
                       "--api-key", API_KEY, "--admin-api-key", ADMIN_KEY, "--api-key-file", "{key_file}", "--tls"),
                      QUIET_THREADS),
    "faults": Shape(("--model", "{draft}", "--prefill", "2", "--decode", "3", "--page-size", "16",
                     "--max-model-len", "256", "--max-num-seqs", "8",
                     # A killed service is back within seconds (same ports); the others serve meanwhile.
                     "--restart-backoff-s", "0.5", "--max-restart-backoff-s", "1",
                     "--transfer-timeout", str(FAULT_TRANSFER_TIMEOUT_S)),
                    {"PDSPARK_ADMIN_API_KEY": ADMIN_KEY, "MC_TRANSFER_TIMEOUT": str(FAULT_MC_TIMEOUT_S),
                     **QUIET_THREADS}),
}
# Fixture name -> shape: a test that uses the fixture (directly or through another fixture) uses the shape.
FIXTURES = {"one_by_one": "one_by_one", "dsv4_tiny_cluster": "dsv4_tiny", "keys_tls": "keys_tls", "faults": "faults"}
KILLS = "kills"  # the marker of tests that kill or stop processes of a shared cluster


class ClusterPool:
    """Shared clusters by shape name, booted on first use. `files`: the session's files a shape's arguments name,
    by placeholder ("draft" fills `{draft}`); `key_file`: the API key file (tests that rotate keys rewrite it)."""

    def __init__(self, draft: Path, key_file: Path):
        self.key_file = key_file
        self.files = {"draft": str(draft), "key_file": str(key_file)}
        self.running: dict[str, ServiceProcess] = {}
        self.failures: list[str] = []

    def get(self, name: str) -> ServiceProcess:
        if name not in self.running:
            shape = SHAPES[name]
            args = list(shape.args)
            for placeholder, path in self.files.items():
                args = [a.replace(f"{{{placeholder}}}", path) for a in args]
            self.running[name] = start_service(f"pdspark up ({name})", ["up", "--port", "0", "--grpc-port", "0",
                                                                         *args],
                                               timeout=BOOT_TIMEOUT_S, env=shape.env)
        return self.running[name]

    def release(self, name: str) -> None:
        """Stop the shape's cluster (its last test is over); a failure is reported at the session's end."""
        service = self.running.pop(name, None)
        if service is None:
            return
        ca = service.info.get("ca")
        if (code := service.stop()) != 0:
            self.failures.append(f"{name}: `pdspark up` ended with {code}:\n{service.tail()}")
        if ca and Path(ca).parent.exists():
            self.failures.append(f"{name}: the throwaway CA {Path(ca).parent} outlived its cluster")

    def close(self) -> None:
        for name in list(self.running):
            self.release(name)


POOL = pytest.StashKey[ClusterPool]()
LAST_USER = pytest.StashKey[dict[str, str]]()


@pytest.fixture(scope="session")
def cluster_pool(request, draft_ckpt, tmp_path_factory) -> Iterator[ClusterPool]:
    key_file = tmp_path_factory.mktemp("keys") / "api-keys"
    key_file.write_text(KEY_FILE_TEXT)
    key_file.chmod(0o600)
    pool = ClusterPool(draft_ckpt, key_file)
    request.config.stash[POOL] = pool
    yield pool
    pool.close()
    assert not pool.failures, "\n".join(pool.failures)


@pytest.fixture(scope="session")
def one_by_one(cluster_pool) -> ServiceProcess:
    return cluster_pool.get("one_by_one")


@pytest.fixture(scope="session")
def dsv4_tiny_cluster(cluster_pool) -> ServiceProcess:
    return cluster_pool.get("dsv4_tiny")


@pytest.fixture(scope="session")
def keys_tls(cluster_pool) -> ServiceProcess:
    return cluster_pool.get("keys_tls")


@pytest.fixture(scope="session")
def faults(cluster_pool) -> ServiceProcess:
    return cluster_pool.get("faults")


@pytest.fixture(scope="session")
def admin_headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {ADMIN_KEY}"}


def _shapes_of(item) -> set[str]:
    return {shape for fixture, shape in FIXTURES.items() if fixture in getattr(item, "fixturenames", ())}


def _folder(item) -> str:
    """The test's folder under tests/ (its tier): "cluster" for tests/cluster/test_chaos.py::..."""
    parts = item.nodeid.split("/")
    return parts[1] if len(parts) > 2 else ""


def order_and_plan_releases(config, items) -> None:
    """Within a tier, the tests of each shape run together (after the tests that use none, shapes in `SHAPES`
    order), those that kill processes of its cluster last; each shape is stopped after its last test (`LAST_USER`).
    An idle cluster's health checks and load reports cost CPU: no cluster stays up beside tests that do not use it.
    A stable sort: tests otherwise keep their order, tiers keep theirs."""
    tiers = {tier: n for n, tier in enumerate(dict.fromkeys(map(_folder, items)))}
    rank = {shape: n + 1 for n, shape in enumerate(SHAPES)}

    def key(item) -> tuple[int, int, bool]:
        shapes = _shapes_of(item)
        return (tiers[_folder(item)], min((rank[s] for s in shapes), default=0),
                item.get_closest_marker(KILLS) is not None)

    items.sort(key=key)
    config.stash[LAST_USER] = {shape: item.nodeid for item in items for shape in _shapes_of(item)}


def release_after_last_user(item) -> None:
    pool = item.config.stash.get(POOL, None)
    if pool is None:
        return
    for shape, nodeid in item.config.stash.get(LAST_USER, {}).items():
        if nodeid == item.nodeid:
            pool.release(shape)
