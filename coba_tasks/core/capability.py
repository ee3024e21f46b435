"""Global capability tracking: the failure rate and the Beta shape (docs/method.md).

After each training step's rollouts are verified, the step's per-prompt pass rates give the
failure rate F_t = 1 - mean_i(pass_rate_i) (a mean over prompts, not over rollouts). A moving
average over the last ``window`` steps, a sigmoid transform below 0.5 and a clip turn it into the
shape (alpha, beta) of the Beta density that the CoBA value function uses for the *next* step:

    Fbar  = mean(F_{t-window+1} .. F_t)
    Ftil  = Fbar                            if Fbar > 0.5
          = sigmoid(gamma * (Fbar - 0.5))   otherwise
    alpha = clip(alpha_min + lam * Ftil, alpha_min, alpha_max)
    beta  = kappa - alpha

The mode of Beta(alpha, beta), (alpha - 1) / (kappa - 2), equals Ftil when lam = kappa - 2 and
alpha_min = 1: a weak model (high F) puts its budget on easy prompts ("exploit"), a strong one on
hard prompts ("explore").

Pure Python and numpy: no I/O, no Prefect. The state round-trips through ``to_dict`` /
``from_dict`` (JSON-safe), so a resumed run continues exactly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

STATE_VERSION = 1


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

    Args:
        kappa: alpha + beta, the concentration of the Beta density (paper default 11).
        window: number of recent steps in the moving average of F (released code: 1).
        gamma: steepness of the sigmoid applied when Fbar <= 0.5.
        alpha_min: lower clip of alpha (default 1).
        alpha_max: upper clip of alpha (default kappa - 1).
        lam: slope of alpha in Ftil (default kappa - 2, which makes the mode equal Ftil).

    Before the first update, (alpha, beta) = (kappa - 2, 2) (released code).

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

    # -- state -------------------------------------------------------------------------------
    @property
    def alpha(self) -> float:
        """Current alpha (for the next step's allocation)."""
        return float(self._alpha)

    @property
    def beta(self) -> float:
        """Current beta = kappa - alpha."""
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

    # -- update ------------------------------------------------------------------------------
    def update(self, step_pass_rates: Sequence[float] | np.ndarray) -> tuple[float, float]:
        """Fold in one step's per-prompt pass rates (shape (M,), values in [0, 1]).

        Returns the new (alpha, beta), to be used for the next step's allocation.
        """
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
        alpha = min(max(self.alpha_min + self.lam * ftil, self.alpha_min), self.alpha_max)
        self._alpha = float(alpha)
        self._beta = float(self.kappa - alpha)
        return self.alpha, self.beta

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe state; ``from_dict(to_dict())`` continues exactly."""
        return {
            "version": STATE_VERSION,
            "kappa": self.kappa,
            "window": self.window,
            "gamma": self.gamma,
            "alpha_min": self.alpha_min,
            "alpha_max": self.alpha_max,
            "lam": self.lam,
            "failure_rates": list(self.failure_rates),
            "alpha": self.alpha,
            "beta": self.beta,
        }

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
