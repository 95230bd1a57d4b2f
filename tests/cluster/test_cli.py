"""`pdspark generate` as a user runs it: a real process."""

from __future__ import annotations

import subprocess
import sys

from conftest import MIXED
from pdspark.testing.time_scale import scaled


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdspark.cli", *args], capture_output=True, text=True,
                          timeout=scaled(120))


def test_generate_from_token_ids(checkpoints):
    path, _ = checkpoints(MIXED, tokenizer=False)
    proc = run_cli("generate", "--model", str(path), "--prompt-ids", "5,6,7,8", "--max-tokens", "6", "--ignore-eos")
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.split()) == 6
    assert "loading weights" in proc.stderr and "6 tokens" in proc.stderr


def test_generate_from_text(checkpoints):
    path, _ = checkpoints(MIXED)
    proc = run_cli("generate", "--model", str(path), "def fib(n):", "--max-tokens", "4", "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("def fib(n):")


def test_bad_model_path_is_a_clear_error(tmp_path):
    proc = run_cli("generate", "--model", str(tmp_path), "hi")
    assert proc.returncode == 2
    assert "no config.json" in proc.stderr
