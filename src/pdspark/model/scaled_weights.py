"""`ScaledWeights`: the released checkpoint's quantized weights, each read with its scale (kept compact, or decoded).

A weight `X.weight` stored FP8 (F8_E4M3) or packed MXFP4 (I8, routed experts) has a sibling scale `X.scale` (DeepSeek's
name; `X.weight_scale_inv` in HF's spelling). Reading `X.weight` through `read` returns it with its checked scale
(`Scaled`), through `get` the float32 weight it stands for (`quant/release_formats.py`); the scale itself is never a
tensor of its own. What does not fit is a `CheckpointError`
naming the tensor: a quantized weight without its scale, a scale of the wrong shape or dtype, a scale whose weight is
not quantized or not in the checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

from pdspark.errors import CheckpointError
from pdspark.quant.release_formats import (
    dequant_fp8_blocks,
    dequant_mxfp4,
    fp8_scale_shape,
    mxfp4_scale_shape,
)

_SCALE_SUFFIXES = (".scale", ".weight_scale_inv")
_SCALE_DTYPES = (torch.float8_e8m0fnu, torch.float32)


def scale_owner(name: str) -> str | None:
    """The weight a scale tensor belongs to (`X.scale` / `X.weight_scale_inv` -> `X.weight`); None for other names
    (mHC's `hc_*_scale` parameters end in `_scale`, not `.scale`)."""
    for suffix in _SCALE_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)] + ".weight"
    return None


class Scaled(NamedTuple):
    """A checkpoint tensor as stored: a quantized weight with its checked scale, or any other tensor (scale None)."""

    weight: torch.Tensor  # FP8 e4m3 [out, in], packed MXFP4 int8 [out, in/2], or a plain tensor
    scale: torch.Tensor | None  # FP8: [ceil(out/128), ceil(in/128)] ue8m0 or fp32; MXFP4: ue8m0 [out, in/32]

    def decoded(self) -> torch.Tensor:
        """The float32 weight it stands for (a plain tensor as it is)."""
        if self.scale is None:
            return self.weight
        if self.weight.dtype == torch.float8_e4m3fn:
            return dequant_fp8_blocks(self.weight, self.scale)
        return dequant_mxfp4(self.weight, self.scale)


class ScaledWeights:
    def __init__(self, handles: dict[Path, Any], names: list[tuple[Path, str]],
                 opener: Callable[[Path], Any] | None = None):
        """`handles`: open safetensors files; `names`: every (file, tensor name) of the checkpoint; `opener` opens
        a file again after `release` (a weight whose scale sits in a file already done)."""
        self._handles = handles
        self._opener = opener
        self._where = {name: f for f, name in names}
        self.scales = {owner: name for _, name in names if (owner := scale_owner(name)) is not None}
        self._used: set[str] = set()

    def has_scale(self, name: str) -> bool:
        """A quantized weight (it has a scale beside it)."""
        return name in self.scales

    def is_scale(self, name: str) -> bool:
        """A scale tensor (read with its weight, never on its own)."""
        return scale_owner(name) is not None

    def get(self, name: str) -> torch.Tensor:
        """Tensor `name`; a quantized weight decoded with its scale (float32)."""
        return self.read(name).decoded()

    def release(self, f: Path) -> None:
        """Close file `f` (its mapped pages leave the process: they would count in its resident memory)."""
        self._handles.pop(f, None)

    def _tensor(self, name: str) -> torch.Tensor:
        f = self._where[name]
        if f not in self._handles:
            assert self._opener is not None, f"{f} was released"
            self._handles[f] = self._opener(f)
        return self._handles[f].get_tensor(name)

    def read(self, name: str) -> Scaled:
        """Tensor `name` as stored, a quantized weight with its scale (both checked)."""
        t = self._tensor(name)
        scale_name = self.scales.get(name)
        if scale_name is None:
            if t.dtype == torch.float8_e4m3fn:
                raise CheckpointError(f"tensor {name!r} is FP8 (F8_E4M3) but the checkpoint has no scale for it "
                                      f"({name.removesuffix('.weight')}.scale)")
            return Scaled(t, None)
        self._used.add(scale_name)
        scale = self._tensor(scale_name)
        if scale.dtype not in _SCALE_DTYPES:
            raise CheckpointError(f"tensor {scale_name!r} is {scale.dtype}; allowed: F8_E8M0 (ue8m0) or F32 scales")
        if t.dtype == torch.float8_e4m3fn:
            return Scaled(t, _shaped(scale, scale_name, fp8_scale_shape(*t.shape), "FP8 128x128 tiles"))
        if t.dtype in (torch.int8, torch.uint8):
            out, packed = t.shape
            want = mxfp4_scale_shape(out, 2 * packed)
            if scale.dtype != torch.float8_e8m0fnu:
                raise CheckpointError(f"tensor {scale_name!r} is {scale.dtype}; allowed: F8_E8M0 for an MXFP4 weight")
            return Scaled(t, _shaped(scale, scale_name, want, "MXFP4 groups of 32 inputs"))
        raise CheckpointError(f"tensor {scale_name!r} scales {name!r}, which is {t.dtype}; allowed: a scale beside "
                              "an F8_E4M3 weight or a packed I8 (MXFP4) weight")

    def check_all_used(self, skipped: set[str]) -> None:
        """Every scale belongs to a weight that was read (or deliberately `skipped`: another rank's experts)."""
        unused = sorted(s for w, s in self.scales.items() if s not in self._used and w not in skipped)
        if unused:
            missing = [s for s in unused if scale_owner(s) not in self._where]
            if missing:
                raise CheckpointError(f"scale tensor {missing[0]!r} has no weight {scale_owner(missing[0])!r} in the "
                                      "checkpoint")
            raise CheckpointError(f"scale tensor {unused[0]!r} was not used: its weight is not part of this model")


def _shaped(scale: torch.Tensor, name: str, want: tuple[int, int], what: str) -> torch.Tensor:
    if tuple(scale.shape) != want:
        raise CheckpointError(f"tensor {name!r} has shape {tuple(scale.shape)}; its weight's {what} need {want}")
    return scale
