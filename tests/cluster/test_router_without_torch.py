"""The core package without the `engine` extra (as the router image installs it): `pdspark serve router` starts and
serves completions through stub workers in a process where torch, numpy, safetensors and Mooncake cannot be
imported, and the commands that load a model stop with an error naming `pip install 'pdspark[engine]'`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from pdspark.launch.service_process import spawn_process, wait_ready
from pdspark.testing.time_scale import scaled

ROOT = Path(__file__).resolve().parents[2]
TOKENS = 3
# Every import of these fails in the child (`sys.modules[name] = None`), as if the extra were not installed.
NO_ENGINE = ("import sys\n"
             "for name in ('torch', 'numpy', 'safetensors', 'mooncake'):\n"
             "    sys.modules[name] = None\n")


def child_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT / "src"), "PYTHONUNBUFFERED": "1"}


def test_the_router_serves_without_the_engine_extra():
    stubs = spawn_process("stubs", [sys.executable, str(ROOT / "bench" / "stub_workers.py"), "--tokens",
                                    str(TOKENS)], child_env())
    router = None
    try:
        wait_ready(stubs, scaled(60))
        router = wait_ready(spawn_process("router", [
            sys.executable, "-c", NO_ENGINE + "from pdspark.cli import main\nsys.exit(main(sys.argv[1:]))",
            "serve", "router", "--port", "0", "--grpc-port", "0",
            "--prefill", stubs.info["prefill"], "--decode", stubs.info["decode"]], child_env()), scaled(60))
        with urllib.request.urlopen(router.info["http"] + "/health", timeout=scaled(10)) as r:
            assert r.status == 200
        body = json.dumps({"model": "dsv4-tiny", "prompt": "def fibonacci(n):", "max_tokens": TOKENS}).encode()
        deadline = time.monotonic() + scaled(30)
        while True:  # 503 until the first health checks of the stubs passed
            request = urllib.request.Request(router.info["http"] + "/v1/completions", body,
                                             {"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=scaled(10)) as r:
                    answer = json.load(r)
                break
            except urllib.error.HTTPError as e:
                assert e.code == 503 and time.monotonic() < deadline, e.read()
                time.sleep(0.1)
        # The prompt went through the router's tokenizer; the stub decode's tokens came back as text.
        assert answer["usage"]["completion_tokens"] == TOKENS and answer["choices"][0]["text"].count(";") == TOKENS
        assert router.alive, router.tail()
    finally:
        for service in (router, stubs):
            if service is not None:
                service.stop()


def test_model_commands_name_the_missing_extra():
    code = NO_ENGINE + (
        "import contextlib, io, json\n"
        "from pdspark.cli import main\n"
        "for argv in (['serve', 'prefill'], ['serve', 'decode'], ['generate', '--model', 'dsv4-tiny', 'hi'], ['up']):\n"
        "    err = io.StringIO()\n"
        "    with contextlib.redirect_stderr(err):\n"
        "        rc = main(argv)\n"
        "    print(json.dumps([' '.join(argv), rc, err.getvalue()]))\n"
        "try:\n"
        "    from pdspark import LLM\n"
        "except ImportError as e:\n"
        "    print(json.dumps(['LLM', 2, str(e)]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=scaled(120),
                         env=child_env())
    assert out.returncode == 0, out.stderr[-2000:]
    results = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r[0] for r in results] == ["serve prefill", "serve decode", "generate --model dsv4-tiny hi", "up", "LLM"]
    for what, rc, error in results:
        assert rc == 2 and "pip install 'pdspark[engine]'" in error and "torch" in error, (what, error)
        assert "Traceback" not in error, (what, error)
    assert "`pdspark serve decode`" in results[1][2]
