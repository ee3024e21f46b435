"""Knapsack-RL as its authors ship it (arXiv 2509.25849; repository liziniu/KnapsackRL, the function
``sampling_budget_by_knapsack`` in verl/trainer/ppo/exploration_utils.py and the per-prompt reward
state of verl/utils/dataset/rl_dataset.py). docs/method.md, section 11.

The estimate (``pool_outcomes``, ``pooled_estimate``: the mean of a prompt's newest ``POOL`` solved flags, none
with fewer than ``MIN_OUTCOMES``) and the rule (``knapsack_rl``: costs at ``CONFIDENCE``, an exact DP over the
mixed prompts in float32 values, the surplus in equal shares, uncapped) are docs/method.md, section 11, step
by step. Equal shares: the amount // k each, one more to the first (amount % k) prompts in batch order.
What happens in the cases the official code cannot run: the same section.

Pure numpy: no I/O, no Prefect, no pandas.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from coba_tasks.core.solvers import solve_mckp_dp

CONFIDENCE = 0.9  # cost: rollouts until a group is mixed with this probability (official alpha)
POOL = 16  # estimate: the newest rollouts pooled when the last visit had fewer (reward_buffer_length)
MIN_OUTCOMES = 8  # estimate: none with fewer rollouts seen (min_buffer_length)

# Prompt groups of the rule (the budget table's ``group`` column under knapsack).
MIXED, ZERO, ONE, NO_ESTIMATE = "mixed", "zero", "one", "no_estimate"


def pool_outcomes(pooled: Sequence[int] | np.ndarray, visit: Sequence[int] | np.ndarray) -> list[int]:
    """The solved flags a prompt keeps after a visit: the visit's flags if there are at least ``POOL`` of them,
    else the newest ``POOL`` of the kept flags followed by the visit's (oldest first).

    >>> pool_outcomes([1] * 10, [0] * 8)
    [1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0]
    >>> len(pool_outcomes([1] * 10, [0] * 20))
    20
    """
    visit = [int(v) for v in visit]
    if len(visit) >= POOL:
        return visit
    return ([int(v) for v in pooled] + visit)[-POOL:]


def pooled_estimate(pooled: Sequence[int] | np.ndarray) -> float:
    """A prompt's success-rate estimate from its kept flags: their mean, or NaN with fewer than ``MIN_OUTCOMES``."""
    flags = np.asarray(pooled, dtype=np.float64)
    return float(flags.mean()) if flags.size >= MIN_OUTCOMES else float("nan")


def knapsack_costs(p: np.ndarray, max_budget: int) -> np.ndarray:
    """Per mixed prompt (0 < p < 1), int(min(B_up, log(1 - CONFIDENCE) / log(max(p, 1 - p)))), the cost held in
    float32 first as the official code holds it; (n,) int64.

    Within about 1e-16 of 0 or 1, max(p, 1 - p) rounds to 1 and the official code fails (its log is 0); the
    cost is then B_up, its limit. No estimate from a finite number of rollouts comes that close."""
    p = np.asarray(p, dtype=np.float64)
    log_q = np.log(np.maximum(p, 1 - p))
    with np.errstate(divide="ignore"):
        cost = np.where(log_q < 0, np.log(1 - CONFIDENCE) / log_q, np.inf).astype(np.float32)
    return np.floor(np.minimum(float(max_budget), cost.astype(np.float64))).astype(np.int64)


def knapsack_item_values(p: np.ndarray, min_budget: int, cap: int) -> np.ndarray:
    """The knapsack's value of x = 0 .. cap extra rollouts per mixed prompt, (n, cap + 1) float64: 0 for x = 0,
    (1 - q^N - (1 - q)^N) q (1 - q)^2 at N = B_low + x otherwise, with q = float32(p) and float32 arithmetic
    (numpy scalars, whose power is the C library's, as the official code computes each value)."""
    p32 = np.asarray(p, dtype=np.float64).astype(np.float32)
    table = np.zeros((p32.size, cap + 1), dtype=np.float64)
    uniq, inverse = np.unique(p32, return_inverse=True)
    for u, q in enumerate(uniq):
        if q == 0 or q == 1:
            continue
        sizes = range(min_budget + 1, min_budget + cap + 1)
        table[inverse == u, 1:] = [float((1 - q**n - (1 - q) ** n) * q * ((1 - q) ** 2)) for n in sizes]
    return table


def equal_shares(amount: int, k: int) -> np.ndarray:
    """``amount`` split over k prompts: amount // k each, one more to the first amount % k; (k,) int64."""
    shares = np.full(k, amount // k, dtype=np.int64)
    shares[: amount % k] += 1
    return shares


@dataclass(frozen=True)
class KnapsackPlan:
    """What ``knapsack_rl`` decided: the budgets, each prompt's group and the quantities of the rule."""

    budgets: np.ndarray  # (M,) int64, sums to B_total; >= B_low; may exceed B_up (surplus, overflow)
    groups: np.ndarray  # (M,) object: "mixed", "zero", "one", "no_estimate"
    estimated_cost: int  # sum of the mixed prompts' costs (0 when there are none)
    surplus: int  # rollouts sent to the zero / no-estimate (or one) prompts above their start


def knapsack_rl(
    p: np.ndarray, has_estimate: np.ndarray, total_budget: int, min_budget: int, max_budget: int
) -> KnapsackPlan:
    """The official allocation (module docstring, steps 1-4) of one batch.

    Args:
        p: (M,) success-rate estimates in [0, 1] (any value where ``has_estimate`` is False).
        has_estimate: (M,) bool.
        total_budget: B_total, M * B_low <= B_total; the official call's n is B_total // M (what a prompt
            without an estimate gets), its total_budget B_total.
        min_budget, max_budget: B_low (the official min_n, negative_n and positive_n) and B_up (max_n).
    """
    p = np.asarray(p, dtype=np.float64)
    valid = np.asarray(has_estimate, dtype=bool)
    m = p.size
    group_size = total_budget // m  # the official n; B_total % M more are part of the rest R
    mixed = valid & (p > 0) & (p < 1)
    zero = ~valid | (p.astype(np.float32) == 0)  # no estimate counts as 0, as in the official array
    groups = np.where(~valid, NO_ESTIMATE, np.where(mixed, MIXED, np.where(p >= 1, ONE, ZERO))).astype(object)
    budgets = np.where(valid, min_budget, group_size).astype(np.int64)
    rest = total_budget - int(budgets.sum())
    idx = np.flatnonzero(mixed)
    if idx.size == 0:
        takers = np.flatnonzero(zero)
        if rest > 0 and takers.size:
            budgets[takers] += equal_shares(rest, takers.size)
            return KnapsackPlan(budgets, groups, 0, rest)
        # every prompt at 1: the official code gives each n (and fails its total check if B_total % M > 0)
        return KnapsackPlan(equal_shares(total_budget, m) if rest > 0 else budgets, groups, 0, 0)
    estimated = int(knapsack_costs(p[idx], max_budget).sum())
    surplus = 0
    if estimated < rest:
        takers = np.flatnonzero(zero) if zero.any() else np.flatnonzero(~mixed)
        if takers.size:  # none: the official code fails; the knapsack keeps the whole rest
            surplus = rest - estimated
            budgets[takers] += equal_shares(surplus, takers.size)
            rest = estimated
    if rest > 0:
        cap = max_budget - min_budget
        placed = min(rest, idx.size * cap)
        extras = solve_mckp_dp(knapsack_item_values(p[idx], min_budget, cap), placed, fewest_on_ties=True)
        extras += equal_shares(rest - placed, idx.size)
        budgets[idx] += extras
    return KnapsackPlan(budgets, groups, estimated, surplus)
