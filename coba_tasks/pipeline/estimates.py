"""The allocation's inputs, from the run's tables: each prompt's estimate under ``allocation.estimator`` and
the rollouts it rests on, and the posterior's counts that the history table carries from visit to visit
(the math: ``coba_tasks.core.estimators``; docs/method.md, section 2).

The history table (``coba_tasks.pipeline.stages.update_history``) holds, per prompt, ``visit_rollouts`` (the
rollouts of each of its last ``pass_rate_window`` visits, beside ``pass_rates``), ``posterior_a`` and
``posterior_b`` (the posterior's counts after its last visit) and ``rollouts_scored`` and ``rollouts_solved``
(all its rollouts, and the solved ones: their sums over the prompts give the global pass rate pbar). Every
estimator's history has them, so a ``last`` run records what ``posterior`` would have estimated.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from coba_tasks.core.estimators import (
    DEFAULT_DECAY,
    DEFAULT_PRIOR_STRENGTH,
    Estimator,
    counts_before,
    global_pass_rate,
    posterior_mean,
    visit,
)
from coba_tasks.engines.verify import solved

POSTERIOR_DTYPES = {
    "posterior_a": np.float64,
    "posterior_b": np.float64,
    "rollouts_scored": np.int64,
    "rollouts_solved": np.int64,
}
POSTERIOR_COLUMNS = tuple(POSTERIOR_DTYPES)


def posterior_state(history: pd.DataFrame) -> pd.DataFrame:
    """``POSTERIOR_COLUMNS`` of each prompt of ``history`` (index prompt_id): its counts (NaN: none yet) and its
    rollouts scored and solved."""
    out = pd.DataFrame(index=pd.Index(history["prompt_id"], name="prompt_id"))
    for name in POSTERIOR_COLUMNS:
        out[name] = history[name].to_numpy(dtype=np.float64)
    return out


def prior_pass_rate(history: pd.DataFrame) -> tuple[float, int]:
    """(pbar, rollouts): the pass rate of every rollout the history has scored (0.5 before any) and their number."""
    state = posterior_state(history)
    scored, won = float(state["rollouts_scored"].sum()), float(state["rollouts_solved"].sum())
    return global_pass_rate(won, scored), int(scored)


def visit_counts(rewards: pd.DataFrame) -> pd.DataFrame:
    """Per prompt of a rewards table (index prompt_id, first-seen order): ``successes`` (verdict ``correct``,
    as ``stages.pass_rates`` counts them) and ``rollouts``."""
    won = solved(rewards).astype(np.int64)
    grouped = won.groupby(rewards["prompt_id"], sort=False)
    return pd.DataFrame({"successes": grouped.sum(), "rollouts": grouped.size()})


def counts_after_visit(
    history: pd.DataFrame, rewards: pd.DataFrame, strength: float, decay: float
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(counts, visits): each prompt of ``rewards``'s posterior counts ``a``, ``b`` after this visit (its counts
    in ``history``, or the prior from ``history``'s pbar, decayed, plus the visit's successes and failures),
    and ``visit_counts(rewards)``; both indexed by prompt_id in first-seen order."""
    visits = visit_counts(rewards)
    before = posterior_state(history).reindex(visits.index)
    pbar, _ = prior_pass_rate(history)
    a, b = counts_before(before["posterior_a"], before["posterior_b"], pbar, strength)
    s = visits["successes"].to_numpy()
    a, b = visit(a, b, s, visits["rollouts"].to_numpy() - s, decay)
    return pd.DataFrame({"a": a, "b": b}, index=visits.index), visits


def batch_estimates(
    batch: Sequence[str], history: pd.DataFrame, alloc: Any, pilot: pd.DataFrame | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(estimate, estimate_rollouts) of each prompt of ``batch`` under ``alloc.estimator`` (coba and uniform;
    Knapsack-RL keeps its own estimate, ``stages.budget_table``):

    - ``last``: the mean of its last visits' pass rates, resting on those visits' rollouts (NaN and 0 when
      never visited; NaN rollouts for visits recorded before ``visit_rollouts``);
    - ``posterior``: the posterior mean a / (a + b), resting on a + b (the prior, pbar and s, for a prompt never
      visited); NaN and 0 while no rollout has been scored at all (the allocation is then uniform);
    - ``pilot``: the posterior after the pilot's rewards ``pilot`` (a rewards table) joined the visit.
    """
    estimator = getattr(alloc, "estimator", Estimator.LAST.value)
    if estimator == Estimator.LAST:
        rates = dict(zip(history["prompt_id"], history["pass_rates"], strict=True))
        sizes = dict(zip(history["prompt_id"], [list(v) for v in history["visit_rollouts"]], strict=True))
        est = np.array([float(np.mean(rates[p])) if p in rates else np.nan for p in batch], dtype=np.float64)
        rests = [float(sum(sizes[p])) if p in rates else 0.0 for p in batch]
        return est, np.array(rests, dtype=np.float64)
    strength = float(getattr(alloc, "prior_strength", DEFAULT_PRIOR_STRENGTH))
    decay = float(getattr(alloc, "posterior_decay", DEFAULT_DECAY))
    state = posterior_state(history).reindex(list(batch))
    pbar, scored = prior_pass_rate(history)
    a, b = counts_before(state["posterior_a"], state["posterior_b"], pbar, strength)
    if estimator == Estimator.PILOT:
        if pilot is None:
            raise ValueError("allocation.estimator = pilot: the allocation needs the pilot's rewards")
        visits = visit_counts(pilot).reindex(list(batch))
        if visits["rollouts"].isna().any():
            missing = [p for p, n in zip(batch, visits["rollouts"], strict=True) if n != n]
            raise ValueError(f"the pilot has no rollouts of prompt {missing[0]} ({len(missing)} prompts without)")
        s = visits["successes"].to_numpy(dtype=np.float64)
        a, b = visit(a, b, s, visits["rollouts"].to_numpy(dtype=np.float64) - s, decay)
        scored += int(visits["rollouts"].sum())
    elif estimator != Estimator.POSTERIOR:
        raise ValueError(f"unknown estimator {estimator!r}; choose one of {', '.join(e.value for e in Estimator)}")
    if scored == 0:  # nothing scored yet: no estimate at all, the allocation is uniform
        return np.full(len(batch), np.nan), np.zeros(len(batch))
    return posterior_mean(a, b), a + b
