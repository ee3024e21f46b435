"""``coba report``: PNG plots and one HTML page for a run directory (a reader: no Prefect, writes only report/).

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
    mechanisms.png           per step N_eff, mixed groups, the estimates' error against the realized pass
                             rates and pass@2; the estimates' error by age (``readers.mechanisms``)
    rollouts.png             rollouts generated and trained on per step; held-out accuracy by rollouts generated
    training.png             the curves RL users read first: loss, entropy, KL, clip fraction, learning rate,
                             gradient norm, completion length and the share truncated at the length limit
    budget_map.png           every prompt (rows) by step (columns): the budget it got
    stage_time.png           seconds per stage, from summary.json (only once the run has finished)
    index.html               all of the above (from a jinja2 template, every text escaped), a table of headline
                             figures, the held-out completions of the newest evaluation, the training rollouts
                             that came back (per evaluated step a few prompts with their budget, the pass-rate
                             estimate the allocation used, their completions with rewards and verdicts:
                             ``readers.samples``) and the paths

Step numbers. Every plot's x axis is the step ``t`` of the run's tables: the rollouts of step ``t``
come from the weights after ``t`` updates, and ``steps/t/eval.parquet`` evaluates the same weights,
so the training pass rate and the held-out accuracy at ``t`` describe one policy (and ``steps/t`` holds the
budget step ``t`` used: ``coba_tasks.pipeline.tables.Table``).

``report_artifacts_markdown(run_dir)`` gives the report as markdown for a Prefect artifact (the plots inline). The
plots themselves are drawn by ``coba_tasks.readers.plots``; the ``coba report`` subcommand is
``coba_tasks.commands.report``.
"""

from __future__ import annotations

import base64
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from coba_tasks.engines.fileio import atomic_write
from coba_tasks.pipeline.store import SUMMARY_FILE, Table
from coba_tasks.readers.figures import run_summary
from coba_tasks.readers.plots import (
    pick_scatter_steps,
    plot_accuracy,
    plot_budget_hist,
    plot_budget_map,
    plot_capability,
    plot_mechanisms,
    plot_rollouts,
    plot_scatter,
    plot_stage_time,
    plot_training,
    plot_update,
    plot_verdicts,
    stage_timing,
)
from coba_tasks.readers.samples import heldout_samples, samples_sql, step_samples_for_eval
from coba_tasks.readers.tables import RunTables, load_run
from coba_tasks.readers.text import figure_table, markdown_text, run_status, summary_rows

ACCURACY_PNG = "accuracy.png"
CAPABILITY_PNG = "capability.png"
SCATTER_PNG = "budget_vs_pass_rate.png"
BUDGET_HIST_PNG = "budget_hist.png"
VERDICTS_PNG = "verdicts.png"
UPDATE_PNG = "update.png"
MECHANISMS_PNG = "mechanisms.png"
ROLLOUTS_PNG = "rollouts.png"
TRAINING_PNG = "training.png"
BUDGET_MAP_PNG = "budget_map.png"
STAGE_TIME_PNG = "stage_time.png"
INDEX_HTML = "index.html"
# every plot the report draws, in the page's order
PLOT_FILES = (ACCURACY_PNG, TRAINING_PNG, CAPABILITY_PNG, SCATTER_PNG, BUDGET_MAP_PNG, BUDGET_HIST_PNG, VERDICTS_PNG)
PLOT_FILES += (UPDATE_PNG, MECHANISMS_PNG, ROLLOUTS_PNG, STAGE_TIME_PNG)
# the plots of the Prefect artifact (inline, so it is seen without a file server): the ones read first
ARTIFACT_FILES = (ACCURACY_PNG, TRAINING_PNG, ROLLOUTS_PNG, BUDGET_MAP_PNG, MECHANISMS_PNG)

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
    MECHANISMS_PNG: "Left: per step t, the prompts, those whose rewards differ (mixed groups: a non-zero "
    "advantage) and N_eff = (sum W_i)^2 / sum W_i^2 of the update over them (W_i a prompt's weight in the loss: its "
    "tokens under the token mean). Middle: the pass-rate estimates budget(t) was allocated with against the pass "
    "rates realized at t (prompts with an estimate only): mean absolute error, bias and correlation; and pass@2 of "
    "the step's groups. Right: the same error and bias by the estimate's age, the steps since the visit it came from.",
    ROLLOUTS_PNG: "Left: the rollouts step t generated (every round, a pilot's and dropped groups' included) and "
    "those its update trained on. Right: held-out accuracy of the weights after t updates against the rollouts "
    "generated before them, the axis on which runs that spend differently per step compare.",
    STAGE_TIME_PNG: "Wall-clock seconds spent in each stage over the whole run (summary.json).",
    TRAINING_PNG: "The update of step t: its loss, the policy's entropy per token, the KL to the sampling policy, "
    "the share of tokens clipped, the learning rate and the gradient norm (before clipping); and step t's "
    "completions: their mean length in tokens and the share cut at rollout.max_tokens (finish reason length).",
    BUDGET_MAP_PNG: "Every prompt a batch held (a row each, in the order of its first step) by step: the budget "
    "the allocation gave it there; blank where the step's batch did not hold it.",
}


def _load(run_dir: str | os.PathLike[str]) -> RunTables:
    """The run's done tables; a ValueError when it has no step done yet (nothing to report)."""
    t = load_run(run_dir)
    if not t.steps_with(Table.CAPABILITY):
        raise ValueError(f"{t.store.root}: no steps done yet (no step has a capability table); nothing to report")
    return t


def _headline_rows(figures: dict[str, Any]) -> list[tuple[str, str]]:
    """The report's headline table: the same rows as ``coba inspect`` (``text.summary_rows``)."""
    return [
        ("run", run_status(figures)),
        ("strategy", str(figures.get("strategy") or "unknown")),
        *summary_rows(figures),
    ]


# --- The report


@dataclass(frozen=True)
class ReportFiles:
    """What ``build_report`` wrote."""

    html: Path
    pngs: list[Path]
    skipped: dict[str, str]  # PNG name -> why it was not drawn


def build_report(run_dir: str | os.PathLike[str], steps_for_scatter: Sequence[int] | None = None) -> ReportFiles:
    """Like ``write_report``, returning the HTML path, the PNG paths and the plots skipped (with why)."""
    data = _load(run_dir)
    figures = run_summary(data)
    summary = data.summary_file()
    scatter_steps = pick_scatter_steps(data, steps_for_scatter)
    out = data.store.report_dir()  # report/ linked out of the run: refused (StoreError) before anything is written
    out.mkdir(parents=True, exist_ok=True)
    plots: list[tuple[str, Callable[[Path], Path]]] = [
        (ACCURACY_PNG, lambda p: plot_accuracy(data, p)),
        (TRAINING_PNG, lambda p: plot_training(data, p)),
        (CAPABILITY_PNG, lambda p: plot_capability(data, p)),
        (SCATTER_PNG, lambda p: plot_scatter(data, p, scatter_steps)),
        (BUDGET_MAP_PNG, lambda p: plot_budget_map(data, p)),
        (BUDGET_HIST_PNG, lambda p: plot_budget_hist(data, p)),
        (VERDICTS_PNG, lambda p: plot_verdicts(data, p)),
        (UPDATE_PNG, lambda p: plot_update(data, p)),
        (MECHANISMS_PNG, lambda p: plot_mechanisms(data, p)),
        (ROLLOUTS_PNG, lambda p: plot_rollouts(data, p)),
    ]
    skipped: dict[str, str] = {}
    stage_seconds, why = stage_timing(summary)
    if stage_seconds is not None:
        wall = (summary or {}).get("wall_seconds")
        wall = float(wall) if isinstance(wall, int | float) else None
        plots.append((STAGE_TIME_PNG, lambda p: plot_stage_time(stage_seconds, wall, p)))
    else:
        skipped[STAGE_TIME_PNG] = why
        (out / STAGE_TIME_PNG).unlink(missing_ok=True)  # a stale one would contradict the page
    pngs = [draw(out / name) for name, draw in plots]
    page = _html(data, figures, pngs, skipped, scatter_steps)
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


def _training_samples(t: RunTables) -> list[dict[str, Any]]:
    """Per evaluated step: a few prompts of the training step that shows those weights, with their budget,
    pass-rate estimate and completions (rewards, verdicts); the query that lists them all."""
    sections = []
    shown: set[int] = set()
    for eval_step in t.steps_with(Table.EVAL):
        found = step_samples_for_eval(t, eval_step)
        if found is None or found[0] in shown:
            continue
        step, rows = found
        shown.add(step)
        prompts = []
        for pid, group in rows.groupby("prompt_id", sort=False):
            first = group.iloc[0]
            est = first["pass_rate_est"]
            completions = [
                {"verdict": str(r.verdict), "reward": f"{float(r.reward):g}", "text": str(r.completion)}
                for r in group.itertuples()
                if r.completion == r.completion
            ]
            prompts.append(
                {
                    "id": str(pid),
                    "budget": int(first["budget"]),
                    "estimate": "never seen (no estimate)" if est != est else f"{est:.2f}",
                    "prompt": str(first["prompt"]),
                    "completions": completions,
                }
            )
        sections.append(
            {
                "eval_step": eval_step,
                "step": step,
                "prompts": prompts,
                "command": f'coba inspect --run-dir {t.store.root} --sql "{samples_sql(step)}"',
            }
        )
    return sections


def _heldout(t: RunTables) -> dict[str, Any] | None:
    """The newest held-out evaluation's kept completions (``readers.samples.heldout_samples``), or None."""
    evals = t.steps_with(Table.EVAL)
    shown = heldout_samples(t, evals[-1]) if evals else None
    if shown is None or shown.empty:
        return None
    rows = []
    for r in shown.to_dict("records"):
        kinds = [("sampled", "sample")] + ([("greedy", "greedy")] if "greedy_completion" in r else [])
        rows.append(
            {
                "id": str(r["prompt_id"]),
                "level": int(r["difficulty"]),
                "accuracy": f"{float(r['accuracy']):.2f}",
                "prompt": str(r.get("prompt_text") or ""),
                "completions": [
                    {"kind": label, "verdict": str(r[f"{key}_verdict"]), "text": str(r[f"{key}_completion"])}
                    for label, key in kinds
                    if r.get(f"{key}_completion") == r.get(f"{key}_completion")  # NaN: none kept
                ],
            }
        )
    return {"step": evals[-1], "rows": rows}


PAGE_TEMPLATE = "report.html.j2"  # beside this module: the page, a jinja2 template (every value escaped)


def _html(t: RunTables, figures: dict[str, Any], pngs: list[Path], skipped: dict[str, str], scatter: list[int]) -> str:
    """The report page (``PAGE_TEMPLATE``, a jinja2 template that escapes every value: completions are untrusted)."""
    from importlib.resources import files

    import jinja2

    store = t.store
    shown = []
    for p in pngs:
        caption = _CAPTIONS.get(p.name, "")
        if p.name == SCATTER_PNG and scatter:
            caption += f" Steps shown: {', '.join(map(str, scatter))}."
        shown.append({"file": p.name, "stem": p.stem, "caption": caption})
    status = (
        f"finished ({SUMMARY_FILE} present)"
        if figures.get("finished")
        else f"in progress or stopped: no {SUMMARY_FILE}; figures cover the tables done so far"
    )
    text = files("coba_tasks.readers").joinpath(PAGE_TEMPLATE).read_text(encoding="utf-8")
    page = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined).from_string(text)
    return page.render(
        name=store.root.resolve().name,
        status=status,
        generated=datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
        rows=_headline_rows(figures),
        figures=shown,
        skipped=list(skipped.items()),
        heldout=_heldout(t),
        training=_training_samples(t),
        paths=[("run directory", str(store.root.resolve())), ("report directory", str(store.report_dir().resolve()))],
        files=[str(p.resolve()) for p in pngs],
    )


def report_artifacts_markdown(run_dir: str | os.PathLike[str], inline: bool = True) -> str:
    """The report as markdown for a Prefect artifact: the headline figures and the report's plots, those of
    ``ARTIFACT_FILES`` shown inline (a ``data:`` image: the artifact needs nothing else to be seen, in any browser)
    when ``inline``, every one with its path; the page's path. The run's paths are shown as written
    (``markdown_text``), never as markdown.

    Lists the PNGs present in ``<run_dir>/report/`` (run ``write_report`` first to draw them).

    Raises:
        ValueError: not a run directory, or no step done yet.
    """
    data = _load(run_dir)
    root = markdown_text(data.store.root)
    lines = [figure_table(f"### coba-rl report: {root}", _headline_rows(run_summary(data)))]
    report = data.store.report_dir()
    pngs = [report / n for n in PLOT_FILES if (report / n).is_file()]
    if not pngs:
        lines.append(f"No plots yet: run coba report --run-dir {root}")
        return "\n".join(lines) + "\n"
    lines.append("Plots:")
    for p in pngs:  # those read first inline, every one by its path
        if inline and p.name in ARTIFACT_FILES:
            lines += ["", f"![{p.name}](data:image/png;base64,{base64.b64encode(p.read_bytes()).decode()})", ""]
        lines.append(f"- {markdown_text(p)}")
    if (report / INDEX_HTML).is_file():
        lines.append(f"- page: {markdown_text(report / INDEX_HTML)}")
    return "\n".join(lines) + "\n"
