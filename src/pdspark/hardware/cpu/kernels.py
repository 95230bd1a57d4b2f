"""`CpuKernels`: C loops compiled on first use and called through ctypes.

The C source (kernels.c and the parts it includes) is compiled with the system C compiler for the host CPU
(`-march=native`) into a per-user cache (`kernel_build`: keyed by the sources, the CPU's feature flags, the compile
command and the compiler's version), once per machine. Without a compiler (or with `PDSPARK_NO_C_KERNELS=1`, or a
library whose `pdspark_abi` contradicts its Python mirrors, `kernel_abi.ABI_MIRRORS`) callers fall back to the
PyTorch reference path.

The boundary: the C loops trust the sizes they are given, so every array they index comes from a buffer Python sized
with the C library's own formulas or limits (`moe_rows_scratch_floats`, `decode_layer_scratch_floats`,
`pdspark_abi`), and the step builders check what they hand over (`model.cpu.decode_step`, `model.cpu.draft_step`);
`KernelArgumentError` is what a wrong one raises.
"""

from __future__ import annotations

import ctypes
import logging
import os
from functools import cache
from pathlib import Path
from typing import Protocol

import torch

from pdspark.errors import ExpertExchangeError
from pdspark.hardware.cpu.kernel_abi import (
    DECODE_LAYOUT,
    DECODE_SIZES,
    DECODE_STEP,
    DECODE_STEP_SIZES,
    INDEX_KEYS,
    INDEX_MAX_TOKENS,
    INDEX_ROWS,
    ROW_BLOCK,
    abi_mismatches,
    library_abi,
)
from pdspark.hardware.cpu.kernel_build import build_library

logger = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("kernels.c")  # the library's one translation unit (benchmarks build variants of it)


class CompressPlanLike(Protocol):
    """The index tensors of `model.batch.CompressPlan` (the model layer sits above this one)."""

    @property
    def out_rows(self) -> torch.Tensor: ...
    @property
    def positions(self) -> torch.Tensor: ...
    @property
    def use_cur(self) -> torch.Tensor: ...
    @property
    def cur_rows(self) -> torch.Tensor: ...
    @property
    def hist_rows(self) -> torch.Tensor: ...
    @property
    def write_tokens(self) -> torch.Tensor: ...
    @property
    def write_rows(self) -> torch.Tensor: ...


@cache
def load() -> ctypes.CDLL | None:
    """The compiled kernel library, or None when it cannot be built here."""
    if os.environ.get("PDSPARK_NO_C_KERNELS") == "1":
        return None
    built = build_library(SOURCE)
    if built is None:
        return None
    lib = built.lib
    lib.pdspark_abi.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.pdspark_abi.restype = ctypes.c_int
    mismatches = abi_mismatches(library_abi(lib))
    if mismatches:
        logger.error("the kernel library %s disagrees with kernels.py: %s; using the PyTorch path", built.path,
                     "; ".join(mismatches))
        return None
    f = ctypes.c_void_p
    i, fl = ctypes.c_int, ctypes.c_float
    lib.hc_collapse.argtypes = [f, f, f, f, i, i, i, i, fl, fl, f, f, f, f, f, f, fl]
    lib.hc_collapse.restype = None
    lib.hc_collapse_mixed.argtypes = [f, f, f, f, i, i, i, i, fl, f, f, f, f]
    lib.hc_collapse_mixed.restype = None
    lib.hc_expand.argtypes = [f, f, f, f, i, i, i, f]
    lib.hc_expand.restype = None
    lib.rms_norm.argtypes = [f, ctypes.c_long, f, i, i, fl, f]
    lib.rms_norm.restype = None
    lib.rope_rotate.argtypes = [f, f, f, i, i, i, i, fl, f]
    lib.rope_rotate.restype = None
    lib.index_scores.argtypes = [f, f, f, ctypes.c_long, i, i, i, i, fl, f]
    lib.index_scores.restype = None
    lib.moe_decode.argtypes = [f, f, ctypes.c_long, f, f, f, f, f, f, i, i, i, i, i, i, fl, fl, f, f, f, f]
    lib.moe_decode.restype = None
    lib.moe_decode_rows.argtypes = [f, f, ctypes.c_long, f, f, f, f, f, f, i, i, i, i, i, f, i, i, i, fl, fl, f, f,
                                    f, f]
    lib.moe_decode_rows.restype = ctypes.c_int
    lib.moe_rows_scratch_floats.argtypes = [i, i, i, i]
    lib.moe_rows_scratch_floats.restype = ctypes.c_long
    lib.sink_attend.argtypes = [f, f, ctypes.c_long, f, f, i, f, ctypes.c_long, f, f, i, f, fl, i, i, i, f, f]
    lib.sink_attend.restype = None
    lib.compressor_run.argtypes = [f, ctypes.c_long, f, i, f, i, i, i, i, f, f, f, f, f, i, f, f, f, fl, f, f, i,
                                   f, f, ctypes.c_long, f, ctypes.c_long, f]
    lib.compressor_run.restype = None
    lib.index_pick.argtypes = [f, f, f, ctypes.c_long, i, f, f, i, i, i, i, fl, i, f, f]
    lib.index_pick.restype = None
    lib.index_pick_shared.argtypes = [f, f, f, ctypes.c_long, i, f, f, i, i, i, i, fl, i, f, i, f, f]
    lib.index_pick_shared.restype = None
    lib.index_pick_shared_scratch_floats.argtypes = [i]
    lib.index_pick_shared_scratch_floats.restype = ctypes.c_long
    lib.topk_mask.argtypes = [f, f, i, i, i, f, f]
    lib.topk_mask.restype = None
    lib.compact_picks.argtypes = [f, f, i, i, i, f, f]
    lib.compact_picks.restype = None
    lib.norm_rope.argtypes = [f, ctypes.c_long, f, i, i, i, fl, f, f, i, f, f, ctypes.c_long, f]
    lib.norm_rope.restype = None
    lib.attn_out.argtypes = [f, f, f, i, i, i, i, f, i, i, f, i, f, f]
    lib.attn_out.restype = None
    lib.attn_out_rows.argtypes = [f, f, f, i, i, i, i, f, i, i, f, i, f, f]
    lib.attn_out_rows.restype = None
    lib.decode_layer.argtypes = [f, f, f, f, f, f, f, f, f, ctypes.c_long, f]
    lib.decode_layer.restype = i
    lib.pool_threads.argtypes = [i]
    lib.pool_threads.restype = None
    lib.lm_head.argtypes = [f, i, i, i, f, f, f, fl, fl, f, fl, f, i, i, f, f]
    lib.lm_head.restype = None
    lib.linear_rows.argtypes = [f, f, i, i, i, f]
    lib.linear_rows.restype = None
    lib.linear_rows_h.argtypes = [f, f, i, i, i, f]
    lib.linear_rows_h.restype = None
    lib.linear_fp8.argtypes = [f, f, f, i, i, f, i, i, i, f]
    lib.linear_fp8.restype = i
    lib.linear_mxfp4.argtypes = [f, f, f, f, f, i, i, i, f]
    lib.linear_mxfp4.restype = i
    lib.linear_proj.argtypes = [f, ctypes.c_long, f, i, i, i, f]
    lib.linear_proj.restype = i
    lib.draft_scratch_floats.argtypes = [f, i, i]
    lib.draft_scratch_floats.restype = ctypes.c_long
    lib.draft_block.argtypes = [f, f, f, f, f, i, f, f, f, i, f, f]
    lib.draft_block.restype = None
    lib.draft_inject.argtypes = [f, f, f, f, i, f, f, f, f]
    lib.draft_inject.restype = None
    lib.decode_index.argtypes = [f, f, f, f]
    lib.decode_index.restype = i
    lib.decode_layers.argtypes = [i, f, f, f, f, i, i, i, f, f, f, ctypes.c_long, f, f, f, i]
    lib.decode_layer_scratch_floats.argtypes = [f, i, i, i, i]
    lib.decode_layer_scratch_floats.restype = ctypes.c_long
    lib.decode_layers.restype = i
    lib.pack_rows.argtypes = [f, ctypes.c_long, i, i, f]
    lib.pack_rows.restype = None
    lib.unpack_rows.argtypes = [f, ctypes.c_long, i, i, f]
    lib.unpack_rows.restype = None
    return lib


def _usable(*tensors: torch.Tensor) -> ctypes.CDLL | None:
    """The library, when every tensor is a contiguous fp32 CPU tensor (what the C loops read)."""
    lib = load()
    if lib is None:
        return None
    for t in tensors:  # (attribute checks only: this runs on every call of every kernel)
        if not (t.is_cpu and t.dtype is torch.float32 and t.is_contiguous()):
            return None
    return lib


def _row_major(t: torch.Tensor) -> bool:
    """A 2-D fp32 CPU matrix whose rows are contiguous (a per-layer view of a page-major pool, a column slice)."""
    return t.is_cpu and t.dtype is torch.float32 and t.dim() == 2 and t.stride(1) == 1


_FLAGS = (torch.bool, torch.uint8)  # one byte per entry, what the C loops read as `unsigned char`


def _check_index(kernel: str, name: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...], shape: tuple[int, ...],
                 rows: int | None = None) -> None:
    """An index array as the C loop reads it: one of `dtypes`, exactly `shape`, and with `rows`, every value a row
    in [0, rows). Raises `KernelArgumentError` naming the kernel and the argument (a caller's bug: never a reason
    to fall back). (Contiguity is checked by the callers: a strided index array falls back to PyTorch.)"""
    if t.dtype not in dtypes or tuple(t.shape) != shape:
        raise KernelArgumentError(f"{kernel}: `{name}` must be {'/'.join(map(str, dtypes))} of shape {shape}; got "
                                  f"{t.dtype} {tuple(t.shape)}")
    if rows is not None and t.numel():
        low, high = (int(v) for v in torch.aminmax(t))  # (one pass)
        if low < 0 or high >= rows:
            raise KernelArgumentError(f"{kernel}: `{name}` holds rows [{low}, {high}]; the pool has {rows}")


def hc_collapse(
    h: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, iters: int, eps: float,
    norm_eps: float, x_norm: tuple[torch.Tensor, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The whole mHC collapse in one call: `h [T, hc, D]` -> `(x [T, D], post [T, hc], comb [T, hc, hc])`; with
    `x_norm = (weight [D], eps)` x comes back RMS-normalised (the sublayer's input norm, in the same call).

    `fn [M, hc*D]`, `scale [3]`, `base [M]` must already be contiguous fp32 (see `HyperConnection.freeze`);
    None when the C path does not apply."""
    lib = _usable(h, fn, scale, base) if x_norm is None else _usable(h, fn, scale, base, x_norm[0])
    if lib is None:
        return None
    T, hc, D = h.shape
    M = fn.shape[0]
    # One allocation: x | post | comb | pre | scratch (normalised rows + mixes).
    buf = torch.empty(T * (D + 2 * hc + hc * hc + hc * D + M))
    x, post, comb, pre, scratch = buf.split([T * D, T * hc, T * hc * hc, T * hc, T * (hc * D + M)])
    lib.hc_collapse(
        h.data_ptr(), fn.data_ptr(), scale.data_ptr(), base.data_ptr(), T, hc, D, iters, eps, norm_eps,
        scratch.data_ptr(), x.data_ptr(), pre.data_ptr(), post.data_ptr(), comb.data_ptr(),
        None if x_norm is None else x_norm[0].data_ptr(), 0.0 if x_norm is None else x_norm[1],
    )
    return x.view(T, D), post.view(T, hc), comb.view(T, hc, hc)


def hc_collapse_mixed(
    h: torch.Tensor, mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, iters: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """`hc_collapse` with the mixes `[T, (2+hc)*hc]` already computed (long chunks, by a BLAS matmul)."""
    lib = _usable(h, mixes, scale, base)
    if lib is None:
        return None
    T, hc, D = h.shape
    buf = torch.empty(T * (D + 2 * hc + hc * hc))
    x, post, comb, pre = buf.split([T * D, T * hc, T * hc * hc, T * hc])
    lib.hc_collapse_mixed(
        h.data_ptr(), mixes.data_ptr(), scale.data_ptr(), base.data_ptr(), T, hc, D, iters, eps,
        x.data_ptr(), pre.data_ptr(), post.data_ptr(), comb.data_ptr(),
    )
    return x.view(T, D), post.view(T, hc), comb.view(T, hc, hc)


def hc_expand(y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor | None:
    """`post * y + comb^T @ residual` per token in one call (`y [T, D]`, `residual [T, hc, D]`); None when the C
    path does not apply."""
    lib = _usable(y, residual, post, comb)
    if lib is None:
        return None
    T, hc, D = residual.shape
    out = torch.empty_like(residual)
    lib.hc_expand(y.data_ptr(), residual.data_ptr(), post.data_ptr(), comb.data_ptr(), T, hc, D, out.data_ptr())
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor | None:
    """RMS-normalise the last dim of `x` (times `weight [D]` when given) in one call; `x` may also be a column
    slice `[N, D]` of a wider fp32 matrix (a split of a fused projection). None when the C path does not apply."""
    D = x.shape[-1]
    if x.dim() == 2 and x.stride(1) == 1 and x.is_cpu and x.dtype is torch.float32:
        stride = x.stride(0)
        lib = load() if weight is None else _usable(weight)
    else:
        stride = D
        lib = _usable(x) if weight is None else _usable(x, weight)
    if lib is None:
        return None
    out = torch.empty(x.shape, dtype=torch.float32)
    lib.rms_norm(x.data_ptr(), stride, None if weight is None else weight.data_ptr(), x.numel() // D, D, eps,
                 out.data_ptr())
    return out


def rope_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> torch.Tensor | None:
    """Rotate the trailing `r` channels of `x [T, D]` or `[T, H, D]` by per-token tables `cos/sin [T, 1, r]`
    (sin signed per pair); `sign=-1` rotates backwards. None when the C path does not apply."""
    lib = _usable(x, cos, sin)
    if lib is None:
        return None
    T, D, r = x.shape[0], x.shape[-1], cos.shape[-1]
    H = x.numel() // (T * D) if T else 0
    out = torch.empty_like(x)
    lib.rope_rotate(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), T, H, D, r, sign, out.data_ptr())
    return out


def index_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor | None:
    """Lightning-indexer scores `[T, V]` of `q [T, H, D]` with head weights `w [T, H]` against `keys [T, V, D]`
    (each query its own) or `[V, D]` (shared by all queries), in the order of `model.indexer.index_scores`'s
    PyTorch path (bit for bit). None when the C path does not apply."""
    lib = _usable(q, w, keys)
    if lib is None:
        return None
    T, H, D = q.shape
    V = keys.shape[-2]
    out = torch.empty(T, V)
    if T and V:
        kstride = V * D if keys.dim() == 3 else 0
        lib.index_scores(q.data_ptr(), w.data_ptr(), keys.data_ptr(), kstride, T, H, V, D, scale, out.data_ptr())
    return out


def moe_decode(
    x: torch.Tensor, lgu: torch.Tensor, input_ids: torch.Tensor, tid2eid: torch.Tensor | None,
    bias: torch.Tensor | None, w13: torch.Tensor, w2: torch.Tensor, w2s: torch.Tensor, top_k: int,
    sqrtsoftplus: bool, scaling: float, limit: float, held: tuple[int, int] | None = None, exchange: int = 0,
) -> torch.Tensor | None:
    """A few tokens' whole MoE after the fused router + shared gate/up matmul `lgu [T, E + 2I]` (a row-contiguous
    matrix, possibly a column slice): routing, the routed experts `w13 [E, 2I, D]`, `w2 [E, D, I]` and the shared
    expert's down projection `w2s [D, I]`, in one call -> `[T, D]`. None when the C path does not apply.
    Expert parallelism (`held`, `exchange`): as `moe_decode_rows`, which then runs (the same bits)."""
    if not _row_major(lgu):
        return None
    lib = _usable(x, w13, w2, w2s) if bias is None else _usable(x, w13, w2, w2s, bias)
    if lib is None or input_ids.dtype is not torch.int64 or not input_ids.is_contiguous():
        return None
    T, D = x.shape
    _, I2, _ = w13.shape
    E = lgu.shape[1] - I2 if held is not None else w13.shape[0]
    I = I2 // 2
    _check_index("moe_decode", "input_ids", input_ids, (torch.int64,), (T,))
    if tid2eid is not None:
        _check_index("moe_decode", "tid2eid", tid2eid, (torch.int64,), (tid2eid.shape[0], top_k), E)
        if not tid2eid.is_contiguous() or (T and int(input_ids.max()) >= tid2eid.shape[0]):
            raise KernelArgumentError("moe_decode: `input_ids` past the rows of a contiguous `tid2eid`")
    if lgu.shape[1] < E + I2 or (bias is not None and bias.numel() != E) or not 1 <= top_k <= E:
        raise KernelArgumentError(f"moe_decode: router logits [T, {E} + {I2}], bias [{E}], 1 <= top_k <= {E}")
    if held is not None:
        if not (held[0] >= 0 and held[1] == w13.shape[0] and held[0] + held[1] <= E):
            raise KernelArgumentError(f"moe_decode: held experts {held} of {E}; `w13` holds {w13.shape[0]}")
        return moe_decode_rows(x, lgu, input_ids, tid2eid, bias, w13, w2, w2s, top_k, sqrtsoftplus, scaling, limit,
                               held, exchange)
    ids = torch.empty(top_k, dtype=torch.int64)  # the current token's experts
    out = torch.empty(T, D)
    scratch = torch.empty(3 * I + 2 * D + top_k)  # gate|up, act, acc, y, then the token's routing weights
    lib.moe_decode(
        x.data_ptr(), lgu.data_ptr(), lgu.stride(0), input_ids.data_ptr(),
        None if tid2eid is None else tid2eid.data_ptr(), None if bias is None else bias.data_ptr(),
        w13.data_ptr(), w2.data_ptr(), w2s.data_ptr(), T, D, E, I, top_k, int(sqrtsoftplus), scaling, limit,
        scratch.data_ptr(), ids.data_ptr(), scratch[3 * I + 2 * D :].data_ptr(), out.data_ptr(),
    )
    return out


def moe_decode_rows(
    x: torch.Tensor, lgu: torch.Tensor, input_ids: torch.Tensor, tid2eid: torch.Tensor | None,
    bias: torch.Tensor | None, w13: torch.Tensor, w2: torch.Tensor, w2s: torch.Tensor, top_k: int,
    sqrtsoftplus: bool, scaling: float, limit: float, held: tuple[int, int] | None = None, exchange: int = 0,
) -> torch.Tensor:
    """`moe_decode` (same arguments, same bits) with each routed expert read once for all the rows that picked it:
    the form `decode_layer` runs for a verify step's rows. The caller checked the tensors as `moe_decode` does.

    Expert parallelism: `held = (e0, n)`, this rank's experts `[e0, e0 + n)` of the `n_experts` the router scores
    (`lgu [T, n_experts + 2I]`; `w13`, `w2` hold those n only), and `exchange` the address of an `expert_exchange`
    C function (`pdspark.parallel.slot_exchange`) that sums the (token, slot) outputs over the group; raises
    `ExpertExchangeError` when it reports a failure."""
    lib = load()
    assert lib is not None
    T, D = x.shape
    n_held, I2, _ = w13.shape
    e0, n_held = held if held is not None else (0, n_held)
    E = lgu.shape[1] - I2 if held is not None else n_held
    I = I2 // 2
    ids = torch.empty(T * top_k, dtype=torch.int64)
    ws = torch.empty(T * top_k)
    fs = torch.empty(lib.moe_rows_scratch_floats(T, top_k, D, I))  # (an expert may gather T * top_k rows)
    out = torch.empty(T, D)
    if lib.moe_decode_rows(
        x.data_ptr(), lgu.data_ptr(), lgu.stride(0), input_ids.data_ptr(),
        None if tid2eid is None else tid2eid.data_ptr(), None if bias is None else bias.data_ptr(),
        w13.data_ptr(), w2.data_ptr(), w2s.data_ptr(), T, D, E, e0, n_held, exchange or None, I, top_k,
        int(sqrtsoftplus), scaling, limit, ids.data_ptr(), ws.data_ptr(), fs.data_ptr(), out.data_ptr(),
    ) != 0:
        raise ExpertExchangeError("moe_decode_rows: the expert exchange failed")
    return out


def sink_attend(
    q: torch.Tensor, swa: torch.Tensor, win_rows: torch.Tensor, win_valid: torch.Tensor, comp: torch.Tensor | None,
    comp_rows: torch.Tensor | None, comp_valid: torch.Tensor | None, sink: torch.Tensor, scale: float,
) -> torch.Tensor | None:
    """`model.attention.sink_attention` of `q [T, H, d]` over each token's window rows of the pool `swa`
    (`win_rows/win_valid [T, W]`) and its compressed rows of `comp` (`comp_rows/comp_valid [T, V]`, or None), read
    in place (pools may be per-layer views with a row stride) -> `[T, H, d]`. None when the C path does not apply."""
    lib = _usable(q, sink)
    if lib is None or not _row_major(swa) or (comp is not None and not _row_major(comp)):
        return None
    T, H, d = q.shape
    W = win_rows.shape[1]
    V = 0 if comp_rows is None else comp_rows.shape[1]
    for idx in (win_rows, win_valid, comp_rows, comp_valid):
        if idx is not None and not (idx.is_cpu and idx.is_contiguous()):
            return None
    _check_index("sink_attend", "win_rows", win_rows, (torch.int64,), (T, W), swa.shape[0])
    _check_index("sink_attend", "win_valid", win_valid, _FLAGS, (T, W))
    if comp is not None or comp_rows is not None:
        if comp is None or comp_rows is None or comp_valid is None:
            raise KernelArgumentError("sink_attend: `comp`, `comp_rows` and `comp_valid` go together")
        _check_index("sink_attend", "comp_rows", comp_rows, (torch.int64,), (T, V), comp.shape[0])
        _check_index("sink_attend", "comp_valid", comp_valid, _FLAGS, (T, V))
    if swa.shape[1] < d or (comp is not None and comp.shape[1] < d) or sink.numel() != H:
        raise KernelArgumentError(f"sink_attend: rows of {d} channels and {H} sinks expected")
    out = torch.empty(T, H, d)
    scratch = torch.empty(H * (W + V))
    lib.sink_attend(
        q.data_ptr(), swa.data_ptr(), swa.stride(0), win_rows.data_ptr(), win_valid.data_ptr(), W,
        None if comp is None else comp.data_ptr(), 0 if comp is None else comp.stride(0),
        None if comp_rows is None else comp_rows.data_ptr(), None if comp_valid is None else comp_valid.data_ptr(),
        V, sink.data_ptr(), scale, T, H, d, scratch.data_ptr(), out.data_ptr(),
    )
    return out


def compressor_run(
    projected: torch.Tensor, positions: torch.Tensor, ape: torch.Tensor, ratio: int, dim: int, overlap: bool,
    plan: CompressPlanLike, norm_w: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
    state: torch.Tensor, pool: torch.Tensor,
) -> bool:
    """`model.compressor.Compressor.run` in one call: state rows of `projected [T, 2w]` (a row-contiguous matrix,
    possibly a column slice), the closing groups of `plan` pooled, normalised and rotated (tables `cos/sin
    [max_len, r]`) into `pool`, and the rows to keep written to `state`. False when the C path does not apply."""
    if not (_row_major(projected) and _row_major(state) and _row_major(pool)):
        return False
    lib = _usable(ape, norm_w, cos, sin)
    if lib is None or not (positions.dtype is torch.int64 and positions.is_contiguous()):
        return False
    for idx in (plan.out_rows, plan.positions, plan.use_cur, plan.cur_rows, plan.hist_rows, plan.write_tokens,
                plan.write_rows):
        if not (idx.is_cpu and idx.is_contiguous()):
            return False
    T = projected.shape[0]
    w = ape.shape[1]
    rows = torch.empty(T * 2 * w + 3 * dim)  # [T, 2w] state rows, then the kernel's scratch
    G, N = plan.out_rows.shape[0], plan.write_tokens.shape[0]
    span = (2 if overlap else 1) * ratio
    k = "compressor_run"
    _check_index(k, "positions", positions, (torch.int64,), (T,))
    _check_index(k, "plan.out_rows", plan.out_rows, (torch.int64,), (G,), pool.shape[0])
    _check_index(k, "plan.positions", plan.positions, (torch.int64,), (G,), cos.shape[0])
    _check_index(k, "plan.use_cur", plan.use_cur, _FLAGS, (G, span))
    _check_index(k, "plan.cur_rows", plan.cur_rows, (torch.int64,), (G, span), max(T, 1))
    _check_index(k, "plan.hist_rows", plan.hist_rows, (torch.int64,), (G, span), state.shape[0])
    _check_index(k, "plan.write_tokens", plan.write_tokens, (torch.int64,), (N,), max(T, 1))
    _check_index(k, "plan.write_rows", plan.write_rows, (torch.int64,), (N,), state.shape[0])
    if projected.shape[1] < 2 * w or state.shape[1] < 2 * w or pool.shape[1] < dim or ape.shape[0] != ratio:
        raise KernelArgumentError(f"{k}: projected/state rows of {2 * w}, pool rows of {dim}, ape [{ratio}, {w}]")
    lib.compressor_run(
        projected.data_ptr(), projected.stride(0), positions.data_ptr(), T, ape.data_ptr(), ratio, dim, int(overlap),
        G, plan.out_rows.data_ptr(), plan.positions.data_ptr(), plan.use_cur.data_ptr(), plan.cur_rows.data_ptr(),
        plan.hist_rows.data_ptr(), N, plan.write_tokens.data_ptr(), plan.write_rows.data_ptr(), norm_w.data_ptr(),
        eps, cos.data_ptr(), sin.data_ptr(), cos.shape[1], rows.data_ptr(), state.data_ptr(), state.stride(0),
        pool.data_ptr(), pool.stride(0), rows[T * 2 * w :].data_ptr(),
    )
    return True


def _index_keys(kernel: str, keys: torch.Tensor, D: int, layout: str) -> int | None:
    """The pool rows `keys` holds if it is what the indexer's C picks read in `layout` (`kernel_abi.INDEX_KEYS`),
    else None: "rows", an fp32 row-major pool of at least `D` channels; "packed", the FP8 cache's uint8 key rows
    `[R, D + 4 * ceil(D / 128)]` (`quant.kv_fp8.IndexRowPack`); "blocked", fp32 blocks `[B, D, ROW_BLOCK]` of
    `ROW_BLOCK` rows each, channel-major (`model.blocked_rows.BlockedRows.blocks`)."""
    if layout not in INDEX_KEYS:
        raise KernelArgumentError(f"{kernel}: `layout` is {layout!r}; allowed: {list(INDEX_KEYS)}")
    if layout == "rows":
        usable = _row_major(keys)
        if usable and keys.shape[1] < D:
            raise KernelArgumentError(f"{kernel}: keys of {D} channels expected")
        return keys.shape[0] if usable else None
    if layout == "blocked":
        if not (keys.is_cpu and keys.dtype is torch.float32 and keys.dim() == 3 and keys.shape[2] == ROW_BLOCK
                and keys.stride(2) == 1 and keys.stride(1) == ROW_BLOCK):
            return None
        if keys.shape[1] != D:
            raise KernelArgumentError(f"{kernel}: key blocks of {D} channels expected, not {keys.shape[1]}")
        return keys.shape[0] * ROW_BLOCK
    if not (keys.is_cpu and keys.dtype is torch.uint8 and keys.dim() == 2 and keys.stride(1) == 1):
        return None
    width = D + 4 * -(-D // 128)
    if keys.shape[1] != width:
        raise KernelArgumentError(f"{kernel}: packed key rows of {width} bytes expected, not {keys.shape[1]}")
    return keys.shape[0]


def index_pick(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor,
               scale: float, topk: int, layout: str = "rows") -> torch.Tensor | None:
    """The indexer's pick for decode/verify tokens in one call: `index_scores` of `q [T, H, D]`, `w [T, H]` against
    the pool rows `keys[rows]` (`rows/valid [T, V]`, read in place), then the top `topk` valid entries of each token
    under the tie rule (`model.indexer.select_topk`) -> the mask `[T, V]` bool. None when the C path does not
    apply. `layout`: how `keys` holds the pool's rows (`_index_keys`): fp32 rows, the FP8 cache's packed rows
    (decoded as they are read: the scores of the decoded floats) or fp32 rows in blocks; the same scores for the
    same floats in any."""
    lib = _usable(q, w)
    T, H, D = q.shape
    held = None if lib is None else _index_keys("index_pick", keys, D, layout)
    if lib is None or held is None or not (rows.is_contiguous() and valid.is_contiguous() and rows.is_cpu):
        return None
    V = rows.shape[1]
    _check_index("index_pick", "rows", rows, (torch.int64,), (T, V), held)
    _check_index("index_pick", "valid", valid, _FLAGS, (T, V))
    if tuple(w.shape) != (T, H):
        raise KernelArgumentError(f"index_pick: head weights [{T}, {H}] expected")
    picked = torch.empty(T, V, dtype=torch.bool)
    scratch = torch.empty(2 * V)
    lib.index_pick(q.data_ptr(), w.data_ptr(), keys.data_ptr(), keys.stride(0), INDEX_KEYS.index(layout),
                   rows.data_ptr(), valid.data_ptr(), T, H, V, D, scale, topk, scratch.data_ptr(), picked.data_ptr())
    return picked


def pack_rows(rows: torch.Tensor, rope: int) -> torch.Tensor | None:
    """`rows [n, dim]` (fp32, or any float dtype: taken as fp32) -> the FP8 cache's packed rows `[n, width]` uint8,
    as the C decode step writes them: main KV rows with `rope` trailing bf16 channels (`quant.kv_fp8.KvRowPack`), or
    indexer key rows with `rope = kernel_abi.INDEX_ROWS` (`IndexRowPack`); the same bytes as those classes' `encode`
    (`tests/unit/test_packed_rows_c.py`). None without the C kernels or off the CPU."""
    lib = load()
    if lib is None or not rows.is_cpu or rows.dim() != 2:
        return None
    x = rows.float().contiguous()
    n, dim = x.shape
    width = dim + 4 * -(-dim // 128) if rope == INDEX_ROWS else -(-(dim + rope + -(-(dim - rope) // 64)) // 8) * 8
    out = torch.empty(n, width, dtype=torch.uint8)
    if n:
        lib.pack_rows(x.data_ptr(), n, dim, rope, out.data_ptr())
    return out


def unpack_rows(packed: torch.Tensor, dim: int, rope: int) -> torch.Tensor | None:
    """`pack_rows`' inverse, as the C decode step reads packed rows: `[n, width]` uint8 -> fp32 `[n, dim]` (the
    floats of the `quant.kv_fp8` classes' `decode`). None without the C kernels or off the CPU."""
    lib = load()
    if lib is None or not packed.is_cpu or packed.dim() != 2 or packed.dtype is not torch.uint8:
        return None
    p = packed.contiguous()
    out = torch.empty(p.shape[0], dim)
    if p.shape[0]:
        lib.unpack_rows(p.data_ptr(), p.shape[0], dim, rope, out.data_ptr())
    return out


def index_pick_shared(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, rows: torch.Tensor,
                      valid: torch.Tensor, scale: float, topk: int, layout: str = "rows"
                      ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`index_pick` for the queries of a prefill segment, which share their candidate entries: one row list
    `rows [V]` for all of `q [T, H, D]`, each query's own `valid [T, V]` -> each query's picks as rows of their own,
    `(rows [T, topk] int64, valid [T, topk] bool)` in entry order then invalid padding (row 0), as `picked_rows` of
    `index_pick`'s mask with the rows repeated per query gives them; with no `[T, V]` array of scores or mask, on the
    kernel threads. None when the C path does not apply. `layout`: as `index_pick`'s."""
    lib = _usable(q, w)
    T, H, D = q.shape
    held = None if lib is None else _index_keys("index_pick_shared", keys, D, layout)
    if lib is None or held is None or not (rows.is_contiguous() and valid.is_contiguous() and rows.is_cpu):
        return None
    V = rows.shape[0]
    _check_index("index_pick_shared", "rows", rows, (torch.int64,), (V,), held)
    _check_index("index_pick_shared", "valid", valid, _FLAGS, (T, V))
    if tuple(w.shape) != (T, H):
        raise KernelArgumentError(f"index_pick_shared: head weights [{T}, {H}] expected")
    out_rows, out_valid = torch.empty(T, topk, dtype=torch.int64), torch.empty(T, topk, dtype=torch.bool)
    parts = min(_threads, max(T, 1))  # the parts the C call may split the queries into, each with its scratch
    scratch = torch.empty(parts * lib.index_pick_shared_scratch_floats(V))
    if T and topk:
        lib.index_pick_shared(q.data_ptr(), w.data_ptr(), keys.data_ptr(), keys.stride(0), INDEX_KEYS.index(layout),
                              rows.data_ptr(), valid.data_ptr(), T, H, V, D, scale, topk, scratch.data_ptr(), parts,
                              out_rows.data_ptr(), out_valid.data_ptr())
    return out_rows, out_valid


def picked_rows(rows: torch.Tensor, picked: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Each row's picked entries of `picked [T, V]` bool as `(rows [T, k] int64, valid [T, k] bool)`: `rows[t, g]`
    of the picked g in entry order, then invalid padding (row 0): `model.indexer.picked_entries` in one O(V) pass.
    None when the C path does not apply."""
    lib = load()
    if lib is None or not (rows.is_cpu and rows.is_contiguous() and picked.is_contiguous() and picked.is_cpu):
        return None
    T, V = rows.shape
    _check_index("picked_rows", "rows", rows, (torch.int64,), (T, V))
    _check_index("picked_rows", "picked", picked, _FLAGS, (T, V))
    out_rows, out_valid = torch.empty(T, k, dtype=torch.int64), torch.empty(T, k, dtype=torch.bool)
    if T and k:
        lib.compact_picks(rows.data_ptr(), picked.data_ptr(), T, V, k, out_rows.data_ptr(), out_valid.data_ptr())
    return out_rows, out_valid


def topk_mask(scores: torch.Tensor, valid: torch.Tensor, topk: int) -> torch.Tensor | None:
    """The top-`topk` mask `[T, V]` bool of `scores [T, V]` fp32 among the `valid [T, V]` entries, by the indexer's
    tie rule (`model.indexer.select_topk`'s picks, without a sort). None when the C path does not apply."""
    lib = _usable(scores)
    if lib is None or not (scores.is_contiguous() and valid.is_contiguous() and valid.is_cpu):
        return None
    T, V = scores.shape
    _check_index("topk_mask", "valid", valid, _FLAGS, (T, V))
    picked = torch.empty(T, V, dtype=torch.bool)
    scratch = torch.empty(V)  # (held here: a temporary's memory would be freed before the call)
    if T and V:
        lib.topk_mask(scores.data_ptr(), valid.data_ptr(), T, V, topk, scratch.data_ptr(), picked.data_ptr())
    return picked


def norm_rope(x: torch.Tensor, heads: int, weight: torch.Tensor | None, eps: float, cos: torch.Tensor,
              sin: torch.Tensor, out: torch.Tensor | None = None, out_rows: torch.Tensor | None = None
              ) -> torch.Tensor | None:
    """RMS-normalise (times `weight` when given) and rotate rows of `d` channels in one call: `x [T, heads * d]`
    (row-contiguous, possibly a column slice) with rope tables `cos/sin [T, 1, r]` -> `[T, heads, d]` packed, or,
    with `out` (a pool `[rows, d]`) and `out_rows [T]` (heads 1), written to those pool rows (returns `out`).
    None when the C path does not apply."""
    if not _row_major(x) or (heads > 1 and not x.is_contiguous()):
        return None
    if out is not None and not (_row_major(out) and out_rows is not None and out_rows.is_contiguous()
                                and out_rows.is_cpu):
        return None
    lib = _usable(cos, sin) if weight is None else _usable(cos, sin, weight)
    if lib is None:
        return None
    T = x.shape[0]
    d = x.shape[1] // heads
    if out is not None and out_rows is not None:
        _check_index("norm_rope", "out_rows", out_rows, (torch.int64,), (T,), out.shape[0])
        if heads != 1 or out.shape[1] < d:
            raise KernelArgumentError(f"norm_rope: pool rows take one head of {d} channels")
    dst = torch.empty(T, heads, d) if out is None else out
    scratch = torch.empty(d)
    lib.norm_rope(x.data_ptr(), d if heads > 1 else x.stride(0), None if weight is None else weight.data_ptr(),
                  T * heads, heads, d, eps, cos.data_ptr(), sin.data_ptr(), cos.shape[-1], dst.data_ptr(),
                  None if out_rows is None else out_rows.data_ptr(), dst.stride(0) if out is not None else d,
                  scratch.data_ptr())
    return dst


def attn_out(o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, wo_a: torch.Tensor, groups: int,
             wo_b: torch.Tensor) -> torch.Tensor | None:
    """`model.attention.Attention.project_out` in one call: `o [T, H, d]` rotated back by the tables
    `cos/sin [T, 1, r]`, the grouped `wo_a [G * L, H * d / G]` and `wo_b [Dm, G * L]` -> `[T, Dm]`. None when the
    C path does not apply."""
    lib = _usable(o, cos, sin, wo_a, wo_b)
    if lib is None:
        return None
    T, H, d = o.shape
    L, Dm = wo_a.shape[0] // groups, wo_b.shape[0]
    out = torch.empty(T, Dm)
    scratch = torch.empty(H * d + groups * L)
    lib.attn_out(o.data_ptr(), cos.data_ptr(), sin.data_ptr(), T, H, d, cos.shape[-1], wo_a.data_ptr(), groups, L,
                 wo_b.data_ptr(), Dm, scratch.data_ptr(), out.data_ptr())
    return out


def attn_out_rows(o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, wo_a: torch.Tensor, groups: int,
                  wo_b: torch.Tensor) -> torch.Tensor:
    """`attn_out` (same arguments, same bits) with the rows sharing each read of `wo_a` and `wo_b`: the form
    `decode_layer` runs for a verify step's rows. The caller checked the tensors as `attn_out` does."""
    lib = load()
    assert lib is not None
    T, H, d = o.shape
    L, Dm = wo_a.shape[0] // groups, wo_b.shape[0]
    out = torch.empty(T, Dm)
    scratch = torch.empty(T * (H * d + groups * L))
    lib.attn_out_rows(o.data_ptr(), cos.data_ptr(), sin.data_ptr(), T, H, d, cos.shape[-1], wo_a.data_ptr(), groups,
                      L, wo_b.data_ptr(), Dm, scratch.data_ptr(), out.data_ptr())
    return out


def decode_layer(weights: torch.Tensor, sizes: torch.Tensor, scalars: torch.Tensor, step: torch.Tensor,
                 step_sizes: torch.Tensor, pools: torch.Tensor, h: torch.Tensor, scratch: torch.Tensor,
                 ids: torch.Tensor) -> torch.Tensor:
    """One decoder layer of a decode step in one call: `h [T, hc, D]` -> `[T, hc, D]`. The arrays hold pointers
    (int64) and sizes (int32) and scalars (fp32) in the slots named by `DECODE_*`; the caller checked that every
    tensor behind them is what the C loops read (see `model.cpu.decode_step`)."""
    lib = load()
    assert lib is not None
    out = torch.empty_like(h)
    rc = lib.decode_layer(weights.data_ptr(), sizes.data_ptr(), scalars.data_ptr(), step.data_ptr(),
                          step_sizes.data_ptr(), pools.data_ptr(), h.data_ptr(), out.data_ptr(), scratch.data_ptr(),
                          scratch.numel(), ids.data_ptr())
    if rc == -2:
        raise ExpertExchangeError("decode_layer: the expert exchange failed")
    if rc == -3:
        raise MemoryError("decode_layer: no memory for a compact weight block's decoded rows")
    if rc < 0:
        raise KernelArgumentError(f"decode_layer: the layer needs more than the {scratch.numel()} scratch floats")
    return out


def decode_layer_scratch_floats(sizes: torch.Tensor, tokens: int, visible: int, window: int,
                                packed: bool = False) -> int:
    """The floats `decode_layer` carves from its scratch for a layer of `sizes` (int32 `DECODE_SIZES`), `tokens`
    tokens, at most `visible` compressed entries and a window of `window`, over pools of packed FP8 rows or not (the
    C library's own formula)."""
    lib = load()
    assert lib is not None
    if not (sizes.dtype is torch.int32 and sizes.is_contiguous() and sizes.numel() == len(DECODE_SIZES)):
        raise KernelArgumentError(f"`sizes` must be {len(DECODE_SIZES)} contiguous int32 values")
    return int(lib.decode_layer_scratch_floats(sizes.data_ptr(), tokens, visible, window, int(packed)))


def lm_head(h: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc_eps: float,
            norm_eps: float, norm_w: torch.Tensor, eps: float, head: torch.Tensor,
            head_bf16: torch.Tensor | None = None) -> torch.Tensor | None:
    """`DSV4Model.logits` of a few rows of streams `h [N, hc, D]` in one call (the final mHC collapse, the final
    norm, the LM head `head [V, D]` as GEMVs) -> fp32 `[N, V]`. `head_bf16`: `bf16_copy(head)`, read instead (the
    same bits, half the bytes), or the head itself where it is kept bf16. None when the C path does not apply."""
    lib = _usable(h, fn, scale, base, norm_w, head) if head.dtype is not torch.bfloat16 else _usable(
        h, fn, scale, base, norm_w)
    if lib is None or (head_bf16 is not None and not (head_bf16.dtype is torch.bfloat16
                                                      and head_bf16.is_contiguous())):
        return None
    if head.dtype is torch.bfloat16 and head_bf16 is None:
        return None
    N, hc, D = h.shape
    V = head.shape[0]
    out = torch.empty(N, V)
    scratch = torch.empty(hc * D + N * D)
    read = head if head_bf16 is None else head_bf16
    lib.lm_head(h.data_ptr(), N, hc, D, fn.data_ptr(), scale.data_ptr(), base.data_ptr(), hc_eps, norm_eps,
                norm_w.data_ptr(), eps, read.data_ptr(), V, int(head_bf16 is not None), scratch.data_ptr(),
                out.data_ptr())
    return out


def linear_rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
    """`F.linear(x, w)` (`x [..., K]`, `w [N, K]`) whose every output row depends on its own input row only: the same
    bits whatever rows share the call (BLAS picks other kernels for other row counts). ~4x slower than BLAS on a
    prefill chunk. `w` fp32, or bf16 (widened exactly: the bits of `w.float()`). None when the C path does not apply
    (other dtypes or devices)."""
    lib = load()
    if lib is None or not (w.is_cpu and w.dim() == 2 and w.is_contiguous() and w.dtype in _ROW_WEIGHTS) or not (
            x.is_cpu and x.dtype is torch.float32) or torch.is_grad_enabled():
        return None
    N, K = w.shape
    x2, out = _rows_out(x, K, N)
    if x2.shape[0]:
        call = lib.linear_rows if w.dtype is torch.float32 else lib.linear_rows_h
        call(x2.data_ptr(), w.data_ptr(), x2.shape[0], N, K, out.data_ptr())
    return out.view(*x.shape[:-1], N)


_ROW_WEIGHTS = (torch.float32, torch.bfloat16)


def _rows_out(x: torch.Tensor, K: int, N: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`x [..., K]` as contiguous rows `[M, K]` and an fp32 output `[M, N]` for them."""
    x2 = x.reshape(-1, K).contiguous()
    return x2, torch.empty(x2.shape[0], N)


@cache
def e4m3_values() -> torch.Tensor:
    """PyTorch's own values of the 256 e4m3 bytes (what the C decode reads: it cannot disagree with torch's)."""
    return torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().contiguous()


def linear_fp8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, row0: int = 0) -> torch.Tensor | None:
    """`x [..., K] @ W.T` for an FP8 weight `q [N, K]` (float8_e4m3fn) with fp32 tile scales `scale [R, C]` (one per
    128x128 tile of the matrix q's rows start at `row0` of): every output the bits `linear_rows` gives with the
    dequantized fp32 weight, read at a byte per value. None when the C path does not apply."""
    lib = load()
    if lib is None or not (x.is_cpu and x.dtype is torch.float32 and q.is_cpu and q.dtype is torch.float8_e4m3fn
                           and q.is_contiguous() and scale.dtype is torch.float32 and scale.is_contiguous()):
        return None
    N, K = q.shape
    assert scale.shape[1] == -(-K // 128) and scale.shape[0] * 128 >= row0 + N, (q.shape, scale.shape, row0)
    x2, out = _rows_out(x, K, N)
    if x2.shape[0] and lib.linear_fp8(x2.data_ptr(), q.data_ptr(), scale.data_ptr(), scale.shape[1], row0,
                                      e4m3_values().data_ptr(), x2.shape[0], N, K, out.data_ptr()) != 0:
        return None
    return out.view(*x.shape[:-1], N)


def linear_mxfp4(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, e2m1: torch.Tensor,
                 e8m0: torch.Tensor) -> torch.Tensor | None:
    """`x [..., K] @ W.T` for an MXFP4 weight `packed [N, K/2]` (uint8 e2m1 pairs) with ue8m0 scales `scale [N, K/32]`
    (uint8 bytes): the bits `linear_rows` gives with the dequantized fp32 weight, read at half a byte per value.
    `e2m1 [16]`, `e8m0 [256]`: fp32 values of the codes and of the scale bytes (the caller's torch decodes). None
    when the C path does not apply."""
    lib = load()
    if lib is None or not (x.is_cpu and x.dtype is torch.float32 and packed.is_cpu and packed.dtype is torch.uint8
                           and packed.is_contiguous() and scale.dtype is torch.uint8 and scale.is_contiguous()):
        return None
    N, K = packed.shape[0], 2 * packed.shape[1]
    assert K % 32 == 0 and tuple(scale.shape) == (N, K // 32), (packed.shape, scale.shape)
    x2, out = _rows_out(x, K, N)
    if x2.shape[0] and lib.linear_mxfp4(x2.data_ptr(), packed.data_ptr(), scale.data_ptr(), e2m1.data_ptr(),
                                        e8m0.data_ptr(), x2.shape[0], N, K, out.data_ptr()) != 0:
        return None
    return out.view(*x.shape[:-1], N)


def linear_proj(x: torch.Tensor, proj: torch.Tensor, row: int, rows: int) -> torch.Tensor | None:
    """`x [T, K] @ W.T` for rows `[row, row + rows)` of a projection descriptor `proj` (int64, `kernel_abi.
    PROJ_SEGMENT` words a segment, built by `model.cpu.projection_table`): every output the bits `linear_rows` gives
    with those rows decoded to fp32. None when the C path does not apply or a compact block's scratch could not be
    allocated."""
    lib = load()
    if lib is None or not (x.is_cpu and x.dtype is torch.float32 and x.dim() == 2 and proj.dtype is torch.int64
                           and proj.is_contiguous()):
        return None
    x = x.contiguous()
    out = torch.empty(x.shape[0], rows)
    if lib.linear_proj(proj.data_ptr(), row, x.data_ptr(), x.shape[0], rows, x.shape[1], out.data_ptr()) != 0:
        return None
    return out


def set_threads(n: int) -> None:
    """Threads for the weight GEMMs of the C decode and verify steps and the compact weights' GEMMs, process-wide:
    the caller and `n - 1` helper threads (at most 64), who share the indexer's work and a verify step's attention
    rows (in up to 8 ranges) too, and at 2 threads a multi-row step's expert ranges. The engine sets its own count,
    the CPUs the process may use; each output keeps its bits whatever the count."""
    global _threads
    lib = load()
    if lib is not None:
        lib.pool_threads(n)
        _threads = max(1, min(n, _MAX_THREADS))


_MAX_THREADS = 64  # pool.c's POOL_MAX_THREADS
_threads = 1  # the count `set_threads` last set (what per-part scratch is sized for)


def bf16_copy(w: torch.Tensor) -> torch.Tensor | None:
    """A contiguous bf16 copy of the fp32 CPU tensor `w` when every value is a bf16 number (it widens back to the
    very same floats: the `_h` kernels then compute `w`'s bits from half the bytes), else None."""
    if not (w.is_cpu and w.dtype is torch.float32):
        return None
    half = w.detach().to(torch.bfloat16).contiguous()
    return half if torch.equal(half.float(), w) else None


def draft_scratch_floats(sizes: torch.Tensor, blocks: int, window: int) -> int:
    """The floats `draft_block` carves from its scratch for `blocks` blocks over `window` context rows."""
    lib = load()
    assert lib is not None
    return int(lib.draft_scratch_floats(sizes.data_ptr(), blocks, window))


def draft_block(weights: torch.Tensor, sizes: torch.Tensor, scalars: torch.Tensor, anchors: int, anchor_pos: int,
                blocks: int, ctx: int, rows: int, valid: int, window: int, scratch: torch.Tensor,
                logits: torch.Tensor) -> None:
    """A DSpark proposal's draft forward in one call, into `logits [blocks * gamma, vocab]`. The arrays hold the
    `DRAFT_*` slots; `anchors`, `anchor_pos` (int64 `[blocks]`), `ctx` (int64 `[stages, 2]`: pool pointer, row
    stride), `rows` (int64 `[blocks, window]`) and `valid` (uint8 `[blocks, window]`) are addresses of host arrays
    the caller keeps alive; the caller checked every tensor (see `model.cpu.draft_step`)."""
    lib = load()
    assert lib is not None
    lib.draft_block(weights.data_ptr(), sizes.data_ptr(), scalars.data_ptr(), anchors, anchor_pos, blocks, ctx, rows,
                    valid, window, scratch.data_ptr(), logits.data_ptr())


def draft_inject(weights: torch.Tensor, sizes: torch.Tensor, scalars: torch.Tensor, features: torch.Tensor,
                 positions: torch.Tensor, ctx: int, slots: torch.Tensor, scratch: torch.Tensor) -> None:
    """`DSparkDrafter.inject` in one call: the context rows of `features [N, F]` (fp32) at `positions` (int64
    `[N]`) written to every stage's pool rows `slots` (int64 `[N]`); `ctx` is the address of the `[stages, 2]`
    int64 pool table. `scratch` holds at least `N * (2 * rope_dim + hidden + stages * head_dim) + head_dim + 80`
    floats. The caller checked every tensor (see `model.cpu.draft_step`)."""
    lib = load()
    assert lib is not None
    lib.draft_inject(weights.data_ptr(), sizes.data_ptr(), scalars.data_ptr(), features.data_ptr(), features.shape[0],
                     positions.data_ptr(), ctx, slots.data_ptr(), scratch.data_ptr())


# ---- decode-index: a small step's indices and layers in two calls ---------------------------------------------------
class KernelArgumentError(ValueError):
    """An argument a C kernel would index out of its bounds (a caller's bug, refused before the call)."""


def decode_index(req: torch.Tensor, layout: torch.Tensor, step: torch.Tensor, step_sizes: torch.Tensor,
                 capacity: int) -> int:
    """Every index of a step of short chunks from the page tables, written into the arrays behind `step`
    (`DECODE_STEP`), its sizes into `step_sizes` (`DECODE_STEP_SIZES`). `req` (int64): `[n, (slot, start, length)
    per chunk, every chunk's token ids]`; `layout` (int64): `DECODE_LAYOUT`; `capacity`: the tokens the buffers
    behind `step` hold. Returns the step's token count; `KernelArgumentError` for arrays the C code would overrun."""
    lib = load()
    assert lib is not None
    _check_index_request(req, layout, step, step_sizes, capacity)
    T = lib.decode_index(req.data_ptr(), layout.data_ptr(), step.data_ptr(), step_sizes.data_ptr())
    if T < 0:
        raise KernelArgumentError(f"decode_index takes at most {INDEX_MAX_TOKENS} tokens")
    return int(T)


def _check_index_request(req: torch.Tensor, layout: torch.Tensor, step: torch.Tensor, step_sizes: torch.Tensor,
                         capacity: int) -> None:
    """`decode_index`'s arrays as the C code reads them: int64 `req` whose chunk list matches its length and fits
    the step buffers (`capacity` tokens), int64 `layout`/`step` with every slot, int32 `step_sizes`."""
    for name, t, dtype, n in (("req", req, torch.int64, 1), ("layout", layout, torch.int64, len(DECODE_LAYOUT)),
                              ("step", step, torch.int64, len(DECODE_STEP)),
                              ("step_sizes", step_sizes, torch.int32, len(DECODE_STEP_SIZES))):
        if not (t.is_cpu and t.dtype is dtype and t.dim() == 1 and t.is_contiguous() and t.numel() >= n):
            raise KernelArgumentError(f"decode_index: `{name}` must be a contiguous 1-D {dtype} CPU tensor of at "
                                      f"least {n} values; got {tuple(t.shape)} {t.dtype}")
    values = req.tolist()
    n = values[0]
    lengths = values[3 : 1 + 3 * n : 3] if n > 0 else []
    if n < 0 or any(length < 0 for length in lengths):
        raise KernelArgumentError("decode_index: `req` has a negative chunk count or negative chunk length")
    tokens = sum(lengths)
    if len(values) != 1 + 3 * n + tokens:
        raise KernelArgumentError(f"decode_index: `req` holds {len(values)} values, not 1 + 3 * {n} chunks + "
                                  f"{tokens} token ids")
    if tokens > min(capacity, INDEX_MAX_TOKENS):
        raise KernelArgumentError(f"decode_index: {tokens} tokens; the step buffers hold {capacity} "
                                  f"(the C limit is {INDEX_MAX_TOKENS})")


def decode_layers(tables: torch.Tensor, step: torch.Tensor, step_sizes: torch.Tensor, embed: torch.Tensor,
                  h: tuple[torch.Tensor, torch.Tensor], scratch: torch.Tensor, ids: torch.Tensor,
                  capture: tuple[torch.Tensor, torch.Tensor] | None = None) -> int:
    """Every layer of a step after `decode_index`: the step's token embeddings (`embed` fp32 or bf16) into `h[0]`
    (each `[>= T, hc, D]`), then `decode_layer` per row of `tables` (`[layers, 4]` int64: weights, sizes, scalars,
    pools pointers), alternating between the two buffers. Returns the index of the buffer holding the output.

    `capture = (columns, features)`: `columns` int32 `[layers]` (-1: not captured, else the layer's block of D
    columns), `features` fp32 `[>= T, F]` receives each captured layer's output averaged over the hc streams (the
    drafter features of `DSV4Model.forward`, bit for bit)."""
    lib = load()
    assert lib is not None
    _, hc, D = h[0].shape
    cols, feats = (None, None) if capture is None else capture
    T = int(step_sizes[0])
    if h[0].shape[0] < T or h[1].shape[0] < T or (feats is not None and feats.shape[0] < T):
        raise KernelArgumentError(f"decode_layers: {T} tokens; the stream or feature buffers hold fewer")
    assert embed.dtype in (torch.float32, torch.bfloat16) and embed.is_contiguous(), embed.dtype
    k = lib.decode_layers(tables.shape[0], tables.data_ptr(), step.data_ptr(), step_sizes.data_ptr(),
                          embed.data_ptr(), int(embed.dtype is torch.bfloat16), hc, D, h[0].data_ptr(),
                          h[1].data_ptr(), scratch.data_ptr(), scratch.numel(), ids.data_ptr(),
                          None if cols is None else cols.data_ptr(), None if feats is None else feats.data_ptr(),
                          0 if feats is None else feats.shape[1])
    if k == -2:
        raise ExpertExchangeError("decode_layers: a layer's expert exchange failed")
    if k == -3:
        raise MemoryError("decode_layers: no memory for a compact weight block's decoded rows")
    if k < 0:
        raise KernelArgumentError(f"decode_layers: a layer needs more than the {scratch.numel()} scratch floats")
    return int(k)
