"""One training step: its stages as Prefect tasks, named as the stage and the table it writes.

    budget(run_dir, t)      capability(t-1), history(t-1) -> budget(t)  each prompt's budget of completions
    rollouts(run_dir, t)    budget(t) -> rollouts(t)                    sampled with the current policy
    rewards(run_dir, t)     rollouts(t) -> rewards(t)                   every completion scored
    capability(run_dir, t)  rewards(t) -> capability(t), history(t)     pass rates -> failure rate -> (alpha, beta)
    update(run_dir, t)      rollouts(t), rewards(t) -> update(t)        the GRPO update; checkpoints/t+1

and ``evaluate(run_dir, t)``: held-out accuracy of the weights after t updates (eval(t)). The order is
``store.step_stages`` (``step_tasks`` gives the tasks in it); ``flows/train.py`` calls them (``run_step``),
``plain_step`` calls the same bodies without Prefect. Under ``allocation.estimator = pilot``
(``coba_tasks.pipeline.pilot``) two stages lead, and the budget is allocated on the posterior after them:

    pilot(run_dir, t)          the batch of t -> pilot(t)             k rollouts per prompt, current policy
    pilot_rewards(run_dir, t)  pilot(t) -> pilot_rewards(t)           the pilot scored

Each body is the stage's work: it reads its inputs from the run directory, calls the stage's pure function
(``coba_tasks.pipeline.stages``) and returns its table. ``@stage`` makes the task and adds what every stage
does: skip the body when the table is already done (in its step's manifest), pass the tests' fault hooks,
write the table into ``steps/t`` (atomically, recorded in the manifest last), run what follows the stage
whether it ran or was done (the update's weight reload), and add the seconds spent to the run's timing. A
task takes the run directory and the step (never models or tables); the run's engine, verifier pool and
trainer are looked up by directory (``run.resources``). The update is not retried by Prefect: it moves the
weights, and a resume recomputes it from the last checkpoint.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pandas as pd
import torch
from prefect import Task, task
from prefect.cache_policies import NO_CACHE

from coba_tasks.core.capability import CapabilityTracker
from coba_tasks.core.estimators import Estimator
from coba_tasks.core.grpo import RewardScaleError
from coba_tasks.engines.engine_sleep import engine_asleep
from coba_tasks.engines.fsdp_update import fsdp_update
from coba_tasks.engines.rollout import SamplingConfig
from coba_tasks.engines.update import NonFiniteUpdateError
from coba_tasks.pipeline import evaluation, prompt_history, stages
from coba_tasks.pipeline import pilot as pilot_waves
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
from coba_tasks.pipeline.store import StoreError, Table, step_stages

ROLLOUT_WEIGHTS_DIR = "rollout_weights"  # LoRA: the merged policy the engine reads (one copy, rewritten)
EVAL_WEIGHTS_DIR = "eval_weights"  # LoRA: an earlier step's merged policy, for its evaluation (removed after)

StageBody = Callable[[RunResources, int], pd.DataFrame]


def stage(
    table: Table,
    retries: int = 1,
    then: Callable[[RunResources, int], None] | None = None,
) -> Callable[[StageBody], Task[[str, int], str]]:
    """Make a stage body ``(res, step) -> table`` the Prefect task ``(run_dir, step) -> table path`` named
    ``table`` (task runs ``<table>-step-<step>``): skipped when the table is done, else computed, passed
    through the tests' fault hooks and written into ``steps/<step>``; then ``then(res, step)``, done or not;
    timed."""

    def make(body: StageBody) -> Task[[str, int], str]:
        def run_stage(run_dir: str, step: int) -> str:
            res, t0 = resources(run_dir), time.perf_counter()
            if not res.store.is_done(step, table):
                frame = body(res, step)
                res.faults.at(step, table)
                res.store.write_table(step, table, frame)
            if then is not None:
                then(res, step)
            res.timed(table, time.perf_counter() - t0)
            return str(res.store.table_path(step, table))

        run_stage.__name__ = run_stage.__qualname__ = body.__name__
        run_stage.__doc__, run_stage.__module__ = body.__doc__, body.__module__
        options = {"retries": retries, "retry_delay_seconds": 2, "cache_policy": NO_CACHE}
        return task(run_stage, name=table.value, task_run_name=f"{table.value}-step-{{step}}", **options)

    return make


# ---------------------------------------------------------------------------------------------
# The stages (their order: ``store.step_stages``)


@stage(Table.PILOT)
def pilot(res: RunResources, step: int) -> pd.DataFrame:
    """allocation.estimator = pilot: the first wave, allocation.pilot_rollouts completions of each prompt of the
    step's batch, from the current policy (each group's usual seed)."""
    plan = pilot_waves.pilot_budget(batch_of(res, step), res.cfg.allocation.pilot_rollouts)
    return stages.rollout_table(plan, res.prompts, res.engine, sampling(res.cfg), res.cfg.run.seed, step)


@stage(Table.PILOT_REWARDS)
def pilot_rewards(res: RunResources, step: int) -> pd.DataFrame:
    """The pilot scored, as the rewards stage scores (and stops on too many errors or timeouts)."""
    table = stages.reward_table(res.store.read_table(step, Table.PILOT), res.prompts, res.pool)
    stages.check_error_share(table, f"step {step}", res.cfg.verify.max_error_share)
    return table


@stage(Table.BUDGET)
def budget(res: RunResources, step: int) -> pd.DataFrame:
    """The allocation of step t, at its start: each prompt of its batch gets a budget from the history and the
    Beta shape after step t - 1 (uniform at step 0: no pass rates yet). Under ``allocation.estimator = pilot``
    on the posterior after the step's pilot: every budget holds the pilot's k and they sum to B_total."""
    history = res.store.read_table(step - 1, Table.HISTORY) if step > 0 else prompt_history.empty_history()
    scored = res.store.read_table(step, Table.PILOT_REWARDS) if piloted(res.cfg) else None
    return budget_for(res, step, history, tracker_before(res, step), pilot=scored)


@stage(Table.ROLLOUTS)
def rollouts(res: RunResources, step: int) -> pd.DataFrame:
    """Sample each prompt of the step's budget table as many completions as its budget, with the rollout engine
    (after a pilot: the rest of its budget, beside the pilot's)."""
    budget = res.store.read_table(step, Table.BUDGET)
    args = (res.prompts, res.engine, sampling(res.cfg), res.cfg.run.seed, step)
    if piloted(res.cfg):
        return pilot_waves.second_wave_table(budget, res.store.read_table(step, Table.PILOT), *args)
    return stages.rollout_table(budget, *args)


@stage(Table.REWARDS)
def rewards(res: RunResources, step: int) -> pd.DataFrame:
    """Score every completion with the verifier pool (after a pilot: its rewards kept, the rest scored); a step
    with too many errors or timeouts stops the run."""
    rolled = res.store.read_table(step, Table.ROLLOUTS)
    if piloted(res.cfg):
        scored = res.store.read_table(step, Table.PILOT_REWARDS)
        table = pilot_waves.merged_reward_table(rolled, scored, res.prompts, res.pool)
    else:
        table = stages.reward_table(rolled, res.prompts, res.pool)
    stages.check_error_share(table, f"step {step}", res.cfg.verify.max_error_share)  # before the table is written
    return table


@stage(Table.CAPABILITY)
def capability(res: RunResources, step: int) -> pd.DataFrame:
    """Fold the step's pass rates into the failure rate and the Beta shape; write the prompt history beside it."""
    table, history = capability_and_history(res, step)
    res.store.write_table(step, Table.HISTORY, history)
    res.store.write_run_table("history", history)
    return table


def _reload_policy(res: RunResources, step: int) -> None:
    """The rollout engine takes the weights the update of ``step`` wrote (also when it was done before);
    then checkpoints beyond the newest ``run.keep_checkpoints`` are deleted."""
    res.engine.load_weights(engine_weights(res, step + 1), version=step + 1)
    res.store.prune_checkpoints(res.cfg.run.keep_checkpoints)


@stage(Table.UPDATE, retries=0, then=_reload_policy)
def update(res: RunResources, step: int) -> pd.DataFrame:
    """The GRPO update on the step's rollouts; writes checkpoints/<step + 1>. A reward beyond the group
    statistics' bound or a non-finite update stops the run in one line naming the step (nothing stepped)."""
    try:
        return _update(res, step)
    except (RewardScaleError, NonFiniteUpdateError) as exc:
        raise type(exc)(f"step {step}: {exc}") from None


@stage(Table.EVAL)
def evaluate(res: RunResources, step: int) -> pd.DataFrame:
    """Held-out accuracy of the weights after ``step`` updates: those the engine holds during a run; an
    evaluation recomputed later (a rerun, a repair, one a kill left out) loads them first (``engine_holds``)."""
    r = res.cfg.run
    with engine_holds(res, step):
        table = evaluation.evaluate(
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
            max_error_share=res.cfg.verify.max_error_share,
            where=f"held-out evaluation at step {step}",
        )
    if set(table["weight_version"]) != {step}:  # never a table of other weights under this step's name
        raise StoreError(f"held-out evaluation at step {step} ran on weight version(s) {set(table['weight_version'])}")
    return table


TASKS = {t.name: t for t in (pilot, pilot_rewards, budget, rollouts, rewards, capability, update)}


def piloted(cfg: Config) -> bool:
    """Whether the run's steps start with a pilot (``allocation.estimator = pilot``)."""
    return cfg.allocation.estimator == Estimator.PILOT


def step_tasks(cfg: Config) -> tuple[Task[[str, int], str], ...]:
    """The stage tasks of one step of the run, in the order ``store.step_stages`` gives."""
    return tuple(TASKS[name] for name in step_stages(piloted(cfg)))


# ---------------------------------------------------------------------------------------------
# What the stages share


def sampling(cfg: Config) -> SamplingConfig:
    """How training rollouts are sampled (the config's rollout section)."""
    r = cfg.rollout
    return SamplingConfig(temperature=r.temperature, top_p=r.top_p, max_tokens=r.max_tokens)


def tracker_before(res: RunResources, step: int) -> CapabilityTracker:
    """The capability tracker as it was when step ``step`` started."""
    if step == 0:
        a = res.cfg.allocation
        return CapabilityTracker(kappa=a.kappa, window=a.capability_window, gamma=a.gamma)
    return stages.tracker_from_capability(res.store.read_table(step - 1, Table.CAPABILITY))


def capability_and_history(res: RunResources, step: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The capability and history tables of ``step``, from its rewards and the tables of ``step - 1``."""
    scored = res.store.read_table(step, Table.REWARDS)
    table, _ = stages.capability_table(step, scored, tracker_before(res, step))
    # history is a per-step snapshot (a pure function of the previous one and this step's rewards),
    # so a stage rerun never counts a step twice; history.parquet at the run root is the latest copy
    previous = res.store.read_table(step - 1, Table.HISTORY) if step > 0 else prompt_history.empty_history()
    a = res.cfg.allocation
    return table, prompt_history.update_history(
        previous, scored, step, a.pass_rate_window, a.prior_strength, a.posterior_decay
    )


def batch_of(res: RunResources, step: int) -> list[str]:
    """The prompt ids of ``step``'s batch."""
    cfg = res.cfg
    ids = res.prompts["prompt_id"].tolist()
    return stages.batch_for_step(ids, step, cfg.data.prompts_per_step, cfg.run.seed, cfg.data.shuffle)


def budget_for(
    res: RunResources, step: int, history: pd.DataFrame, tracker: CapabilityTracker, pilot: pd.DataFrame | None = None
) -> pd.DataFrame:
    """budget.parquet of ``step``: its batch allocated from ``history`` (and the pilot's rewards ``pilot``) and
    the tracker's (alpha, beta)."""
    return stages.budget_table(batch_of(res, step), history, tracker, res.cfg.allocation, pilot, step)


def _update(res: RunResources, step: int) -> pd.DataFrame:
    ckpt = res.store.checkpoint_dir(step + 1)
    rolled = res.store.read_table(step, Table.ROLLOUTS)
    scored = res.store.read_table(step, Table.REWARDS)
    adv = stages.advantages_for(rolled, scored)
    prompt_ids, completion_ids, sampler_logprobs = stages.update_sequences(rolled, res.prompts)
    groups = pd.factorize(rolled["prompt_id"])[0]  # each rollout's prompt (optim.prompt_weighting)
    tracker = stages.tracker_from_capability(res.store.read_table(step, Table.CAPABILITY))
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
                group_ids=groups,
            )
        else:
            metrics = res.trainer.update(prompt_ids, completion_ids, adv, sampler_logprobs, groups)
    if slept:
        res.store.write_step_json(step, "engine_sleep", slept)
    if not fsdp:
        res.trainer.save_checkpoint(ckpt, extra_state=extra_state)
    return stages.update_row(step, metrics, rolled, scored)


def engine_weights(res: RunResources, version: int) -> Path:
    """Where the rollout engine reads the policy after ``version`` updates: the checkpoint itself, or with
    LoRA (an adapter checkpoint) the merged weights the trainer holds, written to ``rollout_weights/``."""
    if res.cfg.model.lora_rank == 0:
        return res.store.checkpoint_dir(version)
    return res.trainer.write_rollout_weights(res.store.root / ROLLOUT_WEIGHTS_DIR)


@contextmanager
def engine_holds(res: RunResources, version: int) -> Iterator[None]:
    """The rollout engine holds the policy after ``version`` updates while the block runs: as it is when it
    holds them already; else they are loaded (the base model at 0, ``checkpoints/<version>``, with LoRA that
    adapter merged into the base) and the engine's own weights are loaded back after. A checkpoint that is
    gone stops here in one line (StoreError), before anything is computed."""
    held = res.engine.weight_version
    if held == version:
        yield
        return
    _load_version(res, version)
    try:
        yield
    finally:
        _load_version(res, held)


def _load_version(res: RunResources, version: int) -> None:
    """Load the policy after ``version`` updates into the engine (``engine_holds``)."""
    cfg = res.cfg
    if version == 0:
        res.engine.load_weights(cfg.model.path, version=0)
        return
    trainer_holds = res.trainer is not None and res.trainer.updates == version
    if cfg.model.lora_rank > 0 and trainer_holds:  # the trainer's merged weights, as after its update
        res.engine.load_weights(engine_weights(res, version), version=version)
        return
    ckpt = checked_checkpoint(res.store, version, needed_for=f"the held-out evaluation of step {version} needs it")
    if cfg.model.lora_rank == 0:
        res.engine.load_weights(ckpt, version=version)
        return
    from coba_tasks.engines.lora import merge_adapter_checkpoint

    merged = res.store.root / EVAL_WEIGHTS_DIR
    dtype = getattr(torch, cfg.model.dtype) if cfg.model.dtype not in ("auto", "float32") else torch.float32
    try:
        res.engine.load_weights(merge_adapter_checkpoint(ckpt, merged, dtype), version=version)
    finally:
        shutil.rmtree(merged, ignore_errors=True)


def due_evaluations(res: RunResources, first: int) -> list[int]:
    """The held-out evaluations between training's first and last (``run.eval_every``) of the weights after at
    most ``first`` updates (the step a run continues at) that are not done: a kill between an update and its
    evaluation, or an evaluation rerun or repaired, leaves one; the flow computes them before it continues."""
    r = res.cfg.run
    due = evaluation.eval_steps(r.steps, r.eval_every)[1:-1]  # the evaluations before and after training have their own
    return [e for e in due if e <= first and not res.store.is_done(e, Table.EVAL)]


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


# ---------------------------------------------------------------------------------------------
# Where the steps of an opened run start, and a step without Prefect


def write_step_timing(res: RunResources, step: int, seconds_before: dict[str, float]) -> dict[str, float]:
    """steps/<step>/timing.json: wall seconds per stage of this step (not a stage output: not in the
    manifest); returns them."""
    seconds = {k: v - seconds_before.get(k, 0.0) for k, v in res.stage_seconds.items() if k != Table.EVAL}
    res.store.write_step_json(step, "timing", seconds)
    return seconds


def plain_step(run_dir: str | Path, step: int) -> None:
    """One training step as plain calls: the stage bodies in order (``Task.fn``, no Prefect), and
    timing.json."""
    res = resources(run_dir)
    before = dict(res.stage_seconds)
    for stage_task in step_tasks(res.cfg):
        stage_task.fn(str(run_dir), step)
    write_step_timing(res, step, before)


def resume_point(res: RunResources) -> int:
    """Start the resources on the right weights and return the first step to run: a continuing run starts
    from the checkpoint of its first step not done."""
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
