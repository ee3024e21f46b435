"""A run forked from another: the steps two runs have in common, trained once (``coba compare``).

docs/design.md, "Resume and rerun" (Fork), says which runs share steps, how ``fork_point`` finds where they
part (recomputing run B's budget, capability and history tables from run A's) and what ``fork_run`` takes
from A and how B differs from B trained from the start. A batch of unseen prompts is allocated uniformly
whatever the strategy, so runs that differ in strategy, mode or schedule, with a pool of P prompts and M a
step, part no earlier than step P // M (counted from 0). A checkpoint is taken as a hard link (a copy where
links are not possible); the one of the fork step must be there. The fork is built in a temporary sibling
and renamed into place when whole.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from coba_tasks.engines.fileio import new_temporary_dir, sha256_file, write_parquet
from coba_tasks.pipeline import prompt_history, stages
from coba_tasks.pipeline.config import Config, config_hash, config_to_dict
from coba_tasks.pipeline.config_sections import ROUND_SAMPLING_KEYS
from coba_tasks.pipeline.policy import policy_class
from coba_tasks.pipeline.run import RunResources, read_run_config
from coba_tasks.pipeline.store import MANIFEST_FILE, RunStore, StoreError, Table

# The allocation keys, each read by the capability, history or budget stage and by no other stage. A key
# added to the allocation section is not shared until it is listed here (it might act elsewhere, as an
# estimator that samples inside the rollouts stage would).
ALLOCATION_KEYS = (
    "strategy",
    "mode",
    "solver",
    "group_size",
    "min_budget",
    "max_budget",
    "schedule",
    "fixed_alpha",
    "fixed_beta",
    "tau",
    "kappa",
    "gamma",
    "capability_window",
    "pass_rate_window",
    "estimator",  # last and posterior act through the budget stage; pilot does not (``shares_prefix``)
    "prior_strength",
    "posterior_decay",
    "pilot_rollouts",  # read by the pilot alone
    # read by the strategies sampled in rounds alone (dynamic, ada), whose steps are no other run's
    *ROUND_SAMPLING_KEYS,
)
PREFIX_KEYS = frozenset({"run.name", *(f"allocation.{k}" for k in ALLOCATION_KEYS)})
ROLLOUT_INPUTS = ("prompt_id", "budget")  # what the rollouts stage reads of a budget table (stages.rollout_tables)
FORK_FILE = "fork.json"


class ForkError(ValueError):
    """A run cannot be forked from this one (the configs differ elsewhere, a checkpoint is gone, ...)."""


def differing_keys(a: Config, b: Config) -> list[str]:
    """The ``section.key`` names whose values differ between two configs."""
    da, db = config_to_dict(a), config_to_dict(b)  # the same sections and keys: every key has a value
    return sorted(f"{section}.{key}" for section, keys in da.items() for key in keys if keys[key] != db[section][key])


def shares_prefix(a: Config, b: Config) -> bool:
    """Whether runs of configs ``a`` and ``b`` may share their first steps: they differ only in ``PREFIX_KEYS``
    and each samples a step once, from its budget (a pilot, or rounds (dynamic, ada), sample inside the step: a
    step of such a run is no other run's)."""
    once = a.allocation.sampling == b.allocation.sampling == "once"
    return once and set(differing_keys(a, b)) <= PREFIX_KEYS


@dataclass
class ForkPoint:
    """Run B forks from run A before ``step``; ``budgets``: B's own budget tables of steps 0..step."""

    step: int
    budgets: dict[int, pd.DataFrame] = field(default_factory=dict)


def fork_point(source: RunStore, cfg: Config) -> ForkPoint | None:
    """Where a run of ``cfg`` parts from the run in ``source``: the first step whose budget (allocated with
    ``cfg`` from the source's tables) gives other prompts or budgets, or whose capability or history tables
    would differ; ``run.steps`` when none does. None while the source's tables do not decide it yet (the
    run has not got that far). ``ForkError`` when the configs differ outside ``PREFIX_KEYS``."""
    theirs = read_run_config(source)
    if not shares_prefix(theirs, cfg):
        apart = [k for k in differing_keys(theirs, cfg) if k not in PREFIX_KEYS]
        why = "a step sampled in more than one wave is no other run's"
        raise ForkError(f"the configs differ in {', '.join(apart)}" if apart else why)
    prompts = source.read_run_table("prompts")
    view = RunResources(cfg=cfg, store=source, prompts=prompts, test=pd.DataFrame())
    their_view = RunResources(cfg=theirs, store=source, prompts=prompts, test=pd.DataFrame())
    history, tracker = prompt_history.empty_history(), stages.tracker_before(view, 0)
    budgets: dict[int, pd.DataFrame] = {}
    for u in range(cfg.run.steps):
        budgets[u] = stages.budget_for(view, u, history, tracker)
        # the source's budget of u: its table, or (step u not started yet) what its budget stage will write
        done = source.is_done(u, Table.BUDGET)
        theirs_u = source.read_table(u, Table.BUDGET) if done else stages.budget_for(their_view, u, history, tracker)
        if not _same_rollout_inputs(budgets[u], theirs_u):
            return ForkPoint(u, budgets)
        if not (source.is_done(u, Table.CAPABILITY) and source.is_done(u, Table.HISTORY)):
            return None
        capability, history = stages.capability_and_history(view, u)  # the source's tables before u: ours
        if not (
            _written_as(source, u, Table.CAPABILITY, capability) and _written_as(source, u, Table.HISTORY, history)
        ):
            return ForkPoint(u, budgets)
        tracker = stages.tracker_from_capability(capability)
    return ForkPoint(cfg.run.steps, budgets)


def _same_rollout_inputs(a: pd.DataFrame, b: pd.DataFrame) -> bool:
    cols = list(ROLLOUT_INPUTS)
    return a[cols].reset_index(drop=True).equals(b[cols].reset_index(drop=True))


def _written_as(store: RunStore, step_dir: int, name: str, frame: pd.DataFrame) -> bool:
    """Whether ``frame`` written as a table gives the bytes of ``name`` in ``steps/<step_dir>``."""
    with tempfile.TemporaryDirectory() as tmp:
        path = write_parquet(frame, Path(tmp) / "t.parquet")
        return sha256_file(path) == store.manifest(step_dir)[name]["sha256"]


def fork_run(source: RunStore, root: str | os.PathLike[str], cfg: Config, point: ForkPoint) -> RunStore:
    """Make the run directory ``root`` of ``cfg`` from ``source`` as it stood before ``point.step``, to continue
    with ``train_flow(resume=True)``. ``ForkError`` (nothing left at ``root``) when a table would not come out
    as the same bytes, or what ``point.step`` continues from is not there (a pruned checkpoint, a step not done)."""
    root, s = Path(root), point.step
    if root.exists():
        raise ForkError(f"{root} exists")
    if s > 0:
        if not source.is_done(s - 1, Table.UPDATE):
            raise ForkError(f"step {s - 1} of {source.root} is not done")
        try:  # what step s continues from (FSDP: the checkpoint of its step; the others replay from their newest)
            policy_class(cfg).check_continues(source, s)
        except StoreError as exc:
            raise ForkError(str(exc)) from None
    if set(point.budgets) != set(range(min(s + 1, cfg.run.steps))):
        raise ForkError(f"the budgets of steps 0..{s} are not all there")
    tmp = new_temporary_dir(root)  # a name of its own: a second fork to the same directory keeps its work
    try:
        store = RunStore(tmp)
        info = source.run_info
        store.create(config_to_dict(cfg), config_hash(cfg), info.get("versions", {}), inputs=info.get("inputs"))
        _run_tables(source, store, s)
        for u in range(s + 1):
            _step_tables(source, store, u, s, point.budgets.get(u))
        for k in range(1, s + 1):  # those run.keep_checkpoints left: the ones B trained alone would hold
            if source.checkpoint_dir(k).is_dir():
                shutil.copytree(source.checkpoint_dir(k), store.checkpoint_dir(k), copy_function=_link)
        store.write_json(FORK_FILE, {"from": str(source.root.resolve()), "config_hash": source.config_hash, "step": s})
        tmp.rename(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return RunStore.open(root)


def _run_tables(source: RunStore, store: RunStore, s: int) -> None:
    """prompts.parquet and the other run-level tables, and history.parquet as it stood before step ``s``."""
    for name in json.loads((source.root / MANIFEST_FILE).read_text(encoding="utf-8"))["entries"]:
        if name == Table.HISTORY:
            store.write_run_table(
                name, source.read_table(s - 1, Table.HISTORY) if s > 0 else prompt_history.empty_history()
            )
        else:
            store.write_run_table(name, source.read_run_table(name))
            if sha256_file(store.root / f"{name}.parquet") != sha256_file(source.root / f"{name}.parquet"):
                raise ForkError(f"{name}.parquet of {source.root} does not come out of a re-write as the same bytes")


def _step_tables(source: RunStore, store: RunStore, u: int, s: int, budget: pd.DataFrame | None) -> None:
    """steps/<u>: the source's tables (before ``s``; at ``s`` only its evaluation) in the source's order, with
    ``budget`` (None after the last step) for its budget table, and the step's timing records."""
    entries: dict[str, Any] = source.manifest(u)
    for name, entry in entries.items():
        if name == Table.BUDGET and budget is not None:
            store.write_table(u, name, budget)
        elif u < s or name == Table.EVAL:
            store.write_table(u, name, source.read_table(u, name))
            if store.manifest(u)[name]["sha256"] != entry["sha256"]:
                raise ForkError(f"steps/{u}/{name}.parquet does not come out of a re-write as the same bytes")
    if budget is not None and Table.BUDGET not in entries:
        store.write_table(u, Table.BUDGET, budget)
    if u < s:
        for path in sorted(source.step_dir(u).glob("*.json")):
            if path.name != MANIFEST_FILE:
                shutil.copy2(path, store.step_dir(u) / path.name)


def _link(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another file system, or one without hard links
        shutil.copy2(src, dst)
