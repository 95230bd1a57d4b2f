"""The explicit state block table (Atlas A3 compressor ABI, cache_mode=2) over pdspark's state rings: the worked
examples of the reference (identity full->SWA pages, C4 ring 8, page 16, request r's position p at full slot
64 r + p, dummy row 999), and agreement with the engine's own state-row translation on a real cache."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from cache_builders import make_kv

from pdspark.cache.explicit_state_table import ExplicitStateTable, StateTableInputs
from pdspark.cache.kv_cache import HostTables
from pdspark.cache.state_rings import StateRings

D = 999


@pytest.fixture
def example():
    sizes = SimpleNamespace(page_size=16, csa_ring=8, hca_ring=128)
    pools = SimpleNamespace(swa_dummy_page=10_000, c4_state_dummy_row=D, c128_state_dummy_row=D)
    rings = StateRings(sizes, pools)  # type: ignore[arg-type]
    req_to_token = 64 * np.arange(4)[:, None] + np.arange(256)[None, :]
    tables = HostTables(req_to_token, np.zeros((4, 1), dtype=np.int64), np.arange(64))
    return rings, tables


def test_decode_and_a_padded_row(example):
    rings, tables = example
    c4 = ExplicitStateTable(rings, 4)
    table = c4.build(StateTableInputs.decode([1, 3], [10, 0]), tables)
    assert table.dtype is torch.int32 and table.shape == (2, 9)  # 2 x 4 history + 1 input column
    assert table[0].tolist() == [33, 34, 35, 36, 37, 38, 39, 32, 33]
    assert table[1].tolist() == [D] * 9


def test_verify(example):
    rings, tables = example
    table = ExplicitStateTable(rings, 4).build(StateTableInputs.verify([2], [6], 3), tables)
    assert table[0].tolist() == [D, D, 64, 65, 66, 67, 68, 69, 70, 71, 64]


def test_prefill_chunks_of_different_lengths(example):
    rings, tables = example
    table = ExplicitStateTable(rings, 4).build(StateTableInputs.prefill([0, 1], [0, 4], [5, 2]), tables)
    assert table.shape == (2, 13)
    assert table[0].tolist() == [D] * 8 + [0, 1, 2, 3, 4]
    assert table[1].tolist() == [D] * 4 + [32, 33, 34, 35, 36, 37] + [D] * 3  # positions 0..5 of request 1


def test_c128_decode(example):
    rings, tables = example
    table = ExplicitStateTable(rings, 128).build(StateTableInputs.decode([1], [10]), tables)
    assert table.shape == (1, 129)
    assert table[0].tolist() == [D] * 119 + list(range(128, 138))


def test_only_the_a3_ratios():
    with pytest.raises(ValueError, match="ratios 4 and 128, not 16"):
        ExplicitStateTable(SimpleNamespace(pools=SimpleNamespace()), 16)  # type: ignore[arg-type]


def test_real_pools_agree_with_the_engine_translation():
    kv = make_kv()
    pages = kv.open()
    assert pages is not None
    kv.grow(pages, 21)
    tables = kv.host_tables()
    table = ExplicitStateTable(kv.rings, 4).build(StateTableInputs.verify([pages.slot], [18], 3), tables)
    pos = 18 - 8 + np.arange(11)
    want = kv.c4_state_rows(tables.req_to_token[pages.slot, pos], pos, tables)
    assert table[0].tolist() == want.tolist()
    # The dummy is the pools' last, positive, empty (kv 0, score -inf) fp32 row.
    dummy = kv.pools.c4_state_dummy_row
    padded = ExplicitStateTable(kv.rings, 4).build(StateTableInputs.decode([pages.slot], [0]), tables)
    assert padded[0].tolist() == [dummy] * 9 and dummy == kv.pools.c4_state.shape[1] - 1 > 0
    state = kv.pools.c4_state[:, dummy]
    half = state.shape[-1] // 2
    assert kv.pools.c4_state.dtype is torch.float32
    assert not state[:, :half].any() and torch.isneginf(state[:, half:]).all()
    kv.close(pages)
