"""What ``coba inspect`` prints, apart from SQL: the run summary as text (``format_summary``), one stage's
table of one step (``show_table``), the prompts (``show_prompts``), the mechanisms (``show_mechanisms``),
each through ``render`` (aligned ``table``, ``csv`` or ``json``); and the checks of what a caller passes,
shared with ``coba_tasks.readers.sql`` and ``coba_tasks.commands.inspection`` (which has the step numbering).
Only done tables are read, through ``RunStore.read_table`` (each file's sha256 checked against the manifest).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from coba_tasks.pipeline.store import RunStore
from coba_tasks.readers.choices import DEFAULT_LIMIT, FORMATS, MECHANISM_VIEWS, TABLE_NAMES
from coba_tasks.readers.figures import plain
from coba_tasks.readers.mechanisms import by_age, prompt_visits, run_mechanisms
from coba_tasks.readers.tables import load_run, ordered
from coba_tasks.readers.text import run_status, step_ranges, summary_rows

_CELL_WIDTH = 48  # characters a cell may take in the ``table`` format before it is cut
# what a completion must not send to a terminal: C0 controls but newline and tab (ESC, CR, BEL, backspace),
# DEL, C1 controls (0x9b is a CSI), and the bidirectional marks, embeddings, overrides and isolates
_UNSAFE_RE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")  # a spreadsheet runs a cell that starts so (OWASP)
_NUMBER_RE = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")  # a number: data, whatever its sign


def format_summary(summary: dict[str, Any]) -> str:
    """``run_summary``'s dict (or the same read back from JSON) as aligned lines of text."""
    lines = [f"run {summary.get('run_dir')}: {run_status(summary)}, strategy {summary.get('strategy') or '?'}"]
    return escape_controls("\n".join([*lines, *(f"{label:<16} {text}" for label, text in summary_rows(summary))]))


# --- One table


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
    table = store.read_table(step, stage)
    df = select_columns(table, columns, f"{stage} at step {step}")
    note = None
    piloted = stage == "budget" and "estimator" in table and (table["estimator"] == "pilot").any()
    if piloted:  # allocation.estimator = pilot: the step allocated it, after its pilot (round 0)
        note = f"(the budget step {step} uses, allocated by step {step} after its pilot)"
    elif stage == "budget":
        note = f"(the budget step {step} uses, allocated from the tables of step {step - 1})" if step else None
    return _render_head(df, limit, fmt, note)


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
    return _render_head(select_columns(df, columns, "prompts"), limit, fmt)


_MECHANISM_NOTES = {
    "steps": "(per step t: the estimates budget(t) allocated with against the pass rates realized at t, over the "
    "estimated prompts; effective_prompts = N_eff of the update; mixed_groups: prompts with a non-zero advantage)",
    "age": "(the estimated prompts of every step by the age of their estimate: steps since the visit it came from; "
    "bias = mean realized - estimate)",
    "prompts": "(per prompt and visit, step t: the rounds it was sampled in, its rollouts generated, trained on "
    "and solved, the budget and estimate budget(t) allocated it with, the pass rate realized at t, the estimate's "
    "age in steps; seen: it had an estimate; level: its difficulty)",
}


def show_mechanisms(
    run_dir: str | os.PathLike[str],
    view: str = "steps",
    limit: int | None = None,
    columns: Sequence[str] | None = None,
    fmt: str = "table",
) -> str:
    """One of ``MECHANISM_VIEWS`` of the run, formatted: ``steps`` (``mechanisms.STEP_COLUMNS``, one row per
    step), ``age`` (``mechanisms.by_age`` over every step) or ``prompts`` (``mechanisms.prompt_visits``: one row
    per prompt and visit)."""
    if view not in MECHANISM_VIEWS:
        raise ValueError(f"unknown mechanisms view {view!r}; views: {', '.join(MECHANISM_VIEWS)}")
    _check_format(fmt)
    limit = _check_limit(limit)
    open_run(run_dir)
    t = load_run(run_dir)
    m = run_mechanisms(t)
    df = {"steps": m.steps, "age": by_age(m.rows), "prompts": prompt_visits(t, m.rows)}[view]
    df = select_columns(df, columns, f"the {view} view of --mechanisms")
    return _render_head(df, limit, fmt, _MECHANISM_NOTES[view])


def _render_head(df: pd.DataFrame, limit: int | None, fmt: str, note: str | None = None) -> str:
    """``render`` of the first ``limit`` rows (all for None or 0), saying how many there were."""
    return render(df.head(limit) if limit else df, fmt, total=len(df), note=note)


def render(df: pd.DataFrame, fmt: str = "table", total: int | None = None, note: str | None = None) -> str:
    """``df`` as ``table`` (aligned, long cells cut), ``csv`` or ``json`` (an array of records).

    ``total`` (the row count before a limit) and ``note`` only add a footer to the ``table`` format.

    >>> print(render(pd.DataFrame({"a": [1, 2], "ids": [[1, 2, 3], []]})))
     a       ids
     1 [1, 2, 3]
     2        []
    """
    _check_format(fmt)
    if fmt == "json":  # JSON escapes C0 controls itself; the others are written as \\u escapes (the same text)
        records = [{str(k): plain(v) for k, v in zip(df.columns, row, strict=True)} for row in df.itertuples(False)]
        text = json.dumps(records, ensure_ascii=False, allow_nan=False)
        return _UNSAFE_RE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)
    if fmt == "csv":
        out = _text_cells(df, _csv_cell)
        out.columns = [_csv_cell(str(c)) for c in out.columns]
        return out.to_csv(index=False).rstrip("\n")
    if df.columns.empty or df.empty:
        text = "(no rows; columns: " + (", ".join(map(str, df.columns)) or "none") + ")"
    else:
        shown = _text_cells(df, _short)
        shown.columns = [escape_controls(str(c)) for c in shown.columns]
        text = shown.to_string(index=False)
    text = escape_controls(text)  # the footer and anything pandas wrote too
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
        text = escape_controls(text)
        if len(text) <= width:
            return text
        suffix = f", …] ({len(cell)})"
        head = text[: max(width - len(suffix), 1)]
        head = head[: head.rfind(",")] if "," in head else head
        return head + suffix
    text = escape_controls(str(cell).replace("\n", "\\n"))
    return text if len(text) <= width else text[: width - 1] + "…"


def escape_controls(text: str) -> str:
    r"""``text`` with the characters that would drive a terminal written as escapes (newline and tab kept):
    a completion is shown, never obeyed.

    >>> escape_controls("a\x1b[2Jb\rc\u202ed\n\te")
    'a\\x1b[2Jb\\rc\\u202ed\n\te'
    """

    def escape(match: re.Match[str]) -> str:  # as Python's repr writes them
        code = ord(match.group())
        return "\\r" if code == 13 else f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"

    return _UNSAFE_RE.sub(escape, text)


def _text_cells(df: pd.DataFrame, cell: Any) -> pd.DataFrame:
    """A copy of ``df`` with ``cell`` applied to each value of its text (and object) columns."""
    out = df.copy()
    for col in out.columns:
        if out[col].dtype == object or pd.api.types.is_string_dtype(out[col].dtype):
            out[col] = [cell(v) for v in out[col]]
    return out


def _csv_cell(value: Any) -> Any:
    """A CSV cell: lists and dicts as JSON text; text with its controls escaped and, when a spreadsheet would
    run it as a formula (it starts with = + - @ or tab, and is not a plain number), a leading single quote."""
    cell = plain(value)
    if isinstance(cell, (list, dict)):
        cell = json.dumps(cell, ensure_ascii=False)
    if not isinstance(cell, str):
        return cell
    cell = escape_controls(cell)
    if cell.startswith(_FORMULA_START) and not _NUMBER_RE.fullmatch(cell):
        return "'" + cell
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


# --- Helpers


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


def _check_step(value: Any, what: str = "step must be a non-negative integer") -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{what}, got {value!r}")
    return int(value)


def _check_limit(limit: Any) -> int | None:
    return None if limit is None else _check_step(limit, "limit must be a non-negative integer or None")
