"""`usable_cpus`: how many CPUs this process may keep busy, and the engine's threads fitted to it.

torch starts one intra-op thread per core it can see, which inside a container is every core of the node, not the
CPU limit Kubernetes gave the pod (a cgroup quota: `cpu.max` in cgroup v2, `cpu.cfs_quota_us / cpu.cfs_period_us`
in v1). Twenty threads on a 2-CPU quota spend most of each period throttled. The usable count is the affinity mask's
size capped by the quota (rounded down, at least 1: a thread per whole CPU the quota pays for).
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

logger = logging.getLogger(__name__)
CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_cpu_quota(root: Path = CGROUP_ROOT, self_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """CPUs the process's cgroup may use per period (a fraction allowed), None when no quota is set or readable.
    Looks in the process's own cgroup directory (from `/proc/self/cgroup`) and then at the root (a container's
    cgroup namespace shows its own cgroup as the root)."""
    dirs = []
    try:
        for line in self_cgroup.read_text().splitlines():
            hierarchy, _, rest = line.partition(":")
            controllers, _, path = rest.partition(":")
            if hierarchy == "0" or "cpu" in controllers.split(","):
                sub = path.lstrip("/")
                dirs += [root / sub, root / "cpu" / sub, root / "cpu,cpuacct" / sub]
    except OSError:
        pass
    dirs += [root, root / "cpu", root / "cpu,cpuacct"]
    for d in dirs:
        quota = _v2_quota(d / "cpu.max")
        if quota is None:
            quota = _v1_quota(d / "cpu.cfs_quota_us", d / "cpu.cfs_period_us")
        if quota is not None:
            return quota
    return None


def _v2_quota(path: Path) -> float | None:
    try:
        fields = path.read_text().split()
    except OSError:
        return None
    if len(fields) != 2 or fields[0] == "max":
        return None
    try:
        quota, period = int(fields[0]), int(fields[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def _v1_quota(quota_path: Path, period_path: Path) -> float | None:
    try:
        quota, period = int(quota_path.read_text()), int(period_path.read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def usable_cpus(quota: float | None = None, affinity: int | None = None) -> int:
    """The CPUs this process may keep busy: its affinity mask's size, capped by the cgroup quota (rounded down, at
    least 1). `quota`/`affinity`: given (tests), else read."""
    if affinity is None:
        try:
            affinity = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):  # (no affinity call on this platform)
            affinity = os.cpu_count() or 1
    if quota is None:
        quota = cgroup_cpu_quota()
    cpus = affinity if quota is None else min(affinity, max(1, math.floor(quota)))
    return max(1, cpus)


def fit_threads() -> int:
    """Cap torch's intra-op threads at `usable_cpus()` (never raise them: a count the user set stays when it is
    lower); returns the count in use. Said once in the log when it lowers them."""
    import torch

    have, usable = torch.get_num_threads(), usable_cpus()
    if have > usable:
        torch.set_num_threads(usable)
        logger.info("engine threads: %d (the CPUs this process may use: affinity and cgroup quota), not %d", usable,
                    have)
        return usable
    return have
