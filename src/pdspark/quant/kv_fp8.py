"""The FP8 KV cache's row formats (`--kv-cache-dtype fp8_e4m3`), as SGLang packs DeepSeek-V4's cache.

- **Main KV rows** (SWA window, C4 and C128 compressed entries), `KvRowPack`: the `nope = head_dim - rope_dim` leading
  channels as FP8 e4m3 in blocks of 64, each block with a ue8m0 (power-of-two) scale; the `rope_dim` trailing
  (rotated) channels as bf16. One row: nope bytes, then the rope channels' bf16 bytes, then one scale byte per block,
  padded to 8 bytes: 448 + 128 + 7 + 1 = 584 bytes for DeepSeek-V4's 512 = 448 + 64 (SGLang's
  `NopeFp8RopeBf16Pack`, which keeps a page's scale bytes after the page's rows; here they end each row, so a row is
  one contiguous span like a float row). The reference model trains with this very quantization of the window and
  compressed KV (`act_quant(kv[..., :-64], 64, ue8m0)`), rope dims left alone.
- **Indexer key rows** (C4), `IndexRowPack`: FP8 e4m3 in blocks of 128 with an fp32 scale each (`amax / 448`):
  128 + 4 = 132 bytes for DeepSeek-V4's 128 channels.

Both encode `[n, dim]` fp32 rows into `[n, width]` uint8 rows and decode them back to fp32. The C decode step writes
and reads the same bytes (`hardware/cpu/packed_rows.c`: the tests hold the two to each other).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_E4M3_MAX = 448.0
_MAIN_BLOCK = 64
_INDEX_BLOCK = 128


def _blocks(n: int, block: int) -> int:
    return -(-n // block)


def _ceil_log2(y: torch.Tensor) -> torch.Tensor:
    """The least integer e with 2^e >= y (int32) for normal fp32 y, exactly, from y's bits: its exponent, plus one
    unless its mantissa is zero (y a power of two); 0 where y is not finite. (A rounded log2 can land on an integer
    just past a power of two.) Integer ops only, on any device. The C decode step encodes with the same rule
    (`packed_rows.c`)."""
    bits = y.float().contiguous().view(torch.int32)
    e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return torch.where(torch.isfinite(y), e, 0)


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """2^e as fp32 for integer e in [-126, 127], built from its bits (exact); e <= -127 (scale byte 0): +0."""
    return torch.where(e > -127, ((e + 127).clamp_min(0) << 23), 0).to(torch.int32).view(torch.float32)


@dataclass(frozen=True)
class KvRowPack:
    dim: int  # head_dim
    rope: int  # the trailing rotated channels, kept bf16

    @property
    def nope(self) -> int:
        return self.dim - self.rope

    @property
    def scales(self) -> int:
        return _blocks(self.nope, _MAIN_BLOCK)

    @property
    def width(self) -> int:
        """Bytes a row: nope FP8, rope bf16, the scale bytes, padded to 8."""
        used = self.nope + 2 * self.rope + self.scales
        return -(-used // 8) * 8

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        """fp32 `[n, dim]` -> uint8 `[n, width]`."""
        n = rows.shape[0]
        x = rows.float()
        nope, rope = x[:, : self.nope], x[:, self.nope :]
        pad = self.scales * _MAIN_BLOCK - self.nope
        blocks = torch.nn.functional.pad(nope, (0, pad)).view(n, self.scales, _MAIN_BLOCK)
        amax = blocks.abs().amax(-1).clamp_min(1e-4)  # [n, blocks]
        exps = _ceil_log2(amax / _E4M3_MAX)  # a power-of-two scale: ue8m0
        q = (blocks / _pow2(exps)[..., None]).view(n, -1)[:, : self.nope].to(torch.float8_e4m3fn)
        out = torch.zeros(n, self.width, dtype=torch.uint8, device=rows.device)
        out[:, : self.nope] = q.view(torch.uint8)
        out[:, self.nope : self.nope + 2 * self.rope] = rope.to(torch.bfloat16).contiguous().view(torch.uint8)
        start = self.nope + 2 * self.rope
        out[:, start : start + self.scales] = (exps + 127).clamp(0, 254).to(torch.uint8)
        return out

    def decode(self, packed: torch.Tensor) -> torch.Tensor:
        """uint8 `[..., width]` -> fp32 `[..., dim]`."""
        lead = packed.shape[:-1]
        p = packed.reshape(-1, self.width)
        n = p.shape[0]
        start = self.nope + 2 * self.rope
        scale = _pow2(p[:, start : start + self.scales].int() - 127)  # [n, blocks]
        values = p[:, : self.nope].contiguous().view(torch.float8_e4m3fn).float()
        expanded = scale.repeat_interleave(_MAIN_BLOCK, dim=1)[:, : self.nope]
        rope = p[:, self.nope : start].contiguous().view(torch.bfloat16).float()
        return torch.cat([values * expanded, rope], dim=1).view(*lead, self.dim) if n else \
            torch.zeros(*lead, self.dim, device=packed.device)


@dataclass(frozen=True)
class IndexRowPack:
    dim: int  # index_head_dim

    @property
    def scales(self) -> int:
        return _blocks(self.dim, _INDEX_BLOCK)

    @property
    def width(self) -> int:
        return self.dim + 4 * self.scales

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        """fp32 `[n, dim]` -> uint8 `[n, width]`: FP8 values, then fp32 scales (`amax / 448` per 128 channels)."""
        n = rows.shape[0]
        pad = self.scales * _INDEX_BLOCK - self.dim
        blocks = torch.nn.functional.pad(rows.float(), (0, pad)).view(n, self.scales, _INDEX_BLOCK)
        scale = (blocks.abs().amax(-1) / _E4M3_MAX).clamp_min(1e-12)  # [n, blocks]
        q = (blocks / scale[..., None]).view(n, -1)[:, : self.dim].to(torch.float8_e4m3fn)
        out = torch.empty(n, self.width, dtype=torch.uint8, device=rows.device)
        out[:, : self.dim] = q.view(torch.uint8)
        out[:, self.dim :] = scale.contiguous().view(torch.uint8).view(n, -1)
        return out

    def decode(self, packed: torch.Tensor) -> torch.Tensor:
        """uint8 `[..., width]` -> fp32 `[..., dim]`."""
        lead = packed.shape[:-1]
        p = packed.reshape(-1, self.width)
        scale = p[:, self.dim :].contiguous().view(torch.float32)  # [n, blocks]
        values = p[:, : self.dim].contiguous().view(torch.float8_e4m3fn).float()
        return (values * scale.repeat_interleave(_INDEX_BLOCK, dim=1)[:, : self.dim]).view(*lead, self.dim)
