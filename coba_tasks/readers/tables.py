"""A run's done tables, read on first use and kept: what every reader of a run starts from.

``load_run(run_dir)`` gives ``RunTables``: only *done* tables count (an entry in the step's manifest and
the file present, ``RunStore.is_done``), so a run still going can be read at any moment, and each table is
read (and checked against its manifest entry) at most once. ``coba inspect``, ``coba report``, the
trackers, the summary and ``coba compare`` read runs through it. Where each table lives (a budget in the
directory of the step that uses it) is the store's rule: ``coba_tasks.pipeline.tables.Table``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from coba_tasks.engines.verify import VerdictKind, count_verdicts
from coba_tasks.pipeline.store import SUMMARY_FILE, RunStore, StoreError, Table
from coba_tasks.readers.choices import TABLE_NAMES as TABLE_ORDER  # the order a step produces them

VERDICTS = tuple(kind.value for kind in VerdictKind)
_VERDICT_PREFIX = "verdict_"


@dataclass
class RunTables:
    """The done tables of a run directory, read on first use and kept."""

    store: RunStore
    config: dict[str, Any]
    steps: list[int]  # step directories, ascending
    done: dict[int, set[str]]  # step -> names of its done tables
    _cache: dict[tuple[int, str], pd.DataFrame] = field(default_factory=dict, repr=False)

    def table(self, step: int, name: str) -> pd.DataFrame:
        """A done table (read and checked against its manifest entry once)."""
        key = (step, str(name))
        if key not in self._cache:
            self._cache[key] = self.store.read_table(step, name)
        return self._cache[key]

    def steps_with(self, name: str) -> list[int]:
        """The steps where table ``name`` is done, ascending."""
        return [s for s in self.steps if name in self.done[s]]

    def stacked(self, name: str) -> pd.DataFrame:
        """Table ``name`` of every step where it is done, one frame sorted by step (``step`` column added
        where the table has none); empty when it is done nowhere."""
        parts = []
        for s in self.steps_with(name):
            t = self.table(s, name)
            parts.append(t if "step" in t.columns else t.assign(step=s))
        return pd.concat(parts, ignore_index=True).sort_values("step", kind="stable") if parts else pd.DataFrame()

    def by_step(self, name: str) -> dict[int, pd.DataFrame]:
        """step -> table ``name``, for every step where it is done."""
        return {s: self.table(s, name) for s in self.steps_with(name)}

    def prompts(self) -> pd.DataFrame | None:
        return self.store.read_run_table("prompts") if self.store.has_run_table("prompts") else None

    def summary_file(self) -> dict[str, Any] | None:
        """summary.json (written when the run finished), or None."""
        if not (self.store.root / SUMMARY_FILE).is_file():
            return None
        try:
            loaded = self.store.read_json(SUMMARY_FILE)
        except (StoreError, OSError, ValueError):
            return None
        return loaded if isinstance(loaded, dict) else None

    def config_value(self, section: str, key: str) -> Any:
        part = self.config.get(section)
        return part.get(key) if isinstance(part, dict) else None

    def verdicts_by_step(self) -> tuple[pd.DataFrame, list[int]]:
        """(index step, one column per verdict) counts, and the steps counted from rewards.parquet because
        their capability table (which holds the counts) is not done yet."""
        rows: dict[int, dict[str, int]] = {}
        from_rewards: list[int] = []
        for s in self.steps:
            if Table.CAPABILITY in self.done[s]:
                cap = self.table(s, Table.CAPABILITY)
                rows[s] = {v: int(cap[c].fillna(0).sum()) for v in VERDICTS if (c := f"{_VERDICT_PREFIX}{v}") in cap}
            elif Table.REWARDS in self.done[s]:
                rows[s] = count_verdicts(self.table(s, Table.REWARDS)["verdict"])
                from_rewards.append(s)
        frame = pd.DataFrame.from_dict(rows, orient="index", columns=list(VERDICTS)).fillna(0).astype(int)
        return frame.sort_index(), from_rewards


def load_run(run_dir: str | os.PathLike[str]) -> RunTables:
    """The done tables of the run in ``run_dir``; a ValueError (``StoreError``) when it holds no run."""
    path = Path(run_dir) if run_dir is not None else None
    if path is None or not path.exists():
        raise ValueError(f"{run_dir}: no such run directory")
    if not path.is_dir():
        raise ValueError(f"{path}: not a directory (expected a run directory written by `coba run`)")
    store = RunStore.open(run_dir)
    try:
        config = store.read_config()
    except (OSError, ValueError):  # config.yaml missing or unreadable: the figures go on without it
        config = {}
    steps = store.steps()
    done = {s: {n for n in store.manifest(s) if store.table_path(s, n).is_file()} for s in steps}
    return RunTables(store=store, config=config if isinstance(config, dict) else {}, steps=steps, done=done)


def ordered(names: set[str]) -> list[str]:
    """Table names in the order a step produces them, then any others alphabetically."""
    return [n for n in TABLE_ORDER if n in names] + sorted(n for n in names if n not in TABLE_ORDER)
