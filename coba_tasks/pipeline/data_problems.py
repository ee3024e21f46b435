"""What can be wrong with a dataset, and the bad-row policy every data check shares.

A ``Problem`` names a row (or a whole column) and what is wrong with it; ``DatasetError`` reports
the first few problems of a file by file, row and column, e.g.
``data/x.parquet: row 17, column reward_model.ground_truth: ground truth is empty``. Row numbers
count from 0, as in ``pandas.read_parquet(path).iloc[row]``.

``refuse_or_skip`` applies the config's ``data.on_bad_rows``: ``error`` refuses a file with any bad
row; ``skip`` drops the bad rows, unless a whole column is bad or no row is left.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import get_args

from coba_tasks.pipeline.config_sections import OnBadRows

MAX_REPORTED = 5  # bad rows listed in a DatasetError message; the rest are counted


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a dataset: where (row, column) and what."""

    column: str
    message: str
    row: int | None = None  # None: the whole column (missing, wrong type)

    def __str__(self) -> str:
        where = f"column {self.column}" if self.row is None else f"row {self.row}, column {self.column}"
        return f"{where}: {self.message}"


class DatasetError(ValueError):
    """A dataset file that cannot be used; the message names the file, the row and the column."""

    def __init__(
        self, path: str | os.PathLike[str], problems: Sequence[Problem] | str, note: str | None = None
    ) -> None:
        self.path = str(path)
        self.problems: list[Problem] = [] if isinstance(problems, str) else list(problems)
        if isinstance(problems, str):
            lines = [f"{self.path}: {problems}"]
        else:
            lines = [f"{self.path}: {note}"] if note else []
            lines += [f"{self.path}: {p}" for p in self.problems[:MAX_REPORTED]]
            if len(self.problems) > MAX_REPORTED:
                lines.append(f"{self.path}: ... and {len(self.problems) - MAX_REPORTED} more problems")
        super().__init__("\n".join(lines))


def error_reason(e: BaseException) -> str:
    """An exception as one short line for a message: its type and its first 300 characters."""
    return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"


def check_on_bad_rows(on_bad_rows: str) -> None:
    """ValueError unless ``on_bad_rows`` is one of the words of ``OnBadRows``."""
    if on_bad_rows not in get_args(OnBadRows):
        raise ValueError(f"on_bad_rows must be one of {', '.join(get_args(OnBadRows))}, got {on_bad_rows!r}")


def refuse_or_skip(path: str | os.PathLike[str], n_rows: int, problems: list[Problem], on_bad_rows: OnBadRows) -> None:
    """Raise for ``problems`` unless they are row problems to skip and some row is left."""
    if not problems:
        return
    if on_bad_rows == "error":
        raise DatasetError(path, problems)
    if any(p.row is None for p in problems):  # a whole column is bad: nothing to skip around
        raise DatasetError(path, [p for p in problems if p.row is None])
    if len({p.row for p in problems}) >= n_rows:
        raise DatasetError(path, problems, note=all_bad_note(n_rows))


def all_bad_note(n_rows: int) -> str:
    """The note of a ``DatasetError`` for a file whose every row is bad and would be skipped."""
    return f"every one of the {n_rows} rows is bad, so data.on_bad_rows=skip leaves no prompt"
