"""The alert rules in deploy/prometheus/rules: `promtool check rules` accepts them, and their unit tests
(`promtool test rules`: each alert firing and not firing) pass. promtool comes from Debian's `prometheus` package,
which `make setup` installs."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml

from pdspark.testing.time_scale import scaled

RULES = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "rules"
ALERTS = {"PdsparkHighErrorRate", "PdsparkTTFTSLOBreach", "PdsparkTransferFailures", "PdsparkStuckTransfers",
          "PdsparkPoolNearlyFull", "PdsparkTargetDown", "PdsparkWorkerUnhealthy", "PdsparkAcceptanceCollapse",
          "PdsparkNoHealthyWorkers", "PdsparkRejectingRequests", "PdsparkITLSLOBreach", "PdsparkQueueSaturated"}
OPERATIONS = RULES.parents[2] / "docs" / "operations.md"


def promtool(*args: str) -> str:
    path = shutil.which("promtool")
    assert path, "promtool is missing: `make setup` installs Debian's `prometheus` package, which has it"
    out = subprocess.run([path, *args], capture_output=True, text=True, timeout=scaled(120))
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout + out.stderr


def rules() -> list[dict]:
    return [r for f in sorted(RULES.glob("*.yml")) for g in yaml.safe_load(f.read_text())["groups"]
            for r in g["rules"]]


def test_promtool_checks_the_rules():
    files = [str(f) for f in sorted(RULES.glob("*.yml"))]
    assert files
    assert f"SUCCESS: {len(rules())} rules found" in promtool("check", "rules", *files)


def test_every_alert_has_for_severity_and_annotations():
    assert {r["alert"] for r in rules()} == ALERTS
    for rule in rules():
        assert rule.get("for") and rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert set(rule["annotations"]) == {"summary", "description", "runbook_url"}, rule["alert"]


def test_every_runbook_url_is_a_section_of_the_operations_guide():
    """`docs/operations.md#<anchor>`: a `####` heading named as the alert (GitHub's anchor: lower case)."""
    headings = {line[5:].strip().lower() for line in OPERATIONS.read_text().splitlines() if line.startswith("#### ")}
    for rule in rules():
        path, anchor = rule["annotations"]["runbook_url"].split("#")
        assert path == "docs/operations.md" and anchor == rule["alert"].lower() and anchor in headings, rule["alert"]


def test_promtool_unit_tests_cover_every_alert_firing_and_not():
    tests = sorted((RULES / "tests").glob("*.yml"))
    firing: set[str] = set()
    quiet: set[str] = set()
    for f in tests:
        for case in yaml.safe_load(f.read_text())["tests"]:
            for check in case.get("alert_rule_test", []):
                (firing if check["exp_alerts"] else quiet).add(check["alertname"])
    assert firing == ALERTS and quiet == ALERTS, (firing, quiet)
    assert "SUCCESS" in promtool("test", "rules", *map(str, tests))
