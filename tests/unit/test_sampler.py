"""The sampler of `dsv4 generate` (spec §12): at temperature T > 0 a draw is token i with probability
softmax(logits / T)_i; T -> 0 is the argmax (issue 17).

`dsv4.generate.sample` draws by the exponential race argmax_i(p_i / E_i), E_i ~ Exp(1) i.i.d., which picks i with
probability exactly p_i (P(E_i / p_i is the smallest) = p_i / sum p). A wrong race (multiplying by the noise, a
temperature applied as a factor, a missing softmax) produces another distribution; no other test looks at the
distribution, only at reproducibility and T = 0.

Goodness of fit: Pearson's chi-square over the 7 categories of a hand-made logit vector (df = 6), N = 40000
draws in one batched call with a fixed seed; the test rejects when the p-value is below ALPHA = 1e-4, i.e. a
correct sampler fails with probability 1e-4 for a random seed (the seed is fixed, so the test is deterministic).
Every expected count is >= 400 (chi-square approximation valid). The p-value of a chi-square with an even df = 2m
has the closed form exp(-x/2) * sum_{i<m} (x/2)^i / i!, so no statistics library is needed.
"""

from __future__ import annotations

import math

import pytest
import torch

from dsv4.generate import sample

pytestmark = pytest.mark.hardstop  # the sampled distribution (kills sampler_noise_multiplied)

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.0, -0.5, 0.7, -1.0])  # distinct, not sorted (position must not matter)
N = 40_000
ALPHA = 1e-4


def chi2_pvalue_even_df(x: float, df: int) -> float:
    """Upper tail P(chi2_df > x) for even df (closed form, Poisson sum)."""
    assert df % 2 == 0
    return math.exp(-x / 2) * sum((x / 2) ** i / math.factorial(i) for i in range(df // 2))


def chi2_of_draws(temperature: float, seed: int) -> tuple[float, float]:
    """(statistic, p-value) of N draws of `sample` at `temperature` against softmax(LOGITS / T)."""
    gen = torch.Generator().manual_seed(seed)
    draws = sample(LOGITS.expand(N, -1).contiguous(), temperature, gen)
    assert draws.shape == (N,) and draws.dtype == torch.int64
    counts = torch.bincount(draws, minlength=LOGITS.numel()).double()
    expected = torch.softmax(LOGITS.double() / temperature, -1) * N
    assert float(expected.min()) >= 100, "expected counts too small for the chi-square approximation"
    stat = float(((counts - expected) ** 2 / expected).sum())
    return stat, chi2_pvalue_even_df(stat, LOGITS.numel() - 1)


def test_chi2_pvalue_closed_form():
    # known quantiles: chi2(df=2) median 2 ln 2; chi2(df=6) 95% quantile 12.5916
    assert abs(chi2_pvalue_even_df(2 * math.log(2), 2) - 0.5) < 1e-12
    assert abs(chi2_pvalue_even_df(12.5916, 6) - 0.05) < 1e-5


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_sampled_distribution_matches_softmax(temperature):
    stat, p = chi2_of_draws(temperature, seed=17 + int(temperature * 10))
    assert p >= ALPHA, (f"T={temperature}: the sampled distribution is not softmax(logits/T): chi2 {stat:.1f} "
                        f"(df 6), p-value {p:.2e} < {ALPHA:g}")


def test_goodness_of_fit_has_power():
    """Negative controls: the same check rejects the noise-multiplied race and a temperature applied as a
    factor (logits * T) at these N."""
    gen = torch.Generator().manual_seed(5)
    x = LOGITS.expand(N, -1)
    expected = torch.softmax(LOGITS.double() / 0.6, -1) * N
    wrong = {"p * E": (torch.softmax(x / 0.6, -1) * torch.empty(N, 7).exponential_(1, generator=gen)).argmax(-1),
             "logits * T": (torch.softmax(x * 0.6, -1) / torch.empty(N, 7).exponential_(1, generator=gen)).argmax(-1)}
    for name, d in wrong.items():
        c = torch.bincount(d, minlength=7).double()
        stat = float(((c - expected) ** 2 / expected).sum())
        assert chi2_pvalue_even_df(stat, 6) < ALPHA, name


def test_small_temperature_is_the_argmax():
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(64, 50) * 3  # fresh logits, distinct maxima
    for t in (0.0, 1e-5):  # 1e-5: the smallest T > 0 (below it is refused, no longer clamped)
        got = sample(rows, t, gen)
        assert torch.equal(got, rows.argmax(-1)), f"T={t}: not the argmax"
