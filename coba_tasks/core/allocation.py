"""Rollout-budget allocation: choose each prompt's GRPO group size B_i under a total budget.

The problem solved at every step (docs/method.md):

    maximise  sum_i V(B_i, p_i)   subject to  sum_i B_i = B_total,  B_low <= B_i <= B_up

The strategies (a registry; ``allocate(..., strategy=NAME)``), each taking a validated ``AllocationRequest``
and returning an ``Allocation``:

- ``uniform``: GRPO, B_total / M each, the remainder one at a time in prompt order.
- ``knapsack``: Knapsack-RL as its authors ship it (``coba_tasks.core.knapsack``): costs from the
  estimates cap what the knapsack spends, the surplus goes to prompts estimated at 0; value
  (1 - p^N - (1 - p)^N) p (1 - p)^2.
- ``coba``: CoBA-RL, V = eta(B, p) * BetaPDF(p; alpha, beta). ``mode="paper"`` runs
  the solver over all prompts; ``mode="released"`` reproduces the authors' released code (only a share
  of the spare budget goes through the solver, over "exploration" prompts, and the rest is handed out by
  a fixed fallback order).

``allocate`` and ``plan_allocation`` (the front end, at the end of this module) check the request and hand
it to a strategy; the solvers of the CoBA objective (``heap``, the paper's Algorithm 1; ``threshold``, the
closed form; ``dp``, the exact oracle; all return the same optimum) are ``coba_tasks.core.solvers``.

Pass rates may be NaN for prompts never seen: if every prompt is unseen the
allocation is uniform whatever the strategy; otherwise unseen prompts count as p = 0.5 (``knapsack``:
a prompt without an estimate gets B_total // M, the authors' code's n, never one more).

Every strategy keeps B_low <= B_i <= B_up except ``knapsack``, whose surplus to the prompts estimated
at 0 is not capped (docs/method.md, section 11).

Determinism: the same input gives the same output; among equal marginal gains the prompt that
comes first in the batch gets the rollout first.

Pure numpy: no I/O, no Prefect, no pandas.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

import numpy as np

from coba_tasks.core.knapsack import equal_shares, knapsack_rl
from coba_tasks.core.registry import Registry
from coba_tasks.core.solvers import CobaProblem, Solver, coba_solve, coba_solver, coba_solvers
from coba_tasks.core.values import adaptive_tau, coba_value, knapsack_value

VERY_HARD_BELOW = 0.05  # released mode: p < 0.05 is "very hard"
VERY_EASY_ABOVE = 0.99  # released mode: p > 0.99 is "very easy"


class Strategy(StrEnum):
    """How a step spends its rollouts: the allocators (``uniform``, ``knapsack``, ``coba``: one budget per prompt,
    ``plan_allocation``) and the strategies that sample a step in rounds, each round's budget uniform
    (``dynamic``: DAPO's dynamic sampling, ``coba_tasks.core.dynamic``; ``ada``: Reinforce-Ada,
    ``coba_tasks.core.ada``)."""

    UNIFORM = "uniform"
    KNAPSACK = "knapsack"
    COBA = "coba"
    DYNAMIC = "dynamic"
    ADA = "ada"


IN_ROUNDS = (Strategy.DYNAMIC.value, Strategy.ADA.value)  # sampled in rounds, not allocated by ``plan_allocation``


class Mode(StrEnum):
    """Variants of the ``coba`` strategy."""

    PAPER = "paper"
    RELEASED = "released"


@dataclass(frozen=True)
class AllocationRequest:
    """A validated allocation problem (what every strategy receives).

    ``pass_rates`` already has unseen prompts filled with 0.5; ``seen`` says which were seen.
    """

    pass_rates: np.ndarray  # (M,) float64 in [0, 1]
    seen: np.ndarray  # (M,) bool
    total_budget: int
    min_budget: int
    max_budget: int
    alpha: float
    beta: float
    tau: str | float
    mode: Mode
    solver: Solver

    @property
    def size(self) -> int:
        return int(self.pass_rates.size)

    @property
    def spare(self) -> int:
        """R = B_total - M * B_low, the rollouts to place above the floor."""
        return self.total_budget - self.size * self.min_budget

    @property
    def cap(self) -> int:
        """Most extra rollouts one prompt can take above B_low."""
        return self.max_budget - self.min_budget


@dataclass(frozen=True)
class Allocation:
    """The result of one allocation.

    Attributes:
        budgets: (M,) int64, the group size of each prompt; sums to the total.
        pass_rates: (M,) float64, the pass rates used (unseen prompts as 0.5; NaN under knapsack).
        values: (M,) float64, each prompt's value under the strategy's own objective
            (CoBA V, Knapsack-RL value; NaN for uniform).
        marginal_gains: (M,) float64, the gain of one more rollout at the final budget under the
            strategy's objective (NaN for uniform and for prompts at or above B_up).
        groups: (M,) str, released mode's prompt groups ("very_hard", "explore", "very_easy");
            knapsack's ("mixed", "zero", "one", "no_estimate"); "all" otherwise.
        tau: the saturation scale used (NaN where no CoBA value was computed).
        fallback: why the strategy was not applied (e.g. every prompt unseen), or "".
    """

    budgets: np.ndarray
    pass_rates: np.ndarray
    values: np.ndarray
    marginal_gains: np.ndarray
    groups: np.ndarray
    strategy: str
    mode: str
    solver: str
    alpha: float
    beta: float
    tau: float
    fallback: str = ""
    extras: dict[str, Any] = field(default_factory=dict)


AllocatorFn = Callable[[AllocationRequest], Allocation]
_ALLOCATORS: Registry[AllocatorFn] = Registry("allocator")
register_allocator = _ALLOCATORS.register  # decorator: register an allocation strategy under a name
strategies = _ALLOCATORS.names  # the registered strategies' names, sorted
allocator = _ALLOCATORS.get  # the strategy registered under a name, or None


# --- Uniform (GRPO)


def uniform_budgets(m: int, total_budget: int) -> np.ndarray:
    """B_total // M each, the remainder one at a time to the first prompts; (M,) int64."""
    return equal_shares(total_budget, m)


def _plan(req: AllocationRequest, strategy: Strategy, budgets: np.ndarray, **fields: Any) -> Allocation:
    """An ``Allocation`` of ``req``: ``fields`` over the defaults (no values, gains, mode, solver or tau)."""
    nan = np.full(req.size, np.nan)
    defaults: dict[str, Any] = {
        "pass_rates": req.pass_rates,
        "values": nan,
        "marginal_gains": nan.copy(),
        "mode": "",
        "solver": "",
    }
    defaults |= {"groups": np.full(req.size, "all", dtype=object), "tau": float("nan")}
    return Allocation(budgets=budgets, strategy=strategy.value, alpha=req.alpha, beta=req.beta, **(defaults | fields))


@register_allocator(Strategy.UNIFORM.value)
def _uniform(req: AllocationRequest) -> Allocation:
    return _plan(req, Strategy.UNIFORM, uniform_budgets(req.size, req.total_budget))


# --- CoBA-RL


def _resolve_tau(tau: str | float, p: np.ndarray) -> float:
    return adaptive_tau(p) if tau == "adaptive" else float(tau)


def _coba_plan(
    req: AllocationRequest, budgets: np.ndarray, problem: CobaProblem, groups: np.ndarray, **extras: Any
) -> Allocation:
    gains = np.where(budgets < req.max_budget, problem.marginal_gains(budgets), np.nan)
    fields = {"values": problem.values(budgets), "marginal_gains": gains, "groups": groups, "tau": problem.tau}
    return _plan(req, Strategy.COBA, budgets, mode=req.mode.value, solver=req.solver.value, **fields, **extras)


@register_allocator(Strategy.COBA.value)
def _coba(req: AllocationRequest) -> Allocation:
    if req.mode is Mode.RELEASED:
        return _coba_released(req)
    p = req.pass_rates
    problem = CobaProblem(p, req.alpha, req.beta, _resolve_tau(req.tau, p), req.min_budget)
    budgets = req.min_budget + coba_solve(problem, req.spare, req.cap, req.solver)
    return _coba_plan(req, budgets, problem, np.full(p.size, "all", dtype=object))


def released_heap_share(n_explore: int, m: int) -> float:
    """Share of the spare budget that goes through the solver in released mode."""
    if n_explore == 0:
        return 0.6
    if n_explore > m / 2:
        return 0.8
    return 0.6 + 0.2 * (2.0 * n_explore / m)


def distribute_proportional(
    budgets: np.ndarray, members: np.ndarray, amount: int, weights: np.ndarray, max_budget: int
) -> int:
    """Add ``amount`` rollouts to ``budgets[members]`` in proportion to ``weights``, capped.

    Largest-remainder rounding (ties by prompt order); what a capped prompt cannot take is
    re-spread over the others in the group. Zero total weight means equal shares. Modifies
    ``budgets`` in place and returns the amount that did not fit.
    """
    members = np.asarray(members, dtype=np.int64)
    weights = np.asarray(weights, dtype=np.float64)
    active = budgets[members] < max_budget
    while amount > 0 and active.any():
        idx = members[active]
        w = weights[active]
        w = np.ones_like(w) if w.sum() <= 0 else w
        ideal = amount * w / w.sum()
        share = np.floor(ideal).astype(np.int64)
        left = amount - int(share.sum())
        if left > 0:
            order = np.lexsort((np.arange(idx.size), -(ideal - share)))[:left]
            share[order] += 1
        room = max_budget - budgets[idx]
        give = np.minimum(share, room)
        budgets[idx] += give
        amount -= int(give.sum())
        active = budgets[members] < max_budget
    return amount


def _coba_released(req: AllocationRequest) -> Allocation:
    p = req.pass_rates
    m = p.size
    groups = np.where(p < VERY_HARD_BELOW, "very_hard", np.where(p > VERY_EASY_ABOVE, "very_easy", "explore"))
    groups = groups.astype(object)
    explore = np.flatnonzero(groups == "explore")
    budgets = np.full(m, req.min_budget, dtype=np.int64)
    share = released_heap_share(explore.size, m)
    heap_budget = min(int(req.spare * share), explore.size * req.cap)
    tau = _resolve_tau(req.tau, p[explore]) if explore.size else float("nan")
    if heap_budget > 0:
        problem = CobaProblem(p[explore], req.alpha, req.beta, tau, req.min_budget)
        budgets[explore] += coba_solve(problem, heap_budget, req.cap, req.solver)
    left = req.spare - heap_budget
    for name in ("very_hard", "explore", "very_easy"):
        members = np.flatnonzero(groups == name)
        if members.size and left > 0:
            left = distribute_proportional(budgets, members, left, 1.0 - p[members], req.max_budget)
    if left > 0:  # any remainder spread uniformly, one at a time in prompt order
        left = distribute_proportional(budgets, np.arange(m), left, np.ones(m), req.max_budget)
    assert left == 0
    full = CobaProblem(p, req.alpha, req.beta, tau if np.isfinite(tau) else _resolve_tau(req.tau, p), req.min_budget)
    return _coba_plan(req, budgets, full, groups, extras={"heap_share": share, "heap_budget": heap_budget})


def coba_objective(budgets: np.ndarray, pass_rates: np.ndarray, alpha: float, beta: float, tau: float) -> float:
    """sum_i V(B_i, p_i): the CoBA objective of an allocation (pass rates already filled)."""
    return float(coba_value(np.asarray(budgets), np.asarray(pass_rates), alpha, beta, tau).sum())


# --- Knapsack-RL (the official rule: coba_tasks.core.knapsack)


def knapsack_gain(n: np.ndarray, p: np.ndarray) -> np.ndarray:
    """value(N + 1, p) - value(N, p) in closed form: (p^N (1 - p) + (1 - p)^N p) p (1 - p)^2."""
    n = np.asarray(n, dtype=np.float64)
    p = np.asarray(p, dtype=np.float64)
    return (p**n * (1.0 - p) + (1.0 - p) ** n * p) * p * (1.0 - p) ** 2


@register_allocator(Strategy.KNAPSACK.value)
def _knapsack(req: AllocationRequest) -> Allocation:
    """Knapsack-RL as its authors ship it; a prompt never seen (NaN) has no estimate. Always the DP
    (``req.solver`` is for CoBA). Values and gains: NaN for prompts without an estimate."""
    plan = knapsack_rl(req.pass_rates, req.seen, req.total_budget, req.min_budget, req.max_budget)
    p = np.where(req.seen, req.pass_rates, np.nan)
    budgets = plan.budgets
    gains = np.where(budgets < req.max_budget, knapsack_gain(budgets, p), np.nan)
    extras = {"estimated_cost": plan.estimated_cost, "surplus": plan.surplus}
    fields = {"pass_rates": p, "values": knapsack_value(budgets, p), "marginal_gains": gains, "groups": plan.groups}
    return _plan(req, Strategy.KNAPSACK, budgets, solver=Solver.DP.value, extras=extras, **fields)


# --- The front end: a request checked and handed to its strategy


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
        plan = _ALLOCATORS[Strategy.UNIFORM.value](request)
        unseen = "every prompt unseen" + (" (without an estimate)" if strategy == Strategy.KNAPSACK.value else "")
        return replace(plan, strategy=strategy, fallback=f"{unseen}: uniform allocation")
    plan = _ALLOCATORS[strategy](request)  # a name _validate checked
    budgets = plan.budgets
    assert budgets.dtype == np.int64 and int(budgets.sum()) == request.total_budget, "allocator broke the total"
    assert budgets.min() >= request.min_budget, "allocator broke B_low"
    # Knapsack-RL caps only its knapsack at B_up: its surplus may lift a prompt above (as the authors' code does)
    assert budgets.max() <= request.max_budget or strategy == Strategy.KNAPSACK.value, "allocator broke B_up"
    return plan


def _validate(
    pass_rates, total_budget, strategy, min_budget, max_budget, alpha, beta, tau, mode, solver
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
    if not (isinstance(tau, str) and tau == "adaptive"):
        if isinstance(tau, str | bool) or not np.isfinite(float(tau)) or float(tau) <= 0:
            raise ValueError(f"tau must be 'adaptive' or a positive number, got {tau!r}")
        tau = float(tau)
    return AllocationRequest(
        p, seen, total_budget, min_budget, max_budget, alpha, beta, tau, Mode(mode), Solver(solver)
    )


def step_strategies() -> list[str]:
    """Every ``allocation.strategy`` a run may name: the registered allocators and those sampled in rounds."""
    return sorted({*strategies(), *IN_ROUNDS})
