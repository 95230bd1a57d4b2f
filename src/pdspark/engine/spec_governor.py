"""`SpecGovernor`: speculate only at the batch sizes where this machine gives more tokens per second with it.

Whether a DSpark verify step pays depends on the hardware and the batch: where a decode step is bound by reading
the weights, a (gamma+1)-row verify costs about one decode and the accepted drafts come nearly free; where it is
bound by arithmetic (a small model whose weights sit in cache, or a batch whose rows already share every weight
read), the verify costs several decodes and speculation is slower than plain decoding (measured: 0.8-1.0x at batch
1 on a Zen 4 core, 0.3-0.5x at batch 8 on two hosts, 2.0x at batch 1 on a Xeon). Measuring beats guessing: the
governor keeps, per number of running requests, the seconds per generated token of recent decode steps with
drafts and without, and picks the cheaper mode; now and then (at most `PROBE_SHARE` of the time) it runs a few steps
of the other mode, so a change (longer contexts, other prompts, acceptance moving) is seen. A batch size first seen
follows the nearest measured one's choice and, once that mode is measured there, the other mode at once
(`MIN_STEPS` + 1 steps). The tokens are
the same either way (a verify step draws each position exactly as plain decoding does), so the choice moves
only the speed.
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


@dataclass
class _BatchCosts:
    speculate: _ModeCost = field(default_factory=_ModeCost)
    plain: _ModeCost = field(default_factory=_ModeCost)
    since_probe: float = 0.0  # decode seconds at this batch size since the last probe began
    probe_left: int = 0  # steps of the current probe still to come
    last: bool | None = None  # the mode of the last step recorded (None: none yet)
    explored: bool = False  # the mode not chosen was run once, at once, to measure it here (`drafts`)


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
        choice as it stands, without probing. A batch size not measured in both modes yet follows the nearest one
        that is (the mode it lacks is probed like any other); before anything is known, speculation is measured
        first, then plain decoding."""
        costs = self._costs(batch)
        spec, plain = costs.speculate.seconds_per_token(), costs.plain.seconds_per_token()
        if spec is not None and plain is not None:
            speculate = spec <= plain
        else:
            guess = self._nearest_choice(batch)
            if guess is None:
                return 0 if not steady or spec is not None else self.num_drafts
            speculate = guess
        if steady:
            own, other = (spec, plain) if speculate else (plain, spec)
            if costs.probe_left:
                costs.probe_left -= 1
                speculate = not speculate
            elif own is not None and other is None and not costs.explored:
                # A batch size that follows another's choice, once it measured that mode here, measures the other
                # one at once: the nearest size's choice is often wrong at this one (drafting pays at 1 request,
                # costs at 8), and waiting for probes within the share left a costly mode running for most of a
                # request.
                costs.explored, costs.since_probe, costs.probe_left = True, 0.0, MIN_STEPS
                speculate = not speculate
            elif costs.since_probe * self.probe_share >= PROBE_BURST * self._step_seconds(batch, not speculate):
                costs.since_probe, costs.probe_left = 0.0, PROBE_BURST - 1
                speculate = not speculate  # the other mode's estimate follows the machine, prompts and acceptance
        return self.num_drafts if speculate else 0

    def _costs(self, batch: int) -> _BatchCosts:
        """`batch`'s books, made on its first step (not `setdefault`: that built a new, unused set of books, four
        deques, at every step)."""
        costs = self._batches.get(batch)
        if costs is None:
            costs = self._batches[batch] = _BatchCosts()
        return costs

    def _nearest_choice(self, batch: int) -> bool | None:
        """The choice at the nearest batch size measured in both modes (the smaller on a tie); None: none is."""
        known = self.chosen()
        if not known:
            return None
        return known[min(known, key=lambda b: (abs(b - batch), b))]

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
