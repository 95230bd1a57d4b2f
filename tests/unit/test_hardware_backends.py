"""Hardware backends: one interface for cpu/cuda/npu, chosen by `--device`, with a clear error for a device this
machine lacks (raised before any weight is loaded)."""

from __future__ import annotations

import contextlib
import os
import sys
import typing
from pathlib import Path

import pytest
import torch

from pdspark.config import Device, EngineConfig, WorkerConfig
from pdspark.engine.factory import create_engine
from pdspark.errors import ConfigError
from pdspark.hardware.backend import DeviceModuleBackend, DeviceUnavailableError, NullStream
from pdspark.hardware.cpu.backend import CpuBackend
from pdspark.hardware.extra_ops import ExtraOpsError, split_paths
from pdspark.hardware.npu import torch_npu_guard
from pdspark.hardware.registry import DEVICES, select_backend
from pdspark.options import parse_args


def test_config_device_names_the_registry_backends():
    assert typing.get_args(Device) == DEVICES


def test_cpu_backend_streams_are_no_ops_in_program_order():
    cpu = select_backend("cpu")
    assert isinstance(cpu, CpuBackend) and cpu.device == torch.device("cpu") and not cpu.has_streams
    side = cpu.new_stream()
    assert isinstance(side, NullStream)
    x = torch.zeros(3)
    with cpu.use_stream(side):
        x += 1
    side.wait_stream(cpu.current_stream())
    cpu.current_stream().wait_stream(side)
    cpu.synchronize()
    assert x.tolist() == [1.0, 1.0, 1.0]
    assert cpu.required_ops("sparse_attention") == ()
    assert cpu.kernels() <= {"hc_collapse", "hc_collapse_mixed", "hc_expand", "rms_norm", "rope_rotate",
                             "index_scores", "index_pick", "sink_attend", "moe_decode", "compressor_run", "norm_rope",
                             "attn_out"}


def test_unknown_device_names_the_allowed_ones():
    with pytest.raises(ConfigError, match=r"`device`.*'cpu', 'cuda', 'npu'"):
        select_backend("gpu")
    with pytest.raises(ConfigError, match=r"'tpu' for `device`; allowed: 'cpu', 'cuda', 'npu'"):
        parse_args(WorkerConfig, ["--device", "tpu"], environ={}, role="decode")
    assert parse_args(WorkerConfig, [], environ={"PDSPARK_DEVICE": "npu"}, role="decode").engine.device == "npu"
    with pytest.raises(ConfigError, match="device"):
        EngineConfig(device="gpu")  # type: ignore[arg-type]


def test_cuda_backend_or_the_missing_piece_named():
    if torch.cuda.is_available():  # on a GPU machine (scripts/device_check.sh)
        cuda = select_backend("cuda")
        assert cuda.device.type == "cuda" and cuda.has_streams
        return
    with pytest.raises(DeviceUnavailableError, match=r"`device='cuda'` is unavailable: torch .* (no CUDA device|"
                                                     r"without CUDA).*allowed here: 'cpu'"):
        select_backend("cuda")


def test_npu_needs_an_importable_torch_npu(monkeypatch):
    # No torch_npu here (it must never be installed on a CPU machine); `None` in sys.modules makes the import fail
    # the same way wherever this runs.
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    torch_npu_guard.import_torch_npu.cache_clear()
    try:
        with pytest.raises(DeviceUnavailableError, match=r"`device='npu'` is unavailable: `import torch_npu` "
                                                         r"failed \(ModuleNotFoundError.*install torch-npu"):
            select_backend("npu")
    finally:
        torch_npu_guard.import_torch_npu.cache_clear()


def test_engine_refuses_a_missing_device_before_loading(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    torch_npu_guard.import_torch_npu.cache_clear()
    loaded = []
    monkeypatch.setattr("pdspark.engine.factory.load_checkpoint", lambda *a, **k: loaded.append(a))
    try:
        with pytest.raises(DeviceUnavailableError, match="torch_npu"):
            create_engine("dsv4-tiny", device="npu")
    finally:
        torch_npu_guard.import_torch_npu.cache_clear()
    assert not loaded


def test_engine_checks_its_extra_operator_libraries_before_loading(monkeypatch, tmp_path):
    cfg = parse_args(WorkerConfig, [], environ={"PDSPARK_EXTRA_OPS_SO": f"{tmp_path}/a.so{os.pathsep}b.so"},
                     role="decode")
    assert split_paths(cfg.engine.extra_ops_so) == (tmp_path / "a.so", Path("b.so"))
    loaded = []
    monkeypatch.setattr("pdspark.engine.factory.load_checkpoint", lambda *a, **k: loaded.append(a))
    with pytest.raises(ExtraOpsError, match=f"PDSPARK_EXTRA_OPS_SO: extra operator library '{tmp_path}/a.so' does "
                                            "not exist"):
        create_engine("dsv4-tiny", config=cfg.engine)
    assert not loaded


def test_a_device_module_backend_drives_the_module_it_was_given():
    """CUDA and NPU share `DeviceModuleBackend`: every stream call goes to their device module (here a recorder)."""
    calls: list[tuple] = []

    class Api:
        def Stream(self, device):  # noqa: N802 (the device modules' name)
            calls.append(("Stream", device))
            return "side"

        def current_stream(self, device):
            calls.append(("current_stream", device))
            return "main"

        @contextlib.contextmanager
        def stream(self, s):
            calls.append(("enter", s))
            yield
            calls.append(("exit", s))

        def synchronize(self, device):
            calls.append(("synchronize", device))

    dev = torch.device("cpu")
    backend = DeviceModuleBackend(Api(), dev)
    assert backend.device == dev and backend.kernels() == frozenset() and backend.has_streams
    assert backend.new_stream() == "side" and backend.current_stream() == "main"
    with backend.use_stream("side"):
        calls.append(("work",))
    backend.synchronize()
    assert calls == [("Stream", dev), ("current_stream", dev), ("enter", "side"), ("work",), ("exit", "side"),
                     ("synchronize", dev)]


def test_each_rank_of_a_group_takes_the_device_of_its_local_index(monkeypatch):
    """One GPU per rank: rank r of a machine's ranks makes device r its current one before its backend is built (a
    group of more ranks than the machine shows devices is refused naming both); nothing happens on the CPU."""
    from pdspark.hardware.registry import bind_local_device

    chosen: list[int] = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    bind_local_device("cuda", 0)
    bind_local_device("cuda", 1)
    assert chosen == [0, 1]
    with pytest.raises(DeviceUnavailableError, match="rank 2 of this machine's ranks needs cuda device 2; this "
                                                     "machine shows 2"):
        bind_local_device("cuda", 2)
    bind_local_device("cpu", 5)  # (no device to bind)
    assert chosen == [0, 1]
