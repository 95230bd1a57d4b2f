"""`HardwareBackend`: what the engine needs from the device it runs on, behind one interface.

A backend names its torch device, hands out streams and events (real ones on CUDA and NPU, no-ops on the CPU, where
everything runs in program order on the calling thread anyway), and says which fused kernels it provides and which
operators each feature needs from extra operator libraries (`pdspark.hardware.extra_ops`). Backends are chosen by
name in one place, `pdspark.hardware.registry.select_backend`, which raises `DeviceUnavailableError` naming what is
missing on this machine (no CUDA device, no `torch_npu`) before anything is allocated.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from pdspark.errors import ConfigError


class DeviceUnavailableError(ConfigError):
    """`--device` names a backend this machine cannot run (the message says what is missing)."""


class NullStream:
    """A stream on a device without streams: every call is a no-op, so code written for streams runs unchanged and
    in program order (CPU results stay bit-identical to the code without streams)."""

    def wait_stream(self, other: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass


class HardwareBackend(ABC):
    """One kind of device. Subclasses are cheap to construct and hold no tensors."""

    name: str  # the `--device` value
    has_streams: bool  # whether `new_stream` gives real, concurrent streams
    dist_backend: str  # the torch.distributed backend a worker group on this device communicates with
    # Features the engine runs through extra-library operators on this backend, checked at start-up. None yet: the
    # engine runs its PyTorch path on every backend (`required_ops` lists what each feature will need).
    op_features: tuple[str, ...] = ()

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """Where the engine's weights, pools and step tensors live."""

    @abstractmethod
    def kernels(self) -> frozenset[str]:
        """Names of the fused kernels this backend runs instead of the PyTorch reference path."""

    def required_ops(self, feature: str) -> tuple[str, ...]:
        """`namespace::op` names that `feature` needs from an extra operator library on this backend (none by
        default: the engine's own path is plain torch)."""
        return ()

    def new_stream(self) -> Any:
        return NullStream()

    def current_stream(self) -> Any:
        return NullStream()

    @contextmanager
    def use_stream(self, stream: Any) -> Iterator[None]:
        """Run the block's work on `stream` (a no-op without streams)."""
        yield

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        """Mark `tensor` as used on `stream` (a no-op without streams: `Tensor.record_stream` refuses CPU streams)."""
        return None

    def synchronize(self) -> None:
        """Wait for every queued kernel of the device (a no-op on the CPU)."""
        return None


class DeviceModuleBackend(HardwareBackend):
    """An accelerator reached through a torch device module (`torch.cuda`, or `torch.npu` that `torch_npu`
    registers): both expose the same stream API, so streams, events and synchronisation are written once here."""

    has_streams = True

    def __init__(self, api: Any, device: torch.device) -> None:
        self._api = api  # the device module: Stream, current_stream, stream, synchronize
        self._device = device

    @property
    def device(self) -> torch.device:
        return self._device

    def kernels(self) -> frozenset[str]:
        return frozenset()  # the PyTorch path: the C kernels are host-only

    def new_stream(self) -> Any:
        return self._api.Stream(self._device)

    def current_stream(self) -> Any:
        return self._api.current_stream(self._device)

    @contextmanager
    def use_stream(self, stream: Any) -> Iterator[None]:
        with self._api.stream(stream):
            yield

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)

    def synchronize(self) -> None:
        self._api.synchronize(self._device)
