"""The wire code, the SDK and the router import without torch (the router image ships no torch)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdspark.testing.time_scale import scaled

TORCH_FREE = [
    "pdspark",
    "pdspark.client",
    "pdspark.rpc.convert",
    "pdspark.rpc.status",
    "pdspark.rpc.keepalive",
    "pdspark.rpc.tls_credentials",
    "pdspark.rpc.peer_roles",
    "pdspark.rpc.malformed_requests",
    "pdspark.rpc.throwaway_ca",
    "pdspark.rpc.tracing",
    "pdspark.router.router_server",
    "pdspark.router.http_api",
    "pdspark.router.grpc_api",
    "pdspark.transfer.plan",
    "pdspark.transfer.plan_validation",
    "pdspark.config",
    "pdspark.cli",  # `pdspark serve router` (the router image's entrypoint) and the engine-extra check
]


@pytest.mark.parametrize("module", TORCH_FREE)
def test_imports_without_torch(module):
    code = (
        f"import sys, importlib; importlib.import_module({module!r}); "
        "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')); "
        "print(','.join(loaded[:5])); sys.exit(1 if loaded else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=scaled(120))
    assert out.returncode == 0, f"importing {module} loaded torch: {out.stdout.strip()} {out.stderr[-2000:]}"


def test_llm_is_still_reachable_from_the_package():
    out = subprocess.run([sys.executable, "-c", "import pdspark; print(pdspark.LLM.__name__)"],
                         capture_output=True, text=True, timeout=scaled(120))
    assert out.returncode == 0 and out.stdout.strip() == "LLM", out.stderr[-2000:]
