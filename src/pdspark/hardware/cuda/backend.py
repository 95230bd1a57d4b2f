"""`CudaBackend`: an NVIDIA GPU through `torch.cuda`. The engine runs its PyTorch path there (the C kernels are
host-only and step aside for device tensors); streams are `torch.cuda.Stream`s.

NOTE: untested until `scripts/device_check.sh` has run on a CUDA machine (see the README)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from pdspark.hardware.backend import DeviceUnavailableError, HardwareBackend


class CudaBackend(HardwareBackend):
    name = "cuda"
    has_streams = True

    def __init__(self) -> None:
        if not torch.cuda.is_available():
            built = torch.version.cuda
            why = (f"torch {torch.__version__} is built with CUDA {built}, but no CUDA device is visible (driver, "
                   "CUDA_VISIBLE_DEVICES)") if built else f"torch {torch.__version__} is a build without CUDA"
            raise DeviceUnavailableError(f"`device='cuda'` is unavailable: {why}; allowed here: 'cpu'")
        # The current device of this process (a worker per GPU sets CUDA_VISIBLE_DEVICES or the current device).
        self._device = torch.device("cuda", torch.cuda.current_device())

    @property
    def device(self) -> torch.device:
        return self._device

    def kernels(self) -> frozenset[str]:
        return frozenset()

    def new_stream(self) -> Any:
        return torch.cuda.Stream(self._device)

    def current_stream(self) -> Any:
        return torch.cuda.current_stream(self._device)

    @contextmanager
    def use_stream(self, stream: Any) -> Iterator[None]:
        with torch.cuda.stream(stream):
            yield

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self._device)
