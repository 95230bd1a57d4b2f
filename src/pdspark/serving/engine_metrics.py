"""`EngineMetrics`: the engine loop's statistics (both roles): its queues, every step's batch size and duration,
the tokens it sampled and its failures. The engine loop calls it (`StepObserver`) on its own thread: one histogram
observation per step, nothing per token."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdspark.engine.fast_path_fallbacks import REASONS as FALLBACK_REASONS

if TYPE_CHECKING:
    from pdspark.engine.engine import Engine
    from pdspark.serving.engine_load import EngineLoad

STEP_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
BATCH_REQUESTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
ERROR_STAGES = ("step", "callback")


class EngineMetrics:
    def __init__(self, registry: CollectorRegistry):
        r = registry
        self.running = Gauge("pdspark_engine_running_requests", "Requests in the engine's running batch", registry=r)
        self.waiting = Gauge("pdspark_engine_waiting_requests", "Requests queued in the engine, not running yet",
                             registry=r)
        self.batch = Histogram("pdspark_engine_batch_requests", "Requests in one engine step (the batch size)",
                               buckets=BATCH_REQUESTS, registry=r)
        self.step_seconds = Histogram("pdspark_engine_step_seconds", "Seconds of one engine step (schedule, "
                                      "draft, forward, sample)", buckets=STEP_SECONDS, registry=r)
        self.generated_tokens = Counter(
            "pdspark_engine_generated_tokens_total", "Tokens the engine sampled (prefill: each request's first "
            "token; decode: the rest); tokens/s is its rate", registry=r)
        self.errors = Counter("pdspark_engine_errors_total", "Engine-loop failures, by stage: step (the step's "
                              "requests were aborted) or callback (a listener or ticker raised)", ["stage"],
                              registry=r)
        for stage in ERROR_STAGES:
            self.errors.labels(stage=stage)
        self.fallback_steps = Counter(
            "pdspark_engine_fast_path_fallback_steps_total", "Decode/verify steps the C fast path did not run (the "
            "slower PyTorch path ran them, same tokens), by reason: model (ModelSlim int8 weights, a bf16/fp16 model, "
            "no C kernels), step_tokens (more rows than the C step takes), pools, device, multi_stream, draft (a "
            "DSpark draft forward or context-row write on the draft's module path)", ["reason"],
            registry=r)
        for reason in FALLBACK_REASONS:
            self.fallback_steps.labels(reason=reason)
        self._fallbacks_seen: dict[str, int] = dict.fromkeys(FALLBACK_REASONS, 0)
        self._generated_seen = 0

    # ---- StepObserver (engine-loop thread) ---------------------------------------------------------------------------
    def on_step(self, seconds: float, batch_size: int) -> None:
        self.step_seconds.observe(seconds)
        self.batch.observe(batch_size)

    def on_error(self, stage: str) -> None:
        self.errors.labels(stage=stage).inc()

    def sample(self, engine: Engine, load: EngineLoad) -> None:
        """Between steps, on the engine thread."""
        self.running.set(load.running)
        self.waiting.set(load.waiting)
        generated = engine.stats.generated_tokens
        if generated > self._generated_seen:
            self.generated_tokens.inc(generated - self._generated_seen)
        self._generated_seen = generated
        for reason, steps in engine.stats.fast_path_fallback_steps.items():
            if steps > self._fallbacks_seen[reason]:
                self.fallback_steps.labels(reason=reason).inc(steps - self._fallbacks_seen[reason])
                self._fallbacks_seen[reason] = steps
