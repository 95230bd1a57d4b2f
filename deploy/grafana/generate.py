"""Generate pdspark's Grafana dashboards (deploy/grafana/dashboards/*.json) with grafana-foundation-sdk.

    python deploy/grafana/generate.py           # write the JSON
    python deploy/grafana/generate.py --check   # exit 1 when the committed JSON differs (tests/unit/test_dashboards.py)

Three dashboards: overview (requests, errors, latency, admission, tokens/s), P/D transfer (bytes, latency, writes,
failures, its share of TTFT) and speculation and cache (DSpark acceptance, prefix cache, pools). Every panel query is
executed against a real Prometheus scraping a live cluster in tests/cluster/test_observability.py, so a renamed
metric fails a test instead of drawing an empty panel.

NOTE: template variables `model`, `role` and `instance` are the labels the router's HTTP service discovery
(`GET /prometheus/targets`) attaches to every target. Router series have role="router" and instance="router", so
router panels filter by `model` only (a `role` of prefill would otherwise empty them); worker panels filter by all
three.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard, prometheus, stat, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableRefresh, VariableSort

OUT = Path(__file__).resolve().parent / "dashboards"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
RATE = "$__rate_interval"
R = 'model=~"$model"'  # router series
W = 'model=~"$model", role=~"$role", instance=~"$instance"'  # worker series
# Server-side failures; client-caused outcomes, cancellations and backpressure are not (as in the alert rules).
FAILED = R + ', outcome!~"ok|invalid|invalid_request|cancelled|overloaded"'


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True)
class PanelSpec:
    title: str
    unit: str
    queries: tuple[Query, ...]
    description: str = ""
    kind: str = "timeseries"  # or "stat"
    width: int = 8


def rate(metric: str, sel: str, by: str = "") -> str:
    group = f" by ({by}) " if by else ""
    return f"sum{group}(rate({metric}{{{sel}}}[{RATE}]))"


def quantiles(histogram: str, sel: str, by: str = "") -> tuple[Query, ...]:
    """p50/p90/p99 of a histogram (`by` adds grouping labels, e.g. instance)."""
    keys = f"{by}, le" if by else "le"
    prefix = f"{{{{{by}}}}} " if by else ""
    return tuple(Query(f"histogram_quantile({q}, sum by ({keys}) (rate({histogram}_bucket{{{sel}}}[{RATE}])))",
                       f"{prefix}p{round(q * 100)}") for q in (0.5, 0.9, 0.99))


def mean(histogram: str, sel: str) -> str:
    return f"{rate(histogram + '_sum', sel)} / {rate(histogram + '_count', sel)}"


OVERVIEW = [
    PanelSpec("Request rate by API", "reqps", (Query(rate("pdspark_router_requests_total", R, "api"), "{{api}}"),)),
    PanelSpec("Requests by outcome", "reqps", (
        Query(rate("pdspark_router_requests_total", R, "outcome"), "{{outcome}}"),)),
    PanelSpec("Error ratio", "percentunit", (Query(
        f"{rate('pdspark_router_requests_total', FAILED)} / {rate('pdspark_router_requests_total', R)}",
        "server-side failures"),),
        "Share of requests ending in a server-side failure (PdsparkHighErrorRate fires over 5% for 5 minutes)"),
    PanelSpec("Time to first token", "s", quantiles("pdspark_router_time_to_first_token_seconds", R),
              "Arrival to first token at the router, queueing included (PdsparkTTFTSLOBreach: p90 over 2 s)"),
    PanelSpec("Inter-token latency", "s", quantiles("pdspark_router_inter_token_latency_seconds", R)),
    PanelSpec("End-to-end latency", "s", quantiles("pdspark_router_request_seconds", R)),
    PanelSpec("Admission: in flight and queued", "short", (
        Query(f"sum(pdspark_router_requests_in_flight{{{R}}})", "in flight"),
        Query(f"sum(pdspark_router_requests_queued{{{R}}})", "queued"),
        Query(f"sum(pdspark_router_max_in_flight_requests{{{R}}})", "slots"))),
    PanelSpec("Queue time", "s", quantiles("pdspark_router_queue_time_seconds", R)[::2]),
    PanelSpec("Backpressure (429) by reason", "reqps", (
        Query(rate("pdspark_router_rejected_requests_total", R, "reason"), "{{reason}}"),)),
    PanelSpec("Tokens/s", "short", (
        Query(rate("pdspark_router_completion_tokens_total", R), "to clients"),
        Query(rate("pdspark_router_prompt_tokens_total", R), "prompt"),
        Query(rate("pdspark_engine_generated_tokens_total", W, "instance"), "sampled {{instance}}"))),
    PanelSpec("Engine requests", "short", (
        Query(f"sum by (instance) (pdspark_engine_running_requests{{{W}}})", "running {{instance}}"),
        Query(f"sum by (instance) (pdspark_engine_waiting_requests{{{W}}})", "waiting {{instance}}"))),
    PanelSpec("Engine step p99", "s", (Query(
        "histogram_quantile(0.99, sum by (instance, le) "
        f"(rate(pdspark_engine_step_seconds_bucket{{{W}}}[{RATE}])))", "{{instance}}"),)),
    PanelSpec("Step time per rank p99", "s", (Query(
        "histogram_quantile(0.99, sum by (instance, rank, le) "
        f"(rate(pdspark_worker_rank_step_seconds_bucket{{{W}}}[{RATE}])))", "{{instance}} rank {{rank}}"),),
        "Each rank of each worker's group (--ep-size; one-process workers: rank 0), the waits in its collectives "
        "included: a rank far from the others holds the whole group back"),
    PanelSpec("Collective share of each rank's time", "percentunit", (Query(
        f"{rate('pdspark_worker_rank_collective_seconds_sum', W, 'instance, rank')} / "
        f"{rate('pdspark_worker_rank_step_seconds_sum', W, 'instance, rank')}", "{{instance}} rank {{rank}}"),),
        "Fraction of each rank's step time in its MoE exchanges' collectives, the wait for the slowest rank "
        "included; 0 for one-process workers"),
    PanelSpec("Ranks per worker", "short", (
        Query(f"sum by (instance) (pdspark_worker_group_ranks{{{W}}})", "{{instance}} ranks"),
        Query(f"sum by (instance) (pdspark_worker_rank_up{{{W}}})", "{{instance}} running")),
        "Rank processes of each worker's engine (--ep-size; 1: one process), and how many run (a group whose rank "
        "exits fails as a unit and restarts)", kind="stat"),
    PanelSpec("Workers by health", "short", (
        Query(f"sum by (worker_role, healthy) (pdspark_router_workers{{{R}}})",
              "{{worker_role}} healthy={{healthy}}"),),
        "The router's view (PdsparkWorkerUnhealthy)"),
    PanelSpec("Retries and migrations", "reqps", (
        Query(rate("pdspark_router_retries_total", R), "retries"),
        Query(rate("pdspark_router_migrations_total", R), "migrations"))),
    PanelSpec("Targets up", "short", (Query(f'up{{job="pdspark", {W}}}', "{{instance}}"),),
              "Prometheus's scrape of every target the router lists (PdsparkTargetDown)", kind="stat"),
]

TRANSFER = [
    PanelSpec("Transfer bytes/s by payload kind", "Bps", (
        Query(rate("pdspark_transfer_payload_bytes_total", W, "kind"), "{{kind}}"),)),
    PanelSpec("Transfers/s", "ops", (Query(rate("pdspark_transfer_seconds_count", W, "instance"), "{{instance}}"),),
              "Cache transfers that succeeded, by prefill worker"),
    PanelSpec("Transfer latency", "s", quantiles("pdspark_transfer_seconds", W)),
    PanelSpec("Bytes per transfer", "bytes", (
        *quantiles("pdspark_transfer_bytes", W)[::2], Query(mean("pdspark_transfer_bytes", W), "mean"))),
    PanelSpec("Writes per transfer", "short", (
        Query(f"{rate('pdspark_transfer_writes_total', W, 'instance')}"
              f" / {rate('pdspark_transfer_seconds_count', W, 'instance')}", "{{instance}}"),),
        "Writes issued per cache transfer (contiguous runs merged)"),
    PanelSpec("Writes/s by payload kind", "ops", (
        Query(rate("pdspark_transfer_writes_total", W, "kind"), "{{kind}}"),)),
    PanelSpec("Transfer failures by reason", "ops", (
        Query(rate("pdspark_transfer_failures_total", W, "role, reason"), "{{role}} {{reason}}"),),
        "Prefill: the error code; decode: checksum (PdsparkTransferFailures)"),
    PanelSpec("Transfer share of TTFT", "percentunit", (Query(
        f"({mean('pdspark_transfer_seconds', W)}) / ({mean('pdspark_router_time_to_first_token_seconds', R)})",
        "transfer / TTFT (means)"),),
        "Mean seconds writing a transfer over mean time to first token"),
    PanelSpec("TTFT breakdown (means)", "s", (
        Query(mean("pdspark_router_queue_time_seconds", R), "router queue"),
        Query(mean("pdspark_prefill_seconds", W), "prefill"),
        Query(mean("pdspark_prefill_plan_wait_seconds", W), "plan wait"),
        Query(mean("pdspark_transfer_seconds", W), "transfer"),
        Query(mean("pdspark_router_time_to_first_token_seconds", R), "TTFT"))),
    PanelSpec("Plan wait", "s", quantiles("pdspark_prefill_plan_wait_seconds", W)[::2],
              "Seconds a transfer waited for the decode worker's reservation of pages"),
    PanelSpec("Transfers in flight", "short", (
        Query(f"sum by (instance) (pdspark_worker_transfers_in_flight{{{W}}})", "{{instance}}"),
        Query(f"sum by (instance) (pdspark_decode_waiting_for_pages_requests{{{W}}})",
              "waiting for pages {{instance}}"),
        Query(f"sum by (instance) (pdspark_prefill_stuck_transfers{{{W}}})", "stuck {{instance}}")),
        "Stuck: transfers given up on whose transfer thread is still blocked by a peer that does not answer "
        "(PdsparkStuckTransfers)"),
    PanelSpec("Worker requests by outcome", "reqps", (
        Query(rate("pdspark_worker_requests_total", W, "instance, outcome"), "{{instance}} {{outcome}}"),)),
    PanelSpec("Routing decisions per worker", "ops", (
        Query(rate("pdspark_router_worker_selected_total", R, "worker"), "{{worker}}"),)),
]

SPEC_CACHE = [
    PanelSpec("Mean acceptance length", "short", (
        Query(f"1 + {rate('pdspark_spec_accepted_tokens_total', W, 'instance')}"
              f" / {rate('pdspark_spec_verify_steps_total', W, 'instance')}", "{{instance}}"),
        Query(f"pdspark_spec_mean_acceptance_length_tokens{{{W}}}", "{{instance}} since start")),
        "Tokens committed per verify step (PdsparkAcceptanceCollapse)"),
    PanelSpec("Acceptance by draft position", "percentunit", (
        Query(f"{rate('pdspark_spec_accepted_tokens_total', W, 'position')}"
              f" / {rate('pdspark_spec_draft_tokens_total', W, 'position')}", "position {{position}}"),),
        "Drafts accepted over drafts proposed at each position. A step near max_tokens proposes fewer drafts, so "
        "with short requests of mixed acceptance a later position can read higher than an earlier one"),
    PanelSpec("Verify steps/s and drafts", "ops", (
        Query(rate("pdspark_spec_verify_steps_total", W, "instance"), "verify steps {{instance}}"),
        Query(rate("pdspark_spec_draft_tokens_total", W), "draft tokens"),
        Query(rate("pdspark_spec_accepted_tokens_total", W), "accepted tokens"))),
    PanelSpec("Prefix-cache hit ratio", "percentunit", (
        Query(f"{rate('pdspark_prefill_prefix_cache_hit_tokens_total', W, 'instance')}"
              f" / {rate('pdspark_prefill_prompt_tokens_total', W, 'instance')}", "{{instance}}"),
        Query(f"pdspark_prefill_prefix_cache_hit_ratio{{{W}}}", "{{instance}} since start"),
        Query(f"{rate('pdspark_router_cached_tokens_total', R)} / {rate('pdspark_router_prompt_tokens_total', R)}",
              "router"))),
    PanelSpec("Prompt tokens/s", "short", (
        Query(rate("pdspark_prefill_prompt_tokens_total", W, "instance"), "prompt {{instance}}"),
        Query(rate("pdspark_prefill_prefix_cache_hit_tokens_total", W, "instance"), "cache hits {{instance}}"))),
    PanelSpec("Pool usage by kind", "percentunit", (
        Query(f"sum by (instance, pool) (pdspark_pool_used_pages{{{W}}})"
              f" / sum by (instance, pool) (pdspark_pool_capacity_pages{{{W}}})", "{{instance}} {{pool}}"),),
        "Pages in use over capacity (prefix-cached pages count as used)"),
    PanelSpec("Pages held, cached and quarantined", "short", (
        Query(f"sum by (instance, pool) (pdspark_pool_used_pages{{{W}}} - pdspark_pool_cached_pages{{{W}}})",
              "held {{instance}} {{pool}}"),
        Query(f"sum by (instance, pool) (pdspark_pool_cached_pages{{{W}}})", "cached {{instance}} {{pool}}"),
        Query(f"sum by (instance) (pdspark_pool_quarantined_pages{{{W}}})", "quarantined {{instance}}")),
        "Held pages no eviction frees (PdsparkPoolNearlyFull); quarantined: of transfers whose prefill worker "
        "did not answer"),
    PanelSpec("State rings and request slots", "percentunit", (
        Query(f"sum by (instance, ring) (pdspark_pool_used_state_rows{{{W}}})"
              f" / sum by (instance, ring) (pdspark_pool_capacity_state_rows{{{W}}})", "{{instance}} {{ring}} rows"),
        Query(f"sum by (instance) (pdspark_pool_used_request_slots{{{W}}})"
              f" / sum by (instance) (pdspark_pool_capacity_request_slots{{{W}}})", "{{instance}} slots"))),
    PanelSpec("Batch size", "short", quantiles("pdspark_engine_batch_requests", W, "instance")[::2]),
    PanelSpec("Engine errors", "short", (
        Query(f"sum by (instance, stage) (increase(pdspark_engine_errors_total{{{W}}}[{RATE}]))",
              "{{instance}} {{stage}}"),)),
]

DASHBOARDS = {
    "pdspark-overview": ("pdspark / Overview", OVERVIEW),
    "pdspark-transfer": ("pdspark / P/D transfer", TRANSFER),
    "pdspark-speculation-cache": ("pdspark / Speculation and cache", SPEC_CACHE),
}


def variable(name: str, query: str) -> dashboard.QueryVariable:
    return (dashboard.QueryVariable(name).label(name).query(query).datasource(DATASOURCE)
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).sort(VariableSort.ALPHABETICAL_ASC)
            .multi(True).include_all(True).all_value(".*"))


def panel(spec: PanelSpec) -> timeseries.Panel | stat.Panel:
    builder = stat.Panel() if spec.kind == "stat" else timeseries.Panel().legend(
        common_builders.VizLegendOptions().show_legend(True).display_mode(common.LegendDisplayMode.LIST)
        .placement(common.LegendPlacement.BOTTOM))
    builder.title(spec.title).unit(spec.unit).datasource(DATASOURCE).span(spec.width).height(8)
    if spec.description:
        builder.description(spec.description)
    for ref, q in zip("ABCDEFGH", spec.queries, strict=False):
        builder.with_target(prometheus.Dataquery().expr(q.expr).legend_format(q.legend).ref_id(ref)
                            .datasource(DATASOURCE))
    return builder


def build(uid: str) -> dict:
    title, specs = DASHBOARDS[uid]
    board = (dashboard.Dashboard(title).uid(uid).tags(["pdspark"]).time("now-30m", "now").refresh("10s")
             .timezone("browser").editable()
             .with_variable(dashboard.DatasourceVariable("datasource").label("Prometheus").type("prometheus"))
             .with_variable(variable("model", 'label_values(up{job="pdspark"}, model)'))
             .with_variable(variable("role", 'label_values(up{job="pdspark", model=~"$model"}, role)'))
             .with_variable(variable("instance",
                                     'label_values(up{job="pdspark", model=~"$model", role=~"$role"}, instance)')))
    for spec in specs:
        board.with_panel(panel(spec))
    return json.loads(json.dumps(board.build(), cls=JSONEncoder))


def render(uid: str) -> str:
    return json.dumps(build(uid), indent=2, sort_keys=True) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="fail when the committed JSON differs")
    args = parser.parse_args()
    stale = []
    OUT.mkdir(parents=True, exist_ok=True)
    for uid in DASHBOARDS:
        path = OUT / f"{uid}.json"
        text = render(uid)
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(path.name)
        else:
            path.write_text(text)
    if stale:
        print(f"stale dashboards (run python deploy/grafana/generate.py): {', '.join(stale)}", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
