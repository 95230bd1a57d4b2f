"""A rendered Helm chart run as local processes: each Deployment's pods started from their container spec, exactly
as rendered, on their own loopback addresses.

What a pod's process gets, in Kubernetes' order:
- the command: the image's ENTRYPOINT + CMD, parsed from services/<image>/Dockerfile (the chart builds one image
  per role from it), unless the container sets `command`; `args` replace CMD; `$(VAR)` expanded from the env;
- the environment: the Dockerfile's ENV, then `envFrom` (rendered ConfigMaps/Secrets), then `env` (values, and
  `valueFrom` resolved: configMapKeyRef, secretKeyRef, fieldRef);
- its volumes: a directory per pod standing for the container's file system, where each volume is made at its
  mount path (emptyDir: an empty directory; secret/configMap: their rendered keys as files).

The liberties a process on the host forces, each one here and named `LIBERTY`:
- the image's `python` is this interpreter, its WORKDIR (/app, where the image copies src/ and services/) is the
  repository root, and the package is imported from the source tree (PYTHONPATH) instead of pip-installed;
- there is no network namespace: an address of 0.0.0.0 (every address *of the pod*) is the pod's own address;
- there is no mount namespace: an absolute path in an env value or argument that lies under a volume's mount path
  (or HOME, /tmp) is rewritten to the pod's directory; other paths (/dev/shm) are the host's.
Headless Services resolve through the router's DNS discovery hosts-file override (`hosts_file`), listing a pod once
its readiness probe passes, as a cluster's DNS lists ready pods.
"""

from __future__ import annotations

import base64
import json
import re
import shlex
import socket
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdspark.launch.service_process import ServiceProcess, spawn_process

ROOT = Path(__file__).resolve().parents[1]
CLUSTER_DOMAIN = "cluster.local"  # the kubelet's default, as the chart's clusterDomain value
HOME = "/home/pdspark"  # the images' user (`useradd --create-home pdspark`)
ANY_ADDRESS = "0.0.0.0"


@dataclass(frozen=True)
class Image:
    """What a Dockerfile's final stage gives a container: its command and environment."""

    entrypoint: tuple[str, ...]
    cmd: tuple[str, ...]
    env: dict[str, str]
    workdir: str

    @classmethod
    def parse(cls, path: Path) -> Image:
        entrypoint: tuple[str, ...] = ()
        cmd: tuple[str, ...] = ()
        env: dict[str, str] = {}
        workdir = "/"
        stages: dict[str, tuple] = {}  # named stages as they ended: a later `FROM <name>` starts from one
        name = ""
        for line in _instructions(path.read_text()):
            op, _, rest = line.partition(" ")
            op, rest = op.upper(), rest.strip()
            if op == "FROM":  # a new stage: only the last one is the image
                if name:
                    stages[name] = (entrypoint, cmd, dict(env), workdir)
                base, _, name = rest.partition(" AS ") if " AS " in rest else rest.partition(" as ")
                base, name = base.strip(), name.strip()
                entrypoint, cmd, env, workdir = (), (), {}, "/"
                if base in stages:
                    entrypoint, cmd, inherited, workdir = stages[base]
                    env = dict(inherited)
            elif op == "ENV":
                env.update(_env_instruction(rest))
            elif op == "WORKDIR":
                workdir = str(Path(workdir, rest))
            elif op == "ENTRYPOINT":
                entrypoint, cmd = _exec_form(rest), ()  # ENTRYPOINT resets an inherited CMD
            elif op == "CMD":
                cmd = _exec_form(rest)
        return cls(entrypoint, cmd, env, workdir)


def _instructions(text: str) -> list[str]:
    """The Dockerfile's instructions, continuation lines joined, comments dropped."""
    out, pending = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        out.append(pending + line)
        pending = ""
    return out


def _env_instruction(rest: str) -> dict[str, str]:
    words = shlex.split(rest)
    if "=" not in words[0]:  # the legacy `ENV KEY value with spaces`
        return {words[0]: rest[len(words[0]):].strip()}
    return dict(w.split("=", 1) for w in words)


def _exec_form(rest: str) -> tuple[str, ...]:
    return tuple(json.loads(rest)) if rest.startswith("[") else ("/bin/sh", "-c", rest)


def image_of(container: dict) -> Image:
    """The container's image, from the Dockerfile of its repository's last path component (ghcr.io/pdspark/router
    -> services/router/Dockerfile)."""
    repository = container["image"].rsplit(":", 1)[0]
    dockerfile = ROOT / "services" / repository.rsplit("/", 1)[-1] / "Dockerfile"
    assert dockerfile.exists(), f"image {container['image']}: no {dockerfile.relative_to(ROOT)} builds it"
    return Image.parse(dockerfile)


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' `$(VAR)` in command, args and env values: defined names replaced, `$$` an escaped `$`."""
    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)", sub, text)


class Rendered:
    """The chart's documents, by kind and name."""

    def __init__(self, docs: list[dict], namespace: str):
        self.docs = docs
        self.namespace = namespace

    def of_kind(self, kind: str) -> list[dict]:
        return [d for d in self.docs if d["kind"] == kind]

    def get(self, kind: str, name: str) -> dict:
        found = [d for d in self.of_kind(kind) if d["metadata"]["name"] == name]
        assert found, f"the pod refers to {kind} {name}, which the chart does not render"
        return found[0]

    def data(self, kind: str, name: str) -> dict[str, str]:
        """A ConfigMap's data, or a Secret's data decoded (and stringData)."""
        doc = self.get(kind, name)
        if kind == "Secret":
            decoded = {k: base64.b64decode(v).decode() for k, v in (doc.get("data") or {}).items()}
            return {**decoded, **(doc.get("stringData") or {})}
        return dict(doc.get("data") or {})


@dataclass
class Pod:
    """One replica of a Deployment, ready to start: `argv`, `env`, `cwd` as the test runs them."""

    name: str
    ip: str
    labels: dict[str, str]
    container: dict
    argv: list[str]
    env: dict[str, str]
    cwd: str
    process: ServiceProcess | None = field(default=None, repr=False)

    def port(self, port: int | str) -> int:
        """A container port by number or name."""
        if isinstance(port, int):
            return port
        (number,) = [p["containerPort"] for p in self.container.get("ports", []) if p.get("name") == port]
        return number

    def start(self) -> None:
        self.process = spawn_process(self.name, self.argv, self.env, self.cwd)

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()

    def probe(self, kind: str = "readinessProbe") -> bool:
        """One run of the container's probe, as the kubelet runs it (at the pod's address)."""
        spec = self.container[kind]
        timeout = spec.get("timeoutSeconds", 1)
        try:
            if "httpGet" in spec:
                get = spec["httpGet"]
                url = f"{get.get('scheme', 'HTTP').lower()}://{self.ip}:{self.port(get['port'])}{get['path']}"
                with urllib.request.urlopen(url, timeout=timeout) as r:
                    return 200 <= r.status < 400
            if "grpc" in spec:
                with grpc.insecure_channel(f"{self.ip}:{spec['grpc']['port']}") as channel:
                    request = health_pb2.HealthCheckRequest(service=spec["grpc"].get("service", ""))
                    answer = health_pb2_grpc.HealthStub(channel).Check(request, timeout=timeout)
                    return answer.status == health_pb2.HealthCheckResponse.SERVING
            if "tcpSocket" in spec:
                with socket.create_connection((self.ip, self.port(spec["tcpSocket"]["port"])), timeout):
                    return True
        except (OSError, urllib.error.URLError, grpc.RpcError):
            return False
        raise AssertionError(f"{self.name}: {kind} {spec} is of no kind this test runs")

    def wait_ready(self, deadline: float) -> None:
        """Until the readiness probe passes; fails at once if the process ended."""
        assert self.process is not None
        while not self.probe():
            assert self.process.alive, f"{self.name} ended ({self.process.exit_text}):\n{self.process.tail()}"
            assert time.monotonic() < deadline, f"{self.name} not ready in time:\n{self.process.tail()}"
            time.sleep(0.2)


def pods(rendered: Rendered, workdir: Path, first_ip: int = 2, extra_env: dict[str, dict[str, str]] | None = None
         ) -> list[Pod]:
    """Every Deployment's replicas as Pods, on 127.0.0.<first_ip>, ... in render order; `extra_env`: component ->
    variables the test adds (its liberties, named where it calls this)."""
    out = []
    for deployment in rendered.of_kind("Deployment"):
        template = deployment["spec"]["template"]
        (container,) = template["spec"]["containers"]
        component = template["metadata"]["labels"].get("app.kubernetes.io/component", "")
        for i in range(deployment["spec"].get("replicas", 1)):
            name = f"{deployment['metadata']['name']}-{i}"
            ip = f"127.0.0.{first_ip + len(out)}"
            out.append(_pod(rendered, name, ip, template, container, workdir / name,
                            (extra_env or {}).get(component, {})))
    return out


def _pod(rendered: Rendered, name: str, ip: str, template: dict, container: dict, root: Path,
         extra_env: dict[str, str]) -> Pod:
    image = image_of(container)
    # LIBERTY (mount namespace): the pod's file system is `root`; its volumes are made at their mount paths there.
    mounts = _volumes(rendered, template["spec"].get("volumes", []), container.get("volumeMounts", []), root)
    mounts.setdefault(HOME, root / HOME.lstrip("/"))
    mounts.setdefault("/tmp", root / "tmp")
    for local in mounts.values():
        local.mkdir(parents=True, exist_ok=True)

    def local_path(value: str) -> str:
        for mount_path in sorted(mounts, key=len, reverse=True):
            if value == mount_path or value.startswith(mount_path.rstrip("/") + "/"):
                return str(mounts[mount_path]) + value[len(mount_path):]
        return value

    fields = {"status.podIP": ip, "metadata.name": name, "metadata.namespace": rendered.namespace,
              "spec.serviceAccountName": template["spec"].get("serviceAccountName", "default")}
    # The base a container runtime gives every process, then the image's ENV.
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOSTNAME": name, "HOME": HOME, **image.env}
    for source in container.get("envFrom", []):
        kind, ref = ("ConfigMap", source["configMapRef"]) if "configMapRef" in source else (
            "Secret", source["secretRef"])
        env.update({source.get("prefix", "") + k: v for k, v in rendered.data(kind, ref["name"]).items()})
    for var in container.get("env", []):
        env[var["name"]] = expand(var["value"], env) if "value" in var else _value_from(rendered, var, fields)
    # LIBERTY (no network namespace): every address of the pod is its own loopback address.
    env = {k: ip if v == ANY_ADDRESS else local_path(v) for k, v in env.items()}
    env.update(extra_env)  # host paths already
    env["TMPDIR"] = str(mounts["/tmp"])  # LIBERTY (mount namespace): what the process writes to /tmp
    # LIBERTY (image): this interpreter and the source tree stand for the image's python and installed package.
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    env["PYTHONPATH"] = str(ROOT / "src")

    if "command" in container:
        argv = [*container["command"], *container.get("args", [])]
    else:
        argv = [*image.entrypoint, *container.get("args", image.cmd)]
    assert argv, f"{name}: neither the container nor its image has a command"
    argv = [local_path(expand(a, env)) for a in argv]
    argv = [ip if a == ANY_ADDRESS else a for a in argv]
    if argv[0] == "python":
        argv[0] = sys.executable
    # LIBERTY (image): WORKDIR /app holds what the Dockerfile copies from the repository root.
    assert image.workdir == "/app", f"{name}: WORKDIR {image.workdir}, not the repository copy this test maps"
    return Pod(name, ip, dict(template["metadata"]["labels"]), container, argv, env, str(ROOT))


def _value_from(rendered: Rendered, var: dict, fields: dict[str, str]) -> str:
    source = var["valueFrom"]
    if "fieldRef" in source:
        path = source["fieldRef"]["fieldPath"]
        assert path in fields, f"env {var['name']}: fieldRef {path} is not one this test resolves ({sorted(fields)})"
        return fields[path]
    for kind, key in (("ConfigMap", "configMapKeyRef"), ("Secret", "secretKeyRef")):
        if key in source:
            ref = source[key]
            data = rendered.data(kind, ref["name"])
            assert ref["key"] in data, f"env {var['name']}: {kind} {ref['name']} has no key {ref['key']}"
            return data[ref["key"]]
    raise AssertionError(f"env {var['name']}: valueFrom {source} is of no kind this test resolves")


def _volumes(rendered: Rendered, volumes: list[dict], volume_mounts: list[dict], root: Path) -> dict[str, Path]:
    """mount path -> the local directory standing for it, with the volume's files written there."""
    by_name = {v["name"]: v for v in volumes}
    mounts = {}
    for mount in volume_mounts:
        volume = by_name[mount["name"]]
        local = root / mount["mountPath"].lstrip("/")
        local.mkdir(parents=True, exist_ok=True)
        for kind, key, name_key in (("Secret", "secret", "secretName"), ("ConfigMap", "configMap", "name")):
            if key in volume:
                data = rendered.data(kind, volume[key][name_key])
                items = volume[key].get("items") or [{"key": k, "path": k} for k in data]
                for item in items:
                    (local / item["path"]).write_text(data[item["key"]])
        assert not set(volume) - {"name", "emptyDir", "secret", "configMap"}, f"volume {volume} is not supported"
        mounts[mount["mountPath"]] = local
    return mounts


def selects(selector: dict[str, str], pod: Pod) -> bool:
    return all(pod.labels.get(k) == v for k, v in selector.items())


def hosts_file_text(rendered: Rendered, ready: list[Pod]) -> str:
    """/etc/hosts lines for every headless Service: the ready pods its selector selects, under its names (the
    FQDN and the shorter forms the pods' DNS search path completes)."""
    lines = []
    for service in rendered.of_kind("Service"):
        if service["spec"].get("clusterIP") != "None":
            continue
        name = service["metadata"]["name"]
        names = [f"{name}.{rendered.namespace}.svc.{CLUSTER_DOMAIN}", f"{name}.{rendered.namespace}.svc",
                 f"{name}.{rendered.namespace}", name]
        lines += [f"{p.ip} {' '.join(names)}" for p in ready if selects(service["spec"]["selector"], p)]
    return "".join(line + "\n" for line in lines)


def service_url(rendered: Rendered, all_pods: list[Pod], service: str, port_name: str) -> str:
    """`http://<pod ip>:<target port>` of a (ClusterIP) Service's port: what its virtual address forwards to."""
    spec = rendered.get("Service", service)["spec"]
    (port,) = [p for p in spec["ports"] if p["name"] == port_name]
    (pod,) = [p for p in all_pods if selects(spec["selector"], p)]
    return f"http://{pod.ip}:{pod.port(port.get('targetPort', port['port']))}"
