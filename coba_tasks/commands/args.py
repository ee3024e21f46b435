"""Argument types and machine facts the ``coba`` subcommands share.

parser.add_argument("--steps", type=positive_int, default=3)   # "0" -> "must be a positive integer, got 0"
"""

from __future__ import annotations

import argparse
import os
from argparse import ArgumentParser
from collections.abc import Sequence
from typing import Any


def positive_int(value: str) -> int:
    """An argparse type: a whole number >= 1, refused with the value named.

    >>> positive_int("3")
    3
    >>> positive_int("0")
    Traceback (most recent call last):
    argparse.ArgumentTypeError: must be a positive integer, got 0
    """
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return n


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one, else the machine's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def add_command(subparsers: Any, name: str, *, help: str, description: str, examples: Sequence[str]) -> ArgumentParser:
    """Register subcommand ``name`` with its one-line ``help``, its ``description`` and an ``examples:`` epilog
    (one command line an entry, printed as written); returns its parser."""
    return subparsers.add_parser(
        name,
        help=help,
        description=description,
        epilog="examples:\n" + "\n".join(f"  {e}" for e in examples),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
