"""`ProjectionTable`: one projection's weights as the C decode step reads them (`gemm_proj` in compact.c): its rows in
segments one after another, each in its own storage (fp32, bf16 bits, FP8 e4m3 in 128x128 tiles, MXFP4), so a
layer's table reaches a released checkpoint's compact weights as stored, and the bf16 or fp32 matrices beside them,
without a stacked or decoded copy. Every output has the bits of the row-exact GEMM over the weights decoded to fp32,
whatever the storage: an FP8 or MXFP4 block of rows is decoded into fp32 rows (each value `code * scale`, one fp32
multiply) and multiplied by the same kernel.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from pdspark.hardware.cpu import kernel_abi
from pdspark.hardware.cpu import kernels as cpu_kernels
from pdspark.model.compact_experts import FP8, CompactExperts
from pdspark.model.fp8_linear import Fp8Linear
from pdspark.quant.release_formats import FP8_BLOCK

F32, BF16, FP8_TILES, MXFP4 = kernel_abi.PROJ_FORMATS


class Segment(NamedTuple):
    """Rows of a projection in one storage (the words of `kernel_abi.PROJ_SEGMENT`, with the tensors behind them)."""

    fmt: str  # one of `kernel_abi.PROJ_FORMATS`
    rows: int
    data: torch.Tensor  # fp32 / bf16 [rows, K]; e4m3 [rows, K]; uint8 MXFP4 pairs [rows, K / 2]
    scale: torch.Tensor | None = None  # FP8: fp32 tile scales [.., ceil(K / 128)]; MXFP4: uint8 ue8m0 [rows, K / 32]
    row0: int = 0  # FP8: where row 0 sits in the matrix its scales tile
    period: int = 0  # FP8 stacks: rows per matrix (0: one matrix)
    scale_period: int = 0  # FP8 stacks: scale rows per matrix
    luts: tuple[torch.Tensor, ...] = ()  # FP8: e4m3 values [256]; MXFP4: e2m1 values [16], ue8m0 values [256]

    @property
    def inputs(self) -> int:
        """K: the inputs each row multiplies (an MXFP4 byte holds two)."""
        return self.data.shape[-1] * (2 if self.fmt == MXFP4 else 1)


class ProjectionTable(NamedTuple):
    words: torch.Tensor  # int64 [1 + segments * len(PROJ_SEGMENT)]: what the layer table points to
    formats: tuple[str, ...]  # each segment's storage
    keep: tuple[torch.Tensor, ...]  # the tensors behind the pointers, held while the table lives


def _plain(t: torch.Tensor) -> bool:
    return t.is_cpu and t.is_contiguous() and t.dim() >= 2


def float_segment(w: torch.Tensor, bf16_copy: bool) -> Segment | str:
    """A float matrix `[rows, K]` (or a stack `[E, rows, K]`): bf16 as it is, fp32 as it is or as its bf16 copy when
    `bf16_copy` and every value is a bf16 number (the same products from half the bytes)."""
    w = w.detach()
    if not _plain(w) or w.dtype not in (torch.float32, torch.bfloat16):
        return f"a {w.dtype} matrix on {w.device} ({'' if w.is_contiguous() else 'not '}contiguous)"
    rows = w.numel() // w.shape[-1]
    if w.dtype is torch.bfloat16:
        return Segment(BF16, rows, w)
    half = cpu_kernels.bf16_copy(w) if bf16_copy else None
    return Segment(BF16, rows, half) if half is not None else Segment(F32, rows, w)


def fp8_segment(linear: Fp8Linear) -> Segment | str:
    """An FP8 linear: its e4m3 bytes and fp32 tile scales as loaded."""
    w, s = linear.weight, linear.scale
    if not (_plain(w) and s.is_cpu and s.is_contiguous()):
        return "an FP8 linear off the CPU or not contiguous"
    return Segment(FP8_TILES, w.shape[0], w, s, row0=linear.row0, luts=(cpu_kernels.e4m3_values(),))


def expert_segment(experts: CompactExperts, proj: str) -> Segment | str:
    """The held experts' stack of `proj` ("w13": each expert's gate rows then up rows; "w2"), as stored."""
    w, s = getattr(experts, proj), getattr(experts, f"{proj}_scale")
    if not (_plain(w) and s.is_cpu and s.is_contiguous()):
        return f"routed experts' {proj} off the CPU or not contiguous"
    E, rows = w.shape[:2]
    if experts.fmt != FP8:
        return Segment(MXFP4, E * rows, w, s, luts=(experts._e2m1, experts._e8m0))
    if proj == "w13" and rows // 2 % FP8_BLOCK:
        # The up rows' tiles start a tile after the gate rows' last one, mid-tile in the stacked matrix's count.
        return f"FP8 routed experts with {rows // 2} gate rows, not a multiple of {FP8_BLOCK}"
    return Segment(FP8_TILES, E * rows, w, s, period=rows, scale_period=s.shape[1], luts=(cpu_kernels.e4m3_values(),))


def segment_of(part: object, bf16_copy: bool) -> Segment | str:
    """A projection's part as a segment: a float matrix or an FP8 linear (anything else: why not)."""
    if isinstance(part, torch.Tensor):
        return float_segment(part, bf16_copy)
    if isinstance(part, Fp8Linear):
        return fp8_segment(part)
    return f"a {type(part).__name__} projection"


def projection_table(segments: list[Segment]) -> ProjectionTable:
    """The descriptor of `segments`, rows in order (`gemm_proj`'s words)."""
    words = [len(segments)]
    keep: list[torch.Tensor] = []
    for s in segments:
        luts = [t.data_ptr() for t in s.luts] + [0] * (2 - len(s.luts))
        fields = {"format": kernel_abi.PROJ_FORMATS.index(s.fmt), "rows": s.rows, "data": s.data.data_ptr(),
                  "scale": 0 if s.scale is None else s.scale.data_ptr(),
                  "scale_cols": 0 if s.scale is None or s.fmt != FP8_TILES else s.scale.shape[-1], "row0": s.row0,
                  "period": s.period, "scale_period": s.scale_period, "lut": luts[0], "lut2": luts[1]}
        words += [fields[n] for n in kernel_abi.PROJ_SEGMENT]
        keep += [s.data, *s.luts] + ([] if s.scale is None else [s.scale])
    return ProjectionTable(torch.tensor(words, dtype=torch.int64), tuple(s.fmt for s in segments), tuple(keep))
