"""Per-prompt value of a rollout budget: CoBA-RL's V(B, p) = eta(B, p) * BetaPDF(p; alpha, beta) and its
marginal gain (docs/method.md, section 5: every solver works with the affine log-gain a - k B, so all do the
same float arithmetic), and Knapsack-RL's value(N, p) = (1 - p^N - (1 - p)^N) * p * (1 - p)^2. Numpy in,
numpy out: no I/O.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import special

P_CLIP = (0.01, 0.99)
VAR_MAX = 1.0 / 6.0
TAU_MIN = 3.0
TAU_MAX = 12.0


def clip_pass_rates(p: np.ndarray) -> np.ndarray:
    """Clip pass rates to [0.01, 0.99], where the Beta density is finite and non-zero."""
    return np.clip(np.asarray(p, dtype=np.float64), *P_CLIP)


def log_beta_density(p: np.ndarray, alpha: float, beta: float) -> np.ndarray:
    """log BetaPDF(p; alpha, beta) for p in (0, 1), shape-preserving."""
    p = np.asarray(p, dtype=np.float64)
    return special.xlogy(alpha - 1.0, p) + special.xlog1py(beta - 1.0, -p) - special.betaln(alpha, beta)


def beta_density(p: np.ndarray, alpha: float, beta: float) -> np.ndarray:
    """BetaPDF(p; alpha, beta), shape-preserving (equals scipy.stats.beta.pdf)."""
    return np.exp(log_beta_density(p, alpha, beta))


def adaptive_tau(p: np.ndarray, tau_min: float = TAU_MIN, tau_max: float = TAU_MAX, var_max: float = VAR_MAX) -> float:
    """tau from the spread of pass rates (released code): tau_min + (tau_max - tau_min) * v.

    v = clip(var(p) / var_max, 0, 1) with the population variance of ``p`` (shape (M,)).
    An empty ``p`` gives tau_min.
    """
    p = np.asarray(p, dtype=np.float64)
    if p.size == 0:
        return float(tau_min)
    v = min(max(float(np.var(p)) / var_max, 0.0), 1.0)
    return float(tau_min + (tau_max - tau_min) * v)


def saturation(budget: np.ndarray, p: np.ndarray, tau: float) -> np.ndarray:
    """eta(B, p) = 1 - exp(-(B / tau) p (1 - p)) with p clipped; broadcasts."""
    pc = clip_pass_rates(p)
    return -np.expm1(-(np.asarray(budget, dtype=np.float64) / tau) * pc * (1.0 - pc))


def coba_value(budget: np.ndarray, p: np.ndarray, alpha: float, beta: float, tau: float) -> np.ndarray:
    """V(B, p) = eta(B, p) * BetaPDF(p; alpha, beta) with p clipped to [0.01, 0.99]; broadcasts."""
    pc = clip_pass_rates(p)
    return saturation(budget, pc, tau) * beta_density(pc, alpha, beta)


def coba_gain_params(p: np.ndarray, alpha: float, beta: float, tau: float) -> tuple[np.ndarray, np.ndarray]:
    """Per-prompt (a, k), shape (M,) each, such that log dV(B) = a - k * B: a = log C + log(1 - exp(-k)),
    k = p (1 - p) / tau > 0, with ``p`` clipped here to [0.01, 0.99]."""
    pc = clip_pass_rates(p)
    k = pc * (1.0 - pc) / tau
    a = log_beta_density(pc, alpha, beta) + np.log(-np.expm1(-k))
    return a, k


def effective_number(weights: np.ndarray) -> float:
    """N_eff = (sum w)^2 / sum w^2 of non-negative weights (shape (M,)): the number of equal weights with the
    same spread, M when all are equal, 1 when one holds everything; 0.0 when every weight is 0. Sums with
    ``math.fsum``, so the order of the weights does not change the result.

    >>> effective_number(np.array([1.0, 1.0, 2.0]))
    2.6666666666666665
    """
    w = np.asarray(weights, dtype=np.float64).ravel()
    if w.size and (not np.all(np.isfinite(w)) or w.min() < 0):
        raise ValueError(f"weights must be finite and non-negative, got min {w.min()}")
    square = math.fsum((w * w).tolist())
    return math.fsum(w.tolist()) ** 2 / square if square > 0 else 0.0


def knapsack_value(n: np.ndarray, p: np.ndarray) -> np.ndarray:
    """Knapsack-RL value(N, p) = (1 - p^N - (1 - p)^N) * p * (1 - p)^2, the probability that a group of N
    rollouts holds both a success and a failure (a non-zero GRPO gradient) times p (1 - p)^2; broadcasts."""
    n, p = np.asarray(n, dtype=np.float64), np.asarray(p, dtype=np.float64)
    return (1.0 - p**n - (1.0 - p) ** n) * p * (1.0 - p) ** 2
