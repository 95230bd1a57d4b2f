"""CPU seconds a process has used, user and system, all threads: another process's from /proc, this one's from
`getrusage`."""

from __future__ import annotations

import contextlib
import os
import resource
from pathlib import Path


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far, all threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu_s(pid: int) -> float:
    """`cpu_s` of `pid` and of its live descendants (a supervisor and the processes it runs)."""
    total = cpu_s(pid)
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            with contextlib.suppress(FileNotFoundError):  # it exited meanwhile
                total += tree_cpu_s(int(child))
    return total


def self_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
