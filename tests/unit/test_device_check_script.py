"""`scripts/device_check.sh`: the tests it runs exist, and on a machine without CUDA it stops at once saying so."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import torch

from pdspark.testing.time_scale import scaled

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "device_check.sh"


def test_every_listed_test_file_exists():
    listed = re.findall(r"tests/[\w/]+\.py", SCRIPT.read_text())
    assert "tests/integration/test_model_parity.py" in listed
    assert [p for p in listed if not (ROOT / p).is_file()] == []


def test_stops_on_a_machine_without_cuda(tmp_path):
    if torch.cuda.is_available():  # a GPU machine runs the script itself instead
        return
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out")], capture_output=True, text=True, env=env,
                          timeout=scaled(120))
    assert proc.returncode == 2
    assert "not a usable CUDA machine" in proc.stderr
    why = "a CPU build" if torch.version.cuda is None else "no CUDA device is visible"
    assert why in (tmp_path / "out" / "env.txt").read_text()
