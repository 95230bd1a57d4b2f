"""`select_backend`: the hardware backend a `--device` value names, constructed once per process."""

from __future__ import annotations

from functools import cache

from pdspark.errors import check_choice
from pdspark.hardware.backend import HardwareBackend

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
