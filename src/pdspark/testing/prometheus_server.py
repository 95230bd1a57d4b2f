"""`PrometheusServer`: Debian's `prometheus` (2.42) on a free loopback port, discovering a pdspark cluster through the
router's HTTP service discovery (`/prometheus/targets`), scraping every second and loading the project's alert
rules (given as files). Started by the observability tests and the dashboards preview (bench/plot_dashboards.py);
stopped by PID."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from pdspark.launch.free_ports import free_ports
from pdspark.testing.time_scale import scaled


def tool(name: str) -> str:
    path = shutil.which(name)
    assert path, f"{name} is missing: `make setup` installs Debian's `prometheus` package, which has it"
    return path


class PrometheusServer:
    """`admin_key`: the router's admin key, which guards its service discovery when one is set; `rules`: alert and
    recording rule files to load (the repository's are under deploy/prometheus/rules)."""

    def __init__(self, tmp: Path, router_http: str, admin_key: str | None = None, rules: Sequence[Path] = (),
                 job_name: str = "pdspark", relabel_configs: Sequence[dict] = ()):
        """`job_name`, `relabel_configs`: the scrape job's (the Helm chart's monitors: the operator names the job
        after the monitor and the chart's relabelling sets `job` back to `pdspark`)."""
        sd: dict = {"url": router_http + "/prometheus/targets", "refresh_interval": "1s"}
        if admin_key is not None:
            key_file = tmp / "admin-key"
            key_file.write_text(admin_key)
            key_file.chmod(0o600)
            # `type` explicitly: 2.42's HTTP discovery sends no `Bearer` without it.
            sd["authorization"] = {"type": "Bearer", "credentials_file": str(key_file)}
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(f) for f in rules],
            "scrape_configs": [{"job_name": job_name, "http_sd_configs": [sd],
                                "relabel_configs": list(relabel_configs)}],
        }
        (tmp / "prometheus.json").write_text(json.dumps(config))  # JSON is YAML
        self.url = f"http://127.0.0.1:{free_ports('127.0.0.1', 1)[0]}"
        self.log_path = tmp / "prometheus.log"
        self.log = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [tool("prometheus"), f"--config.file={tmp / 'prometheus.json'}", f"--storage.tsdb.path={tmp / 'tsdb'}",
             f"--web.listen-address={self.url.removeprefix('http://')}"], stdout=self.log, stderr=subprocess.STDOUT)

    def tail(self, chars: int = 2000) -> str:
        return self.log_path.read_text()[-chars:]

    def wait_ready(self, timeout_s: float = 15) -> None:
        """Until `/-/ready` answers, within `timeout_s` (scaled)."""
        deadline = time.monotonic() + scaled(timeout_s)
        while True:
            assert self.proc.poll() is None, f"prometheus exited: {self.tail()}"
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=scaled(1)) as r:
                    r.read()
                return
            except (urllib.error.URLError, ConnectionError):
                assert time.monotonic() < deadline, f"prometheus not ready: {self.tail()}"
                time.sleep(0.1)

    def api(self, path: str, **params) -> dict:
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}",
                                    timeout=scaled(30)) as r:
            reply = json.loads(r.read())
        assert reply["status"] == "success", reply
        return reply["data"]

    def query(self, promql: str) -> list[dict]:
        return self.api("query", query=promql)["result"]

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=scaled(10))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=scaled(10))
        self.log.close()
