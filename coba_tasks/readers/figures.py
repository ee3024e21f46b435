"""A run's figures, computed once from its done tables (``coba_tasks.readers.tables``): per table
(``eval_figures``, ``capability_figures``, ``budget_figures``, ``update_figures``; ``step_figures`` for one
training step) and per run (``run_summary``, what ``coba inspect``, ``coba report`` and summary.json show;
``summary_json`` flattens it into summary.json), and the steps without signal (every group scored alike).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from datetime import date, datetime
from itertools import groupby
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from coba_tasks.core.passk import pass_at_ks
from coba_tasks.engines.verify import count_verdicts
from coba_tasks.pipeline.config_sections import MAIN_TEST_SET
from coba_tasks.pipeline.store import STAGES, SUMMARY_FILE, RunStore, Table
from coba_tasks.readers.mechanisms import mechanism_summary, mixed_prompts, run_mechanisms
from coba_tasks.readers.tables import RunTables, load_run, ordered

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
NO_SIGNAL_STEPS = 2  # steps in a row without a mixed group before the step line warns that nothing is learned
NO_SIGNAL_FIX = (
    "the prompts are too hard or too easy for the model, or the verifier never accepts its answers: read a few "
    "completions (coba inspect --run-dir DIR --step N --stage rewards), then choose other prompts "
    "(data.difficulties, data.train), raise allocation.group_size or rollout.temperature, or fix the verifier or "
    "the prompt's answer format"
)


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


def eval_table_figures(table: pd.DataFrame) -> dict[str, Any]:
    """The figures of a per-prompt evaluation table: avg@k (``accuracy``), ``greedy``, ``pass_at_k`` (k -> the
    unbiased pass@k, k = 1 .. samples), ``answered``, ``boxed``, ``prompts``, ``by_difficulty`` and
    ``by_data_source`` (source -> accuracy, pass@k, prompts); NaN figures (greedy not measured) are None."""
    figures = eval_figures(table.drop(columns="test_set", errors="ignore"))
    sources = table.groupby("data_source", sort=True) if "data_source" in table else []
    figures["by_data_source"] = {
        str(src): {k: v for k, v in eval_figures(rows).items() if k in ("accuracy", "pass_at_k", "prompts")}
        for src, rows in sources
    }
    return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in figures.items()}


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
    counted = {"samples", "solved"} <= set(table.columns)  # tables of runs made before pass@k lack the counts
    return {
        "accuracy": mean("accuracy"),
        "greedy": mean("accuracy_greedy"),
        "answered": mean("answered"),
        "boxed": mean("boxed"),
        "prompts": len(table),
        "by_difficulty": {str(plain(k)): float(v) for k, v in by_level.items()},
        # k -> mean pass@k over the prompts (unbiased estimator), k = 1 .. completions per prompt
        "pass_at_k": {str(k): v for k, v in pass_at_ks(table["samples"], table["solved"]).items()} if counted else {},
    }


def capability_figures(table: pd.DataFrame) -> dict[str, float]:
    """A capability table's figures: pass rate S, failure rate F, the Beta shape after the step (alpha, beta)
    and the one it allocated with (alpha_used, beta_used), the share of groups whose rollouts scored alike."""
    keys = ("S", "F", "alpha", "beta", "alpha_used", "beta_used", "zero_variance_groups")
    return {k: float(table.iloc[0][k]) for k in keys if k in table}


def budget_figures(table: pd.DataFrame) -> dict[str, Any]:
    """A budget table's figures: the fewest, most, mean and total rollouts per prompt."""
    b = table["budget"]
    return {"min": int(b.min()), "max": int(b.max()), "mean": float(b.mean()), "total": int(b.sum())}


def update_figures(table: pd.DataFrame) -> dict[str, float]:
    """An update table's figures (``UPDATE_FIELDS`` it holds): loss, gradient norm, entropy, KL, clip
    fraction, learning rate, tokens and the sampler/trainer log-prob gap."""
    return {k: float(table.iloc[0][k]) for k in UPDATE_FIELDS if k in table}


def step_figures(store: RunStore, step: int) -> dict[str, dict[str, Any]]:
    """The figures of training step ``step``, by stage (``budget``: the allocation it sampled with,
    ``rollouts``: their number, ``rewards``: verdict counts, ``capability``, ``update``); a stage whose table is
    not done, and the pilot's, are left out."""
    read = {
        Table.BUDGET: budget_figures,
        Table.ROLLOUTS: lambda t: {"rollouts": len(t)},
        Table.REWARDS: lambda t: count_verdicts(t["verdict"]),
        Table.CAPABILITY: capability_figures,
        Table.UPDATE: update_figures,
    }
    return {str(stage): read[stage](store.read_table(step, stage)) for stage in STAGES if store.is_done(step, stage)}


def step_row(store: RunStore, step: int, figures: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """One done training step in one flat row (the run's step table in Prefect, the payload of its
    ``coba.step.finished`` event): ``step`` (its directory), ``pass_rate`` (S, the mean over prompts),
    ``failure_rate`` (F) and the Beta shape after it (``alpha``, ``beta``), the budgets (``budget_min``,
    ``budget_mean``, ``budget_max``), ``mixed_groups`` of ``prompts``, ``n_eff`` (the update's effective number
    of prompts), ``loss``, ``grad_norm``, the rollouts it generated (every round, pilot and dropped group),
    trained on and generated by the run so far (``rollouts_generated``, ``rollouts_trained``,
    ``rollouts_generated_total``) and ``seconds`` (its stages' wall seconds, timing.json); 4 decimals,
    NaN -> None. ``figures``: the step's ``step_figures`` when the caller has them."""
    update = store.read_table(step, Table.UPDATE)
    if figures is None:  # the small tables only (a resume reads every done step's row)
        figures = {
            "capability": capability_figures(store.read_table(step, Table.CAPABILITY)),
            "budget": budget_figures(store.read_table(step, Table.BUDGET)),
            "update": update_figures(update),
        }
    cap, budget, upd = figures["capability"], figures["budget"], figures["update"]
    rewards = store.read_table(step, Table.REWARDS, columns=("prompt_id", "reward"))
    mixed = mixed_prompts(rewards)
    timing = store.read_step_json(step, "timing") if store.step_json_path(step, "timing").is_file() else {}
    row = {
        "step": step,
        "pass_rate": cap["S"],
        "failure_rate": cap["F"],
        "alpha": cap["alpha"],
        "beta": cap["beta"],
        "budget_min": budget["min"],
        "budget_mean": budget["mean"],
        "budget_max": budget["max"],
        "mixed_groups": int(mixed.sum()),
        "prompts": len(mixed),
        "n_eff": float(update["effective_prompts"].iloc[0]) if "effective_prompts" in update else math.nan,
        "loss": upd["loss"],
        "grad_norm": upd["grad_norm"],
        **generated_counts(store, step),
        "seconds": float(sum(timing.values())) if timing else math.nan,
    }
    return {k: _shown(v) for k, v in row.items()}


def generated_counts(store: RunStore, step: int) -> dict[str, int]:
    """``rollouts_generated`` by step ``step`` (every round, pilot and dropped group), ``rollouts_trained`` by its
    update, and ``rollouts_generated_total`` by the run through it (its rollouts tables' rows, from the
    manifests)."""
    rows = [int(store.manifest(s)[Table.ROLLOUTS]["rows"]) for s in range(step + 1) if store.is_done(s, Table.ROLLOUTS)]
    update = store.read_table(step, Table.UPDATE) if store.is_done(step, Table.UPDATE) else None
    return {
        "rollouts_generated": rows[-1] if rows else 0,
        "rollouts_trained": int(update["rollouts"].iloc[0]) if update is not None and "rollouts" in update else 0,
        "rollouts_generated_total": sum(rows),
    }


def heldout_rows(table: pd.DataFrame, step: int | None = None) -> list[dict[str, Any]]:
    """A held-out evaluation in rows, one per held-out set (data.test's first): ``step`` (the updates the
    weights had; None for a model evaluated on its own), ``test_set``, ``prompts``, ``avg_at_k`` (the sampled
    accuracy), ``greedy``, ``pass_at_k`` with its ``k`` (the completions per prompt; 1: pass@1 = avg@1), and
    ``level_<d>`` (avg@k by difficulty level, where the set has levels); 4 decimals, NaN -> None."""
    rows = []
    for name, rows_of_set in split_test_sets(table).items():
        fig = _set_figures(rows_of_set)
        k = max(fig["pass_at_k"], key=int, default="1")
        rows.append(
            {
                "step": step,
                "test_set": name,
                "prompts": fig["prompts"],
                "avg_at_k": fig["accuracy"],
                "greedy": fig["greedy"],
                "k": int(k),
                "pass_at_k": fig["pass_at_k"].get(k, fig["accuracy"]),
                **{f"level_{d}": v for d, v in fig["by_difficulty"].items()},
            }
        )
    return [{k: _shown(v) for k, v in row.items()} for row in rows]


def _shown(value: Any) -> Any:
    """``plain(value)``, a float rounded to 4 decimals (figures to read; the tables keep every digit)."""
    value = plain(value)
    return round(value, 4) if isinstance(value, float) else value


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
    over done updates of their mean train/rollout log-prob gap, and the largest token gap), ``mechanisms``
    (``mechanisms.mechanism_summary``: the means over steps of the estimates' error against the realized
    pass rates, N_eff, mixed groups and pass@2, first-solved prompts, the estimates' error by age; None
    before a step has rewards).

    Raises:
        ValueError: ``run_dir`` is not a run directory (``StoreError``), or a done table is corrupt.
    """
    t = run if isinstance(run, RunTables) else load_run(run)
    steps_done = t.steps_with(Table.UPDATE)

    evals = t.steps_with(Table.EVAL)
    heldout = []
    for s in evals:
        ev = split_test_sets(t.table(s, Table.EVAL))[MAIN_TEST_SET]
        has_acc = "accuracy" in ev.columns
        item: dict[str, Any] = {
            "step": s,
            "accuracy": float(ev["accuracy"].astype(float).mean()) if has_acc and len(ev) else None,
            "prompts": len(ev),
        }
        if "difficulty" in ev.columns and has_acc:
            item["by_difficulty"] = _group_means(ev, "difficulty", "accuracy")
        heldout.append(item)
    before = eval_figures(t.table(0, Table.EVAL)) if 0 in evals else None
    after = eval_figures(t.table(evals[-1], Table.EVAL)) | {"step": evals[-1]} if evals and evals[-1] > 0 else None
    gains = heldout_gains(t.table(0, Table.EVAL), t.table(evals[-1], Table.EVAL)) if before and after else {}

    def first_row(step: int, name: Table, fields: Sequence[str]) -> dict[str, Any]:
        row = t.table(step, name)
        return {"step": step} | {f: plain(row[f].iloc[0]) if len(row) else None for f in fields if f in row.columns}

    caps = t.steps_with(Table.CAPABILITY)
    capability = {
        key: first_row(caps[i], Table.CAPABILITY, CAPABILITY_FIELDS) if caps else None
        for key, i in (("first", 0), ("latest", -1))
    }

    verdict_frame, _ = t.verdicts_by_step()
    verdicts = {k: int(v) for k, v in verdict_frame.sum().items()} if len(verdict_frame) else {}

    last_update = first_row(steps_done[-1], Table.UPDATE, UPDATE_FIELDS) if steps_done else None
    updates = t.stacked(Table.UPDATE)
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
        "budget": _budget_stats(t, [s for s in steps_done if Table.BUDGET in t.done[s]]),
        "verdicts": verdicts,
        "total_rollouts": sum(
            int(t.store.manifest(s)["rollouts"].get("rows", 0)) for s in t.steps_with(Table.ROLLOUTS)
        ),
        **rollout_counts(updates),
        "last_update": last_update,
        "logprob_gap": {"mean": gap_mean, "max": gap_max},
        "no_signal": no_signal_steps(t),
        "mechanisms": mechanism_summary(run_mechanisms(t)),
    }
    return plain(summary)


def rollout_counts(updates: pd.DataFrame) -> dict[str, int | None]:
    """What the updates done trained on (``rollouts_trained``, ``tokens_trained``) and the tokens their steps
    generated (``tokens_generated``: every round, pilot and dropped group; None from runs that do not record it);
    ``updates`` is every update table, stacked (``total_rollouts`` counts the rollouts generated)."""
    if updates.empty:
        return {"rollouts_trained": 0, "tokens_trained": 0, "tokens_generated": 0}
    return {
        "rollouts_trained": int(updates["rollouts"].sum()) if "rollouts" in updates else 0,
        "tokens_trained": int(updates["tokens"].sum()) if "tokens" in updates else 0,
        "tokens_generated": int(updates["tokens_generated"].sum()) if "tokens_generated" in updates else None,
    }


def _no_signal(capability: pd.DataFrame) -> bool:
    """Whether a step's every group scored alike (``zero_variance_groups`` 1): every advantage 0, no gradient."""
    return "zero_variance_groups" in capability and float(capability["zero_variance_groups"].iloc[0]) >= 1.0


def no_signal_streak(store: RunStore, step: int) -> int:
    """How many steps in a row, ending at ``step``, had no mixed group (0 when ``step`` had one)."""
    n = 0
    while step - n >= 0 and store.is_done(step - n, Table.CAPABILITY):
        if not _no_signal(store.read_table(step - n, Table.CAPABILITY)):
            break
        n += 1
    return n


def no_signal_steps(t: RunTables) -> dict[str, Any]:
    """The done steps with no mixed group (``steps``) and the longest run of them in a row (``longest``)."""
    steps = [s for s in t.steps_with(Table.CAPABILITY) if _no_signal(t.table(s, Table.CAPABILITY))]
    runs = groupby(enumerate(steps), lambda i_s: i_s[1] - i_s[0])  # a run of consecutive steps: one key
    return {"steps": steps, "longest": max((len(list(run)) for _, run in runs), default=0)}


def summary_json(
    run: RunTables | str | os.PathLike[str],
    wall: float,
    stage_seconds: Mapping[str, float],
    step_walls: Sequence[tuple[float, float]],
) -> dict[str, Any]:
    """summary.json of a finished run: ``run_summary``'s figures flattened under the names of the
    before/after comparison, plus the timings the flow measured (``wall`` seconds in all, ``stage_seconds``
    per stage, ``step_walls``: per step its wall seconds and Prefect's share of them)."""
    t = run if isinstance(run, RunTables) else load_run(run)
    s = run_summary(t)
    before, after = s["heldout_before"] or {}, s["heldout_after"] or {}
    first, latest = s["capability"]["first"] or {}, s["capability"]["latest"] or {}

    def nan(x: Any) -> float:
        return float("nan") if x is None else float(x)

    return {
        "steps": s["steps_done"],  # run.steps, or fewer where run.rollout_budget ended the run
        "strategy": t.config_value("allocation", "strategy"),
        **{f"heldout_{k}_before": nan(before.get(k)) for k in ("accuracy", "greedy", "answered", "boxed")},
        **{f"heldout_{k}_after": nan(after.get(k)) for k in ("accuracy", "greedy", "answered", "boxed")},
        # k -> pass@k (unbiased, over the held-out prompts): the chance one of k completions is solved
        "heldout_pass_at_k_before": before.get("pass_at_k", {}),
        "heldout_pass_at_k_after": after.get("pass_at_k", {}),
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
        "total_rollouts": s["total_rollouts"],  # generated: every round, pilot and dropped group
        "rollouts_trained": s["rollouts_trained"],
        "tokens_generated": s["tokens_generated"],
        "tokens_trained": s["tokens_trained"],
        "verdicts": s["verdicts"],
        "steps_without_signal": s["no_signal"]["steps"],  # steps whose every group scored alike: nothing learned
        # means over steps: estimate vs realized pass rate, N_eff, mixed groups, pass@2; first solved in all
        "mechanisms": s["mechanisms"],
        "logprob_gap_mean": nan(s["logprob_gap"]["mean"]),  # over steps: |sampler - trainer| log p of completion tokens
        "logprob_gap_max": nan(s["logprob_gap"]["max"]),  # the largest token gap of any step
        "wall_seconds": wall,
        "stage_seconds": dict(stage_seconds),
        "step_seconds_mean": _mean_of([w for w, _ in step_walls]),
        "prefect_overhead_seconds_per_step": _mean_of([o for _, o in step_walls]),
        "run_dir": s["run_dir"],
        "config": {"lr": t.config_value("optim", "lr"), "group_size": t.config_value("allocation", "group_size")},
    }


def _mean_of(xs: list[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else float("nan")


def _budget_stats(t: RunTables, steps: list[int]) -> dict[str, Any] | None:
    """min/mean/max of the budgets used by ``steps``, and the mean per difficulty level (via prompts)."""
    if not steps:
        return None
    budgets = pd.concat([t.table(s, Table.BUDGET) for s in steps], ignore_index=True)
    if "budget" not in budgets.columns or budgets.empty:
        return None
    figures = budget_figures(budgets)
    stats: dict[str, Any] = {"steps": len(steps), "rows": len(budgets)}
    stats |= {k: float(figures[k]) for k in ("min", "mean", "max")} | {"mean_by_difficulty": None}
    prompts = t.prompts()
    if prompts is not None and "prompt_id" in budgets.columns and {"prompt_id", "difficulty"} <= set(prompts.columns):
        left = budgets[["prompt_id", "budget"]].assign(prompt_id=lambda d: d["prompt_id"].astype(str))
        right = prompts[["prompt_id", "difficulty"]].assign(prompt_id=lambda d: d["prompt_id"].astype(str))
        merged = left.merge(right.drop_duplicates("prompt_id"), on="prompt_id", how="inner")
        if not merged.empty:
            stats["mean_by_difficulty"] = _group_means(merged, "difficulty", "budget")
    return stats


# --- Helpers


def _group_means(df: pd.DataFrame, by: str, col: str) -> dict[str, float]:
    means = df.groupby(by, sort=True)[col].mean()
    return {str(plain(k)): float(v) for k, v in means.items()}


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
