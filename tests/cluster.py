"""Real worker processes for end-to-end tests: started with `pdspark serve ...`, stopped by PID."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field


@dataclass
class WorkerProcess:
    role: str
    proc: subprocess.Popen
    info: dict = field(default_factory=dict)
    log: list[str] = field(default_factory=list)

    @property
    def address(self) -> str:
        return self.info["address"]

    def stop(self, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode


def start_worker(role: str, model: str, *args: str, timeout: float = 120.0, env: dict | None = None) -> WorkerProcess:
    """Start `pdspark serve <role>` and wait (bounded) for its ready line."""
    cmd = [sys.executable, "-m", "pdspark.cli", "serve", role, "--model", model, "--port", "0",
           "--metrics-port", "0", *args]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env)
    worker = WorkerProcess(role, proc)
    threading.Thread(target=_drain, args=(proc.stderr, worker.log), daemon=True).start()
    ready = threading.Event()

    def read_stdout() -> None:
        for line in proc.stdout:
            if line.startswith("{") and '"ready"' in line:
                worker.info = json.loads(line)
                ready.set()
            worker.log.append(line)

    threading.Thread(target=read_stdout, daemon=True).start()
    deadline = time.monotonic() + timeout
    while not ready.wait(0.1):
        if proc.poll() is not None or time.monotonic() > deadline:
            worker.stop()
            raise RuntimeError(f"{role} worker did not become ready:\n" + "".join(worker.log[-40:]))
    return worker


def _drain(stream, sink: list[str]) -> None:
    for line in stream:
        sink.append(line)
        del sink[:-400]
