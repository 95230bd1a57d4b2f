"""`PackedRows`: one layer's view of an FP8 cache pool (`--kv-cache-dtype fp8_e4m3`), read and written as float rows.

The pool stores each row packed (`quant/kv_fp8.py`: `[R, width]` uint8); the attention, compressor and indexer code
index it as it indexes a float pool `[R, dim]` of the model's dtype: `index_select(0, rows)` (what
`batch.gather_rows` calls) decodes the rows it gathers, `pool[rows] = values` encodes. Its `dtype` is the storage's
(uint8), so the C kernels that take fp32 rows leave it to the PyTorch path; the C decode step and the indexer's C
pick read and write `storage` in place instead (`hardware/cpu/packed_rows.c`, the same bytes).

NOTE: on the CPU the rows are encoded and decoded by that same C code (`kernels.pack_rows`/`unpack_rows`: the bytes
and floats of `quant/kv_fp8.py`'s torch ops, held to them by `tests/unit/test_packed_rows_c.py`), 16-25x faster
decoding than the torch ops (16,384 rows of 512: 1.6 ms against 34 ms on a Zen 4 core) and ~4x encoding: the
module path's prefill and attention over an FP8 cache read their gathered rows that way.
"""

from __future__ import annotations

from typing import Protocol

import torch

from pdspark.hardware.cpu import kernels as cpu_kernels
from pdspark.hardware.cpu.kernel_abi import INDEX_ROWS
from pdspark.quant.kv_fp8 import IndexRowPack, KvRowPack


class RowPack(Protocol):
    @property
    def dim(self) -> int: ...
    @property
    def width(self) -> int: ...
    def encode(self, rows: torch.Tensor) -> torch.Tensor: ...
    def decode(self, packed: torch.Tensor) -> torch.Tensor: ...


class PackedRows:
    def __init__(self, storage: torch.Tensor, pack: RowPack, rows_dtype: torch.dtype = torch.float32):
        """`storage [R, width]` uint8 (a per-layer view of a page-major pool: rows may be strided); `rows_dtype`:
        the dtype rows are read in (the model's compute dtype)."""
        assert storage.dtype is torch.uint8 and storage.shape[-1] == pack.width, (storage.dtype, storage.shape)
        self.storage = storage
        self.pack = pack
        self.rows_dtype = rows_dtype
        # The C kernels' name for the layout (`packed_rows.c`): main rows by their bf16 rope channels, or index rows.
        self._c_layout = pack.rope if isinstance(pack, KvRowPack) else INDEX_ROWS if isinstance(
            pack, IndexRowPack) else None

    @property
    def shape(self) -> torch.Size:
        return torch.Size([self.storage.shape[0], self.pack.dim])

    @property
    def dtype(self) -> torch.dtype:
        return self.storage.dtype

    @property
    def device(self) -> torch.device:
        return self.storage.device

    @property
    def is_cpu(self) -> bool:
        return self.storage.is_cpu

    def dim(self) -> int:
        return 2

    def index_select(self, axis: int, rows: torch.Tensor) -> torch.Tensor:
        """Rows `rows [n]` decoded -> `[n, dim]` in `rows_dtype`."""
        assert axis == 0
        return self._decode(self.storage.index_select(0, rows))

    def __getitem__(self, rows: torch.Tensor) -> torch.Tensor:
        return self._decode(self.storage[rows])

    def __setitem__(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Encode `values [n, dim]` into rows `rows [n]` (the C codec where it runs: the CPU; else the torch ops)."""
        flat = values.reshape(-1, self.pack.dim)
        packed = cpu_kernels.pack_rows(flat, self._c_layout) if self._c_layout is not None else None
        self.storage[rows] = packed if packed is not None else self.pack.encode(flat)

    def _decode(self, packed: torch.Tensor) -> torch.Tensor:
        """Packed rows `[..., width]` -> `[..., dim]` in `rows_dtype`."""
        flat = packed.reshape(-1, self.pack.width)
        rows = cpu_kernels.unpack_rows(flat, self.pack.dim, self._c_layout) if self._c_layout is not None else None
        if rows is None:
            rows = self.pack.decode(flat)
        return rows.view(*packed.shape[:-1], self.pack.dim).to(self.rows_dtype)
