"""The CPUs a process may keep busy: its affinity mask capped by its cgroup's CPU quota (v2 `cpu.max`, v1
`cfs_quota_us / cfs_period_us`), from the process's own cgroup directory or the root."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdspark.hardware.cpu import cpu_budget
from pdspark.hardware.cpu.cpu_budget import cgroup_cpu_quota, fit_threads, usable_cpus


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_v2_quota_of_the_process_cgroup_or_the_root(tmp_path):
    self_cgroup = tmp_path / "self"
    write(self_cgroup, "0::/kubepods/pod1/ctr\n")
    write(tmp_path / "cg" / "kubepods" / "pod1" / "ctr" / "cpu.max", "250000 100000\n")
    assert cgroup_cpu_quota(tmp_path / "cg", self_cgroup) == 2.5
    write(tmp_path / "root" / "cpu.max", "max 100000\n")  # no limit
    assert cgroup_cpu_quota(tmp_path / "root", self_cgroup) is None
    write(tmp_path / "ns" / "cpu.max", "50000 100000\n")  # a cgroup namespace: its own cgroup is the root
    assert cgroup_cpu_quota(tmp_path / "ns", tmp_path / "missing") == 0.5


def test_v1_quota_and_none_unless_positive(tmp_path):
    self_cgroup = tmp_path / "self"
    write(self_cgroup, "4:memory:/x\n1:cpu,cpuacct:/pod\n")
    write(tmp_path / "cg" / "cpu,cpuacct" / "pod" / "cpu.cfs_quota_us", "300000\n")
    write(tmp_path / "cg" / "cpu,cpuacct" / "pod" / "cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu_quota(tmp_path / "cg", self_cgroup) == 3.0
    write(tmp_path / "cg" / "cpu,cpuacct" / "pod" / "cpu.cfs_quota_us", "-1\n")
    assert cgroup_cpu_quota(tmp_path / "cg", self_cgroup) is None


@pytest.mark.parametrize("quota, affinity, cpus", [(None, 8, 8), (2.5, 8, 2), (0.5, 8, 1), (16.0, 4, 4)])
def test_usable_cpus_are_the_affinity_capped_by_whole_cpus_of_the_quota(quota, affinity, cpus):
    assert usable_cpus(quota, affinity) == cpus


def test_threads_are_lowered_to_the_usable_cpus_never_raised(monkeypatch):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        monkeypatch.setattr(cpu_budget, "usable_cpus", lambda: 1)
        assert fit_threads() == 1 and torch.get_num_threads() == 1
        monkeypatch.setattr(cpu_budget, "usable_cpus", lambda: 8)
        assert fit_threads() == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
