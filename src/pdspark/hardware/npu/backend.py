"""`NpuBackend`: an Ascend NPU through `torch_npu` (`torch.npu` streams and events, the `npu` torch device).

Constructing it imports `torch_npu` through `torch_npu_guard`; without it (every machine but an Ascend host) it
raises `DeviceUnavailableError` naming what is missing. The engine runs its PyTorch path on the `npu` device; the
DSV4 sparse-attention operators come from an extra operator library (`PDSPARK_EXTRA_OPS_SO`, e.g. vllm-ascend's
custom-op `.so`), checked by `pdspark.hardware.extra_ops` for the features that use them.

NOTE: untested (no Ascend machine has run it)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from pdspark.hardware.backend import DeviceUnavailableError, HardwareBackend
from pdspark.hardware.npu.torch_npu_guard import import_torch_npu

# Operators each feature needs from an extra operator library on the NPU (`namespace::op`).
NPU_REQUIRED_OPS: dict[str, tuple[str, ...]] = {
    "sparse_attention": ("custom::npu_sparse_attn_sharedkv", "custom::npu_sparse_attn_sharedkv_metadata"),
}


class NpuBackend(HardwareBackend):
    name = "npu"
    has_streams = True

    def __init__(self) -> None:
        module, missing = import_torch_npu()
        if module is None:
            raise DeviceUnavailableError(f"`device='npu'` is unavailable: {missing}; allowed here: 'cpu'")
        self._npu: Any = torch.npu  # type: ignore[attr-defined]  # registered by torch_npu
        self._device = torch.device("npu", self._npu.current_device())

    @property
    def device(self) -> torch.device:
        return self._device

    def kernels(self) -> frozenset[str]:
        return frozenset()

    def required_ops(self, feature: str) -> tuple[str, ...]:
        return NPU_REQUIRED_OPS.get(feature, ())

    def new_stream(self) -> Any:
        return self._npu.Stream(self._device)

    def current_stream(self) -> Any:
        return self._npu.current_stream(self._device)

    @contextmanager
    def use_stream(self, stream: Any) -> Iterator[None]:
        with self._npu.stream(stream):
            yield

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)

    def synchronize(self) -> None:
        self._npu.synchronize(self._device)
