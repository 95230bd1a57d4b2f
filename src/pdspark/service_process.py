"""`ServiceProcess`: a pdspark service started as a child process, ready once it prints its JSON ready line.

Children are asked to die with their parent (Linux `PR_SET_PDEATHSIG`), so a killed launcher leaves no orphans;
`stop()` sends SIGTERM, waits, and kills only if the child does not exit in time.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    with contextlib.suppress(OSError):  # not Linux: the launcher's own signal handling still stops children
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class ServiceProcess:
    name: str
    proc: subprocess.Popen
    info: dict = field(default_factory=dict)
    log: list[str] = field(default_factory=list)

    @property
    def address(self) -> str:
        return self.info.get("address", "")

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode

    def tail(self, n: int = 40) -> str:
        return "".join(self.log[-n:])


def spawn_service(name: str, args: list[str], env: dict | None = None) -> ServiceProcess:
    """Start `python -m pdspark.cli <args>`; call from the thread that lives as long as the service (the child is
    tied to its creating thread by `PR_SET_PDEATHSIG`)."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen([sys.executable, "-m", "pdspark.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=full_env, preexec_fn=_die_with_parent)
    service = ServiceProcess(name, proc)
    service._ready = threading.Event()  # type: ignore[attr-defined]

    def read(stream, parse: bool) -> None:
        for line in stream:
            if parse and line.startswith("{") and '"ready"' in line:
                service.info = json.loads(line)
                service._ready.set()  # type: ignore[attr-defined]
            service.log.append(line)
            del service.log[:-400]

    threading.Thread(target=read, args=(proc.stdout, True), daemon=True).start()
    threading.Thread(target=read, args=(proc.stderr, False), daemon=True).start()
    return service


def wait_ready(service: ServiceProcess, timeout: float = 180.0) -> ServiceProcess:
    """Wait (bounded) for the ready line; raises RuntimeError (after stopping the child) otherwise."""
    deadline = time.monotonic() + timeout
    while not service._ready.wait(0.1):  # type: ignore[attr-defined]
        if service.proc.poll() is not None or time.monotonic() > deadline:
            service.stop()
            raise RuntimeError(f"{service.name} did not become ready:\n{service.tail()}")
    return service


def start_service(name: str, args: list[str], timeout: float = 180.0, env: dict | None = None) -> ServiceProcess:
    return wait_ready(spawn_service(name, args, env), timeout)
