"""How each stage of a training step runs in an open run: the stage recipes, ``run_stage``, the fault hooks.

Each stage is one recipe in ``RECIPES``: a function ``(res, step) -> table`` and its figures;
``run_stage`` wraps it with what every stage does: skip it when its table is in the step's manifest,
else compute, pass the fault hooks, write the table (atomically, recorded in the manifest) and add its
seconds to the run's timing. The budget stage of step t writes the budget of step t + 1; the update
stage writes the next checkpoint, and after it (done or not) the rollout engine is given that
checkpoint's weights.

``resume_point`` writes the first budget and starts an opened run's resources on the weights of its
first step not done; ``plain_step`` runs one whole step as plain calls (no Prefect). The run's
resources come from ``coba_tasks.pipeline.run`` (``resources(run_dir)``).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from coba_tasks.core.capability import CapabilityTracker
from coba_tasks.core.grpo import RewardScaleError
from coba_tasks.engines.engine_sleep import engine_asleep
from coba_tasks.engines.fsdp_update import fsdp_update
from coba_tasks.engines.rollout import SamplingConfig
from coba_tasks.engines.update_batch import NonFiniteUpdateError
from coba_tasks.engines.verify import count_verdicts
from coba_tasks.pipeline import stages
from coba_tasks.pipeline.config import Config
from coba_tasks.pipeline.run import (
    RunResources,
    checked_checkpoint,
    first_step_not_done,
    previous_checkpoint,
    resources,
    start_resources,
    update_settings,
)
from coba_tasks.pipeline.store import Stage, Table
from coba_tasks.pipeline.summary import eval_figures

ROLLOUT_WEIGHTS_DIR = "rollout_weights"  # LoRA: the merged policy the engine reads (one copy, rewritten)


def sampling(cfg: Config) -> SamplingConfig:
    """How training rollouts are sampled (the config's rollout section)."""
    r = cfg.rollout
    return SamplingConfig(temperature=r.temperature, top_p=r.top_p, max_tokens=r.max_tokens)


# ---------------------------------------------------------------------------------------------
# The stages of a step: (res, step) -> the stage's table


def tracker_before(res: RunResources, step: int) -> CapabilityTracker:
    """The capability tracker as it was when step ``step`` started."""
    if step == 0:
        a = res.cfg.allocation
        return CapabilityTracker(kappa=a.kappa, window=a.capability_window, gamma=a.gamma)
    return stages.tracker_from_capability(res.store.read_table(step - 1, Stage.CAPABILITY))


def _rollouts(res: RunResources, step: int) -> pd.DataFrame:
    budget = res.store.read_table(step, Stage.BUDGET)
    return stages.rollout_table(budget, res.prompts, res.engine, sampling(res.cfg), res.cfg.run.seed, step)


def _rewards(res: RunResources, step: int) -> pd.DataFrame:
    table = stages.reward_table(res.store.read_table(step, Stage.ROLLOUTS), res.prompts, res.pool)
    stages.check_error_share(table, step, res.cfg.verify.max_error_share)  # raises before the table is written
    return table


def _capability(res: RunResources, step: int) -> pd.DataFrame:
    rewards = res.store.read_table(step, Stage.REWARDS)
    table, _ = stages.capability_table(step, rewards, tracker_before(res, step))
    # history is a per-step snapshot (a pure function of the previous one and this step's rewards),
    # so a stage rerun never counts a step twice; history.parquet at the run root is the latest copy
    previous = res.store.read_table(step - 1, Table.HISTORY) if step > 0 else stages.empty_history()
    history = stages.update_history(previous, rewards, step, res.cfg.allocation.pass_rate_window)
    res.store.write_table(step, Table.HISTORY, history)
    res.store.write_run_table("history", history)
    return table


def budget_for(res: RunResources, step: int, history: pd.DataFrame, tracker: CapabilityTracker) -> pd.DataFrame:
    """budget.parquet of ``step``: its batch allocated from ``history`` and the tracker's (alpha, beta)."""
    cfg = res.cfg
    batch = stages.batch_for_step(
        res.prompts["prompt_id"].tolist(), step, cfg.data.prompts_per_step, cfg.run.seed, cfg.data.shuffle
    )
    return stages.budget_table(batch, history, tracker, cfg.allocation)


def _budget(res: RunResources, step: int) -> pd.DataFrame:
    """The allocation at the end of step t: the budget of step t + 1."""
    tracker = stages.tracker_from_capability(res.store.read_table(step, Stage.CAPABILITY))
    return budget_for(res, step + 1, res.store.read_table(step, Table.HISTORY), tracker)


def write_first_budget(res: RunResources) -> None:
    """The budget of step 0 (uniform: no pass rates yet), unless it is done."""
    if not res.store.is_done(0, Stage.BUDGET):
        res.store.write_table(0, Stage.BUDGET, budget_for(res, 0, stages.empty_history(), tracker_before(res, 0)))


def _update(res: RunResources, step: int) -> pd.DataFrame:
    """The GRPO update on the step's rollouts; writes checkpoints/<step + 1>."""
    ckpt = res.store.checkpoint_dir(step + 1)
    rollouts = res.store.read_table(step, Stage.ROLLOUTS)
    rewards = res.store.read_table(step, Stage.REWARDS)
    adv = stages.advantages_for(rollouts, rewards)
    prompt_ids, completion_ids, sampler_logprobs = stages.update_batch(rollouts, res.prompts)
    tracker = stages.tracker_from_capability(res.store.read_table(step, Stage.CAPABILITY))
    extra_state = {"step": step, "capability": tracker.to_dict()}
    fsdp = res.cfg.optim.fsdp_processes > 1
    previous = previous_checkpoint(res.store, step) if fsdp else None  # checked before the engine sleeps
    # rollout.sleep_during_update: the engine's GPU memory is free while the update runs; it is awake
    # again before the new weights are loaded (engine_sleep.json: seconds and memory figures)
    with engine_asleep(res.engine, res.cfg.rollout.sleep_during_update) as slept:
        if fsdp:  # a torchrun job of optim.fsdp_processes ranks; it writes the checkpoint itself
            metrics = fsdp_update(
                res.cfg.model.path,
                ckpt,
                prompt_ids,
                completion_ids,
                adv,
                update_settings(res.cfg),
                res.cfg.optim.fsdp_processes,
                checkpoint=previous,
                seed=res.cfg.run.seed,
                extra_state=extra_state,
                sampler_logprobs=sampler_logprobs,
            )
        else:
            metrics = res.trainer.update(prompt_ids, completion_ids, adv, sampler_logprobs)
    if slept:
        res.store.write_json(f"steps/{step:06d}/engine_sleep.json", slept)
    if not fsdp:
        res.trainer.save_checkpoint(ckpt, extra_state=extra_state)
    return stages.update_row(step, metrics, rollouts, rewards)


def _update_or_stop(res: RunResources, step: int) -> pd.DataFrame:
    """``_update``; a reward beyond the group statistics' bound or a non-finite update stops the run in one
    line that names the step (nothing was stepped and ``checkpoints/<step + 1>`` is not written)."""
    try:
        return _update(res, step)
    except (RewardScaleError, NonFiniteUpdateError) as exc:
        raise type(exc)(f"step {step}: {exc}") from None


def _reload_policy(res: RunResources, step: int) -> None:
    """The rollout engine takes the weights the update of ``step`` wrote (also when it was done before);
    then checkpoints beyond the newest ``run.keep_checkpoints`` are deleted."""
    res.engine.load_weights(engine_weights(res, step + 1), version=step + 1)
    res.store.prune_checkpoints(res.cfg.run.keep_checkpoints)


def engine_weights(res: RunResources, version: int) -> Path:
    """Where the rollout engine reads the policy after ``version`` updates: the checkpoint itself, or with
    LoRA (an adapter checkpoint) the merged weights the trainer holds, written to ``rollout_weights/``."""
    if res.cfg.model.lora_rank == 0:
        return res.store.checkpoint_dir(version)
    return res.trainer.write_rollout_weights(res.store.root / ROLLOUT_WEIGHTS_DIR)


def _evaluate(res: RunResources, step: int) -> pd.DataFrame:
    r = res.cfg.run
    return stages.evaluate(
        res.test,
        res.engine,
        res.pool,
        r.eval_samples,
        r.eval_temperature,
        res.cfg.rollout.max_tokens,
        r.seed,
        greedy=r.eval_greedy,
        top_p=r.eval_top_p,
        progress=sys.stderr.isatty(),  # the engine's progress bar, on a terminal
    )


def eval_plan(res: RunResources) -> str:
    """What an evaluation of the run computes, in words: ``90 + 90 held-out prompts x (4 samples + greedy)``."""
    r = res.cfg.run
    sizes = res.test["test_set"].value_counts(sort=False) if "test_set" in res.test else [len(res.test)]
    kinds = f"{r.eval_samples} sample{'s' if r.eval_samples > 1 else ''} at T {r.eval_temperature:g}"
    if r.eval_temperature == 0 and r.eval_samples == 1:
        kinds = "greedy"
    elif r.eval_greedy:
        kinds += " + greedy"
    return f"{' + '.join(str(int(n)) for n in sizes)} held-out prompts x ({kinds})"


def _capability_figures(table: pd.DataFrame) -> dict[str, float]:
    return {k: float(table.iloc[0][k]) for k in ("S", "F", "alpha", "beta", "zero_variance_groups")}


def _budget_figures(table: pd.DataFrame) -> dict[str, float]:
    b = table["budget"]
    return {"min": int(b.min()), "max": int(b.max()), "mean": float(b.mean()), "total": int(b.sum())}


def _update_figures(table: pd.DataFrame) -> dict[str, float]:
    return {k: float(table.iloc[0][k]) for k in ("loss", "clip_frac", "grad_norm", "entropy", "tokens")}


@dataclass(frozen=True)
class Recipe:
    """How a stage runs: its table from (res, step), the few figures of that table a step's progress line
    and artifacts show, and what follows it whether it ran or was done."""

    compute: Callable[[RunResources, int], pd.DataFrame]
    figures: Callable[[pd.DataFrame], dict[str, Any]]
    after: Callable[[RunResources, int], None] | None = None
    fault_hooks: bool = True


RECIPES: dict[Table, Recipe] = {  # the five stages of a step, and the held-out evaluation of a run
    Table.ROLLOUTS: Recipe(_rollouts, lambda t: {"rollouts": len(t)}),
    Table.REWARDS: Recipe(_rewards, lambda t: count_verdicts(t["verdict"])),
    Table.CAPABILITY: Recipe(_capability, _capability_figures),
    Table.BUDGET: Recipe(_budget, _budget_figures),
    Table.UPDATE: Recipe(_update_or_stop, _update_figures, after=_reload_policy),
    Table.EVAL: Recipe(_evaluate, eval_figures, fault_hooks=False),  # the weights after `step` updates
}


def run_stage(run_dir: str | Path, step: int, stage: Stage | Table) -> pd.DataFrame:
    """Stage ``stage`` of step ``step`` (or the held-out evaluation, ``Table.EVAL``) in the open run at
    ``run_dir``; returns the stage's table.

    Skipped when its table is in the manifest of its step directory (``output_step(step)``), else
    computed, passed through the fault hooks and written; then the stage's follow-up (the update's
    weight reload) runs. The seconds spent are added to the run's ``stage_seconds``.
    """
    res, t0 = resources(run_dir), time.perf_counter()
    table_name = Table(stage)
    how, where = RECIPES[table_name], table_name.output_step(step)
    if not res.store.is_done(where, table_name):
        table = how.compute(res, step)
        if how.fault_hooks:
            res.faults.at(step, table_name)
        res.store.write_table(where, table_name, table)
    if how.after is not None:
        how.after(res, step)
    res.timed(table_name, time.perf_counter() - t0)
    return res.store.read_table(where, table_name)


def stage_figures(stage: Stage | Table, table: pd.DataFrame) -> dict[str, Any]:
    """The few figures of a stage's table that a step's progress line and artifacts show."""
    return RECIPES[Table(stage)].figures(table)


def write_step_timing(res: RunResources, step: int, seconds_before: dict[str, float]) -> dict[str, float]:
    """steps/<step>/timing.json: wall seconds per stage of this step (not a stage output: not in the
    manifest); returns them."""
    seconds = {k: v - seconds_before.get(k, 0.0) for k, v in res.stage_seconds.items() if k != Table.EVAL}
    res.store.write_json(f"steps/{step:06d}/timing.json", seconds)
    return seconds


def plain_step(run_dir: str | Path, step: int) -> None:
    """One training step as plain calls: the five stages in order, and timing.json (no Prefect)."""
    res = resources(run_dir)
    before = dict(res.stage_seconds)
    for stage in Stage:
        run_stage(run_dir, step, stage)
    write_step_timing(res, step, before)


# ---------------------------------------------------------------------------------------------
# Where the steps of an opened run start


def resume_point(res: RunResources) -> int:
    """Write the first budget if needed, start the resources on the right weights, and return the first
    step to run: a continuing run starts from the checkpoint of its first step not done."""
    write_first_budget(res)
    first = first_step_not_done(res.store, res.cfg.run.steps)
    lora = res.cfg.model.lora_rank > 0
    ckpt = checked_checkpoint(res.store, first) if first > 0 else None
    # an adapter checkpoint is not a whole model: the engine starts on the base, then takes the merged weights
    weights = str(ckpt) if ckpt is not None and not lora else res.cfg.model.path
    start_resources(res, weights, version=first)
    if ckpt is not None and res.trainer is not None:  # FSDP: each update loads the last checkpoint itself
        res.trainer.load_checkpoint(ckpt)
        if lora:
            res.engine.load_weights(engine_weights(res, first), version=first)
    return first
