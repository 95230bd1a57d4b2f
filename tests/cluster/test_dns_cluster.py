"""`pdspark serve router` given only DNS names (`--prefill-dns`/`--decode-dns`), as a Helm chart's router is: the
workers run as processes on their own loopback addresses, the names resolve through `PDSPARK_HOSTS_FILE` (the
resolver's test/dev hook), and a completion comes back equal to the offline engine's."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

from cluster import start_worker
from pdspark import LLM, SamplingParams
from pdspark.service_process import start_service

MODEL = "dsv4-tiny"
ENGINE = ["--max-model-len", "256", "--max-num-seqs", "4"]
PROMPT = "def fibonacci(n):"
MAX_TOKENS = 8


def test_a_router_that_knows_only_dns_names_serves(tmp_path):
    t0 = time.monotonic()
    prefill = start_worker("prefill", MODEL, *ENGINE, "--host", "127.0.0.2", "--advertise-host", "127.0.0.2")
    decode = start_worker("decode", MODEL, *ENGINE, "--host", "127.0.0.3", "--advertise-host", "127.0.0.3")
    router = None
    try:
        assert prefill.address.startswith("127.0.0.2:") and decode.address.startswith("127.0.0.3:")
        hosts = tmp_path / "hosts"
        hosts.write_text("127.0.0.2 pf.test\n127.0.0.3 dc.test\n")
        pf_port, dc_port = prefill.address.rsplit(":", 1)[1], decode.address.rsplit(":", 1)[1]
        router = start_service("router", ["serve", "router", "--model", MODEL, "--port", "0", "--grpc-port", "0",
                                          "--prefill-dns", f"pf.test:{pf_port}", "--decode-dns",
                                          f"dc.test:{dc_port}", "--dns-interval-s", "0.5"],
                               timeout=60, env={"PDSPARK_HOSTS_FILE": str(hosts)})
        body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
                           "ignore_eos": True}).encode()
        deadline = time.monotonic() + 30
        while True:  # until discovery has admitted both and the health checks passed
            request = urllib.request.Request(router.info["http"] + "/v1/completions", body,
                                             {"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=30) as r:
                    answer = json.load(r)
                break
            except urllib.error.HTTPError as e:
                assert e.code == 503 and time.monotonic() < deadline, e.read()
                time.sleep(0.1)
        with urllib.request.urlopen(router.info["http"] + "/workers", timeout=10) as r:
            workers = {w["address"]: w["role"] for w in json.load(r)}
        assert workers == {prefill.address: "prefill", decode.address: "decode"}
        assert time.monotonic() - t0 < 40, "workers, router and a completion within 40 s"
    finally:
        for service in (router, decode, prefill):
            if service is not None:
                service.stop()
    offline = LLM(MODEL, max_model_len=256).generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))[0].text
    assert answer["choices"][0]["text"] == offline
