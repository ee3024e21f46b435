"""Per-prompt pass-rate estimators: what the allocation is told of each prompt (docs/method.md, section 2).

``allocation.estimator`` chooses one:

- ``last``: the mean pass rate of the prompt's last ``pass_rate_window`` visits (the paper's estimate;
  one visit by default);
- ``posterior``: a Beta(a, b) posterior over the prompt's pass rate. Before its first visit the prior is
  Beta(s * pbar, s * (1 - pbar)), pbar the pass rate of every rollout scored so far (0.5 before any), s the
  prior strength; at each visit the counts are multiplied by the decay d, then the visit's successes are
  added to a and its failures to b. The estimate is the posterior mean a / (a + b), resting on a + b
  (pseudo-)rollouts;
- ``pilot``: the same posterior, updated at the step itself with a first wave of k rollouts per prompt
  from the current policy (part of the visit: the step's later rollouts join the same update).

Pure numpy: no I/O, no pandas. The posterior's counts travel in the history table
(``coba_tasks.pipeline.prompt_history.update_history``), so a resumed run continues from them exactly.
"""

from __future__ import annotations

from enum import StrEnum

import numpy as np

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
