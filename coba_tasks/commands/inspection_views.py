"""What ``coba inspect`` prints, apart from SQL: the run summary as text, one stage's table, the prompts.

* ``format_summary``: ``run_summary``'s dict (``coba_tasks.pipeline.summary``) as aligned lines: steps
  done, held-out accuracy, the failure rate and (alpha, beta), budget statistics, verdict counts,
  rollouts, wall time (when finished);
* ``show_table``: one stage's table of one step (``steps/NNNNNN/<stage>.parquet``);
* ``show_prompts``: the run's training prompts as the model saw them;
* ``render``: a DataFrame as an aligned ``table`` (long cells cut), ``csv`` or ``json``.

Also the checks of what a caller passes (run directory, stage, step, format, limit, columns), shared
with the SQL view and the command in ``coba_tasks.commands.inspection``. Only done tables are read,
through ``RunStore.read_table`` (each file's sha256 checked against the manifest); see
``coba_tasks.commands.inspection`` for the step numbering.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from coba_tasks.pipeline.store import RunStore
from coba_tasks.pipeline.summary import TABLE_ORDER, UPDATE_FIELDS, load_run, ordered, plain, step_ranges

# The per-step tables, in the order a step produces them (budget first: it is written into the
# step's directory before the step runs). ``history`` is the per-step snapshot of the pass-rate
# history, ``eval`` the held-out evaluation (only on evaluated steps).
TABLE_NAMES: tuple[str, ...] = TABLE_ORDER  # what `coba inspect --stage` shows: every table of a step
FORMATS: tuple[str, ...] = ("table", "csv", "json")
DEFAULT_LIMIT = 20

_CELL_WIDTH = 48  # characters a cell may take in the ``table`` format before it is cut


# ---------------------------------------------------------------------------------------------
# Summary (computed in coba_tasks.pipeline.summary, shared with the report and summary.json)


def format_summary(summary: dict[str, Any]) -> str:
    """``run_summary``'s dict (or the same read back from JSON) as aligned lines of text."""
    s = summary
    lines = []
    planned = s.get("steps_planned")
    done_text = f"{s.get('steps_done', 0)}/{planned if planned is not None else '?'} steps done"
    if s.get("finished"):
        wall = s.get("wall_seconds")
        status = f"finished, {done_text}" + (f", {wall:.0f} s" if isinstance(wall, (int, float)) else "")
    else:
        status = f"not finished (running or stopped), {done_text}"
    lines.append(f"run {s.get('run_dir')}: {status}, strategy {s.get('strategy') or '?'}")

    latest = s.get("latest_step")
    step_line = f"{s.get('step_dirs', 0)} directories, last done {_or_dash(s.get('last_step_done'))}"
    step_line += f", {s.get('total_rollouts', 0):,} rollouts"
    lines.append(_row("steps", step_line))
    if latest is not None and not s.get("finished"):
        tables = ", ".join(latest.get("tables") or []) or "nothing yet"
        lines.append(_row("latest step", f"{latest['step']}: {tables}"))

    heldout = s.get("heldout") or []
    if heldout:
        first, last = heldout[0], heldout[-1]
        at = ", ".join(str(h["step"]) for h in heldout)
        lines.append(
            _row(
                "held-out acc",
                f"{_num(first.get('accuracy'), '.3f')} -> {_num(last.get('accuracy'), '.3f')}"
                f"  (step {first['step']} -> step {last['step']}; evaluated at {at})",
            )
        )
        a, b = first.get("by_difficulty") or {}, last.get("by_difficulty") or {}
        levels = _sorted_levels(set(a) | set(b))
        if levels:
            cells = [f"L{k} {_num(a.get(k), '.2f')}->{_num(b.get(k), '.2f')}" for k in levels]
            lines.append(_row("  by difficulty", "  ".join(cells)))
    else:
        lines.append(_row("held-out acc", "no eval yet"))

    cap = s.get("capability") or {}
    first, last = cap.get("first"), cap.get("latest")
    if first and last:
        lines.append(
            _row(
                "failure rate F",
                f"{_num(first.get('F'), '.3f')} -> {_num(last.get('F'), '.3f')}"
                f"  (step {first['step']} -> step {last['step']})",
            )
        )
        start = (first.get("alpha_used"), first.get("beta_used"))
        end = (last.get("alpha"), last.get("beta"))
        lines.append(
            _row(
                "alpha, beta",
                f"({_num(start[0], '.2f')}, {_num(start[1], '.2f')}) used at step {first['step']} -> "
                f"({_num(end[0], '.2f')}, {_num(end[1], '.2f')}) after step {last['step']}",
            )
        )
    else:
        lines.append(_row("failure rate F", "no capability table yet"))

    budget = s.get("budget")
    if budget:
        lines.append(
            _row(
                "budget",
                f"min {_num(budget.get('min'), 'g')}  mean {_num(budget.get('mean'), '.2f')}  "
                f"max {_num(budget.get('max'), 'g')}  over {budget.get('steps')} steps "
                f"({budget.get('rows'):,} prompts)",
            )
        )
        by_level = budget.get("mean_by_difficulty") or {}
        if by_level:
            cells = [f"L{k} {_num(by_level[k], '.1f')}" for k in _sorted_levels(by_level)]
            lines.append(_row("  by difficulty", "  ".join(cells)))
    else:
        lines.append(_row("budget", "no done step yet"))

    verdicts = s.get("verdicts") or {}
    if verdicts:
        total = sum(verdicts.values())
        cells = [f"{k} {v:,} ({v / total:.0%})" if total else f"{k} {v:,}" for k, v in verdicts.items()]
        lines.append(_row("verdicts", "  ".join(cells)))
    upd = s.get("last_update")
    if upd:
        cells = [f"{k} {_num(upd[k], '.4g')}" for k in UPDATE_FIELDS if k in upd and k != "lr"]
        lines.append(_row("last update", f"step {upd['step']}: " + "  ".join(cells)))
    return "\n".join(lines)


def _row(label: str, text: str) -> str:
    return f"{label:<16} {text}"


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


# ---------------------------------------------------------------------------------------------
# One table


def show_table(
    run_dir: str | os.PathLike[str],
    step: int,
    stage: str,
    limit: int | None = DEFAULT_LIMIT,
    columns: Sequence[str] | None = None,
    fmt: str = "table",
) -> str:
    """The table of one stage at one step, formatted.

    Args:
        run_dir: the run directory.
        step: the step directory (``steps/000007`` for 7; budget: see ``coba_tasks.commands.inspection``).
        stage: one of ``TABLE_NAMES``.
        limit: the first ``limit`` rows; None or 0 shows every row.
        columns: column names to keep, in this order; None keeps all.
        fmt: ``table`` (aligned text, long cells cut, a footer when rows were left out), ``csv``
            or ``json`` (one JSON array of records).

    Raises:
        ValueError: not a run, bad step/stage/format/column, or the stage is not done at that step
            (the message lists the tables done there).
    """
    store = open_run(run_dir)
    _check_stage(stage)
    _check_format(fmt)
    step = _check_step(step)
    limit = _check_limit(limit)
    steps = store.steps()
    if step not in steps:
        where = f"steps there: {step_ranges(steps)}" if steps else "no step has a directory yet"
        raise ValueError(f"step {step} has no directory in {store.root} ({where})")
    done = load_run(store.root).done[step]
    if stage not in done:
        raise ValueError(
            f"stage {stage!r} is not done at step {step} yet (done there: {', '.join(ordered(done)) or 'nothing'})"
        )
    df = store.read_table(step, stage)
    df = select_columns(df, columns, f"{stage} at step {step}")
    total = len(df)
    if limit:
        df = df.head(limit)
    note = None
    if stage == "budget":
        note = f"(the budget step {step} uses, allocated at the end of step {step - 1})" if step else None
    return render(df, fmt, total=total, note=note)


PROMPT_COLUMNS = ("prompt_id", "difficulty", "prompt_tokens", "prompt_rendered")  # what --prompts shows by default


def show_prompts(
    run_dir: str | os.PathLike[str],
    limit: int | None = DEFAULT_LIMIT,
    columns: Sequence[str] | None = None,
    fmt: str = "table",
) -> str:
    """The run's training prompts as the model saw them: ``prompt_rendered`` is the exact text the rollout
    engine received (chat template applied, or the raw user message) and ``prompt_tokens`` its length in
    tokens (``prompt_token_ids``, the same ids the trainer reads). ``columns`` may name any column of
    prompts.parquet (e.g. ``messages``, ``prompt_token_ids``, ``ground_truth``)."""
    store = open_run(run_dir)
    _check_format(fmt)
    limit = _check_limit(limit)
    df = store.read_run_table("prompts")
    if "prompt_token_ids" in df:
        df.insert(len(df.columns), "prompt_tokens", [len(ids) for ids in df["prompt_token_ids"]])
    if columns is None:
        columns = [c for c in PROMPT_COLUMNS if c in df.columns] or None
    df = select_columns(df, columns, "prompts")
    total = len(df)
    return render(df.head(limit) if limit else df, fmt, total=total)


def render(df: pd.DataFrame, fmt: str = "table", total: int | None = None, note: str | None = None) -> str:
    """``df`` as ``table`` (aligned, long cells cut), ``csv`` or ``json`` (an array of records).

    ``total`` (the row count before a limit) and ``note`` only add a footer to the ``table`` format.

    >>> print(render(pd.DataFrame({"a": [1, 2], "ids": [[1, 2, 3], []]})))
     a       ids
     1 [1, 2, 3]
     2        []
    """
    _check_format(fmt)
    if fmt == "json":
        records = [{str(k): plain(v) for k, v in zip(df.columns, row, strict=True)} for row in df.itertuples(False)]
        return json.dumps(records, ensure_ascii=False, allow_nan=False)
    if fmt == "csv":
        out = df.copy()
        for col in out.columns:
            if out[col].dtype == object:
                out[col] = [_csv_cell(v) for v in out[col]]
        return out.to_csv(index=False).rstrip("\n")
    if df.columns.empty or df.empty:
        text = "(no rows; columns: " + (", ".join(map(str, df.columns)) or "none") + ")"
    else:
        shown = df.copy()
        for col in shown.columns:
            if shown[col].dtype == object or pd.api.types.is_string_dtype(shown[col].dtype):
                shown[col] = [_short(v) for v in shown[col]]
        text = shown.to_string(index=False)
    footer = []
    if total is not None and total > len(df):
        footer.append(f"({len(df)} of {total} rows shown)")
    if note:
        footer.append(note)
    return "\n".join([text, *footer])


def _short(value: Any, width: int = _CELL_WIDTH) -> str:
    """A cell as text of at most ``width`` characters; sequences say how long they were.

    >>> _short(list(range(100)), 30)
    '[0, 1, 2, 3, 4, 5, …] (100)'
    >>> _short("abc"), _short(None)
    ('abc', 'None')
    """
    cell = plain(value)
    if isinstance(cell, list):
        text = "[" + ", ".join(json.dumps(v, ensure_ascii=False) if isinstance(v, str) else str(v) for v in cell) + "]"
        if len(text) <= width:
            return text
        suffix = f", …] ({len(cell)})"
        head = text[: max(width - len(suffix), 1)]
        head = head[: head.rfind(",")] if "," in head else head
        return head + suffix
    text = str(cell).replace("\n", "\\n")
    return text if len(text) <= width else text[: width - 1] + "…"


def _csv_cell(value: Any) -> Any:
    cell = plain(value)
    if isinstance(cell, (list, dict)):
        return json.dumps(cell, ensure_ascii=False)
    return cell


def select_columns(df: pd.DataFrame, columns: Sequence[str] | None, what: str) -> pd.DataFrame:
    if columns is None:
        return df
    if isinstance(columns, str):
        columns = [columns]
    columns = list(columns)
    if not columns:
        raise ValueError("columns: give at least one column name")
    valid = [str(c) for c in df.columns]
    unknown = [c for c in columns if c not in valid]
    if unknown:
        raise ValueError(f"unknown column {unknown[0]!r} in {what}; valid columns: {', '.join(valid)}")
    return df[columns]


# ---------------------------------------------------------------------------------------------
# Helpers


def open_run(run_dir: str | os.PathLike[str]) -> RunStore:
    if run_dir is None or not Path(run_dir).is_dir():
        raise ValueError(f"{run_dir}: no such directory")
    return RunStore.open(run_dir)


def _check_stage(stage: Any) -> None:
    if stage not in TABLE_NAMES:
        raise ValueError(f"unknown stage {stage!r}; stages: {', '.join(TABLE_NAMES)}")


def _check_format(fmt: Any) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; formats: {', '.join(FORMATS)}")


def _check_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise ValueError(f"step must be a non-negative integer, got {step!r}")
    return int(step)


def _check_limit(limit: Any) -> int | None:
    if limit is None:
        return None
    if isinstance(limit, bool) or not isinstance(limit, (int, np.integer)) or limit < 0:
        raise ValueError(f"limit must be a non-negative integer or None, got {limit!r}")
    return int(limit)
