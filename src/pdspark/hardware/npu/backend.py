"""`NpuBackend`: an Ascend NPU through `torch_npu` (`torch.npu` streams and events, the `npu` torch device).

Constructing it imports `torch_npu` through `torch_npu_guard`; without it (every machine but an Ascend host) it
raises `DeviceUnavailableError` naming what is missing. The engine runs its PyTorch path on the `npu` device; the
DSV4 sparse-attention operators come from an extra operator library (`PDSPARK_EXTRA_OPS_SO`, e.g. vllm-ascend's
custom-op `.so`), checked by `pdspark.hardware.extra_ops` for the features that use them.

NOTE: untested (no Ascend machine has run it)."""

from __future__ import annotations

from typing import Any

import torch

from pdspark.hardware.backend import DeviceModuleBackend, DeviceUnavailableError
from pdspark.hardware.npu.torch_npu_guard import import_torch_npu

# Operators each feature needs from an extra operator library on the NPU (`namespace::op`).
NPU_REQUIRED_OPS: dict[str, tuple[str, ...]] = {
    "sparse_attention": ("custom::npu_sparse_attn_sharedkv", "custom::npu_sparse_attn_sharedkv_metadata"),
}


class NpuBackend(DeviceModuleBackend):
    name = "npu"
    dist_backend = "hccl"

    def __init__(self) -> None:
        module, missing = import_torch_npu()
        if module is None:
            raise DeviceUnavailableError(f"`device='npu'` is unavailable: {missing}; allowed here: 'cpu'")
        npu: Any = torch.npu  # type: ignore[attr-defined]  # registered by torch_npu
        super().__init__(npu, torch.device("npu", npu.current_device()))

    def required_ops(self, feature: str) -> tuple[str, ...]:
        return NPU_REQUIRED_OPS.get(feature, ())
