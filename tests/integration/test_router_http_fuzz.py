"""schemathesis against the router's HTTP API, from its own `/openapi.json`: the documented examples, boundary
values of every field (the coverage phase) and generated bodies, valid and not (the fuzzing phase). No request may
get a 5xx, a body the schema forbids must be refused with a 4xx, and every response must match what the document
says (status, content type, error body). Workers are faked, but every request crosses the worker's protobuf
message, so a value the wire cannot carry fails as it would in a cluster.

Twice: on an open router, and on one with API keys, called with a key (the key check must not change what a valid
caller gets, nor turn bad input into a server error). Each run generates well over 200 cases over every documented
route (about 1,900).

Deterministic (`--generation-deterministic`: the same cases every run) and bounded (`--max-examples`), about 15 s
a run on 2 cores. `/openapi.json` itself is not among the tested operations (schemathesis skips the document it
reads).
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from pdspark.testing.time_scale import scaled
from router_app import RouterApp

CHECKS = [
    "not_a_server_error",
    "negative_data_rejection",
    "status_code_conformance",
    "content_type_conformance",
    "response_schema_conformance",
    "response_headers_conformance",
    "unsupported_method",
    "allow_header_conformance",
]
# NOTE: not `positive_data_acceptance`: a body the schema allows may still be refused for the served model (a
# prompt plus `max_tokens` over its context, a token id over its vocabulary, another model's name).


KEY = "k-fuzz-0123456789abcdef"
MIN_CASES = 200


@pytest.fixture(params=["open", "keyed"])
def app(request):
    """(the router app, schemathesis's extra arguments)."""
    keyed = request.param == "keyed"
    r = RouterApp(api_key=(KEY,)) if keyed else RouterApp()
    yield r, (["-H", f"Authorization: Bearer {KEY}"] if keyed else [])
    r.close()


def test_schemathesis_finds_no_server_error_and_no_schema_violation(app, tmp_path):
    app, extra = app
    cmd = [sys.executable, "-m", "schemathesis.cli", "run", app.url + "/openapi.json", *extra,
           "--checks", ",".join(CHECKS), "--phases", "examples,coverage,fuzzing", "--max-examples", "30",
           "--generation-deterministic", "--workers", "1", "--suppress-health-check", "all", "--no-color",
           "--request-timeout", str(scaled(10))]
    # In a fresh directory: schemathesis keeps a cache of past failures (`.schemathesis/`) where it runs, and would
    # replay them first; every run starts from nothing instead.
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=scaled(300), cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-8000:] + out.stderr[-2000:]
    # (every documented route but /openapi.json: the OpenAI routes, /generate, the tokenizer's, /health, /live,
    # /metrics)
    assert "No issues found" in out.stdout and "Tested: 10" in out.stdout, out.stdout[-3000:]
    generated = re.search(r"(\d+) generated", out.stdout)
    assert generated is not None and int(generated.group(1)) >= MIN_CASES, out.stdout[-3000:]
