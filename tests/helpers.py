"""Builders and checks shared by the tests."""

from __future__ import annotations

from pdspark import LLM, SamplingParams
from pdspark.testing.prompt_logits import prompt_logits  # noqa: F401 (re-exported for the tests)

GREEDY = dict(temperature=0.0, ignore_eos=True)


def sample_value(registry, name: str, **labels) -> float | None:
    """The value of a Prometheus registry's sample `name` with `labels` (None when it has none)."""
    return registry.get_sample_value(name, labels)


def make_llm(path, **kw) -> LLM:
    opts = dict(page_size=16, max_model_len=256, max_num_seqs=16, max_num_batched_tokens=256)
    opts.update(kw)
    return LLM(str(path), **opts)


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=max_tokens, **GREEDY))
    return [o.token_ids for o in outs]


def assert_no_leaks(llm: LLM) -> None:
    """Every pool is consistent and back to its initial free count."""
    engine = llm.engine
    engine.check_integrity()
    assert not engine.scheduler.running and not engine.scheduler.waiting
    engine.flush_cache()
    engine.check_integrity()
    for name, (used, total) in engine.kv.usage().items():
        assert used == 0, f"{name}: {used} of {total} pages still held"


def two_free_ports() -> int:
    """A port P with P + 1 free too (a worker group's rendezvous and its control channel), on loopback."""
    from pdspark.launch.free_ports import free_ports

    return free_ports("127.0.0.1", 2, consecutive=True)[0]
