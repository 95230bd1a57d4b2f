"""`select_backend`: the hardware backend a `--device` value names, constructed once per process."""

from __future__ import annotations

from functools import cache
from typing import Any

from pdspark.errors import check_choice
from pdspark.hardware.backend import DeviceUnavailableError, HardwareBackend

# The values of `--device`: `pdspark.config.Device` names the same (a test checks), without importing this module
# (the router's config must not import torch).
DEVICES: tuple[str, ...] = ("cpu", "cuda", "npu")


@cache
def select_backend(device: str) -> HardwareBackend:
    """The backend of `device`; `DeviceUnavailableError` (a ConfigError) naming what this machine lacks when it
    cannot run here. Backends import their device libraries only when selected (`torch_npu` only for 'npu')."""
    check_choice("device", device, DEVICES)
    if device == "cuda":
        from pdspark.hardware.cuda.backend import CudaBackend

        return CudaBackend()
    if device == "npu":
        from pdspark.hardware.npu.backend import NpuBackend

        return NpuBackend()
    from pdspark.hardware.cpu.backend import CpuBackend

    return CpuBackend()


def bind_local_device(device: str, local_rank: int) -> None:
    """A worker group's rank `local_rank` on this machine takes the device of that index as its current one (call
    before `select_backend`, whose backend is this process's current device): one GPU or NPU per rank. Nothing to
    do on the CPU. `DeviceUnavailableError` when this machine shows fewer devices than its ranks need."""
    check_choice("device", device, DEVICES)
    if device == "cpu":
        return
    import torch

    api: Any = torch.cuda if device == "cuda" else getattr(torch, "npu", None)  # (torch.npu: from torch_npu)
    count = api.device_count() if api is not None else 0
    if api is None or local_rank >= count:
        raise DeviceUnavailableError(f"rank {local_rank} of this machine's ranks needs {device} device {local_rank}; "
                                     f"this machine shows {count}: run at most {count} ranks a machine "
                                     "(--nnodes spreads a group over machines)")
    api.set_device(local_rank)
