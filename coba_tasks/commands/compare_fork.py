"""`coba compare`'s forks: within a seed, the steps its strategies have in common are trained once.

Within a seed every strategy trains the same model on the same batches with the same seeds; only the
allocation differs, and an allocation of prompts never seen is uniform whatever the strategy. So the runs
of a seed are one run until the first allocation that differs (``coba_tasks.pipeline.fork`` computes
where, from the tables). The first run of a seed to train (the carrier) trains in its own process as
always, and at each step boundary (``coba_tasks.pipeline.run.watch_boundaries``) forks every later run of
the seed that has no directory yet and whose config differs only in allocation keys, once that run's fork
point is known: before the step whose budget it allocates differently. The forked run then resumes in
its own process, from there. A run with no directory whose seed has another run in ``--out`` (finished
in an earlier sitting, say) is forked from it (its resume replays the updates after the newest checkpoint that
run kept; under FSDP it needs the checkpoint the fork continues from). A run that cannot be forked trains from
its start.
``--no-fork`` trains every run from its start.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from coba_tasks.pipeline.tables import step_label

if TYPE_CHECKING:
    from coba_tasks.pipeline.config import Config
    from coba_tasks.pipeline.run import RunResources

Log = Callable[[str], None]


class Carrier:
    """The watcher of the run trained in this process: forks each of ``runs`` (run directory -> config) from
    it at the step boundary where that run's fork point is known; a run that cannot be forked is said and
    left to train from its start."""

    def __init__(self, runs: dict[Path, Config], log: Log = print) -> None:
        self.runs, self.log = dict(runs), log

    def __call__(self, res: RunResources, step: int) -> None:
        from coba_tasks.pipeline import fork

        for root, cfg in list(self.runs.items()):
            try:
                point = fork.fork_point(res.store, cfg)
                if point is None or point.step > step:
                    continue  # not decided yet, or after steps the carrier has still to finish
                fork.fork_run(res.store, root, cfg, point)
                self.log(f"{root.name}: {forked_text(res.store.root.name, point.step, cfg.run.steps)}")
            except Exception as exc:  # a fork that fails never stops the carrier: that run trains from its start
                self.log(
                    f"{root.name}: not forked from {res.store.root.name} ({type(exc).__name__}: {exc}); "
                    "it trains from its start"
                )
            del self.runs[root]


def carry(run_dir: str, runs: Sequence[tuple[str, Config]]) -> None:
    """In the process that trains ``run_dir``: fork ``runs`` ((run directory, config) pairs) from it."""
    from coba_tasks.pipeline.run import watch_boundaries

    watch_boundaries(run_dir, Carrier({Path(d).resolve(): cfg for d, cfg in runs}))


def carried_runs(
    out: Path, cfg: Config, later: Sequence[tuple[str, int]], planned: dict[tuple[str, int], tuple[list[str], Config]]
) -> list[tuple[str, int]]:
    """The (strategy, seed) runs of ``later`` that the run of ``cfg`` can carry: no directory in ``out`` yet,
    and a config (``planned``) that differs from ``cfg`` only in keys that act through the allocation."""
    from coba_tasks.pipeline.fork import shares_prefix

    return [
        (s, k)
        for s, k in later
        if not (out / f"{s}-seed{k}" / "run.json").exists() and shares_prefix(cfg, planned[(s, k)][1])
    ]


def fork_from_siblings(run_dir: Path, cfg: Config, siblings: Sequence[Path]) -> bool:
    """Fork ``run_dir`` (config ``cfg``, no directory yet) from the sibling run (same seed, in ``--out``) that
    shares the most steps with it, when one can give it (``fork_record`` then says which); whether it did."""
    from coba_tasks.pipeline import fork
    from coba_tasks.pipeline.store import RunStore

    points = []
    for sibling in siblings:
        if not (sibling / "run.json").is_file():
            continue
        try:
            store = RunStore.open(sibling)
            point = fork.fork_point(store, cfg)
        except (ValueError, OSError):  # ForkError and StoreError are ValueErrors
            continue
        if point is not None:
            points.append((point.step, str(sibling), store, point))
    for _, _, store, point in sorted(points, key=lambda p: p[:2], reverse=True):
        try:
            fork.fork_run(store, run_dir, cfg, point)
        except fork.ForkError:
            continue  # e.g. a table that does not come out of a re-write as the same bytes: the next one
        return True
    return False


def fork_record(run_dir: Path, steps: int) -> tuple[str, int] | None:
    """(the run it was forked from, the step it forked before) while a forked run is as it was forked: it
    trains from that step on and has computed nothing of it yet. None for a run that was not forked or that
    has moved since (its own steps, a rerun that removed the shared ones)."""
    import json

    from coba_tasks.pipeline.fork import FORK_FILE
    from coba_tasks.pipeline.progress import first_step_not_done
    from coba_tasks.pipeline.store import RunStore, Table

    path = run_dir / FORK_FILE
    if not path.is_file():
        return None
    record = json.loads(path.read_text(encoding="utf-8"))
    step, store = int(record["step"]), RunStore.open(run_dir)
    if first_step_not_done(store, steps) != step or store.is_done(step, Table.ROLLOUTS):
        return None
    return Path(record["from"]).name, step


def forked_text(source: str, step: int, steps: int) -> str:
    """How `coba compare` says that a run was forked from ``source`` before ``step`` (of ``steps``).

    >>> forked_text("uniform-seed0", 3, 12)
    'forked from uniform-seed0 before step 3 (4 of 12), sharing its steps 0-2 and their evaluations: training 9 steps'
    >>> forked_text("uniform-seed0", 2, 3)
    'forked from uniform-seed0 before step 2 (3 of 3), sharing its steps 0-1 and their evaluations: training 1 step'
    >>> forked_text("uniform-seed0", 1, 3)
    'forked from uniform-seed0 before step 1 (2 of 3), sharing its step 0 and its evaluations: training 2 steps'
    >>> forked_text("uniform-seed0", 0, 12)
    'forked from uniform-seed0 before step 0 (1 of 12), sharing its evaluation before training: training 12 steps'
    >>> forked_text("uniform-seed0", 12, 12)
    'forked from uniform-seed0 after its last step (every allocation gave the same rollouts): evaluating'
    """
    if step >= steps:
        return f"forked from {source} after its last step (every allocation gave the same rollouts): evaluating"
    shared = f"its steps 0-{step - 1} and their evaluations" if step > 1 else "its step 0 and its evaluations"
    shared = shared if step else "its evaluation before training"
    left = f"{steps - step} step{'s' if steps - step > 1 else ''}"
    return f"forked from {source} before {step_label(step, steps)}, sharing {shared}: training {left}"
