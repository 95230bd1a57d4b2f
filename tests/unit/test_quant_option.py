"""`--quantization`: auto by default; "none" is a choice of its own (not the unset value); bad values name it."""

from __future__ import annotations

import pytest

from pdspark.config import EngineConfig
from pdspark.errors import ConfigError
from pdspark.options import build, parse_args


def test_quantization_option():
    assert parse_args(EngineConfig, []).quantization == "auto"
    assert parse_args(EngineConfig, ["--quantization", "none"]).quantization == "none"
    assert parse_args(EngineConfig, [], environ={"PDSPARK_QUANTIZATION": "modelslim"}).quantization == "modelslim"
    with pytest.raises(ConfigError, match="quantization.*modelslim"):
        build(EngineConfig, {"quantization": "int8"})
