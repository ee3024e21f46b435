"""The PNG plots of ``coba report``: one function per plot, each drawing a run's ``RunTables`` into a file.

``coba_tasks.readers.report`` loads the run and calls these (matplotlib on the Agg backend, imported
lazily); each ``plot_*`` renders one figure and writes it atomically. Every x axis is the step ``t``
of the run's tables (the policy after ``t`` updates); see ``coba_tasks.readers.report`` for what each
file shows. ``pick_scatter_steps`` chooses the steps of the budget-vs-pass-rate scatter and
``stage_timing`` reads the stage seconds of summary.json (or says why there are none).
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from coba_tasks.engines.fileio import atomic_write
from coba_tasks.pipeline.config_sections import MAIN_TEST_SET
from coba_tasks.pipeline.store import SUMMARY_FILE, Table
from coba_tasks.readers.figures import split_test_sets
from coba_tasks.readers.mechanisms import PASS_AT, by_age, run_mechanisms
from coba_tasks.readers.tables import VERDICTS, RunTables
from coba_tasks.readers.text import step_ranges

DPI = 110
VERDICT_COLOURS = {
    "correct": "#2ca02c",
    "wrong": "#d62728",
    "no_answer": "#ff7f0e",
    "timeout": "#9467bd",
    "error": "#404040",
}
SCATTER_STEPS_DEFAULT = 4  # how many evenly spaced budget steps the scatter shows by default
UNSEEN_X = -0.1  # where the scatter puts prompts without a pass-rate estimate


def _pyplot():
    """pyplot on the Agg backend (imported lazily: the CLI should not pay for matplotlib on every call)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _subplots(*grid: int, **kw):
    return _pyplot().subplots(*grid, layout="constrained", **kw)


def _legend_right(ax, **kw) -> None:
    """The legend outside the axes, on their right."""
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9, frameon=False, **kw)


def _save(fig, path: Path) -> Path:
    """Render ``fig`` to PNG bytes and write them atomically; close the figure. The image is quantized to a
    palette of 256 colours (Pillow): a plot has few colours, and the report's artifact carries every plot inline."""
    from PIL import Image

    buf = io.BytesIO()
    try:
        fig.savefig(buf, format="png", dpi=DPI)
    finally:
        _pyplot().close(fig)
    out = io.BytesIO()
    Image.open(io.BytesIO(buf.getvalue())).convert("RGB").quantize(colors=256).save(out, format="PNG", optimize=True)
    data = out.getvalue()
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


def plot_accuracy(run: RunTables, path: Path) -> Path:
    fig, ax = _subplots(figsize=(9.5, 5.2))
    evals = run.by_step(Table.EVAL)
    eval_steps = sorted(evals)
    all_steps: list[int] = list(eval_steps)
    by_set = {s: split_test_sets(evals[s]) for s in eval_steps}
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
                cmap = _pyplot().get_cmap("viridis")
                for i, level in enumerate(levels):
                    by = ev[ev["difficulty"] == level].groupby("_step")["accuracy"].mean()
                    colour = cmap(i / max(1, len(levels) - 1) * 0.9)
                    label = f"held-out, difficulty {int(level)}"
                    ax.plot(by.index, by.values, ".-", lw=1.0, ms=4, color=colour, alpha=0.85, label=label)
    cap = run.stacked(Table.CAPABILITY).reset_index(drop=True)
    if "S" in cap.columns and len(cap):
        s_steps = cap["step"].astype(int).tolist()
        all_steps += s_steps
        label = "training pass rate S (step's rollouts)"
        ax.plot(s_steps, cap["S"].astype(float), "--", color="C3", lw=1.8, label=label)
    if not all_steps:
        _no_data(ax, "no held-out evaluation or training step yet")
    _step_axis(ax, all_steps)
    ax.set_ylim(-0.02, 1.02)
    ax.set_ylabel("accuracy / pass rate")
    ax.set_title("Held-out accuracy and training pass rate per step")
    if ax.get_legend_handles_labels()[0]:
        _legend_right(ax)
    return _save(fig, path)


def plot_capability(run: RunTables, path: Path) -> Path:
    fig, (top, bottom) = _subplots(2, 1, figsize=(9.5, 6.4), sharex=True)
    cap = run.stacked(Table.CAPABILITY).reset_index(drop=True)
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
            bottom.plot(
                steps, cap[col].astype(float), "o-", ms=3.5, color=colour, lw=1.8, label=f"{col} (after step t)"
            )
    values = pd.concat([cap[c].astype(float) for c in ("alpha", "beta") if c in cap.columns] or [pd.Series([0.0])])
    finite = values[np.isfinite(values)]
    if len(finite):
        lo, hi = float(finite.min()), float(finite.max())
        pad = max(0.5, 0.08 * (hi - lo))
        bottom.set_ylim(max(0.0, lo - pad), hi + pad)
    bottom.set_ylabel("alpha, beta")
    bottom.legend(loc="center right", fontsize=9)
    _step_axis(bottom, steps)
    return _save(fig, path)


def pick_scatter_steps(run: RunTables, requested: Sequence[int] | None) -> list[int]:
    budgets = run.by_step(Table.BUDGET)
    available = sorted(budgets)
    if requested:
        missing = [s for s in requested if s not in budgets]
        if missing:
            raise ValueError(
                f"step(s) {', '.join(map(str, missing))} have no budget table "
                f"(steps with one: {step_ranges(available) or 'none'})"
            )
        return sorted(set(int(t) for t in requested))
    if len(available) <= SCATTER_STEPS_DEFAULT:
        return available
    idx = np.linspace(0, len(available) - 1, SCATTER_STEPS_DEFAULT).round().astype(int)
    return [available[i] for i in sorted(set(idx.tolist()))]


def _marker_sizes(x: pd.Series, y: pd.Series) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Collapse identical (x, y) points into one marker each: (x, y, count)."""
    counts = pd.DataFrame({"x": x.to_numpy(), "y": y.to_numpy()}).value_counts(sort=False).reset_index()
    return counts["x"].to_numpy(float), counts["y"].to_numpy(float), counts["count"].to_numpy(float)


def plot_scatter(run: RunTables, path: Path, steps: list[int]) -> Path:
    from matplotlib.lines import Line2D

    fig, ax = _subplots(figsize=(9.5, 5.6))
    any_unseen = False
    budget_min, budget_max = math.inf, 0.0
    handles: list[Line2D] = []

    def area(count: np.ndarray) -> np.ndarray:  # marker area grows with the number of prompts it stands for
        return 14.0 * np.sqrt(count) + 6.0

    for i, t in enumerate(steps):
        b = run.table(t, Table.BUDGET)
        est = pd.to_numeric(b["pass_rate_est"], errors="coerce")
        budget = pd.to_numeric(b["budget"], errors="coerce")
        colour = f"C{i % 10}"
        # Pass-rate estimates are often the same fractions; shift each step a little so every colour shows.
        dodge = (i - (len(steps) - 1) / 2) * 0.012
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
        label = f"step {t}: {int(seen.sum())} seen, {int(unseen.sum())} unseen"
        handles.append(Line2D([], [], marker="o", ls="", color=colour, alpha=0.7, ms=7, label=label))
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
        _legend_right(ax, handles=handles, title="budget used by")
    return _save(fig, path)


def plot_budget_hist(run: RunTables, path: Path) -> Path:
    fig, ax = _subplots(figsize=(9.5, 5.0))
    frames = [pd.to_numeric(b["budget"], errors="coerce") for b in run.by_step(Table.BUDGET).values() if "budget" in b]
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
        ax.set_title(f"Per-prompt budgets over {len(frames)} budget tables ({len(budgets):,} prompt-steps)")
    else:
        _no_data(ax, "no budget table yet")
        ax.set_title("Per-prompt budgets")
    ax.set_xlabel("budget (rollouts for the prompt)")
    ax.grid(True, alpha=0.3, axis="y")
    return _save(fig, path)


def plot_verdicts(run: RunTables, path: Path) -> Path:
    fig, ax = _subplots(figsize=(9.5, 5.0))
    v, from_rewards = run.verdicts_by_step()
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
        _legend_right(ax, title="verdict (total)")
    else:
        _no_data(ax, "no rewards yet")
    ax.set_ylabel("rollouts")
    title = "Verdicts of each step's rollouts"
    if from_rewards:
        title += f"\n(step {step_ranges(from_rewards)}: capability not written yet, counted from rewards)"
    ax.set_title(title)
    return _save(fig, path)


def plot_update(run: RunTables, path: Path) -> Path:
    fig, (gap_ax, norm_ax) = _subplots(1, 2, figsize=(11.0, 4.2))
    u = run.stacked(Table.UPDATE).reset_index(drop=True)
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


# The curves RL users read first (update.parquet's figures, the rollouts' lengths): (column, title)
TRAINING_CURVES = (
    ("loss", "loss"),
    ("entropy", "entropy (nats per token)"),
    ("kl", "KL to the sampling policy"),
    ("clip_frac", "clip fraction"),
    ("lr", "learning rate"),
    ("grad_norm", "gradient norm (before clipping)"),
    ("completion_tokens", "completion length (tokens, mean)"),
    ("truncated", "share truncated at rollout.max_tokens"),
)


def completion_lengths(run: RunTables) -> pd.DataFrame:
    """Per step with rollouts: ``completion_tokens`` (mean tokens of a completion) and ``truncated`` (the share that
    ended at the length limit, ``finish_reason`` ``length``), read from two columns of each rollouts table."""
    rows = []
    for s in run.steps_with(Table.ROLLOUTS):
        r = run.store.read_table(s, Table.ROLLOUTS, verify=False, columns=("n_tokens", "finish_reason"))
        rows.append(
            {
                "step": s,
                "completion_tokens": float(r["n_tokens"].mean()),
                "truncated": float((r["finish_reason"] == "length").mean()),
            }
        )
    return pd.DataFrame(rows, columns=["step", "completion_tokens", "truncated"])


def plot_training(run: RunTables, path: Path) -> Path:
    """The training curves, one panel each (``TRAINING_CURVES``): the update's loss, entropy, KL, clip fraction,
    learning rate and gradient norm, and the completions' mean length and share truncated, by step."""
    fig, axes = _subplots(2, 4, figsize=(14.0, 5.6))
    u = run.stacked(Table.UPDATE).reset_index(drop=True)
    lengths = completion_lengths(run)
    frame = u.merge(lengths, on="step", how="outer") if len(u) else lengths
    for ax, (column, title) in zip(axes.flat, TRAINING_CURVES, strict=True):
        values = frame[["step", column]].dropna() if column in frame else frame.iloc[:0]
        if len(values):
            ax.plot(values["step"], values[column], "o-", ms=3, lw=1.2)
            _step_axis(ax, values["step"].astype(int).tolist())
            ax.set_xlabel("step t")
        else:
            _no_data(ax, "not recorded")
        ax.set_title(title, fontsize=10)
        ax.grid(True, alpha=0.3)
    axes.flat[3].set_ylim(bottom=0)
    axes.flat[7].set_ylim(-0.02, 1.02)
    return _save(fig, path)


def plot_budget_map(run: RunTables, path: Path) -> Path:
    """Every prompt a budget table holds (rows, in the order of their first step) by step (columns): the budget it
    got, blank where the step's batch did not hold it. Where the allocation sends the rollouts, over the run."""
    fig, ax = _subplots(figsize=(11.0, 5.2))
    tables = run.by_step(Table.BUDGET)
    parts = [b[["prompt_id", "budget"]].assign(step=s) for s, b in tables.items() if "budget" in b]
    if parts:
        long = pd.concat(parts, ignore_index=True)
        order = long.drop_duplicates("prompt_id")["prompt_id"].tolist()
        grid = long.pivot_table(index="prompt_id", columns="step", values="budget", aggfunc="sum").reindex(order)
        image = np.ma.masked_invalid(grid.to_numpy(dtype=float))
        shown = ax.imshow(
            image,
            aspect="auto",
            interpolation="nearest",
            cmap="viridis",
            extent=(grid.columns.min() - 0.5, grid.columns.max() + 0.5, len(order) - 0.5, -0.5),
        )
        fig.colorbar(shown, ax=ax, label="budget (rollouts)")
        _step_axis(ax, [int(c) for c in grid.columns])
        ax.set_ylabel(f"prompt ({len(order)}, by first step)")
        ax.grid(False)
        ax.set_title("Budget of each prompt at each step (blank: not in that step's batch)")
    else:
        _no_data(ax, "no budget table yet")
        ax.set_title("Budget of each prompt at each step")
    return _save(fig, path)


def plot_rollouts(run: RunTables, path: Path) -> Path:
    """Left: the rollouts each step generated (every round, pilot and dropped group) and those its update trained
    on. Right: the held-out accuracy of the weights after t updates against the rollouts generated before them
    (steps 0..t-1): the x axis on which runs that spend differently per step compare."""
    fig, (per_step, by_budget) = _subplots(1, 2, figsize=(11.0, 4.2))
    steps = run.steps_with(Table.ROLLOUTS)
    generated = [int(run.store.manifest(s)[Table.ROLLOUTS]["rows"]) for s in steps]
    if steps:
        per_step.plot(steps, generated, "o-", ms=4, color="C0", label="generated")
        updates = run.stacked(Table.UPDATE).reset_index(drop=True)
        if len(updates):
            per_step.plot(updates["step"], updates["rollouts"], "s--", ms=4, color="C1", label="trained on")
        per_step.legend(fontsize=9, frameon=False)
        _step_axis(per_step, steps)
    else:
        _no_data(per_step, "no rollouts yet")
    per_step.set_title("rollouts per step")
    per_step.grid(True, alpha=0.3)
    before = dict(zip([s + 1 for s in steps], np.cumsum(generated).tolist(), strict=True)) | {0: 0}
    evals = [s for s in run.steps_with(Table.EVAL) if s in before]
    if evals:
        ys = [float(split_test_sets(run.table(s, Table.EVAL))[MAIN_TEST_SET]["accuracy"].mean()) for s in evals]
        by_budget.plot([before[s] for s in evals], ys, "o-", ms=5, color="C0")
        by_budget.set_ylim(-0.02, 1.02)
    else:
        _no_data(by_budget, "no held-out evaluation yet")
    by_budget.set_xlabel("rollouts generated before the weights evaluated")
    by_budget.set_title("held-out accuracy by rollouts generated")
    by_budget.grid(True, alpha=0.3)
    return _save(fig, path)


def plot_mechanisms(run: RunTables, path: Path) -> Path:
    """Per step: N_eff of the update beside the mixed groups and the prompts; the estimates the budget was
    allocated with against the pass rates realized (MAE, bias, correlation) and pass@2; and by the
    estimates' age, their MAE and bias over the run (``coba_tasks.readers.mechanisms``)."""
    m = run_mechanisms(run)
    s = m.steps
    fig, (n_ax, e_ax, a_ax) = _subplots(1, 3, figsize=(15.0, 4.2))
    if len(s):
        steps = s["step"].astype(int).tolist()
        for col, style, label in (
            ("prompts", ":", "prompts"),
            ("mixed_groups", "s--", "mixed groups (non-zero advantage)"),
            ("effective_prompts", "o-", "N_eff of the update"),
        ):
            n_ax.plot(steps, s[col].astype(float), style, ms=4, label=label)
        _step_axis(n_ax, steps)
        n_ax.set_ylim(bottom=0)
        n_ax.legend(fontsize=9, frameon=False)
        for col, style, label in (
            ("estimate_mae", "o-", "MAE |estimate - realized|"),
            ("estimate_bias", "s--", "bias (realized - estimate)"),
            ("estimate_corr", "^:", "correlation"),
            (f"train_pass_at_{PASS_AT}", "-", f"pass@{PASS_AT} of the groups"),
        ):
            e_ax.plot(steps, s[col].astype(float), style, ms=4, label=label)
        e_ax.axhline(0.0, color="0.6", lw=0.8)
        _step_axis(e_ax, steps)
        e_ax.legend(fontsize=9, frameon=False)
    else:
        for ax in (n_ax, e_ax):
            _no_data(ax, "no step with rewards yet")
    n_ax.set_title("prompts, mixed groups and N_eff per step")
    e_ax.set_title("the allocation's estimates against the realized pass rates")
    ages = by_age(m.rows)
    if len(ages):
        x = np.arange(len(ages))
        a_ax.bar(x - 0.2, ages["estimate_mae"].astype(float), 0.4, label="MAE")
        a_ax.bar(x + 0.2, ages["estimate_bias"].astype(float), 0.4, label="bias (realized - estimate)")
        a_ax.set_xticks(x, [f"{a}\n({n})" for a, n in zip(ages["age"], ages["prompts"], strict=True)])
        a_ax.axhline(0.0, color="0.6", lw=0.8)
        a_ax.set_xlabel("age of the estimate in steps (prompts)")
        a_ax.legend(fontsize=9, frameon=False)
    else:
        _no_data(a_ax, "no estimated prompt yet")
    a_ax.set_title("the estimates' error by their age (all steps)")
    a_ax.grid(True, alpha=0.3)
    return _save(fig, path)


def plot_stage_time(stage_seconds: dict[str, float], wall: float | None, path: Path) -> Path:
    items = sorted(stage_seconds.items(), key=lambda kv: kv[1])
    fig, ax = _subplots(figsize=(9.5, 1.4 + 0.5 * len(items)))
    names, secs = [k for k, _ in items], [v for _, v in items]
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


def stage_timing(summary: dict[str, Any] | None) -> tuple[dict[str, float] | None, str]:
    """(stage -> seconds, '') or (None, why the plot is skipped)."""
    if summary is None:
        return None, f"{SUMMARY_FILE} not found (the run has not finished), so there is no stage timing yet."
    raw = summary.get("stage_seconds")
    if not isinstance(raw, dict) or not raw:
        return None, f"{SUMMARY_FILE} has no stage_seconds, so there is no stage timing."
    out = {str(k): float(v) for k, v in raw.items() if isinstance(v, int | float) and math.isfinite(v)}
    if not out:
        return None, f"{SUMMARY_FILE}: stage_seconds holds no numbers, so there is no stage timing."
    return out, ""
