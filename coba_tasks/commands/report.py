"""``coba report``: its parser and its handler (the report itself is ``coba_tasks.readers.report``)."""

from __future__ import annotations

import argparse
from typing import Any

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
    from coba_tasks.readers.report import build_report

    files = build_report(args.run_dir, args.steps)
    print(files.html)
    for p in files.pngs:
        print(p)
    for png, why in files.skipped.items():
        print(f"(skipped {png}: {why})")
    return 0
