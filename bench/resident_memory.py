"""Resident memory of a process (`VmRSS`): this one's, or another's by pid (a group's other ranks)."""

from __future__ import annotations

from pathlib import Path


def rss_mb(pid: int | str = "self") -> float:
    """Resident MiB of process `pid` now (NaN when /proc does not say)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")
