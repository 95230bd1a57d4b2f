"""`SpecGovernor`: speculate only at the batch sizes where this machine gives more tokens per second with it.

Whether a DSpark verify step pays depends on the hardware and the batch: where a decode step is bound by reading
the weights, a (gamma+1)-row verify costs about one decode and the accepted drafts come nearly free; where it is
bound by arithmetic (a small model whose weights sit in cache, or a batch whose rows already share every weight
read), the verify costs several decodes and speculation is slower than plain decoding (measured: 0.8-1.0x at batch
1 on a Zen 4 core, 0.3-0.5x at batch 8 on two hosts, 2.0x at batch 1 on a Xeon). Measuring beats guessing: the
governor keeps, per number of running requests, the seconds per generated token of recent decode steps with
drafts and without, and picks the cheaper mode; now and then (at most `PROBE_SHARE` of the time) it runs a few steps
of the other mode, so a change (longer contexts, other prompts, acceptance moving) is seen.

A batch size first seen decodes plainly (`MIN_STEPS` + 1 steps: plain decoding costs nothing over itself), then
tries drafting at once, unless a smaller size measured in both modes predicts that drafting cannot pay here
(`_drafting_cannot_pay`): a verify step over 8 requests' 48 rows costs ~8x one over 6 rows where the rows are
arithmetic, and five such steps to learn it cost a quarter of a short batch-8 run's time (measured on a Zen 4 VM:
0.78x plain over 128 tokens). The tokens are the same either way (a verify step draws each position exactly as
plain decoding does), so the choice moves only the speed.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

WINDOW_STEPS = 32  # recent steps per mode whose seconds / tokens make its estimate (a ratio of sums: a mean)
MIN_STEPS = 4  # steps of a mode before its estimate counts
# Probes come in bursts of this many steps of the mode not chosen, the first of which is not counted: the first step
# after a switch pays for it (step buffers and indices for another row count: a plain step after a verify step cost
# ~3x a plain step after a plain step on a Zen 4 core), which a steady mode does not.
PROBE_BURST = 3
# At most this share of a batch size's decode time goes to probing the mode not chosen: a burst comes once the
# chosen mode has run 1 / PROBE_SHARE times the burst's expected time (a verify step 15x a decode step, as a batch of 8
# on the module path, is probed once in ~900 plain steps; two modes of equal cost every ~60 steps).
PROBE_SHARE = 0.05
# Drafting is tried at a new batch size unless its predicted seconds a token exceed plain decoding's there by this
# factor. The prediction is optimistic (see `_drafting_cannot_pay`), so a size it rules out is one where drafting
# loses clearly; a size where the two come close is measured.
PREDICTED_LOSS = 1.1


@dataclass
class _ModeCost:
    """Recent seconds and tokens of the decode steps of one mode at one batch size (two deques side by side: the
    estimates are sums and a max over them in C, asked for at every step, a few microseconds of a ~0.5 ms step)."""

    seconds: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW_STEPS))
    tokens: deque[int] = field(default_factory=lambda: deque(maxlen=WINDOW_STEPS))

    def add(self, seconds: float, tokens: int) -> None:
        self.seconds.append(seconds)
        self.tokens.append(tokens)

    def seconds_per_token(self) -> float | None:
        """Seconds over tokens of the window less its slowest step (a GC pause, a page fault)."""
        if len(self.seconds) < MIN_STEPS:
            return None
        slowest = max(self.seconds)
        tokens = sum(self.tokens) - self.tokens[self.seconds.index(slowest)]
        return (sum(self.seconds) - slowest) / max(1, tokens)

    def seconds_per_step(self) -> float:
        return sum(self.seconds) / max(1, len(self.seconds))

    def tokens_per_step(self) -> float:
        return sum(self.tokens) / max(1, len(self.tokens))


@dataclass
class _BatchCosts:
    speculate: _ModeCost = field(default_factory=_ModeCost)
    plain: _ModeCost = field(default_factory=_ModeCost)
    since_probe: float = 0.0  # decode seconds at this batch size since the last probe began
    probe_left: int = 0  # steps of the current probe still to come
    last: bool | None = None  # the mode of the last step recorded (None: none yet)
    explored: bool = False  # drafting was run once, at once, to measure it here (`drafts`)


class SpecGovernor:
    def __init__(self, num_drafts: int, probe_share: float = PROBE_SHARE):
        if not 0 < probe_share < 1:
            raise ValueError(f"probe_share must be in (0, 1) (got {probe_share})")
        self.num_drafts = num_drafts
        self.probe_share = probe_share
        self._batches: dict[int, _BatchCosts] = {}

    def drafts(self, batch: int, steady: bool = True) -> int:
        """Draft tokens per verify step for the next step of `batch` running requests (0: decode plainly). Not
        `steady`: prompts are being computed too, so the step will not be timed (its cost is mostly theirs): the
        choice as it stands, without probing. A batch size not measured in both modes yet decodes plainly, and
        measures drafting once plain decoding is measured there (unless it is predicted to lose: then only probes
        measure it, within their share)."""
        costs = self._costs(batch)
        spec, plain = costs.speculate.seconds_per_token(), costs.plain.seconds_per_token()
        speculate = spec is not None and plain is not None and spec <= plain
        if not steady:
            return self.num_drafts if speculate else 0
        if costs.probe_left:
            costs.probe_left -= 1
            speculate = not speculate
        elif plain is None:
            pass  # plain decoding is measured first (it costs nothing over itself)
        elif spec is None and not costs.explored and not self._drafting_cannot_pay(batch, plain):
            # Measured at once rather than when a probe comes round: waiting left drafting unmeasured (or a costly
            # mode running) for most of a request.
            costs.explored, costs.since_probe, costs.probe_left = True, 0.0, MIN_STEPS
            speculate = True
        elif costs.since_probe * self.probe_share >= PROBE_BURST * self._step_seconds(batch, not speculate):
            costs.since_probe, costs.probe_left = 0.0, PROBE_BURST - 1
            speculate = not speculate  # the other mode's estimate follows the machine, prompts and acceptance
        return self.num_drafts if speculate else 0

    def _drafting_cannot_pay(self, batch: int, plain: float) -> bool:
        """Whether drafting at `batch`, predicted from the nearest smaller size `b` measured in both modes, costs
        more than `PREDICTED_LOSS` times plain decoding's `plain` seconds a token here. A request adds gamma + 1 rows
        to a verify step where it adds one to a plain step, so the verify step grows by gamma + 1 times what the
        plain step grew from `b` to `batch`; each request gives the tokens a request gave at `b`. Optimistic: the
        draft's own cost is taken as not growing, and rows past the caches cost more than the first ones."""
        chosen = self.chosen()  # the sizes measured in both modes
        smaller = [b for b in chosen if b < batch]
        if not smaller:
            return False
        near = self._batches[max(smaller)]
        grown = self._batches[batch].plain.seconds_per_step() - near.plain.seconds_per_step()
        spec_step = near.speculate.seconds_per_step() + (self.num_drafts + 1) * max(0.0, grown)
        tokens = near.speculate.tokens_per_step() * batch / max(smaller)
        return tokens > 0 and spec_step / tokens > PREDICTED_LOSS * plain

    def _costs(self, batch: int) -> _BatchCosts:
        """`batch`'s books, made on its first step (not `setdefault`: that built a new, unused set of books, four
        deques, at every step)."""
        costs = self._batches.get(batch)
        if costs is None:
            costs = self._batches[batch] = _BatchCosts()
        return costs

    def _step_seconds(self, batch: int, speculate: bool) -> float:
        """What a step of that mode takes at `batch`: its own recent mean, else the nearest size's scaled by rows."""
        def mode(costs: _BatchCosts) -> _ModeCost:
            return costs.speculate if speculate else costs.plain

        own = mode(self._batches[batch])
        if own.seconds:
            return own.seconds_per_step()
        measured = [b for b, costs in self._batches.items() if mode(costs).seconds]
        if not measured:
            return 0.0
        near = min(measured, key=lambda b: (abs(b - batch), b))
        return mode(self._batches[near]).seconds_per_step() * batch / near

    def record(self, batch: int, speculated: bool, seconds: float, tokens: int) -> None:
        """A decode step of `batch` running requests (no prompt chunk in it) that gave `tokens` tokens. The first
        step after a switch of mode is timed into the probe budget only."""
        costs = self._costs(batch)
        if costs.last is None or costs.last == speculated:
            (costs.speculate if speculated else costs.plain).add(seconds, tokens)
        costs.last = speculated
        costs.since_probe += seconds

    def chosen(self) -> dict[int, bool]:
        """Per batch size with both estimates: whether speculation is the cheaper mode now (for stats and logs)."""
        out = {}
        for batch, costs in sorted(self._batches.items()):
            spec, plain = costs.speculate.seconds_per_token(), costs.plain.seconds_per_token()
            if spec is not None and plain is not None:
                out[batch] = spec <= plain
        return out
