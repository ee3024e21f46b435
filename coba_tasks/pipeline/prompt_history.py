"""The allocator's memory of each prompt: the history table, the pass rates it is made of, the posterior counts it
carries from visit to visit, and each prompt's estimate under ``allocation.estimator`` with the rollouts it rests on
(the math: ``coba_tasks.core.capability``; docs/method.md, section 2).

The history table (``update_history``; ``steps/t/history.parquet``, written by the capability stage) holds, per
prompt, its last ``pass_rate_window`` visits' ``pass_rates`` and ``visit_rollouts`` (the rollouts of each),
``last_step``, ``pooled_solved`` (the solved flags Knapsack-RL's estimate averages), ``posterior_a`` and
``posterior_b`` (the posterior's counts after its last visit) and ``rollouts_scored`` and ``rollouts_solved``
(all its rollouts, and the solved ones: their sums over the prompts give the global pass rate pbar). Every
estimator's history has them, so a ``last`` run records what ``posterior`` would have estimated.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from coba_tasks.core.capability import (
    DEFAULT_DECAY,
    DEFAULT_PRIOR_STRENGTH,
    Estimator,
    counts_before,
    global_pass_rate,
    posterior_mean,
    visit,
)
from coba_tasks.core.knapsack import pool_outcomes
from coba_tasks.engines.verify import solved

if TYPE_CHECKING:
    from coba_tasks.pipeline.config_sections import AllocationConfig

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
    return history.set_index("prompt_id")[list(POSTERIOR_COLUMNS)].astype(np.float64)


def prior_pass_rate(history: pd.DataFrame) -> tuple[float, int]:
    """(pbar, rollouts): the pass rate of every rollout the history has scored (0.5 before any) and their number."""
    state = posterior_state(history)
    scored, won = float(state["rollouts_scored"].sum()), float(state["rollouts_solved"].sum())
    return global_pass_rate(won, scored), int(scored)


def visit_counts(rewards: pd.DataFrame) -> pd.DataFrame:
    """Per prompt of a rewards table (index prompt_id, first-seen order): ``successes`` (verdict ``correct``,
    as ``prompt_history.pass_rates`` counts them) and ``rollouts``."""
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
    batch: Sequence[str], history: pd.DataFrame, alloc: AllocationConfig, pilot: pd.DataFrame | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(estimate, estimate_rollouts) of each prompt of ``batch`` under ``alloc.estimator`` (coba and uniform;
    Knapsack-RL keeps its own estimate, ``stages.budget_table``):

    - ``last``: the mean of its last visits' pass rates, resting on those visits' rollouts (NaN and 0 when
      never visited; NaN rollouts for visits recorded before ``visit_rollouts``);
    - ``posterior``: the posterior mean a / (a + b), resting on a + b (the prior, pbar and s, for a prompt never
      visited); NaN and 0 while no rollout has been scored at all (the allocation is then uniform);
    - ``pilot``: the posterior after the pilot's rewards ``pilot`` (a rewards table) joined the visit.
    """
    estimator = alloc.estimator
    if estimator == Estimator.LAST:
        rates = dict(zip(history["prompt_id"], history["pass_rates"], strict=True))
        sizes = dict(zip(history["prompt_id"], [list(v) for v in history["visit_rollouts"]], strict=True))
        est = np.array([float(np.mean(rates[p])) if p in rates else np.nan for p in batch], dtype=np.float64)
        rests = [float(sum(sizes[p])) if p in rates else 0.0 for p in batch]
        return est, np.array(rests, dtype=np.float64)
    strength = float(alloc.prior_strength)
    decay = float(alloc.posterior_decay)
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


def pass_rates(rewards: pd.DataFrame) -> pd.Series:
    """Per-prompt pass rate of this step: share of solved rollouts (verdict ``correct``) among its rollouts
    (index prompt_id). A built-in verifier's ``correct`` is its reward 1; a reward file's is a score of at
    least ``verify.pass_threshold`` (``coba_tasks.engines.reward_file``), so fractional scores count as
    solved or not, never as fractions of a pass."""
    return solved(rewards).groupby(rewards["prompt_id"], sort=False).mean()


def update_history(
    history: pd.DataFrame,
    rewards: pd.DataFrame,
    step: int,
    window: int,
    prior_strength: float = DEFAULT_PRIOR_STRENGTH,
    decay: float = DEFAULT_DECAY,
) -> pd.DataFrame:
    """Per prompt, its last ``window`` visits' pass rates (the allocator's memory) and rollouts
    (``visit_rollouts``), ``pooled_solved``, the solved flags (1/0, in sample order, oldest first) that
    Knapsack-RL's estimate averages (``coba_tasks.core.knapsack.pool_outcomes``), and the Beta posterior's
    counts after this visit with the rollouts scored and solved so far (``coba_tasks.pipeline.prompt_history``:
    prior strength s, decay per visit d)."""
    rates = pass_rates(rewards)
    ordered = rewards.sort_values("sample_idx", kind="stable")
    flags = solved(ordered).astype(int).groupby(ordered["prompt_id"], sort=False).agg(list)
    hist = {pid: list(v) for pid, v in zip(history["prompt_id"], history["pass_rates"], strict=True)}
    last = dict(zip(history["prompt_id"], history["last_step"], strict=True))
    pooled = dict(zip(history["prompt_id"], pooled_flags(history), strict=True))
    sizes = dict(zip(history["prompt_id"], [list(v) for v in history["visit_rollouts"]], strict=True))
    post = posterior_state(history).to_dict("index")  # prompt_id -> {posterior_a, ..., rollouts_solved}
    counts, visits = counts_after_visit(history, rewards, prior_strength, decay)
    for pid, rate in rates.items():
        hist[pid] = ([*hist.get(pid, []), float(rate)])[-window:]
        sizes[pid] = ([*sizes.get(pid, []), int(visits.loc[pid, "rollouts"])])[-window:]
        last[pid] = step
        pooled[pid] = pool_outcomes(pooled.get(pid, []), flags[pid])
        was = post.get(pid, {"rollouts_scored": 0.0, "rollouts_solved": 0.0})
        post[pid] = {
            "posterior_a": counts.loc[pid, "a"],
            "posterior_b": counts.loc[pid, "b"],
            "rollouts_scored": was["rollouts_scored"] + visits.loc[pid, "rollouts"],
            "rollouts_solved": was["rollouts_solved"] + visits.loc[pid, "successes"],
        }
    ids = sorted(hist)
    return pd.DataFrame(
        {
            "prompt_id": ids,
            "pass_rates": [hist[i] for i in ids],
            "last_step": np.array([last[i] for i in ids], dtype=np.int64),
            "pooled_solved": [pooled[i] for i in ids],
            "visit_rollouts": [[int(n) for n in sizes.get(i, [])] for i in ids],
            **{c: np.array([post[i][c] for i in ids], dtype=POSTERIOR_DTYPES[c]) for c in POSTERIOR_COLUMNS},
        }
    )


def pooled_flags(history: pd.DataFrame) -> list[list[int]]:
    """Each history row's ``pooled_solved``."""
    return [[int(v) for v in flags] for flags in history["pooled_solved"]]


def empty_history() -> pd.DataFrame:
    """History before the first visit."""
    columns = ("prompt_id", "pass_rates", "last_step", "pooled_solved", "visit_rollouts")  # objects, but last_step
    dtypes = {**dict.fromkeys(columns, object), "last_step": np.int64, **POSTERIOR_DTYPES}
    return pd.DataFrame({c: pd.Series([], dtype=t) for c, t in dtypes.items()})
