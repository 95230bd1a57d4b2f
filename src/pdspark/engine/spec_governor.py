"""`SpecGovernor`: speculate only at the batch sizes where this machine gives more tokens per second with it.

Whether a DSpark verify step pays depends on the hardware and the batch: where a decode step is bound by reading
the weights, a (gamma+1)-row verify costs about one decode and the accepted drafts come nearly free; where it is
bound by arithmetic (a small model whose weights sit in cache, or a batch whose rows already share every weight
read), the verify costs several decodes and speculation is slower than plain decoding (measured: 0.8-1.0x at batch
1 on a Zen 4 core, 0.3-0.5x at batch 8 on two hosts, 2.0x at batch 1 on a Xeon). Measuring beats guessing: the
governor keeps, per number of running requests, the seconds per generated token of recent decode steps with
drafts and without, and picks the cheaper mode; now and then (at most `PROBE_SHARE` of the time) it runs a few steps
of the other mode, so a change (longer contexts, other prompts, acceptance moving) is seen.

A batch size first seen decodes plainly until plain decoding is measured there (it costs nothing over itself), then
tries drafting at once, unless a smaller size measured in both modes predicts that drafting cannot pay here
(`_drafting_cannot_pay`): a verify step over 8 requests' 48 rows costs ~8x one over 6 rows where the rows are
arithmetic, and five such steps to learn it cost a quarter of a short batch-8 run's time (measured on a Zen 4 VM:
0.78x plain over 128 tokens). The tokens are the same either way (a verify step draws each position exactly as
plain decoding does), so the choice moves only the speed.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

WINDOW_STEPS = 32  # recent steps per mode whose seconds and tokens make its estimate (`_ModeCost`)
MIN_STEPS = 4  # steps of a mode before its estimate counts
# The steps that begin within this many seconds of a switch of mode are not counted: a mode runs slower for a while
# after the other one (step buffers and indices for another row count, caches and clocks settling after the other
# mode's work): measured on a Zen 4 VM with dsv4-tiny, the first plain step after verify steps cost 2-3x a steady
# one, the next ones 1.3-1.6x for 8-12 steps (~5-10 ms), and a verify step after plain ones ~1.1x, for one step. A
# mode measured in its first milliseconds looked twice as dear as it runs in a stretch of its own, which is what
# the choice buys, and the governor kept drafting where it cost 0.8x.
SETTLE_S = 0.015
SETTLE_STEPS = 4  # and the first this many steps, however long (the first after a switch alone ran 2-3x)
# A pause of this long between two steps (no request to run: the engine idle) settles the mode again:
# after a 20 ms sleep the next plain steps of dsv4-tiny ran 3x, 1.7x, 1.3x, 1.1x a steady one (Zen 4 VM). A serving
# loop's own work between steps is well under it.
GAP_S = 0.01
# Probes come in bursts of the mode not chosen: the steps that settle it, then this many counted ones (a burst ends
# when they are counted, not after a number of steps worked out from an estimate: an estimate too high would make
# bursts too short to count a step, and so never be corrected), at most `PROBE_MAX_STEPS` steps or 4 times the
# steps its estimate says settle the mode, whichever is more.
PROBE_COUNTED = 2
PROBE_MAX_STEPS = 64
# At most this share of a batch size's decode time goes to probing the mode not chosen: a burst comes once the
# chosen mode has run 1 / PROBE_SHARE times the burst's expected time (`_burst_seconds`).
PROBE_SHARE = 0.05
# Drafting is tried at a new batch size unless its predicted seconds a token exceed plain decoding's there by this
# factor. The prediction is optimistic (see `_drafting_cannot_pay`), so a size it rules out is one where drafting
# loses clearly; a size where the two come close is measured.
PREDICTED_LOSS = 1.1
# The mode chosen changes only once the other one is this much cheaper a token: each switch costs the settling of the
# mode switched to (above), so two modes of about equal cost are better left than flipped at every wobble.
HYSTERESIS = 0.05


@dataclass
class _ModeCost:
    """Recent seconds and tokens of the decode steps of one mode at one batch size. Its estimates use the median
    step: a step's time hardly depends on how many drafts it accepted (a verify step computes its gamma + 1 rows
    whatever), and a median is not moved by the slow steps of a shared machine (a GC pause, a neighbour's burst, a
    page fault) that a mean of 32 steps carried for as long as they stayed in the window."""

    seconds: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW_STEPS))
    tokens: deque[int] = field(default_factory=lambda: deque(maxlen=WINDOW_STEPS))
    _median: float | None = None  # of `seconds`, made when first asked for after an `add`
    _tokens_sum: int = 0  # of `tokens` (kept as steps come and go: the estimates are asked for at every step)

    def add(self, seconds: float, tokens: int) -> None:
        if len(self.tokens) == WINDOW_STEPS:
            self._tokens_sum -= self.tokens[0]
        self.seconds.append(seconds)
        self.tokens.append(tokens)
        self._tokens_sum += tokens
        self._median = None

    def seconds_per_token(self) -> float | None:
        """The median step's seconds over the mean tokens a step; None before `MIN_STEPS` steps."""
        if len(self.seconds) < MIN_STEPS:
            return None
        return self.seconds_per_step() * len(self.tokens) / max(1, self._tokens_sum)

    def seconds_per_step(self) -> float:
        """The median step's seconds (0 before any step)."""
        if self._median is None:
            ordered, n = sorted(self.seconds), len(self.seconds)
            self._median = 0.0 if not n else (ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2)
        return self._median

    def tokens_per_step(self) -> float:
        return self._tokens_sum / max(1, len(self.tokens))


@dataclass
class _BatchCosts:
    speculate: _ModeCost = field(default_factory=_ModeCost)
    plain: _ModeCost = field(default_factory=_ModeCost)
    since_probe: float = 0.0  # decode seconds at this batch size since the last probe began
    probe_due: float = 0.0  # `since_probe` at which the next probe may be due (`drafts` checks it exactly then)
    probe: bool | None = None  # the mode being probed (None: no probe under way)
    probe_need: int = 0  # its steps still to be counted
    probe_cap: int = 0  # its steps still allowed
    last: bool | None = None  # the mode of the last step recorded (None: none yet)
    settled: float = 0.0  # seconds of that mode since the last switch (or the first step at this size)
    settled_steps: int = 0  # and its steps
    choice: bool | None = None  # drafting chosen (None: not both modes measured yet)
    explored: bool = False  # drafting was run at once to measure it here (`drafts`)
    exploring: bool = False  # and is being run until it is measured


class SpecGovernor:
    def __init__(self, num_drafts: int, probe_share: float = PROBE_SHARE,
                 clock: Callable[[], float] = time.perf_counter):
        if not 0 < probe_share < 1:
            raise ValueError(f"probe_share must be in (0, 1) (got {probe_share})")
        self.num_drafts = num_drafts
        self.probe_share = probe_share
        self._batches: dict[int, _BatchCosts] = {}
        self._clock = clock  # seconds: the pauses between steps (`GAP_S`)
        self._last_busy = float("-inf")  # when the last step ended (recorded or not: `record`, `busy`)

    def drafts(self, batch: int, steady: bool = True) -> int:
        """Draft tokens per verify step for the next step of `batch` running requests (0: decode plainly). Not
        `steady`: prompts are being computed too, so the step will not be timed (its cost is mostly theirs): the
        choice as it stands, without probing. A batch size not measured in both modes yet decodes plainly, and
        measures drafting once plain decoding is measured there (unless it is predicted to lose: then only probes
        measure it, within their share)."""
        if not batch:
            return 0  # (prompts alone: nothing decodes, and no books are made for it)
        costs = self._costs(batch)
        if self._clock() - self._last_busy > GAP_S:
            costs.settled, costs.settled_steps = 0.0, 0  # a pause: the machine settles again (`GAP_S`)
        spec, plain = costs.speculate.seconds_per_token(), costs.plain.seconds_per_token()
        speculate = self._choose(costs, spec, plain)
        if not steady:
            return self.num_drafts if speculate else 0
        if costs.exploring:
            costs.exploring = spec is None
            speculate = speculate or spec is None
            if not costs.exploring:
                costs.since_probe = 0.0
        elif costs.probe is not None and costs.probe_need > 0 and costs.probe_cap > 0:
            costs.probe_cap -= 1
            speculate = costs.probe
        elif costs.probe is not None:
            costs.probe = None  # (counted, or out of steps)
        elif plain is None:
            pass  # plain decoding is measured first (it costs nothing over itself)
        elif spec is None and not costs.explored and not self._drafting_cannot_pay(batch, plain):
            # Measured at once rather than when a probe comes round: waiting left drafting unmeasured (or a costly
            # mode running) for most of a request. Until measured: the steps that settle it, then `MIN_STEPS`.
            costs.explored = costs.exploring = True
            speculate = True
        elif costs.since_probe >= costs.probe_due:
            # (A probe's cost is worked out when one may be due, not at every step: estimates move slowly.)
            costs.probe_due = self._burst_seconds(batch, not speculate) / self.probe_share
            if costs.since_probe >= costs.probe_due:
                costs.since_probe = costs.probe_due = 0.0
                speculate = not speculate  # the other mode's estimate follows the machine, prompts and acceptance
                cap = max(PROBE_MAX_STEPS, 4 * self._settle_steps(batch, speculate))
                costs.probe, costs.probe_need, costs.probe_cap = speculate, PROBE_COUNTED, cap - 1
        return self.num_drafts if speculate else 0

    @staticmethod
    def _choose(costs: _BatchCosts, spec: float | None, plain: float | None) -> bool:
        """The mode chosen at a batch size: the cheaper a token, changed only past `HYSTERESIS`; plain decoding
        until both are measured."""
        if spec is None or plain is None:
            return False
        if costs.choice is None:
            costs.choice = spec <= plain
        elif costs.choice and plain < spec * (1 - HYSTERESIS):
            costs.choice = False
        elif not costs.choice and spec < plain * (1 - HYSTERESIS):
            costs.choice = True
        return costs.choice

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
        """What a step of that mode takes at `batch`: its own median, else the nearest size's scaled by rows."""
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

    def _settle_steps(self, batch: int, speculate: bool) -> int:
        """Steps of that mode at `batch` that settle it after a switch: the first `SETTLE_STEPS`, and those that
        begin within `SETTLE_S`."""
        step = self._step_seconds(batch, speculate)
        return max(SETTLE_STEPS, 1 + (int(SETTLE_S / step) if step > 0 else 0))

    def _burst_seconds(self, batch: int, speculate: bool) -> float:
        """What a probe of that mode at `batch` takes: the steps that settle it, then `PROBE_COUNTED` more."""
        return (self._settle_steps(batch, speculate) + PROBE_COUNTED) * self._step_seconds(batch, speculate)

    def record(self, batch: int, speculated: bool, seconds: float, tokens: int) -> None:
        """A decode step of `batch` running requests (no prompt chunk in it) that gave `tokens` tokens. A step that
        settles its mode (among the first `SETTLE_STEPS` steps or `SETTLE_S` seconds after a switch of mode, or
        after the first step at this size) is timed into the probe budget only."""
        costs = self._costs(batch)
        if costs.last is not None and costs.last != speculated:
            costs.settled, costs.settled_steps = 0.0, 0
        if costs.settled >= SETTLE_S and costs.settled_steps >= SETTLE_STEPS:
            (costs.speculate if speculated else costs.plain).add(seconds, tokens)
            if costs.probe == speculated:
                costs.probe_need -= 1
        costs.settled += seconds
        costs.settled_steps += 1
        costs.last = speculated
        costs.since_probe += seconds
        self._last_busy = self._clock()

    def busy(self) -> None:
        """A step that is not recorded (prompts in it) ended now: the engine was not idle (`GAP_S`)."""
        self._last_busy = self._clock()

    def chosen(self) -> dict[int, bool]:
        """Per batch size with both estimates: whether speculation is the mode chosen now (for stats and logs)."""
        out = {}
        for batch, costs in sorted(self._batches.items()):
            spec, plain = costs.speculate.seconds_per_token(), costs.plain.seconds_per_token()
            if spec is not None and plain is not None:  # (the choice `drafts` made last, else the cheaper now)
                out[batch] = costs.choice if costs.choice is not None else spec <= plain
        return out
