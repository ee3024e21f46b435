"""Knapsack-RL against its authors' code (docs/method.md, section 11).

The two Parquet files beside this one hold what the official code (liziniu/KnapsackRL at commit
ca5d5f5b7e933378d916d05d1aeb4ae9de929ee5, recorded in each file's metadata) returned on random cases;
the official code itself is not part of this repository.

- knapsack_official_cases.parquet: 400 batches (1-96 prompts, B_low 2-4, B_up from B_low to 128,
  G from B_low to B_up, estimates k/d and continuous, with exact 0s and 1s and prompts without an
  estimate as NaN). ``budgets``: ``sampling_budget_by_knapsack(reward_states, n=G, min_n=B_low,
  max_n=B_up)`` with its other arguments at their defaults, run with its plain numpy program;
  ``budgets_numba``: the same call as shipped with numba installed, which hands problems with
  M_mixed * budget * (B_up - B_low) > 50,000 to a numba-compiled copy (``numba`` says which did);
  ``official_failed``: the official call failed its own total check (surplus and every prompt mixed),
  and both budget columns hold its answer with ``allow_fallback=False``.
- knapsack_official_estimates.parquet: 200 prompts' visits (solved flags per visit); after each visit
  the official dataset's ``get_sample_state`` (buffer full, estimate) with its shipped settings
  (epoch_estimation, robust_epoch_estimation, reward_buffer_length 16, min_buffer_length 8).
"""

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from coba_tasks.core.allocation import plan_allocation
from coba_tasks.core.knapsack import (
    knapsack_costs,
    knapsack_item_values,
    knapsack_rl,
    pool_outcomes,
    pooled_estimate,
)
from coba_tasks.core.solvers import solve_mckp_dp
from coba_tasks.core.values import knapsack_value

HERE = Path(__file__).parent
CASES = pd.read_parquet(HERE / "knapsack_official_cases.parquet")
ESTIMATES = pd.read_parquet(HERE / "knapsack_official_estimates.parquet")


def ours(row) -> np.ndarray:
    p = np.asarray(row.estimates, dtype=np.float64)
    total = int(row.prompts) * int(row.group_size)
    plan = plan_allocation(
        p, total, strategy="knapsack", min_budget=int(row.min_budget), max_budget=int(row.max_budget)
    )
    return plan.budgets


def knapsack_objective(budgets: np.ndarray, p: np.ndarray, low: int) -> float:
    """The official program's objective: value(B_i, p_i) over mixed prompts given extra rollouts."""
    mixed = (p > 0) & (p < 1)
    b = budgets[mixed]
    return float(np.where(b > low, knapsack_value(b, p[mixed]), 0.0).sum())


def test_the_cases_cover_every_branch():
    p = CASES["estimates"].map(np.asarray)
    assert len(CASES) == 400
    assert CASES["official_failed"].sum() >= 5 and CASES["numba"].sum() >= 5
    assert (CASES["budgets"].map(max) > CASES["max_budget"]).sum() >= 20  # surplus above B_up
    assert p.map(lambda x: np.isnan(x).any()).sum() >= 50 and p.map(lambda x: (x == 0).any()).sum() >= 100
    assert p.map(lambda x: np.isnan(x).all()).sum() >= 5 and p.map(lambda x: ((x > 0) & (x < 1)).all()).sum() >= 20


def test_same_budgets_as_the_official_code_on_every_case():
    mismatches = [int(r.case) for r in CASES.itertuples() if ours(r).tolist() != list(r.budgets)]
    assert mismatches == []


def test_the_official_numba_program_differs_only_where_values_tie_in_float32():
    # The numba copy computes the item values partly in float64; where they are flat in float32 (large N)
    # it picks other extras of the same value. Budgets outside the knapsack are the same.
    differ = 0
    for r in CASES.itertuples():
        b, official = ours(r), np.asarray(r.budgets_numba)
        if np.array_equal(b, official):
            continue
        differ += 1
        assert r.numba
        p = np.asarray(r.estimates, dtype=np.float64)
        mixed = (p > 0) & (p < 1)
        assert np.array_equal(b[~mixed], official[~mixed]) and b.sum() == official.sum()
        low = int(r.min_budget)
        assert knapsack_objective(b, p, low) == pytest.approx(knapsack_objective(official, p, low), rel=1e-7)
    assert differ <= 10


def test_estimates_as_the_official_dataset_keeps_them():
    for r in ESTIMATES.itertuples():
        pooled: list[int] = []
        for visit, has, official in zip(r.visits, r.has_estimate, r.estimate, strict=True):
            pooled = pool_outcomes(pooled, visit)
            mine = pooled_estimate(pooled)
            assert np.isnan(mine) != has, (r.case, visit)
            if has:
                assert mine == official, (r.case, visit)


# --- the demo's shape: 16 prompts, G = 8 (B_total = 128), bounds 2..32 ----------------------------

EARLY = [0, 0, 0, 0, 1 / 8, 1 / 8, 1 / 4, 1 / 4, 1 / 4, 3 / 8, 3 / 8, 1 / 2, 1 / 2, 5 / 8, 3 / 4, 1]
LATER = [0, 0, 1 / 8, 1 / 4, 3 / 8, 1 / 2, 1 / 2, 5 / 8, 3 / 4, 7 / 8, 1, 1, 1, 1, 1, 1]


def test_a_prompt_estimated_at_zero_in_the_demo_shape():
    # early in the demo (mean estimate 0.27): costs 17, 17, 8, 8, 8, 4, 4, 3, 3, 4, 8 sum to 84 < 96 spare,
    # so the surplus 12 goes to the four prompts at 0: 2 + 3 = 5 each (the rule before gave them 2)
    plan = plan_allocation(EARLY, 128, strategy="knapsack", max_budget=32)
    assert plan.budgets.tolist() == [5, 5, 5, 5, 15, 14, 11, 11, 11, 8, 8, 7, 7, 7, 7, 2]  # the official code's
    assert plan.extras == {"estimated_cost": 84, "surplus": 12}
    assert plan.groups.tolist() == ["zero"] * 4 + ["mixed"] * 11 + ["one"]
    # later (mean 0.64, six prompts at 1): the costs sum to 64, and the two prompts at 0 share 32: 18 each
    later = plan_allocation(LATER, 128, strategy="knapsack", max_budget=32)
    assert later.budgets.tolist() == [18, 18, 20, 13, 9, 8, 8, 8, 9, 5, 2, 2, 2, 2, 2, 2]  # the official code's


def test_costs_by_hand():
    # log(0.1) / log(max(p, 1 - p)): 3.32 at 1/2, 8.004 at 3/4 and 1/4, 17.24 at 1/8; capped at B_up, truncated
    assert knapsack_costs(np.array([0.5, 0.75, 0.25, 0.125, 0.01]), 32).tolist() == [3, 8, 8, 17, 32]
    # max(p, 1 - p) rounds to 1 (the official code fails there): the limit, B_up
    assert knapsack_costs(np.array([1e-200]), 32).tolist() == [32]


def test_item_values_are_zero_without_extras_and_float32():
    t = knapsack_item_values(np.array([0.5, 0.25]), 2, 3)
    assert t[:, 0].tolist() == [0.0, 0.0]
    expected = np.float32((1 - 0.5**3 - 0.5**3) * 0.5 * 0.25)
    assert t[0, 1] == float(expected)
    assert t.dtype == np.float64 and np.array_equal(t, t.astype(np.float32).astype(np.float64))


def test_no_estimate_counts_with_the_zeros():
    # a prompt without an estimate gets G and, like the prompts at 0, a share of the surplus
    p = np.array([np.nan, 0.0, 0.5, 1.0])
    plan = knapsack_rl(p, ~np.isnan(p), 32, 2, 16)
    # start 8, 2, 2, 2 (rest 18); cost of 0.5 is 3 < 18: surplus 15 -> 8 + 8 and 2 + 7; the knapsack gives 0.5 three
    assert plan.budgets.tolist() == [16, 9, 5, 2] and plan.surplus == 15 and plan.estimated_cost == 3


def test_every_prompt_mixed_keeps_the_whole_rest_in_the_knapsack():
    # the official code fails here (nowhere to send the surplus); its answer with the fallback off
    p = np.array([0.5, 0.5, 0.25])
    plan = knapsack_rl(p, np.ones(3, dtype=bool), 30, 2, 16)
    assert plan.surplus == 0 and plan.budgets.sum() == 30 and plan.budgets.max() <= 16


def test_what_the_knapsack_cannot_place_is_spread_uncapped():
    # cost 17 (p = 1/8) capped at B_up = 4 is 4 per prompt: 8 > 2 prompts * (4 - 2), so each takes 2 more
    p = np.array([0.125, 0.125, 1.0])
    plan = knapsack_rl(p, np.ones(3, dtype=bool), 18, 2, 4)
    # rest 12, estimated 8 < 12: surplus 4 -> the prompt at 1 (no prompt at 0); the knapsack places 4 of 8
    assert plan.budgets.tolist() == [6, 6, 6]


def test_solver_setting_does_not_change_knapsack():
    p = np.array([0.0, 0.3, 0.6, 0.9, np.nan])
    runs = {
        s: plan_allocation(p, 40, strategy="knapsack", solver=s, max_budget=16) for s in ("heap", "threshold", "dp")
    }
    assert len({tuple(r.budgets.tolist()) for r in runs.values()}) == 1
    assert {r.solver for r in runs.values()} == {"dp"}


def test_dp_fewest_on_ties():
    values = np.array([[0.0, 1.0, 1.0, 1.0], [0.0, 1.0, 1.0, 1.0]])
    assert solve_mckp_dp(values, 3, fewest_on_ties=True).tolist() == [2, 1]  # the last item takes the fewest
    assert solve_mckp_dp(values, 3).tolist() == [1, 2]  # by default the most
    assert solve_mckp_dp(values, 2, fewest_on_ties=True).tolist() == [1, 1]


def test_pool_and_estimate_by_hand():
    assert np.isnan(pooled_estimate([1, 0, 1] * 2 + [1]))  # fewer than 8 rollouts: no estimate
    assert pooled_estimate([1, 0] * 4) == 0.5
    pooled = pool_outcomes([], [1] * 20)  # a visit of 20: its own mean
    assert pooled_estimate(pooled) == 1.0 and len(pooled) == 20
    pooled = pool_outcomes(pooled, [0] * 4)  # a visit of 4: the newest 16, 12 of them from the visit before
    assert pooled == [1] * 12 + [0] * 4 and pooled_estimate(pooled) == 0.75


def test_the_surplus_remainder_goes_over_the_zero_pool_in_batch_order_unseen_prompts_included():
    """The official code holds an unseen prompt's rate as 0: the zero pool is the prompts at 0 and the unseen
    ones, in batch order, and the surplus's remainder goes to its first members. M = 5, G = 4 (B_total 20),
    B_low 2, B_up 8, p = [0.5, 0, unseen, 0, unseen]: starts 2, 2, 4, 2, 4 (rest 6); the cost of 0.5 is 3 < 6,
    so the surplus 3 goes over the pool [1, 2, 3, 4], 0 each and one more to its first three (1, 2, 3, not
    the unseen 2 and 4 first); the knapsack gives 0.5 its 3."""
    p = np.array([0.5, 0.0, np.nan, 0.0, np.nan])
    plan = plan_allocation(p, 20, strategy="knapsack", min_budget=2, max_budget=8)
    assert plan.budgets.tolist() == [5, 3, 5, 3, 4] and plan.extras == {"estimated_cost": 3, "surplus": 3}


# --- a total that is not a multiple of M -------------------------------------------------------------
# The official code is called with n = B_total // M and total_budget = B_total (its trainer's call, with the
# total set): a prompt without an estimate (fewer than 8 rollouts: not valid) gets exactly n, never one more;
# the B_total % M left over is part of R and goes where R goes. Each expected list below is the official
# algorithm followed by hand (docs/method.md, section 11), and is what the official function (ca5d5f5, its
# numpy program, run outside this repository) returns for it.


def test_an_unseen_prompt_gets_the_official_n_when_the_total_is_not_a_multiple_of_m():
    """M = 4, B_total = 22 (22 % 4 = 2), B_low 2, B_up 8, p = [0.5, unseen, 0, unseen]: n = 5; starts 2, 5, 2, 5
    (R = 8); the cost of 0.5 is 3 < 8, so the surplus 5 goes over the zero pool [1, 2, 3]: 1 each and one more
    to the first two (1, 2): 7, 4, 6; the knapsack gives 0.5 its 3: 5. (The rule before gave the unseen
    prompt 1 a start of 6, R 7, surplus 4: 5, 8, 3, 6.)"""
    p = np.array([0.5, np.nan, 0.0, np.nan])
    plan = plan_allocation(p, 22, strategy="knapsack", min_budget=2, max_budget=8)
    assert plan.budgets.tolist() == [5, 7, 4, 6] and plan.extras == {"estimated_cost": 3, "surplus": 5}


def test_no_mixed_prompt_and_a_total_not_a_multiple_of_m():
    """M = 5, B_total = 23 (n = 4, 23 % 5 = 3), B_low 2, p = [0, unseen, 1, unseen, 0]: starts 2, 4, 2, 4, 2
    (R = 9); no mixed prompt, so R goes over the zero pool [0, 1, 3, 4]: 2 each and one more to prompt 0."""
    p = np.array([0.0, np.nan, 1.0, np.nan, 0.0])
    plan = plan_allocation(p, 23, strategy="knapsack", min_budget=2, max_budget=8)
    assert plan.budgets.tolist() == [5, 6, 2, 6, 4] and plan.extras == {"estimated_cost": 0, "surplus": 9}


def test_the_remainder_of_a_total_not_a_multiple_of_m_goes_to_the_knapsack():
    """M = 3, B_total = 19 (n = 6, 19 % 3 = 1), B_low 2, B_up 32, p = [unseen, 1/8, unseen]: starts 6, 2, 6
    (R = 5); the cost of 1/8 is 17 >= 5, no surplus: the knapsack places all 5 on its one prompt."""
    p = np.array([np.nan, 0.125, np.nan])
    plan = plan_allocation(p, 19, strategy="knapsack", min_budget=2, max_budget=32)
    assert plan.budgets.tolist() == [6, 7, 6] and plan.extras == {"estimated_cost": 17, "surplus": 0}


def test_every_prompt_unseen_with_a_total_not_a_multiple_of_m_is_the_official_split():
    # n = 3 each (R = 2, no mixed prompt, every prompt in the zero pool): one more to the first two, the
    # uniform allocation plan_allocation falls back to
    p = np.full(4, np.nan)
    assert knapsack_rl(p, np.zeros(4, dtype=bool), 14, 2, 8).budgets.tolist() == [4, 4, 3, 3]
    assert plan_allocation(p, 14, strategy="knapsack").budgets.tolist() == [4, 4, 3, 3]


def test_every_prompt_at_one_with_a_total_not_a_multiple_of_m_is_uniform():
    # the official code gives each prompt n = 3 here and fails its own total check (9 != 10); here the
    # uniform allocation: 10 // 3 each, one more to the first
    plan = plan_allocation([1.0, 1.0, 1.0], 10, strategy="knapsack", min_budget=2, max_budget=8)
    assert plan.budgets.tolist() == [4, 3, 3] and plan.extras == {"estimated_cost": 0, "surplus": 0}
