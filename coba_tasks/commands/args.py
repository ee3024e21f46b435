"""Argument types and the declaration of a subcommand, which the ``coba`` subcommands share.

A subcommand is declared as data, its options a list of ``option(...)`` rows; ``Command.add_to`` (or
``add_command`` with the same arguments) registers it:

    COMMAND = Command("demo", help=..., description=..., examples=["coba demo"], func=cmd_demo, options=[
        option("--steps", type=positive_int, default=3),   # "0" -> "must be a positive integer, got 0"
    ])
    COMMAND.add_to(subparsers)
"""

from __future__ import annotations

import argparse
from argparse import ArgumentParser
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

Option = tuple[tuple[str, ...], dict[str, Any]]  # an argument: its flags (or name), the keywords of add_argument


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


def non_negative_float(value: str) -> float:
    """An argparse type: a finite number >= 0, refused with the value named.

    >>> non_negative_float("0.7")
    0.7
    >>> non_negative_float("-1")
    Traceback (most recent call last):
    argparse.ArgumentTypeError: must be a number >= 0, got -1
    """
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {value}") from None
    if not 0 <= x < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {value}")
    return x


def option(*flags: str, **keywords: Any) -> Option:
    """One argument as data: ``parser.add_argument(*flags, **keywords)`` when ``add_command`` adds it."""
    return flags, keywords


def add_command(
    subparsers: Any,
    name: str,
    *,
    help: str,
    description: str,
    examples: Sequence[str],
    options: Iterable[Option] = (),
    func: Callable[[argparse.Namespace], int] | None = None,
) -> ArgumentParser:
    """Register subcommand ``name`` with its one-line ``help``, its ``description`` and an ``examples:`` epilog
    (one command line an entry, printed as written), then its ``options`` (``option(...)`` rows, in order) and
    its handler ``func`` (``args.func``); returns its parser."""
    parser = subparsers.add_parser(
        name,
        help=help,
        description=description,
        epilog="examples:\n" + "\n".join(f"  {e}" for e in examples),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for flags, keywords in options:
        parser.add_argument(*flags, **keywords)
    if func is not None:
        parser.set_defaults(func=func)
    return parser


@dataclass(frozen=True)
class Command:
    """A subcommand as data: ``add_command``'s arguments, registered by ``add_to``."""

    name: str
    help: str
    description: str
    examples: Sequence[str]
    options: Sequence[Option] = ()
    func: Callable[[argparse.Namespace], int] | None = None

    def add_to(self, subparsers: Any) -> ArgumentParser:
        """Register this subcommand on ``subparsers`` (an ``add_subparsers()`` object); returns its parser."""
        return add_command(subparsers, **vars(self))
