"""`ResidentWeights`: the bytes a loaded model's weights hold in memory, by dtype, and the checkpoint bytes they come
from, so that a worker can say (and a test can bound) what a checkpoint costs once loaded."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from pdspark.model.tensor_inventory import stored_tensors
from pdspark.model.weights import checkpoint_files


@dataclass(frozen=True)
class ResidentWeights:
    by_dtype: dict[str, int]  # "torch.bfloat16" -> bytes

    @classmethod
    def of(cls, model: nn.Module) -> ResidentWeights:
        """Every parameter and persistent buffer of `model`, each storage counted once (a tied head is the
        embedding); computed tables (non-persistent buffers such as code tables) are left out."""
        seen: set[int] = set()
        by_dtype: Counter[str] = Counter()
        for t in [*model.parameters(), *(b for _, b in model.state_dict(keep_vars=True).items())]:
            ptr = t.untyped_storage().data_ptr()
            if t.is_meta or ptr in seen:
                continue
            seen.add(ptr)
            by_dtype[str(t.dtype).removeprefix("torch.")] += t.untyped_storage().nbytes()
        return cls(dict(by_dtype))

    @property
    def total(self) -> int:
        return sum(self.by_dtype.values())

    def describe(self) -> str:
        parts = ", ".join(f"{d} {b / 2**20:.1f} MiB" for d, b in sorted(self.by_dtype.items(), key=lambda kv: -kv[1]))
        return f"{self.total / 2**20:.1f} MiB ({parts})"


def checkpoint_bytes(path: str | Path, skip_prefixes: tuple[str, ...] = ()) -> dict[str, int]:
    """The tensor bytes of the checkpoint at `path` by safetensors dtype (headers only), leaving out tensors whose
    name starts with one of `skip_prefixes` (`mtp.`: the draft, loaded apart)."""
    out: Counter[str] = Counter()
    for t in stored_tensors(checkpoint_files(Path(path))):
        if not t.name.startswith(skip_prefixes):
            out[t.dtype] += t.nbytes
    return dict(out)
