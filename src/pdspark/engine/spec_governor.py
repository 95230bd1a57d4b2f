"""`SpecGovernor`: speculate only at the batch sizes where this machine gives more tokens per second with it.

Whether a DSpark verify step pays depends on the hardware and the batch: where a decode step is bound by reading
the weights, a (gamma+1)-row verify costs about one decode and the accepted drafts come nearly free; where it is
bound by arithmetic (a small model whose weights sit in cache, or a batch whose rows already share every weight
read), the verify costs several decodes and speculation is slower than plain decoding (measured: 0.9-1.1x at batch
1 on a Zen 4 core, 0.3-0.5x at batch 8 on two hosts, 2.0x at batch 1 on a Xeon). Measuring beats guessing: the
governor keeps, per number of running requests, the seconds per generated token of recent decode steps with
drafts and without, and picks the cheaper mode; now and then (at most `PROBE_SHARE` of the time) it runs one step of
the other mode, so a change (longer contexts, other prompts, acceptance moving) is seen. The tokens are
the same either way (a verify step draws each position exactly as plain decoding does), so the choice moves
only the speed.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

WINDOW_STEPS = 32  # recent steps per mode whose seconds / tokens make its estimate (a ratio of sums: a mean)
MIN_STEPS = 2  # steps of a mode before its estimate counts (its first steps may carry one-time costs)
# At most this share of a batch size's decode time goes to probing the mode not chosen: a probe step comes once the
# chosen mode has run 1 / PROBE_SHARE times that mode's step time (a verify step 15x a decode step, as a batch of 8
# on the module path, is probed once in ~300 plain steps; two modes of equal cost every ~20 steps).
PROBE_SHARE = 0.05


@dataclass
class _ModeCost:
    """Recent `(seconds, tokens)` of the decode steps of one mode at one batch size."""

    steps: deque = field(default_factory=lambda: deque(maxlen=WINDOW_STEPS))

    def seconds_per_token(self) -> float | None:
        if len(self.steps) < MIN_STEPS:
            return None
        return sum(s for s, _ in self.steps) / max(1, sum(n for _, n in self.steps))

    def seconds_per_step(self) -> float:
        return sum(s for s, _ in self.steps) / max(1, len(self.steps))


@dataclass
class _BatchCosts:
    speculate: _ModeCost = field(default_factory=_ModeCost)
    plain: _ModeCost = field(default_factory=_ModeCost)
    since_probe: float = 0.0  # decode seconds at this batch size since the last probe


class SpecGovernor:
    def __init__(self, num_drafts: int, probe_share: float = PROBE_SHARE):
        if not 0 < probe_share < 1:
            raise ValueError(f"probe_share must be in (0, 1) (got {probe_share})")
        self.num_drafts = num_drafts
        self.probe_share = probe_share
        self._batches: dict[int, _BatchCosts] = {}

    def drafts(self, batch: int) -> int:
        """Draft tokens per verify step for the next step of `batch` running requests (0: decode plainly)."""
        costs = self._batches.setdefault(batch, _BatchCosts())
        spec, plain = costs.speculate.seconds_per_token(), costs.plain.seconds_per_token()
        if spec is None:
            return self.num_drafts  # measure speculation first, then plain decoding
        if plain is None:
            return 0
        speculate = spec <= plain
        other = costs.plain if speculate else costs.speculate
        if costs.since_probe * self.probe_share >= other.seconds_per_step():
            costs.since_probe = 0.0
            speculate = not speculate  # one step of the other mode: its estimate follows the machine and prompts
        return self.num_drafts if speculate else 0

    def record(self, batch: int, speculated: bool, seconds: float, tokens: int) -> None:
        """A decode step of `batch` running requests (no prompt chunk in it) that gave `tokens` tokens."""
        costs = self._batches.setdefault(batch, _BatchCosts())
        (costs.speculate if speculated else costs.plain).steps.append((seconds, tokens))
        costs.since_probe += seconds

    def chosen(self) -> dict[int, bool]:
        """Per batch size with both estimates: whether speculation is the cheaper mode now (for stats and logs)."""
        out = {}
        for batch, costs in sorted(self._batches.items()):
            spec, plain = costs.speculate.seconds_per_token(), costs.plain.seconds_per_token()
            if spec is not None and plain is not None:
                out[batch] = spec <= plain
        return out
