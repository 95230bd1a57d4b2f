"""The Helm chart runs: rendered by the real helm with ci/local-run-values.yaml (1 router, 1 prefill, 2 decode, API
keys on), every pod started as a local process exactly as rendered (tests/chart_pods.py: the command from its image's
Dockerfile, args, env, volumes; the liberties named there), each on its own loopback address, the headless Services'
names resolving through the router's DNS discovery hosts-file override once the pods pass their readiness probes.
Completions through the router Service's HTTP port equal the offline engine's: a chart whose wiring is wrong
(ports, selectors, env names, discovery names, key files) fails here although it validates. The router starts before
its workers: alive (startup and liveness probes pass) but not ready until they come."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from chart_pods import ROOT, Pod, Rendered, hosts_file_text, pods, service_url
from pdspark import SamplingParams
from pdspark.testing.time_scale import scaled
from pdspark.testing.waiting import wait_until

CHART = ROOT / "deploy" / "helm" / "pdspark"
VALUES = CHART / "ci" / "local-run-values.yaml"
RELEASE, NAMESPACE = "rel", "serving"
FULL = f"{RELEASE}-pdspark"
MODEL = "dsv4-tiny"  # the chart's default model: the shipped checkpoint, no path to map
PROMPTS = ["def fibonacci(n):", "The capital of France is", "import numpy as np\n"]
MAX_TOKENS = 8
STREAMS_OK = 'pdspark_worker_requests_total{outcome="ok"}'
START_S = scaled(90.0)  # every pod ready and the first completion served


def helm_template() -> Rendered:
    helm = Path(sys.executable).parent / "helm"  # `make setup` (helm-tools) fetches it into the venv
    helm_bin = str(helm) if helm.exists() else shutil.which("helm")
    assert helm_bin, "helm is missing: `make setup` (helm-tools) installs it"
    out = subprocess.run([helm_bin, "template", RELEASE, str(CHART), "--namespace", NAMESPACE, "-f", str(VALUES)],
                         capture_output=True, text=True, timeout=scaled(60))
    assert out.returncode == 0, out.stderr
    return Rendered([d for d in yaml.safe_load_all(out.stdout) if d], NAMESPACE)


def post(url: str, body: dict, key: str, timeout: float = 30.0) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(request, timeout=scaled(timeout)) as r:
        return json.load(r)


def complete(url: str, prompt: str, key: str) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    return post(url + "/v1/completions", body, key)["choices"][0]["text"]


def decode_streams_ended(pod: Pod) -> float:
    with urllib.request.urlopen(f"http://{pod.ip}:{pod.port('metrics')}/metrics", timeout=scaled(10)) as r:
        lines = r.read().decode().splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith(STREAMS_OK))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """(rendered, pods, router URL, API key, admin key, the first completion, seconds until it came), stopped at
    the end."""
    t0 = time.monotonic()
    rendered = helm_template()
    work = tmp_path_factory.mktemp("chart")
    hosts = work / "hosts"
    hosts.write_text("")
    # LIBERTY (DNS): the router resolves the headless Services through its discovery's hosts-file override.
    all_pods = pods(rendered, work, extra_env={"router": {"PDSPARK_HOSTS_FILE": str(hosts)}})
    assert [p.labels["app.kubernetes.io/component"] for p in all_pods] == ["router", "prefill", "decode", "decode"]
    assert [p.ip for p in all_pods] == ["127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"]
    keys = rendered.data("Secret", f"{FULL}-auth")
    api_key, admin_key = keys["api-keys"].split()[0], keys["admin-api-keys"].split()[0]
    try:
        deadline = t0 + START_S
        workers = [p for p in all_pods if p.labels["app.kubernetes.io/component"] != "router"]
        router = next(p for p in all_pods if p not in workers)
        # The router first, alone: its startup and liveness probes pass (it would not be restarted in a loop while
        # its workers load), its readiness probe does not (no worker yet).
        router.start()
        assert router.process is not None
        while not router.probe("startupProbe"):
            assert router.process.alive and time.monotonic() < deadline, router.process.tail()
            time.sleep(0.2)
        assert router.probe("livenessProbe") and not router.probe("readinessProbe")
        for pod in workers:  # then the workers, all at once, as a cluster schedules them
            pod.start()
        for pod in workers:
            pod.wait_ready(deadline)
            assert pod.probe("livenessProbe")
        # A headless Service's DNS lists the ready pods it selects: now all of them (atomic: the router re-reads it).
        (work / "hosts.new").write_text(hosts_file_text(rendered, workers))
        os.replace(work / "hosts.new", hosts)
        router.wait_ready(deadline)
        assert router.probe("livenessProbe")
        url = service_url(rendered, all_pods, f"{FULL}-router", "http")
        while True:  # 503 until discovery has admitted the workers and their health checks passed
            try:
                first = complete(url, PROMPTS[0], api_key)
                break
            except urllib.error.HTTPError as e:
                assert e.code == 503 and time.monotonic() < deadline, e.read()
                time.sleep(0.1)
        yield rendered, all_pods, url, api_key, admin_key, first, time.monotonic() - t0
    finally:  # SIGTERM to all first: they drain at once, not one after another
        for pod in all_pods:
            if pod.process is not None:
                pod.process.terminate()
        for pod in all_pods:
            pod.stop()


@pytest.fixture(scope="module")
def offline(offline_reference) -> list[str]:
    refs = offline_reference.outputs(MODEL, PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                                    ignore_eos=True))
    return [r.text for r in refs]


def test_every_pod_runs_its_images_command_with_the_rendered_args(cluster):
    rendered, all_pods, *_ = cluster
    for pod in all_pods:  # each role's image (its Dockerfile's ENTRYPOINT) and the rendered args
        role = pod.labels["app.kubernetes.io/component"]
        assert pod.argv == [sys.executable, f"services/{role}/main.py", *pod.container.get("args", [])]
        assert pod.process is not None and pod.process.alive, pod.process and pod.process.tail()
    router = all_pods[0]
    assert router.argv[2:] == ["--prefill-dns", f"{FULL}-prefill.{NAMESPACE}.svc.cluster.local:50051",
                               "--decode-dns", f"{FULL}-decode.{NAMESPACE}.svc.cluster.local:50051"]


def test_the_router_found_every_worker_pod_by_dns(cluster):
    rendered, all_pods, url, api_key, admin_key, *_ = cluster
    with urllib.request.urlopen(urllib.request.Request(url + "/workers", headers={
            "Authorization": f"Bearer {admin_key}"}), timeout=scaled(10)) as r:
        workers = {w["address"]: w["role"] for w in json.load(r)}
    assert workers == {f"{p.ip}:50051": p.labels["app.kubernetes.io/component"] for p in all_pods[1:]}


def test_completions_through_the_router_service_equal_offline(cluster, offline):
    rendered, all_pods, url, api_key, admin_key, first, started_s = cluster
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # at once: both decode pods may take some
        answers = list(pool.map(lambda p: complete(url, p, api_key), PROMPTS))
    assert [first, *answers] == [offline[0], *offline]
    # The decode pods' /metrics on their rendered metrics port: together they ended every stream (a stream's count
    # may trail its last token to the client by a moment).
    def ended() -> float:
        return sum(decode_streams_ended(pod) for pod in all_pods[2:])

    wait_until(lambda: ended() >= 1 + len(PROMPTS), 10, "every stream counted ended by the decode pods",
               describe=lambda: f"({ended()})", interval_s=0.1)
    assert ended() == 1 + len(PROMPTS)
    assert started_s < START_S


def test_the_rendered_api_key_is_required(cluster):
    rendered, all_pods, url, *_ = cluster
    with pytest.raises(urllib.error.HTTPError) as refused:
        complete(url, PROMPTS[0], "not-the-key")
    assert refused.value.code == 401


def test_the_helm_test_hook_runs_one_completion(cluster, tmp_path):
    """`helm test`'s Pod, its command as rendered, run against the chart's pods. LIBERTIES: the router Service's
    in-cluster URL is replaced by its local address (DNS), and the key file the Pod mounts from the auth Secret by
    a file with the rendered Secret's keys (volumes)."""
    rendered, all_pods, url, api_key, admin_key, first, elapsed = cluster
    (pod,) = [d for d in rendered.docs if d["kind"] == "Pod"]
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    (container,) = pod["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["PDSPARK_TEST_URL"] == f"http://{FULL}-router:8000"
    keys = tmp_path / "api-keys"
    keys.write_text(rendered.data("Secret", f"{FULL}-auth")["api-keys"])
    env |= {"PDSPARK_TEST_URL": url, "PDSPARK_TEST_KEYS_FILE": str(keys)}
    assert container["command"][:2] == ["python", "-c"]
    out = subprocess.run([sys.executable, "-c", container["command"][2]], env={**os.environ, **env},
                         capture_output=True, text=True, timeout=scaled(120))
    assert out.returncode == 0 and "one completion served" in out.stdout, out.stdout + out.stderr
