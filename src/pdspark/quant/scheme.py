"""`QuantDescription`: what `quant_model_description.json` of a ModelSlim ("ascendV1") checkpoint says.

The file is one flat object: every saved tensor's name maps to its scheme ("FLOAT", "W8A8", "W8A8_DYNAMIC",
"W4A8_DYNAMIC", ...), beside a few top-level keys (`version`, `model_quant_type`, `metadata`, `group_size`,
`optional`). A linear's scheme is the entry of its own `.weight`. `model_quant_type` is never read: ModelSlim writes
the highest type of a priority list that leaves W4A8_DYNAMIC out, so a pure W4A8 model says "FLOAT".
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdspark.errors import CheckpointError

DESCRIPTION_FILE = "quant_model_description.json"

FLOAT = "FLOAT"
W8A8 = "W8A8"  # static: per-tensor asymmetric activations (calibrated), per-channel symmetric weights
W8A8_DYNAMIC = "W8A8_DYNAMIC"  # per-token symmetric activations at run time, per-channel symmetric weights
W4A8_DYNAMIC = "W4A8_DYNAMIC"  # as W8A8_DYNAMIC with int4 weights packed two per byte along the output dimension
SCHEMES = (FLOAT, W8A8, W8A8_DYNAMIC, W4A8_DYNAMIC)
DYNAMIC_SCHEMES = (W8A8_DYNAMIC, W4A8_DYNAMIC)

# Top-level keys that are not tensor names.
_META_KEYS = frozenset({"version", "model_quant_type", "metadata", "group_size", "optional", "kv_cache_type",
                        "kv_quant_type", "fa_quant_type", "reduce_quant_type"})


def is_modelslim_dir(path: str | Path) -> bool:
    """A ModelSlim checkpoint is recognised by its description file."""
    return (Path(path) / DESCRIPTION_FILE).is_file()


@dataclass(frozen=True)
class QuantDescription:
    schemes: Mapping[str, str]  # tensor name -> scheme, as written
    group_size: int  # 0: per-channel weight scales
    rotation_file: str | None  # QuaRot's global rotation (relative path), when the checkpoint ships it
    source: str  # where it was read, for error messages

    @classmethod
    def from_dir(cls, path: str | Path) -> QuantDescription:
        file = Path(path) / DESCRIPTION_FILE
        try:
            raw = json.loads(file.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"cannot read {file}: {e}") from e
        return cls.parse(raw, str(file))

    @classmethod
    def parse(cls, raw: Any, source: str) -> QuantDescription:
        if not isinstance(raw, dict):
            raise CheckpointError(f"{source}: expected one JSON object, got {type(raw).__name__}")
        schemes: dict[str, str] = {}
        for name, value in raw.items():
            if name in _META_KEYS:
                continue
            if value not in SCHEMES:
                raise CheckpointError(f"{source}: tensor {name!r} has scheme {value!r}; supported: {list(SCHEMES)}")
            schemes[name] = value
        group_size = raw.get("group_size", 0)
        if group_size != 0:
            raise CheckpointError(f"{source}: `group_size` is {group_size!r}; only 0 (per-channel scales) is "
                                  "supported")
        rotation = (raw.get("optional") or {}).get("quarot", {}).get("rotation_map", {}).get("global_rotation")
        return cls(schemes, group_size, rotation, source)

    def scheme_of(self, prefix: str) -> str:
        """The scheme of the linear `prefix` (its `.weight` entry); a name the file does not list is an error."""
        name = f"{prefix}.weight"
        if name not in self.schemes:
            raise CheckpointError(f"{self.source} has no entry for {name!r}")
        return self.schemes[name]

    def quantized_linear(self, tensor: str) -> str | None:
        """The quantized linear a checkpoint tensor belongs to (`layers.0.attn.wq_a` for `...wq_a.weight_scale`),
        or None for a float tensor."""
        prefix = tensor.rsplit(".", 1)[0]
        scheme = self.schemes.get(f"{prefix}.weight")
        return prefix if scheme is not None and scheme != FLOAT else None

    @property
    def quarot(self) -> bool:
        """The residual stream is rotated (the checkpoint's embed and head are its own, rotated ones)."""
        return self.rotation_file is not None
