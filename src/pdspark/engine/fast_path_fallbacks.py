"""`FastPathFallbacks`: decode and verify steps the C fast path did not run, by reason, each reason logged once.

The C step (`model.cpu.decode_step`) serves small decode/verify steps of fp32 CPU models and of released checkpoints
held compact (their FP8/MXFP4 and bf16 matrices as stored), over fp32 pools or the FP8 cache's packed rows; anything
else takes the PyTorch module path, which gives
the same tokens, slower. That must never happen silently: the first step of each reason writes one log line saying
why, and every such step counts (`pdspark_engine_fast_path_fallback_steps_total`).
Prefill chunks are not counted: they take the module path by design (BLAS matmuls share each weight read).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

logger = logging.getLogger(__name__)

# The reasons (metric label values, all initialised at start): the model has no C step (ModelSlim int8 weights, a
# bf16/fp16 model, no C kernels), the step has more token rows than the C step takes, the KV pools (or the drafter's
# capture) are not what it reads, the engine runs off the CPU, the multi-stream prepare takes the step; and a DSpark
# draft's forward or context-row write that took the draft's module path (the draft has no C step, or the call is not
# what it reads).
REASONS = ("model", "step_tokens", "pools", "device", "multi_stream", "draft")


class FastPathFallbacks:
    def __init__(self) -> None:
        self.steps: Counter[str] = Counter({reason: 0 for reason in REASONS})

    def note(self, reason: str, detail: Callable[[], str]) -> None:
        """One decode/verify step took the module path for `reason` (one of `REASONS`; `detail()` says more, asked
        only for the log line)."""
        assert reason in REASONS, reason
        if self.steps[reason] == 0:
            logger.warning("decode/verify steps take the slower PyTorch path: %s (logged once per reason; counted "
                           "in pdspark_engine_fast_path_fallback_steps_total{reason=%r})", detail(), reason)
        self.steps[reason] += 1
