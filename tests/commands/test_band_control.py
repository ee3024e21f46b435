"""scripts/band_control.py: the positive control's early stop and paired contrast on synthetic comparison tables."""

from __future__ import annotations

import pandas as pd
import pytest
from scripts_loader import load_script

band_control = load_script("scripts/band_control.py")


def _levels(turned: dict[tuple[str, int], int]) -> pd.DataFrame:
    """steps_by_level rows: each run's band wrong->mixed count at step 3, and a level-0 row that must not count."""
    rows = []
    for (strategy, seed), n in turned.items():
        rows.append({"strategy": strategy, "seed": seed, "step": 3, "difficulty": 1, "wrong_to_mixed": n})
        rows.append({"strategy": strategy, "seed": seed, "step": 3, "difficulty": 0, "wrong_to_mixed": 50})
    return pd.DataFrame(rows)


def test_the_early_stop_needs_knapsack_above_uniform_in_two_of_three_pairs():
    uniform = {("uniform", s): 2 for s in (400, 401, 402)}
    go = band_control.early_stop(_levels({**uniform, ("knapsack", 400): 5, ("knapsack", 401): 3, ("knapsack", 402): 2}))
    assert go["pairs"] == {400: (2, 5), 401: (2, 3), 402: (2, 2)} and go["above"] == 2 and not go["stop"]
    stop = band_control.early_stop(
        _levels(
            {
                **{("uniform", s): 4 for s in (400, 401, 402)},
                ("knapsack", 400): 5,
                ("knapsack", 401): 4,
                ("knapsack", 402): 1,
            }
        )
    )
    assert stop["above"] == 1 and stop["stop"] and stop["complete"]
    partial = band_control.early_stop(_levels({("uniform", 400): 1, ("knapsack", 400): 3}))
    assert not partial["complete"]


def test_the_contrast_pairs_seeds_on_the_mean_of_steps_6_and_12():
    rows = []
    for seed, (u6, u12, k6, k12) in {
        400: (0.2, 0.3, 0.3, 0.4),
        401: (0.1, 0.3, 0.2, 0.3),
        402: (0.2, 0.4, 0.2, 0.5),
    }.items():
        for step, u, k in ((0, 0.05, 0.05), (6, u6, k6), (12, u12, k12)):
            rows += [{"strategy": "uniform", "seed": seed, "step": step, "accuracy": u}]
            rows += [{"strategy": "knapsack", "seed": seed, "step": step, "accuracy": k}]
    rows.append({"strategy": "knapsack", "seed": 403, "step": 6, "accuracy": 0.9})  # no uniform pair: left out
    c = band_control.contrast(pd.DataFrame(rows), "knapsack")
    assert c["pairs"] == 3
    assert c["per_seed"] == pytest.approx({400: 0.1, 401: 0.05, 402: 0.05})
    assert c["difference"] == pytest.approx(0.2 / 3)
    assert c["ci"][0] < c["difference"] < c["ci"][1] and 0 < c["p"] < 1
    assert c["uniform_gain_6_12"] == pytest.approx((0.1 + 0.2 + 0.2) / 3)
    assert band_control.contrast(pd.DataFrame(rows), "coba") is None
