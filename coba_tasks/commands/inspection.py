"""``coba inspect``: look inside a run directory, also while the run is still going.

Four views of a run, all read-only (nothing is ever written into the run directory):

* ``run_summary`` / ``format_summary``: steps done, held-out accuracy, the failure rate and
  (alpha, beta), budget statistics, verdict counts, rollouts, wall time (when finished);
* ``show_table``: one stage's table of one step (``steps/NNNNNN/<stage>.parquet``);
* ``run_sql``: a SELECT over every done table of the run with DuckDB, one view per stage.

Only *done* tables are read: a table counts when its entry is in the step's manifest and its file
exists (``RunStore.is_done``). File lists come from the manifests, never from a glob, so the
temporaries a writer leaves beside a table (``.<name>.parquet.<hex>.tmp``) and a table being
written right now are invisible; a run in progress can be inspected at any moment.

Step numbering: a table lives in the directory of the step that *uses* it. ``budget`` in
``steps/000007`` is the budget step 7 consumed (allocated at the end of step 6), and the directory
after the last step holds the budget allocated for a step that never ran (and the final ``eval``).
``eval`` in ``steps/000008`` is the held-out accuracy of the weights after 8 updates.

``run_summary`` and ``show_table`` read through ``RunStore.read_table``, which checks each file's
sha256 against the manifest; ``run_sql`` lets DuckDB read the files directly (no hashing).

This module is layer 2 (I/O over the store; no Prefect, no model). DuckDB is imported only by
``run_sql``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from coba_tasks.pipeline.store import RunStore
from coba_tasks.pipeline.summary import TABLE_ORDER, UPDATE_FIELDS, load_run, ordered, plain, run_summary

# The per-step tables, in the order a step produces them (budget first: it is written into the
# step's directory before the step runs). ``history`` is the per-step snapshot of the pass-rate
# history, ``eval`` the held-out evaluation (only on evaluated steps).
STAGE_NAMES: tuple[str, ...] = TABLE_ORDER
RUN_TABLE_VIEWS: tuple[str, ...] = ("prompts",)  # run-level tables exposed as SQL views
FORMATS: tuple[str, ...] = ("table", "csv", "json")
DEFAULT_LIMIT = 20

_CELL_WIDTH = 48  # characters a cell may take in the ``table`` format before it is cut
_FILE_COLUMN = "_coba_file"  # the file-name column DuckDB adds while building a view (dropped again)
_STEP_DIR_SQL_RE = r"/([0-9]+)/[^/]*$"  # the step directory in .../steps/000007/budget.parquet


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
        step: the step directory (``steps/000007`` for 7; see the module docstring for budget).
        stage: one of ``STAGE_NAMES``.
        limit: the first ``limit`` rows; None or 0 shows every row.
        columns: column names to keep, in this order; None keeps all.
        fmt: ``table`` (aligned text, long cells cut, a footer when rows were left out), ``csv``
            or ``json`` (one JSON array of records).

    Raises:
        ValueError: not a run, bad step/stage/format/column, or the stage is not done at that step
            (the message lists the tables done there).
    """
    store = _open(run_dir)
    _check_stage(stage)
    _check_format(fmt)
    step = _check_step(step)
    limit = _check_limit(limit)
    steps = store.steps()
    if step not in steps:
        where = f"steps there: {_ranges(steps)}" if steps else "no step has a directory yet"
        raise ValueError(f"step {step} has no directory in {store.root} ({where})")
    done = load_run(store.root).done[step]
    if stage not in done:
        raise ValueError(
            f"stage {stage!r} is not done at step {step} yet (done there: {', '.join(ordered(done)) or 'nothing'})"
        )
    df = store.read_table(step, stage)
    df = _select_columns(df, columns, f"{stage} at step {step}")
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
    store = _open(run_dir)
    _check_format(fmt)
    limit = _check_limit(limit)
    df = store.read_run_table("prompts")
    if "prompt_token_ids" in df:
        df.insert(len(df.columns), "prompt_tokens", [len(ids) for ids in df["prompt_token_ids"]])
    if columns is None:
        columns = [c for c in PROMPT_COLUMNS if c in df.columns] or None
    df = _select_columns(df, columns, "prompts")
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


def _select_columns(df: pd.DataFrame, columns: Sequence[str] | None, what: str) -> pd.DataFrame:
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
# SQL


def run_sql(run_dir: str | os.PathLike[str], query: str) -> pd.DataFrame:
    """Run one read-only SELECT over the run's tables with DuckDB and return the result.

    Views: one per stage in ``STAGE_NAMES`` (the union of that table over every step where it is
    done, columns united by name, with an integer ``step`` column first: the step directory the
    row comes from, replacing the table's own ``step`` column where it has one) and ``prompts``
    (the run-level prompts table). A stage with no done table yet is a view with only the ``step``
    column and no rows. File lists come from the manifests (never a glob).

    Read-only, twice over: the query must be exactly one statement of type SELECT (``WITH ...
    SELECT``, ``FROM ...``, ``DESCRIBE``, ``SHOW`` parse as SELECT); and the in-memory DuckDB
    connection runs with external access disabled except for the exact Parquet files behind the
    views (``allowed_paths``), with extension autoloading, Python replacement scans and spilling to
    disk off, and its configuration locked, so a SELECT cannot read, write or load anything else.

    Raises:
        ValueError: not a run; not exactly one SELECT statement ("read-only: only SELECT ...");
            any DuckDB error (bad SQL, unknown column, refused file), with DuckDB's message.
    """
    import duckdb

    statement = _check_select(query, duckdb)
    store = _open(run_dir)
    files = _done_files(store)
    prompts = [store.root / "prompts.parquet"] if store.has_run_table("prompts") else []
    allowed = [_abs(p) for paths in files.values() for _, p in paths] + [_abs(p) for p in prompts]
    empty = [name for name in STAGE_NAMES if not files[name]] + (["prompts"] if not prompts else [])

    con = duckdb.connect(
        ":memory:",
        config={
            "python_enable_replacements": False,  # no `select * from some_python_variable`
            "autoinstall_known_extensions": False,
            "autoload_known_extensions": False,
            "allow_community_extensions": False,
        },
    )
    try:
        try:
            con.execute("SET temp_directory = ''")  # never spill (the working directory may be the run)
            con.execute("SET allowed_paths = $1", [allowed])  # must come before disabling external access
            con.execute("SET enable_external_access = false")
            for name in STAGE_NAMES:
                con.execute(_view_sql(con, name, [_abs(p) for _, p in files[name]]))
            if prompts:
                con.execute(f"CREATE VIEW prompts AS SELECT * FROM read_parquet({_sql_str(_abs(prompts[0]))})")
            else:
                con.execute("CREATE VIEW prompts AS SELECT NULL::VARCHAR AS prompt_id WHERE false")
            con.execute("SET lock_configuration = true")
        except duckdb.Error as e:
            raise ValueError(f"{store.root}: could not open the run's tables in DuckDB: {_one_line(e)}") from None
        try:
            return con.execute(statement.query).df()
        except duckdb.Error as e:
            message = _one_line(e)
            if isinstance(e, duckdb.PermissionException):
                message += " (a query reads only this run's tables, through the views)"
            mentioned = [n for n in empty if re.search(rf"\b{n}\b", query, re.IGNORECASE)]
            if mentioned:
                message += f" (no data yet in: {', '.join(mentioned)}; those views have no rows)"
            raise ValueError(message) from None
    finally:
        con.close()


def _check_select(query: str, duckdb: Any) -> Any:
    """The one statement of ``query`` when it is a SELECT; ValueError otherwise."""
    if not isinstance(query, str) or not query.strip():
        raise ValueError("empty query: give one SELECT statement")
    try:
        statements = duckdb.extract_statements(query)
    except duckdb.Error as e:
        raise ValueError(_one_line(e)) from None
    if len(statements) != 1:
        raise ValueError(
            f"run_sql is read-only: only SELECT is allowed, as exactly one statement (got {len(statements)})"
        )
    kind = statements[0].type
    if kind != duckdb.StatementType.SELECT:
        name = getattr(kind, "name", str(kind))
        raise ValueError(f"run_sql is read-only: only SELECT statements are allowed, not {name}")
    return statements[0]


def _view_sql(con: Any, name: str, paths: list[str]) -> str:
    """CREATE VIEW for one stage: the union of its files by column name, with ``step`` from the directory."""
    if not paths:
        return f'CREATE VIEW "{name}" AS SELECT NULL::INTEGER AS step WHERE false'
    source = (
        "read_parquet(["
        + ", ".join(_sql_str(p) for p in paths)
        + f"], filename = '{_FILE_COLUMN}', union_by_name = true)"
    )
    names = [row[0] for row in con.execute(f"DESCRIBE SELECT * FROM {source}").fetchall()]
    exclude = ", ".join([_FILE_COLUMN] + (["step"] if "step" in names else []))
    step = f"CAST(regexp_extract({_FILE_COLUMN}, '{_STEP_DIR_SQL_RE}', 1) AS INTEGER)"
    return f'CREATE VIEW "{name}" AS SELECT {step} AS step, * EXCLUDE ({exclude}) FROM {source}'


def _done_files(store: RunStore) -> dict[str, list[tuple[int, Path]]]:
    """stage -> [(step, path)] of its done tables, from the manifests."""
    files: dict[str, list[tuple[int, Path]]] = {name: [] for name in STAGE_NAMES}
    for step, names in load_run(store.root).done.items():
        for name in names:
            if name in files:
                files[name].append((step, store.table_path(step, name)))
    return files


def _sql_str(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _abs(path: Path) -> str:
    return str(Path(path).resolve())


def _one_line(exc: BaseException) -> str:
    """DuckDB's message without the 'LINE 1: ... ^^^' pointer, on one line."""
    text = str(exc).split("\n\nLINE ", 1)[0]
    return " ".join(part.strip() for part in text.splitlines() if part.strip())


# ---------------------------------------------------------------------------------------------
# CLI

EPILOG = """examples:
  coba inspect --run-dir runs/demo                       # summary (works while the run is going)
  coba inspect --run-dir runs/demo --json
  coba inspect --run-dir runs/demo --step 3 --stage rewards --limit 10
  coba inspect --run-dir runs/demo --step 3 --stage rollouts --columns prompt_id,completion,n_tokens
  coba inspect --run-dir runs/demo --step 0 --stage eval --format csv > eval0.csv
  coba inspect --run-dir runs/demo --prompts --limit 3  # the prompts exactly as the model saw them
  coba inspect --run-dir runs/demo --sql "select step, F, alpha, beta from capability order by step"
  coba inspect --run-dir runs/demo --format json --sql \\
      "select b.step, avg(r.reward) from rewards r join budget b using (step, prompt_id) group by 1"
  coba inspect --run-dir runs/demo --sql \\
      "select p.difficulty, avg(b.budget) from budget b join prompts p using (prompt_id) group by 1"

stages / SQL views: budget, rollouts, rewards, capability, update, history, eval (each with a
`step` column: the step directory), and prompts. budget at step t is the budget step t used
(allocated at the end of step t - 1). --sql accepts one SELECT; nothing can be written.
"""


def add_inspect_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``inspect`` on an ``add_subparsers()`` object; sets ``func=cmd_inspect``."""
    parser = subparsers.add_parser(
        "inspect",
        help="look inside a run directory (summary, one table, or SQL), also while it runs",
        description="Look inside a run directory, finished or still running: a summary (default), the table of one "
        "stage at one step (--step and --stage), or a read-only SQL SELECT over every done table (--sql, DuckDB). "
        "Only tables listed in the manifests are read; nothing is written.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--run-dir", required=True, help="the run directory (e.g. runs/demo)")
    parser.add_argument("--json", action="store_true", help="print as JSON (the summary, or the same as --format json)")
    parser.add_argument("--step", type=_non_negative, default=None, help="step directory to show (with --stage)")
    parser.add_argument("--stage", choices=STAGE_NAMES, default=None, help="stage table to show (with --step)")
    parser.add_argument(
        "--limit",
        type=_non_negative,
        default=None,
        help=f"rows to print, 0 = all (default {DEFAULT_LIMIT} for --step/--stage, all for --sql)",
    )
    parser.add_argument("--columns", default=None, metavar="A,B,C", help="comma-separated columns to keep")
    parser.add_argument("--format", choices=FORMATS, default=None, dest="fmt", help="table (default), csv or json")
    parser.add_argument("--sql", default=None, metavar="QUERY", help="one read-only SELECT over the run's tables")
    parser.add_argument(
        "--prompts",
        action="store_true",
        help="the training prompts as the model saw them (rendered text and token count; --columns for more)",
    )
    parser.set_defaults(func=cmd_inspect)
    return parser


def cmd_inspect(args: argparse.Namespace) -> int:
    """Run ``coba inspect``: print the summary, a table or a query result. Bad input -> ValueError."""
    table_mode = args.step is not None or args.stage is not None
    if (args.step is None) != (args.stage is None):
        missing = "--stage" if args.stage is None else "--step"
        raise ValueError(f"--step and --stage go together: {missing} is missing (e.g. --step 0 --stage rewards)")
    if sum([table_mode, args.sql is not None, bool(getattr(args, "prompts", False))]) > 1:
        raise ValueError("choose one of --step/--stage, --sql and --prompts")
    if args.json and args.fmt not in (None, "json"):
        raise ValueError(f"--json and --format {args.fmt} contradict each other")
    fmt = "json" if args.json else (args.fmt or "table")
    columns = None
    if args.columns is not None:
        columns = [c.strip() for c in args.columns.split(",") if c.strip()]
        if not columns:
            raise ValueError("--columns: give comma-separated column names, e.g. --columns prompt_id,reward")

    if table_mode:
        limit = DEFAULT_LIMIT if args.limit is None else args.limit
        print(show_table(args.run_dir, args.step, args.stage, limit=limit, columns=columns, fmt=fmt))
        return 0
    if getattr(args, "prompts", False):
        limit = DEFAULT_LIMIT if args.limit is None else args.limit
        print(show_prompts(args.run_dir, limit=limit, columns=columns, fmt=fmt))
        return 0
    if args.sql is not None:
        df = run_sql(args.run_dir, args.sql)
        df = _select_columns(df, columns, "the query result")
        total = len(df)
        if args.limit:
            df = df.head(args.limit)
        print(render(df, fmt, total=total))
        return 0
    if columns is not None or args.limit is not None or fmt == "csv":
        raise ValueError("--columns, --limit and --format csv apply to --step/--stage or --sql, not to the summary")
    summary = run_summary(args.run_dir)
    print(json.dumps(summary, indent=2) if fmt == "json" else format_summary(summary))
    return 0


def _non_negative(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {value!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {value}")
    return n


# ---------------------------------------------------------------------------------------------
# Helpers


def _open(run_dir: str | os.PathLike[str]) -> RunStore:
    if run_dir is None or not Path(run_dir).is_dir():
        raise ValueError(f"{run_dir}: no such directory")
    return RunStore.open(run_dir)


def _check_stage(stage: Any) -> None:
    if stage not in STAGE_NAMES:
        raise ValueError(f"unknown stage {stage!r}; stages: {', '.join(STAGE_NAMES)}")


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


def _ranges(steps: list[int]) -> str:
    """'0-5, 8, 10-12' for [0, 1, 2, 3, 4, 5, 8, 10, 11, 12].

    >>> _ranges([0, 1, 2, 3, 4, 5, 8, 10, 11, 12])
    '0-5, 8, 10-12'
    """
    parts: list[str] = []
    start = prev = None
    for s in [*steps, None]:
        if start is not None and (s is None or s != prev + 1):
            parts.append(str(start) if start == prev else f"{start}-{prev}")
            start = None
        if s is not None and start is None:
            start = s
        prev = s
    return ", ".join(parts)
