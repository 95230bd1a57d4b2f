"""`address_problem`: a worker's address given at run time is host:port (a DNS name, an IPv4 address or an IPv6
address in brackets; a port in [1, 65535]), and a refusal names the field and the expected form."""

from __future__ import annotations

import pytest

from pdspark.router.workers.worker_address import EXPECTED, address_problem


@pytest.mark.parametrize("address", [
    "127.0.0.1:5", "[::1]:5", "worker-0.svc:50051", "localhost:65535", "prefill-0.pd.default.svc.cluster.local.:1",
    "[fe80::1%eth0]:50051", "10.0.0.7:1", ".".join(["a"] * 127) + ":5",  # a name of 253 characters, the most
])
def test_host_port_is_accepted(address):
    assert address_problem(address) is None


@pytest.mark.parametrize("address", [
    "nohost", "h:0", "h:99999", "h:x", "h:", ":5", "h:+5", "h:-1", "h:５",  # a port of other digits than ASCII
    "[::1]", "[::1:5", "[nothex]:5", "::1:5",  # IPv6 without brackets
    "999.1.1.1:5", "1.2.3:5",  # numbers only, but no IPv4 address
    "-a:5", "a-:5", "a_b:5", "a..b:5", "a b:5", "http://h:5", "h/x:5", "",
    "a" * 64 + ".b:5", ".".join(["a"] * 128) + ":5",  # a label of 64 characters, a name of 255
])
def test_anything_else_is_refused_naming_the_field_and_the_form(address):
    problem = address_problem(address)
    assert problem is not None and problem.startswith("`address` must be ") and EXPECTED in problem
    if "::" in address and "[" not in address:
        assert "IPv6 address goes in brackets" in problem


def test_a_long_address_is_shown_cut():
    problem = address_problem("x" * 10_000)
    assert problem is not None and len(problem) < 300
