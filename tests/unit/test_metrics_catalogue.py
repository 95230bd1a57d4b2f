"""The metrics catalogue: the table in docs/operations.md is what the live registries export (drift fails, like the
proto check), every metric follows the naming rules, and `promtool check metrics` (Debian's `prometheus` package,
installed by `make setup`) finds nothing in any exporter's exposition."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from pdspark.testing.script_module import load_script
from pdspark.testing.time_scale import scaled

ROOT = Path(__file__).resolve().parents[2]
catalogue = load_script(ROOT / "scripts" / "metrics_catalogue.py")


def test_catalogue_table_is_current():
    text = (ROOT / "docs" / "operations.md").read_text()
    assert catalogue.doc_with_table(text) == text, (
        "docs/operations.md's metrics catalogue is stale: run `python scripts/metrics_catalogue.py --write`")


def test_naming_rules():
    for row, exporters in catalogue.catalogue():
        assert row.name.startswith("pdspark_") and ":" not in row.name, row.name
        assert row.name.endswith("_total") == (row.type == "counter"), row.name
        if "router" in exporters:
            assert row.name.startswith("pdspark_router_") and exporters == ("router",), row.name
        assert row.help and row.help[0].isupper(), row.name
        if row.type == "histogram":
            assert row.name.endswith(("_seconds", "_bytes", "_requests")), f"{row.name}: a unit last"


def test_no_metric_label_is_one_prometheus_gives_the_target():
    """`role`, `model` and `instance` come from the router's service discovery (`job` from the scrape config): a
    metric's own label of that name would be renamed `exported_<name>` at the scrape."""
    for row, _ in catalogue.catalogue():
        assert not {"role", "model", "instance", "job"} & set(row.labels), row.name


def test_the_catalogue_has_what_the_issue_asks_for():
    names = {row.name for row, _ in catalogue.catalogue()}
    wanted = {
        # router
        "pdspark_router_requests_total", "pdspark_router_time_to_first_token_seconds",
        "pdspark_router_inter_token_latency_seconds", "pdspark_router_request_seconds",
        "pdspark_router_queue_time_seconds", "pdspark_router_requests_in_flight", "pdspark_router_requests_queued",
        "pdspark_router_retries_total", "pdspark_router_migrations_total", "pdspark_router_worker_selected_total",
        "pdspark_router_rejected_requests_total", "pdspark_router_auth_failures_total",
        # prefill
        "pdspark_prefill_prompt_tokens_total", "pdspark_prefill_seconds",
        "pdspark_prefill_prefix_cache_hit_tokens_total", "pdspark_prefill_prefix_cache_hit_ratio",
        "pdspark_transfer_bytes", "pdspark_transfer_seconds", "pdspark_transfer_payload_bytes_total",
        "pdspark_transfer_writes_total", "pdspark_transfer_failures_total", "pdspark_prefill_stuck_transfers",
        # decode and both
        "pdspark_engine_running_requests", "pdspark_engine_waiting_requests", "pdspark_engine_batch_requests",
        "pdspark_engine_step_seconds", "pdspark_engine_generated_tokens_total", "pdspark_spec_verify_steps_total",
        "pdspark_spec_draft_tokens_total", "pdspark_spec_accepted_tokens_total",
        "pdspark_spec_mean_acceptance_length_tokens",
        # pools
        "pdspark_pool_used_pages", "pdspark_pool_capacity_pages", "pdspark_pool_used_state_rows",
        "pdspark_pool_capacity_state_rows", "pdspark_pool_used_request_slots", "pdspark_pool_capacity_request_slots",
        "pdspark_engine_errors_total",
    }
    assert wanted <= names, sorted(wanted - names)


def promtool_findings(text: bytes) -> str:
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: `make setup` installs Debian's `prometheus` package, which has it"
    out = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, timeout=scaled(60))
    return (out.stdout + out.stderr).decode() + ("" if out.returncode == 0 else f" (exit {out.returncode})")


@pytest.mark.parametrize("exporter", ["router", "prefill", "decode"])
def test_promtool_finds_nothing(exporter):
    registry = catalogue.registries()[exporter]
    assert promtool_findings(generate_latest(registry)) == ""


def test_promtool_does_flag_a_bad_metric():
    """The check above can fail: a gauge named like a counter is a finding."""
    bad = b"# HELP pdspark_x_total A gauge.\n# TYPE pdspark_x_total gauge\npdspark_x_total 1\n"
    assert "_total" in promtool_findings(bad)
