"""What the model can do: the failure rate over the pool and its Beta shape, and each prompt's pass-rate
estimate (docs/method.md).

A step's failure rate F_t = 1 - mean_i(pass_rate_i) (over prompts, not rollouts), averaged over ``window``
steps, transformed and clipped, gives the shape (alpha, beta) of the Beta density the CoBA value uses for the
*next* step (equations: docs/method.md, sections 3-4). Pure Python and numpy; the state round-trips through
``to_dict`` / ``from_dict`` (JSON-safe), so a resumed run continues exactly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np

STATE_VERSION = 1
_SHAPE_KEYS = ("kappa", "window", "gamma", "alpha_min", "alpha_max", "lam")  # the settings in the saved state


def transform_failure_rate(fbar: float, gamma: float = 10.0) -> float:
    """Ftil from Fbar: identity above 0.5, sigmoid(gamma * (Fbar - 0.5)) at or below it."""
    if fbar > 0.5:
        return float(fbar)
    return 1.0 / (1.0 + math.exp(-gamma * (fbar - 0.5)))


def beta_mode(alpha: float, beta: float) -> float:
    """Mode of Beta(alpha, beta) for alpha, beta > 1: (alpha - 1) / (alpha + beta - 2)."""
    if alpha <= 1.0 or beta <= 1.0:
        raise ValueError(f"the mode of Beta({alpha}, {beta}) is at an end point: alpha and beta must be > 1")
    return (alpha - 1.0) / (alpha + beta - 2.0)


@dataclass
class CapabilityTracker:
    """Tracks the policy's failure rate across steps and gives the Beta shape (alpha, beta).

    ``kappa`` = alpha + beta (paper: 11); ``window``: steps in the moving average of F (released code: 1);
    ``gamma``: the sigmoid's steepness; alpha is clipped to [``alpha_min``, ``alpha_max``] (default kappa - 1)
    with slope ``lam`` in Ftil (default kappa - 2: the mode equals Ftil). Before the first update (alpha,
    beta) = (kappa - 2, 2) (released code).

    >>> t = CapabilityTracker()
    >>> t.alpha, t.beta
    (9.0, 2.0)
    >>> a, b = t.update([0.0, 0.2, 0.4])    # F = 0.8 > 0.5, so Ftil = 0.8
    >>> round(a, 6), round(b, 6)
    (8.2, 2.8)
    """

    kappa: float = 11.0
    window: int = 1
    gamma: float = 10.0
    alpha_min: float = 1.0
    alpha_max: float | None = None
    lam: float | None = None
    failure_rates: list[float] = field(default_factory=list)
    _alpha: float | None = field(default=None, repr=False)
    _beta: float | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not math.isfinite(self.kappa) or self.kappa <= 2.0:
            raise ValueError(f"kappa must be a finite number > 2 (alpha + beta), got {self.kappa}")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"window must be an integer >= 1 (steps in the moving average), got {self.window!r}")
        if not math.isfinite(self.gamma) or self.gamma <= 0:
            raise ValueError(f"gamma must be a positive number, got {self.gamma}")
        if self.alpha_max is None:
            self.alpha_max = self.kappa - 1.0
        if self.lam is None:
            self.lam = self.kappa - 2.0
        if not 0.0 < self.alpha_min <= self.alpha_max < self.kappa:
            raise ValueError(
                f"need 0 < alpha_min <= alpha_max < kappa so that alpha and beta stay positive; "
                f"got alpha_min={self.alpha_min}, alpha_max={self.alpha_max}, kappa={self.kappa}"
            )
        self.failure_rates = [float(f) for f in self.failure_rates]
        if self._alpha is None:
            self._alpha = self.kappa - 2.0
            self._beta = 2.0

    @property
    def alpha(self) -> float:
        """Current alpha (for the next step's allocation)."""
        assert self._alpha is not None  # set by __post_init__
        return float(self._alpha)

    @property
    def beta(self) -> float:
        """Current beta = kappa - alpha."""
        assert self._beta is not None  # set by __post_init__
        return float(self._beta)

    @property
    def failure_rate(self) -> float:
        """F of the most recent step (NaN before the first update)."""
        return self.failure_rates[-1] if self.failure_rates else float("nan")

    @property
    def failure_rate_avg(self) -> float:
        """Fbar: mean F over the last ``window`` steps (NaN before the first update)."""
        if not self.failure_rates:
            return float("nan")
        recent = self.failure_rates[-self.window :]
        return float(sum(recent) / len(recent))

    @property
    def failure_rate_transformed(self) -> float:
        """Ftil: Fbar after the sigmoid transform (NaN before the first update)."""
        fbar = self.failure_rate_avg
        return float("nan") if math.isnan(fbar) else transform_failure_rate(fbar, self.gamma)

    @property
    def steps(self) -> int:
        """Number of updates so far."""
        return len(self.failure_rates)

    def update(self, step_pass_rates: Sequence[float] | np.ndarray) -> tuple[float, float]:
        """Fold in one step's per-prompt pass rates, (M,) in [0, 1]; the new (alpha, beta), for the next step."""
        rates = np.asarray(step_pass_rates, dtype=np.float64)
        if rates.ndim != 1 or rates.size == 0:
            raise ValueError(f"step_pass_rates must be a non-empty 1-D sequence, got shape {rates.shape}")
        bad = np.flatnonzero(~np.isfinite(rates) | (rates < 0.0) | (rates > 1.0))
        if bad.size:
            i = int(bad[0])
            raise ValueError(
                f"step pass rates must lie in [0, 1]; {bad.size} do not, the first at position {i}: {rates[i]}"
            )
        self.failure_rates.append(float(1.0 - rates.mean()))
        ftil = self.failure_rate_transformed
        lam, alpha_max = self.lam, self.alpha_max
        assert lam is not None and alpha_max is not None  # set by __post_init__
        alpha = min(max(self.alpha_min + lam * ftil, self.alpha_min), alpha_max)
        self._alpha = float(alpha)
        self._beta = float(self.kappa - alpha)
        return self.alpha, self.beta

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe state; ``from_dict(to_dict())`` continues exactly."""
        state = {"version": STATE_VERSION} | {k: getattr(self, k) for k in _SHAPE_KEYS}
        return state | {"failure_rates": list(self.failure_rates), "alpha": self.alpha, "beta": self.beta}

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> CapabilityTracker:
        """Rebuild a tracker from ``to_dict`` output."""
        version = state.get("version")
        if version != STATE_VERSION:
            raise ValueError(
                f"capability state version {version!r} is not supported (this build reads version {STATE_VERSION})"
            )
        return cls(
            kappa=float(state["kappa"]),
            window=int(state["window"]),
            gamma=float(state["gamma"]),
            alpha_min=float(state["alpha_min"]),
            alpha_max=float(state["alpha_max"]),
            lam=float(state["lam"]),
            failure_rates=[float(f) for f in state["failure_rates"]],
            _alpha=float(state["alpha"]),
            _beta=float(state["beta"]),
        )


# --- Each prompt's pass-rate estimate (``allocation.estimator``; docs/method.md, section 2): ``last`` (the mean
# pass rate of its last ``pass_rate_window`` visits), ``posterior`` (a Beta(a, b) posterior: the prior
# Beta(s * pbar, s * (1 - pbar)) before its first visit, pbar the pass rate of every rollout scored so far;
# at each visit the counts times the decay d, plus the visit's successes to a and failures to b; the
# estimate a / (a + b)) or ``pilot`` (the same posterior, updated at the step itself with a first wave of
# k rollouts per prompt). The counts travel in the history table (``prompt_history.update_history``).

UNINFORMED_PASS_RATE = 0.5  # pbar before any rollout is scored
DEFAULT_PRIOR_STRENGTH = 2.0  # s: the prior weighs as much as two rollouts (allocation.prior_strength)
DEFAULT_DECAY = 0.5  # d: each later visit halves a visit's weight (allocation.posterior_decay)
DEFAULT_PILOT_ROLLOUTS = 2  # k: the pilot's rollouts per prompt (allocation.pilot_rollouts)


class Estimator(StrEnum):
    """The values of ``allocation.estimator``."""

    LAST = "last"
    POSTERIOR = "posterior"
    PILOT = "pilot"


def global_pass_rate(solved: float, scored: float) -> float:
    """pbar: the share of solved rollouts among all ``scored`` so far; 0.5 before any.

    >>> global_pass_rate(3, 12), global_pass_rate(0, 0)
    (0.25, 0.5)
    """
    if scored < 0 or solved < 0 or solved > scored:
        raise ValueError(f"need 0 <= solved <= scored, got solved={solved}, scored={scored}")
    return float(solved) / float(scored) if scored > 0 else UNINFORMED_PASS_RATE


def prior_counts(pbar: float, strength: float) -> tuple[float, float]:
    """(a, b) of the prior Beta(s * pbar, s * (1 - pbar)) of a prompt not visited yet.

    >>> prior_counts(0.25, 2.0)
    (0.5, 1.5)
    """
    if not 0.0 <= pbar <= 1.0:
        raise ValueError(f"pbar must lie in [0, 1], got {pbar}")
    if not strength > 0:
        raise ValueError(f"the prior strength must be > 0, got {strength}")
    return strength * pbar, strength * (1.0 - pbar)


def counts_before(a: np.ndarray, b: np.ndarray, pbar: float, strength: float) -> tuple[np.ndarray, np.ndarray]:
    """Each prompt's (a, b) before its next visit: its counts, or the prior where it has none (NaN).

    >>> a, b = counts_before(np.array([3.0, np.nan]), np.array([1.0, np.nan]), 0.25, 2.0)
    >>> a.tolist(), b.tolist()
    ([3.0, 0.5], [1.0, 1.5])
    """
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    pa, pb = prior_counts(pbar, strength)
    unseen = np.isnan(a) | np.isnan(b)
    return np.where(unseen, pa, a), np.where(unseen, pb, b)


def visit(
    a: np.ndarray, b: np.ndarray, successes: np.ndarray, failures: np.ndarray, decay: float
) -> tuple[np.ndarray, np.ndarray]:
    """The counts after a visit: the old ones times ``decay``, plus the visit's successes (to a) and
    failures (to b). ``decay`` 1 forgets nothing; 0 keeps only this visit.

    >>> a, b = visit(np.array([1.0]), np.array([3.0]), np.array([2]), np.array([0]), 0.5)
    >>> a.tolist(), b.tolist()
    ([2.5], [1.5])
    """
    if not 0.0 <= decay <= 1.0:
        raise ValueError(f"the decay must lie in [0, 1], got {decay}")
    s, f = np.asarray(successes, dtype=np.float64), np.asarray(failures, dtype=np.float64)
    if (s < 0).any() or (f < 0).any():
        raise ValueError("successes and failures must be >= 0")
    return decay * np.asarray(a, dtype=np.float64) + s, decay * np.asarray(b, dtype=np.float64) + f


def posterior_mean(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a / (a + b), the estimate the allocation uses; NaN where a + b is 0 or NaN.

    >>> posterior_mean(np.array([2.5, 0.0]), np.array([1.5, 0.0])).tolist()
    [0.625, nan]
    """
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    n = a + b
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n > 0, a / np.where(n > 0, n, 1.0), np.nan)
