"""Rerunning one stage of a run: which later outputs it invalidates, and removing them (docs/operations.md,
"Rerun": the order outputs are computed in, what a rerun removes, and the checkpoints it checks first).

``plan_rerun`` lists the stage's own output and everything computed after it (and the checkpoints and
summary.json that go with them); ``apply_rerun`` removes them, manifest entries first, after ``check_plan``
made sure the resume can recompute them.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

from coba_tasks.pipeline.evaluation import run_eval_steps
from coba_tasks.pipeline.policy import policy_class, whole_checkpoint
from coba_tasks.pipeline.progress import first_step_not_done, rerun_line, run_length
from coba_tasks.pipeline.run import read_run_config
from coba_tasks.pipeline.store import STEP_ORDER, RunStore, StoreError, Table, inside_run, step_stages
from coba_tasks.pipeline.tables import RERUNNABLE


def _order(step_dir: int, name: str) -> tuple[int, int]:
    """Position of table ``name`` in ``steps/<step_dir>/`` in the order outputs are computed."""
    if name == Table.EVAL:  # eval(t) measures the weights after update(t - 1), before step t's stages
        return (step_dir, -1)
    stage = Table.CAPABILITY if name == Table.HISTORY else name
    if stage not in STEP_ORDER:
        raise ValueError(f"unknown stage {name!r}; choose one of {', '.join(RERUNNABLE)}")
    return (step_dir, STEP_ORDER.index(stage))


@dataclass
class RerunPlan:
    """What rerunning ``stage`` at ``step`` invalidates."""

    step: int
    stage: str
    tables: list[tuple[int, str]] = field(default_factory=list)  # (step directory, table), in order
    checkpoints: list[Path] = field(default_factory=list)
    files: list[Path] = field(default_factory=list)  # summary.json and report/ when present

    def describe(self, root: Path) -> str:
        """One line per output that would be removed."""
        lines = [f"rerunning {self.stage} at step {self.step} invalidates {len(self.tables)} table(s):"]
        lines += [f"  steps/{s:06d}/{name}.parquet" for s, name in self.tables]
        if self.checkpoints:
            lines.append(f"and {len(self.checkpoints)} checkpoint(s):")
            lines += [f"  {p.relative_to(root)}/" for p in self.checkpoints]
        lines += [f"and {p.relative_to(root)}" for p in self.files]
        return "\n".join(lines)


def plan_rerun(store: RunStore, step: int, stage: str, require_done: bool = True) -> RerunPlan:
    """The outputs that rerunning ``stage`` at ``step`` invalidates (its own included); ValueError for an unknown
    stage, a negative step, or (``require_done``) a stage not run there yet."""
    if stage not in RERUNNABLE:
        raise ValueError(f"unknown stage {stage!r}; choose one of {', '.join(RERUNNABLE)}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if require_done and not store.is_done(step, stage):
        done = [n for n in (*STEP_ORDER, Table.EVAL) if store.is_done(step, n)]
        raise ValueError(
            f"{stage} is not done at step {step} (done there: {', '.join(done) or 'nothing'}); "
            "`coba resume` computes what is missing"
        )
    # a step sampled in rounds: each round's requests follow from the rewards of those before, and its rollouts
    # and rewards are its rounds': rerunning any of them redoes every round (a pilot's budget, allocated between
    # its rounds, with them: the step from its start)
    sampled = (Table.ROUND, Table.ROUND_REWARDS, Table.ROLLOUTS, Table.REWARDS)
    if stage in (*sampled, Table.BUDGET) and store.is_done(step, Table.ROUND) and _sampling(store) == "pilot":
        start = _order(step, Table.BUDGET)
    else:
        start = _order(step, Table.ROUND if stage in sampled and store.is_done(step, Table.ROUND) else stage)
    plan = RerunPlan(step=step, stage=stage)
    if stage == Table.EVAL:  # nothing reads a held-out evaluation: it invalidates only itself
        plan.tables.append((step, stage))
    else:
        for s in store.steps():
            for name in store.manifest(s):
                if name in tuple(Table) and _order(s, name) >= start:
                    plan.tables.append((s, name))
    plan.tables.sort(key=lambda t: _order(*t))
    updates = [s for s, name in plan.tables if name == Table.UPDATE]
    if updates:  # update(t) wrote checkpoints/t+1; only checkpoints count (``RunStore.checkpoints``)
        plan.checkpoints = [store.checkpoint_dir(k) for k in store.checkpoints() if k >= min(updates) + 1]
    for extra in ("summary.json", "report"):
        if (store.root / extra).exists():
            plan.files.append(store.root / extra)
    return plan


def _sampling(store: RunStore) -> str:
    """How the run's steps sample (its config's ``allocation.sampling``); a damaged config: ``once``."""
    try:
        return read_run_config(store).allocation.sampling
    except StoreError:
        return "once"


def damaged_tables(store: RunStore) -> list[tuple[int, str, str]]:
    """(step directory, table, reason) of every damaged table of a manifest, in the order they were computed."""
    out = []
    for s in store.steps():
        for name in store.manifest(s):
            reason = store.damage(s, name)
            if reason is not None:
                out.append((s, name, reason))
    return sorted(out, key=lambda t: _order(t[0], t[1]) if t[1] in tuple(Table) else (10**9, 0))


def plan_repair(store: RunStore) -> RerunPlan | None:
    """The rerun that recomputes from the earliest damaged table (a ``history`` table: its capability stage)."""
    damaged = damaged_tables(store)
    if not damaged:
        return None
    step, name, _ = damaged[0]
    stage = Table.CAPABILITY if name == Table.HISTORY else name
    return plan_rerun(store, step, stage, require_done=False)


def resume_step(store: RunStore, plan: RerunPlan, steps: int) -> int:
    """The step a resume after ``plan`` starts at: the first whose update is not done without the plan's tables."""
    removed = {s for s, name in plan.tables if name == Table.UPDATE}
    return first_step_not_done(store, steps, removed)


def needed_checkpoints(store: RunStore, plan: RerunPlan) -> list[int]:
    """The checkpoints the resume after ``plan`` reads (``Policy.needed_checkpoints``: under FSDP the one it
    continues from and those of the held-out evaluations before that step it must compute first, the plan's own
    or ones missing; none where the updates after the newest checkpoint are replayed)."""
    cfg = read_run_config(store)
    first = resume_step(store, plan, run_length(store, cfg))
    removed = set(plan.tables)
    evals = [e for e in run_eval_steps(store, cfg) if 0 < e < first]
    needed = [e for e in evals if (e, Table.EVAL) in removed or not store.is_done(e, Table.EVAL)]
    return policy_class(cfg).needed_checkpoints(store, first, needed)


def check_plan(store: RunStore, plan: RerunPlan) -> None:
    """Refuse (StoreError, one line) a plan whose resume would need a checkpoint that is missing or damaged;
    the line names the rerun that is possible instead: from the newest whole checkpoint at or below the
    earliest one missing (step 0: the base model), the first rerun from there that needs nothing missing."""
    missing = [k for k in needed_checkpoints(store, plan) if not whole_checkpoint(store, k)]
    if not missing:
        return
    first_stage = step_stages(_sampling(store))[0]
    possible = 0
    for k in range(missing[0] - 1, 0, -1):
        if whole_checkpoint(store, k) and store.is_done(k - 1, Table.UPDATE):
            candidate = plan_rerun(store, k, first_stage, require_done=False)
            if all(whole_checkpoint(store, j) for j in needed_checkpoints(store, candidate)):
                possible = k
                break
    names = ", ".join(f"checkpoints/{k:06d}" for k in missing)
    raise StoreError(
        f"rerunning {plan.stage} at step {plan.step} needs {names} (the weights to continue or evaluate from), "
        f"missing or damaged (run.keep_checkpoints removes old ones); nothing was removed. To recompute from step "
        f"{possible} instead ({'the base model' if possible == 0 else f'checkpoints/{possible:06d}'}): "
        f"{rerun_line(store, possible, first_stage)}"
    )


def resume_weights(store: RunStore, plan: RerunPlan) -> list[str]:
    """Where the resume after ``plan`` takes its weights from, in words (``Policy.resume_lines``), one line per
    held-out evaluation it computes first and one for the step it goes on at."""
    cfg = read_run_config(store)
    first = resume_step(store, plan, run_length(store, cfg))
    removed = set(plan.tables)
    kept = sorted((k for k in store.checkpoints() if store.checkpoint_dir(k) not in plan.checkpoints), reverse=True)
    due = [
        e
        for e in run_eval_steps(store, cfg)[1:-1]
        if e <= first and ((e, Table.EVAL) in removed or not store.is_done(e, Table.EVAL))
    ]
    return policy_class(cfg).resume_lines(store, cfg, first, due, kept)


def apply_rerun(store: RunStore, plan: RerunPlan) -> None:
    """Remove what ``plan`` lists, latest outputs first, once every path is checked ``inside_run`` (a symlinked
    step directory or ``checkpoints/`` too) and the resume will find the checkpoints it needs (``check_plan``)."""
    for path in (*plan.files, *plan.checkpoints, *(store.table_path(s, name) for s, name in plan.tables)):
        inside_run(store.root, path)
    check_plan(store, plan)
    for extra in plan.files:
        if extra.is_dir():
            shutil.rmtree(extra)
        else:
            extra.unlink(missing_ok=True)
    for s, name in reversed(plan.tables):
        store.invalidate(s, name)
    for ckpt in reversed(plan.checkpoints):
        shutil.rmtree(ckpt)
