"""`DraftBacklog` keeps plain steps' draft context rows in buffers made once, hands them back in commit order, and
drops a forgotten request's rows."""

from __future__ import annotations

import torch

from pdspark.engine.draft_backlog import MAX_BYTES, MAX_ROWS, DraftBacklog, capacity

F = 6


def step(first: int, owners: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A step's rows: features whose every value is the row's position, positions, slots = 100 + position."""
    pos = torch.arange(first, first + len(owners))
    return pos[:, None].float().expand(-1, F).contiguous(), pos, pos + 100


def keep(backlog: DraftBacklog, first: int, owners: list[int]) -> None:
    features, positions, slots = step(first, owners + [0])  # a step's buffers hold a row more than it kept
    assert backlog.room(len(owners), F)
    backlog.keep(features, positions, slots, len(owners), owners)
    features.fill_(-1.0)  # the step's buffers are reused: the backlog holds copies
    positions.fill_(-1)


def test_rows_come_back_in_commit_order_as_copies():
    backlog = DraftBacklog()
    keep(backlog, 0, [3, 5])
    keep(backlog, 2, [3, 5])
    assert backlog.rows == 4
    features, positions, slots = backlog.take()
    assert positions.tolist() == [0, 1, 2, 3] and slots.tolist() == [100, 101, 102, 103]
    assert torch.equal(features, positions[:, None].float().expand(-1, F))
    assert backlog.rows == 0 and backlog.take() is None


def test_a_forgotten_request_s_rows_are_dropped_and_the_rest_keep_their_order():
    backlog = DraftBacklog()
    keep(backlog, 0, [3, 5, 7])
    keep(backlog, 3, [3, 5, 7])
    backlog.forget(5)
    backlog.forget(9)  # holds nothing: no change
    features, positions, slots = backlog.take()
    assert positions.tolist() == [0, 2, 3, 5] and slots.tolist() == [100, 102, 103, 105]
    assert torch.equal(features[:, 0], positions.float())
    keep(backlog, 0, [3])
    backlog.forget(3)  # every row forgotten: nothing to write, and the backlog is empty at once
    assert backlog.rows == 0 and backlog.take() is None


def test_the_buffers_hold_a_bounded_number_of_rows():
    backlog = DraftBacklog()
    assert backlog.room(200, F)
    backlog.keep(*step(0, [0] * 200), 200, [0] * 200)
    size = capacity(F)
    assert size == MAX_ROWS
    assert backlog.room(size - 200, F) and not backlog.room(size - 199, F)
    # Another row width while rows are kept: no room until they are taken; then buffers of the new width.
    assert not backlog.room(1, 2 * F)
    backlog.take()
    assert backlog.room(1, 2 * F)
    assert capacity(MAX_BYTES) == 256  # a very wide row: still one step of 256 requests
