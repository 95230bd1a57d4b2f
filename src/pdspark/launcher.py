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
from pdspark.model.model_config import ModelConfig
from pdspark.service_process import ServiceProcess, spawn_service, start_service, wait_ready


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def launch(args) -> int:
    path = resolve_model(args.model)
    has_draft = "dspark" in ModelConfig.from_dir(path).raw
    worker_flags = ["--model", args.model, "--port", "0", "--metrics-port", "0"] + args.engine_flags
    if has_draft and not args.no_speculative:
        worker_flags += ["--speculative", "dspark"]
    services: list[ServiceProcess] = []
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        t0 = time.monotonic()
        roles = ["prefill"] * args.prefill + ["decode"] * args.decode
        _log(f"pdspark up: starting {args.prefill} prefill + {args.decode} decode worker(s) on {args.model} "
             f"(speculative: {'dspark' if has_draft and not args.no_speculative else 'off'})")

        # Spawn every worker from this thread (children die with the thread that made them), wait in parallel.
        for i, role in enumerate(roles):
            extra = ["--no-prefix-cache"] if role == "decode" else []
            services.append(spawn_service(f"{role}-{i}", ["serve", role, *worker_flags, *extra]))

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
        router = start_service("router", ["serve", "router", "--model", args.model, "--host", args.host,
                                          "--port", str(args.port), "--grpc-port", str(args.grpc_port),
                                          "--prefill", ",".join(prefill), "--decode", ",".join(decode)])
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


def add_up_arguments(parser) -> None:
    from pdspark.config import add_engine_arguments

    parser.add_argument("--model", default="dsv4-tiny")
    parser.add_argument("--prefill", type=int, default=1, help="prefill workers")
    parser.add_argument("--decode", type=int, default=1, help="decode workers")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="router HTTP port")
    parser.add_argument("--grpc-port", type=int, default=50050, help="router gRPC port")
    parser.add_argument("--no-speculative", action="store_true", help="decode without DSpark")
    engine = parser.add_argument_group("engine options passed to every worker")
    add_engine_arguments(engine)


def engine_flags(args) -> list[str]:
    """The engine options the user set, as worker command-line flags."""
    from pdspark.config import ENGINE_FLAGS

    flags = []
    for name, (_, default, _) in ENGINE_FLAGS.items():
        value = getattr(args, name)
        if value is not None and value != default and name not in ("speculative",):
            flags += ["--" + name.replace("_", "-"), str(value)]
    if args.no_prefix_cache:
        flags.append("--no-prefix-cache")
    return flags
