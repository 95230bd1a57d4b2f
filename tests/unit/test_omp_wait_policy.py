"""`omp_wait_policy`: `import pdspark` makes torch's OpenMP threads sleep after their parallel regions unless the
user chose otherwise, and an engine in a process that loaded torch first says how to fix it."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from pdspark import omp_wait_policy


def test_importing_pdspark_first_sets_passive_before_libgomp_reads_it():
    code = ("import os, pdspark, torch; from pdspark import omp_wait_policy as w; "
            "print(os.environ.get('OMP_WAIT_POLICY'), w.outcome)")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", omp_wait_policy.OPT_OUT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["PASSIVE", "set"]


@pytest.mark.parametrize(("env", "torch_loaded", "want", "value"), [
    ({}, False, "set", "PASSIVE"),
    ({"OMP_WAIT_POLICY": "ACTIVE"}, False, "user", "ACTIVE"),
    ({"PDSPARK_OMP_WAIT_POLICY": "default"}, False, "opted-out", None),
    ({}, True, "late", None),
])
def test_apply_respects_the_user_and_never_pretends_after_torch_loaded(monkeypatch, env, torch_loaded, want, value):
    for key in ("OMP_WAIT_POLICY", omp_wait_policy.OPT_OUT):
        monkeypatch.delenv(key, raising=False)
    for key, v in env.items():
        monkeypatch.setenv(key, v)
    if torch_loaded:
        monkeypatch.setitem(sys.modules, "torch", sys.modules.get("torch", object()))
    else:
        monkeypatch.delitem(sys.modules, "torch", raising=False)
    monkeypatch.setattr(omp_wait_policy, "outcome", "unapplied")
    assert omp_wait_policy.apply() == want
    assert os.environ.get("OMP_WAIT_POLICY") == value


def test_an_engine_after_a_late_import_warns_once(monkeypatch, caplog):
    monkeypatch.setattr(omp_wait_policy, "outcome", "late")
    with caplog.at_level(logging.WARNING, logger=omp_wait_policy.__name__):
        omp_wait_policy.check()
        omp_wait_policy.check()
    warnings = [r for r in caplog.records if "OMP_WAIT_POLICY=PASSIVE" in r.getMessage()]
    assert len(warnings) == 1
