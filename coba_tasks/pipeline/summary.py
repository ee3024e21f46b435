"""A run's done tables, read once, and the one summary computed from them.

``RunTables`` (``load_run``) is the loader that ``coba inspect``, ``coba report`` and the training
flow's ``summary.json`` share: it reads only *done* tables (an entry in the step's manifest and the
file present, ``RunStore.is_done``), so a run still going can be read at any moment, and each table
at most once. ``run_summary`` computes every figure the three show (``run_summary_json`` flattens
it, with the timings the flow measured, into ``summary.json``).

Step numbering: a table lives in the directory of the step that *uses* it. ``budget`` in
``steps/000007`` is the budget step 7 consumed (allocated at the end of step 6); ``eval`` in
``steps/000008`` is the held-out accuracy of the weights after 8 updates.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import date, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from coba_tasks.engines.verify import VerdictKind, count_verdicts
from coba_tasks.pipeline.config_sections import MAIN_TEST_SET
from coba_tasks.pipeline.store import SUMMARY_FILE, RunStore, Stage, StoreError, Table

if TYPE_CHECKING:  # annotations only: run.py pulls in the engines (torch), which inspect and report do not need
    from coba_tasks.pipeline.run import RunResources

TABLE_ORDER: tuple[str, ...] = tuple(t.value for t in Table)  # the order a step produces them
VERDICTS = tuple(kind.value for kind in VerdictKind)
CAPABILITY_FIELDS = ("F", "S", "alpha_used", "beta_used", "alpha", "beta")
UPDATE_FIELDS = (
    "loss",
    "grad_norm",
    "entropy",
    "kl",
    "clip_frac",
    "lr",
    "tokens",
    "logprob_diff_mean",
    "logprob_diff_max",
)
_VERDICT_PREFIX = "verdict_"
NO_SIGNAL_STEPS = 2  # steps in a row without a mixed group before the step line warns that nothing is learned
NO_SIGNAL_FIX = (
    "the prompts are too hard or too easy for the model, or the verifier never accepts its answers: read a few "
    "completions (coba inspect --run-dir DIR --step N --stage rewards), then choose other prompts "
    "(data.difficulties, data.train), raise allocation.group_size or rollout.temperature, or fix the verifier or "
    "the prompt's answer format"
)


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
            if Stage.CAPABILITY in self.done[s]:
                cap = self.table(s, Stage.CAPABILITY)
                rows[s] = {
                    v: int(cap[f"{_VERDICT_PREFIX}{v}"].fillna(0).sum())
                    for v in VERDICTS
                    if f"{_VERDICT_PREFIX}{v}" in cap
                }
            elif Stage.REWARDS in self.done[s]:
                rows[s] = count_verdicts(self.table(s, Stage.REWARDS)["verdict"])
                from_rewards.append(s)
        frame = pd.DataFrame.from_dict(rows, orient="index", columns=list(VERDICTS)).fillna(0).astype(int)
        return frame.sort_index(), from_rewards


def load_run(run_dir: str | os.PathLike[str]) -> RunTables:
    """The done tables of the run in ``run_dir`` (StoreError, a ValueError, when it holds no run)."""
    if run_dir is None or not Path(run_dir).is_dir():
        raise ValueError(f"{run_dir}: no such directory")
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


# ---------------------------------------------------------------------------------------------
# Figures


def split_test_sets(table: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """An eval table's rows by held-out set (column ``test_set``), data.test's (``MAIN_TEST_SET``) first;
    a table without the column (an older run, ``coba-eval``) is all data.test."""
    if "test_set" not in table:
        return {MAIN_TEST_SET: table}
    out = {MAIN_TEST_SET: table[table["test_set"] == MAIN_TEST_SET]}
    for name in dict.fromkeys(table["test_set"]):  # in table order
        if name != MAIN_TEST_SET:
            out[str(name)] = table[table["test_set"] == name]
    return out


def eval_figures(table: pd.DataFrame) -> dict[str, Any]:
    """Held-out figures of an eval table: accuracy (avg@k), greedy, answered, boxed, accuracy by level, of
    data.test's prompts; with extra held-out sets (``data.extra_tests``) the same figures of each under
    ``test_sets`` (set name -> figures)."""
    sets = split_test_sets(table)
    out = _set_figures(sets.pop(MAIN_TEST_SET))
    if sets:
        out["test_sets"] = {name: _set_figures(rows) for name, rows in sets.items()}
    return out


def paired_gain(before: pd.DataFrame, after: pd.DataFrame, column: str = "accuracy") -> dict[str, float]:
    """The held-out gain from ``before`` to ``after`` (two eval tables of one held-out set): the mean over
    the prompts both scored of (after - before) ``column``, and its standard error (the standard deviation
    of the per-prompt differences over the square root of their number; NaN with fewer than 2 prompts)."""
    if column not in before or column not in after:
        return {"gain": float("nan"), "se": float("nan"), "prompts": 0}
    keyed = [t.drop_duplicates("prompt_id").set_index("prompt_id")[column].astype(float) for t in (before, after)]
    diff = (keyed[1] - keyed[0]).dropna()
    n = len(diff)
    se = float(diff.std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan")
    return {"gain": float(diff.mean()) if n else float("nan"), "se": se, "prompts": n}


def heldout_gains(before: pd.DataFrame, after: pd.DataFrame) -> dict[str, dict[str, float]]:
    """``paired_gain`` of the sampled accuracy for each held-out set (data.test's first) of two eval tables."""
    b, a = split_test_sets(before), split_test_sets(after)
    return {name: paired_gain(b[name], a[name]) for name in a if name in b}


def _set_figures(table: pd.DataFrame) -> dict[str, Any]:
    def mean(col: str) -> float:  # runs made before a column existed lack it
        return float(table[col].astype(float).mean()) if col in table and len(table) else float("nan")

    by_level = table.groupby("difficulty")["accuracy"].mean() if "difficulty" in table else pd.Series(dtype=float)
    return {
        "accuracy": mean("accuracy"),
        "greedy": mean("accuracy_greedy"),
        "answered": mean("answered"),
        "boxed": mean("boxed"),
        "prompts": len(table),
        "by_difficulty": {str(plain(k)): float(v) for k, v in by_level.items()},
    }


def run_summary(run: RunTables | str | os.PathLike[str]) -> dict[str, Any]:
    """Figures about a run, finished or not; JSON-serialisable (plain numbers and strings, NaN -> None).

    Keys: ``run_dir``, ``finished``, ``wall_seconds`` (from summary.json, None while running),
    ``strategy`` and ``steps_planned`` (config), ``step_dirs`` (steps with a directory),
    ``steps_done`` (steps whose update table is done), ``last_step_done``, ``latest_step``
    (``{"step", "tables"}``: the last step directory and the tables done there), ``heldout``
    (one ``{"step", "accuracy", "prompts", "by_difficulty"}`` per evaluated step, ascending),
    ``heldout_gain`` (held-out set -> ``paired_gain`` of avg@k from step 0 to the latest evaluation),
    ``heldout_before`` / ``heldout_after`` (``eval_figures`` of the evaluation at step 0 and of the
    latest one after it), ``capability`` (``{"first", "latest"}``: the first and latest capability
    rows, each with step, F, S, alpha_used, beta_used, alpha, beta; alpha/beta are the values after
    that step's update, alpha_used/beta_used the ones that step allocated with), ``budget`` (min,
    mean, max, rows, steps and ``mean_by_difficulty`` over the budgets used by done steps),
    ``verdicts`` (verdict -> count), ``total_rollouts`` (rows of the done rollouts tables),
    ``last_update`` (the latest update row's loss, grad_norm, ...) and ``logprob_gap`` (the mean
    over done updates of their mean train/rollout log-prob gap, and the largest token gap).

    Raises:
        ValueError: ``run_dir`` is not a run directory (``StoreError``), or a done table is corrupt.
    """
    t = run if isinstance(run, RunTables) else load_run(run)
    steps_done = t.steps_with(Stage.UPDATE)

    heldout = []
    for s in t.steps_with(Table.EVAL):
        ev = split_test_sets(t.table(s, Table.EVAL))[MAIN_TEST_SET]
        item: dict[str, Any] = {"step": s, "accuracy": _mean(ev, "accuracy"), "prompts": len(ev)}
        if "difficulty" in ev.columns and "accuracy" in ev.columns:
            item["by_difficulty"] = _group_means(ev, "difficulty", "accuracy")
        heldout.append(item)
    evals = t.steps_with(Table.EVAL)
    before = eval_figures(t.table(0, Table.EVAL)) if 0 in evals else None
    after = eval_figures(t.table(evals[-1], Table.EVAL)) | {"step": evals[-1]} if evals and evals[-1] > 0 else None
    gains = heldout_gains(t.table(0, Table.EVAL), t.table(evals[-1], Table.EVAL)) if before and after else {}

    cap_steps = t.steps_with(Stage.CAPABILITY)
    capability: dict[str, Any] = {"first": None, "latest": None}
    for key, s in (("first", cap_steps[0] if cap_steps else None), ("latest", cap_steps[-1] if cap_steps else None)):
        if s is not None:
            row = t.table(s, Stage.CAPABILITY)
            capability[key] = {"step": s} | {f: _first(row, f) for f in CAPABILITY_FIELDS if f in row.columns}

    verdict_frame, _ = t.verdicts_by_step()
    verdicts = {k: int(v) for k, v in verdict_frame.sum().items()} if len(verdict_frame) else {}

    last_update = None
    if steps_done:
        row = t.table(steps_done[-1], Stage.UPDATE)
        last_update = {"step": steps_done[-1]} | {f: _first(row, f) for f in UPDATE_FIELDS if f in row.columns}
    updates = t.stacked(Stage.UPDATE)
    gap_mean = updates["logprob_diff_mean"].mean() if "logprob_diff_mean" in updates else None
    gap_max = updates["logprob_diff_max"].max() if "logprob_diff_max" in updates else None

    wall = (t.summary_file() or {}).get("wall_seconds")
    summary = {
        "run_dir": str(t.store.root.resolve()),
        "finished": (t.store.root / SUMMARY_FILE).is_file(),
        "wall_seconds": wall,
        "strategy": t.config_value("allocation", "strategy"),
        "steps_planned": t.config_value("run", "steps"),
        "step_dirs": len(t.steps),
        "steps_done": len(steps_done),
        "last_step_done": steps_done[-1] if steps_done else None,
        "latest_step": {"step": t.steps[-1], "tables": ordered(t.done[t.steps[-1]])} if t.steps else None,
        "heldout": heldout,
        "heldout_before": before,
        "heldout_after": after,
        "heldout_gain": gains,
        "capability": capability,
        "budget": _budget_stats(t, [s for s in steps_done if Stage.BUDGET in t.done[s]]),
        "verdicts": verdicts,
        "total_rollouts": sum(
            int(t.store.manifest(s)["rollouts"].get("rows", 0)) for s in t.steps_with(Stage.ROLLOUTS)
        ),
        "last_update": last_update,
        "logprob_gap": {"mean": gap_mean, "max": gap_max},
        "no_signal": no_signal_steps(t),
    }
    return plain(summary)


def _no_signal(capability: pd.DataFrame) -> bool:
    """Whether a step's every group scored alike (``zero_variance_groups`` 1): every advantage 0, no gradient."""
    return "zero_variance_groups" in capability and float(capability["zero_variance_groups"].iloc[0]) >= 1.0


def no_signal_streak(store: RunStore, step: int) -> int:
    """How many steps in a row, ending at ``step``, had no mixed group (0 when ``step`` had one)."""
    n = 0
    while step - n >= 0 and store.is_done(step - n, Stage.CAPABILITY):
        if not _no_signal(store.read_table(step - n, Stage.CAPABILITY)):
            break
        n += 1
    return n


def no_signal_steps(t: RunTables) -> dict[str, Any]:
    """The done steps with no mixed group (``steps``) and the longest run of them in a row (``longest``)."""
    steps = [s for s in t.steps_with(Stage.CAPABILITY) if _no_signal(t.table(s, Stage.CAPABILITY))]
    longest = run = 0
    for i, s in enumerate(steps):
        run = run + 1 if i and steps[i - 1] == s - 1 else 1
        longest = max(longest, run)
    return {"steps": steps, "longest": longest}


def run_summary_json(res: RunResources, wall: float) -> dict[str, Any]:
    """summary.json of a finished run: ``run_summary``'s figures flattened under the names of the
    before/after comparison, plus the timings the flow measured in this process (stage seconds, step
    seconds, Prefect's share)."""
    s = run_summary(res.store.root)
    before, after = s["heldout_before"] or {}, s["heldout_after"] or {}
    first, latest = s["capability"]["first"] or {}, s["capability"]["latest"] or {}

    def nan(x: Any) -> float:
        return float("nan") if x is None else float(x)

    walls = res.step_walls
    return {
        "steps": res.cfg.run.steps,
        "strategy": res.cfg.allocation.strategy,
        **{f"heldout_{k}_before": nan(before.get(k)) for k in ("accuracy", "greedy", "answered", "boxed")},
        **{f"heldout_{k}_after": nan(after.get(k)) for k in ("accuracy", "greedy", "answered", "boxed")},
        "heldout_accuracy_by_difficulty_before": before.get("by_difficulty", {}),
        "heldout_accuracy_by_difficulty_after": after.get("by_difficulty", {}),
        # avg@k gain on each held-out set (data.test's is "test"), paired by prompt, with its standard error
        "heldout_gain": s["heldout_gain"],
        # data.extra_tests: each held-out set's figures before and after training
        "heldout_test_sets": {
            name: {"before": (before.get("test_sets") or {}).get(name), "after": figures}
            for name, figures in (after.get("test_sets") or {}).items()
        },
        "mean_budget_by_difficulty": (s["budget"] or {}).get("mean_by_difficulty") or {},
        "alpha_beta_start": [nan(first.get("alpha_used")), nan(first.get("beta_used"))],
        "alpha_beta_end": [nan(latest.get("alpha")), nan(latest.get("beta"))],
        "total_rollouts": s["total_rollouts"],
        "verdicts": s["verdicts"],
        "steps_without_signal": s["no_signal"]["steps"],  # steps whose every group scored alike: nothing learned
        "logprob_gap_mean": nan(s["logprob_gap"]["mean"]),  # over steps: |sampler - trainer| log p of completion tokens
        "logprob_gap_max": nan(s["logprob_gap"]["max"]),  # the largest token gap of any step
        "wall_seconds": wall,
        "stage_seconds": res.stage_seconds,
        "step_seconds_mean": _mean_of([w for w, _ in walls]),
        "prefect_overhead_seconds_per_step": _mean_of([o for _, o in walls]),
        "run_dir": s["run_dir"],
        "config": {"lr": res.cfg.optim.lr, "group_size": res.cfg.allocation.group_size},
    }


def _mean_of(xs: list[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else float("nan")


def _budget_stats(t: RunTables, steps: list[int]) -> dict[str, Any] | None:
    """min/mean/max of the budgets used by ``steps``, and the mean per difficulty level (via prompts)."""
    if not steps:
        return None
    budgets = pd.concat([t.table(s, Stage.BUDGET) for s in steps], ignore_index=True)
    if "budget" not in budgets.columns or budgets.empty:
        return None
    col = budgets["budget"].astype(float)
    stats: dict[str, Any] = {
        "steps": len(steps),
        "rows": len(budgets),
        "min": col.min(),
        "mean": col.mean(),
        "max": col.max(),
        "mean_by_difficulty": None,
    }
    prompts = t.prompts()
    if prompts is not None and "prompt_id" in budgets.columns and {"prompt_id", "difficulty"} <= set(prompts.columns):
        left = budgets[["prompt_id", "budget"]].assign(prompt_id=lambda d: d["prompt_id"].astype(str))
        right = prompts[["prompt_id", "difficulty"]].assign(prompt_id=lambda d: d["prompt_id"].astype(str))
        merged = left.merge(right.drop_duplicates("prompt_id"), on="prompt_id", how="inner")
        if not merged.empty:
            stats["mean_by_difficulty"] = _group_means(merged, "difficulty", "budget")
    return stats


# ---------------------------------------------------------------------------------------------
# Helpers


def _mean(df: pd.DataFrame, col: str) -> float | None:
    if col not in df.columns or df.empty:
        return None
    return float(df[col].astype(float).mean())


def _first(df: pd.DataFrame, col: str) -> Any:
    return plain(df[col].iloc[0]) if len(df) else None


def _group_means(df: pd.DataFrame, by: str, col: str) -> dict[str, float]:
    means = df.groupby(by, sort=True)[col].mean()
    return {str(plain(k)): float(v) for k, v in means.items()}


def step_ranges(steps: Sequence[int]) -> str:
    """'0-5, 8, 10-12' for sorted step numbers.

    >>> step_ranges([0, 1, 2, 3, 4, 5, 8, 10, 11, 12]), step_ranges([])
    ('0-5, 8, 10-12', '')
    """
    out: list[str] = []
    steps = list(steps)
    i = 0
    while i < len(steps):
        j = i
        while j + 1 < len(steps) and steps[j + 1] == steps[j] + 1:
            j += 1
        out.append(str(steps[i]) if i == j else f"{steps[i]}-{steps[j]}")
        i = j + 1
    return ", ".join(out)


def figure_table(title: str, rows: list[tuple[str, Any]]) -> str:
    """A markdown page of ``rows`` as a two-column table under ``title``: what the flows' artifacts and
    the report's Prefect summary show.

    >>> print(figure_table("# Step 0", [("rollouts", 128), ("loss", "-0.0123")]), end="")
    # Step 0
    <BLANKLINE>
    | figure | value |
    |---|---|
    | rollouts | 128 |
    | loss | -0.0123 |
    """
    return "\n".join([title, "", "| figure | value |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)]) + "\n"


def plain(value: Any) -> Any:
    """``value`` as plain JSON-able Python: numpy/pandas scalars and arrays unwrapped, NaN -> None.

    >>> plain({"a": np.float64("nan"), "b": np.array([1, 2]), 3: np.int64(4)})
    {'a': None, 'b': [1, 2], '3': 4}
    """
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, np.ndarray)):
        return [plain(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if value is None or value is pd.NaT or value is pd.NA:
        return None
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (pd.Timestamp, datetime, date)):
        return value.isoformat()
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (bool, int, str)):
        return value
    try:
        if pd.isna(value):
            return None
    except (TypeError, ValueError):
        pass
    return str(value)


# ---------------------------------------------------------------------------------------------
# The one rendering of a run's figures: `coba inspect`, the end of `coba run`, the report's headline table


def run_status(s: dict[str, Any]) -> str:
    """ "finished, 10/10 steps done, 347 s" or "not finished (running or stopped), 3/10 steps done"."""
    planned = s.get("steps_planned")
    done_text = f"{s.get('steps_done', 0)}/{planned if planned is not None else '?'} steps done"
    if not s.get("finished"):
        return f"not finished (running or stopped), {done_text}"
    wall = s.get("wall_seconds")
    return f"finished, {done_text}" + (f", {wall:.0f} s" if isinstance(wall, (int, float)) else "")


def summary_rows(s: dict[str, Any]) -> list[tuple[str, str]]:
    """``run_summary``'s figures (or the same read back from JSON) as (label, text) rows: held-out accuracy
    with its paired gain, greedy, answer rates, F, alpha and beta, budgets, verdicts, the last update."""
    rows: list[tuple[str, str]] = []
    latest = s.get("latest_step")
    step_line = f"{s.get('step_dirs', 0)} directories, last done {_or_dash(s.get('last_step_done'))}"
    rows.append(("steps", step_line + f", {s.get('total_rollouts', 0):,} rollouts"))
    if latest is not None and not s.get("finished"):
        rows.append(("latest step", f"{latest['step']}: " + (", ".join(latest.get("tables") or []) or "nothing yet")))
    rows += _heldout_rows(s)
    rows += _capability_rows(s.get("capability") or {})
    rows += _budget_rows(s.get("budget"))
    verdicts = s.get("verdicts") or {}
    if verdicts:
        total = sum(verdicts.values())
        cells = [f"{k} {v:,} ({v / total:.0%})" if total else f"{k} {v:,}" for k, v in verdicts.items()]
        rows.append(("verdicts", "  ".join(cells)))
    gap = s.get("logprob_gap") or {}
    if gap.get("max") is not None:
        rows.append(
            (
                "train/rollout log-prob gap",
                f"mean over steps {_num(gap.get('mean'), '.2e')}, largest token {gap['max']:.2e}",
            )
        )
    quiet = s.get("no_signal") or {}
    if quiet.get("steps"):
        n, done = len(quiet["steps"]), s.get("steps_done", 0)
        rows.append(
            (
                "no signal",
                f"steps {step_ranges(quiet['steps'])} ({n} of {done}, {quiet['longest']} in a row): every group's "
                f"rollouts scored alike, so the update learned nothing there; {NO_SIGNAL_FIX}",
            )
        )
    upd = s.get("last_update")
    if upd:
        cells = [f"{k} {_num(upd[k], '.4g')}" for k in UPDATE_FIELDS if k in upd and k != "lr"]
        rows.append(("last update", f"step {upd['step']}: " + "  ".join(cells)))
    return rows


def _heldout_rows(s: dict[str, Any]) -> list[tuple[str, str]]:
    heldout = s.get("heldout") or []
    if not heldout:
        return [("held-out acc", "no eval yet")]
    first, last = heldout[0], heldout[-1]
    at = ", ".join(str(h["step"]) for h in heldout)
    rows = [
        (
            "held-out acc",
            f"{_num(first.get('accuracy'), '.3f')} -> {_num(last.get('accuracy'), '.3f')}"
            f"  (step {first['step']} -> step {last['step']}; evaluated at {at})",
        )
    ]
    a, b = first.get("by_difficulty") or {}, last.get("by_difficulty") or {}
    levels = _sorted_levels(set(a) | set(b))
    if levels:
        rows.append(
            ("  by difficulty", "  ".join(f"L{k} {_num(a.get(k), '.2f')}->{_num(b.get(k), '.2f')}" for k in levels))
        )
    before, after = s.get("heldout_before") or {}, s.get("heldout_after") or {}
    for name, g in (s.get("heldout_gain") or {}).items():  # avg@k, paired by prompt: step 0 -> the latest eval
        b, a = (
            (before, after)
            if name == MAIN_TEST_SET
            else ((x.get("test_sets") or {}).get(name) or {} for x in (before, after))
        )
        se = f" ± {g['se']:.3f} s.e." if g.get("se") is not None else ""
        rows.append(
            (
                "  gain",
                f"{name}: {_num(b.get('accuracy'), '.3f')} -> {_num(a.get('accuracy'), '.3f')}, "
                f"{_num(g.get('gain'), '+.3f')}{se} over {g.get('prompts', 0)} prompts",
            )
        )
    for key, label, what in (
        ("greedy", "greedy", ""),
        ("answered", "answered", " (share of completions with an answer)"),
        ("boxed", "boxed", " (share of completions with \\boxed{})"),
    ):
        b0, b1 = before.get(key), after.get(key)
        if b0 is not None and b1 is not None and (key != "boxed" or b0 > 0 or b1 > 0):
            rows.append((f"  {label}", f"{b0:.3f} -> {b1:.3f}{what}"))
    return rows


def _capability_rows(cap: dict[str, Any]) -> list[tuple[str, str]]:
    first, last = cap.get("first"), cap.get("latest")
    if not (first and last):
        return [("failure rate F", "no capability table yet")]
    f0, f1 = _num(first.get("F"), ".3f"), _num(last.get("F"), ".3f")
    a0, b0 = _num(first.get("alpha_used"), ".2f"), _num(first.get("beta_used"), ".2f")
    a1, b1 = _num(last.get("alpha"), ".2f"), _num(last.get("beta"), ".2f")
    return [
        ("failure rate F", f"{f0} -> {f1}  (step {first['step']} -> step {last['step']})"),
        ("alpha, beta", f"({a0}, {b0}) used at step {first['step']} -> ({a1}, {b1}) after step {last['step']}"),
    ]


def _budget_rows(budget: dict[str, Any] | None) -> list[tuple[str, str]]:
    if not budget:
        return [("budget", "no done step yet")]
    rows = [
        (
            "budget",
            f"min {_num(budget.get('min'), 'g')}  mean {_num(budget.get('mean'), '.2f')}  "
            f"max {_num(budget.get('max'), 'g')}  over {budget.get('steps')} steps ({budget.get('rows'):,} prompts)",
        )
    ]
    by_level = budget.get("mean_by_difficulty") or {}
    if by_level:
        rows.append(
            ("  by difficulty", "  ".join(f"L{k} {_num(by_level[k], '.1f')}" for k in _sorted_levels(by_level)))
        )
    return rows


def _num(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return format(value, spec)


def _or_dash(value: Any) -> str:
    return "-" if value is None else str(value)


def _sorted_levels(levels: Any) -> list[str]:
    """Difficulty keys (strings, from JSON) in numeric order when they are numbers."""
    return sorted(levels, key=lambda k: (0, float(k), "") if _is_number(k) else (1, 0.0, str(k)))


def _is_number(text: Any) -> bool:
    try:
        float(text)
    except (TypeError, ValueError):
        return False
    return True
