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

The summary, table and prompt views and their rendering are in ``coba_tasks.commands.inspection_views``;
this module holds the SQL view and the command's parser and handler. Both are in the commands layer
(I/O over the store; no Prefect, no model). DuckDB is imported only by ``run_sql``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path
from typing import Any

import pandas as pd

from coba_tasks.commands.inspection_views import (
    DEFAULT_LIMIT,
    FORMATS,
    TABLE_NAMES,
    format_summary,
    open_run,
    render,
    select_columns,
    show_prompts,
    show_table,
)
from coba_tasks.pipeline.store import RunStore, inside_run
from coba_tasks.pipeline.summary import load_run, run_summary

RUN_TABLE_VIEWS: tuple[str, ...] = ("prompts",)  # run-level tables exposed as SQL views
_FILE_COLUMN = "_coba_file"  # the file-name column DuckDB adds while building a view (dropped again)
_STEP_DIR_SQL_RE = r"/([0-9]+)/[^/]*$"  # the step directory in .../steps/000007/budget.parquet


# ---------------------------------------------------------------------------------------------
# SQL


def run_sql(run_dir: str | os.PathLike[str], query: str) -> pd.DataFrame:
    """Run one read-only SELECT over the run's tables with DuckDB and return the result.

    Views: one per stage in ``TABLE_NAMES`` (the union of that table over every step where it is
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
        ValueError: not a run; a table that resolves outside the run (a symlink: ``inside_run``);
            not exactly one SELECT statement ("read-only: only SELECT ...");
            any DuckDB error (bad SQL, unknown column, refused file), with DuckDB's message.
    """
    import duckdb

    statement = _check_select(query, duckdb)
    store = open_run(run_dir)
    files = _done_files(store)
    prompts = [store.root / "prompts.parquet"] if store.has_run_table("prompts") else []
    for path in [p for paths in files.values() for _, p in paths] + prompts:
        inside_run(store.root, path)  # a table linked out of the run is not read
    allowed = [_abs(p) for paths in files.values() for _, p in paths] + [_abs(p) for p in prompts]
    empty = [name for name in TABLE_NAMES if not files[name]] + (["prompts"] if not prompts else [])

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
            for name in TABLE_NAMES:
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
    files: dict[str, list[tuple[int, Path]]] = {name: [] for name in TABLE_NAMES}
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
    parser.add_argument("--stage", choices=TABLE_NAMES, default=None, help="stage table to show (with --step)")
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
        df = select_columns(df, columns, "the query result")
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
