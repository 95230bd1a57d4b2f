"""Multi-stream attention prepare: the policy (which steps, how many rows) and the streams it runs on.

On decode and verify steps the attention's input preparation is several small independent kernels, too small to fill
the device one after another. `PrepareStreams` overlaps them (as SGLang's `_forward_prepare_multi_stream_npu`):
- side stream `kv`: raw K=V latent norm + RoPE + SWA cache write;
- side stream `q`: the query heads (wq_b, head norm, RoPE) from the normalised q latent;
- the current stream: the compressors and the indexer (which needs the q latent too), then it waits for both sides.
Extend (prefill) steps are large enough to fill the device on their own and never use it; nor do steps over the
row limit. Without streams (the CPU) every call is a no-op and the work runs in program order, bit for bit as without.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Literal

import torch

from pdspark.hardware.backend import HardwareBackend

StepKind = Literal["decode", "verify", "extend"]  # what a chunk of a step computes
_PREPARE_KINDS = ("decode", "verify")


def use_prepare_streams(kinds: Iterable[StepKind], num_rows: int, max_rows: int) -> bool:
    """Whether a step of chunks of `kinds` and `num_rows` token rows prepares attention on side streams: only
    decode and verify chunks (any extend chunk, a mixed step included, runs on one stream), at most `max_rows`
    rows (0: never)."""
    kinds = list(kinds)
    return 0 < num_rows <= max_rows and bool(kinds) and all(k in _PREPARE_KINDS for k in kinds)


class PrepareStreams:
    """The two side streams of one engine (created once) and the joins around a layer's prepare."""

    def __init__(self, backend: HardwareBackend):
        self.backend = backend
        self.kv = backend.new_stream()
        self.q = backend.new_stream()

    def fork(self) -> None:
        """Both side streams start after what the current stream queued so far (the layer input, the q latent)."""
        current = self.backend.current_stream()
        self.kv.wait_stream(current)
        self.q.wait_stream(current)

    @contextmanager
    def on_kv(self) -> Iterator[None]:
        with self.backend.use_stream(self.kv):
            yield

    @contextmanager
    def on_q(self) -> Iterator[None]:
        with self.backend.use_stream(self.q):
            yield

    def join(self, *made_on_q: torch.Tensor) -> None:
        """The current stream waits for both sides; tensors made on the q stream are marked as used by the current
        one, so the allocator does not hand their memory back to the q stream while current still reads them."""
        current = self.backend.current_stream()
        current.wait_stream(self.kv)
        current.wait_stream(self.q)
        for t in made_on_q:
            self.backend.record_stream(t, current)
