"""Reading a dataset's rows: each veRL or flat row checked and turned into the loaded fields.

``read_rows`` applies a row reader (``read_verl_row`` or ``make_flat_reader``'s) to every row and
collects a ``Problem`` for each bad value (null or empty prompt or ground truth, a difficulty that is
not an integer, ...) instead of stopping at the first; ``duplicate_ids`` finds repeated prompt ids
and ``rows_to_frame`` builds the table of ``LOADED_COLUMNS``. ``prompt_hash`` is the stable id of a
prompt without one. ``coba_tasks.pipeline.data.read_dataset`` runs them over a file.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from typing import Any

import pandas as pd
import pyarrow as pa

from coba_tasks.pipeline.data_problems import Problem

LOADED_COLUMNS = (
    "prompt_id",
    "data_source",
    "ability",
    "difficulty",
    "prompt_text",
    "ground_truth",
    "messages",
    "extra_info",
)
MISSING_DIFFICULTY = -1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MISSING_TEXTS = ("nan", "none", "null", "<na>", "nat")  # how pandas, Python and SQL print a missing value
HASH_CHARS = 16

Messages = list[dict[str, str]]
Row = dict[str, Any]
RowReader = Callable[[Row], Row]


class _BadValue(Exception):
    """Raised by the per-value parsers below; the row loop turns it into a ``Problem``."""

    def __init__(self, column: str, message: str) -> None:
        super().__init__(message)
        self.column = column
        self.message = message


def prompt_hash(messages: Messages) -> str:
    """A stable id for a chat prompt: the first 16 hex chars of sha256 of its canonical JSON.

    >>> prompt_hash([{"role": "user", "content": "1+1="}])
    '415485a3e0e22f36'
    """
    canonical = json.dumps(
        [{"role": m["role"], "content": m["content"]} for m in messages],
        ensure_ascii=False,
        separators=(",", ":"),
    )
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:HASH_CHARS]


def column_values(table: pa.Table) -> list[Row]:
    """The table as Python rows (structs become dicts, lists become lists)."""
    columns = {name: table.column(name).to_pylist() for name in table.column_names}
    return [dict(zip(columns, values, strict=True)) for values in zip(*columns.values(), strict=True)]


def read_rows(raw_rows: list[Row], reader: RowReader) -> tuple[list[Row], list[Problem]]:
    """Apply ``reader`` to every row; collect the problems instead of stopping at the first."""
    rows, problems = [], []
    for i, raw in enumerate(raw_rows):
        try:
            row = reader(raw)
        except _BadValue as e:
            problems.append(Problem(e.column, e.message, row=i))
            continue
        row["_row"] = i
        rows.append(row)
    return rows, problems


def read_verl_row(raw: Row) -> Row:
    """One veRL row -> the loaded fields."""
    messages = _messages(raw["prompt"])
    extra = raw.get("extra_info")
    extra = extra if isinstance(extra, dict) else {}
    reward_model = raw["reward_model"] or {}
    index = extra.get("index")
    return {
        "prompt_id": _prompt_id(index, "extra_info.index") if index is not None else prompt_hash(messages),
        "_id_column": "extra_info.index" if index is not None else "prompt",
        "data_source": _required_string(raw["data_source"], "data_source"),
        "ability": _optional_string(raw.get("ability")),
        "difficulty": _difficulty(extra.get("difficulty", raw.get("difficulty")), "extra_info.difficulty"),
        "prompt_text": _last_user_text(messages),
        "ground_truth": _ground_truth(reward_model.get("ground_truth"), "reward_model.ground_truth"),
        "messages": messages,
        "extra_info": extra_info_text(extra),
    }


def make_flat_reader(default_source: str) -> RowReader:
    """A reader for rows of a flat (``prompt``, ``answer``) table."""

    def read(raw: Row) -> Row:
        text = raw["prompt"]
        if text is None or not text.strip():
            raise _BadValue("prompt", "prompt is empty" if text is not None else "prompt is null")
        messages = [{"role": "user", "content": text}]
        given_id = raw.get("prompt_id")
        return {
            "prompt_id": _prompt_id(given_id, "prompt_id") if given_id is not None else prompt_hash(messages),
            "_id_column": "prompt_id" if given_id is not None else "prompt",
            "data_source": _optional_string(raw.get("data_source")) or default_source,
            "ability": _optional_string(raw.get("ability")),
            "difficulty": _difficulty(raw.get("difficulty"), "difficulty"),
            "prompt_text": text,
            "ground_truth": _ground_truth(raw["answer"], "answer"),
            "messages": messages,
            "extra_info": "{}",
        }

    return read


def extra_info_text(extra: dict[str, Any]) -> str:
    """A veRL row's ``extra_info`` as JSON text (what a reward file's ``extra_info`` argument is read from);
    a value JSON cannot hold is kept as its text.

    >>> extra_info_text({"split": "train", "index": 3})
    '{"split": "train", "index": 3}'
    """
    return json.dumps(extra, ensure_ascii=False, default=str)


def _messages(value: Any) -> Messages:
    """A veRL ``prompt`` cell -> a list of ``{role, content}`` dicts, all strings."""
    if not value:
        raise _BadValue("prompt", "prompt is null" if value is None else "prompt has no messages")
    messages = []
    for k, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise _BadValue("prompt", f"message {k} is not a {{role, content}} pair of strings: {m!r}")
        messages.append({"role": m["role"], "content": m["content"]})
    return messages


def _last_user_text(messages: Messages) -> str:
    """The content of the last user message; it must not be empty."""
    user_texts = [m["content"] for m in messages if m["role"] == "user"]
    if not user_texts:
        raise _BadValue("prompt", "prompt has no user message")
    if not user_texts[-1].strip():
        raise _BadValue("prompt", "prompt is empty (the last user message has no content)")
    return user_texts[-1]


def _ground_truth(value: Any, column: str) -> str:
    """A ground truth as a string; numbers are accepted (integral floats lose their '.0')."""
    if value is None:
        raise _BadValue(column, "ground truth is null")
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise _BadValue(column, f"ground truth must be a string or a number, not {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise _BadValue(column, f"ground truth is {value}")
    text = _number_text(value) if not isinstance(value, str) else value
    if not text.strip():
        raise _BadValue(column, "ground truth is empty")
    if text.strip().lower() in MISSING_TEXTS:
        raise _BadValue(
            column, f"ground truth is {text.strip()!r}, the text of a missing value (a null written as text?)"
        )
    return text


def _number_text(value: int | float) -> str:
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def _prompt_id(value: Any, column: str) -> str:
    """A prompt id from an index or id cell: ints and integral floats print without a '.0'; a blank text or
    a NaN names no prompt (a bad row)."""
    if isinstance(value, float) and math.isnan(value):
        raise _BadValue(column, "prompt id is NaN; give every row an id, or drop the column to hash the prompts")
    pid = _number_text(value) if isinstance(value, int | float) and not isinstance(value, bool) else str(value)
    if not pid.strip():
        raise _BadValue(column, "prompt id is blank; give every row an id, or drop the column to hash the prompts")
    return pid


def _difficulty(value: Any, column: str) -> int:
    """An integer difficulty level; null or absent -> MISSING_DIFFICULTY."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return MISSING_DIFFICULTY
    integral = (isinstance(value, int) and not isinstance(value, bool)) or (
        isinstance(value, float) and value.is_integer()
    )
    level = int(value) if integral or (isinstance(value, str) and _is_ascii_integer(value.strip())) else None
    if level is None or not INT64_MIN <= level <= INT64_MAX:
        raise _BadValue(column, f"difficulty must be an integer (64-bit), got {_short_repr(value)}")
    return level


def _is_ascii_integer(text: str) -> bool:
    """'12', '-3': what ``int()`` reads, without '+', '_' or non-ASCII digits."""
    digits = text.removeprefix("-")
    return digits.isascii() and digits.isdigit()


def _short_repr(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _required_string(value: Any, column: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _BadValue(column, f"{column} must be a non-empty string, got {value!r}")
    return value


def _optional_string(value: Any) -> str:
    return value if isinstance(value, str) else ""


def duplicate_ids(rows: list[Row]) -> list[Problem]:
    """A problem for every row whose prompt id an earlier row already has.

    The problem names the column the id came from: the index or id column, or ``prompt`` for a
    hashed id (two rows with the same messages).
    """
    first_row: dict[str, int] = {}
    problems = []
    for row in rows:
        pid, i = row["prompt_id"], row["_row"]
        if pid in first_row:
            message = f"prompt id {pid!r} duplicates row {first_row[pid]}"
            problems.append(Problem(row["_id_column"], message, row=i))
        else:
            first_row[pid] = i
    return problems


def rows_to_frame(rows: list[Row]) -> pd.DataFrame:
    """Loaded rows -> a DataFrame with the columns of ``LOADED_COLUMNS``, in that order."""
    frame = pd.DataFrame({c: [row[c] for row in rows] for c in LOADED_COLUMNS})
    frame["difficulty"] = frame["difficulty"].astype("int64")
    numbers = [row["_row"] for row in rows]
    if numbers != list(range(len(rows))):  # rows were skipped: keep each row's number in the file
        frame.index = pd.Index(numbers, dtype="int64")
    return frame
