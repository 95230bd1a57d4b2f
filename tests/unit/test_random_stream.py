"""The counter-based random source: each position's noise is a pure function of (seed, position, purpose), Exp(1)
per token, independent of its neighbours, and the race `argmax p / E` samples p and never picks a token of
probability zero."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from pdspark.engine.random_stream import (
    Purpose,
    RandomStream,
    draw_key,
    exponential_from_uniform,
    exponentials,
    race,
)

LARGEST_BELOW_ONE = 1.0 - 2.0**-53


def chi_square(counts: torch.Tensor, expected: torch.Tensor) -> float:
    return float(((counts - expected) ** 2 / expected).sum())


def uniforms(noise: torch.Tensor) -> torch.Tensor:
    """Exp(1) noise mapped through its CDF: uniform on [0, 1) when the noise is Exp(1)."""
    return -torch.expm1(-noise)


def assert_uniform(u: torch.Tensor) -> None:
    """Kolmogorov-Smirnov at the 99.9% critical value."""
    n = u.numel()
    ranked = u.flatten().double().sort().values
    grid = torch.arange(1, n + 1, dtype=torch.float64) / n
    ks = float(torch.maximum(grid - ranked, ranked - (grid - 1 / n)).max())
    assert ks < 1.95 / math.sqrt(n)


def test_a_draw_is_a_pure_function_of_its_inputs():
    keys = list(itertools.product([0, 7, 2**40, -3], [0, 1, 63, 10_000], list(Purpose)))
    forward = [draw_key(s, p, k) for s, p, k in keys]
    backward = [draw_key(s, p, k) for s, p, k in reversed(keys)][::-1]  # no hidden state: order does not matter
    assert forward == backward
    assert [RandomStream(s).key(p, k) for s, p, k in keys] == forward
    assert all(0 <= key < 2**128 for key in forward)
    noise = exponentials(forward, 64)
    assert torch.equal(exponentials(forward[::-1], 64).flip(0), noise)  # a row depends on its own key only
    assert torch.equal(torch.cat([exponentials([key], 64) for key in forward]), noise)
    assert noise.dtype == torch.float64 and (noise >= 0).all() and noise.isfinite().all()


def test_draws_differ_across_seeds_and_positions():
    keys = [draw_key(s, p, Purpose.SAMPLE) for s in range(40) for p in range(100)]
    assert len(set(keys)) == 40 * 100
    first = exponentials(keys, 4)[:, 0]
    assert first.unique().numel() == 40 * 100


def test_every_bit_of_the_key_seeds_the_noise():
    """torch's CPU generator keeps only the low 32 bits of a seed; these keys differ only above bit 64."""
    key = draw_key(3, 17, Purpose.SAMPLE)
    rows = exponentials([key, key ^ (1 << 64), key ^ (1 << 100), key ^ (1 << 127)], 16)
    assert len({tuple(r.tolist()) for r in rows}) == 4


def test_noise_is_exponential():
    # One token of 20,000 rows over consecutive seeds and positions (the keys a server actually uses), then every
    # token of one long row.
    across = exponentials([draw_key(s, p, Purpose.SAMPLE) for s in range(200) for p in range(100)], 3)
    assert_uniform(uniforms(across[:, 1]))
    along = exponentials([draw_key(11, 5, Purpose.SAMPLE)], 20_000)
    assert_uniform(uniforms(along))
    assert abs(float(along.mean()) - 1.0) < 4 / math.sqrt(along.numel())  # Exp(1): mean 1, sd 1


@pytest.mark.parametrize("neighbour", [
    lambda s, p: (s, p + 1, Purpose.SAMPLE),  # the next token of the same request
    lambda s, p: (s + 1, p, Purpose.SAMPLE),  # the same position of the next seed
    lambda s, p: (s + 1, p + 1, Purpose.SAMPLE),  # the next token of the next seed
], ids=["next-position", "next-seed", "next-seed-next-position"])
def test_neighbouring_draws_are_independent(neighbour):
    """Joint histogram of (token 0's noise at (seed, p, SAMPLE), token 0's at a neighbouring key), as uniforms on an
    8x8 grid, is flat; so is the one of tokens 0 and 1 of the same row."""
    keys = [(s, p) for s in range(100) for p in range(100)]
    a = uniforms(exponentials([draw_key(s, p, Purpose.SAMPLE) for s, p in keys], 2))
    b = uniforms(exponentials([draw_key(*neighbour(s, p)) for s, p in keys], 2))
    for x, y in [(a[:, 0], b[:, 0]), (a[:, 0], a[:, 1])]:
        cells = (x * 8).long() * 8 + (y * 8).long()
        counts = torch.bincount(cells, minlength=64).double()
        assert chi_square(counts, torch.full((64,), len(keys) / 64)) < 103.4  # 99.9% quantile, 63 dof


def test_noise_from_the_edges_of_the_uniform_grid():
    u = torch.tensor([0.0, 2.0**-53, 0.5, LARGEST_BELOW_ONE], dtype=torch.float64)
    e = exponential_from_uniform(u.clone())
    assert e[0] == 2.0**-60  # u = 0: positive, not 0 or -0.0
    torch.testing.assert_close(e[1:], torch.tensor([2.0**-53, math.log(2), 53 * math.log(2)], dtype=torch.float64))
    assert (e > 0).all() and (e < 36.8).all()


def test_race_never_picks_a_zero_probability_token():
    # [5, 6] float32 weights (not normalised): zeros at the ends, in the middle, a single live token, and a live
    # token of the smallest float32 weight beside dead ones.
    weights = torch.tensor([
        [0.0, 0.2, 0.0, 0.5, 0.3, 0.0],
        [0.0, 0.0, 0.0, 0.0, 0.0, 2.5],
        [1e-30, 0.0, 1.0, 0.0, 0.0, 0.0],
        [3.0, 0.0, 0.0, 1.0, 1e-7, 0.0],
        [0.0, 0.0, 0.0, 1.4e-45, 0.0, 0.0],
    ])
    live = weights > 0
    rows = torch.arange(5)
    # The noise's extremes against the zeros: dead tokens at the smallest noise, live ones at the largest.
    adversarial = torch.where(live, 36.8, 2.0**-60).double()
    assert live[rows, race(weights, adversarial)].all()
    assert race(weights, torch.full((5, 6), 2.0**-60, dtype=torch.float64)).tolist() == [3, 5, 2, 0, 3]
    for noise in exponentials([draw_key(9, p, Purpose.SAMPLE) for p in range(500)], 30).view(500, 5, 6):
        assert live[rows, race(weights, noise)].all()


def test_race_follows_the_weights():
    weights = torch.tensor([3.0, 0.0, 1.0, 6.0, 0.0])
    n = 20_000
    noise = exponentials([draw_key(4, p, Purpose.SAMPLE) for p in range(n)], 5)
    counts = torch.bincount(race(weights.expand(n, -1), noise), minlength=5).double()
    assert counts[1] == 0 and counts[4] == 0
    live = weights > 0
    expected = n * weights[live].double() / weights.sum()
    assert chi_square(counts[live], expected) < 13.8  # 99.9% quantile, 2 dof


def test_batched_race_equals_row_by_row():
    g = torch.Generator().manual_seed(0)
    weights = torch.rand(16, 50, generator=g) * (torch.rand(16, 50, generator=g) > 0.5)  # [16, 50], half zeros
    stream = RandomStream(1)
    noise = exponentials([stream.key(p) for p in range(16)], 50)
    batched = race(weights, noise)
    rows = [int(race(weights[i : i + 1], noise[i : i + 1])) for i in range(16)]
    assert batched.tolist() == rows
    assert [stream.choice(weights[i], i) for i in range(16)] == rows
