"""The counter-based random source: each draw is a pure function of (seed, position, purpose), uniform on [0, 1),
independent of its neighbours, and inverse-CDF sampling never picks a token of probability zero."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from pdspark.engine.random_stream import Purpose, RandomStream, inverse_cdf, uniform

LARGEST_BELOW_ONE = 1.0 - 2.0**-53


def chi_square(counts: torch.Tensor, expected: torch.Tensor) -> float:
    return float(((counts - expected) ** 2 / expected).sum())


def test_a_draw_is_a_pure_function_of_its_inputs():
    keys = list(itertools.product([0, 7, 2**40, -3], [0, 1, 63, 10_000], list(Purpose)))
    forward = [uniform(s, p, k) for s, p, k in keys]
    backward = [uniform(s, p, k) for s, p, k in reversed(keys)][::-1]  # no hidden state: order does not matter
    assert forward == backward
    assert [RandomStream(s).uniform(p, k) for s, p, k in keys] == forward
    assert all(0.0 <= u < 1.0 for u in forward)


def test_draws_differ_across_seeds_and_positions():
    draws = {uniform(s, p, Purpose.SAMPLE) for s in range(40) for p in range(100)}
    assert len(draws) == 40 * 100


def test_draws_are_uniform():
    # 20,000 draws over consecutive seeds and positions: the inputs a server actually uses.
    u = torch.tensor([uniform(s, p, Purpose.SAMPLE) for s in range(200) for p in range(100)], dtype=torch.float64)
    n, bins = u.numel(), 32
    counts = torch.histc(u, bins=bins, min=0.0, max=1.0)
    assert chi_square(counts, torch.full((bins,), n / bins)) < 61.1  # 99.9% quantile, chi-square with 31 dof
    # Kolmogorov-Smirnov: the largest gap between the empirical CDF and the identity.
    ranked = u.sort().values
    grid = torch.arange(1, n + 1, dtype=torch.float64) / n
    ks = float(torch.maximum(grid - ranked, ranked - (grid - 1 / n)).max())
    assert ks < 1.95 / math.sqrt(n)  # 99.9% critical value


@pytest.mark.parametrize("neighbour", [
    lambda s, p: (s, p + 1, Purpose.SAMPLE),  # the next token of the same request
    lambda s, p: (s + 1, p, Purpose.SAMPLE),  # the same position of the next seed
    lambda s, p: (s + 1, p + 1, Purpose.SAMPLE),  # the next token of the next seed
], ids=["next-position", "next-seed", "next-seed-next-position"])
def test_neighbouring_draws_are_independent(neighbour):
    """Joint histogram of (u at (seed, p, SAMPLE), u at a neighbouring key) on an 8x8 grid is flat."""
    keys = [(s, p) for s in range(100) for p in range(100)]
    a = torch.tensor([uniform(s, p, Purpose.SAMPLE) for s, p in keys])
    b = torch.tensor([uniform(*neighbour(s, p)) for s, p in keys])
    cells = (a * 8).long() * 8 + (b * 8).long()
    counts = torch.bincount(cells, minlength=64).double()
    assert chi_square(counts, torch.full((64,), len(keys) / 64)) < 103.4  # 99.9% quantile, 63 dof


def test_inverse_cdf_never_picks_a_zero_probability_token():
    # [4, 6] weights (not normalised): zeros at the ends, in the middle, and a single live token.
    weights = torch.tensor([
        [0.0, 0.2, 0.0, 0.5, 0.3, 0.0],
        [0.0, 0.0, 0.0, 0.0, 0.0, 2.5],
        [1e-30, 0.0, 1.0, 0.0, 0.0, 0.0],
        [3.0, 0.0, 0.0, 1.0, 1e-7, 0.0],
    ])
    edges = [0.0, 1e-300, 0.5, 0.2, 0.7, LARGEST_BELOW_ONE, 1.0]  # 1.0 is outside [0, 1): the guard still holds
    randoms = [uniform(9, p, Purpose.SAMPLE) for p in range(500)]
    for u in edges + randoms:
        picked = inverse_cdf(weights, torch.full((4,), u, dtype=torch.float64))
        assert (weights[torch.arange(4), picked] > 0).all(), (u, picked)
    top = inverse_cdf(weights, torch.full((4,), LARGEST_BELOW_ONE, dtype=torch.float64))
    assert top.tolist() == [4, 5, 2, 4]  # the last token with weight, not a zero-weight tail
    bottom = inverse_cdf(weights, torch.zeros(4, dtype=torch.float64))
    assert bottom.tolist() == [1, 5, 0, 0]


def test_inverse_cdf_at_the_rounding_edge_of_float32_weights():
    """Weights whose float32 total is slightly below the float64 sum of its parts: u just below 1 must still land
    on the last live token, not past the end."""
    weights = torch.full((1, 1000), 0.1, dtype=torch.float32)
    weights[0, -3:] = 0.0
    picked = inverse_cdf(weights, torch.tensor([LARGEST_BELOW_ONE], dtype=torch.float64))
    assert picked.tolist() == [996]


def test_inverse_cdf_follows_the_weights():
    weights = torch.tensor([3.0, 0.0, 1.0, 6.0, 0.0])
    n = 20_000
    rows = weights.expand(n, -1)
    u = torch.tensor([uniform(4, p, Purpose.SAMPLE) for p in range(n)], dtype=torch.float64)
    counts = torch.bincount(inverse_cdf(rows, u), minlength=5).double()
    assert counts[1] == 0 and counts[4] == 0
    live = weights > 0
    expected = n * weights[live].double() / weights.sum()
    assert chi_square(counts[live], expected) < 13.8  # 99.9% quantile, 2 dof


def test_batched_inverse_cdf_equals_row_by_row():
    g = torch.Generator().manual_seed(0)
    weights = torch.rand(16, 50, generator=g) * (torch.rand(16, 50, generator=g) > 0.5)  # [16, 50], half zeros
    u = torch.tensor([uniform(1, p, Purpose.SAMPLE) for p in range(16)], dtype=torch.float64)
    batched = inverse_cdf(weights, u)
    rows = [int(inverse_cdf(weights[i : i + 1], u[i : i + 1])) for i in range(16)]
    assert batched.tolist() == rows
    stream = RandomStream(1)
    assert [stream.choice(weights[i], i, Purpose.SAMPLE) for i in range(16)] == rows
