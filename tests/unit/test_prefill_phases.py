"""A prefill rendezvous's phases: the moves its one transition function allows, and the ones that would be a bug
(ending twice, ending while writes still read the pages, going back to the engine after the transfer started)."""

from __future__ import annotations

import asyncio

import pytest

from pdspark.deadline import Deadline
from pdspark.serving.prefill_worker import Phase, _Rendezvous


@pytest.fixture
def rendezvous():
    loop = asyncio.new_event_loop()
    yield lambda: _Rendezvous("t", Deadline.after(10), loop.create_future())
    loop.close()


def test_the_path_of_a_transfer_and_its_release_rule(rendezvous):
    rv = rendezvous()
    path = [Phase.QUEUED, Phase.PREFILLED, Phase.TRANSFERRING, Phase.WRITING, Phase.TRANSFERRING, Phase.ENDED]
    held = []
    for phase in path:
        rv.enter(phase)
        held.append(rv.phase.in_engine)
    assert held == [True, True, True, True, True, False]


@pytest.mark.parametrize("start, move", [
    ([Phase.QUEUED, Phase.PREFILLED, Phase.TRANSFERRING, Phase.WRITING], Phase.ENDED),  # writes still read pages
    ([Phase.ENDED], Phase.ENDED),  # released twice
    ([Phase.QUEUED, Phase.PREFILLED, Phase.TRANSFERRING], Phase.QUEUED),
    ([], Phase.PREFILLED),  # a first token for a prompt never queued
])
def test_a_move_the_table_does_not_list_is_refused(rendezvous, start, move):
    rv = rendezvous()
    for phase in start:
        rv.enter(phase)
    with pytest.raises(AssertionError, match=f"-> {move.value}"):
        rv.enter(move)
