"""One training step: each stage as a pure function over tables (testable without Prefect) and as a Prefect
task over the run directory (docs/design.md, "One training step, stage by stage": the stages, in the order
``store.step_stages`` gives, what each reads and writes, the rounds of a step sampled in rounds, and what
``@stage`` adds).

A task takes the run directory and the step, never models or tables (the engine, verifier pool and policy
are found by directory: ``run.resources``). The update is the policy's (``coba_tasks.pipeline.policy``: which
weights, which checkpoints); it is not retried by Prefect: it moves the weights, and a resume recomputes it from
the last checkpoint.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pandas as pd
import torch
from prefect import Task, task
from prefect.cache_policies import NO_CACHE
from prefect.states import Completed, State

from coba_tasks.core.allocation import IN_ROUNDS, Allocation, Strategy, plan_allocation
from coba_tasks.core.capability import CapabilityTracker, Estimator
from coba_tasks.core.grpo import (
    RewardScaleError,
    zero_variance_share,
)
from coba_tasks.core.knapsack import pooled_estimate
from coba_tasks.engines.rollout import RolloutBackend, RolloutRequest, SamplingConfig, rollout_seed
from coba_tasks.engines.update import NonFiniteUpdateError
from coba_tasks.engines.verify import VerdictKind, count_verdicts
from coba_tasks.pipeline import prompt_history
from coba_tasks.pipeline.config import Config
from coba_tasks.pipeline.config_sections import AllocationConfig
from coba_tasks.pipeline.prompt_history import batch_estimates, pass_rates, pooled_flags
from coba_tasks.pipeline.rounds import (
    ROUND,
    USED,
    ada_next,
    ada_used,
    dynamic_next,
    dynamic_used,
    gen_batch_size,
)
from coba_tasks.pipeline.run import RunResources, resources
from coba_tasks.pipeline.store import StoreError, Table, step_stages

logger = logging.getLogger(__name__)


def batch_for_step(prompt_ids: Sequence[str], step: int, batch_size: int, seed: int, shuffle: bool = True) -> list[str]:
    """The ``batch_size`` distinct prompt ids of ``step``: from position step * batch_size of the concatenated
    per-epoch permutations (epoch e's seeded by (seed, e)). A batch straddling two epochs skips ids it holds
    already (a prompt twice would merge its groups), so it may read a little past its slice."""
    n = len(prompt_ids)
    if batch_size > n:
        raise ValueError(f"prompts per step ({batch_size}) exceed the training pool ({n} prompts)")
    out: list[str] = []
    chosen: set[str] = set()
    pos = step * batch_size
    order, order_epoch = np.arange(0), -1  # the epoch's permutation, drawn on the first pass
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


# --- Rollout generation


def rollout_table(
    budget: pd.DataFrame,
    prompts: pd.DataFrame,
    engine: RolloutBackend,
    sampling: SamplingConfig,
    run_seed: int,
    step: int,
    wave: int = 0,
) -> pd.DataFrame:
    """``budget.budget`` completions per prompt, one row each, sampled from each prompt's ``prompt_token_ids``
    (the ids the update trains on); ``logprobs`` is the sampler's. ``wave``: the round ``r`` of a step sampled in rounds
    (its seeds, ``rollout_seed``)."""
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
    """``rollout_table`` of each (budget, sampling) batch, in one engine call where the backend can
    (``generate_many``): a sampled and a greedy evaluation share the engine's batches."""
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


# --- Verification


REWARD_COLUMNS = ("prompt_id", "sample_idx", "reward", "verdict", "extracted_answer", "detail")


def reward_table(rollouts: pd.DataFrame, prompts: pd.DataFrame, pool: Any) -> pd.DataFrame:
    """Score every completion with its data_source's verifier, or the run's reward file; the extra keys of a
    reward file's dict follow as columns (``extra_columns``)."""
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
    out: dict[str, pd.Series] = {}
    for key in keys:
        name = key
        while name in REWARD_COLUMNS or (name != key and name in taken):
            name = f"extra_{name}"
        taken.add(name)
        values = [x.get(key) for x in extras]
        present = [v for v in values if v is not None]
        if present and all(isinstance(v, bool) for v in present):
            column = pd.Series(values, dtype="boolean")
        elif present and all(isinstance(v, int | float) and not isinstance(v, bool) for v in present):
            column = pd.Series([np.nan if v is None else float(v) for v in values], dtype=np.float64)
        else:
            column = pd.Series([None if v is None else str(v) for v in values], dtype=object)
        out[name] = column
    return out


class ScoringError(ValueError):
    """Too many of a step's completions could not be scored (``check_error_share``); one line."""


def check_error_share(rewards: pd.DataFrame, where: str, max_share: float) -> None:
    """ScoringError when the share of ``error`` and ``timeout`` verdicts is above ``max_share``
    (``verify.max_error_share``): their zero rewards would read as pass rates or an accuracy of 0. Called
    before a table is written, so the stage is computed again when the run continues. ``where``: ``step 3``,
    ``held-out evaluation at step 3 (test)``; the message shows the first error's detail (else the first
    timeout's)."""
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


# --- Failure-rate update


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


# --- Allocation (the step's batch, at its start)


def schedule_shape(tracker: CapabilityTracker, alloc: AllocationConfig) -> tuple[float, float]:
    """(alpha, beta) of the next allocation: the tracker's (``adaptive``), swapped (``reversed``: Beta(beta,
    alpha) peaks at 1 - Ftil, explore first) or ``fixed_alpha``, ``fixed_beta`` (``fixed``)."""
    schedule = alloc.schedule
    if schedule == "reversed":
        return tracker.beta, tracker.alpha
    if schedule == "fixed":
        return float(alloc.fixed_alpha), float(alloc.fixed_beta)
    return tracker.alpha, tracker.beta


def section_allocation(est: np.ndarray, alloc: AllocationConfig, alpha: float, beta: float) -> Allocation:
    """The allocation of a batch with pass rates ``est`` (NaN: never seen) under the ``allocation`` section; a
    strategy sampled in rounds gives each prompt of its first round ``rollouts_per_prompt`` (uniform)."""
    if alloc.strategy in IN_ROUNDS:
        m, nan = len(est), np.full(len(est), np.nan)
        budgets = np.full(m, alloc.rollouts_per_prompt, dtype=np.int64)
        groups = np.array(["all"] * m, dtype=object)
        return Allocation(budgets, est, nan, nan, groups, alloc.strategy, alloc.mode, "", alpha, beta, float("nan"))
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
    alloc: AllocationConfig,
    pilot: pd.DataFrame | None = None,
    step: int | None = None,
) -> pd.DataFrame:
    """budget.parquet for ``batch`` (its columns: docs/design.md, "Step tables"). Under ``knapsack`` the estimate
    is Knapsack-RL's (``pooled_estimate`` of the ``pooled_solved`` flags: NaN with fewer than 8); else
    ``batch_estimates``. ``pilot``: the step's pilot rewards under the ``pilot`` estimator; the budgets count
    the pilot's rollouts. ``step``: the step the budget is for (None: the history's newest visit + 1)."""
    estimator = alloc.estimator
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
    """Per prompt of ``batch``: steps from its last visit to ``step`` (None: the step after the history's newest
    visit), NaN where ``est`` has no estimate.

    >>> h = pd.DataFrame({"prompt_id": ["a", "b"], "last_step": [4, 2]})
    >>> estimate_ages(["a", "b", "c"], np.array([0.5, np.nan, np.nan]), h, None).tolist()
    [1.0, nan, nan]
    """
    last = dict(zip(history["prompt_id"], history["last_step"], strict=True))
    now = step if step is not None else (int(history["last_step"].max()) + 1 if len(history) else 0)
    ages = [now - last[p] if p in last and np.isfinite(e) else np.nan for p, e in zip(batch, est, strict=True)]
    return np.array(ages, dtype=np.float64)


KEY = ["prompt_id", "sample_idx"]


def pilot_budget(batch: Sequence[str], k: int) -> pd.DataFrame:
    """The pilot's request (allocation.estimator = pilot, round 0 of its step): ``k`` rollouts for each prompt of
    ``batch``."""
    if k < 1:
        raise ValueError(f"the pilot needs at least one rollout per prompt, got k={k}")
    return pd.DataFrame({"prompt_id": list(batch), "budget": np.full(len(batch), k, dtype=np.int64)})


def second_round_budget(budget: pd.DataFrame, k: int) -> pd.DataFrame:
    """The pilot's second round: each prompt's ``budget`` less the pilot's ``k``, the prompts with more to sample
    (in budget order).

    >>> second_round_budget(pd.DataFrame({"prompt_id": ["a", "b"], "budget": [2, 5]}), 2)
    ... # doctest: +NORMALIZE_WHITESPACE
      prompt_id  budget
    1         b       3
    """
    rest = budget[["prompt_id"]].assign(budget=budget["budget"].to_numpy(dtype=np.int64) - k)
    if (rest["budget"] < 0).any():
        raise ValueError("a budget below its prompt's pilot rollouts")
    return rest[rest["budget"] > 0]


def in_budget_order(rows: pd.DataFrame, budget: pd.DataFrame) -> pd.DataFrame:
    """``rows`` (a pilot step's rounds) by prompt in ``budget`` order, then ``sample_idx``: each group together,
    its pilot first."""
    order = {pid: i for i, pid in enumerate(budget["prompt_id"])}
    keyed = rows.assign(_order=rows["prompt_id"].map(order))
    if keyed["_order"].isna().any():
        raise ValueError("the pilot's prompts are not the budget's")
    return keyed.sort_values(["_order", "sample_idx"], kind="stable").drop(columns="_order").reset_index(drop=True)


# --- The stages as Prefect tasks over the run directory

StageBody = Callable[..., pd.DataFrame]  # (res, step) -> table; a round's stage (res, step, r) -> table


def stage(
    table: Table,
    retries: int = 1,
    then: Callable[[RunResources, int], None] | None = None,
    rounds: bool = False,
) -> Callable[[StageBody], Task[..., State]]:
    """A stage body ``(res, step) -> table`` as the Prefect task ``(run_dir, step) -> Completed state`` named
    ``table`` (runs ``<table>-step-<step>``): the body skipped when the table is done, else the fault hooks and
    the write; then ``then(res, step)``, done or not; timed. The state's data is the table's path, its message
    says whether the table was written now or was already done (a resume, a retry: shown in the Prefect UI).
    ``rounds``: a stage of each round of a step sampled in rounds, ``(res, step, r) -> table`` as the task
    ``(run_dir, step, r)`` (runs ``<table>-step-<step>-round-<r>``), skipped when its table holds round ``r``
    (the table holds every round so far: written again with each)."""

    def make(body: StageBody) -> Task[..., State]:
        def run_stage(run_dir: str, step: int, r: int = 0) -> State:
            res, t0 = resources(run_dir), time.perf_counter()
            path = res.store.table_path(step, table)
            shown = path.relative_to(res.store.root).as_posix()
            if round_done(res.store, step, table, r) if rounds else res.store.is_done(step, table):
                message = f"already done: {shown} is in the step's manifest, not computed again"
            else:
                frame = body(res, step, r) if rounds else body(res, step)
                res.faults.at(step, f"{table.value}.{r}" if rounds else table.value)
                res.store.write_table(step, table, frame)
                message = f"wrote {shown} ({len(frame)} rows)"
            if then is not None:
                then(res, step)
            res.timed(table, time.perf_counter() - t0)
            return Completed(message=message, data=str(path))

        run_stage.__name__ = run_stage.__qualname__ = body.__name__
        run_stage.__doc__, run_stage.__module__ = body.__doc__, body.__module__
        name = f"{table.value}-step-{{step}}" + ("-round-{r}" if rounds else "")
        options = task(
            name=table.value,
            task_run_name=name,
            retries=retries,
            retry_delay_seconds=2,
            cache_policy=NO_CACHE,
            persist_result=False,
        )
        return options(run_stage)

    return make


def round_done(store: Any, step: int, table: Table, r: int) -> bool:
    """Whether ``table`` (``round`` or ``round_rewards``) of ``step`` holds round ``r``."""
    return store.is_done(step, table) and int(store.read_table(step, table, columns=(ROUND,))[ROUND].max()) >= r


# --- The stages (their order: ``store.step_stages``)


@stage(Table.BUDGET)
def budget(res: RunResources, step: int) -> pd.DataFrame:
    """The allocation of step t from the history and the Beta shape after step t - 1 (uniform at step 0), and
    under ``allocation.estimator = pilot`` the step's pilot (its round 0; every budget holds its k). Under a
    strategy sampled in rounds: its first round's prompts, each ``rollouts_per_prompt`` (dynamic: with
    ``gen_batch``, the index of the step's first generation batch among the run's)."""
    history = res.store.read_table(step - 1, Table.HISTORY) if step > 0 else prompt_history.empty_history()
    scored = rounds_before(res, step, Table.ROUND_REWARDS, 1) if res.cfg.allocation.piloted else None
    table = budget_for(res, step, history, tracker_before(res, step), pilot=scored)
    if res.cfg.allocation.strategy == Strategy.DYNAMIC:
        table["gen_batch"] = np.int64(first_gen_batch(res, step))
    return table


@stage(Table.ROUND, rounds=True)
def round_rollouts(res: RunResources, step: int, r: int) -> pd.DataFrame:
    """Round ``r`` of a step sampled in rounds, after the rounds before it: its prompts (``round_plan``), each
    sampled with the round's seeds (``rollout_seed``'s wave ``r``), numbered on after the prompt's earlier rows."""
    before = rounds_before(res, step, Table.ROUND, r)
    plan, seed = round_plan(res, step, r), res.cfg.run.seed
    fresh = rollout_table(plan, res.prompts, res.engine, sampling(res.cfg), seed, step, wave=r)
    if before is not None:
        earlier = before.groupby("prompt_id").size().reindex(fresh["prompt_id"]).fillna(0)
        fresh["sample_idx"] += earlier.to_numpy(dtype=np.int64)
    fresh[ROUND] = np.int64(r)
    return fresh if before is None else pd.concat([before, fresh], ignore_index=True)


@stage(Table.ROUND_REWARDS, rounds=True)
def round_rewards(res: RunResources, step: int, r: int) -> pd.DataFrame:
    """Round ``r``'s rollouts scored, after the rounds before it (a round with too many errors or timeouts stops
    the run)."""
    rows = res.store.read_table(step, Table.ROUND)
    scored = reward_table(rows[rows[ROUND] == r], res.prompts, res.pool)
    scored[ROUND] = np.int64(r)
    check_error_share(scored, f"step {step}, round {r}", res.cfg.verify.max_error_share)
    before = rounds_before(res, step, Table.ROUND_REWARDS, r)
    return scored if before is None else pd.concat([before, scored], ignore_index=True)


@stage(Table.ROLLOUTS)
def rollouts(res: RunResources, step: int) -> pd.DataFrame:
    """Sample each prompt of the step's budget table as many completions as its budget, with the rollout engine.
    Sampled in rounds: every round's rollouts; after a pilot each group together in budget order (the pilot's
    first), else in the order the rounds came, with whether the update trains on each (``used``:
    ``rounds.dynamic_used``, ``rounds.ada_used``)."""
    if res.cfg.allocation.sampling != "once":
        rows, scored = res.store.read_table(step, Table.ROUND), res.store.read_table(step, Table.ROUND_REWARDS)
        if not rows[KEY].equals(scored[KEY]):
            raise StoreError(f"step {step}: the round and round_rewards tables do not hold the same rows")
        if res.cfg.allocation.piloted:  # a pilot step trains on every rollout, in the groups of its budget
            return in_budget_order(rows, res.store.read_table(step, Table.BUDGET, columns=("prompt_id",)))
        return rows.assign(**{USED: used_rows(res, step, rows, scored)})
    budget = res.store.read_table(step, Table.BUDGET)
    return rollout_table(budget, res.prompts, res.engine, sampling(res.cfg), res.cfg.run.seed, step)


@stage(Table.REWARDS)
def rewards(res: RunResources, step: int) -> pd.DataFrame:
    """Score every completion with the verifier pool (sampled in rounds: its rounds' rewards as scored, in the rows'
    order of the step's rollouts); a step with too many errors or timeouts stops the run."""
    if res.cfg.allocation.sampling != "once":
        scored = res.store.read_table(step, Table.ROUND_REWARDS)
        if not res.cfg.allocation.piloted:
            return scored
        rolled = res.store.read_table(step, Table.ROLLOUTS, columns=tuple(KEY))
        return rolled.merge(scored, on=KEY, how="left", validate="one_to_one")
    table = reward_table(res.store.read_table(step, Table.ROLLOUTS), res.prompts, res.pool)
    check_error_share(table, f"step {step}", res.cfg.verify.max_error_share)  # before the table is written
    return table


@stage(Table.CAPABILITY)
def capability(res: RunResources, step: int) -> pd.DataFrame:
    """Fold the step's pass rates into the failure rate and the Beta shape; write the prompt history beside it."""
    table, history = capability_and_history(res, step)
    res.store.write_table(step, Table.HISTORY, history)
    res.store.write_run_table("history", history)
    return table


def _hand_over(res: RunResources, step: int) -> None:
    res.policy.hand_over(step)  # the engine takes the weights after the update (also when it was done before)


@stage(Table.UPDATE, retries=0, then=_hand_over)
def update(res: RunResources, step: int) -> pd.DataFrame:
    """The GRPO update on the step's rollouts (``Policy.update``); writes checkpoints/<step + 1> when due. A reward
    beyond the group statistics' bound or a non-finite update stops the run in one line naming the step (nothing
    stepped)."""
    try:
        return res.policy.update(step)
    except (RewardScaleError, NonFiniteUpdateError) as exc:
        raise type(exc)(f"step {step}: {exc}") from None


def step_tasks(res: RunResources, step: int) -> Iterator[tuple[Task[..., State], int]]:
    """The stage tasks of step ``step`` in the order ``store.step_stages`` gives, each with its timeout
    (``limited``) and its round (0 but in a step sampled in rounds); the round pair is given again while
    ``more_rounds`` asks for one, each time after the one before ran (a generator: the caller runs each task
    before asking for the next)."""
    tasks, r = stage_tasks(res.cfg), 0
    for name in step_stages(res.cfg.allocation.sampling):
        if name != Table.ROUND:
            if name == Table.ROUND_REWARDS:
                continue
            yield tasks[name], 0
        if name == Table.ROUND or (name == Table.BUDGET and r > 0):  # the rounds (a pilot's rest: after its budget)
            while more_rounds(res, step, r):
                yield tasks[Table.ROUND], r
                yield tasks[Table.ROUND_REWARDS], r
                r += 1


def stage_tasks(cfg: Config) -> dict[str, Task[..., State]]:
    """Every stage's task, by name, with the timeout ``cfg`` gives it (``limited``)."""
    every = (budget, round_rollouts, round_rewards, rollouts, rewards, capability, update)
    return {t.name: limited(t, cfg) for t in every}


def limited(stage_task: Task[[str, int], State], cfg: Config) -> Task[[str, int], State]:
    """``stage_task`` with the wall-clock limit the config gives its stage (``run.rollouts_timeout_s`` for a
    round and the rollouts, ``run.update_timeout_s``, ``run.eval_timeout_s``; 0: none, the task as it is)."""
    r = cfg.run
    limits = {
        Table.ROUND: r.rollouts_timeout_s,
        Table.ROLLOUTS: r.rollouts_timeout_s,
        Table.UPDATE: r.update_timeout_s,
        Table.EVAL: r.eval_timeout_s,
    }
    seconds = float(limits.get(Table(stage_task.name), 0))
    return stage_task.with_options(timeout_seconds=seconds) if seconds else stage_task


# --- What the stages share


def sampling(cfg: Config) -> SamplingConfig:
    """How training rollouts are sampled (the config's rollout section)."""
    r = cfg.rollout
    return SamplingConfig(temperature=r.temperature, top_p=r.top_p, max_tokens=r.max_tokens)


def tracker_before(res: RunResources, step: int) -> CapabilityTracker:
    """The capability tracker as it was when step ``step`` started."""
    if step == 0:
        a = res.cfg.allocation
        return CapabilityTracker(kappa=a.kappa, window=a.capability_window, gamma=a.gamma)
    return tracker_from_capability(res.store.read_table(step - 1, Table.CAPABILITY))


def capability_and_history(res: RunResources, step: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The capability and history tables of ``step``, from its rewards and the tables of ``step - 1``."""
    scored = res.store.read_table(step, Table.REWARDS)
    table, _ = capability_table(step, scored, tracker_before(res, step))
    # a per-step snapshot of history, so a stage rerun never counts a step twice
    previous = res.store.read_table(step - 1, Table.HISTORY) if step > 0 else prompt_history.empty_history()
    a = res.cfg.allocation
    return table, prompt_history.update_history(
        previous, scored, step, a.pass_rate_window, a.prior_strength, a.posterior_decay
    )


def batch_of(res: RunResources, step: int) -> list[str]:
    """The prompt ids of ``step``'s batch (dynamic: its first generation batch's)."""
    cfg = res.cfg
    if cfg.allocation.strategy == Strategy.DYNAMIC:
        return generation_batch(res, first_gen_batch(res, step))
    ids = res.prompts["prompt_id"].tolist()
    return batch_for_step(ids, step, cfg.data.prompts_per_step, cfg.run.seed, cfg.data.shuffle)


# --- A step sampled in rounds (``coba_tasks.pipeline.rounds`` decides; these read and write its tables)


def generation_batch(res: RunResources, index: int) -> list[str]:
    """dynamic: the prompts of the run's generation batch ``index`` (the pool's epochs cut into
    ``gen_batch_size`` prompts, as ``batch_for_step`` cuts a step's batch)."""
    cfg = res.cfg
    size = gen_batch_size(cfg.allocation, cfg.data.prompts_per_step)
    return batch_for_step(res.prompts["prompt_id"].tolist(), index, size, cfg.run.seed, cfg.data.shuffle)


def first_gen_batch(res: RunResources, step: int) -> int:
    """dynamic: the index of ``step``'s first generation batch: every generation batch of the steps before it (the
    budget of step - 1 holds its own first index; its rounds, how many it sampled)."""
    if step == 0:
        return 0
    before = int(res.store.read_table(step - 1, Table.BUDGET, columns=("gen_batch",))["gen_batch"].iloc[0])
    return before + int(res.store.read_table(step - 1, Table.ROUND, columns=(ROUND,))[ROUND].max()) + 1


def rounds_before(res: RunResources, step: int, table: Table, r: int) -> pd.DataFrame | None:
    """The rows of the rounds before ``r`` in ``table`` (``round`` or ``round_rewards``); None before round 1."""
    if r == 0 or not res.store.is_done(step, table):
        return None
    rows = res.store.read_table(step, table)
    return rows[rows[ROUND] < r].reset_index(drop=True)


def more_rounds(res: RunResources, step: int, r: int) -> bool:
    """Whether the step samples round ``r`` (round 0 always), from the rewards of the rounds before it (a pilot's
    round 1: once the budget allocated on its pilot is there, when a budget holds more than the pilot)."""
    if r == 0:
        return True
    alloc, m = res.cfg.allocation, res.cfg.data.prompts_per_step
    if alloc.piloted:
        if r > 1 or not res.store.is_done(step, Table.BUDGET):
            return False
        return not second_round_budget(res.store.read_table(step, Table.BUDGET), alloc.pilot_rollouts).empty
    scored = rounds_before(res, step, Table.ROUND_REWARDS, r)
    if alloc.strategy == Strategy.DYNAMIC:
        return dynamic_next(scored, alloc, m, len(res.prompts), step)
    return bool(ada_next(scored, batch_of(res, step), alloc))


def round_plan(res: RunResources, step: int, r: int) -> pd.DataFrame:
    """Round ``r``'s requests (prompt_id, budget): round 0 the budget table's (a pilot: ``pilot_rollouts`` of each
    prompt of the batch); then dynamic the step's next generation batch, ``group_size`` each; ada the prompts still
    in the rounds, ``round_repeat`` each; a pilot's round 1 the rest of each budget (``second_round_budget``)."""
    alloc = res.cfg.allocation
    if alloc.piloted:
        if r == 0:
            return pilot_budget(batch_of(res, step), alloc.pilot_rollouts)
        return second_round_budget(res.store.read_table(step, Table.BUDGET), alloc.pilot_rollouts)
    if r == 0:
        return res.store.read_table(step, Table.BUDGET, columns=("prompt_id", "budget"))
    if alloc.strategy == Strategy.DYNAMIC:
        index = int(res.store.read_table(step, Table.BUDGET, columns=("gen_batch",))["gen_batch"].iloc[0]) + r
        prompts = generation_batch(res, index)
    else:
        prompts = ada_next(rounds_before(res, step, Table.ROUND_REWARDS, r), batch_of(res, step), alloc)
    budgets = np.full(len(prompts), alloc.rollouts_per_prompt, dtype=np.int64)
    return pd.DataFrame({"prompt_id": prompts, "budget": budgets})


def used_rows(res: RunResources, step: int, rows: pd.DataFrame, scored: pd.DataFrame) -> np.ndarray:
    """Which of a step's rollouts (every round's, ``rows``, scored alike in ``scored``) the update trains on."""
    alloc = res.cfg.allocation
    if alloc.strategy == Strategy.DYNAMIC:
        return dynamic_used(rows, scored, alloc.filter_metric, res.cfg.data.prompts_per_step)
    return ada_used(scored, batch_of(res, step), alloc)


def budget_for(
    res: RunResources, step: int, history: pd.DataFrame, tracker: CapabilityTracker, pilot: pd.DataFrame | None = None
) -> pd.DataFrame:
    """budget.parquet of ``step`` (``budget_table`` of its batch)."""
    return budget_table(batch_of(res, step), history, tracker, res.cfg.allocation, pilot, step)


# --- What a step records of itself


def write_step_timing(res: RunResources, step: int, seconds_before: dict[str, float]) -> dict[str, float]:
    """Write and return steps/<step>/timing.json: wall seconds per stage of this step."""
    seconds = {k: v - seconds_before.get(k, 0.0) for k, v in res.stage_seconds.items() if k != Table.EVAL}
    res.store.write_step_json(step, "timing", seconds)
    return seconds
