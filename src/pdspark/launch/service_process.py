"""`ServiceProcess`: a pdspark service started as a child process, ready once it prints its JSON ready line. It is
also the process backend's `ServiceRun` (`pdspark.launch.backend`).

Children are asked to die with their parent (Linux `PR_SET_PDEATHSIG`, set by `orphan_guard.py` before it execs the
child's command), so a killed launcher leaves no orphans;
`stop()` sends SIGTERM, waits, and kills only if the child does not exit in time. Every JSON line a child prints
on stdout is kept as an event (`events`); the first `{"event": "ready", ...}` one is `info`. With `echo_stderr`,
every line the child writes on stderr is also written on ours as it comes, prefixed with the service's name (`pdspark
up`: a live worker's warnings and tracebacks reach the terminal, not only the last lines of one that exited).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

_MAX_LOG_LINES = 400
_ORPHAN_GUARD = Path(__file__).with_name("orphan_guard.py")
_ECHO_LOCK = threading.Lock()  # one whole line at a time on our stderr, whichever child's reader writes it


@dataclass
class ServiceProcess:
    name: str
    proc: subprocess.Popen
    info: dict = field(default_factory=dict)  # the ready line
    events: list[dict] = field(default_factory=list)  # every JSON line on stdout, in order
    log: list[str] = field(default_factory=list)  # the last lines of stdout and stderr, interleaved
    errors: list[str] = field(default_factory=list)  # the last lines of stderr alone
    ready_event: threading.Event = field(default_factory=threading.Event, repr=False)
    readers: list[threading.Thread] = field(default_factory=list, repr=False)
    echo: Callable[[str], None] | None = field(default=None, repr=False)  # called with each stderr line as read

    @property
    def address(self) -> str:
        return self.info.get("address", "")

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def ready(self) -> bool:
        return self.ready_event.is_set()

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    @property
    def details(self) -> dict:
        """Nothing to add to `up`'s ready event: the pid is where the service runs."""
        return {}

    @property
    def exit_text(self) -> str:
        """How the child ended, for logs: "exit code 1", "killed by SIGKILL" (or "running")."""
        code = self.proc.poll()
        if code is None:
            return "running"
        if code < 0:
            with contextlib.suppress(ValueError):
                return f"killed by {signal.Signals(-code).name}"
            return f"killed by signal {-code}"
        return f"exit code {code}"

    def send_signal(self, signum: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signum)

    def terminate(self) -> None:
        """Ask the child to stop (SIGTERM) without waiting; `stop()` waits."""
        self.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 15.0) -> int:
        self.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        return self.proc.returncode

    def drain(self, timeout: float = 1.0) -> None:
        """After the child exited: wait (bounded) until its last output is read, so a report shows its last words
        (a grandchild still holding the pipes would keep them open; hence the bound)."""
        deadline = time.monotonic() + timeout
        for t in self.readers:
            t.join(max(0.0, deadline - time.monotonic()))

    def tail(self, n: int = 40) -> str:
        return "".join(self.log[-n:])

    def stderr_tail(self, n: int = 10) -> str:
        return "".join(self.errors[-n:])

    def _read(self, stream, is_stdout: bool) -> None:
        for line in stream:
            if is_stdout and line.startswith("{"):
                with contextlib.suppress(ValueError):
                    event = json.loads(line)
                    if isinstance(event, dict):
                        self.events.append(event)
                        if event.get("event") == "ready" and not self.ready:
                            self.info = event
                            self.ready_event.set()
            if not is_stdout:
                self.errors.append(line)
                del self.errors[:-_MAX_LOG_LINES]
                if self.echo is not None:
                    self.echo(line)
            self.log.append(line)
            del self.log[:-_MAX_LOG_LINES]


def echo_prefixed(name: str) -> Callable[[str], None]:
    """Write a child's stderr line on ours as `[name] line`, whole (children's readers run in their own threads)."""
    def echo(line: str) -> None:
        text = f"[{name}] {line}" if line.endswith("\n") else f"[{name}] {line}\n"  # a last line may lack one
        with _ECHO_LOCK:
            sys.stderr.write(text)
            sys.stderr.flush()
    return echo


def spawn_service(name: str, args: list[str], env: dict | None = None, echo_stderr: bool = False) -> ServiceProcess:
    """Start `python -m pdspark.cli <args>`, in this process's environment updated by `env`; call from the thread
    that lives as long as the service (the child is tied to its creating thread by `PR_SET_PDEATHSIG`). With
    `echo_stderr`, its stderr lines are also written on ours, prefixed with `name`."""
    return spawn_process(name, [sys.executable, "-m", "pdspark.cli", *args],
                         {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                         echo=echo_prefixed(name) if echo_stderr else None)


def spawn_process(name: str, argv: list[str], env: dict[str, str], cwd: str | None = None,
                  echo: Callable[[str], None] | None = None) -> ServiceProcess:
    """Start `argv` with exactly the environment `env` (nothing inherited) in `cwd`; as `spawn_service`, from the
    thread that lives as long as the process. `echo` is called with each line of its stderr (in a reader thread)."""
    # No `preexec_fn` (see orphan_guard.py): `subprocess` then spawns with vfork, which runs no gRPC fork handlers.
    # The death signal fires when the *thread* that spawned the child exits, not the process: spawn from a thread
    # that lives as long as the parent (the main thread).
    guarded = [sys.executable, "-I", "-S", str(_ORPHAN_GUARD), str(os.getpid()), *argv]
    proc = subprocess.Popen(guarded, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd)
    service = ServiceProcess(name, proc, echo=echo)
    for stream, is_stdout in ((proc.stdout, True), (proc.stderr, False)):
        service.readers.append(threading.Thread(target=service._read, args=(stream, is_stdout), daemon=True))
        service.readers[-1].start()
    return service


def wait_ready(service: ServiceProcess, timeout: float = 180.0) -> ServiceProcess:
    """Wait (bounded) for the ready line; raises RuntimeError (after stopping the child) otherwise. A child that
    exits right after its ready line is ready: its readers are drained before deciding (the exit can be seen before
    the reader thread has parsed the line)."""
    deadline = time.monotonic() + timeout
    while not service.ready_event.wait(0.1):
        exited = service.proc.poll() is not None
        if exited:
            service.drain()
        if service.ready_event.is_set():
            break
        if exited or time.monotonic() > deadline:
            service.stop()
            raise RuntimeError(f"{service.name} did not become ready:\n{service.tail()}")
    return service


def start_service(name: str, args: list[str], timeout: float = 180.0, env: dict | None = None) -> ServiceProcess:
    return wait_ready(spawn_service(name, args, env), timeout)
