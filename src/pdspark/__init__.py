"""pdspark: a disaggregated prefill/decode serving system for DeepSeek-V4 class models.

`LLM` loads torch and is imported on first use, so that the router, the SDK and the wire code (which import this
package) stay torch-free: the core package installs without torch, `LLM` and the workers need `pdspark[engine]`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdspark import omp_wait_policy

omp_wait_policy.apply()  # before anything loads torch (and libgomp with it): see omp_wait_policy

from pdspark.types import RequestOutput, SamplingParams, StructuredOutputs, TokenLogprobs  # noqa: E402

if TYPE_CHECKING:
    from pdspark.llm import LLM

__all__ = ["LLM", "RequestOutput", "SamplingParams", "StructuredOutputs", "TokenLogprobs"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "LLM":
        from pdspark.engine_extra import require_engine

        require_engine("`pdspark.LLM`")
        from pdspark.llm import LLM

        return LLM
    raise AttributeError(f"module 'pdspark' has no attribute {name!r}")
