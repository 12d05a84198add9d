"""The decode engine's sampler finds a token by inverse CDF in two levels (blocks of tokens, then the
chosen block): the same token as one search over the whole cumulative sum, never a token of mass 0."""

from __future__ import annotations

import torch

from kdistill.ops.sample import CDF_BLOCK, inverse_cdf


def _one_level(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    cdf = probs.double().cumsum(-1)
    target = u.double()[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, target, right=True).clamp_(max=probs.shape[-1] - 1)[:, 0]


def test_the_two_level_search_picks_the_one_level_searchs_token():
    g = torch.Generator().manual_seed(0)
    for v in (5, CDF_BLOCK, 3 * CDF_BLOCK + 17, 1000):
        probs = torch.rand((64, v), generator=g, dtype=torch.float64) ** 4  # uneven masses
        probs[:, ::3] = 0.0  # and tokens of none
        u = torch.rand(64, generator=g, dtype=torch.float64)
        u[:4] = torch.tensor([0.0, 1e-12, 0.5, 1 - 1e-12], dtype=torch.float64)
        got = inverse_cdf(probs, u)
        assert torch.equal(got, _one_level(probs, u))
        assert bool((probs.gather(1, got[:, None]) > 0).all())


def test_a_row_whose_mass_sits_in_one_token_always_draws_it():
    probs = torch.zeros((3, 700))
    probs[0, 0], probs[1, 699], probs[2, 300] = 1.0, 2.0, 0.25
    for x in (0.0, 0.3, 0.999999):
        assert inverse_cdf(probs, torch.full((3,), x)).tolist() == [0, 699, 300]


def test_draws_follow_the_distribution():
    g = torch.Generator().manual_seed(1)
    p = torch.tensor([0.1, 0.0, 0.6, 0.3] + [0.0] * 300)
    u = torch.rand(40000, generator=g)
    counts = torch.bincount(inverse_cdf(p.expand(40000, -1), u), minlength=304)[:4].double() / 40000
    assert counts[1] == 0 and torch.allclose(counts, p[:4].double(), atol=0.01)
