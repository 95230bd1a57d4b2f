"""`SpecMetrics`: DSpark speculative decoding on a decode worker: verify steps, drafts proposed and accepted by
draft position, and the mean acceptance length.

Read off the engine's `SpecStats` between steps (on the engine thread): the counters move by the difference since
the last read, so a verify step costs the engine two list adds and nothing here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge

if TYPE_CHECKING:
    from pdspark.engine.engine import SpecStats


class SpecMetrics:
    def __init__(self, registry: CollectorRegistry, num_drafts: int):
        """`num_drafts`: draft tokens per verify step (0: no speculation; then no position series)."""
        r = registry
        self.verify_steps = Counter("pdspark_spec_verify_steps_total", "Speculative verify steps (one per request "
                                    "and step)", registry=r)
        self.draft_tokens = Counter("pdspark_spec_draft_tokens_total", "Draft tokens proposed, by draft position "
                                    "(1 = first after the last committed token)", ["position"], registry=r)
        self.accepted_tokens = Counter("pdspark_spec_accepted_tokens_total", "Draft tokens accepted, by draft "
                                       "position (acceptance at a position: its rate over the drafts')",
                                       ["position"], registry=r)
        self.mean_acceptance_length = Gauge(
            "pdspark_spec_mean_acceptance_length_tokens", "Tokens committed per verify step (accepted drafts + 1) "
            "since the worker started (over a window: 1 + accepted rate / verify step rate)", registry=r)
        self.positions = [str(k + 1) for k in range(num_drafts)]
        for position in self.positions:
            self.draft_tokens.labels(position=position)
            self.accepted_tokens.labels(position=position)
        self._verify_seen = 0
        self._drafted_seen = [0] * num_drafts
        self._accepted_seen = [0] * num_drafts

    def sample(self, spec: SpecStats) -> None:
        if spec.verify_steps == self._verify_seen:
            return
        self.verify_steps.inc(spec.verify_steps - self._verify_seen)
        self._verify_seen = spec.verify_steps
        for counter, now, seen in ((self.draft_tokens, spec.drafted_per_position, self._drafted_seen),
                                   (self.accepted_tokens, spec.accepted_per_position, self._accepted_seen)):
            for k, position in enumerate(self.positions):
                if now[k] > seen[k]:
                    counter.labels(position=position).inc(now[k] - seen[k])
                seen[k] = now[k]
        self.mean_acceptance_length.set(spec.mean_acceptance_length)
