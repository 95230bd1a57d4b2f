"""The C index builder (`kernels.decode_index`) gives `build_forward_batch`'s indices, array for array."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import MIXED
from helpers import make_llm
from pdspark.engine.forward_batch import Chunk, build_forward_batch, index_layout, index_request, logits_rows
from pdspark.hardware.cpu import kernel_abi
from pdspark.hardware.cpu import kernels as cpu_kernels
from pdspark.model.batch import CompressPlan
from pdspark.model.cpu.decode_step import MAX_TOKENS

# Chunk shapes, as (request, first position, length): decode tokens at and around group ends (CSA ratio 4, HCA
# ratio 8 in the tiny specs), verify windows that close groups mid-chunk, several requests in one step.
CASES = [
    [(0, 0, 1)],
    [(0, 3, 1)],
    [(0, 7, 1)],
    [(1, 100, 1)],
    [(1, 127, 1)],
    [(2, 170, 1)],
    [(0, 5, 8)],
    [(2, 160, 8)],
    [(1, 118, 6)],
    [(0, 30, 1), (1, 63, 1), (2, 199, 1)],
    [(0, 14, 3), (2, 181, 4)],
]


def _views(step: torch.Tensor, sizes: torch.Tensor) -> dict[str, np.ndarray]:
    """The arrays behind the step table, cut to this step's sizes."""
    si = dict(zip(kernel_abi.DECODE_STEP_SIZES, sizes.tolist()))
    ptr = dict(zip(kernel_abi.DECODE_STEP, step.tolist()))
    T, W, r = si["tokens"], si["window"], si["rope_dim"]

    def arr(name: str, n: int, dtype) -> np.ndarray:
        if n == 0:
            return np.zeros(0, dtype=dtype)
        buf = (np.ctypeslib.ctypes.c_char * (n * np.dtype(dtype).itemsize)).from_address(ptr[name])
        return np.frombuffer(buf, dtype=dtype).copy()

    out = {n: arr(n, T, np.int64) for n in ("positions", "input_ids", "swa_slots")}
    out["win_rows"], out["win_valid"] = arr("win_rows", T * W, np.int64), arr("win_valid", T * W, np.uint8)
    for kind in ("csa", "hca"):
        V = si[f"{kind}_visible"]
        out[f"{kind}_rows"], out[f"{kind}_valid"] = arr(f"{kind}_rows", T * V, np.int64), arr(
            f"{kind}_valid", T * V, np.uint8)
    for name in ("cos_main", "sin_main", "cos_comp", "sin_comp"):
        out[name] = arr(name, T * r, np.float32)
    for kind in ("csa", "hca"):
        out[f"{kind}_G"], out[f"{kind}_N"] = np.array(si[f"{kind}_groups"]), np.array(si[f"{kind}_writes"])
        out[f"{kind}_ptrs"] = np.array([ptr[f"{kind}_{s}"] for s in ("out", "pos", "use", "cur", "hist", "wtok",
                                                                         "wrow")])
    return out


def _plan_arrays(ptrs: np.ndarray, G: int, N: int, span: int) -> list[np.ndarray]:
    def arr(p: int, n: int, dtype) -> np.ndarray:
        if n == 0:
            return np.zeros(0, dtype=dtype)
        buf = (np.ctypeslib.ctypes.c_char * (n * np.dtype(dtype).itemsize)).from_address(int(p))
        return np.frombuffer(buf, dtype=dtype).copy()

    return [arr(ptrs[0], G, np.int64), arr(ptrs[1], G, np.int64), arr(ptrs[2], G * span, np.uint8),
            arr(ptrs[3], G * span, np.int64), arr(ptrs[4], G * span, np.int64), arr(ptrs[5], N, np.int64),
            arr(ptrs[6], N, np.int64)]


def _check_plan(ref: CompressPlan | None, got: dict, kind: str) -> int:
    """Checks one plan; returns its group count."""
    if ref is None:
        assert int(got[f"{kind}_G"]) == 0 and int(got[f"{kind}_N"]) == 0
        return 0
    G, N = ref.num_groups, int(ref.write_tokens.shape[0])
    assert (int(got[f"{kind}_G"]), int(got[f"{kind}_N"])) == (G, N), kind
    span = int(ref.use_cur.shape[1]) if G else 0
    arrays = _plan_arrays(got[f"{kind}_ptrs"], G, N, span)
    for name, a in zip(("out_rows", "positions", "use_cur", "cur_rows", "hist_rows", "write_tokens", "write_rows"),
                       arrays):
        want = getattr(ref, name).numpy().reshape(-1)
        np.testing.assert_array_equal(a, want.astype(a.dtype), err_msg=f"{kind} plan {name}")
    return G


@pytest.mark.skipif(cpu_kernels.load() is None, reason="needs the C kernels (a C compiler)")
def test_decode_index_matches_build_forward_batch(checkpoints):
    path, _ = checkpoints(MIXED)
    llm = make_llm(path)
    kv, model = llm.engine.kv, llm.engine.runner.model
    step_path = model._decode_step
    assert step_path is not None
    pages = [kv.open() for _ in range(3)]
    for rp, n in zip(pages, (40, 140, 220)):
        kv.grow(rp, n)
    kv.release_window(pages[2], 200)  # early SWA pages released: their state rows read the dummy row
    layout = index_layout(kv)
    groups = {"csa": 0, "hca": 0}  # closing groups seen: the plans were exercised, not only empty
    try:
        for case in CASES:
            chunks = [Chunk(pages[i].slot, start, [(7 * start + j) % 200 + 2 for j in range(n)], num_logits=n)
                      for i, start, n in case]
            assert sum(len(c.token_ids) for c in chunks) <= MAX_TOKENS
            with torch.inference_mode():
                out = model.forward_indexed(index_request(chunks), layout, kv.pools)
            assert out is not None
            hidden = out.hidden
            assert out.features is None  # (nothing captured)
            st = step_path._indexed
            assert st is not None
            got = _views(st.step, st.step_sizes)
            ref = build_forward_batch(chunks, kv)
            T = ref.num_tokens
            assert hidden.shape[0] == T
            assert torch.equal(out.positions, ref.positions) and torch.equal(out.swa_slots, ref.swa_slots)
            for name, want in (("positions", ref.positions), ("input_ids", ref.input_ids),
                               ("swa_slots", ref.swa_slots), ("win_rows", ref.window.rows),
                               ("win_valid", ref.window.valid)):
                np.testing.assert_array_equal(got[name], want.numpy().reshape(-1).astype(got[name].dtype),
                                              err_msg=f"{case} {name}")
            for kind, idx in (("csa", ref.csa), ("hca", ref.hca)):
                assert idx is not None  # MIXED has both kinds
                for part in ("rows", "valid"):
                    want = getattr(idx, part).numpy().reshape(-1)
                    np.testing.assert_array_equal(got[f"{kind}_{part}"], want.astype(got[f"{kind}_{part}"].dtype),
                                                  err_msg=f"{case} {kind} {part}")
            for name, table in (("cos_main", model.rope_main.cos), ("sin_main", model.rope_main.sin),
                                ("cos_comp", model.rope_compress.cos), ("sin_comp", model.rope_compress.sin)):
                np.testing.assert_array_equal(got[name], table[ref.positions].numpy().reshape(-1))
            groups["csa"] += _check_plan(ref.csa_plan, got, "csa")
            groups["hca"] += _check_plan(ref.hca_plan, got, "hca")
            assert logits_rows(chunks) == ref.logits_rows.tolist()
    finally:
        for rp in pages:
            kv.close(rp)
    assert groups["csa"] >= 5 and groups["hca"] >= 3


def test_index_request_layout():
    chunks = [Chunk(3, 10, [5, 6]), Chunk(1, 0, [9])]
    assert index_request(chunks) == [2, 3, 10, 2, 1, 0, 1, 5, 6, 9]
    assert logits_rows([Chunk(0, 0, [1, 2, 3], num_logits=2), Chunk(1, 0, [4], num_logits=0),
                        Chunk(2, 5, [7], num_logits=1)]) == [1, 2, 4]
