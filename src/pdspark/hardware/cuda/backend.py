"""`CudaBackend`: an NVIDIA GPU through `torch.cuda`. The engine runs its PyTorch path there (the C kernels are
host-only and step aside for device tensors); streams are `torch.cuda.Stream`s.

NOTE: untested until `scripts/device_check.sh` has run on a CUDA machine (see docs/operations.md)."""

from __future__ import annotations

import torch

from pdspark.hardware.backend import DeviceModuleBackend, DeviceUnavailableError


class CudaBackend(DeviceModuleBackend):
    name = "cuda"
    dist_backend = "nccl"

    def __init__(self) -> None:
        if not torch.cuda.is_available():
            built = torch.version.cuda
            why = (f"torch {torch.__version__} is built with CUDA {built}, but no CUDA device is visible (driver, "
                   "CUDA_VISIBLE_DEVICES)") if built else f"torch {torch.__version__} is a build without CUDA"
            raise DeviceUnavailableError(f"`device='cuda'` is unavailable: {why}; allowed here: 'cpu'")
        # The current device of this process (a worker per GPU sets CUDA_VISIBLE_DEVICES or the current device).
        super().__init__(torch.cuda, torch.device("cuda", torch.cuda.current_device()))
