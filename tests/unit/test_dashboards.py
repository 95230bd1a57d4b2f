"""The Grafana dashboards in deploy/grafana/dashboards are what deploy/grafana/generate.py produces today (drift
fails, like the proto check), they carry the template variables the router's service discovery labels, and every
metric their queries name is in the metrics catalogue of docs/operations.md (a renamed metric fails here before it
empties a panel; tests/cluster/test_observability.py runs every query against a live cluster)."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BOARDS = ROOT / "deploy" / "grafana" / "dashboards"


def generator():
    spec = importlib.util.spec_from_file_location("generate_dashboards", ROOT / "deploy" / "grafana" / "generate.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def committed() -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(BOARDS.glob("*.json"))}


def test_committed_dashboards_are_current():
    gen = generator()
    assert sorted(gen.DASHBOARDS) == sorted(committed())
    for uid in gen.DASHBOARDS:
        assert gen.render(uid) == (BOARDS / f"{uid}.json").read_text(), \
            f"{uid}.json is stale: run `python deploy/grafana/generate.py`"


def test_variables_and_queries():
    exprs = []
    for uid, board in committed().items():
        assert board["uid"] == uid
        names = [v["name"] for v in board["templating"]["list"]]
        assert names == ["datasource", "model", "role", "instance"], uid
        for panel in board["panels"]:
            assert panel["targets"], panel["title"]
            exprs += [t["expr"] for t in panel["targets"]]
    assert len(exprs) >= 24
    catalogue = set(re.findall(r"^\| `(pdspark_[a-z0-9_]+)`", (ROOT / "docs" / "operations.md").read_text(), re.M))
    used = {re.sub(r"_(bucket|sum|count)$", "", m) for e in exprs for m in re.findall(r"pdspark_[a-z0-9_]+", e)}
    assert used - catalogue == set(), "dashboards name metrics the catalogue lacks"
