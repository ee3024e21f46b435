"""Value functions: CoBA-RL and Knapsack-RL (docs/method.md)."""

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from scipy import stats

from coba_tasks.core.values import (
    adaptive_tau,
    beta_density,
    coba_gain_params,
    coba_value,
    effective_number,
    knapsack_value,
    saturation,
)


def coba_marginal_gain(budget: np.ndarray, p: np.ndarray, alpha: float, beta: float, tau: float) -> np.ndarray:
    """dV(B) = V(B + 1) - V(B) = C exp(-k B) (1 - exp(-k)): the closed form the solvers use, from coba_gain_params."""
    a, k = coba_gain_params(p, alpha, beta, tau)
    return np.exp(a - k * np.asarray(budget, dtype=np.float64))


def test_beta_density_matches_scipy():
    p = np.linspace(0.01, 0.99, 37)
    for a, b in [(9.0, 2.0), (1.0, 10.0), (5.5, 5.5), (1.4, 9.6)]:
        np.testing.assert_allclose(beta_density(p, a, b), stats.beta.pdf(p, a, b), rtol=1e-12)


def test_value_by_hand():
    # p = 0.5, alpha = beta = 2: density = 6 p (1 - p) = 1.5; tau = 4, B = 8: eta = 1 - exp(-0.5)
    v = coba_value(8, 0.5, 2.0, 2.0, 4.0)
    assert v == pytest.approx(1.5 * (1.0 - math.exp(-0.5)))


def test_pass_rate_clipped_to_one_percent():
    assert coba_value(4, 0.0, 3.0, 8.0, 5.0) == pytest.approx(coba_value(4, 0.01, 3.0, 8.0, 5.0))
    assert coba_value(4, 1.0, 3.0, 8.0, 5.0) == pytest.approx(coba_value(4, 0.99, 3.0, 8.0, 5.0))
    assert np.isfinite(coba_value(4, 0.0, 0.5, 0.5, 5.0))


@given(
    p=st.floats(0.0, 1.0),
    alpha=st.floats(1.0, 10.0),
    tau=st.floats(3.0, 12.0),
    b=st.integers(0, 200),
)
def test_marginal_gain_closed_form_equals_difference(p, alpha, tau, b):
    beta = 11.0 - alpha
    diff = coba_value(b + 1, p, alpha, beta, tau) - coba_value(b, p, alpha, beta, tau)
    assert coba_marginal_gain(b, p, alpha, beta, tau) == pytest.approx(diff, rel=1e-7, abs=1e-13)


@given(p=st.floats(0.0, 1.0), alpha=st.floats(1.0, 10.0), tau=st.floats(3.0, 12.0))
def test_marginal_gain_is_geometric_in_budget(p, alpha, tau):
    beta = 11.0 - alpha
    gains = coba_marginal_gain(np.arange(2, 40), p, alpha, beta, tau)
    ratios = gains[1:] / gains[:-1]
    pc = min(max(p, 0.01), 0.99)
    np.testing.assert_allclose(ratios, math.exp(-pc * (1 - pc) / tau), rtol=1e-9)
    assert np.all(np.diff(gains) < 0)  # strictly decreasing: V is concave in B


def test_gain_params_by_hand():
    a, k = coba_gain_params(np.array([0.5]), 2.0, 2.0, 4.0)
    assert k[0] == pytest.approx(0.0625)
    assert a[0] == pytest.approx(math.log(1.5) + math.log(1 - math.exp(-0.0625)))


def test_saturation_limits():
    assert saturation(0, 0.3, 5.0) == 0.0
    assert saturation(10_000, 0.3, 5.0) == pytest.approx(1.0)


def test_adaptive_tau():
    assert adaptive_tau(np.full(10, 0.4)) == pytest.approx(3.0)  # no spread: tau_min
    # var([0, 1]) = 0.25 > 1/6: v clipped to 1 -> tau_max
    assert adaptive_tau(np.array([0.0, 1.0])) == pytest.approx(12.0)
    # var([0.2, 0.6]) = 0.04: v = 0.24, tau = 3 + 9 * 0.24 = 5.16
    assert adaptive_tau(np.array([0.2, 0.6])) == pytest.approx(5.16)
    assert adaptive_tau(np.array([])) == 3.0


@pytest.mark.parametrize(
    ("n", "p", "expected"),
    [
        (2, 0.5, (1 - 0.25 - 0.25) * 0.5 * 0.25),  # 0.0625
        (4, 0.5, (1 - 2 / 16) * 0.5 * 0.25),
        (8, 0.25, (1 - 0.25**8 - 0.75**8) * 0.25 * 0.75**2),
        (16, 0.0, 0.0),
        (16, 1.0, 0.0),
    ],
)
def test_knapsack_value_by_hand(n, p, expected):
    assert knapsack_value(n, p) == pytest.approx(expected)


def test_knapsack_value_concave_in_n():
    n = np.arange(2, 130)
    for p in (0.05, 0.3, 0.5, 0.9):
        v = knapsack_value(n, p)
        d = np.diff(v)
        assert np.all(d >= 0) and np.all(np.diff(d) <= 1e-15)


def test_effective_number_counts_equal_weights_and_falls_as_one_weight_grows():
    assert effective_number(np.ones(4)) == 4.0
    assert effective_number(np.array([3.0, 0.0, 0.0])) == 1.0
    assert effective_number(np.zeros(3)) == 0.0 and effective_number(np.array([])) == 0.0
    # 3 prompts of 30 rollouts and 29 of 2: 148^2 / (3 * 900 + 29 * 4)
    w = np.array([30.0] * 3 + [2.0] * 29)
    assert effective_number(w) == pytest.approx(148**2 / (3 * 900 + 29 * 4), rel=1e-15)
    assert effective_number(w[::-1]) == effective_number(w)
    for bad in (np.array([1.0, -1.0]), np.array([1.0, np.nan])):
        with pytest.raises(ValueError, match="finite and non-negative"):
            effective_number(bad)
