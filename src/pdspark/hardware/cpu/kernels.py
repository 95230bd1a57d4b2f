"""`CpuKernels`: C loops compiled on first use and called through ctypes.

The source is compiled with the system C compiler into a per-user cache keyed by the source hash, once per
machine. Without a compiler (or with `PDSPARK_NO_C_KERNELS=1`) callers fall back to the PyTorch reference path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

logger = logging.getLogger(__name__)
_SOURCE = Path(__file__).with_name("kernels.c")


def _cache_dir() -> Path:
    root = os.environ.get("PDSPARK_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "pdspark")
    return Path(root) / "kernels"


@cache
def load() -> ctypes.CDLL | None:
    """The compiled kernel library, or None when it cannot be built here."""
    if os.environ.get("PDSPARK_NO_C_KERNELS") == "1":
        return None
    source = _SOURCE.read_bytes()
    lib_path = _cache_dir() / f"libpdspark_cpu_{hashlib.sha256(source).hexdigest()[:16]}.so"
    if not lib_path.exists():
        cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if cc is None:
            logger.warning("no C compiler found; using the slower PyTorch path for mHC")
            return None
        lib_path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=lib_path.parent) as tmp:
            out = Path(tmp) / lib_path.name
            cmd = [cc, "-O2", "-fPIC", "-shared", "-fno-fast-math", str(_SOURCE), "-o", str(out), "-lm"]
            result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode != 0:
                logger.warning("building CPU kernels failed (%s); using the PyTorch path", result.stderr[-500:])
                return None
            os.replace(out, lib_path)  # atomic: concurrent builders race harmlessly
    lib = ctypes.CDLL(str(lib_path))
    f = ctypes.c_void_p
    lib.hc_split_sinkhorn.argtypes = [f, f, f, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_float, f, f, f]
    lib.hc_split_sinkhorn.restype = None
    return lib


def hc_split_sinkhorn(
    mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """`mixes [T, (2+hc)*hc]` fp32 -> `(pre [T, hc], post [T, hc], comb [T, hc, hc])`; None if unavailable."""
    lib = load()
    if lib is None or mixes.device.type != "cpu":
        return None
    mixes = mixes.contiguous()
    scale = scale.detach().float().contiguous()
    base = base.detach().float().contiguous()
    T = mixes.shape[0]
    pre = torch.empty(T, hc, dtype=torch.float32)
    post = torch.empty(T, hc, dtype=torch.float32)
    comb = torch.empty(T, hc, hc, dtype=torch.float32)
    lib.hc_split_sinkhorn(
        mixes.data_ptr(), scale.data_ptr(), base.data_ptr(), T, hc, iters, eps,
        pre.data_ptr(), post.data_ptr(), comb.data_ptr(),
    )
    return pre, post, comb
