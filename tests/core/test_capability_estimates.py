"""The posterior's math (coba_tasks/core/capability.py): the prior from the global pass rate, the decay per
visit, the update and the mean the allocation uses."""

from __future__ import annotations

import numpy as np
import pytest

from coba_tasks.core.capability import (
    Estimator,
    counts_before,
    global_pass_rate,
    posterior_mean,
    prior_counts,
    visit,
)


def test_the_prior_is_the_global_pass_rate_weighted_by_its_strength():
    assert global_pass_rate(30, 120) == 0.25 and global_pass_rate(0, 0) == 0.5  # 0.5 before any rollout
    a, b = prior_counts(global_pass_rate(30, 120), 2.0)
    assert (a, b) == (0.5, 1.5) and a / (a + b) == 0.25  # its mean is pbar, its weight s rollouts
    assert prior_counts(0.25, 8.0) == (2.0, 6.0)
    # a prompt with counts keeps them; one without (NaN) takes the prior
    a, b = counts_before(np.array([3.0, np.nan]), np.array([1.0, np.nan]), 0.25, 2.0)
    assert a.tolist() == [3.0, 0.5] and b.tolist() == [1.0, 1.5]
    for bad in (lambda: global_pass_rate(5, 4), lambda: prior_counts(1.5, 2.0), lambda: prior_counts(0.5, 0.0)):
        with pytest.raises(ValueError):
            bad()


def test_a_visit_decays_the_old_counts_then_adds_its_outcomes():
    a, b = visit(np.array([0.5]), np.array([1.5]), np.array([1]), np.array([3]), decay=0.5)
    assert (a[0], b[0]) == (1.25, 3.75)  # 0.5 * 0.5 + 1, 0.5 * 1.5 + 3
    # decay 1 never forgets (counts add up), decay 0 keeps the last visit only (its pass rate)
    a1, b1 = visit(np.array([2.0]), np.array([2.0]), np.array([4]), np.array([0]), decay=1.0)
    a0, b0 = visit(np.array([2.0]), np.array([2.0]), np.array([4]), np.array([0]), decay=0.0)
    assert (a1[0], b1[0]) == (6.0, 2.0) and (a0[0], b0[0]) == (4.0, 0.0) and posterior_mean(a0, b0)[0] == 1.0
    with pytest.raises(ValueError, match="decay"):
        visit(np.array([1.0]), np.array([1.0]), np.array([1]), np.array([1]), decay=1.5)
    with pytest.raises(ValueError, match=">= 0"):
        visit(np.array([1.0]), np.array([1.0]), np.array([-1]), np.array([1]), decay=0.5)


def test_visits_weigh_by_the_decay_to_the_power_of_the_later_visits():
    """After visits 1..n, a = d^n * a0 + sum_j d^(n - j) * s_j (and b alike): the newest visit weighs 1, the
    one before d, the prior d^n; the estimate is a / (a + b)."""
    d, s, pbar = 0.5, 2.0, 0.3
    outcomes = [(2, 0), (0, 2), (1, 3), (4, 4)]  # (successes, failures) per visit
    a, b = counts_before(np.array([np.nan]), np.array([np.nan]), pbar, s)
    for won, lost in outcomes:
        a, b = visit(a, b, np.array([won]), np.array([lost]), d)
    n = len(outcomes)
    want_a = d**n * s * pbar + sum(d ** (n - 1 - j) * w for j, (w, _) in enumerate(outcomes))
    want_b = d**n * s * (1 - pbar) + sum(d ** (n - 1 - j) * f for j, (_, f) in enumerate(outcomes))
    assert a[0] == pytest.approx(want_a, rel=1e-15) and b[0] == pytest.approx(want_b, rel=1e-15)
    assert posterior_mean(a, b)[0] == pytest.approx(want_a / (want_a + want_b), rel=1e-15)
    # a visit whose every rollout failed is not an estimate of 0, as the last visit's pass rate would be
    a, b = visit(*prior_counts(pbar, s), np.array([0]), np.array([2]), d)
    assert posterior_mean(a, b)[0] == pytest.approx(0.3 / 3.0) and (a + b)[0] == 3.0


def test_the_posterior_mean_is_nan_without_counts():
    assert np.isnan(posterior_mean(np.array([0.0]), np.array([0.0]))[0])
    assert [e.value for e in Estimator] == ["last", "posterior", "pilot"]
