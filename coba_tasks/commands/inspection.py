"""``coba inspect``: look inside a run directory, also while the run is still going.

Every view is read-only: nothing is ever written into the run directory. Only *done* tables are read: a
table counts when its entry is in the step's manifest and its file exists (``RunStore.is_done``). File lists
come from the manifests, never from a glob, so the temporaries a writer leaves beside a table
(``.<name>.parquet.<hex>.tmp``) and a table being written right now are invisible; a run in progress can be
inspected at any moment. ``run_summary`` and ``show_table`` check each file's sha256 against the manifest
(``RunStore.read_table``); ``run_sql`` lets DuckDB read the files directly (no hashing).

Step numbering is the store's (``coba_tasks.pipeline.tables.Table``): a table lives in the directory of
the step that uses it.

The views and their rendering are readers of the run (``coba_tasks.readers.views`` and, for the SQL,
``coba_tasks.readers.sql``); this module is the command's parser and handler.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from coba_tasks.readers.choices import DEFAULT_LIMIT, FORMATS, MECHANISM_VIEWS, TABLE_NAMES

# --- CLI

EPILOG = """examples:
  coba inspect --run-dir runs/demo                       # summary (works while the run is going)
  coba inspect --run-dir runs/demo --json
  coba inspect --run-dir runs/demo --step 3 --stage rewards --limit 10
  coba inspect --run-dir runs/demo --step 3 --stage rollouts --columns prompt_id,completion,n_tokens
  coba inspect --run-dir runs/demo --step 0 --stage eval --format csv > eval0.csv
  coba inspect --run-dir runs/demo --prompts --limit 3  # the prompts exactly as the model saw them
  coba inspect --run-dir runs/demo --mechanisms          # per step: estimate error, N_eff, mixed, pass@2
  coba inspect --run-dir runs/demo --mechanisms age      # the estimates' error by their age
  coba inspect --run-dir runs/demo --sql "select step, F, alpha, beta from capability order by step"
  coba inspect --run-dir runs/demo --format json --sql \\
      "select b.step, avg(r.reward) from rewards r join budget b using (step, prompt_id) group by 1"
  coba inspect --run-dir runs/demo --sql \\
      "select p.difficulty, avg(b.budget) from budget b join prompts p using (prompt_id) group by 1"

stages / SQL views: budget, rollouts, rewards, capability, update, history, eval (each with a
`step` column: the step directory), and prompts. budget at step t is the budget step t used
(its first stage, from the tables of step t - 1). --sql accepts one SELECT; nothing can be written.
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
    parser.add_argument(
        "--mechanisms",
        nargs="?",
        const="steps",
        choices=MECHANISM_VIEWS,
        default=None,
        help="per step: the allocation's estimates against the realized pass rates, N_eff, mixed groups, first "
        "solved, pass@2 (steps, the default); the estimates' error by age (age); per allocated prompt (prompts)",
    )
    parser.set_defaults(func=cmd_inspect)
    return parser


def cmd_inspect(args: argparse.Namespace) -> int:
    """Run ``coba inspect``: print the summary, a table or a query result. Bad input -> ValueError."""
    table_mode = args.step is not None or args.stage is not None
    if (args.step is None) != (args.stage is None):
        missing = "--stage" if args.stage is None else "--step"
        raise ValueError(f"--step and --stage go together: {missing} is missing (e.g. --step 0 --stage rewards)")
    mechanisms = getattr(args, "mechanisms", None)
    if sum([table_mode, args.sql is not None, bool(getattr(args, "prompts", False)), mechanisms is not None]) > 1:
        raise ValueError("choose one of --step/--stage, --sql, --prompts and --mechanisms")
    if args.json and args.fmt not in (None, "json"):
        raise ValueError(f"--json and --format {args.fmt} contradict each other")
    fmt = "json" if args.json else (args.fmt or "table")
    columns = None
    if args.columns is not None:
        columns = [c.strip() for c in args.columns.split(",") if c.strip()]
        if not columns:
            raise ValueError("--columns: give comma-separated column names, e.g. --columns prompt_id,reward")

    from coba_tasks.readers.figures import run_summary
    from coba_tasks.readers.sql import run_sql
    from coba_tasks.readers.views import (
        format_summary,
        render,
        select_columns,
        show_mechanisms,
        show_prompts,
        show_table,
    )

    limit = DEFAULT_LIMIT if args.limit is None else args.limit  # of a table or the prompts
    if table_mode:
        print(show_table(args.run_dir, args.step, args.stage, limit=limit, columns=columns, fmt=fmt))
        return 0
    if getattr(args, "prompts", False):
        print(show_prompts(args.run_dir, limit=limit, columns=columns, fmt=fmt))
        return 0
    if mechanisms is not None:
        print(show_mechanisms(args.run_dir, mechanisms, limit=args.limit, columns=columns, fmt=fmt))
        return 0
    if args.sql is not None:
        df = select_columns(run_sql(args.run_dir, args.sql), columns, "the query result")
        print(render(df.head(args.limit) if args.limit else df, fmt, total=len(df)))
        return 0
    if columns is not None or args.limit is not None or fmt == "csv":
        raise ValueError(
            "--columns, --limit and --format csv apply to --step/--stage, --sql or --mechanisms, not to the summary"
        )
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
