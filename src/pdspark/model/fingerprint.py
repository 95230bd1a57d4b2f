"""`model_fingerprint`: a digest that two workers compare before they exchange a model's cache."""

from __future__ import annotations

import hashlib
import json

import torch

from pdspark.model.dsv4 import DSV4Model

# A routed expert's tensors: one digest per (parameter, expert), so that ranks holding different experts can pool
# theirs into the digest of one process holding every expert.
_EXPERT_PARAMS = ("ffn.w13", "ffn.w2")


def expert_digests(model: DSV4Model) -> list[tuple[str, int, str]]:
    """`(parameter, expert id, sha256)` of each routed expert this model holds."""
    out = []
    with torch.no_grad():
        for name, p in model.state_dict().items():
            if name.endswith(_EXPERT_PARAMS):
                out += [(name, model.experts.first + e, hashlib.sha256(_bytes(p[e])).hexdigest())
                        for e in range(p.shape[0])]
    return out


def model_fingerprint(model: DSV4Model, experts: list[tuple[str, int, str]] | None = None) -> str:
    """A digest of the architecture and every weight (names, shapes, dtypes, values). `experts`: the digests of
    every routed expert (`expert_digests` of each rank of a group, pooled); by default this model's own."""
    h = hashlib.sha256(json.dumps(model.cfg.fingerprint_dict(), sort_keys=True, default=str).encode())
    with torch.no_grad():
        for name, p in sorted(model.state_dict().items()):
            if name.endswith(_EXPERT_PARAMS):
                h.update(f"{name}:{tuple(p.shape[1:])}:{p.dtype}".encode())  # (the expert count varies by rank)
                continue
            h.update(f"{name}:{tuple(p.shape)}:{p.dtype}".encode())
            h.update(_bytes(p))
    for name, e, digest in sorted(experts if experts is not None else expert_digests(model)):
        h.update(f"{name}:{e}:{digest}".encode())
    return h.hexdigest()[:32]


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
