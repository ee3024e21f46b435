"""Prompt datasets: load veRL-format or flat Parquet into one validated table, and write veRL Parquet.

Two input layouts are accepted (docs/design.md, "Input data"):

- **veRL**, unchanged: ``data_source`` (string), ``prompt`` (list of ``{role, content}``),
  ``ability`` (optional), ``reward_model`` (struct ``{style, ground_truth}``) and ``extra_info``
  (optional struct ``{index, difficulty, ...}``). DAPO-Math-17K, GSM8K and MATH as prepared by
  veRL's scripts load as they are.
- **flat**: ``prompt`` (a string, the user message) and ``answer``; optional ``data_source``,
  ``ability``, ``difficulty`` and ``prompt_id``.

The layout is told apart by the type of ``prompt``: a list means veRL, a string means flat.
``load_dataset`` returns one row per prompt with the columns in ``LOADED_COLUMNS``
(``coba_tasks.pipeline.data_rows``, which reads and checks each row):

- ``prompt_id``: ``str(extra_info.index)`` (veRL) or the ``prompt_id`` column (flat) when present,
  else ``prompt_hash(messages)``, a stable hash of the prompt;
- ``data_source``, ``ability``: strings (a flat table's source defaults to ``default_source``);
- ``difficulty``: ``extra_info.difficulty`` or a ``difficulty`` column as an int, -1 when missing;
- ``prompt_text``: the content of the last user message; ``messages``: the whole chat prompt (what the
  model sees is rendered from these by ``coba_tasks.pipeline.data_prompts.render_prompts``);
- ``ground_truth``: ``reward_model.ground_truth`` or ``answer`` as a string;
- ``extra_info``: a veRL row's ``extra_info`` as JSON text (``{}`` for a flat row): the ``extra_info``
  argument of a reward file (``verify.reward_function``).

Validation happens on load, so a bad file stops a run before it starts: every row is checked,
and ``DatasetError`` (``coba_tasks.pipeline.data_problems``) reports the first few bad rows by
number and column, e.g. ``data/x.parquet: row 17, column reward_model.ground_truth: ground truth is
empty``. Row numbers count from 0, as in ``pandas.read_parquet(path).iloc[row]``. With
``on_bad_rows="skip"`` (the config's ``data.on_bad_rows``) bad rows are dropped instead and returned
as ``Problem``s (a duplicated id keeps its first row); a file whose every row is bad, or that is bad
as a whole (not Parquet, a column missing or of the wrong type), is still an error. A run's files
with every check (ground truths, rendering, prompt lengths): ``coba_tasks.pipeline.data_run``.

``write_verl_parquet`` writes the veRL layout atomically (temporary name, then ``os.replace``) and
deterministically (explicit schema, no pandas metadata), so a generator rerun gives the same bytes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from coba_tasks.engines.fileio import write_parquet
from coba_tasks.pipeline.data_problems import (
    DatasetError,
    OnBadRows,
    Problem,
    check_on_bad_rows,
    error_reason,
    refuse_or_skip,
)
from coba_tasks.pipeline.data_rows import (
    column_values,
    duplicate_ids,
    make_flat_reader,
    read_rows,
    read_verl_row,
    rows_to_frame,
)

VERL_REQUIRED = ("data_source", "prompt", "reward_model")
FLAT_REQUIRED = ("prompt", "answer")
VERL_COLUMNS = ("data_source", "prompt", "ability", "reward_model", "extra_info")

MESSAGE_TYPE = pa.struct([("role", pa.string()), ("content", pa.string())])
REWARD_MODEL_TYPE = pa.struct([("style", pa.string()), ("ground_truth", pa.string())])

Layout = Literal["verl", "flat"]


def load_dataset(
    path: str | os.PathLike[str], default_source: str = "math", on_bad_rows: OnBadRows = "error"
) -> pd.DataFrame:
    """Read a veRL or flat Parquet file of prompts and validate every row.

    Args:
        path: the Parquet file.
        default_source: ``data_source`` for rows of a flat table that have none.
        on_bad_rows: ``"error"`` refuses a file with any bad row; ``"skip"`` drops the bad rows
            (``read_dataset`` also returns what was dropped).

    Returns:
        One row per prompt, in file order, with the columns of ``LOADED_COLUMNS``. The index is
        the row's number in the file: 0..n-1 unless rows were skipped.

    Raises:
        DatasetError: the file is not Parquet, lacks a column, or has bad rows (null or empty
            ground truth or prompt, duplicated prompt id, ...) and ``on_bad_rows`` is
            ``"error"`` or every row is bad; the message lists the first few.
        FileNotFoundError: there is no such file.
    """
    return read_dataset(path, default_source, on_bad_rows)[0]


def read_dataset(
    path: str | os.PathLike[str], default_source: str = "math", on_bad_rows: OnBadRows = "error"
) -> tuple[pd.DataFrame, list[Problem]]:
    """``load_dataset``, and the problems of the rows it skipped (empty with ``"error"``), in row order."""
    check_on_bad_rows(on_bad_rows)
    try:  # a damaged file can hold names or values that are not UTF-8, whatever reads them
        table = _read_table(path)
        layout = _detect_layout(table.schema, path)
        _check_columns(table.schema, layout, path)
        values = column_values(table)
    except (UnicodeDecodeError, pa.ArrowException) as e:
        raise DatasetError(path, f"not a readable Parquet file: damaged ({error_reason(e)})") from e
    if table.num_rows == 0:
        raise DatasetError(path, "the table has no rows")
    reader = read_verl_row if layout == "verl" else make_flat_reader(default_source)
    rows, problems = read_rows(values, reader)
    problems += duplicate_ids(rows)
    problems.sort(key=lambda p: p.row or 0)
    refuse_or_skip(path, table.num_rows, problems, on_bad_rows)
    bad = {p.row for p in problems}
    return rows_to_frame([row for row in rows if row["_row"] not in bad]), problems


def write_verl_parquet(df: pd.DataFrame, path: str | os.PathLike[str]) -> Path:
    """Write prompts in the veRL layout, atomically and deterministically.

    Args:
        df: columns ``data_source`` (str), ``prompt`` (list of ``{role, content}``), ``ability``
            (str), ``reward_model`` (``{style, ground_truth}``) and ``extra_info`` (a dict per row,
            same keys in every row). Other columns are not written.
        path: the destination; its directory is created if needed.

    Returns:
        The path written.
    """
    missing = [c for c in VERL_COLUMNS if c not in df.columns]
    if missing:
        raise ValueError(f"write_verl_parquet: missing columns {missing}; a veRL table needs {list(VERL_COLUMNS)}")
    table = pa.table(
        {
            "data_source": pa.array(df["data_source"].tolist(), type=pa.string()),
            "prompt": pa.array([list(m) for m in df["prompt"]], type=pa.list_(MESSAGE_TYPE)),
            "ability": pa.array(df["ability"].tolist(), type=pa.string()),
            "reward_model": pa.array(df["reward_model"].tolist(), type=REWARD_MODEL_TYPE),
            "extra_info": pa.array(df["extra_info"].tolist()),
        }
    )
    return write_parquet(table, path)


# ---------------------------------------------------------------------------------------------
# File and schema checks


def _read_table(path: str | os.PathLike[str]) -> pa.Table:
    """The whole Parquet file as an Arrow table; DatasetError if it is not Parquet."""
    try:
        table = pq.read_table(path)
        table.column_names  # noqa: B018 - decodes the names: a damaged footer fails here
    except FileNotFoundError:
        raise
    except (pa.ArrowException, OSError, UnicodeDecodeError) as e:  # not Parquet; IO, type, damaged names
        _refuse_repeated_columns(path, _schema_names(path))  # a valid file whose column names repeat
        raise DatasetError(path, f"not a readable Parquet file ({error_reason(e)})") from e
    _refuse_repeated_columns(path, table.column_names)
    try:  # a damaged file can decode into invalid values (strings that are not UTF-8, bad offsets)
        table.validate(full=True)
    except pa.ArrowException as e:
        raise DatasetError(path, f"not a readable Parquet file: damaged values ({error_reason(e)})") from e
    for i, field in enumerate(table.schema):  # dictionary-encoded (pandas' categorical): the values themselves
        if pa.types.is_dictionary(field.type):
            table = table.set_column(i, field.name, table.column(i).cast(field.type.value_type))
    return table


def _schema_names(path: str | os.PathLike[str]) -> list[str]:
    """The column names in the file's footer; empty when even that cannot be read."""
    try:
        return pq.read_schema(path).names
    except (pa.ArrowException, OSError, UnicodeDecodeError):
        return []


def _refuse_repeated_columns(path: str | os.PathLike[str], names: list[str]) -> None:
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise DatasetError(path, [Problem(n, "appears more than once in the table") for n in twice])


def is_string_type(t: pa.DataType) -> bool:
    """Whether an Arrow type is a string type (string, large string or string view)."""
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_list_view(t)


def _detect_layout(schema: pa.Schema, path: str | os.PathLike[str]) -> Layout:
    """veRL if ``prompt`` is a list (of messages), flat if it is a string."""
    if "prompt" not in schema.names:
        raise DatasetError(path, [Problem("prompt", _missing_hint())])
    prompt_type = schema.field("prompt").type
    if _is_list(prompt_type):
        return "verl"
    if is_string_type(prompt_type):
        return "flat"
    if pa.types.is_null(prompt_type):  # every prompt is null: judge by the other columns
        return "verl" if "reward_model" in schema.names else "flat"
    message = f"has type {prompt_type}; expected a list of {{role, content}} (veRL) or a string (flat table)"
    raise DatasetError(path, [Problem("prompt", message)])


def _missing_hint() -> str:
    return (
        f"missing; a veRL table needs columns {', '.join(VERL_REQUIRED)}, "
        f"a flat table needs columns {', '.join(FLAT_REQUIRED)}"
    )


def _check_columns(schema: pa.Schema, layout: Layout, path: str | os.PathLike[str]) -> None:
    """Every required column is there, and a veRL ``reward_model`` is a struct with ``ground_truth``."""
    required = VERL_REQUIRED if layout == "verl" else FLAT_REQUIRED
    problems = [Problem(c, _missing_hint()) for c in required if c not in schema.names]
    if layout == "verl" and "reward_model" in schema.names:
        rm_type = schema.field("reward_model").type
        if not pa.types.is_struct(rm_type):
            problems.append(Problem("reward_model", f"has type {rm_type}; expected a struct {{style, ground_truth}}"))
        elif rm_type.get_field_index("ground_truth") < 0:
            problems.append(Problem("reward_model.ground_truth", "missing from the reward_model struct"))
    if problems:
        raise DatasetError(path, problems)
