"""Stage functions of one training step (the pipeline layer): read input tables, call the math or a backend,
write the output table. Plain functions, testable without Prefect; the flow wraps them as tasks.

Per step t (docs/design.md, "One training step"):

    budget     capability(t-1) + history(t-1) + batch(t) -> steps/t/budget.parquet
    rollouts   budget(t) + policy            -> steps/t/rollouts.parquet
    rewards    rollouts(t) + ground truths    -> steps/t/rewards.parquet
    capability rewards(t) + capability(t-1)   -> steps/t/capability.parquet (+ history.parquet)
    update     rollouts(t) + rewards(t)       -> steps/t/update.parquet + checkpoints/t+1/

The allocation of step t uses only what is known at its start. Seeds derive from
(run seed, step, prompt id); the capability tracker's state travels in capability.parquet, so
every output is a function of its inputs and the config.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
import torch

from coba_tasks.core.allocation import Allocation, Strategy, plan_allocation
from coba_tasks.core.capability import CapabilityTracker
from coba_tasks.core.estimators import Estimator
from coba_tasks.core.grpo import (
    RewardScaleError,
    group_advantages,
    reward_scale_message,
    unbounded_rewards,
    zero_variance_share,
)
from coba_tasks.core.knapsack import pooled_estimate
from coba_tasks.engines.rollout import RolloutBackend, RolloutRequest, SamplingConfig, rollout_seed
from coba_tasks.engines.verify import VerdictKind, count_verdicts
from coba_tasks.pipeline.prompt_history import batch_estimates, pass_rates, pooled_flags

# ---------------------------------------------------------------------------------------------
# Batches: which prompts a step visits (an epoch is one pass over the shuffled dataset)
# ---------------------------------------------------------------------------------------------


def batch_for_step(prompt_ids: Sequence[str], step: int, batch_size: int, seed: int, shuffle: bool = True) -> list[str]:
    """The ``batch_size`` distinct prompt ids of ``step``: slices of per-epoch permutations.

    Epoch e's order is a permutation seeded by (seed, e); step t reads from position t * M of their
    concatenation. A batch that straddles two epochs skips ids it already holds (a prompt is never
    twice in one batch: its group would merge), so it may read a little past its slice.
    """
    n = len(prompt_ids)
    if batch_size > n:
        raise ValueError(f"prompts per step ({batch_size}) exceed the training pool ({n} prompts)")
    out: list[str] = []
    chosen: set[str] = set()
    pos = step * batch_size
    order, order_epoch = None, -1
    while len(out) < batch_size:
        epoch, offset = divmod(pos, n)
        if epoch != order_epoch:
            order = np.random.default_rng([seed, epoch]).permutation(n) if shuffle else np.arange(n)
            order_epoch = epoch
        pid = prompt_ids[int(order[offset])]
        if pid not in chosen:
            chosen.add(pid)
            out.append(pid)
        pos += 1
    return out


# ---------------------------------------------------------------------------------------------
# Rollout generation
# ---------------------------------------------------------------------------------------------


def rollout_table(
    budget: pd.DataFrame,
    prompts: pd.DataFrame,
    engine: RolloutBackend,
    sampling: SamplingConfig,
    run_seed: int,
    step: int,
    wave: int = 0,
) -> pd.DataFrame:
    """Generate ``budget.budget`` completions per prompt; one row per completion.

    ``prompts`` holds each prompt's ``prompt_token_ids`` (``coba_tasks.pipeline.data_prompts.render_prompts``): the
    engine receives those ids, the same the update trains on. Column ``logprobs`` is the sampler's
    log-probability of each completion token. ``wave``: which wave of the step's groups this is (its seeds,
    ``rollout_seed``; 1 is the second wave after a pilot, ``coba_tasks.pipeline.pilot``).
    """
    return rollout_tables([(budget, sampling)], prompts, engine, run_seed, step, wave=wave)[0]


def rollout_tables(
    batches: list[tuple[pd.DataFrame, SamplingConfig]],
    prompts: pd.DataFrame,
    engine: RolloutBackend,
    run_seed: int,
    step: int,
    progress: bool = False,
    wave: int = 0,
) -> list[pd.DataFrame]:
    """``rollout_table`` of each (budget, sampling) batch, generated in one engine call where the backend can
    (``generate_many``, with its progress bar when ``progress``): a sampled and a greedy evaluation share
    the engine's batches."""
    by_id = prompts.set_index("prompt_id")
    ids, text = by_id["prompt_token_ids"], by_id["prompt_rendered"]

    def requests(budget: pd.DataFrame) -> list[RolloutRequest]:
        return [
            RolloutRequest(
                prompt_id=pid,
                prompt_token_ids=tuple(ids[pid]),
                n=int(b),
                seed=rollout_seed(run_seed, step, pid, wave),
                prompt=text[pid],
            )
            for pid, b in zip(budget["prompt_id"], budget["budget"], strict=True)
        ]

    generated = engine.generate_many([(requests(budget), sampling) for budget, sampling in batches], progress)
    return [_rows_table(rows) for rows in generated]


def _rows_table(rows: list[Any]) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "prompt_id": [r.prompt_id for r in rows],
            "sample_idx": np.array([r.sample_idx for r in rows], dtype=np.int64),
            "completion": [r.completion for r in rows],
            "token_ids": [list(r.token_ids) for r in rows],
            "n_tokens": np.array([r.n_tokens for r in rows], dtype=np.int64),
            "finish_reason": [r.finish_reason for r in rows],
            "seed": np.array([r.seed for r in rows], dtype=np.int64),
            "weight_version": np.array([r.weight_version for r in rows], dtype=np.int64),
            "logprobs": [list(r.logprobs) for r in rows],
        }
    )


# ---------------------------------------------------------------------------------------------
# Verification
# ---------------------------------------------------------------------------------------------


REWARD_COLUMNS = ("prompt_id", "sample_idx", "reward", "verdict", "extracted_answer", "detail")


def reward_table(rollouts: pd.DataFrame, prompts: pd.DataFrame, pool: Any) -> pd.DataFrame:
    """Score every completion with the verifier of its prompt's data_source, or the run's reward file (in
    worker processes). ``detail`` says why an item is ``error`` or ``timeout``; the extra keys a reward
    file's dict returns follow as columns (``extra_columns``)."""
    meta = prompts.set_index("prompt_id")
    rows = meta.loc[rollouts["prompt_id"]]
    truth, source = rows["ground_truth"].tolist(), rows["data_source"].tolist()
    items: list[tuple[Any, ...]] = list(zip(rollouts["completion"].tolist(), truth, source, strict=True))
    if getattr(pool, "reward_function", None) is not None:  # the reward file's extra_info argument
        extra = [json.loads(x) for x in rows["extra_info"]] if "extra_info" in rows else [{}] * len(items)
        items = [(*item, x) for item, x in zip(items, extra, strict=True)]
    verdicts = pool.score(items)
    table = pd.DataFrame(
        {
            "prompt_id": rollouts["prompt_id"].tolist(),
            "sample_idx": rollouts["sample_idx"].to_numpy(),
            "reward": np.array([v.reward for v in verdicts], dtype=np.float64),
            "verdict": [str(v.verdict) for v in verdicts],
            "extracted_answer": [v.extracted_answer for v in verdicts],
            "detail": [v.detail for v in verdicts],
        }
    )
    for name, values in extra_columns([dict(v.extra) for v in verdicts]).items():
        table[name] = values
    return table


def extra_columns(extras: Sequence[dict[str, Any]]) -> dict[str, pd.Series]:
    """The extra keys of a reward file's dicts as columns, one value per row (null where a row lacks the
    key). A column of bools stays bool, one of numbers float64; any other mix is written as text. A key
    named like a column of the rewards table gets the prefix ``extra_``, as many times as it takes to name no
    other column (a key ``reward`` beside a key ``extra_reward``: ``extra_extra_reward``).

    >>> cols = extra_columns([{"acc": True, "pred": "4"}, {"acc": False, "pred": 4}])
    >>> cols["acc"].tolist(), cols["pred"].tolist()
    ([True, False], ['4', '4'])
    >>> list(extra_columns([{"reward": 1, "extra_reward": 2}]))
    ['extra_extra_reward', 'extra_reward']
    """
    keys = list(dict.fromkeys(k for x in extras for k in x))
    taken = set(REWARD_COLUMNS) | set(keys)
    names: dict[str, str] = {}
    for key in keys:
        name = key
        while name in REWARD_COLUMNS or (name != key and name in taken):
            name = f"extra_{name}"
        taken.add(name)
        names[key] = name
    out: dict[str, pd.Series] = {}
    for key in keys:
        values = [x.get(key) for x in extras]
        present = [v for v in values if v is not None]
        if present and all(isinstance(v, bool) for v in present):
            column = pd.Series(values, dtype="boolean")
        elif present and all(isinstance(v, int | float) and not isinstance(v, bool) for v in present):
            column = pd.Series([np.nan if v is None else float(v) for v in values], dtype=np.float64)
        else:
            column = pd.Series([None if v is None else str(v) for v in values], dtype=object)
        out[names[key]] = column
    return out


class ScoringError(ValueError):
    """Too many of a step's completions could not be scored (``check_error_share``); one line."""


def check_error_share(rewards: pd.DataFrame, where: str, max_share: float) -> None:
    """Stop the run when the share of ``error`` and ``timeout`` verdicts of ``rewards`` (``where``: ``step 3``,
    ``held-out evaluation at step 3 (test)``) is above ``max_share`` (``verify.max_error_share``): such
    scores say nothing of the policy (a reward file that raises on every call, a verifier that times out),
    yet their zero rewards would be read as pass rates of 0, moving the budget, or as an accuracy of 0. The
    rewards and eval stages call this before their table is written, so the stage is computed again when the
    run continues. The message names where, the share, the first error's ``detail`` (the first timeout's
    when nothing raised) and the key."""
    verdicts = rewards["verdict"].astype(str)
    failed = verdicts.isin([str(VerdictKind.ERROR), str(VerdictKind.TIMEOUT)])
    if verdicts.empty or not failed.mean() > max_share:
        return
    kind = str(VerdictKind.ERROR) if (verdicts == str(VerdictKind.ERROR)).any() else str(VerdictKind.TIMEOUT)
    detail = rewards["detail"][verdicts == kind].iloc[0] or "(no detail)"
    raise ScoringError(
        f"{where}: {int(failed.sum())} of {len(verdicts)} completions scored error or timeout "
        f"({failed.mean():.0%}), above verify.max_error_share = {max_share:g}; the first {kind}: {detail}; fix "
        "the reward file or verifier and continue the run (`coba resume`, with --allow-changed-inputs after "
        "editing a reward file), or set verify.max_error_share higher (1 = never stop) for a new run"
    )


# ---------------------------------------------------------------------------------------------
# Failure-rate update
# ---------------------------------------------------------------------------------------------


def capability_table(
    step: int, rewards: pd.DataFrame, previous: CapabilityTracker
) -> tuple[pd.DataFrame, CapabilityTracker]:
    """Fold the step's pass rates into the tracker; one row of figures (tracker state as JSON)."""
    tracker = CapabilityTracker.from_dict(previous.to_dict())
    alpha_used, beta_used = tracker.alpha, tracker.beta
    rates = pass_rates(rewards)
    tracker.update(rates.to_numpy())
    group_ids = torch.as_tensor(pd.factorize(rewards["prompt_id"])[0])
    counts = count_verdicts(rewards["verdict"])
    row = {
        "step": step,
        "S": float(rates.mean()),
        "F": tracker.failure_rate,
        "Fbar": tracker.failure_rate_avg,
        "Ftil": tracker.failure_rate_transformed,
        "alpha_used": alpha_used,
        "beta_used": beta_used,
        "alpha": tracker.alpha,
        "beta": tracker.beta,
        "prompts": int(rates.size),
        "rollouts": len(rewards),
        "zero_variance_groups": zero_variance_share(
            torch.tensor(rewards["reward"].to_numpy(dtype=np.float64)), group_ids
        ),
        **{f"verdict_{k}": v for k, v in counts.items()},
        "tracker_state": json.dumps(tracker.to_dict()),
    }
    return pd.DataFrame([row]), tracker


def tracker_from_capability(capability: pd.DataFrame) -> CapabilityTracker:
    """The tracker as it was at the end of the step that wrote ``capability``."""
    return CapabilityTracker.from_dict(json.loads(capability["tracker_state"].iloc[0]))


# ---------------------------------------------------------------------------------------------
# Allocation (the step's batch, at its start)
# ---------------------------------------------------------------------------------------------


def schedule_shape(tracker: CapabilityTracker, alloc: Any) -> tuple[float, float]:
    """(alpha, beta) of the Beta density for the next allocation.

    ``adaptive`` (the method): from the failure rate. The paper's ablations:
    ``reversed`` swaps them (Beta(beta, alpha) peaks at 1 - Ftil: explore first, exploit later) and
    ``fixed`` uses ``fixed_alpha`` and ``fixed_beta`` at every step.
    """
    schedule = getattr(alloc, "schedule", "adaptive")
    if schedule == "reversed":
        return tracker.beta, tracker.alpha
    if schedule == "fixed":
        return float(alloc.fixed_alpha), float(alloc.fixed_beta)
    return tracker.alpha, tracker.beta


def section_allocation(est: np.ndarray, alloc: Any, alpha: float, beta: float) -> Allocation:
    """The allocation of a batch with pass rates ``est`` (NaN: never seen) and shape (alpha, beta) under the
    config's ``allocation`` section: B_total = len(est) * group_size, its bounds, strategy, tau, mode and solver."""
    return plan_allocation(
        est,
        len(est) * alloc.group_size,
        strategy=alloc.strategy,
        min_budget=alloc.min_budget,
        max_budget=alloc.max_budget,
        alpha=alpha,
        beta=beta,
        tau=alloc.tau,
        mode=alloc.mode,
        solver=alloc.solver,
    )


def budget_table(
    batch: Sequence[str],
    history: pd.DataFrame,
    tracker: CapabilityTracker,
    alloc: Any,
    pilot: pd.DataFrame | None = None,
    step: int | None = None,
) -> pd.DataFrame:
    """Budgets for ``batch`` from each prompt's estimate and (alpha, beta), with the allocation's inputs:
    ``estimator``, the estimate (``pass_rate_est``, NaN: none) and ``estimate_rollouts``, the rollouts it rests
    on (``coba_tasks.pipeline.prompt_history.batch_estimates``), and ``pilot_rollouts``.

    Under ``knapsack`` the estimate is Knapsack-RL's own: the mean of the prompt's ``pooled_solved`` flags,
    NaN (no estimate) with fewer than 8 (``pooled_estimate``), resting on those flags. Under the ``pilot``
    estimator ``pilot`` is the step's pilot rewards: the estimates are the posterior after them, and the
    budgets, step total B_total and bounds [B_low, B_up] as always, count the pilot's rollouts (every budget
    is at least B_low >= k, its second wave the rest). ``estimate_age``: ``step`` (the step the budget is for;
    None: the history's newest visit + 1) minus the visit the estimate's newest rollouts come from: 0 under
    ``pilot`` (this step's), NaN where there is no estimate (``estimate_ages``)."""
    estimator = getattr(alloc, "estimator", Estimator.LAST.value)
    if alloc.strategy == Strategy.KNAPSACK.value:
        flags = dict(zip(history["prompt_id"], pooled_flags(history), strict=True))
        est = np.array([pooled_estimate(flags.get(pid, [])) for pid in batch], dtype=np.float64)
        rests = np.array([len(flags.get(pid, [])) for pid in batch], dtype=np.float64)
        rests[np.isnan(est)] = 0.0
    else:
        est, rests = batch_estimates(batch, history, alloc, pilot)
    alpha, beta = schedule_shape(tracker, alloc)
    plan = section_allocation(est, alloc, alpha, beta)
    k = int(alloc.pilot_rollouts) if estimator == Estimator.PILOT else 0
    if (plan.budgets < k).any():  # the config refuses it (pilot_rollouts <= min_budget); never a negative wave
        raise ValueError(
            f"a budget of {int(plan.budgets.min())} is below the pilot's {k} rollouts; allocation.pilot_rollouts "
            "must be <= allocation.min_budget"
        )
    ages = estimate_ages(batch, est, history, step) if pilot is None else np.where(np.isnan(est), np.nan, 0.0)
    return pd.DataFrame(
        {
            "prompt_id": list(batch),
            "pass_rate_est": est,
            "estimate_age": ages,
            "budget": plan.budgets,
            "value": plan.values,
            "marginal_gain": plan.marginal_gains,
            "group": [str(g) for g in plan.groups],
            "alpha": plan.alpha,
            "beta": plan.beta,
            "tau": plan.tau,
            "strategy": alloc.strategy,
            "fallback": plan.fallback,
            "estimator": estimator,
            "estimate_rollouts": rests,
            "pilot_rollouts": np.full(len(batch), k, dtype=np.int64),
        }
    )


def estimate_ages(batch: Sequence[str], est: np.ndarray, history: pd.DataFrame, step: int | None) -> np.ndarray:
    """Per prompt of ``batch``: how many steps before ``step`` its last visit was (the newest visit its estimate
    ``est`` holds), NaN without an estimate; ``step`` None: the step after the history's newest visit.

    >>> h = pd.DataFrame({"prompt_id": ["a", "b"], "last_step": [4, 2]})
    >>> estimate_ages(["a", "b", "c"], np.array([0.5, np.nan, np.nan]), h, None).tolist()
    [1.0, nan, nan]
    """
    last = dict(zip(history["prompt_id"], history["last_step"], strict=True))
    now = step if step is not None else (int(history["last_step"].max()) + 1 if len(history) else 0)
    ages = [now - last[p] if p in last and np.isfinite(e) else np.nan for p, e in zip(batch, est, strict=True)]
    return np.array(ages, dtype=np.float64)


# ---------------------------------------------------------------------------------------------
# GRPO update
# ---------------------------------------------------------------------------------------------


def advantages_for(rollouts: pd.DataFrame, rewards: pd.DataFrame) -> np.ndarray:
    """GRPO advantages aligned with ``rollouts`` rows, grouped by prompt id (groups of any size >= 2); a reward
    that is not finite or beyond +/- ``REWARD_BOUND`` is refused (``RewardScaleError`` naming the prompt)."""
    merged = rollouts[["prompt_id", "sample_idx"]].merge(rewards, on=["prompt_id", "sample_idx"], how="left")
    if merged["reward"].isna().any():
        raise ValueError("rewards do not cover every rollout (prompt_id, sample_idx)")
    ids = torch.as_tensor(pd.factorize(merged["prompt_id"])[0])
    reward = torch.tensor(merged["reward"].to_numpy(dtype=np.float64))
    bad = unbounded_rewards(reward)  # refused naming the prompt (group_advantages knows only group numbers)
    if bad.numel():
        row = merged.iloc[int(bad[0])]
        where = f"prompt {row['prompt_id']} (sample {row['sample_idx']})"
        raise RewardScaleError(reward_scale_message(where, float(row["reward"])))
    return group_advantages(reward, ids).numpy()


def update_sequences(
    rollouts: pd.DataFrame, prompts: pd.DataFrame
) -> tuple[list[list[int]], list[list[int]], list[list[float]] | None]:
    """What the update trains on, one entry per rollout row: the prompt's token ids (the very ids the
    engine received), the completion's token ids, and the sampler's log p of each completion token."""
    ids = prompts.set_index("prompt_id")["prompt_token_ids"]
    prompt_ids = [list(ids[p]) for p in rollouts["prompt_id"]]
    completion_ids = [list(t) for t in rollouts["token_ids"]]
    logprobs = [list(x) for x in rollouts["logprobs"]]
    return prompt_ids, completion_ids, logprobs


def update_row(step: int, metrics: dict[str, float], rollouts: pd.DataFrame, rewards: pd.DataFrame) -> pd.DataFrame:
    """update.parquet: the update's metrics and the share of groups with zero reward variance."""
    ids = torch.as_tensor(pd.factorize(rewards["prompt_id"])[0])
    zero = zero_variance_share(torch.tensor(rewards["reward"].to_numpy(dtype=np.float64)), ids)
    return pd.DataFrame([{"step": step, **metrics, "zero_variance_groups": zero, "rollouts": len(rollouts)}])
