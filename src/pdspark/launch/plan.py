"""The plan of a `pdspark up` cluster: which services run, with which command line, environment and ports.

Pure data: nothing here starts a process. (With `--tls` the plan does write the certificates of a throwaway CA to
the directory it is given: the command lines name them.)

NOTE: stable addresses. Every port is picked up front (gRPC and metrics per worker; HTTP, gRPC and, when asked for,
admin for the router) and passed explicitly, so a restarted worker answers at the address the router already knows
(its health checks re-admit it) and a restarted router serves on the same endpoints.
NOTE: keys. The router gets its API and admin keys in its environment (`secret_env`), never on its command line,
which every user of the machine can read in `ps`; the workers get those variables blanked.
NOTE: TLS. A throwaway CA issues every service a certificate naming its role; the services get the paths as flags
(`--tls-cert/--tls-key/--tls-ca`; the router also `--ssl-certfile/--ssl-keyfile` for HTTPS and TLS on its gRPC
port); clients trust the CA whose path the plan keeps (`ca_path`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

from pdspark.assets import resolve_model
from pdspark.config import RouterConfig, TLSConfig, UpConfig, WorkerConfig
from pdspark.errors import ConfigError
from pdspark.launch.free_ports import free_ports
from pdspark.model.model_config import ModelConfig
from pdspark.options import replace_options, secret_env, to_argv
from pdspark.rpc.throwaway_ca import ThrowawayCA


@dataclass(frozen=True)
class Service:
    """One service of the cluster, as every run of it starts: `pdspark <argv>` with `env` over the launcher's own."""

    name: str  # "prefill-0", "decode-1", ..., "router"
    role: str  # "prefill", "decode" or "router"
    argv: list[str]  # after `pdspark`: `serve <role> --flag value ...`
    env: dict[str, str]  # what must not be on the command line (keys)
    ranks: int = 1  # rank processes of each run (a worker group, `--ep-size`): each takes the role's resources

    @property
    def is_worker(self) -> bool:
        return self.role != "router"


@dataclass(frozen=True)
class ClusterPlan:
    workers: list[Service]
    router: Service
    speculative: str | None  # what the decode workers speculate with ("dspark"), for the start line
    ca_path: str | None  # with --tls: the CA clients trust

    @property
    def services(self) -> list[Service]:
        return [*self.workers, self.router]


def worker_configs(cfg: UpConfig, has_draft: bool) -> dict[str, WorkerConfig]:
    """What each role's workers run: the user's engine options, DSpark when the checkpoint has a draft (unless
    `--no-speculative`), and no prefix cache on decode (every prompt's cache arrives there by transfer, so a
    prefix cache would only hold memory). Groups: a prefill group runs its batch on every rank (replicated), a
    decode group DP-attention (each rank owns whole requests), whether `--dp-attention` is given or not."""
    engine = replace_options(cfg.engine, speculative="dspark" if has_draft and cfg.speculative else None)
    ep = {role: size if size is not None else cfg.engine.parallel.ep_size
          for role, size in (("prefill", cfg.prefill_ep_size), ("decode", cfg.decode_ep_size))}
    if cfg.engine.parallel.nnodes > 1:
        raise ConfigError(f"`nnodes` is {cfg.engine.parallel.nnodes} for `pdspark up`; allowed: 1 (a local cluster "
                          "runs on this machine: start groups across machines with `pdspark serve --node-rank`)")
    return {
        "prefill": WorkerConfig(role="prefill", model=cfg.model, port=0, metrics_port=0,
                                engine=replace_options(engine, ep_size=ep["prefill"], dp_attention=False),
                                otlp_endpoint=cfg.otlp_endpoint),
        "decode": WorkerConfig(role="decode", model=cfg.model, port=0, metrics_port=0,
                               engine=replace_options(engine, enable_prefix_cache=False, ep_size=ep["decode"],
                                                      dp_attention=ep["decode"] > 1),
                               otlp_endpoint=cfg.otlp_endpoint),
    }


def router_config(cfg: UpConfig, prefill: list[str], decode: list[str]) -> RouterConfig:
    # The router admits what the workers serve: the same max_model_len (None on both sides resolves the same way).
    return RouterConfig(model=cfg.model, host=cfg.host, port=cfg.port, grpc_port=cfg.grpc_port,
                        admin_port=cfg.admin_port, auth=cfg.auth, prefill=tuple(prefill), decode=tuple(decode),
                        max_model_len=cfg.engine.scheduler.max_model_len, otlp_endpoint=cfg.otlp_endpoint,
                        transfer_timeout_s=cfg.transfer_timeout_s, processes=cfg.router_processes)


def plan_cluster(cfg: UpConfig, tls_dir: str | None = None) -> ClusterPlan:
    """The cluster `cfg` asks for. `tls_dir`: with `cfg.tls`, the private directory the certificates go to."""
    assert not cfg.tls or tls_dir is not None, "--tls needs a directory for the certificates"
    ca = ThrowawayCA(tls_dir) if cfg.tls and tls_dir is not None else None
    has_draft = "dspark" in ModelConfig.from_dir(resolve_model(cfg.model)).raw
    base = worker_configs(cfg, has_draft)
    # gRPC and metrics for each worker, none of them a port the user gave the router; the router's other ports are
    # picked apart from them (each set is held only while it is picked).
    chosen = frozenset({cfg.port, cfg.grpc_port, cfg.admin_port or 0} - {0})
    worker_ports = free_ports(base["prefill"].host, 2 * (cfg.prefill + cfg.decode), avoid=chosen)
    workers, addresses = _workers(cfg, base, ca, iter(worker_ports))
    router = _router(cfg, addresses, ca, frozenset(worker_ports))
    return ClusterPlan(workers, router, base["decode"].engine.speculative, ca.ca_path if ca is not None else None)


def _workers(cfg: UpConfig, base: dict[str, WorkerConfig], ca: ThrowawayCA | None,
             ports: Iterator[int]) -> tuple[list[Service], dict[str, list[str]]]:
    """The workers, numbered across roles (prefill-0, prefill-1, decode-2, ...), and their addresses by role."""
    roles = ["prefill"] * cfg.prefill + ["decode"] * cfg.decode
    # The workers need no key: blank any the launcher's own environment holds.
    no_keys = {name: "" for name in secret_env(router_config(cfg, [], []))}
    workers: list[Service] = []
    addresses: dict[str, list[str]] = {"prefill": [], "decode": []}
    for i, role in enumerate(roles):
        name = f"{role}-{i}"
        # Children get every option as a flag, so their config is this one whatever their environment says.
        w = dataclasses.replace(base[role], port=next(ports), metrics_port=next(ports),
                                tls=_tls(ca, name, role, base[role].advertise_host))
        workers.append(Service(name, role, ["serve", role, *to_argv(w)], no_keys, w.engine.parallel.ep_size))
        addresses[role].append(f"{w.advertise_host}:{w.port}")
    return workers, addresses


def _router(cfg: UpConfig, addresses: dict[str, list[str]], ca: ThrowawayCA | None, taken: frozenset[int]) -> Service:
    ports = iter(free_ports(cfg.host, [cfg.port, cfg.grpc_port, cfg.admin_port].count(0), avoid=taken))
    router = dataclasses.replace(router_config(cfg, addresses["prefill"], addresses["decode"]),
                                 port=cfg.port or next(ports), grpc_port=cfg.grpc_port or next(ports),
                                 admin_port=next(ports) if cfg.admin_port == 0 else cfg.admin_port)
    if ca is not None:
        # One certificate for both ends: the router's public ports and its calls to the workers.
        tls = _tls(ca, "router", "router", cfg.host)
        router = dataclasses.replace(router, tls=tls, ssl_certfile=tls.tls_cert, ssl_keyfile=tls.tls_key)
    return Service("router", "router", ["serve", "router", *to_argv(router)], secret_env(router))


def _tls(ca: ThrowawayCA | None, name: str, role: str, host: str) -> TLSConfig:
    if ca is None:
        return TLSConfig()
    issued = ca.issue(name, role, (host,))
    return TLSConfig(tls_cert=issued.cert, tls_key=issued.key, tls_ca=ca.ca_path)
