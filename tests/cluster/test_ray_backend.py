"""`pdspark up --backend ray`: router, prefill and decode as Ray actors on a local Ray serve the offline engine's
greedy completions; a killed service comes back at its address; Ctrl-C leaves no Ray or pdspark process."""

from __future__ import annotations

import os
import signal
import uuid
from pathlib import Path

import openai

from helpers import make_llm
from pdspark import SamplingParams
from pdspark.launch.service_process import ServiceProcess, start_service
from pdspark.testing.time_scale import scaled
from pdspark.testing.waiting import wait_until

ENGINE = ["--page-size", "16", "--max-model-len", "256", "--max-num-seqs", "8"]
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def push(self, x):"]
TAG = "PDSPARK_RAY_TEST_TAG"  # inherited by every process the launcher starts, Ray's included


def tagged_pids(tag: str) -> set[int]:
    """Processes (not zombies) whose environment carries `TAG=tag`: whatever this test's launcher started."""
    needle = f"{TAG}={tag}".encode()
    out = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if needle in (proc / "environ").read_bytes().split(b"\0") and \
                    ") Z " not in (proc / "stat").read_text():
                out.add(int(proc.name))
        except OSError:  # gone meanwhile, or not ours
            continue
    return out


def wait_event(service: ServiceProcess, event: str, name: str, timeout: float = 60.0) -> dict:
    """The first `event` event `pdspark up` printed for service `name`, within `timeout` (scaled)."""
    return wait_until(lambda: next((e for e in service.events if e.get("event") == event and e.get("service") == name),
                                   None), timeout, f"a {event} event for {name}",
                      describe=lambda: f"\n{service.tail()}", interval_s=0.2)


def test_ray_backend_serves_offline_greedy_restarts_and_ctrl_c_leaves_nothing():
    tag = uuid.uuid4().hex
    service = start_service("pdspark up", ["up", "--backend", "ray", "--ray-num-cpus", "2", "--model", "dsv4-tiny",
                                           "--prefill", "1", "--decode", "2", "--port", "0", "--grpc-port", "0",
                                           "--restart-backoff-s", "0.2", *ENGINE],
                            timeout=scaled(150), env={TAG: tag})
    try:
        info = service.info
        services = info["services"]
        assert set(services) == {"prefill-0", "decode-1", "decode-2", "router"}
        started = tagged_pids(tag)
        # Ray's own processes, one actor per service and the service under it: the tag does reach them.
        assert {s["pid"] for s in services.values()} | {s["actor_pid"] for s in services.values()} <= started
        assert len(started) > 2 * len(services)

        offline = make_llm("dsv4-tiny", page_size=16, max_model_len=256)
        client = openai.OpenAI(base_url=info["http"] + "/v1", api_key="none", max_retries=0)

        def check(prompts: list[str]) -> None:
            for prompt in prompts:
                want = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
                got = client.completions.create(model=info["model"], prompt=prompt, max_tokens=16, temperature=0,
                                                extra_body={"ignore_eos": True})
                assert got.choices[0].text == want.text

        check(PROMPTS)
        # A service that dies is restarted by Ray at the same address, and the cluster serves again.
        os.kill(services["decode-1"]["pid"], signal.SIGKILL)
        assert wait_event(service, "exited", "decode-1")["pid"] == services["decode-1"]["pid"]
        again = wait_event(service, "restarted", "decode-1")
        assert again["address"] == services["decode-1"]["address"] and again["pid"] != services["decode-1"]["pid"]
        check(PROMPTS[:2])
        service.proc.send_signal(signal.SIGHUP)  # passed on to the router (keys reread); the cluster keeps serving
        check(PROMPTS[2:])
    finally:
        service.proc.send_signal(signal.SIGINT)  # Ctrl-C
        try:
            rc = service.proc.wait(scaled(60))
        finally:
            service.stop()
    assert rc == 0, service.tail()
    wait_until(lambda: not tagged_pids(tag), 30, "every process of the cluster gone", interval_s=0.5,
               describe=lambda: str([Path(f"/proc/{p}/cmdline").read_bytes()[:200] for p in tagged_pids(tag)]))


def test_a_two_node_ray_cluster_runs_the_prefill_group_on_one_node_and_the_decode_group_on_the_other():
    """A Ray cluster of two nodes on this machine (a head with `node_a`, a second raylet with `node_b`):
    `--ray-placement spread` and the roles' custom resources put the prefill group (2 ranks) on one node and the
    decode group (2 ranks, DP-attention) on the other, through one placement group; completions equal offline."""
    from ray.cluster_utils import Cluster

    nodes = Cluster(initialize_head=True, connect=False,
                    head_node_args={"num_cpus": 2, "resources": {"node_a": 1}, "include_dashboard": False})
    try:
        nodes.add_node(num_cpus=2, resources={"node_b": 1})
        nodes.wait_for_nodes()
        service = start_service("pdspark up", [
            "up", "--backend", "ray", "--ray-address", nodes.address, "--ray-placement", "spread",
            "--model", "dsv4-tiny", "--prefill-ep-size", "2", "--decode-ep-size", "2",
            "--ray-prefill-resources", "CPU=0.25,node_a=0.5", "--ray-decode-resources", "CPU=0.25,node_b=0.5",
            "--port", "0", "--grpc-port", "0", *ENGINE], timeout=scaled(180))
        try:
            services = service.info["services"]
            prefill, decode = services["prefill-0"], services["decode-1"]
            assert prefill["ray_node"] and decode["ray_node"] and prefill["ray_node"] != decode["ray_node"]
            offline = make_llm("dsv4-tiny", page_size=16, max_model_len=256)
            client = openai.OpenAI(base_url=service.info["http"] + "/v1", api_key="none", max_retries=0)
            for prompt in PROMPTS[:2]:
                want = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
                got = client.completions.create(model=service.info["model"], prompt=prompt, max_tokens=16,
                                                temperature=0, extra_body={"ignore_eos": True})
                assert got.choices[0].text == want.text
        finally:
            service.stop()
    finally:
        nodes.shutdown()
