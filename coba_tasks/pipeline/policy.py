"""The policy's weights over a run, decided here and nowhere else: which weights the trainer and the rollout engine
hold, where "the policy after v updates" comes from (the base model, a checkpoint, the trainer's memory, the
updates replayed from their tables), when a checkpoint is written, and which checkpoints a resume needs.

    policy = res.policy                 # made with the run's resources (``RunResources``): nothing started yet
    first = policy.start(upto)          # engine, verifier pool and trainer on the newest whole checkpoint <= upto
    policy.advance(first)               # trainer and engine on the policy after ``first`` updates (a replay between)
    with policy.holding(5): ...         # the engine holds the policy after 5 updates for the block, its own after
    row = policy.update(step)           # the step's update (update.parquet's row), its checkpoint when due
    policy.hand_over(step)              # the engine takes the weights after it; old checkpoints pruned
    policy.stop("the update of step 3") # asked to stop (Ctrl-C, SIGTERM): a checkpoint, then RunStopped

Two implementations, one per way of training: ``InProcessPolicy`` (the trainer lives in this process; between
checkpoints the updates are replayed from their tables, each proving its weights digest) and ``TorchrunPolicy``
(``optim.fsdp_processes`` > 1: each update is a torchrun job that starts from the last checkpoint and writes the
next; nothing is replayed). ``policy_class`` is the one place that chooses. What needs no resources (whether a
run can continue at a step, which checkpoints a resume needs, where it takes its weights from, in words) is
asked of the class: ``policy_class(cfg).needed_checkpoints(store, first, evaluations)``.

Which weights does the evaluation of step 5 score after a resume at step 7, with ``run.checkpoint_every=3`` and
LoRA? The flow asks ``start(upto=5)``: the trainer loads checkpoints/000003 (the newest whole one at or below 5;
the engine starts on the base model and takes the merged adapter); ``advance(5)`` replays the updates of steps
3 and 4 from their tables (each must give its recorded weights digest) and hands the engine the weights; the
evaluation's ``holding(5)`` finds them there.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import signal
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pandas as pd
import torch

from coba_tasks.core.capability import CapabilityTracker
from coba_tasks.engines.checkpoint import CheckpointError, verify_checkpoint
from coba_tasks.engines.fsdp_update import fsdp_update
from coba_tasks.engines.rollout import RolloutBackend
from coba_tasks.engines.update import PolicyTrainer, UpdateSettings, engine_asleep, repeatable_setup
from coba_tasks.pipeline import update_batch
from coba_tasks.pipeline.config import Config
from coba_tasks.pipeline.config_sections import OptimConfig
from coba_tasks.pipeline.progress import first_step_not_done, rerun_line, run_length
from coba_tasks.pipeline.store import RunStore, StoreError, Table
from coba_tasks.pipeline.tables import after_updates, step_label

logger = logging.getLogger(__name__)

Batch = tuple[list[list[int]], list[list[int]], np.ndarray, list[list[float]] | None, np.ndarray]
"""What one update trains on: prompt token ids, completion token ids, advantages, the sampler's log p of each
completion token, each rollout's group."""


class RunStopped(Exception):
    """A run stopped on purpose (Ctrl-C, SIGTERM) after a stage, its checkpoint written: the message says how to
    continue; ``exit_code`` is the shell's for the signal (128 + its number)."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.exit_code = 128 + signum


def update_settings(cfg: Config | None = None, **changes: Any) -> UpdateSettings:
    """The GRPO update's settings from the run's config (the same for one process and for FSDP); ``cfg`` None:
    the config's defaults. ``changes`` (``lr=1e-3``, ``lora_rank=4``) replace single keys, for a test or a
    benchmark: every key not changed is the config's."""
    cfg = cfg if cfg is not None else Config()
    # every setting is the config key of its name, optim's or else model's; the temperature is the rollouts'
    run_keys = {"temperature": cfg.rollout.temperature, "lr_schedule_steps": cfg.run.steps}
    keys = [f.name for f in dataclasses.fields(UpdateSettings) if f.name not in ("threads", *run_keys)]
    values = {k: getattr(cfg.optim if k in OptimConfig.model_fields else cfg.model, k) for k in keys}
    return UpdateSettings(**{**values, **run_keys, **changes})


class Resources(Protocol):
    """What the policy uses of a run's resources (``coba_tasks.pipeline.run.RunResources`` is one): the config,
    the store, the rendered training pool, the rollout engine (started by ``start``, with the verifier pool),
    and the signal the run was asked to stop by."""

    cfg: Config
    store: RunStore
    prompts: pd.DataFrame
    engine: RolloutBackend
    stop_signal: str | None

    def start(self, model_path: str, version: int) -> None:
        """Start the rollout engine on ``model_path`` (weight version ``version``) and the verifier pool."""
        ...


# --- Checkpoints as files


def checked_checkpoint(store: RunStore, step: int, needed_for: str = "") -> Path:
    """``checkpoints/<step>``, after checking every file against its manifest (``verify_checkpoint``):
    a missing, partial or damaged checkpoint stops the run with the file named, what needs it (``needed_for``;
    by default the step that continues from it) and the way out (rerun the update that wrote it), never a
    silent start from other weights."""
    ckpt = store.checkpoint_dir(step)
    try:
        verify_checkpoint(ckpt)
    except CheckpointError as exc:
        why = f"{ckpt} is missing" if not ckpt.is_dir() else str(exc)
        raise StoreError(
            f"{why}: {needed_for or f'step {step} continues from it'} (run.keep_checkpoints may delete old ones); "
            f"recompute it with {rerun_line(store, step - 1, Table.UPDATE)}"
        ) from None
    return ckpt


def whole_checkpoint(store: RunStore, step: int) -> bool:
    """Whether ``checkpoints/<step>`` is there with every file as its ``checkpoint.json`` lists it."""
    try:
        verify_checkpoint(store.checkpoint_dir(step))
    except CheckpointError:
        return False
    return True


def newest_checkpoint(
    store: RunStore,
    upto: int,
    warn: Callable[[str], None] | None = None,
    above: int = 0,
    passed_over: set[int] | None = None,
) -> int | None:
    """The newest checkpoint at or below ``upto`` and above ``above`` whose files are as written (None: none; with
    ``above`` 0 the caller starts from the base model); each is hashed only when the newer ones were not whole. A
    partial or damaged one on the way is named to ``warn`` and passed over (the updates after the one taken are
    replayed from the tables: ``InProcessPolicy.advance``), and added to ``passed_over``, whose versions are passed
    over without a word (a run's earlier findings)."""
    skip = passed_over if passed_over is not None else set()
    for k in sorted((k for k in store.checkpoints() if above < k <= upto and k not in skip), reverse=True):
        try:
            verify_checkpoint(store.checkpoint_dir(k))
        except CheckpointError as exc:
            (warn or logger.warning)(f"{exc}: passed over, the updates after an earlier checkpoint are replayed")
            skip.add(k)
            continue
        return k
    return None


def checkpoint_state(store: RunStore, step: int) -> dict[str, Any]:
    """What a checkpoint written after the update of ``step`` records beside the weights: the step and the
    capability tracker after it."""
    capability = store.read_table(step, Table.CAPABILITY)
    tracker = CapabilityTracker.from_dict(json.loads(capability["tracker_state"].iloc[0]))
    return {"step": step, "capability": tracker.to_dict()}


# --- Replays


class ReplayError(StoreError):
    """A replayed update that did not give the weights (or a figure) its table holds; ``step`` is its step."""

    def __init__(self, message: str, step: int = -1) -> None:
        super().__init__(message)
        self.step = step


DIGEST = "params_digest"  # update.parquet's digest of the trained weights after the update (engines/digest.py)


@dataclass(frozen=True)
class Advanced:
    """How ``advance`` brought the trainer to a version: the checkpoint it loaded (None: it went on from the
    policy the trainer held, ``held`` updates), and the steps whose updates it replayed."""

    loaded: int | None
    held: int
    replayed: tuple[int, ...] = ()

    def line(self, version: int) -> str:
        """What happened, in words (empty when the trainer held the version already)."""
        if self.loaded is None and not self.replayed:
            return ""
        start = self.start_words()
        if not self.replayed:
            return f"the policy after {version} updates: {start}"
        first, last = self.replayed[0], self.replayed[-1]
        what = f"the updates of steps {first}-{last}" if last > first else f"the update of step {first}"
        return (
            f"the policy after {version} updates: {what} replayed from the tables (each gave its recorded weights "
            f"digest and figures), from {start}"
        )

    def start_words(self) -> str:
        if self.loaded is not None:
            return f"checkpoints/{self.loaded:06d}"
        return "the base model" if self.held == 0 else f"the policy after {self.held} updates the trainer held"


# --- The owner


class Policy(ABC):
    """The policy's weights in a run: made with its resources (``RunResources.policy``), started by ``start``."""

    def __init__(self, res: Resources) -> None:
        self.res = res

    # --- What needs no resources: asked of the class

    @classmethod
    def check_continues(cls, store: RunStore, step: int) -> None:
        """StoreError (one line) when a run cannot continue at ``step`` from what ``store`` holds."""
        return None  # nothing, unless an implementation says otherwise

    @classmethod
    def needed_checkpoints(cls, store: RunStore, first: int, evaluations: Sequence[int]) -> list[int]:
        """The checkpoints a resume at ``first`` reads, computing ``evaluations`` (steps before it) first."""
        return []

    @classmethod
    @abstractmethod
    def resume_lines(
        cls, store: RunStore, cfg: Config, first: int, due: Sequence[int], kept: Sequence[int]
    ) -> list[str]:
        """Where a resume at ``first`` takes its weights from, in words: one line per held-out evaluation it computes
        first (``due``) and one for the step it goes on at; ``kept``: the checkpoints left to it, newest first."""

    # --- A run's lifecycle

    def start(self, upto: int | None = None) -> int:
        """Start the engine, the verifier pool and the trainer on the newest whole checkpoint at or below ``upto``
        (default and at most: the first step not done; the base model when there is none) and return the first
        step not done (``advance`` brings them on to a version)."""
        res = self.res
        first = first_step_not_done(res.store, run_length(res.store, res.cfg))
        version, ckpt = self._start_point(first, first if upto is None else min(upto, first))
        self._before_engine()
        # an adapter checkpoint is not a whole model: the engine starts on the base, then takes the merged weights
        weights = str(ckpt) if ckpt is not None and res.cfg.model.lora_rank == 0 else res.cfg.model.path
        res.start(weights, version)
        self._start_trainer(ckpt, version)
        return first

    @abstractmethod
    def _start_point(self, first: int, upto: int) -> tuple[int, Path | None]:
        """(version, checkpoint) the run starts from: checkpoint None is the base model."""

    def _before_engine(self) -> None:
        """What must be set before the engine starts."""
        return None  # nothing, unless an implementation says otherwise

    def _start_trainer(self, ckpt: Path | None, version: int) -> None:
        """The trainer of this process, on ``ckpt`` (None: the base model)."""
        return None  # nothing, unless an implementation says otherwise

    @abstractmethod
    def advance(self, version: int) -> Advanced:
        """Bring the trainer and the rollout engine to the policy after ``version`` updates."""

    @contextmanager
    def holding(self, version: int) -> Iterator[None]:
        """The rollout engine holds the policy after ``version`` updates while the block runs, loaded when it holds
        others and its own loaded back after; a checkpoint that is gone is a StoreError before anything is
        computed."""
        held = self.res.engine.weight_version
        if held == version:
            yield
            return
        self._load(version)
        try:
            yield
        finally:
            self._load(held)

    def _load(self, version: int) -> None:
        """The engine takes the policy after ``version`` updates: the base model at 0, else ``_load_trained``."""
        if version == 0:
            self.res.engine.load_weights(self.res.cfg.model.path, version=0)
        else:
            self._load_trained(version)

    @abstractmethod
    def _load_trained(self, version: int) -> None:
        """The engine takes the policy after ``version`` (> 0) updates for an evaluation."""

    def update(self, step: int, replay: bool = False) -> pd.DataFrame:
        """The update of ``step`` from its tables (update.parquet's row); its checkpoint when due. ``replay``: the
        trainer takes it again (``InProcessPolicy.replay``): no checkpoint, no record of the engine's sleep."""
        res = self.res
        generated = res.store.read_table(step, Table.ROLLOUTS)
        rolled, scored, adv, groups = update_batch.trained(
            generated, res.store.read_table(step, Table.REWARDS), res.cfg.allocation
        )
        prompt_ids, completion_ids, sampler_logprobs = update_batch.update_sequences(rolled, res.prompts)
        job = self._job(step)  # what it starts from is checked before the engine sleeps
        with engine_asleep(res.engine, res.cfg.rollout.sleep_during_update) as slept:
            metrics = job((prompt_ids, completion_ids, adv, sampler_logprobs, groups))
        metrics = {**metrics, DIGEST: self._digest()}  # the weights after the optimizer steps, for a replay to prove
        # what the step generated (every round, the pilot, dropped groups) beside what the update trained on
        metrics |= {"rollouts_generated": len(generated), "tokens_generated": int(generated["n_tokens"].sum())}
        if slept and not replay:
            res.store.write_step_json(step, "engine_sleep", slept)
        if not replay:
            self._after_update(step)
        return update_batch.update_row(step, metrics, rolled, scored)

    @abstractmethod
    def _job(self, step: int) -> Callable[[Batch], dict[str, Any]]:
        """The update of ``step`` as a call on its batch, returning its metrics."""

    def _digest(self) -> str:
        """The digest of the trained weights (empty where the update ran elsewhere)."""
        return ""

    def _after_update(self, step: int) -> None:
        """After the update of ``step`` (not a replay): its checkpoint when due."""
        return None  # nothing, unless an implementation says otherwise

    def hand_over(self, step: int) -> None:
        """The rollout engine takes the policy after the update of ``step`` (also when it was done before); then
        checkpoints beyond the newest ``run.keep_checkpoints`` are deleted."""
        version = step + 1
        self._hand_over(version)
        self.res.store.prune_checkpoints(self.res.cfg.run.keep_checkpoints, upto=version)

    @abstractmethod
    def _hand_over(self, version: int) -> None:
        """The engine takes the policy after ``version`` updates, just trained."""

    def stop(self, after: str) -> None:
        """``RunStopped`` once the run was asked to stop (``run.stop_on_signals``): the policy written as a
        checkpoint if it is not one yet, and the line that says how to continue; nothing otherwise."""
        res = self.res
        if res.stop_signal is None:
            return
        written = self._write_on_stop()
        raise RunStopped(
            f"stopped by {res.stop_signal} after {after}{written}; continue with: coba resume --run-dir "
            f"{res.store.root}",
            int(signal.Signals[res.stop_signal]),
        )

    def _write_on_stop(self) -> str:
        """Write the policy as a checkpoint if it is not one; what to say of it."""
        return ""

    def checkpoint_due(self, version: int) -> bool:
        """Whether the policy after ``version`` updates is written as a checkpoint: every ``run.checkpoint_every``-th,
        the last, any once the run was asked to stop."""
        res = self.res
        return (
            version % res.cfg.run.checkpoint_every == 0
            or version == run_length(res.store, res.cfg)  # the last (under run.rollout_budget known by its rollouts)
            or res.stop_signal is not None
        )


class InProcessPolicy(Policy):
    """The trainer in this process (``PolicyTrainer``); the engine takes its weights from memory. A checkpoint is
    written every ``run.checkpoint_every`` updates (each one where updates do not repeat bit for bit); the
    versions between are rebuilt by replaying their updates from the tables."""

    def __init__(self, res: Resources) -> None:
        super().__init__(res)
        self._trainer: PolicyTrainer | None = None
        # why every update is written as a checkpoint, its replay not relied on; None: on schedule
        self.not_repeatable: str | None = None
        self.replay_failed: ReplayError | None = None  # the trainer's policy is not the run's until a load
        self.damaged_checkpoints: set[int] = set()  # found partial or damaged: passed over, said once

    @property
    def trainer(self) -> PolicyTrainer:
        if self._trainer is None:
            raise RuntimeError("the run's trainer is not started (Policy.start)")
        return self._trainer

    @classmethod
    def resume_lines(
        cls, store: RunStore, cfg: Config, first: int, due: Sequence[int], kept: Sequence[int]
    ) -> list[str]:
        """The newest whole checkpoint at or below each target and above what the trainer holds then is loaded, the
        updates after it replayed."""
        steps = run_length(store, cfg)
        lines, held = [], 0
        for target in (*due, first):
            whole = next((k for k in kept if held < k <= target and whole_checkpoint(store, k)), None)
            start = held if whole is None else whole
            where = "the base model" if held == 0 else f"the policy {after_updates(held)}"
            where = f"checkpoints/{whole:06d}" if whole else where
            what = (
                f"the evaluation {after_updates(target)}"
                if target in due
                else f"training at {step_label(first, steps)}"
            )
            if target == first == steps:
                what = "the end of the run (the policy after its last update)"
            n = target - start
            said = f"replaying {n} update{'s' if n != 1 else ''} from their tables" if n else "no replay"
            lines.append(f"the resume computes {what} from {where} ({said})")
            held = target
        return lines

    def _start_point(self, first: int, upto: int) -> tuple[int, Path | None]:
        version = newest_checkpoint(self.res.store, upto, passed_over=self.damaged_checkpoints) or 0
        return version, self.res.store.checkpoint_dir(version) if version > 0 else None

    def _before_engine(self) -> None:
        self.not_repeatable = repeatable_setup()  # before the engine: cuBLAS reads its setting once
        if self.not_repeatable:
            logger.warning(
                f"updates on this GPU will not repeat bit for bit ({self.not_repeatable}): every update is written as "
                "a checkpoint, never replayed"
            )

    def _start_trainer(self, ckpt: Path | None, version: int) -> None:
        cfg = self.res.cfg
        self._trainer = PolicyTrainer(cfg.model.path, update_settings(cfg), seed=cfg.run.seed)
        if ckpt is not None:
            self.trainer.load_checkpoint(ckpt)
            if cfg.model.lora_rank > 0:
                self.res.engine.set_weights(self.trainer.engine_weights, version=version)

    def advance(self, version: int) -> Advanced:
        """From the newest whole checkpoint above the trainer's policy and at or below ``version`` when there is one
        (never a replay past a checkpoint), else on from the trainer's; the updates in between replayed from their
        tables (``replay``). After a failed replay the trainer's policy is not the run's: only a checkpoint above
        the failed update brings it back, else the same ``ReplayError``."""
        res, trainer = self.res, self.trainer
        failed, held = self.replay_failed, trainer.updates
        if failed is None and held > version:
            raise RuntimeError(f"the trainer holds the policy after {held} updates, past the {version} asked for")
        loaded = None
        if failed is not None or held < version:
            floor = failed.step if failed is not None else held
            loaded = newest_checkpoint(res.store, version, above=floor, passed_over=self.damaged_checkpoints)
            if loaded is None and failed is not None:
                raise ReplayError(str(failed), failed.step)
            if loaded is not None:
                trainer.load_checkpoint(res.store.checkpoint_dir(loaded))
                self.replay_failed = None
        done = Advanced(loaded=loaded, held=held, replayed=tuple(range(trainer.updates, version)))
        for step in done.replayed:
            try:
                self.replay(step, done.start_words())
            except ReplayError as exc:
                self.replay_failed = exc
                raise
        if loaded is not None or done.replayed or res.engine.weight_version != version:
            res.engine.set_weights(trainer.engine_weights, version=version)
        return done

    def replay(self, step: int, start: str) -> None:
        """The trainer takes the update of ``step`` again from the step's tables (no rollout, no scoring), which must
        give the weights digest and every figure ``update.parquet`` holds, bit for bit; ``ReplayError`` (one line,
        the way out) if not. ``start``: where the replay started, in words (the message names it)."""
        store = self.res.store
        stored = store.read_table(step, Table.UPDATE)
        if DIGEST not in stored.columns:
            raise ReplayError(
                f"step {step}: update.parquet records no digest of the weights after the update (written by an "
                f"earlier build), so a replay from {start} could not prove it rebuilds them; {_way_out(store, step)}",
                step,
            )
        row = self.update(step, replay=True)
        same = lambda a, b: a == b or (a != a and b != b)  # noqa: E731  (NaN is NaN here)
        differ = [c for c in stored.columns if c not in row.columns or not same(row[c].iloc[0], stored[c].iloc[0])]
        if differ:
            raise ReplayError(
                f"step {step}: the update replayed from {start} gave {_figures(row)} where update.parquet holds "
                f"{_figures(stored)} ({', '.join(differ[:4])} differ{'s' if len(differ) == 1 else ''}): this machine "
                f"does not repeat the update bit for bit (another CPU, torch build or GPU kernels); "
                f"{_way_out(store, step)}",
                step,
            )
        ckpt = store.checkpoint_dir(step + 1)
        if ckpt.is_dir() and not whole_checkpoint(store, step + 1):  # damaged: written again, from the replayed policy
            self.trainer.save_checkpoint(ckpt, extra_state=checkpoint_state(store, step))
            self.damaged_checkpoints.discard(step + 1)

    def _load_trained(self, version: int) -> None:
        # the flow brings the trainer to a version before evaluating it (``advance``)
        if self.trainer.updates != version:
            raise RuntimeError(f"the trainer holds the policy after {self.trainer.updates} updates, not {version}")
        self.res.engine.set_weights(self.trainer.engine_weights, version=version)

    def _job(self, step: int) -> Callable[[Batch], dict[str, Any]]:
        return lambda batch: self.trainer.update(*batch)

    def _digest(self) -> str:
        return self.trainer.params_digest()

    def _after_update(self, step: int) -> None:
        if self.checkpoint_due(step + 1) or self._not_repeated(step):
            self.trainer.save_checkpoint(
                self.res.store.checkpoint_dir(step + 1), extra_state=checkpoint_state(self.res.store, step)
            )

    def checkpoint_due(self, version: int) -> bool:
        """Also every one where updates do not repeat bit for bit (``not_repeatable``)."""
        return super().checkpoint_due(version) or self.not_repeatable is not None

    def _not_repeated(self, step: int) -> bool:
        """Whether the update of ``step`` just done ran an operation without a deterministic kernel (said once per
        run): it would not repeat bit for bit, so its checkpoint is written whatever ``run.checkpoint_every``
        says."""
        ops = self.trainer.not_repeatable
        if ops and not self.not_repeatable:
            self.not_repeatable = (
                f"the update of step {step} ran an operation without a deterministic kernel ({ops[0]})"
            )
            logger.warning(
                f"{self.not_repeatable}: from now on every update is written as a checkpoint, never replayed"
            )
        return bool(ops)

    def _hand_over(self, version: int) -> None:
        self.advance(version)  # the trainer holds it: handed over (a trainer behind it would replay first)

    def _write_on_stop(self) -> str:
        if self._trainer is None or self.trainer.updates == 0:
            return ""
        version = self.trainer.updates
        ckpt = self.res.store.checkpoint_dir(version)
        if not ckpt.is_dir():
            self.trainer.save_checkpoint(ckpt, extra_state=checkpoint_state(self.res.store, version - 1))
        return f"; checkpoints/{version:06d} holds the policy after {version} update{'s' if version != 1 else ''}"


class TorchrunPolicy(Policy):
    """``optim.fsdp_processes`` > 1: no trainer in this process; each update is a torchrun job of that many ranks
    from ``checkpoints/<step>`` (the base model at step 0), which writes ``checkpoints/<step + 1>`` itself. A copy
    kept in sync here would load every checkpoint (about 4x the model's size) only to hold weights the flow never
    reads; the engine loads each checkpoint instead, and a resume continues from the one of its step."""

    @classmethod
    def check_continues(cls, store: RunStore, step: int) -> None:
        if step > 0:  # a partial or damaged checkpoint: the file and the rerun that mends it
            checked_checkpoint(store, step)

    @classmethod
    def needed_checkpoints(cls, store: RunStore, first: int, evaluations: Sequence[int]) -> list[int]:
        return sorted({*evaluations, *([first] if first > 0 else [])})

    @classmethod
    def resume_lines(
        cls, store: RunStore, cfg: Config, first: int, due: Sequence[int], kept: Sequence[int]
    ) -> list[str]:
        steps = run_length(store, cfg)
        return [f"the resume goes on at {step_label(first, steps)} from checkpoints/{first:06d} (FSDP: no replay)"]

    def _start_point(self, first: int, upto: int) -> tuple[int, Path | None]:
        return first, checked_checkpoint(self.res.store, first) if first > 0 else None

    def _start_trainer(self, ckpt: Path | None, version: int) -> None:
        # the thread count PolicyTrainer sets in the single-process mode, so that the in-process engine's CPU work
        # runs the same in both modes (the ranks get it as OMP_NUM_THREADS)
        torch.set_num_threads(update_settings(self.res.cfg).threads)

    def advance(self, version: int) -> Advanced:
        """The engine loads ``checkpoints/<version>`` when it holds another version."""
        engine = self.res.engine
        if engine.weight_version != version:
            engine.load_weights(checked_checkpoint(self.res.store, version), version=version)
        return Advanced(loaded=version, held=version)

    def _load_trained(self, version: int) -> None:
        needed = f"the held-out evaluation of step {version} needs it"
        self.res.engine.load_weights(checked_checkpoint(self.res.store, version, needed_for=needed), version=version)

    def _job(self, step: int) -> Callable[[Batch], dict[str, Any]]:
        res = self.res
        # the checkpoint it starts from, written by the previous step's update (None at step 0: the base model, a
        # fresh optimizer); a missing one is an error, never a silent restart from the base model
        previous = None if step == 0 else checked_checkpoint(res.store, step)
        cfg, ckpt = res.cfg, res.store.checkpoint_dir(step + 1)

        def job(batch: Batch) -> dict[str, Any]:
            prompt_ids, completion_ids, adv, sampler_logprobs, groups = batch
            return fsdp_update(
                cfg.model.path,
                ckpt,
                prompt_ids,
                completion_ids,
                adv,
                update_settings(cfg),
                cfg.optim.fsdp_processes,
                checkpoint=previous,
                seed=cfg.run.seed,
                extra_state=checkpoint_state(res.store, step),
                sampler_logprobs=sampler_logprobs,
                group_ids=groups,
            )

        return job

    def _hand_over(self, version: int) -> None:
        self.res.engine.load_weights(self.res.store.checkpoint_dir(version), version=version)  # the job just wrote it


def policy_class(cfg: Config) -> type[Policy]:
    """The policy of a run of ``cfg``: the one place that asks how updates run."""
    return TorchrunPolicy if cfg.optim.fsdp_processes > 1 else InProcessPolicy


def _figures(table: pd.DataFrame) -> str:
    """The weights digest, loss and gradient norm of an update's row, as plain numbers."""
    row = table.iloc[0]
    return f"weights {row.get(DIGEST, '?')}, loss {float(row['loss'])!r}, grad norm {float(row['grad_norm'])!r}"


def _way_out(store: RunStore, step: int) -> str:
    return (
        f"continue the run on the machine that trained it, or train again from step {step} with "
        f"{rerun_line(store, step, Table.UPDATE)}"
    )
