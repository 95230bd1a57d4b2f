"""Shared fixtures: random tiny DSV4 checkpoints written by transformers, built once per test session."""

from __future__ import annotations

import inspect
import os
import subprocess
from pathlib import Path

import pytest
import torch

import cluster_pool as pool
from cluster_pool import (  # noqa: F401 (fixtures)
    admin_headers,
    cluster_pool,
    dsv4_tiny_cluster,
    faults,
    keys_tls,
    one_by_one,
)
from hf_reference import CSA, HCA, SLIDING, TinySpec, save_hf_checkpoint, write_byte_tokenizer
from pdspark.config import EngineConfig
from pdspark.testing.offline_reference import OfflineReference
from pdspark.testing.random_draft import add_random_draft
from pdspark.testing.script_module import load_script
from pdspark.testing.time_scale import scaled

# Tests measure behaviour, not speed: one intra-op thread keeps runs steady on shared 2-core machines.
torch.set_num_threads(int(os.environ.get("PDSPARK_TEST_THREADS", "1")))

MIXED = TinySpec()  # SWA, CSA, HCA, CSA; hc_mult 2; one hash-MoE layer; YaRN on compressed layers
HC4 = TinySpec(layer_types=(CSA, HCA, SLIDING, HCA), hc_mult=4, hash_layers=2, yarn=False, seed=1)
TIED = TinySpec(layer_types=(HCA, SLIDING, CSA), hash_layers=0, tie_word_embeddings=True, seed=3)
SPARSE = TinySpec(index_topk=4, seed=2)  # the indexer keeps fewer entries than are visible


class CheckpointFactory:
    def __init__(self, root):
        self.root = root
        self._cache: dict[TinySpec, tuple] = {}

    def __call__(self, spec: TinySpec, tokenizer: bool = True):
        key = (spec, tokenizer)
        if key not in self._cache:
            path = self.root / f"ckpt{len(self._cache)}"
            model = save_hf_checkpoint(spec, path)
            if tokenizer:
                write_byte_tokenizer(path)
            self._cache[key] = (path, model)
        return self._cache[key]


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> CheckpointFactory:
    """`checkpoints(spec) -> (path, transformers model)`."""
    return CheckpointFactory(tmp_path_factory.mktemp("checkpoints"))


@pytest.fixture(scope="session")
def draft_ckpt(checkpoints, tmp_path_factory):
    """The MIXED checkpoint with a random 3-token DSpark draft beside it (P/D, router and cluster tests)."""
    path, _ = checkpoints(MIXED)
    dst = tmp_path_factory.mktemp("draft") / "ckpt"
    add_random_draft(path, dst, gamma=3)
    return dst


@pytest.fixture(scope="module", params=["per-request", "multiplexed"])
def worker_calls(request) -> str:
    """How the router calls its workers (`--worker-calls`): a test that takes this runs once with each (module
    scope: a module-scoped fixture of the test's may take it too)."""
    return request.param


def random_prompts(n: int, lengths: list[int], vocab: int = 256, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]


def pytest_addoption(parser):
    parser.addoption("--device", choices=("cpu", "cuda", "npu"), default="cpu",
                     help="run the tests' engines on this device (scripts/device_check.sh); default: cpu")


def pytest_configure(config):
    device = config.getoption("--device")
    if device != "cpu":
        _run_engines_on(device)


def _run_engines_on(device: str) -> None:
    """Every engine the tests build without naming a device runs on `device`: worker processes read
    PDSPARK_DEVICE; in-process engines (`LLM(...)`, `create_engine(...)`) get it as `EngineConfig`'s default.
    NOTE: a test-session switch only: the option's default stays written once, in the field."""
    os.environ["PDSPARK_DEVICE"] = device
    init = EngineConfig.__init__
    names = list(inspect.signature(init).parameters)[1:]  # without self; every field has a default
    defaults = list(init.__defaults__ or ())
    defaults[names.index("device") - (len(names) - len(defaults))] = device
    init.__defaults__ = tuple(defaults)
REPO = Path(__file__).resolve().parents[1]


def _modelslim_generator():
    """scripts/make_modelslim_fixtures.py (stdlib imports only: msmodelslim runs in its own venv)."""
    return load_script(REPO / "scripts" / "make_modelslim_fixtures.py")


@pytest.fixture(scope="session")
def modelslim_dir() -> Path:
    """The msmodelslim-made fixtures (`float/`, `w8a8_dynamic/`, `w8a8/`, `w4a8_dynamic/`; see
    scripts/make_modelslim_fixtures.py): `make setup` makes them; made here when missing (minutes)."""
    gen = _modelslim_generator()
    out = gen.fixture_dir()
    if not (out / gen.DONE).is_file():
        python = REPO / ".venv-modelslim" / "bin" / "python"
        if not python.is_file():
            pytest.fail(f"no ModelSlim fixtures in {out} and no {python.parent.parent}: run `make modelslim-fixtures`")
        subprocess.run([str(python), gen.__file__], check=True, timeout=scaled(1800))
    return out


TIERS = ("unit", "integration", "cluster")  # tests/<tier>/: one layer in-process; components in-process; processes


def pytest_collection_modifyitems(config, items) -> None:
    """Each test is marked with its tier (the folder it lives in): `pytest -m "not cluster"` runs the in-process
    tiers; `make test` runs every tier."""
    for item in items:
        tier = next((t for t in TIERS if f"/tests/{t}/" in str(item.path)), None)
        if tier is not None:
            item.add_marker(tier)
    pool.order_and_plan_releases(config, items)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item) -> None:
    """A shared cluster stops after its last test (`cluster_pool`)."""
    pool.release_after_last_user(item)


@pytest.fixture(scope="session")
def offline_reference() -> OfflineReference:
    """The session's offline engines and their outputs (the equality ladder's bottom), shared by every test."""
    return OfflineReference()
