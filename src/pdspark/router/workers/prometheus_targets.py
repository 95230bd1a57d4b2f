"""`prometheus_targets`: the router's Prometheus HTTP service discovery (`GET /prometheus/targets`).

Prometheus's `http_sd_configs` format: a list of target groups `{"targets": ["host:port"], "labels": {...}}`. One
group per metrics endpoint: the router's own `/metrics` (at its `--advertise-host`, else the address the scraper
reached it by) and each registered worker's (its `metrics_url`, from its load reports; a worker that has not reported
one yet is left out until it has). Every group is labelled `role` (router, prefill, decode), `model` (the served
model) and `instance` (the worker's name; the router's `--instance-name`, `router` by default: a replica's pod name
in the Helm chart), so that series name no address; `__metrics_path__` and `__scheme__` tell Prometheus where on the
target to scrape. The list names worker addresses, so it takes what `GET /workers`
takes (an admin key, see `api_keys`).
"""

from __future__ import annotations

from collections.abc import Iterable
from urllib.parse import urlsplit

from pdspark.router.workers.worker_registry import WorkerInfo

ROUTER_INSTANCE = "router"


def prometheus_targets(workers: Iterable[WorkerInfo], model: str, router_address: str,
                       router_scheme: str = "http", router_instance: str = ROUTER_INSTANCE) -> list[dict]:
    """The target groups of the router (reached at `router_address`, host:port) and of `workers`.

    Args:
        model: the served model's name (the `model` label of every group).
        router_address: where the scraper reaches this router (its advertised address, else the `Host` called).
        router_scheme: `http` or `https`, as the scraper reached it.
        router_instance: this router's `instance` label (`--instance-name`: each replica its own).
    """
    groups = [_group(router_address, "router", model, router_instance, router_scheme, "/metrics")]
    for w in workers:
        if not w.metrics_url:
            continue
        url = urlsplit(w.metrics_url)
        groups.append(_group(url.netloc, w.role, model, w.name, url.scheme or "http", url.path or "/metrics"))
    return groups


def _group(target: str, role: str, model: str, instance: str, scheme: str, path: str) -> dict:
    return {"targets": [target], "labels": {"role": role, "model": model, "instance": instance,
                                           "__scheme__": scheme, "__metrics_path__": path}}
