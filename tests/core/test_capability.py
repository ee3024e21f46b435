"""CapabilityTracker: the failure rate and the Beta shape, by hand and by property."""

import json
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from coba_tasks.core.capability import CapabilityTracker, beta_mode, transform_failure_rate


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def test_initial_shape_is_kappa_minus_two_and_two():
    t = CapabilityTracker()
    assert (t.alpha, t.beta) == (9.0, 2.0)
    assert math.isnan(t.failure_rate) and math.isnan(t.failure_rate_avg)
    t5 = CapabilityTracker(kappa=7.0)
    assert (t5.alpha, t5.beta) == (5.0, 2.0)


@pytest.mark.parametrize(
    ("pass_rates", "expected_f", "expected_ftil"),
    [
        ([0.0, 0.0, 0.0, 0.0], 1.0, 1.0),  # everything fails: alpha = 1 + 9 = 10
        ([0.1, 0.3], 0.8, 0.8),  # F > 0.5: identity
        ([0.5, 0.5], 0.5, 0.5),  # at 0.5 the sigmoid gives 0.5 too
        ([0.7, 0.9], 0.2, sigmoid(10 * (0.2 - 0.5))),  # F <= 0.5: sigmoid(gamma (F - 0.5))
        ([1.0], 0.0, sigmoid(-5.0)),
    ],
)
def test_alpha_beta_by_hand(pass_rates, expected_f, expected_ftil):
    t = CapabilityTracker()
    alpha, beta = t.update(pass_rates)
    assert t.failure_rate == pytest.approx(expected_f)
    assert t.failure_rate_transformed == pytest.approx(expected_ftil)
    assert alpha == pytest.approx(1.0 + 9.0 * expected_ftil)
    assert beta == pytest.approx(11.0 - alpha)
    assert (t.alpha, t.beta) == (alpha, beta)


def test_hand_value_at_f_point_two():
    # F = 0.2: Ftil = sigmoid(-3) = 0.0474259; alpha = 1 + 9 * 0.0474259 = 1.42683; beta = 9.57317
    t = CapabilityTracker()
    alpha, beta = t.update([0.8, 0.8])
    assert alpha == pytest.approx(1.426833, abs=1e-6)
    assert beta == pytest.approx(9.573167, abs=1e-6)


def test_failure_rate_is_mean_over_prompts_not_rollouts():
    t = CapabilityTracker()
    t.update([1.0, 0.0, 0.0, 0.0])  # one easy prompt, three failed: S = 0.25
    assert t.failure_rate == pytest.approx(0.75)


def test_moving_average_over_window():
    t = CapabilityTracker(window=3)
    for s in (0.0, 0.3, 0.6, 0.9):
        t.update([s])
    assert t.failure_rates == pytest.approx([1.0, 0.7, 0.4, 0.1])
    assert t.failure_rate == pytest.approx(0.1)
    assert t.failure_rate_avg == pytest.approx((0.7 + 0.4 + 0.1) / 3)
    assert t.failure_rate_transformed == pytest.approx(transform_failure_rate(0.4, 10.0))


@given(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=50))
def test_mode_of_beta_equals_transformed_failure_rate(pass_rates):
    t = CapabilityTracker()
    alpha, beta = t.update(pass_rates)
    assert alpha + beta == pytest.approx(11.0)
    assert 1.0 <= alpha <= 10.0
    if alpha > 1.0 and beta > 1.0:
        assert beta_mode(alpha, beta) == pytest.approx(t.failure_rate_transformed, abs=1e-9)


def test_schedule_moves_from_exploit_to_explore():
    t = CapabilityTracker()
    modes = []
    for s in (0.1, 0.3, 0.5, 0.7, 0.9):  # the model gets better
        t.update([s] * 8)
        modes.append(beta_mode(t.alpha, t.beta))
    assert modes == sorted(modes, reverse=True)  # the density's peak moves towards hard prompts
    assert modes[0] > 0.8 and modes[-1] < 0.05


def test_clipping_bounds():
    t = CapabilityTracker(alpha_min=2.0, alpha_max=8.0)
    assert t.update([0.0])[0] == pytest.approx(8.0)  # 1 would be 2 + 9 * 1 = 11, clipped to 8
    assert t.update([1.0] * 10)[0] >= 2.0


def test_state_round_trip_continues_exactly():
    rng = np.random.default_rng(3)
    steps = [rng.uniform(0, 1, size=16) for _ in range(10)]
    full = CapabilityTracker(window=3)
    for s in steps:
        full.update(s)
    first = CapabilityTracker(window=3)
    for s in steps[:4]:
        first.update(s)
    state = json.loads(json.dumps(first.to_dict()))  # through JSON, as a checkpoint stores it
    resumed = CapabilityTracker.from_dict(state)
    assert (resumed.alpha, resumed.beta) == (first.alpha, first.beta)
    for s in steps[4:]:
        resumed.update(s)
    assert resumed.to_dict() == full.to_dict()


@pytest.mark.parametrize(
    ("rates", "match"),
    [([], "non-empty"), ([0.2, 1.5], r"\[0, 1\].*position 1: 1.5"), ([float("nan")], "position 0")],
)
def test_bad_pass_rates(rates, match):
    with pytest.raises(ValueError, match=match):
        CapabilityTracker().update(rates)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"kappa": 2.0}, "kappa"), ({"window": 0}, "window"), ({"gamma": -1.0}, "gamma"), ({"alpha_max": 11.0}, "alpha")],
)
def test_bad_parameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CapabilityTracker(**kwargs)


def test_unknown_state_version():
    state = CapabilityTracker().to_dict()
    state["version"] = 99
    with pytest.raises(ValueError, match="version 99"):
        CapabilityTracker.from_dict(state)
