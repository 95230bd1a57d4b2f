"""`CpuBackend`: the host CPU, with the C kernels of `pdspark.hardware.cpu.kernels` and no streams."""

from __future__ import annotations

import torch

from pdspark.hardware.backend import HardwareBackend
from pdspark.hardware.cpu import kernels

# The C loops `kernels.load()` provides (each falls back to the PyTorch path when the library cannot be built).
CPU_KERNELS = frozenset({"hc_collapse", "hc_collapse_mixed", "hc_expand", "rms_norm", "rope_rotate", "index_scores",
                         "index_pick", "sink_attend", "moe_decode", "compressor_run", "norm_rope", "attn_out"})


class CpuBackend(HardwareBackend):
    name = "cpu"
    dist_backend = "gloo"
    has_streams = False

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def kernels(self) -> frozenset[str]:
        return CPU_KERNELS if kernels.load() is not None else frozenset()
