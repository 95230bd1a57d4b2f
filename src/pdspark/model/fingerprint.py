"""`model_fingerprint`: a digest that two workers compare before they exchange a model's cache."""

from __future__ import annotations

import hashlib
import json

import torch

from pdspark.model.dsv4 import DSV4Model


def model_fingerprint(model: DSV4Model) -> str:
    """A digest of the architecture and every weight (names, shapes, dtypes, values)."""
    h = hashlib.sha256(json.dumps(model.cfg.fingerprint_dict(), sort_keys=True, default=str).encode())
    with torch.no_grad():
        for name, p in sorted(model.state_dict().items()):
            h.update(f"{name}:{tuple(p.shape)}:{p.dtype}".encode())
            h.update(p.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:32]
