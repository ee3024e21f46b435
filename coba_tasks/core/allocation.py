"""Rollout-budget allocation, the front end: choose each prompt's GRPO group size B_i under a total budget.

The problem solved at every step (docs/method.md):

    maximise  sum_i V(B_i, p_i)   subject to  sum_i B_i = B_total,  B_low <= B_i <= B_up

``allocate`` and ``plan_allocation`` check the request and hand it to a strategy:

- strategies (``uniform``, ``knapsack``, ``coba`` in ``paper`` or ``released`` mode), the
  ``Allocation`` they return and the released mode's fallback order: ``coba_tasks.core.allocators``;
- solvers for the CoBA objective (``heap``, the paper's Algorithm 1; ``threshold``, the closed form;
  ``dp``, the exact oracle; all return the same optimum): ``coba_tasks.core.solvers``.

Pass rates may be NaN for prompts never seen: if every prompt is unseen the
allocation is uniform whatever the strategy; otherwise unseen prompts count as p = 0.5 (``knapsack``:
a prompt without an estimate gets its uniform share B_total / M, as the authors' code gives it).

Every strategy keeps B_low <= B_i <= B_up except ``knapsack``, whose surplus to the prompts estimated
at 0 is not capped (docs/method.md, section 11).

Determinism: the same input gives the same output; among equal marginal gains the prompt that
comes first in the batch gets the rollout first.

Pure numpy: no I/O, no Prefect, no pandas.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from coba_tasks.core.allocators import Allocation, AllocationRequest, Mode, Strategy, allocator, strategies
from coba_tasks.core.solvers import Solver, coba_solver, coba_solvers

DEFAULT_ALPHA = 9.0  # (kappa - 2, 2) with kappa = 11: the shape before the first update
DEFAULT_BETA = 2.0
UNSEEN_PASS_RATE = 0.5


def allocate(pass_rates: np.ndarray | list[float], total_budget: int, **options: Any) -> np.ndarray:
    """Rollout budget per prompt, shape (M,) int64, summing to ``total_budget``: the budgets of
    ``plan_allocation`` (same arguments).

    >>> allocate([0.1, 0.5, 0.9, float("nan")], 16, strategy="uniform").tolist()
    [4, 4, 4, 4]
    >>> allocate([0.2, 0.5, 0.8], 12, alpha=9.0, beta=2.0).tolist()   # exploit: easy prompts first
    [2, 2, 8]
    """
    return plan_allocation(pass_rates, total_budget, **options).budgets


def plan_allocation(
    pass_rates: np.ndarray | list[float],
    total_budget: int,
    *,
    strategy: str = "coba",
    min_budget: int = 2,
    max_budget: int = 128,
    alpha: float | None = None,
    beta: float | None = None,
    tau: str | float = "adaptive",
    mode: str = "paper",
    solver: str = "heap",
) -> Allocation:
    """The full ``Allocation`` (budgets, values, gains, tau, groups) of a batch.

    Args:
        pass_rates: (M,) pass rate of each prompt on its last visit, in [0, 1]; NaN = never seen
            (``knapsack``: its estimate, NaN = none; ``coba_tasks.core.knapsack.pooled_estimate``).
        total_budget: B_total, rollouts for the whole batch (M * min_budget <= B_total <= M * max_budget).
        strategy: one of ``strategies()``: "coba", "knapsack", "uniform".
        min_budget: B_low >= 2 (a GRPO group of one has no advantage).
        max_budget: B_up (``knapsack``: the cap of its knapsack, not of its surplus).
        alpha, beta: the Beta shape from ``CapabilityTracker`` (default: the pre-training (9, 2)).
        tau: "adaptive" (from the spread of pass rates) or a positive number.
        mode: "paper" (solver over all prompts) or "released" (the authors' released code).
        solver: "heap" (Algorithm 1), "threshold" (closed form) or "dp" (exact DP); CoBA only
            (``knapsack`` always runs its DP).
    """
    request = _validate(pass_rates, total_budget, strategy, min_budget, max_budget, alpha, beta, tau, mode, solver)
    if not request.seen.any():
        plan = allocator(Strategy.UNIFORM.value)(request)
        unseen = "every prompt unseen" + (" (without an estimate)" if strategy == Strategy.KNAPSACK.value else "")
        return replace(plan, strategy=strategy, fallback=f"{unseen}: uniform allocation")
    plan = allocator(strategy)(request)
    budgets = plan.budgets
    assert budgets.dtype == np.int64 and int(budgets.sum()) == request.total_budget, "allocator broke the total"
    assert budgets.min() >= request.min_budget, "allocator broke B_low"
    # Knapsack-RL caps only its knapsack at B_up: its surplus may lift a prompt above (as the authors' code does)
    assert budgets.max() <= request.max_budget or strategy == Strategy.KNAPSACK.value, "allocator broke B_up"
    return plan


def _validate(
    pass_rates: Any,
    total_budget: Any,
    strategy: Any,
    min_budget: Any,
    max_budget: Any,
    alpha: Any,
    beta: Any,
    tau: Any,
    mode: Any,
    solver: Any,
) -> AllocationRequest:
    if allocator(strategy) is None:
        raise ValueError(f"unknown allocation strategy {strategy!r}; valid strategies: {', '.join(strategies())}")
    if mode not in {m.value for m in Mode}:
        raise ValueError(f"unknown coba mode {mode!r}; valid modes: {', '.join(m.value for m in Mode)}")
    if coba_solver(solver) is None:
        raise ValueError(f"unknown solver {solver!r}; valid solvers: {', '.join(coba_solvers())}")
    for name, value in (("total_budget", total_budget), ("min_budget", min_budget), ("max_budget", max_budget)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer):
            raise ValueError(f"{name} must be an integer, got {value!r}")
    total_budget, min_budget, max_budget = int(total_budget), int(min_budget), int(max_budget)
    if min_budget < 2:
        raise ValueError(f"min_budget must be >= 2 (a GRPO group of one rollout has no advantage), got {min_budget}")
    if max_budget < min_budget:
        raise ValueError(f"max_budget ({max_budget}) must be >= min_budget ({min_budget})")

    p = np.array(pass_rates, dtype=np.float64, copy=True)
    if p.ndim != 1 or p.size == 0:
        raise ValueError(f"pass_rates must be a non-empty 1-D array, got shape {p.shape}")
    seen = ~np.isnan(p)
    bad = np.flatnonzero(seen & ~((p >= 0.0) & (p <= 1.0)))
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"pass rates must lie in [0, 1] (NaN for unseen prompts); {bad.size} do not, "
            f"the first at position {i}: {p[i]}"
        )
    p[~seen] = UNSEEN_PASS_RATE
    m = p.size
    if total_budget < m * min_budget:
        raise ValueError(
            f"total_budget {total_budget} is infeasible: below M * min_budget = {m} * {min_budget} = {m * min_budget}"
        )
    if total_budget > m * max_budget:
        raise ValueError(
            f"total_budget {total_budget} is infeasible: above M * max_budget = {m} * {max_budget} = {m * max_budget}"
        )

    alpha = DEFAULT_ALPHA if alpha is None else float(alpha)
    beta = DEFAULT_BETA if beta is None else float(beta)
    if not (np.isfinite(alpha) and alpha > 0 and np.isfinite(beta) and beta > 0):
        raise ValueError(f"alpha and beta must be positive finite numbers, got alpha={alpha}, beta={beta}")
    if isinstance(tau, str):
        if tau != "adaptive":
            raise ValueError(f"tau must be 'adaptive' or a positive number, got {tau!r}")
    else:
        if isinstance(tau, bool) or not np.isfinite(float(tau)) or float(tau) <= 0:
            raise ValueError(f"tau must be 'adaptive' or a positive number, got {tau!r}")
        tau = float(tau)
    return AllocationRequest(
        pass_rates=p,
        seen=seen,
        total_budget=total_budget,
        min_budget=min_budget,
        max_budget=max_budget,
        alpha=alpha,
        beta=beta,
        tau=tau,
        mode=Mode(mode),
        solver=Solver(solver),
    )
