"""Solvers for the CoBA objective (a registry: ``heap``, ``threshold``, ``dp``; all return the same optimum).

A solver gets per-prompt log-gain parameters of the *extra* rollouts above B_low (the j-th extra
rollout of prompt i has log-gain ``a0[i] - k[i] * j``, from ``CobaProblem``) and returns the extras
(n,) int64 (docs/method.md, sections 7-9):

- ``heap``: the paper's Algorithm 1, greedy with a max-heap of marginal gains, O(B_total log M).
- ``threshold``: the closed form. Each prompt's log-gain is affine in B (log dV(B) = a - k B), so
  the optimum is "every gain above a threshold lambda"; a vectorised bisection finds lambda, and ties
  at lambda go by prompt order exactly as the heap breaks them. O(M log(1/eps)).
- ``dp``: the exact dynamic program (multiple-choice knapsack over the extra rollouts), the
  correctness oracle and the paper's speed reference. O(M * B_total * (B_up - B_low)).

Also the greedy loop of the heap solver (``greedy_heap``) and the multiple-choice knapsack DP
``solve_mckp_dp`` (the CoBA oracle and Knapsack-RL's program, ``coba_tasks.core.knapsack``).
Pure numpy: no I/O, no Prefect, no pandas.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from functools import cached_property

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from coba_tasks.core.registry import Registry
from coba_tasks.core.values import clip_pass_rates, coba_value, log_beta_density


class Solver(StrEnum):
    """Solvers for the CoBA objective."""

    HEAP = "heap"
    THRESHOLD = "threshold"
    DP = "dp"


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


# A CoBA solver gets per-prompt log-gain parameters of the *extra* rollouts: the j-th extra
# rollout (j = 0 .. cap-1) of prompt i has log-gain a0[i] - k[i] * j. It returns extras (M,).
CobaSolverFn = Callable[[np.ndarray, np.ndarray, int, int, CobaProblem], np.ndarray]
_COBA_SOLVERS: Registry[CobaSolverFn] = Registry("CoBA solver")
register_coba_solver = _COBA_SOLVERS.register  # decorator: register a solver for the CoBA objective under a name
coba_solvers = _COBA_SOLVERS.names  # the registered CoBA solvers' names, sorted
coba_solver = _COBA_SOLVERS.get  # the CoBA solver registered under a name, or None


def coba_solve(problem: CobaProblem, spare: int, cap: int, solver: Solver) -> np.ndarray:
    """Extras (n,) int64 above B_low: ``spare`` rollouts placed by ``solver``, at most ``cap`` per prompt."""
    a0 = problem.a - problem.k * problem.min_budget  # the j-th extra rollout of prompt i: log-gain a0[i] - k[i] * j
    return _COBA_SOLVERS[solver.value](a0, problem.k, spare, cap, problem)


def greedy_heap(first_keys: list[float], next_key: Callable[[int, int], float], total: int, cap: int) -> np.ndarray:
    """Greedy allocation of ``total`` units with a heap: the smallest key takes the next unit.

    The heap holds (key, prompt index), so equal keys go by prompt order. ``first_keys[i]`` is the
    key of prompt i's first unit and ``next_key(i, j)`` that of its unit j (j = 1 .. cap - 1); a
    prompt leaves the heap once it holds ``cap`` units. Keys are negated gains, so the largest gain
    goes first. One ``heapreplace`` per unit. Returns extras (n,) int64.
    """
    n = len(first_keys)
    extras = [0] * n
    heap = [(first_keys[i], i) for i in range(n)]
    heapq.heapify(heap)
    replace, pop = heapq.heapreplace, heapq.heappop
    for _ in range(total):
        i = heap[0][1]
        j = extras[i] + 1
        extras[i] = j
        if j < cap:
            replace(heap, (next_key(i, j), i))
        else:
            pop(heap)
    return np.asarray(extras, dtype=np.int64)


@register_coba_solver(Solver.HEAP.value)
def heap_extras(a0: np.ndarray, k: np.ndarray, spare: int, cap: int, problem: CobaProblem) -> np.ndarray:
    """Algorithm 1: pop the largest marginal gain, grant one rollout, push the prompt's next gain.

    Gains are kept as log-gains a0 - k * j (monotone in the gain, so the order is the same) and
    the heap holds (-log_gain, prompt index), which breaks ties by prompt order (``greedy_heap``).
    Returns extras (n,) int64.
    """
    a0l, kl = a0.tolist(), k.tolist()
    return greedy_heap([-a for a in a0l], lambda i, j: kl[i] * j - a0l[i], spare, cap)


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


def solve_mckp_dp(values: np.ndarray, total: int, *, fewest_on_ties: bool = False) -> np.ndarray:
    """Exact multiple-choice knapsack: max sum_i values[i, x_i] s.t. sum_i x_i = total.

    Args:
        values: (n, C + 1) value of giving x = 0..C extra units to item i.
        total: units to place, 0 <= total <= n * C.
        fewest_on_ties: among choices of equal running total, item i takes the smallest x (the
            Knapsack-RL authors' program); by default the largest.
    Returns:
        x: (n,) int64.

    Dynamic program over items; for each item one vectorised max over an (total + 1, C + 1)
    window view of the previous row (no Python loop over budgets or choices), with the reachable
    range limited to what the items so far can hold. Each running total is the float64 sum
    best[r - x] + values[i, x], item by item, so ties are exact. Memory: an (n, total + 1) int16
    choice table.
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
        # argmax takes the first maximum: scanning j = cap - x upwards is the largest x first
        j = cap - cand[:, ::-1].argmax(axis=1) if fewest_on_ties else cand.argmax(axis=1)
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
