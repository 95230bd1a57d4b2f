"""Multi-stream attention prepare (`--multi-stream-rows`): which work runs on which stream, and on the CPU (no-op
streams) the same tokens bit for bit, with DSpark verify steps and plain decode steps, as the one-stream path."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from conftest import random_prompts
from helpers import greedy, make_llm
from pdspark.hardware.backend import HardwareBackend
from pdspark.hardware.prepare_streams import PrepareStreams
from pdspark.model import attention as attention_module
from pdspark.model.compressor import Compressor
from pdspark.model.indexer import Indexer


class _Stream:
    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def wait_stream(self, other: _Stream) -> None:
        self.log.append(f"{self.name} waits {other.name}")


class RecordingBackend(HardwareBackend):
    """Streams that log their waits, and which stream is active when the attention's pieces run."""

    name = "recording"
    has_streams = True

    def __init__(self) -> None:
        self.log: list[str] = []
        self._current = _Stream("current", self.log)
        self.active = self._current
        self._made = 0

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def kernels(self) -> frozenset[str]:
        return frozenset()

    def new_stream(self) -> _Stream:
        self._made += 1
        return _Stream(("kv", "q")[self._made - 1], self.log)

    def current_stream(self) -> _Stream:
        return self._current

    @contextmanager
    def use_stream(self, stream):
        self.active, before = stream, self.active
        try:
            yield
        finally:
            self.active = before

    def record_stream(self, tensor, stream) -> None:
        self.log.append(f"record {tensor.dim()}-d tensor of {tensor.shape[0]} rows on {stream.name}")


@pytest.fixture(scope="module")
def ckpt(draft_ckpt):
    return draft_ckpt  # MIXED (sliding, CSA, HCA, CSA) with a 3-token draft


def _spy(monkeypatch, backend: RecordingBackend, owner, name: str, label: str) -> None:
    real = getattr(owner, name)

    def spied(*args, **kwargs):
        backend.log.append(f"{label} on {backend.active.name}")
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, spied)


def test_prepare_runs_kv_and_q_on_side_streams_and_the_rest_on_current(ckpt, monkeypatch):
    llm = make_llm(ckpt, multi_stream_rows=64)
    backend = RecordingBackend()
    llm.engine.runner.streams = PrepareStreams(backend)
    for owner, name, label in [(attention_module.Attention, "_write_kv", "kv write"),
                               (attention_module.Attention, "_q_heads", "q heads"),
                               (Compressor, "run", "compressor"), (Indexer, "select", "indexer")]:
        _spy(monkeypatch, backend, owner, name, label)
    greedy(llm, [[5, 6, 7, 8, 9]], max_tokens=2)  # one prefill step (one stream), then one decode step
    log = backend.log
    first = log.index("kv waits current")
    prefill, decode = log[:first], log[first:]
    assert "kv waits current" not in prefill and all(e.endswith("on current") for e in prefill)
    layers = []  # one decode token through the sliding (0), CSA (1), HCA (2), CSA (3) layers
    while decode:
        end = decode.index("current waits q") + 2
        layers.append(decode[:end])
        decode = decode[end:]
    assert len(layers) == 4
    assert layers[0] == ["kv waits current", "q waits current", "kv write on kv", "q heads on q",
                         "current waits kv", "current waits q", "record 3-d tensor of 1 rows on current"]
    csa = ["kv waits current", "q waits current", "kv write on kv", "q heads on q", "compressor on current",
           "compressor on current", "indexer on current", "current waits kv", "current waits q",
           "record 3-d tensor of 1 rows on current"]
    assert layers[1] == layers[3] == csa
    assert layers[2] == csa[:5] + csa[7:]  # HCA: one compressor, no indexer


def test_cpu_tokens_equal_the_one_stream_path(ckpt, monkeypatch):
    prompts = random_prompts(3, [5, 19, 33], seed=4)
    calls: list[int] = []
    real = attention_module.Attention._prepare_on_streams

    def counted(self, xp, batch, *args):
        calls.append(batch.num_tokens)
        return real(self, xp, batch, *args)

    monkeypatch.setattr(attention_module.Attention, "_prepare_on_streams", counted)
    for opts in (dict(), dict(speculative="dspark")):
        want = greedy(make_llm(ckpt, **opts), prompts, max_tokens=6)
        assert not calls
        got = greedy(make_llm(ckpt, multi_stream_rows=64, **opts), prompts, max_tokens=6)
        assert got == want
        # Decode (1 row a request) or verify (at most 4 rows a request) steps only, never the prompts' extend
        # steps (57 rows together, at least 5 alone).
        assert calls and max(calls) <= (3 if not opts else 12) and (opts or set(calls) <= {1, 2, 3})
        calls.clear()
