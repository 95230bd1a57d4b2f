"""`pdspark up`: a local cluster (router + prefill and decode workers) as child processes, in one command.

Starts the workers (in parallel), waits for each with a progress line, starts the router on them, prints the
endpoints with ready-to-paste examples, and shuts everything down on Ctrl-C / SIGTERM (or as soon as any service
dies), leaving no child behind.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from pdspark.assets import resolve_model
from pdspark.config import RouterConfig, UpConfig, WorkerConfig
from pdspark.model.model_config import ModelConfig
from pdspark.options import replace_options, to_argv
from pdspark.service_process import ServiceProcess, spawn_service, start_service, wait_ready


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def worker_configs(cfg: UpConfig, has_draft: bool) -> dict[str, WorkerConfig]:
    """What each role's workers run: the user's engine options, DSpark when the checkpoint has a draft (unless
    `--no-speculative`), and no prefix cache on decode (every prompt's cache arrives there by transfer, so a
    prefix cache would only hold memory)."""
    engine = replace_options(cfg.engine, speculative="dspark" if has_draft and cfg.speculative else None)
    return {
        "prefill": WorkerConfig(role="prefill", model=cfg.model, port=0, metrics_port=0, engine=engine),
        "decode": WorkerConfig(role="decode", model=cfg.model, port=0, metrics_port=0,
                               engine=replace_options(engine, enable_prefix_cache=False)),
    }


def router_config(cfg: UpConfig, prefill: list[str], decode: list[str]) -> RouterConfig:
    # The router admits what the workers serve: the same max_model_len (None on both sides resolves the same way).
    return RouterConfig(model=cfg.model, host=cfg.host, port=cfg.port, grpc_port=cfg.grpc_port, prefill=tuple(prefill),
                        decode=tuple(decode), max_model_len=cfg.engine.scheduler.max_model_len)


def launch(cfg: UpConfig) -> int:
    has_draft = "dspark" in ModelConfig.from_dir(resolve_model(cfg.model)).raw
    workers = worker_configs(cfg, has_draft)
    services: list[ServiceProcess] = []
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        t0 = time.monotonic()
        roles = ["prefill"] * cfg.prefill + ["decode"] * cfg.decode
        _log(f"pdspark up: starting {cfg.prefill} prefill + {cfg.decode} decode worker(s) on {cfg.model} "
             f"(speculative: {workers['decode'].engine.speculative or 'off'})")

        # Spawn every worker from this thread (children die with the thread that made them), wait in parallel.
        # Children get every option as a flag, so their config is this one whatever their environment says.
        for i, role in enumerate(roles):
            services.append(spawn_service(f"{role}-{i}", ["serve", role, *to_argv(workers[role])]))

        def ready(s: ServiceProcess) -> ServiceProcess:
            wait_ready(s)
            _log(f"  [{time.monotonic() - t0:5.1f}s] {s.name} worker ready at {s.address} "
                 f"(metrics :{s.info['metrics_port']})")
            return s

        with ThreadPoolExecutor(max_workers=len(services)) as pool:
            try:
                list(pool.map(ready, services))
            except RuntimeError as e:
                _log(f"pdspark up: a worker failed to start: {e}")
                return 1
        prefill = [s.address for s in services if s.name.startswith("prefill")]
        decode = [s.address for s in services if s.name.startswith("decode")]
        router = start_service("router", ["serve", "router", *to_argv(router_config(cfg, prefill, decode))])
        services.append(router)
        _log(f"  [{time.monotonic() - t0:5.1f}s] router ready")
        _print_endpoints(router.info)
        while not stop.wait(0.5):
            dead = [s for s in services if not s.alive]
            if dead:
                _log(f"pdspark up: {dead[0].name} exited; shutting down\n{dead[0].tail(20)}")
                return 1
        return 0
    finally:
        _log("pdspark up: stopping all services...")
        for s in reversed(services):
            s.stop()
        _log("pdspark up: stopped")


def _print_endpoints(info: dict) -> None:
    http, grpc_addr, model = info["http"], info["grpc"], info["model"]
    print(json.dumps({"event": "ready", "http": http, "grpc": grpc_addr, "model": model}), flush=True)
    print(f"""
pdspark cluster is up.
  OpenAI HTTP : {http}/v1   (also {http}/generate, /health, /metrics, /workers)
  gRPC        : {grpc_addr}   (pdspark.v1.Router)

Try it:
  curl {http}/v1/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{model}", "prompt": "def fibonacci(n):", "max_tokens": 48, "temperature": 0}}'

  python -c "from openai import OpenAI; c = OpenAI(base_url='{http}/v1', api_key='none'); \\
print(c.completions.create(model='{model}', prompt='import os', max_tokens=32).choices[0].text)"

  python -c "from pdspark.client import Client; \\
print(Client('{grpc_addr}').generate('def fibonacci(n):', max_tokens=48, temperature=0).text)"

Press Ctrl-C to stop.
""", flush=True)
