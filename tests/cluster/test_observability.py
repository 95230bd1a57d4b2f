"""Observability end to end: a real Prometheus (Debian's `prometheus` 2.42, started here on a free loopback port and
stopped by PID) finds a `pdspark up` cluster through the router's HTTP service discovery, behind the admin key;
after a little mixed load (streamed and not, chat, a prefix-cache hit, a bad request, a client that drops its
stream) every target is up under its name and the key series of every service are there; `promtool check
metrics` finds nothing on any endpoint. Under a running mixed load, every panel query of every Grafana dashboard
(deploy/grafana/dashboards) returns data, and the alert rules (deploy/prometheus/rules), loaded by the same
Prometheus, all evaluate with health ok."""

from __future__ import annotations

import json
import math
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from cluster_pool import ADMIN_KEY
from pdspark.testing.prometheus_server import PrometheusServer, tool
from pdspark.testing.router_http import drop_a_stream, post
from pdspark.testing.time_scale import scaled
from pdspark.testing.waiting import wait_until

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
SHARED = list(range(10, 58))  # 48 tokens: a second request with this prefix hits 3 cached pages of 16
ROOT = Path(__file__).resolve().parents[2]
RULES = sorted((ROOT / "deploy" / "prometheus" / "rules").glob("*.yml"))
DASHBOARDS = sorted((ROOT / "deploy" / "grafana" / "dashboards").glob("*.json"))
RATE_WINDOW = "30s"  # what the tests put for the panels' $__rate_interval (30 scrapes at 1 s)


@pytest.fixture(scope="module")
def cluster(one_by_one):
    """The shared 1 prefill + 1 decode cluster (pages of 16 tokens)."""
    return one_by_one


@pytest.fixture(scope="module")
def prometheus(cluster, tmp_path_factory):
    """One Prometheus for the module's tests, scraping `cluster` from its start on, as prometheus-operator scrapes
    the Helm chart's PodMonitor: the job named after the monitor (`<namespace>/<monitor>`), set back to `pdspark` by
    the chart's relabelling (tests/integration/test_helm_chart.py holds the chart to it), so every rule and panel
    that selects job="pdspark" is tried under that shape."""
    server = PrometheusServer(tmp_path_factory.mktemp("prometheus"), cluster.info["http"], ADMIN_KEY, rules=RULES,
                              job_name="serving/rel-pdspark",
                              relabel_configs=[{"target_label": "job", "replacement": "pdspark"}])
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def get(url: str, headers: dict | None = None, timeout: float = 10):
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout) as r:
        return r.read()


def mixed_load(http: str) -> None:
    completions, chat = "/v1/completions", "/v1/chat/completions"
    assert post(http, completions, {"prompt": SHARED, "max_tokens": 8, "ignore_eos": True}) == 200
    assert post(http, completions, {"prompt": SHARED + [3, 4], "max_tokens": 8, "ignore_eos": True}) == 200  # hit
    assert post(http, completions, {"prompt": "def f(x):", "max_tokens": 12, "stream": True}) == 200
    assert post(http, chat, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}) == 200
    assert post(http, chat, {"messages": [{"role": "user", "content": "a stack"}], "max_tokens": 6,
                             "stream": True}) == 200
    assert post(http, "/generate", {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4}}) == 200
    assert post(http, completions, {"prompt": "x", "temperature": -1}) == 400
    drop_a_stream(http)


def wait_all_up(prometheus: PrometheusServer, model: str) -> None:
    seen: list = []

    def all_up() -> bool:
        active = prometheus.api("targets", state="active")["activeTargets"]
        seen[:] = [(t["labels"], t["health"], t["lastError"]) for t in active]
        want = {("router", "router", "up"), ("prefill", "prefill-0", "up"), ("decode", "decode-1", "up")}
        return ({(t["labels"].get("role"), t["labels"].get("instance"), t["health"]) for t in active} == want
                and all(t["labels"]["model"] == model for t in active))

    try:
        wait_until(all_up, 20, "every target up under its name", interval_s=0.25)
    except AssertionError as e:
        raise AssertionError(f"{e}; the targets: {seen}; prometheus: "
                             f"{prometheus.tail(3000)}") from None


# Series every service has once the load above ran (a query that returns nothing fails): (PromQL, what it shows).
KEY_SERIES = [
    ('pdspark_router_requests_total{outcome="ok"} > 0', "served requests"),
    ('pdspark_router_requests_total{outcome="invalid"} > 0', "the bad request"),
    ('pdspark_router_requests_total{api="completions",outcome="cancelled"} > 0', "the dropped stream"),
    ("pdspark_router_inter_token_latency_seconds_count > 0", "inter-token latency"),
    ("pdspark_router_time_to_first_token_seconds_count > 0", "TTFT"),
    ('pdspark_router_worker_selected_total{worker_role="decode",worker="decode-1"} > 0', "routing by worker name"),
    ('pdspark_router_rejected_requests_total{reason="queue_full"}', "a 429 series before any 429"),
    ('pdspark_prefill_prompt_tokens_total{role="prefill",instance="prefill-0"} > 0', "prompt tokens"),
    ('pdspark_prefill_prefix_cache_hit_tokens_total{role="prefill"} > 0', "the prefix-cache hit"),
    ('pdspark_transfer_bytes_count{role="prefill"} > 0', "transfers, on the prefill side"),
    ('pdspark_transfer_writes_total{kind="swa_kv"} > 0', "writes by payload kind"),
    ('pdspark_transfer_failures_total{role="decode",reason="checksum"}', "the decode side's check, at 0"),
    ('pdspark_prefill_stuck_transfers{role="prefill"} == 0', "no transfer thread held by a stuck write"),
    ('pdspark_engine_step_seconds_count{role="decode",instance="decode-1"} > 0', "decode steps"),
    ('pdspark_engine_batch_requests_count{role="prefill"} > 0', "prefill steps"),
    ('pdspark_engine_generated_tokens_total{role="decode"} > 0', "tokens/s"),
    ('pdspark_spec_verify_steps_total{role="decode"} > 0', "DSpark verify steps"),
    ('pdspark_spec_draft_tokens_total{position="1"} > 0', "drafts by position"),
    ('pdspark_spec_accepted_tokens_total{position="3"}', "acceptance by position (a series per position)"),
    ('pdspark_worker_requests_total{role="decode",outcome="ok"} > 0', "worker outcomes"),
    ('pdspark_pool_capacity_pages{pool="c4"} > 0', "pool sizes"),
    ('pdspark_pool_capacity_state_rows{ring="c128"} > 0', "state rings"),
    ('pdspark_engine_errors_total{stage="step"} == 0', "no engine error"),
]


def test_prometheus_discovers_and_scrapes_every_service(cluster, prometheus):
    t0 = time.monotonic()
    http = cluster.info["http"]
    # `pdspark up` told its user how to scrape it.
    assert any("http_sd_configs" in line for line in cluster.errors), cluster.errors[-20:]
    assert any(f"url: {http}/prometheus/targets" in line for line in cluster.errors)
    mixed_load(http)

    wait_all_up(prometheus, cluster.info["model"])
    for promql, what in KEY_SERIES:
        wait_until(lambda q=promql: prometheus.query(q), 15, f"{what}: {promql}", interval_s=0.25)
    # Nothing Prometheus scraped is down, no series names an address, and no metric's own label clashed with
    # a target label (Prometheus would have renamed it `exported_...`).
    assert [r["value"][1] for r in prometheus.query("up")] == ["1"] * 3
    instances = {r["metric"].get("instance") for r in prometheus.query('{job="pdspark"}')}
    assert instances == {"router", "prefill-0", "decode-1"}
    for label in ("role", "model", "instance", "job"):
        assert prometheus.query(f'{{exported_{label}=~".+"}}') == [], label
    print(f"\nprometheus: every target up and {len(KEY_SERIES)} key series in {time.monotonic() - t0:.1f} s")


def test_promtool_finds_nothing_on_any_endpoint(cluster):
    http = cluster.info["http"]
    # The router learns each worker's metrics URL from its load reports (every second).
    workers = wait_until(lambda: (ws := json.loads(get(http + "/workers", ADMIN))) and all(w["metrics_url"] for w in ws)
                         and ws, 10, "the workers' metrics URLs", interval_s=0.25)
    urls = [http + "/metrics", *(w["metrics_url"] for w in workers)]
    assert len(urls) == 3, workers
    for url in urls:
        out = subprocess.run([tool("promtool"), "check", "metrics"], input=get(url), capture_output=True,
                             timeout=scaled(60))
        assert out.returncode == 0 and not (out.stdout + out.stderr).strip(), (url, out.stdout + out.stderr)


def panel_queries(model: str) -> list[tuple[str, str, str]]:
    """(dashboard, panel title, PromQL) of every panel query, the template variables substituted: `model` by the
    cluster's, `role` and `instance` by `.*` (Grafana's "All"), `$__rate_interval` by RATE_WINDOW."""
    subs = {"$__rate_interval": RATE_WINDOW, "$model": model, "$role": ".*", "$instance": ".*"}
    out = []
    for path in DASHBOARDS:
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel["targets"]:
                expr = target["expr"]
                for var, value in subs.items():
                    expr = expr.replace(var, value)
                assert "$" not in expr, expr
                out.append((path.stem, panel["title"], expr))
    return out


def has_data(result: list[dict]) -> bool:
    """A result with at least one sample that is a number (a quantile or ratio of no events is NaN)."""
    return any(not math.isnan(float(r["value"][1])) for r in result)


class BackgroundLoad:
    """`mixed_load` over and over on a thread, so every rate window the queries look at holds requests."""

    def __init__(self, http: str):
        self.stop_event = threading.Event()
        self.rounds = 0
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(http,), daemon=True)
        self.thread.start()

    def _run(self, http: str) -> None:
        try:
            while not self.stop_event.is_set():
                mixed_load(http)
                self.rounds += 1
        except BaseException as e:  # noqa: BLE001 (reported by stop)
            self.error = e

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join(timeout=scaled(60))
        assert self.error is None, f"the load failed: {self.error!r}"


def test_every_dashboard_query_returns_data_and_every_rule_is_ok(cluster, prometheus):
    t0 = time.monotonic()
    http, model = cluster.info["http"], cluster.info["model"]
    queries = panel_queries(model)
    assert len(queries) >= 24 and RULES
    load = None
    try:
        wait_all_up(prometheus, model)
        load = BackgroundLoad(http)
        empty: list = []

        def all_have_data() -> bool:
            empty[:] = [q for q in queries if not has_data(prometheus.query(q[2]))]
            return not empty and load.rounds >= 2

        try:
            wait_until(all_have_data, 40, "every panel query returns data", interval_s=0.25)
        except AssertionError as e:
            raise AssertionError(f"{e}; {len(empty)} of {len(queries)} without data: "
                                 + "\n".join(f"{d} / {t}: {q}" for d, t, q in empty)) from None
        rules: list = []

        def all_rules_ok() -> bool:
            rules[:] = [r for g in prometheus.api("rules")["groups"] for r in g["rules"]]
            return bool(rules) and all(r["health"] == "ok" for r in rules)

        wait_until(all_rules_ok, 15, "every alert rule evaluates with health ok", interval_s=0.25)
        loaded = {r["name"] for r in rules}
        assert {"PdsparkHighErrorRate", "PdsparkAcceptanceCollapse", "PdsparkTargetDown"} <= loaded, loaded
        assert not [r for r in rules if r.get("lastError")], rules
        firing = [a["labels"]["alertname"] for r in rules for a in r.get("alerts", []) if a["state"] == "firing"]
        assert "PdsparkTargetDown" not in firing and "PdsparkWorkerUnhealthy" not in firing, firing
    finally:
        if load is not None:
            load.stop()
    print(f"\nprometheus: {len(queries)} panel queries of {len(DASHBOARDS)} dashboards return data, {len(rules)} "
          f"rules ok, {load.rounds} load rounds, in {time.monotonic() - t0:.1f} s")
