"""Rollout-budget allocation: choose each prompt's GRPO group size B_i under a total budget.

The problem solved at every step (docs/method.md):

    maximise  sum_i V(B_i, p_i)   subject to  sum_i B_i = B_total,  B_low <= B_i <= B_up

Strategies (a registry; ``allocate(..., strategy=NAME)``):

- ``uniform``: GRPO, B_total / M each, the remainder one at a time in prompt order.
- ``knapsack``: Knapsack-RL, value (1 - p^N - (1 - p)^N) p (1 - p)^2.
- ``coba``: CoBA-RL, V = eta(B, p) * BetaPDF(p; alpha, beta). ``mode="paper"`` runs
  the solver over all prompts; ``mode="released"`` reproduces the authors' released code (only a
  share of the spare budget goes through the solver, over "exploration" prompts, and the rest is
  handed out by a fixed fallback order).

Solvers for the CoBA objective (a registry; all return the same optimum):

- ``heap``: the paper's Algorithm 1, greedy with a max-heap of marginal gains, O(B_total log M).
- ``threshold``: the closed form. Each prompt's log-gain is affine in B (log dV(B) = a - k B), so
  the optimum is "every gain above a threshold lambda"; a vectorised bisection finds lambda, and ties
  at lambda go by prompt order exactly as the heap breaks them. O(M log(1/eps)).
- ``dp``: the exact dynamic program (multiple-choice knapsack over the extra rollouts), the
  correctness oracle and the paper's speed reference. O(M * B_total * (B_up - B_low)).

Pass rates may be NaN for prompts never seen: if every prompt is unseen the
allocation is uniform whatever the strategy; otherwise unseen prompts count as p = 0.5.

Determinism: the same input gives the same output; among equal marginal gains the prompt that
comes first in the batch gets the rollout first.

Pure numpy: no I/O, no Prefect, no pandas.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import StrEnum
from functools import cached_property
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from coba_tasks.core.values import (
    adaptive_tau,
    clip_pass_rates,
    coba_value,
    knapsack_value,
    log_beta_density,
)

DEFAULT_ALPHA = 9.0  # (kappa - 2, 2) with kappa = 11: the shape before the first update
DEFAULT_BETA = 2.0
UNSEEN_PASS_RATE = 0.5
VERY_HARD_BELOW = 0.05  # released mode: p < 0.05 is "very hard"
VERY_EASY_ABOVE = 0.99  # released mode: p > 0.99 is "very easy"


class Strategy(StrEnum):
    """Allocation strategies."""

    UNIFORM = "uniform"
    KNAPSACK = "knapsack"
    COBA = "coba"


class Mode(StrEnum):
    """Variants of the ``coba`` strategy."""

    PAPER = "paper"
    RELEASED = "released"


class Solver(StrEnum):
    """Solvers for the CoBA objective."""

    HEAP = "heap"
    THRESHOLD = "threshold"
    DP = "dp"


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
        pass_rates: (M,) float64, the pass rates used (unseen prompts as 0.5).
        values: (M,) float64, each prompt's value under the strategy's own objective
            (CoBA V, Knapsack-RL value; NaN for uniform).
        marginal_gains: (M,) float64, the gain of one more rollout at the final budget under the
            strategy's objective (NaN for uniform and for prompts at B_up).
        groups: (M,) str, released mode's prompt groups ("very_hard", "explore", "very_easy");
            "all" otherwise.
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
_ALLOCATORS: dict[str, AllocatorFn] = {}

# A CoBA solver gets per-prompt log-gain parameters of the *extra* rollouts: the j-th extra
# rollout (j = 0 .. cap-1) of prompt i has log-gain a0[i] - k[i] * j. It returns extras (M,).
CobaSolverFn = Callable[[np.ndarray, np.ndarray, int, int, "CobaProblem"], np.ndarray]
_COBA_SOLVERS: dict[str, CobaSolverFn] = {}


def register_allocator(name: str) -> Callable[[AllocatorFn], AllocatorFn]:
    """Decorator: register an allocation strategy under ``name``."""

    def wrap(fn: AllocatorFn) -> AllocatorFn:
        if name in _ALLOCATORS:
            raise ValueError(f"allocator {name!r} is already registered")
        _ALLOCATORS[name] = fn
        return fn

    return wrap


def register_coba_solver(name: str) -> Callable[[CobaSolverFn], CobaSolverFn]:
    """Decorator: register a solver for the CoBA objective under ``name``."""

    def wrap(fn: CobaSolverFn) -> CobaSolverFn:
        if name in _COBA_SOLVERS:
            raise ValueError(f"CoBA solver {name!r} is already registered")
        _COBA_SOLVERS[name] = fn
        return fn

    return wrap


def strategies() -> list[str]:
    """Names of the registered strategies."""
    return sorted(_ALLOCATORS)


def coba_solvers() -> list[str]:
    """Names of the registered CoBA solvers."""
    return sorted(_COBA_SOLVERS)


# ---------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------


def allocate(
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
) -> np.ndarray:
    """Rollout budget per prompt, shape (M,) int64, summing to ``total_budget``.

    Args:
        pass_rates: (M,) pass rate of each prompt on its last visit, in [0, 1]; NaN = never seen.
        total_budget: B_total, rollouts for the whole batch (M * min_budget <= B_total <= M * max_budget).
        strategy: one of ``strategies()``: "coba", "knapsack", "uniform".
        min_budget: B_low >= 2 (a GRPO group of one has no advantage).
        max_budget: B_up.
        alpha, beta: the Beta shape from ``CapabilityTracker`` (default: the pre-training (9, 2)).
        tau: "adaptive" (from the spread of pass rates) or a positive number.
        mode: "paper" (solver over all prompts) or "released" (the authors' released code).
        solver: "heap" (Algorithm 1), "threshold" (closed form) or "dp" (exact DP).

    >>> allocate([0.1, 0.5, 0.9, float("nan")], 16, strategy="uniform").tolist()
    [4, 4, 4, 4]
    >>> allocate([0.2, 0.5, 0.8], 12, alpha=9.0, beta=2.0).tolist()   # exploit: easy prompts first
    [2, 2, 8]
    """
    return plan_allocation(
        pass_rates,
        total_budget,
        strategy=strategy,
        min_budget=min_budget,
        max_budget=max_budget,
        alpha=alpha,
        beta=beta,
        tau=tau,
        mode=mode,
        solver=solver,
    ).budgets


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
    """Like ``allocate`` but returns the full ``Allocation`` (values, gains, tau, groups)."""
    request = _validate(pass_rates, total_budget, strategy, min_budget, max_budget, alpha, beta, tau, mode, solver)
    if not request.seen.any():
        plan = _uniform(request)
        return _replace(plan, strategy=strategy, fallback="every prompt unseen: uniform allocation")
    plan = _ALLOCATORS[strategy](request)
    budgets = plan.budgets
    assert budgets.dtype == np.int64 and int(budgets.sum()) == request.total_budget, "allocator broke the total"
    assert budgets.min() >= request.min_budget and budgets.max() <= request.max_budget, "allocator broke a bound"
    return plan


def _replace(plan: Allocation, **changes: Any) -> Allocation:
    return replace(plan, **changes)


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
    if strategy not in _ALLOCATORS:
        raise ValueError(f"unknown allocation strategy {strategy!r}; valid strategies: {', '.join(strategies())}")
    if mode not in {m.value for m in Mode}:
        raise ValueError(f"unknown coba mode {mode!r}; valid modes: {', '.join(m.value for m in Mode)}")
    if solver not in _COBA_SOLVERS:
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


# ---------------------------------------------------------------------------------------------
# Uniform (GRPO)
# ---------------------------------------------------------------------------------------------


def uniform_budgets(m: int, total_budget: int) -> np.ndarray:
    """B_total // M each, the remainder one at a time to the first prompts; (M,) int64."""
    budgets = np.full(m, total_budget // m, dtype=np.int64)
    budgets[: total_budget - int(budgets.sum())] += 1
    return budgets


@register_allocator(Strategy.UNIFORM.value)
def _uniform(req: AllocationRequest) -> Allocation:
    m = req.size
    nan = np.full(m, np.nan)
    return Allocation(
        budgets=uniform_budgets(m, req.total_budget),
        pass_rates=req.pass_rates,
        values=nan,
        marginal_gains=nan.copy(),
        groups=np.full(m, "all", dtype=object),
        strategy=Strategy.UNIFORM.value,
        mode="",
        solver="",
        alpha=req.alpha,
        beta=req.beta,
        tau=float("nan"),
    )


# ---------------------------------------------------------------------------------------------
# CoBA-RL
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CobaProblem:
    """The CoBA objective over a set of prompts, for the solvers (derived arrays cached)."""

    pass_rates: np.ndarray  # (n,) in [0, 1], unclipped
    alpha: float
    beta: float
    tau: float
    min_budget: int

    @cached_property
    def log_density(self) -> np.ndarray:
        """log BetaPDF(p) with p clipped to [0.01, 0.99]; (n,)."""
        return log_beta_density(clip_pass_rates(self.pass_rates), self.alpha, self.beta)

    @cached_property
    def k(self) -> np.ndarray:
        """p (1 - p) / tau with p clipped; (n,), strictly positive."""
        pc = clip_pass_rates(self.pass_rates)
        return pc * (1.0 - pc) / self.tau

    @cached_property
    def a(self) -> np.ndarray:
        """log dV(B) = a - k B: a = log C + log(1 - exp(-k)); (n,)."""
        return self.log_density + np.log(-np.expm1(-self.k))

    def values(self, budgets: np.ndarray) -> np.ndarray:
        """V(B_i, p_i) for budgets (n,)."""
        return np.exp(self.log_density) * -np.expm1(-self.k * budgets)

    def marginal_gains(self, budgets: np.ndarray) -> np.ndarray:
        """dV(B_i) = V(B_i + 1) - V(B_i) for budgets (n,)."""
        return np.exp(self.a - self.k * budgets)

    def value_table(self, cap: int) -> np.ndarray:
        """V(B_low + x, p_i) for x = 0..cap; shape (n, cap + 1)."""
        budgets = self.min_budget + np.arange(cap + 1, dtype=np.float64)
        return coba_value(budgets[None, :], self.pass_rates[:, None], self.alpha, self.beta, self.tau)


def coba_log_gains(problem: CobaProblem) -> tuple[np.ndarray, np.ndarray]:
    """(a0, k): log-gain of the j-th extra rollout of prompt i is a0[i] - k[i] * j."""
    return problem.a - problem.k * problem.min_budget, problem.k


@register_coba_solver(Solver.HEAP.value)
def heap_extras(a0: np.ndarray, k: np.ndarray, spare: int, cap: int, problem: CobaProblem) -> np.ndarray:
    """Algorithm 1: pop the largest marginal gain, grant one rollout, push the prompt's next gain.

    Gains are kept as log-gains a0 - k * j (monotone in the gain, so the order is the same) and
    the heap holds (-log_gain, prompt index), which breaks ties by prompt order. One
    ``heapreplace`` per rollout. Returns extras (n,) int64.
    """
    n = a0.size
    extras = [0] * n
    a0l = a0.tolist()
    kl = k.tolist()
    heap = [(-a0l[i], i) for i in range(n)]
    heapq.heapify(heap)
    replace, pop = heapq.heapreplace, heapq.heappop
    for _ in range(spare):
        i = heap[0][1]
        j = extras[i] + 1
        extras[i] = j
        if j < cap:
            replace(heap, (kl[i] * j - a0l[i], i))
        else:
            pop(heap)
    return np.asarray(extras, dtype=np.int64)


def _count_above(a0: np.ndarray, k: np.ndarray, cap: int, lam: float) -> np.ndarray:
    """Per prompt, the number of j in [0, cap) with a0 - k * j > lam; (n,) float64 of integers, exact."""
    c = np.ceil((a0 - lam) / k)
    np.minimum(c, cap, out=c)
    np.maximum(c, 0.0, out=c)
    # The division can round across the boundary: check with the same arithmetic as the heap.
    c -= (c > 0) & ~(a0 - k * (c - 1) > lam)
    c += (c < cap) & (a0 - k * c > lam)
    return c


@register_coba_solver(Solver.THRESHOLD.value)
def threshold_extras(a0: np.ndarray, k: np.ndarray, spare: int, cap: int, problem: CobaProblem) -> np.ndarray:
    """Closed form: every extra rollout whose log-gain is above lambda, lambda by a bracketed search.

    The count of gains above lambda falls monotonically in lambda; a safeguarded interpolation
    (regula falsi, with a bisection step whenever one end of the bracket stalls) narrows
    (lo, hi] until the count equals ``spare`` or the bracket is narrower than every k (then it
    holds at most one gain per prompt). The last few rollouts go to the largest next gains, ties
    by prompt order, exactly as the heap gives them. Returns extras (n,) int64.
    """
    n = a0.size
    if spare == 0:
        return np.zeros(n, dtype=np.int64)
    if spare == n * cap:
        return np.full(n, cap, dtype=np.int64)
    hi, n_hi = float(a0.max()), 0  # nothing is strictly above the largest gain
    lo, n_lo = float((a0 - k * (cap - 1)).min()) - 1.0, n * cap  # everything is above
    k_min = float(k.min())
    stalled = 0  # consecutive moves of the same end
    last_side = 0
    while hi - lo >= k_min:
        # regula falsi on the count, or a bisection step when one end has moved twice in a row
        mid = 0.5 * (lo + hi) if stalled >= 2 else hi - (hi - lo) * (spare - n_hi) / (n_lo - n_hi)
        if not lo < mid < hi:
            mid = 0.5 * (lo + hi)
            if not lo < mid < hi:
                break
        c = _count_above(a0, k, cap, mid)
        total = int(c.sum())
        if total == spare:
            return c.astype(np.int64)
        side = 1 if total > spare else -1
        stalled = stalled + 1 if side == last_side else 0
        last_side = side
        if side > 0:
            lo, n_lo = mid, total
        else:
            hi, n_hi = mid, total
    extras = _count_above(a0, k, cap, hi).astype(np.int64)
    short = spare - int(extras.sum())
    open_ = np.flatnonzero(extras < cap)
    nxt = a0[open_] - k[open_] * extras[open_]
    order = np.lexsort((open_, -nxt))[:short]  # largest gain first, then prompt order
    extras[open_[order]] += 1
    return extras


def solve_mckp_dp(values: np.ndarray, total: int) -> np.ndarray:
    """Exact multiple-choice knapsack: max sum_i values[i, x_i] s.t. sum_i x_i = total.

    Args:
        values: (n, C + 1) value of giving x = 0..C extra units to item i.
        total: units to place, 0 <= total <= n * C.
    Returns:
        x: (n,) int64.

    Dynamic program over items; for each item one vectorised max over an (total + 1, C + 1)
    window view of the previous row (no Python loop over budgets or choices), with the reachable
    range limited to what the items so far can hold. Memory: an (n, total + 1) int16 choice table.
    """
    n, width = values.shape
    cap = width - 1
    neg = -np.inf
    best = np.full(total + 1, neg)
    best[0] = 0.0
    choice = np.zeros((n, total + 1), dtype=np.int16)
    rev = values[:, ::-1]
    for i in range(n):
        reach = min(total, (i + 1) * cap)
        padded = np.concatenate((np.full(cap, neg), best[: reach + 1]))
        # windows[r, j] = best[r + j - cap]: choosing x = cap - j extra units for item i
        windows = sliding_window_view(padded, cap + 1)
        cand = windows + rev[i]
        j = cand.argmax(axis=1)
        new = np.full(total + 1, neg)
        new[: reach + 1] = cand[np.arange(reach + 1), j]
        choice[i, : reach + 1] = cap - j
        best = new
    if not np.isfinite(best[total]):
        raise ValueError(f"no allocation of {total} units fits {n} items of capacity {cap}")
    x = np.zeros(n, dtype=np.int64)
    r = total
    for i in range(n - 1, -1, -1):
        x[i] = choice[i, r]
        r -= x[i]
    return x


@register_coba_solver(Solver.DP.value)
def dp_extras(a0: np.ndarray, k: np.ndarray, spare: int, cap: int, problem: CobaProblem) -> np.ndarray:
    """Exact DP on the value table V(B_low + x, p) (not on the gains): the oracle."""
    return solve_mckp_dp(problem.value_table(cap), spare)


def _coba_solve(problem: CobaProblem, spare: int, cap: int, solver: Solver) -> np.ndarray:
    a0, k = coba_log_gains(problem)
    return _COBA_SOLVERS[solver.value](a0, k, spare, cap, problem)


def _resolve_tau(tau: str | float, p: np.ndarray) -> float:
    return adaptive_tau(p) if tau == "adaptive" else float(tau)


def _coba_plan(req: AllocationRequest, budgets: np.ndarray, problem: CobaProblem, groups: np.ndarray) -> Allocation:
    gains = np.where(budgets < req.max_budget, problem.marginal_gains(budgets), np.nan)
    return Allocation(
        budgets=budgets,
        pass_rates=req.pass_rates,
        values=problem.values(budgets),
        marginal_gains=gains,
        groups=groups,
        strategy=Strategy.COBA.value,
        mode=req.mode.value,
        solver=req.solver.value,
        alpha=req.alpha,
        beta=req.beta,
        tau=problem.tau,
    )


@register_allocator(Strategy.COBA.value)
def _coba(req: AllocationRequest) -> Allocation:
    if req.mode is Mode.RELEASED:
        return _coba_released(req)
    p = req.pass_rates
    problem = CobaProblem(p, req.alpha, req.beta, _resolve_tau(req.tau, p), req.min_budget)
    budgets = req.min_budget + _coba_solve(problem, req.spare, req.cap, req.solver)
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
        budgets[explore] += _coba_solve(problem, heap_budget, req.cap, req.solver)
    left = req.spare - heap_budget
    for name in ("very_hard", "explore", "very_easy"):
        members = np.flatnonzero(groups == name)
        if members.size and left > 0:
            left = distribute_proportional(budgets, members, left, 1.0 - p[members], req.max_budget)
    if left > 0:  # any remainder spread uniformly, one at a time in prompt order
        left = distribute_proportional(budgets, np.arange(m), left, np.ones(m), req.max_budget)
    assert left == 0
    full = CobaProblem(p, req.alpha, req.beta, tau if np.isfinite(tau) else _resolve_tau(req.tau, p), req.min_budget)
    plan = _coba_plan(req, budgets, full, groups)
    return _replace(plan, extras={"heap_share": share, "heap_budget": heap_budget})


# ---------------------------------------------------------------------------------------------
# Knapsack-RL
# ---------------------------------------------------------------------------------------------


def knapsack_gain(n: np.ndarray, p: np.ndarray) -> np.ndarray:
    """value(N + 1, p) - value(N, p) in closed form: (p^N (1 - p) + (1 - p)^N p) p (1 - p)^2."""
    n = np.asarray(n, dtype=np.float64)
    p = np.asarray(p, dtype=np.float64)
    return (p**n * (1.0 - p) + (1.0 - p) ** n * p) * p * (1.0 - p) ** 2


def greedy_extras(gains: np.ndarray, total: int) -> np.ndarray:
    """Greedy with a max-heap on an explicit (n, C) table of non-increasing gains; exact for concave values."""
    n, cap = gains.shape
    extras = [0] * n
    rows = gains.tolist()
    heap = [(-rows[i][0], i) for i in range(n)]
    heapq.heapify(heap)
    for _ in range(total):
        i = heap[0][1]
        j = extras[i] + 1
        extras[i] = j
        if j < cap:
            heapq.heapreplace(heap, (-rows[i][j], i))
        else:
            heapq.heappop(heap)
    return np.asarray(extras, dtype=np.int64)


@register_allocator(Strategy.KNAPSACK.value)
def _knapsack(req: AllocationRequest) -> Allocation:
    p = req.pass_rates
    m = p.size
    budgets = np.full(m, req.min_budget, dtype=np.int64)
    mixed = np.flatnonzero((p > 0.0) & (p < 1.0))
    units = min(req.spare, mixed.size * req.cap)
    if units > 0:
        n = req.min_budget + np.arange(req.cap + 1, dtype=np.float64)
        pm = p[mixed][:, None]
        if req.solver is Solver.DP:
            budgets[mixed] += solve_mckp_dp(knapsack_value(n[None, :], pm), units)
        else:  # the value is concave in N, so the greedy is exact (heap and threshold alike)
            budgets[mixed] += greedy_extras(knapsack_gain(n[None, :-1], pm), units)
    left = req.spare - units
    for members in (np.flatnonzero(p == 0.0), np.arange(m)):  # left over: p = 0 first, then all
        if left > 0 and members.size:
            left = distribute_proportional(budgets, members, left, np.ones(members.size), req.max_budget)
    assert left == 0
    values = knapsack_value(budgets, p)
    gains = np.where(budgets < req.max_budget, knapsack_gain(budgets, p), np.nan)
    return Allocation(
        budgets=budgets,
        pass_rates=p,
        values=values,
        marginal_gains=gains,
        groups=np.full(m, "all", dtype=object),
        strategy=Strategy.KNAPSACK.value,
        mode="",
        solver=req.solver.value,
        alpha=req.alpha,
        beta=req.beta,
        tau=float("nan"),
    )


def coba_objective(budgets: np.ndarray, pass_rates: np.ndarray, alpha: float, beta: float, tau: float) -> float:
    """sum_i V(B_i, p_i): the CoBA objective of an allocation (pass rates already filled)."""
    return float(coba_value(np.asarray(budgets), np.asarray(pass_rates), alpha, beta, tau).sum())
