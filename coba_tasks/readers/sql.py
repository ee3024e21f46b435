"""``coba inspect --sql``: one SELECT over every done table of a run with DuckDB, one view per table.

Read-only: DuckDB runs in memory over the Parquet files the manifests list (never a glob, so a temporary
or a table being written is invisible), every file resolved inside the run (``inside_run``), and only a
single SELECT is accepted. It reads the files directly (no sha256 check, unlike ``RunStore.read_table``).
DuckDB is imported only by ``run_sql``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pandas as pd

from coba_tasks.pipeline.store import RunStore, inside_run
from coba_tasks.readers.tables import load_run
from coba_tasks.readers.views import TABLE_NAMES, open_run

RUN_TABLE_VIEWS: tuple[str, ...] = ("prompts",)  # run-level tables exposed as SQL views
_FILE_COLUMN = "_coba_file"  # the file-name column DuckDB adds while building a view (dropped again)
_STEP_DIR_SQL_RE = r"/([0-9]+)/[^/]*$"  # the step directory in .../steps/000007/budget.parquet


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

    # python_enable_replacements off: no `select * from some_python_variable`
    off = ("python_enable_replacements", "autoinstall_known_extensions", "autoload_known_extensions")
    con = duckdb.connect(":memory:", config=dict.fromkeys((*off, "allow_community_extensions"), False))
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
    files = ", ".join(_sql_str(p) for p in paths)
    source = f"read_parquet([{files}], filename = '{_FILE_COLUMN}', union_by_name = true)"
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
