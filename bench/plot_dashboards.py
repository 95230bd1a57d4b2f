"""A preview of pdspark's Grafana dashboards without Grafana (it cannot run on these machines): start `pdspark up`
and Debian's `prometheus` (discovering the cluster through the router's HTTP SD, loading the alert rules), run a
mixed load that ramps up, then run every panel query of deploy/grafana/dashboards/*.json over the run with
`query_range` and draw each dashboard's panels as one grid of matplotlib plots, in the dashboard's panel order:
bench/results/dashboard_<uid>.png, and bench/results/dashboards.json (series and points per query; the queries that
returned nothing).

The template variables are Grafana's "All" (`.*`) and `$__rate_interval` is --rate-window. Both services are
children of this script, on free loopback ports, stopped by PID at the end and on errors.

    python bench/plot_dashboards.py [--model dsv4-tiny] [--duration 90] [--clients 4] [--rate-window 15s]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import tempfile
import threading
import time
from pathlib import Path

from pdspark.launch.service_process import ServiceProcess, start_service
from pdspark.testing.prometheus_server import PrometheusServer
from pdspark.testing.router_http import drop_a_stream, post

from console import log
from report import RESULTS, write_json

ROOT = Path(__file__).resolve().parents[1]
RULES = sorted((ROOT / "deploy" / "prometheus" / "rules").glob("*.yml"))  # the alert rules the dashboards show
DASHBOARDS = sorted((ROOT / "deploy" / "grafana" / "dashboards").glob("*.json"))
SHARED = list(range(10, 170))  # a shared 160-token prefix (2.5 pages of 64): later requests hit the prefix cache



def one_round(http: str, i: int) -> None:
    """Streamed and not, chat, a prefix-cache hit, a bad request and (every fourth round) a dropped stream; greedy
    and sampled (temperature 1, the API's default: the draft's acceptance is lower)."""
    completions, chat = "/v1/completions", "/v1/chat/completions"
    send = functools.partial(post, http, timeout=120)  # generous: the machine is loaded on purpose
    send(completions, {"prompt": SHARED + [i % 200 + 2], "max_tokens": 16, "ignore_eos": True})
    send(completions, {"prompt": "def fibonacci(n):", "max_tokens": 48, "stream": True, "temperature": 0})
    send(chat, {"messages": [{"role": "user", "content": f"a stack {i}"}], "max_tokens": 24, "stream": True})
    send(chat, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 12})
    send(completions, {"prompt": "x", "temperature": -1})
    if i % 4 == 0:
        drop_a_stream(http, timeout=60)


def run_load(http: str, clients: int, duration_s: float) -> int:
    """`clients` threads, started one after another over the first half of the run (a ramp); returns rounds."""
    deadline = time.monotonic() + duration_s
    rounds = [0] * clients

    def client(k: int) -> None:
        time.sleep(k * duration_s / (2 * clients))
        while time.monotonic() < deadline:
            one_round(http, rounds[k] * clients + k)
            rounds[k] += 1

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(rounds)


def substitute(expr: str, rate_window: str) -> str:
    for var, value in (("$__rate_interval", rate_window), ("$model", ".*"), ("$role", ".*"), ("$instance", ".*")):
        expr = expr.replace(var, value)
    return expr


def legend(fmt: str, labels: dict) -> str:
    for key, value in labels.items():
        fmt = fmt.replace("{{" + key + "}}", value)
    return fmt


def plot_dashboard(board: dict, series: list[list[list[tuple[str, list[float], list[float]]]]], t0: float) -> Path:
    """One grid: a plot per panel, a line per series of each of its queries."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = board["panels"]
    ncols = 3
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(15, 3.1 * nrows), squeeze=False)
    for ax, panel, per_query in zip(axes.flat, panels, series, strict=False):
        for lines in per_query:
            # NOTE: at most 8 series a query, the highest peaks first (Grafana would draw them all).
            peak = [max((y for y in ys if not math.isnan(y)), default=0.0) for _, _, ys in lines]
            for _, (name, xs, ys) in sorted(zip(peak, lines, strict=True), key=lambda pl: -pl[0])[:8]:
                ax.plot([x - t0 for x in xs], ys, label=name, linewidth=1.2)
        unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
        ax.set_title(f"{panel['title']} [{unit}]" if unit else panel["title"], fontsize=9)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6, loc="upper left")
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="red")
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    fig.suptitle(f"{board['title']} (matplotlib preview from a real Prometheus; x: seconds into the run)",
                 fontsize=11)
    fig.tight_layout()
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"dashboard_{board['uid']}.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="dsv4-tiny")
    parser.add_argument("--duration", type=float, default=90.0, help="seconds of load")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--rate-window", default="15s", help="what $__rate_interval becomes")
    parser.add_argument("--step", default="2", help="query_range step, seconds")
    args = parser.parse_args()
    cluster: ServiceProcess | None = None
    prometheus: PrometheusServer | None = None
    with tempfile.TemporaryDirectory(prefix="pdspark-dashboards-") as tmp:
        try:
            cluster = start_service("pdspark up", ["up", "--model", args.model, "--port", "0", "--grpc-port", "0"],
                                    timeout=240)
            http = cluster.info["http"]
            prometheus = PrometheusServer(Path(tmp), http, rules=RULES)
            prometheus.wait_ready()
            log(f"cluster at {http}, prometheus at {prometheus.url}; {args.duration:.0f} s of load")
            time.sleep(3)  # a few scrapes of the idle cluster first
            t0 = time.time()
            rounds = run_load(http, args.clients, args.duration)
            time.sleep(5)
            t1 = time.time()
            log(f"{rounds} load rounds; querying")
            summary: dict = {"args": vars(args), "rounds": rounds, "dashboards": {}}
            for path in DASHBOARDS:
                board = json.loads(path.read_text())
                per_panel = []
                record: dict[str, list] = {"queries": [], "no_data": []}
                summary["dashboards"][board["uid"]] = record
                for panel in board["panels"]:
                    per_query = []
                    for target in panel["targets"]:
                        expr = substitute(target["expr"], args.rate_window)
                        result = prometheus.api("query_range", query=expr, start=t0 - 3, end=t1, step=args.step)
                        lines = [(legend(target.get("legendFormat", ""), r["metric"]),
                                  [float(t) for t, _ in r["values"]], [float(v) for _, v in r["values"]])
                                 for r in result["result"]]
                        per_query.append(lines)
                        points = sum(sum(not math.isnan(y) for y in ys) for _, _, ys in lines)
                        record["queries"].append({"panel": panel["title"], "expr": expr, "series": len(lines),
                                                  "points": points})
                        if not points:
                            record["no_data"].append(f"{panel['title']}: {expr}")
                    per_panel.append(per_query)
                log(f"plot: {plot_dashboard(board, per_panel, t0)}")
            write_json("dashboards", summary)
            empty = [q for d in summary["dashboards"].values() for q in d["no_data"]]
            log(f"queries without data: {len(empty)}" + "".join(f"\n  {q}" for q in empty))
            return 0
        finally:
            if prometheus is not None:
                prometheus.stop()
            if cluster is not None:
                cluster.stop()


if __name__ == "__main__":
    sys.exit(main())
