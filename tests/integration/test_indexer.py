"""The CSA indexer picks the same entries for a query however the step reaches it: inside a long prefill chunk
(keys shared by the chunk) or as a decode token (keys gathered per query)."""

from __future__ import annotations

import torch

from conftest import SPARSE
from helpers import make_llm
from pdspark.engine.forward_batch import Chunk, build_forward_batch


def ranked(scores: torch.Tensor) -> list[int]:
    """The tie rule, written plainly: highest score first, then the lower index."""
    return sorted(range(scores.shape[0]), key=lambda g: (-float(scores[g]), g))


@torch.inference_mode()
def test_prefill_and_decode_paths_score_bitwise_alike_and_pick_alike_at_a_near_tie(checkpoints):
    path, _ = checkpoints(SPARSE)  # 2 index heads of 16 channels, top-4
    llm = make_llm(path)
    kv, model = llm.engine.kv, llm.engine.runner.model
    layer = kv.model.csa_layers[0]
    indexer = model.layers[layer].attn.indexer
    index_kv = kv.pools.layer(layer).index_kv  # [c4 rows + 1, 16]
    n, k = 64, indexer.topk
    V = n // kv.model.csa_ratio  # entries visible to the last query
    pages = kv.open()
    kv.grow(pages, n)
    ids = [5] * n
    prefill = build_forward_batch([Chunk(pages.slot, 0, ids)], kv)
    decode = build_forward_batch([Chunk(pages.slot, n - 1, ids[-1:])], kv)
    assert prefill.segments and not decode.segments  # the two paths under test
    assert prefill.csa.max_visible == decode.csa.max_visible == V > k

    # The query projection is the identity, so both paths score the very same query: `wq_b` is a matmul whose
    # rounding depends on the batch too, and it is not the scoring routine under test.
    assert indexer.wq_b.shape[0] == indexer.wq_b.shape[1]
    indexer.wq_b.copy_(torch.eye(indexer.wq_b.shape[0]))
    g = torch.Generator().manual_seed(0)
    rows = decode.csa.rows[0, :V]
    keys = torch.randn(V, index_kv.shape[1], generator=g)
    qr = torch.randn(n, kv.model.q_lora_rank, generator=g)
    head_w = torch.rand(n, indexer.n_heads, generator=g) + 0.5  # positive weights: scores grow with the dots

    def both_paths():
        index_kv[rows] = keys
        at_prefill = model.rope_compress.at(prefill.positions)
        at_decode = model.rope_compress.at(decode.positions)
        s_prefill = indexer.scores(head_w, qr, at_prefill, prefill, index_kv)[-1]
        s_decode = indexer.scores(head_w[-1:], qr[-1:], at_decode, decode, index_kv)[0]
        # Each path's pick comes as the query's picked entries' own rows (`picked_entries`): as a mask over the
        # entries here
        def as_mask(own, t):
            chosen = set(own.rows[t][own.valid[t]].tolist())
            return torch.tensor([r in chosen for r in decode.csa.rows[0].tolist()])

        pick_prefill = as_mask(indexer.select(head_w, qr, prefill, index_kv, at_prefill), -1)
        pick_decode = as_mask(indexer.select(head_w[-1:], qr[-1:], decode, index_kv, at_decode), 0)
        return s_prefill, s_decode, pick_prefill, pick_decode

    # Make a near-tie at the cut: copy the last picked entry's key onto two entries it beats, once one ulp away (a
    # difference below the rounding of a dot product) and once exactly (a tie the lower index wins).
    order = ranked(both_paths()[1])
    cut = order[k - 1]
    nudged, copied = sorted(order[k:])[:2]
    keys[nudged] = keys[cut]
    keys[nudged, 0] = torch.nextafter(keys[cut, 0], torch.tensor(float("inf")))
    keys[copied] = keys[cut]

    s_prefill, s_decode, pick_prefill, pick_decode = both_paths()
    assert torch.equal(s_prefill, s_decode), (s_prefill - s_decode).abs().max()
    assert torch.equal(pick_prefill, pick_decode)
    order = ranked(s_decode)
    assert set(torch.nonzero(pick_decode).flatten().tolist()) == set(order[:k])
    # The cut really is a near-tie: the last pick and the first entry left out score within a few ulps.
    assert s_decode[cut] > 0 and s_decode[copied] == s_decode[cut]
    assert abs(float(s_decode[order[k - 1]] - s_decode[order[k]])) <= 4 * torch.finfo(torch.float32).eps * float(
        s_decode[cut]
    )
    kv.close(pages)
