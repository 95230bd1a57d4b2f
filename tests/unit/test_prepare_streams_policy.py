"""The multi-stream prepare policy: decode and verify steps only, within the row limit."""

from __future__ import annotations

import pytest

from pdspark.hardware.prepare_streams import use_prepare_streams


@pytest.mark.parametrize(
    "kinds, rows, limit, expected",
    [
        (["decode"], 1, 64, True),
        (["decode"] * 64, 64, 64, True),
        (["decode"] * 65, 65, 64, False),  # over the row limit
        (["verify", "verify"], 8, 64, True),
        (["decode", "verify"], 5, 64, True),  # both read a few rows per request
        (["extend"], 16, 64, False),  # prefill fills the device on its own
        (["decode", "extend"], 17, 64, False),  # mixed
        (["verify", "extend"], 20, 64, False),
        (["decode"], 1, 0, False),  # off
        ([], 0, 64, False),
    ],
)
def test_policy(kinds, rows, limit, expected):
    assert use_prepare_streams(kinds, rows, limit) is expected
