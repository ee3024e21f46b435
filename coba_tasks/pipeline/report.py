"""``coba report``: PNG plots and one HTML page for a run directory (layer 2: I/O, no Prefect).

``write_report(run_dir)`` reads the done tables of a run (it works while the run is still going:
a table counts only when the store says it is done) and writes into ``<run_dir>/report/``::

    accuracy.png             held-out accuracy per evaluated step (overall and per difficulty level)
                             and the training pass rate S per step
    capability.png           failure rate F (top) and the Beta(alpha, beta) parameters (bottom) per step
    budget_vs_pass_rate.png  per-prompt budget against the prompt's pass-rate estimate, a few steps
    budget_hist.png          histogram of per-prompt budgets over all steps
    verdicts.png             verdict counts per step (stacked bars)
    update.png               the train/rollout log-prob gap (sampler vs trainer, mean and max) and the
                             gradient norm of each step's update
    stage_time.png           seconds per stage, from summary.json (only once the run has finished)
    index.html               all of the above, a table of headline figures and the paths

Step numbers. Every plot's x axis is the step ``t`` of the run's tables: the rollouts of step ``t``
come from the weights after ``t`` updates, and ``steps/t/eval.parquet`` evaluates the same weights,
so the training pass rate and the held-out accuracy at ``t`` describe one policy. The budget table
in ``steps/t`` is the budget *used by* step ``t`` (allocated at the end of step ``t - 1``).

``report_artifacts_markdown(run_dir)`` gives a short markdown summary for a Prefect artifact;
``add_report_parser`` registers the ``coba report`` subcommand.
"""

from __future__ import annotations

import argparse
import html
import io
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from coba_tasks.pipeline.config import MAIN_TEST_SET
from coba_tasks.pipeline.fileio import atomic_write
from coba_tasks.pipeline.store import SUMMARY_FILE, RunStore, Stage
from coba_tasks.pipeline.summary import VERDICTS, load_run, run_summary, split_test_sets

# Table names (the same strings as coba_tasks.pipeline.stages, which is not imported: it pulls in torch).
BUDGET, CAPABILITY, REWARDS = Stage.BUDGET.value, Stage.CAPABILITY.value, Stage.REWARDS.value
UPDATE = Stage.UPDATE.value
EVAL = "eval"

DPI = 110
ACCURACY_PNG = "accuracy.png"
CAPABILITY_PNG = "capability.png"
SCATTER_PNG = "budget_vs_pass_rate.png"
BUDGET_HIST_PNG = "budget_hist.png"
VERDICTS_PNG = "verdicts.png"
UPDATE_PNG = "update.png"
STAGE_TIME_PNG = "stage_time.png"
INDEX_HTML = "index.html"
PLOT_FILES = (ACCURACY_PNG, CAPABILITY_PNG, SCATTER_PNG, BUDGET_HIST_PNG, VERDICTS_PNG, UPDATE_PNG, STAGE_TIME_PNG)
VERDICT_COLOURS = {
    "correct": "#2ca02c",
    "wrong": "#d62728",
    "no_answer": "#ff7f0e",
    "timeout": "#9467bd",
    "error": "#404040",
}
SCATTER_STEPS_DEFAULT = 4  # how many evenly spaced budget steps the scatter shows by default
UNSEEN_X = -0.1  # where the scatter puts prompts without a pass-rate estimate

_CAPTIONS = {
    ACCURACY_PNG: "Held-out accuracy of the weights after t updates (overall, and one thin line per difficulty "
    "level) and the training pass rate S of step t's rollouts (mean over prompts of the per-prompt pass rate).",
    CAPABILITY_PNG: "Top: failure rate F of each step's rollouts. Bottom: the Beta(alpha, beta) parameters of the "
    "capability tracker after step t (they shape the budget of step t + 1).",
    SCATTER_PNG: "Per-prompt budget used by step t against the prompt's pass-rate estimate at allocation time; "
    "prompts never seen before (no estimate) are drawn at the left with an x.",
    BUDGET_HIST_PNG: "Histogram of the per-prompt budgets (rollouts per prompt) of every budget table.",
    VERDICTS_PNG: "Verdict counts of each step's rollouts (stacked).",
    UPDATE_PNG: "Left: |sampler log p - trainer log p| over the completion tokens of step t (mean and max): the "
    "rollout engine and the trainer should agree on the policy they share; a stale weight reload, another "
    "tokenization or a dtype difference shows here. Right: the gradient norm of step t's update (before clipping).",
    STAGE_TIME_PNG: "Wall-clock seconds spent in each stage over the whole run (summary.json).",
}


# ---------------------------------------------------------------------------------------------
# Reading a run
# ---------------------------------------------------------------------------------------------


@dataclass
class _RunData:
    """The done tables of a run, gathered once."""

    store: RunStore
    config: dict[str, Any]
    summary: dict[str, Any] | None
    capability: pd.DataFrame  # one row per step with a done capability table, sorted by step
    evals: dict[int, pd.DataFrame]  # step -> eval table
    budgets: dict[int, pd.DataFrame]  # step -> budget table (the budget used by that step)
    updates: pd.DataFrame  # one row per step with a done update table, sorted by step
    verdicts: pd.DataFrame  # index step, columns VERDICTS
    verdicts_from_rewards: list[int]  # steps whose verdicts were counted from rewards.parquet (no capability yet)
    steps_done: list[int]  # steps with every stage table done
    figures: dict[str, Any]  # coba_tasks.pipeline.summary.run_summary of the same tables


def _open_run(run_dir: str | os.PathLike[str]) -> RunStore:
    path = Path(run_dir)
    if not path.exists():
        raise ValueError(f"{path}: no such run directory")
    if not path.is_dir():
        raise ValueError(f"{path}: not a directory (expected a run directory written by `coba run`)")
    return RunStore.open(path)  # StoreError (a ValueError) when it holds no run


def _load(run_dir: str | os.PathLike[str]) -> _RunData:
    _open_run(run_dir)  # the messages for a missing path or a plain file
    t = load_run(run_dir)
    capability = t.stacked(CAPABILITY).reset_index(drop=True)
    if capability.empty:
        raise ValueError(f"{t.store.root}: no steps done yet (no step has a capability table); nothing to report")
    verdicts, from_rewards = t.verdicts_by_step()
    return _RunData(
        store=t.store,
        config=t.config,
        summary=t.summary_file(),
        capability=capability,
        evals=t.by_step(EVAL),
        budgets=t.by_step(BUDGET),
        updates=t.stacked(UPDATE).reset_index(drop=True),
        verdicts=verdicts,
        verdicts_from_rewards=from_rewards,
        steps_done=t.store.steps_done(),
        figures=run_summary(t),
    )


@dataclass(frozen=True)
class Headline:
    """The headline figures of a run (None where not known yet)."""

    steps_done: int
    steps_planned: int | None
    accuracy_before: float | None
    accuracy_before_step: int | None
    accuracy_after: float | None
    accuracy_after_step: int | None
    total_rollouts: int
    strategy: str
    finished: bool
    logprob_gap: tuple[int, float, float] | None = None  # (step, mean, max) of the last update that has one

    def rows(self) -> list[tuple[str, str]]:
        """(label, value) pairs for a table."""
        planned = f" of {self.steps_planned}" if self.steps_planned is not None else ""
        return [
            ("steps done", f"{self.steps_done}{planned}" + ("" if self.finished else " (run not finished)")),
            ("held-out accuracy before", _acc_text(self.accuracy_before, self.accuracy_before_step)),
            ("held-out accuracy after", _acc_text(self.accuracy_after, self.accuracy_after_step)),
            ("total rollouts", f"{self.total_rollouts:,}"),
            ("strategy", self.strategy),
            ("train/rollout log-prob gap", _gap_text(self.logprob_gap)),
        ]


def _gap_text(gap: tuple[int, float, float] | None) -> str:
    if gap is None:
        return "not recorded"
    step, mean, largest = gap
    return f"mean {mean:.2e}, max {largest:.2e} (step {step})"


def _acc_text(value: float | None, step: int | None) -> str:
    if value is None:
        return "not evaluated yet"
    return f"{value:.4f} (step {step})"


def _headline(data: _RunData) -> Headline:
    summary = data.summary or {}
    first, last = data.figures["heldout_before"], data.figures["heldout_after"]
    before, before_step = (first["accuracy"], 0) if first else (None, None)
    after, after_step = (last["accuracy"], last["step"]) if last else (None, None)
    if before is None and isinstance(summary.get("heldout_accuracy_before"), int | float):
        before, before_step = float(summary["heldout_accuracy_before"]), 0
    if after is None and isinstance(summary.get("heldout_accuracy_after"), int | float):
        after, after_step = float(summary["heldout_accuracy_after"]), summary.get("steps")

    if isinstance(summary.get("total_rollouts"), int | float):
        total = int(summary["total_rollouts"])
    else:
        total = int(pd.to_numeric(data.capability.get("rollouts"), errors="coerce").fillna(0).sum())

    strategy = summary.get("strategy") or (data.config.get("allocation") or {}).get("strategy")
    if not strategy:
        col = [b["strategy"].iloc[0] for b in data.budgets.values() if "strategy" in b and len(b)]
        strategy = str(col[-1]) if col else "unknown"
    planned = (data.config.get("run") or {}).get("steps")
    return Headline(
        steps_done=len(data.steps_done),
        steps_planned=int(planned) if isinstance(planned, int) else None,
        accuracy_before=before,
        accuracy_before_step=before_step,
        accuracy_after=after,
        accuracy_after_step=after_step,
        total_rollouts=total,
        strategy=str(strategy),
        finished=data.summary is not None,
        logprob_gap=_last_gap(data.figures["last_update"]),
    )


def _last_gap(update: dict[str, Any] | None) -> tuple[int, float, float] | None:
    if not update or update.get("logprob_diff_mean") is None:
        return None
    return int(update["step"]), float(update["logprob_diff_mean"]), float(update["logprob_diff_max"])


# ---------------------------------------------------------------------------------------------
# Plots
# ---------------------------------------------------------------------------------------------


def _pyplot():
    """pyplot on the Agg backend (imported lazily: the CLI should not pay for matplotlib on every call)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    """Render ``fig`` to PNG bytes and write them atomically; close the figure."""
    plt = _pyplot()
    try:
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=DPI)
    finally:
        plt.close(fig)
    data = buf.getvalue()
    return atomic_write(path, lambda f: f.write(data))


def _no_data(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=11, color="0.4")


def _step_axis(ax, steps: Sequence[int]) -> None:
    """Integer step ticks and a little margin."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if len(steps):
        lo, hi = min(steps), max(steps)
        pad = max(0.5, 0.02 * (hi - lo))
        ax.set_xlim(lo - pad, hi + pad)
    ax.set_xlabel("step t (policy after t updates)")
    ax.grid(True, alpha=0.3)


def _plot_accuracy(data: _RunData, path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9.5, 5.2), layout="constrained")
    eval_steps = sorted(data.evals)
    all_steps: list[int] = list(eval_steps)
    by_set = {t: split_test_sets(data.evals[t]) for t in eval_steps}
    main = {t: sets.pop(MAIN_TEST_SET) for t, sets in by_set.items()}
    if eval_steps:
        overall = [float(main[t]["accuracy"].mean()) for t in eval_steps]
        ax.plot(eval_steps, overall, "o-", color="C0", lw=2.4, ms=6, label="held-out accuracy (all)", zorder=5)
        extra_names = list(dict.fromkeys(name for sets in by_set.values() for name in sets))
        for i, name in enumerate(extra_names):  # data.extra_tests: one line per set
            steps = [t for t in eval_steps if name in by_set[t]]
            ys = [float(by_set[t][name]["accuracy"].mean()) for t in steps]
            ax.plot(steps, ys, "s--", color=f"C{4 + i}", lw=2.0, ms=5, label=f"held-out, {name}", zorder=4)
        frames = [main[t].assign(_step=t) for t in eval_steps]
        ev = pd.concat(frames, ignore_index=True)
        if "difficulty" in ev.columns:
            diff = pd.to_numeric(ev["difficulty"], errors="coerce")
            if diff.notna().any() and not (diff.dropna() == -1).all():
                ev = ev.assign(difficulty=diff)
                levels = sorted(ev.loc[ev["difficulty"] >= 0, "difficulty"].dropna().unique())
                cmap = plt.get_cmap("viridis")
                for i, level in enumerate(levels):
                    by = ev[ev["difficulty"] == level].groupby("_step")["accuracy"].mean()
                    colour = cmap(i / max(1, len(levels) - 1) * 0.9)
                    ax.plot(
                        by.index,
                        by.values,
                        ".-",
                        lw=1.0,
                        ms=4,
                        color=colour,
                        alpha=0.85,
                        label=f"held-out, difficulty {int(level)}",
                    )
    cap = data.capability
    if "S" in cap.columns and len(cap):
        s_steps = cap["step"].astype(int).tolist()
        all_steps += s_steps
        ax.plot(
            s_steps, cap["S"].astype(float), "--", color="C3", lw=1.8, label="training pass rate S (step's rollouts)"
        )
    if not all_steps:
        _no_data(ax, "no held-out evaluation or training step yet")
    _step_axis(ax, all_steps)
    ax.set_ylim(-0.02, 1.02)
    ax.set_ylabel("accuracy / pass rate")
    ax.set_title("Held-out accuracy and training pass rate per step")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9, frameon=False)
    return _save(fig, path)


def _plot_capability(data: _RunData, path: Path) -> Path:
    plt = _pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9.5, 6.4), sharex=True, layout="constrained")
    cap = data.capability
    steps = cap["step"].astype(int).tolist()
    if "F" in cap.columns:
        top.plot(steps, cap["F"].astype(float), "o-", ms=3.5, color="C3", lw=1.8, label="F (failure rate)")
    top.set_ylim(-0.02, 1.02)
    top.set_ylabel("failure rate F")
    top.set_title("Failure rate and capability parameters per step")
    top.legend(loc="lower right", fontsize=9)
    top.grid(True, alpha=0.3)
    for col, colour in (("alpha", "C0"), ("beta", "C1")):
        if col in cap.columns:
            label = f"{col} (after step t)"
            bottom.plot(steps, cap[col].astype(float), "o-", ms=3.5, color=colour, lw=1.8, label=label)
    values = pd.concat([cap[c].astype(float) for c in ("alpha", "beta") if c in cap.columns] or [pd.Series([0.0])])
    finite = values[np.isfinite(values)]
    if len(finite):
        lo, hi = float(finite.min()), float(finite.max())
        pad = max(0.5, 0.08 * (hi - lo))
        bottom.set_ylim(max(0.0, lo - pad), hi + pad)
    bottom.set_ylabel("alpha, beta")
    bottom.legend(loc="center right", fontsize=9)
    _step_axis(bottom, steps)
    top.set_xlabel("")
    return _save(fig, path)


def _scatter_steps(data: _RunData, requested: Sequence[int] | None) -> list[int]:
    available = sorted(data.budgets)
    if requested:
        missing = [t for t in requested if t not in data.budgets]
        if missing:
            raise ValueError(
                f"step(s) {', '.join(map(str, missing))} have no budget table "
                f"(steps with one: {_ranges(available) or 'none'})"
            )
        return sorted(set(int(t) for t in requested))
    if len(available) <= SCATTER_STEPS_DEFAULT:
        return available
    idx = np.linspace(0, len(available) - 1, SCATTER_STEPS_DEFAULT).round().astype(int)
    return [available[i] for i in sorted(set(idx.tolist()))]


def _ranges(steps: Sequence[int]) -> str:
    """'0-5, 8, 10-12' for a sorted list of step numbers."""
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


def _marker_sizes(x: pd.Series, y: pd.Series) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Collapse identical (x, y) points into one marker each: (x, y, count)."""
    counts = pd.DataFrame({"x": x.to_numpy(), "y": y.to_numpy()}).value_counts(sort=False).reset_index()
    return counts["x"].to_numpy(float), counts["y"].to_numpy(float), counts["count"].to_numpy(float)


def _plot_scatter(data: _RunData, path: Path, steps: list[int]) -> Path:
    plt = _pyplot()
    from matplotlib.lines import Line2D

    fig, ax = plt.subplots(figsize=(9.5, 5.6), layout="constrained")
    any_unseen = False
    budget_min, budget_max = math.inf, 0.0
    handles: list[Line2D] = []
    n = len(steps)

    def area(count: np.ndarray) -> np.ndarray:  # marker area grows with the number of prompts it stands for
        return 14.0 * np.sqrt(count) + 6.0

    for i, t in enumerate(steps):
        b = data.budgets[t]
        est = pd.to_numeric(b["pass_rate_est"], errors="coerce")
        budget = pd.to_numeric(b["budget"], errors="coerce")
        colour = f"C{i % 10}"
        # Pass-rate estimates are often the same fractions; shift each step a little so every colour shows.
        dodge = (i - (n - 1) / 2) * 0.012
        seen = est.notna() & budget.notna()
        unseen = est.isna() & budget.notna()
        if seen.any():
            x, y, c = _marker_sizes(est[seen], budget[seen])
            ax.scatter(x + dodge, y, s=area(c), alpha=0.55, color=colour, edgecolors="none")
        if unseen.any():
            any_unseen = True
            x, y, c = _marker_sizes(pd.Series(np.full(int(unseen.sum()), UNSEEN_X)), budget[unseen])
            ax.scatter(x + dodge, y, s=area(c), marker="x", alpha=0.8, color=colour, linewidths=1.4)
        if budget.notna().any():
            budget_min = min(budget_min, float(budget.min()))
            budget_max = max(budget_max, float(budget.max()))
        handles.append(
            Line2D(
                [],
                [],
                marker="o",
                ls="",
                color=colour,
                alpha=0.7,
                ms=7,
                label=f"step {t}: {int(seen.sum())} seen, {int(unseen.sum())} unseen",
            )
        )
    if not steps:
        _no_data(ax, "no budget table yet")
    if steps and budget_min > 0:
        from matplotlib.ticker import ScalarFormatter

        ax.set_yscale("log", base=2)
        ax.yaxis.set_major_formatter(ScalarFormatter())
        # Stretch to whole powers of two so the top and bottom of the data have a labelled tick.
        lo, hi = 2.0 ** math.floor(math.log2(budget_min)), 2.0 ** math.ceil(math.log2(max(budget_max, budget_min)))
        ax.set_ylim(lo / 1.25, max(hi, lo * 2) * 1.25)
    ticks = [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    if any_unseen:
        ax.axvline(UNSEEN_X / 2, color="0.6", lw=0.8, ls=":")
        ax.set_xticks([UNSEEN_X, *ticks], ["unseen", *[f"{x:.1f}" for x in ticks]])
        ax.set_xlim(UNSEEN_X - 0.06, 1.05)
        handles.append(Line2D([], [], marker="x", ls="", color="0.3", ms=7, label="unseen prompt (no estimate)"))
    else:
        ax.set_xticks(ticks)
        ax.set_xlim(-0.05, 1.05)
    ax.set_xlabel("pass-rate estimate of the prompt (at allocation time)")
    ax.set_ylabel("budget (rollouts for the prompt)")
    ax.set_title("Budget vs. pass-rate estimate (marker area grows with the number of prompts)")
    ax.grid(True, alpha=0.3)
    if handles:
        ax.legend(
            handles=handles,
            loc="upper left",
            bbox_to_anchor=(1.01, 1.0),
            fontsize=9,
            frameon=False,
            title="budget used by",
        )
    return _save(fig, path)


def _plot_budget_hist(data: _RunData, path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9.5, 5.0), layout="constrained")
    frames = [pd.to_numeric(b["budget"], errors="coerce") for b in data.budgets.values() if "budget" in b]
    budgets = pd.concat(frames, ignore_index=True).dropna() if frames else pd.Series(dtype=float)
    if len(budgets):
        lo, hi = float(budgets.min()), float(budgets.max())
        width = max(1.0, math.ceil((hi - lo + 1) / 48))
        edges = np.arange(math.floor(lo) - 0.5, hi + width + 0.5, width)
        counts, _, _ = ax.hist(budgets, bins=edges, color="C0", edgecolor="white", linewidth=0.5)
        positive = counts[counts > 0]
        log_y = len(positive) > 0 and positive.max() / positive.min() >= 30  # a few budgets dominate
        if log_y:
            from matplotlib.ticker import ScalarFormatter

            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(ScalarFormatter())
            ax.set_ylim(bottom=0.7)
        ax.set_ylabel("prompt-steps (log scale)" if log_y else "prompt-steps")
        mean = float(budgets.mean())
        median = float(budgets.median())
        ax.axvline(mean, color="C3", ls="--", lw=1.6, zorder=3, label=f"mean {mean:.1f}")
        ax.axvline(median, color="black", ls=":", lw=1.6, zorder=3, label=f"median {median:g}")
        ax.legend(loc="upper right", fontsize=9)
        ax.set_title(f"Per-prompt budgets over {len(data.budgets)} budget tables ({len(budgets):,} prompt-steps)")
    else:
        _no_data(ax, "no budget table yet")
        ax.set_title("Per-prompt budgets")
    ax.set_xlabel("budget (rollouts for the prompt)")
    ax.grid(True, alpha=0.3, axis="y")
    return _save(fig, path)


def _plot_verdicts(data: _RunData, path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9.5, 5.0), layout="constrained")
    v = data.verdicts
    if len(v):
        steps = v.index.astype(int).to_numpy()
        bottom = np.zeros(len(v))
        for name in VERDICTS:
            counts = v[name].to_numpy(dtype=float)
            label = f"{name} ({int(counts.sum()):,})"
            ax.bar(steps, counts, bottom=bottom, width=0.8, color=VERDICT_COLOURS[name], label=label)
            bottom += counts
        _step_axis(ax, steps.tolist())
        ax.set_ylim(0, max(1.0, float(bottom.max())) * 1.02)
        ax.grid(True, alpha=0.3, axis="y")
        ax.grid(False, axis="x")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9, frameon=False, title="verdict (total)")
    else:
        _no_data(ax, "no rewards yet")
    ax.set_ylabel("rollouts")
    title = "Verdicts of each step's rollouts"
    if data.verdicts_from_rewards:
        title += f"\n(step {_ranges(data.verdicts_from_rewards)}: capability not written yet, counted from rewards)"
    ax.set_title(title)
    return _save(fig, path)


def _plot_update(data: _RunData, path: Path) -> Path:
    plt = _pyplot()
    fig, (gap_ax, norm_ax) = plt.subplots(1, 2, figsize=(11.0, 4.2), layout="constrained")
    u = data.updates
    # runs made before the sampler's log-probabilities were recorded have no gap columns
    gap = u[["step", "logprob_diff_mean", "logprob_diff_max"]].dropna() if "logprob_diff_mean" in u else u.iloc[:0]
    if len(gap):
        for col, style in (("logprob_diff_mean", "o-"), ("logprob_diff_max", "s--")):
            ys = gap[col].to_numpy(dtype=float).clip(min=1e-12)  # log axis: an exact 0 drawn at 1e-12
            gap_ax.plot(gap["step"], ys, style, ms=4, label=col.removeprefix("logprob_diff_"))
        gap_ax.set_yscale("log")
        _step_axis(gap_ax, gap["step"].astype(int).tolist())
        gap_ax.legend(fontsize=9, frameon=False)
    else:
        _no_data(gap_ax, "no sampler log-probabilities recorded")
    gap_ax.set_title("train/rollout log-prob gap |sampler - trainer|")
    gap_ax.grid(True, alpha=0.3)
    if len(u) and "grad_norm" in u:
        norm_ax.plot(u["step"], u["grad_norm"], "o-", ms=4, color="C2")
        _step_axis(norm_ax, u["step"].astype(int).tolist())
    else:
        _no_data(norm_ax, "no update yet")
    norm_ax.set_title("gradient norm (before clipping)")
    norm_ax.grid(True, alpha=0.3)
    return _save(fig, path)


def _plot_stage_time(stage_seconds: dict[str, float], wall: float | None, path: Path) -> Path:
    plt = _pyplot()
    items = sorted(stage_seconds.items(), key=lambda kv: kv[1])
    fig, ax = plt.subplots(figsize=(9.5, 1.4 + 0.5 * len(items)), layout="constrained")
    names = [k for k, _ in items]
    secs = [v for _, v in items]
    total = sum(secs)
    ax.barh(names, secs, color="C0")
    for y, s in enumerate(secs):
        share = 100 * s / total if total > 0 else 0.0
        ax.text(s, y, f" {s:.1f} s ({share:.0f}%)", va="center", fontsize=9)
    ax.set_xlim(0, max(secs) * 1.25 if secs and max(secs) > 0 else 1)
    ax.set_xlabel("seconds (whole run)")
    title = f"Time per stage: {total:.1f} s in stages"
    if wall is not None:
        title += f", {wall:.1f} s wall clock"
    ax.set_title(title)
    ax.grid(True, alpha=0.3, axis="x")
    return _save(fig, path)


def _stage_seconds(summary: dict[str, Any] | None) -> tuple[dict[str, float] | None, str]:
    """(stage -> seconds, '') or (None, why the plot is skipped)."""
    if summary is None:
        return None, f"{SUMMARY_FILE} not found (the run has not finished), so there is no stage timing yet."
    raw = summary.get("stage_seconds")
    if not isinstance(raw, dict) or not raw:
        return None, f"{SUMMARY_FILE} has no stage_seconds, so there is no stage timing."
    out: dict[str, float] = {}
    for k, v in raw.items():
        if isinstance(v, int | float) and math.isfinite(v):
            out[str(k)] = float(v)
    if not out:
        return None, f"{SUMMARY_FILE}: stage_seconds holds no numbers, so there is no stage timing."
    return out, ""


# ---------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReportFiles:
    """What ``build_report`` wrote."""

    html: Path
    pngs: list[Path]
    skipped: dict[str, str]  # PNG name -> why it was not drawn


def build_report(run_dir: str | os.PathLike[str], steps_for_scatter: Sequence[int] | None = None) -> ReportFiles:
    """Like ``write_report``, returning the HTML path, the PNG paths and the plots skipped (with why)."""
    data = _load(run_dir)
    scatter_steps = _scatter_steps(data, steps_for_scatter)
    out = data.store.report_dir()
    out.mkdir(parents=True, exist_ok=True)
    plots: list[tuple[str, Callable[[Path], Path]]] = [
        (ACCURACY_PNG, lambda p: _plot_accuracy(data, p)),
        (CAPABILITY_PNG, lambda p: _plot_capability(data, p)),
        (SCATTER_PNG, lambda p: _plot_scatter(data, p, scatter_steps)),
        (BUDGET_HIST_PNG, lambda p: _plot_budget_hist(data, p)),
        (VERDICTS_PNG, lambda p: _plot_verdicts(data, p)),
        (UPDATE_PNG, lambda p: _plot_update(data, p)),
    ]
    skipped: dict[str, str] = {}
    stage_seconds, why = _stage_seconds(data.summary)
    if stage_seconds is not None:
        wall = (data.summary or {}).get("wall_seconds")
        wall = float(wall) if isinstance(wall, int | float) else None
        plots.append((STAGE_TIME_PNG, lambda p: _plot_stage_time(stage_seconds, wall, p)))
    else:
        skipped[STAGE_TIME_PNG] = why
        (out / STAGE_TIME_PNG).unlink(missing_ok=True)  # a stale one would contradict the page
    pngs = [draw(out / name) for name, draw in plots]
    page = _html(data, _headline(data), pngs, skipped, scatter_steps)
    html_path = atomic_write(out / INDEX_HTML, lambda f: f.write(page.encode("utf-8")))
    return ReportFiles(html=html_path, pngs=pngs, skipped=skipped)


def write_report(run_dir: str | os.PathLike[str], steps_for_scatter: list[int] | None = None) -> Path:
    """Write the PNG plots and ``index.html`` into ``<run_dir>/report/``; return the HTML path.

    Args:
        run_dir: a run directory (``runs/<name>``); the run may still be going.
        steps_for_scatter: steps whose budget tables the budget-vs-pass-rate scatter shows; default: up to
            four evenly spaced steps that have one.

    Raises:
        ValueError: not a run directory, no step done yet, or a requested scatter step has no budget table.
    """
    return build_report(run_dir, steps_for_scatter).html


def _html(data: _RunData, head: Headline, pngs: list[Path], skipped: dict[str, str], scatter: list[int]) -> str:
    e = html.escape
    root = data.store.root
    name = root.resolve().name
    rows = "\n".join(f"<tr><th>{e(k)}</th><td>{e(v)}</td></tr>" for k, v in head.rows())
    paths = [("run directory", root.resolve()), ("report directory", data.store.report_dir().resolve())]
    path_rows = "\n".join(f"<tr><th>{e(k)}</th><td><code>{e(str(v))}</code></td></tr>" for k, v in paths)
    status = (
        f"finished ({SUMMARY_FILE} present)"
        if head.finished
        else f"in progress or stopped: no {SUMMARY_FILE}; figures cover the tables done so far"
    )
    figures = []
    for p in pngs:
        caption = _CAPTIONS.get(p.name, "")
        if p.name == SCATTER_PNG and scatter:
            caption += f" Steps shown: {', '.join(map(str, scatter))}."
        figures.append(
            f'<figure><img src="{e(p.name)}" alt="{e(p.stem)}">'
            f"<figcaption><code>{e(p.name)}</code>: {e(caption)}</figcaption></figure>"
        )
    for png, why in skipped.items():
        figures.append(f'<p class="skipped"><code>{e(png)}</code> not drawn: {e(why)}</p>')
    file_list = "\n".join(f"<li><code>{e(str(p.resolve()))}</code></li>" for p in pngs)
    generated = datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>coba-rl report: {e(name)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }}
table {{ border-collapse: collapse; margin: 0.5em 0 1.5em; }}
th, td {{ text-align: left; padding: 0.25em 1em 0.25em 0; border-bottom: 1px solid #ddd; }}
figure {{ margin: 1.5em 0; }}
img {{ max-width: 100%; border: 1px solid #eee; }}
figcaption {{ color: #555; font-size: 0.9em; }}
.skipped {{ color: #8a5a00; }}
</style>
</head>
<body>
<h1>coba-rl report: {e(name)}</h1>
<p>Run status: {e(status)}. Generated {e(generated)}.</p>
<h2>Headline figures</h2>
<table>
{rows}
</table>
<h2>Plots</h2>
{chr(10).join(figures)}
<h2>Paths</h2>
<table>
{path_rows}
</table>
<ul>
{file_list}
</ul>
</body>
</html>
"""


def report_artifacts_markdown(run_dir: str | os.PathLike[str]) -> str:
    """A short markdown summary for a Prefect artifact: the headline figures and the report's PNG paths.

    Lists the PNGs present in ``<run_dir>/report/`` (run ``write_report`` first to draw them).

    Raises:
        ValueError: not a run directory, or no step done yet.
    """
    data = _load(run_dir)
    head = _headline(data)
    lines = [f"### coba-rl report: `{data.store.root}`", "", "| figure | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in head.rows()]
    report = data.store.report_dir()
    pngs = [report / n for n in PLOT_FILES if (report / n).is_file()]
    lines.append("")
    if pngs:
        lines.append("Plots:")
        lines += [f"- `{p}`" for p in pngs]
        if (report / INDEX_HTML).is_file():
            lines.append(f"- page: `{report / INDEX_HTML}`")
    else:
        lines.append(f"No plots yet: run `coba report --run-dir {data.store.root}`.")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

REPORT_EPILOG = """examples:
  coba report --run-dir runs/demo                 # writes runs/demo/report/index.html and the PNGs
  coba report --run-dir runs/demo --steps 0,8,16  # the budget scatter for steps 0, 8 and 16
"""


def _step_list(text: str) -> list[int]:
    try:
        steps = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated step numbers like 0,8,16, got {text!r}") from None
    if not steps or any(s < 0 for s in steps):
        raise argparse.ArgumentTypeError(f"expected comma-separated non-negative step numbers, got {text!r}")
    return steps


def add_report_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``coba report`` on an argparse subparsers object; returns the new parser."""
    rep = subparsers.add_parser(
        "report",
        help="PNG plots and an HTML page for a run directory",
        description="Plot a run (accuracy, capability, budgets, verdicts, stage times) into <run-dir>/report/ "
        "and write report/index.html showing them with the headline figures. Works while the run is going.",
        epilog=REPORT_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    rep.add_argument("--run-dir", required=True, help="the run directory, e.g. runs/demo")
    rep.add_argument(
        "--steps",
        type=_step_list,
        default=None,
        metavar="T1,T2,...",
        help="steps for the budget-vs-pass-rate scatter (default: up to 4 evenly spaced steps)",
    )
    rep.set_defaults(func=cmd_report)
    return rep


def cmd_report(args: argparse.Namespace) -> int:
    """Write the report; print the HTML path, then the PNG paths."""
    files = build_report(args.run_dir, args.steps)
    print(files.html)
    for p in files.pngs:
        print(p)
    for png, why in files.skipped.items():
        print(f"(skipped {png}: {why})")
    return 0
