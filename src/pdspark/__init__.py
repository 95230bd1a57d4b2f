"""pdspark: a disaggregated prefill/decode serving system for DeepSeek-V4 class models."""

from pdspark.llm import LLM
from pdspark.types import RequestOutput, SamplingParams, TokenLogprobs

__all__ = ["LLM", "RequestOutput", "SamplingParams", "TokenLogprobs"]
__version__ = "0.1.0"
