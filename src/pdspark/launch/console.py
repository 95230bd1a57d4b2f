"""What `pdspark up` prints: a line on stderr per thing that happens, one JSON line on stdout per event (for scripts),
and, once the cluster is up, its endpoints with examples to paste and a Prometheus scrape config.

No output shows a key: with API keys, the examples read `$PDSPARK_API_KEY` from the environment.
"""

from __future__ import annotations

import json
import os
import sys

from pdspark.config import AuthConfig, UpConfig
from pdspark.router.auth.api_keys import is_loopback


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def event(**fields) -> None:
    print(json.dumps(fields), flush=True)


def starting_line(cfg: UpConfig, speculative: str | None) -> str:
    where = f"Ray ({cfg.ray_address or 'local'}) for " if cfg.backend == "ray" else ""
    return (f"pdspark up: starting {where}{cfg.prefill} prefill + {cfg.decode} decode worker(s) on {cfg.model} "
            f"(speculative: {speculative or 'off'})")


def scrape_config(http: str, auth: AuthConfig, host: str) -> str:
    """A Prometheus scrape config for the cluster (human text): HTTP service discovery at the router, which lists
    every metrics endpoint. The list names worker addresses, so it takes an admin key unless the router is a
    development one (no key of either kind, loopback only: see `pdspark.router.auth.api_keys`)."""
    url = f"{http}/prometheus/targets"
    lines = ["Prometheus: the router lists every metrics endpoint (its own and each worker's) at",
             f"  {url}  (HTTP service discovery). A scrape config:",
             "  scrape_configs:",
             "    - job_name: pdspark",
             "      scrape_interval: 15s",
             "      http_sd_configs:",
             f"        - url: {url}",
             "          refresh_interval: 30s"]
    if auth.admin_api_key or auth.admin_api_key_file:
        # NOTE: Prometheus sends a credentials file's whole content: a key file of several lines does not do. And
        # 2.42's HTTP discovery sends no `Bearer` unless `type` says so (the scrape's own default does not apply).
        lines += ["          authorization:  # an admin key: the list names worker addresses",
                  "            type: Bearer",
                  "            credentials_file: /path/to/admin-key  # a file holding one admin key"]
    elif auth.configured or not is_loopback(host):
        lines.append("  (the list needs an admin key on this router: start it with --admin-api-key-file)")
    return "\n".join(lines) + "\n"


def print_endpoints(info: dict, services: dict[str, dict], needs_key: bool, ca: str | None = None) -> None:
    """The `ready` event (every service's pid and address), then the endpoints with examples to paste."""
    http, grpc_addr, model = info["http"], info["grpc"], info["model"]
    # With --admin-port the admin routes are there, and not on the main port.
    admin = (f"  Admin       : {info['admin']}/workers, /prometheus/targets\n" if "admin" in info else "")
    also = "/generate, /health, /metrics" + ("" if admin else ", /workers")
    event(event="ready", http=http, grpc=grpc_addr, model=model, pid=os.getpid(), services=services, ca=ca)
    # With API keys, the examples read the key from the environment: it is never printed.
    auth = " -H \"Authorization: Bearer $PDSPARK_API_KEY\"" if needs_key else ""
    openai_key = "__import__('os').environ['PDSPARK_API_KEY']" if needs_key else "'none'"
    keys = "  API keys    : required (the examples send $PDSPARK_API_KEY; the SDK reads it too)\n" if needs_key else ""
    # With TLS, every example trusts the run's CA (and only it).
    tls = f"  TLS         : every service; clients trust the CA {ca} (removed when the cluster stops)\n" if ca else ""
    cacert = f" --cacert {ca}" if ca else ""
    http_client = (f", http_client=__import__('openai').DefaultHttpxClient(verify=__import__('ssl')"
                   f".create_default_context(cafile='{ca}'))") if ca else ""
    sdk_tls = f", tls=TLSOptions.from_files(ca='{ca}')" if ca else ""
    sdk_import = "Client, TLSOptions" if ca else "Client"
    print(f"""
pdspark cluster is up.
  OpenAI HTTP : {http}/v1   (also {http}{also})
  gRPC        : {grpc_addr}   (pdspark.v1.Router)
{admin}{keys}{tls}
Try it:
  curl{cacert} {http}/v1/completions -H 'Content-Type: application/json'{auth} \\
    -d '{{"model": "{model}", "prompt": "def fibonacci(n):", "max_tokens": 48, "temperature": 0}}'

  python -c "from openai import OpenAI; c = OpenAI(base_url='{http}/v1', api_key={openai_key}{http_client}); \\
print(c.completions.create(model='{model}', prompt='import os', max_tokens=32).choices[0].text)"

  python -c "from pdspark.client import {sdk_import}; \\
print(Client('{grpc_addr}'{sdk_tls}).generate('def fibonacci(n):', max_tokens=48, temperature=0).text)"

Press Ctrl-C to stop. Services that exit are restarted on the same ports.
""", flush=True)
