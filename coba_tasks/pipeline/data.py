"""Prompt datasets, one concept from the file to the run: read veRL-format or flat Parquet into one validated
table (and write veRL Parquet), the bad-row policy, the prompts rendered and tokenized as the model sees them,
and a run's datasets after every check (``load_run_datasets``) with the prompts its held-out evaluations score
(``eval_prompt_set``).

Two input layouts (docs/design.md, "Components"), told apart by the type of ``prompt``: **veRL** (a list of
messages) and **flat** (a string, with ``answer``; optional ``data_source``, ``ability``, ``difficulty`` and
``prompt_id``). The prompt id is ``extra_info.index`` or ``prompt_id``, else ``prompt_hash``; a missing
difficulty is -1; ``extra_info`` is kept as JSON text (the reward file's argument).

Every row is checked on load; ``DatasetError`` names the file, the row (counted from 0, as in
``pandas.read_parquet(path).iloc[row]``) and the column of the first few bad rows. With ``on_bad_rows="skip"``
bad rows are dropped and returned as ``Problem``s (a duplicated id keeps its first row); a file whose every
row is bad, or that is bad as a whole, is still an error.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from coba_tasks.engines.fileio import write_parquet
from coba_tasks.pipeline.config_fields import ConfigError, short
from coba_tasks.pipeline.config_sections import MAIN_TEST_SET, OnBadRows, PromptFormat, UnknownSources, test_set_name

if TYPE_CHECKING:
    from coba_tasks.engines.reward_file import RewardFunction
    from coba_tasks.pipeline.config import Config

# --- What can be wrong with a dataset, and the bad-row policy every data check shares


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


# --- Reading a dataset's rows: each veRL or flat row checked and turned into the loaded fields


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


class _BadValue(Exception):
    """Raised by the per-value parsers below (args: column, message); the row loop makes it a ``Problem``."""


def prompt_hash(messages: Messages) -> str:
    """A stable id for a chat prompt: the first 16 hex chars of sha256 of its canonical JSON.

    >>> prompt_hash([{"role": "user", "content": "1+1="}])
    '415485a3e0e22f36'
    """
    canonical = json.dumps(
        [{"role": m["role"], "content": m["content"]} for m in messages], ensure_ascii=False, separators=(",", ":")
    )
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:HASH_CHARS]


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


def make_flat_reader(default_source: str) -> Callable[[Row], Row]:
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
        raise _BadValue(column, f"difficulty must be an integer (64-bit), got {short(value)}")
    return level


def _is_ascii_integer(text: str) -> bool:
    """'12', '-3': what ``int()`` reads, without '+', '_' or non-ASCII digits."""
    digits = text.removeprefix("-")
    return digits.isascii() and digits.isdigit()


def _required_string(value: Any, column: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _BadValue(column, f"{column} must be a non-empty string, got {value!r}")
    return value


def _optional_string(value: Any) -> str:
    return value if isinstance(value, str) else ""


def duplicate_ids(rows: list[Row]) -> list[Problem]:
    """A problem for every row whose prompt id an earlier row already has, naming the column the id came from
    (``prompt`` for a hashed id: two rows with the same messages)."""
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


# --- Reading and writing a dataset file


VERL_REQUIRED = ("data_source", "prompt", "reward_model")
FLAT_REQUIRED = ("prompt", "answer")
VERL_COLUMNS = ("data_source", "prompt", "ability", "reward_model", "extra_info")

MESSAGE_TYPE = pa.struct([("role", pa.string()), ("content", pa.string())])
REWARD_MODEL_TYPE = pa.struct([("style", pa.string()), ("ground_truth", pa.string())])

Layout = Literal["verl", "flat"]
MISSING_HINT = (
    f"missing; a veRL table needs columns {', '.join(VERL_REQUIRED)}, "
    f"a flat table needs columns {', '.join(FLAT_REQUIRED)}"
)


def load_dataset(
    path: str | os.PathLike[str], default_source: str = "math", on_bad_rows: OnBadRows = "error"
) -> pd.DataFrame:
    """Read a veRL or flat Parquet file of prompts and validate every row: one row per prompt, in file order,
    with the columns of ``LOADED_COLUMNS``, indexed by the row's number in the file (0..n-1 unless rows were
    skipped). ``default_source`` is the ``data_source`` of flat rows without one; ``on_bad_rows="skip"`` drops
    bad rows (``read_dataset`` also returns them). DatasetError: the file is not Parquet, lacks a column, or
    has bad rows and ``on_bad_rows`` is ``"error"`` or every row is bad; FileNotFoundError: no such file."""
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
        values = table.to_pylist()  # structs become dicts, lists lists
    except (UnicodeDecodeError, pa.ArrowException) as e:
        raise DatasetError(path, f"not a readable Parquet file: damaged ({error_reason(e)})") from e
    if table.num_rows == 0:
        raise DatasetError(path, "the table has no rows")
    reader = read_verl_row if layout == "verl" else make_flat_reader(default_source)
    rows, problems = [], []
    for i, raw in enumerate(values):  # every problem collected, not just the first
        try:
            rows.append({**reader(raw), "_row": i})
        except _BadValue as e:
            column, message = e.args
            problems.append(Problem(column, message, row=i))
    problems += duplicate_ids(rows)
    problems.sort(key=lambda p: p.row or 0)
    refuse_or_skip(path, table.num_rows, problems, on_bad_rows)
    bad = {p.row for p in problems}
    return rows_to_frame([row for row in rows if row["_row"] not in bad]), problems


def write_verl_parquet(df: pd.DataFrame, path: str | os.PathLike[str]) -> Path:
    """Write prompts in the veRL layout, atomically and deterministically (explicit schema, no pandas metadata:
    a generator rerun gives the same bytes); returns the path. ``df`` has ``data_source``, ``prompt`` (list of
    ``{role, content}``), ``ability``, ``reward_model`` (``{style, ground_truth}``) and ``extra_info`` (a dict
    per row, same keys in every row); other columns are not written."""
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


# --- File and schema checks


def _read_table(path: str | os.PathLike[str]) -> pa.Table:
    """The whole Parquet file as an Arrow table; DatasetError if it is not Parquet."""
    try:
        table = pq.read_table(path)
        table.column_names  # noqa: B018 - decodes the names: a damaged footer fails here
    except FileNotFoundError:
        raise
    except (pa.ArrowException, OSError, UnicodeDecodeError) as e:  # not Parquet; IO, type, damaged names
        with contextlib.suppress(pa.ArrowException, OSError, UnicodeDecodeError):  # even the footer is unreadable
            _refuse_repeated_columns(path, pq.read_schema(path).names)  # a valid file whose column names repeat
        raise DatasetError(path, f"not a readable Parquet file ({error_reason(e)})") from e
    _refuse_repeated_columns(path, table.column_names)
    try:  # a damaged file can decode into invalid values (strings that are not UTF-8, bad offsets)
        table.validate(full=True)
    except pa.ArrowException as e:
        raise DatasetError(path, f"not a readable Parquet file: damaged values ({error_reason(e)})") from e
    for i, column in enumerate(table.schema):  # dictionary-encoded (pandas' categorical): the values themselves
        if pa.types.is_dictionary(column.type):
            table = table.set_column(i, column.name, table.column(i).cast(column.type.value_type))
    return table


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
        raise DatasetError(path, [Problem("prompt", MISSING_HINT)])
    prompt_type = schema.field("prompt").type
    if _is_list(prompt_type):
        return "verl"
    if is_string_type(prompt_type):
        return "flat"
    if pa.types.is_null(prompt_type):  # every prompt is null: judge by the other columns
        return "verl" if "reward_model" in schema.names else "flat"
    message = f"has type {prompt_type}; expected a list of {{role, content}} (veRL) or a string (flat table)"
    raise DatasetError(path, [Problem("prompt", message)])


def _check_columns(schema: pa.Schema, layout: Layout, path: str | os.PathLike[str]) -> None:
    """Every required column is there, and a veRL ``reward_model`` is a struct with ``ground_truth``."""
    required = VERL_REQUIRED if layout == "verl" else FLAT_REQUIRED
    problems = [Problem(c, MISSING_HINT) for c in required if c not in schema.names]
    if layout == "verl" and "reward_model" in schema.names:
        rm_type = schema.field("reward_model").type
        if not pa.types.is_struct(rm_type):
            problems.append(Problem("reward_model", f"has type {rm_type}; expected a struct {{style, ground_truth}}"))
        elif rm_type.get_field_index("ground_truth") < 0:
            problems.append(Problem("reward_model.ground_truth", "missing from the reward_model struct"))
    if problems:
        raise DatasetError(path, problems)


# --- Prompts as the model sees them: rendering, tokenizing, and the check that each fits the context


def prompt_format_of(tokenizer: Any, prompt_format: PromptFormat) -> Literal["chat", "raw"]:
    """The format ``render_prompts`` uses: ``auto`` is ``chat`` when the tokenizer has a chat template.
    ValueError: ``chat`` asked for and the tokenizer has no chat template, or an unknown format."""
    if prompt_format not in get_args(PromptFormat):
        raise ValueError(f"prompt format must be one of {', '.join(get_args(PromptFormat))}, got {prompt_format!r}")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if prompt_format == "chat" and not has_template:
        raise ValueError(
            "data.prompt_format=chat but the model's tokenizer has no chat template; "
            "use data.prompt_format=raw (the last user message as plain text) or a model with a template"
        )
    if prompt_format == "auto":
        return "chat" if has_template else "raw"
    return prompt_format


def render_prompts(
    df: pd.DataFrame, tokenizer: Any, prompt_format: PromptFormat = "auto"
) -> tuple[pd.DataFrame, list[Problem]]:
    """Render every prompt as the model will see it, and tokenize it: the one place prompts become tokens.

    - ``chat``: the tokenizer's chat template over the whole ``messages`` list (system messages and
      earlier turns included) with ``add_generation_prompt=True``, tokenized without adding special
      tokens (the template writes them), as Hugging Face's ``apply_chat_template(tokenize=True)`` and
      veRL do.
    - ``raw``: the last user message as plain text, tokenized with the tokenizer's special tokens (a
      BOS where the tokenizer adds one), as vLLM tokenizes a text prompt. For base models and the
      tiny character model.

    The rollout engine receives ``prompt_token_ids`` as they are (a token prompt: it tokenizes
    nothing) and the trainer reads the same ids, so the policy is trained on the sequence it sampled.

    Returns ``df`` (a frame of ``load_dataset``) with ``prompt_rendered`` (the text) and ``prompt_token_ids``
    (a list of ints per row), and the problems of rows whose template failed to render (those rows dropped).
    """
    fmt = prompt_format_of(tokenizer, prompt_format)
    texts, problems = [], []
    for row, (messages, text) in zip(df.index, zip(df["messages"], df["prompt_text"], strict=True), strict=True):
        if fmt == "raw":
            texts.append(text)
            continue
        try:
            chat = [{"role": str(m["role"]), "content": str(m["content"])} for m in messages]
            texts.append(tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))
        except Exception as e:  # a template refuses some role orders (jinja raises its own errors)
            problems.append(
                Problem("prompt", f"the chat template cannot render this prompt: {error_reason(e)}", row=int(row))
            )
            texts.append(None)
    keep = [t is not None for t in texts]
    kept = [t for t in texts if t is not None]
    ids = _token_ids(tokenizer, kept, add_special_tokens=fmt == "raw")
    out = df[keep].copy() if problems else df.copy()
    out["prompt_rendered"] = kept
    out["prompt_token_ids"] = [list(map(int, i)) for i in ids]
    return out, problems


def _token_ids(tokenizer: Any, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    """The token ids of ``texts``, as ``tokenizer(texts)["input_ids"]`` gives them.

    A fast tokenizer's Rust backend encodes the batch without the character offsets and attention masks
    that ``tokenizer(...)`` also computes: the same ids, in a third of the time (20,000 prompts: 0.17 s
    against 0.55 s), paid by every run at its start.
    """
    if not texts:
        return []
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # a slow (Python) tokenizer
        return tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]
    return [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=add_special_tokens)]


def check_prompt_lengths(
    df: pd.DataFrame,
    context: int,
    max_tokens: int,
    path: str | os.PathLike[str],
    on_bad_rows: OnBadRows = "error",
    context_from: str = "rollout.max_model_len / the model's max_position_embeddings",
) -> tuple[pd.DataFrame, list[Problem]]:
    """Refuse (or with ``"skip"`` drop) the prompts that leave no room for a whole completion.

    A prompt fits when its token count (``prompt_token_ids`` of ``render_prompts``, whose index is the
    file's row number) plus ``max_tokens`` is at most ``context`` (the engine's, in tokens; ``context_from``
    says where it came from, for messages). Returns the frame without the skipped rows (index kept) and their
    problems; DatasetError when some prompt is too long and ``on_bad_rows`` is ``"error"``, or every one is.
    """
    check_on_bad_rows(on_bad_rows)
    if df.empty:
        return df, []
    limit = context - max_tokens
    counts = [len(ids) for ids in df["prompt_token_ids"]]
    problems = [
        Problem(
            "prompt",
            f"prompt is {n} tokens; with rollout.max_tokens {max_tokens} it exceeds the context of"
            f" {context} tokens ({context_from})",
            row=int(row),
        )
        for row, n in zip(df.index, counts, strict=True)
        if n > limit
    ]
    refuse_or_skip(path, len(df), problems, on_bad_rows)
    keep = [n <= limit for n in counts]
    return (df[keep] if problems else df), problems


def model_context(model_path: str, trust_remote_code: bool, max_model_len: int) -> tuple[Any, int | None, str]:
    """(tokenizer, context length or None when unknown, where the length came from) of a model.

    The context is ``max_model_len`` when it is > 0, else the model config's
    ``max_position_embeddings``. ConfigError naming ``model.path`` when the model cannot be read.
    """
    from transformers import AutoConfig, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        if max_model_len > 0:
            return tokenizer, max_model_len, "rollout.max_model_len"
        config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.path: cannot read the tokenizer and config of {model_path}: {e}") from e
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(text_config, name, None)
        if isinstance(value, int) and value > 0:
            return tokenizer, value, f"the model's {name}; rollout.max_model_len is 0"
    return tokenizer, None, "unknown"


# --- A run's datasets after every check, the ground-truth check, and the prompts its evaluations score


BAD_ROWS_COLUMNS = ("key", "file", "row", "column", "message")  # bad_rows.parquet of a run


@dataclass
class RunDatasets:
    """A run's prompts after every check: what ``load_run_datasets`` gives."""

    train: pd.DataFrame | None  # None when not asked for (a continuing run has its prompts table)
    test: pd.DataFrame
    extra_tests: dict[str, pd.DataFrame] = field(default_factory=dict)  # data.extra_tests: set name -> prompts
    skipped: dict[str, tuple[str, list[Problem]]] = field(default_factory=dict)  # config key -> (file, problems)
    tokenizer: Any = None  # the model's tokenizer, which rendered the prompts
    train_file: str = ""  # data.train, when it was loaded
    overlap: dict[str, tuple[str, int, int]] = field(default_factory=dict)  # test key -> (file, shared, prompts)

    def bad_rows(self) -> pd.DataFrame:
        """The skipped rows as a table (``BAD_ROWS_COLUMNS``), written to a run as bad_rows.parquet."""
        records = [
            (key, file, -1 if p.row is None else p.row, p.column, p.message)
            for key, (file, problems) in self.skipped.items()
            for p in problems
        ]
        frame = pd.DataFrame(records, columns=list(BAD_ROWS_COLUMNS))
        return frame.astype({"key": str, "file": str, "row": "int64", "column": str, "message": str})

    def skip_lines(self) -> list[str]:
        """One line per file with skipped rows: ``skipped N bad rows of FILE (see bad_rows.parquet)``."""
        return [
            f"skipped {len(problems)} bad row{'s' if len(problems) != 1 else ''} of {file} (see bad_rows.parquet)"
            for file, problems in self.skipped.values()
            if problems
        ]

    def overlap_lines(self) -> list[str]:
        """One warning per held-out set that shares prompt texts with data.train, with the count."""
        return [
            f"warning: {shared} of {total} prompts of {file} ({key}) have the same text as a prompt of "
            f"{self.train_file} (data.train): held-out accuracy counts them; remove them from one of the files "
            "for a clean held-out set"
            for key, (file, shared, total) in self.overlap.items()
            if shared
        ]


def shared_prompts(train: pd.DataFrame, test: pd.DataFrame) -> int:
    """How many of ``test``'s prompts have the text of a prompt of ``train`` (last user message, stripped)."""
    seen = set(train["prompt_text"].str.strip())
    return int(test["prompt_text"].str.strip().isin(seen).sum())


_TRUTH_CHECKED: dict[tuple[str, str], str | None] = {}  # (ground truth, source) -> reason; per process
_REWARD_CHECKED: set[tuple[str, str, str, float]] = set()  # (path, function, sha256, time limit); per process


def reward_function(cfg: Config) -> RewardFunction | None:
    """The run's reward file (``verify.reward_function``), checked, or None for the built-in verifiers.

    The check imports the file in a verifier worker under ``verify.timeout_s``, never in this process (its
    top-level code is the user's: it runs where the items are scored, with the same limit). A file that does
    not exist or import in time, or lacks the function, or whose name is not a function, is a
    ``RewardFileError`` (a ValueError): one line naming the key, the path and the fix, before anything
    starts. The run's verifier workers import the same file again (by its absolute path). A file checked
    once in this process is not checked again until its bytes change."""
    from coba_tasks.engines.fileio import sha256_file
    from coba_tasks.engines.reward_file import RewardFunction
    from coba_tasks.engines.verify_pool import check_reward_function

    if not cfg.verify.reward_function.strip():
        return None
    rf = RewardFunction.from_spec(cfg.verify.reward_function, cfg.verify.pass_threshold)
    try:
        digest = sha256_file(rf.path)
    except OSError:  # missing or unreadable: the check says which, in one line
        digest = ""
    key = (rf.path, rf.name, digest, cfg.verify.timeout_s)
    if key not in _REWARD_CHECKED:
        check_reward_function(rf, cfg.verify.timeout_s)
        _REWARD_CHECKED.add(key)
    return rf


def check_ground_truths(
    df: pd.DataFrame,
    path: str | os.PathLike[str],
    on_bad_rows: OnBadRows = "error",
    unknown_sources: str = "error",
    workers: int = 2,
    timeout_s: float = 5.0,
) -> tuple[pd.DataFrame, list[Problem]]:
    """Check every row's ground truth with the verifier its ``data_source`` names (``Verifier.check``, run
    in verifier worker processes with the hard ``timeout_s`` limit): a ground truth it cannot read is a bad
    row (``on_bad_rows``), never a prompt whose every rollout scores ``error`` (pass rate 0, where CoBA-RL
    would spend budget).

    A ``data_source`` no verifier is registered for stops the run (``DatasetError`` naming the sources, the
    registered ones and how to register one), unless ``unknown_sources`` is ``math``: then math-verify
    scores those rows, as it checks them here. Results are kept for the process, so a second load of the
    same rows (``coba run`` checks, then its flow) costs nothing.
    """
    from coba_tasks.engines.verify import UNKNOWN_SOURCE_HINT, registered_verifiers
    from coba_tasks.engines.verify import unknown_sources as find_unknown
    from coba_tasks.engines.verify_pool import VerifierPool

    if unknown_sources not in get_args(UnknownSources):
        words = ", ".join(get_args(UnknownSources))
        raise ValueError(f"unknown_sources must be one of {words}, got {unknown_sources!r}")
    if df.empty:
        return df, []
    unknown = find_unknown(df["data_source"])
    if unknown and unknown_sources == "error":
        rows = df.index[df["data_source"].isin(unknown)].tolist()
        shown = ", ".join(map(str, rows[:5])) + (f" and {len(rows) - 5} more" if len(rows) > 5 else "")
        raise DatasetError(
            path,
            f"data_source {', '.join(map(repr, unknown))} (rows {shown}) has no verifier; registered: "
            f"{', '.join(registered_verifiers())}. {UNKNOWN_SOURCE_HINT[0].upper()}{UNKNOWN_SOURCE_HINT[1:]}",
        )
    items = list(zip(df["ground_truth"].astype(str), df["data_source"].astype(str), strict=True))
    todo = [item for item in dict.fromkeys(items) if item not in _TRUTH_CHECKED]
    if todo:
        with VerifierPool(workers=workers, timeout_s=timeout_s) as pool:
            _TRUTH_CHECKED.update(zip(todo, pool.check_truths(todo), strict=True))
    column = _ground_truth_column(path)
    problems = [
        Problem(column, reason, row=int(row))
        for row, item in zip(df.index, items, strict=True)
        if (reason := _TRUTH_CHECKED[item]) is not None
    ]
    refuse_or_skip(path, len(df), problems, on_bad_rows)
    bad = {p.row for p in problems}
    return (df[[r not in bad for r in df.index]] if problems else df), problems


def _ground_truth_column(path: str | os.PathLike[str]) -> str:
    """Where a file keeps its ground truths: ``reward_model.ground_truth`` (veRL) or ``answer`` (flat)."""
    try:
        prompt = pq.read_schema(path).field("prompt").type
    except (KeyError, pa.ArrowException, OSError):
        return "ground_truth"
    return "answer" if is_string_type(prompt) else "reward_model.ground_truth"


def load_run_datasets(cfg: Config, train: bool = True) -> RunDatasets:
    """Load and check a run's datasets: the reward file, if any (``reward_function``), every row
    (``load_dataset``), every ground truth with its verifier (``check_ground_truths``; not with a reward
    file, which reads the ground truths itself), rendered and tokenized as the model will see it
    (``render_prompts`` with ``data.prompt_format``), and every prompt's length.

    ``data.on_bad_rows`` says whether a bad row stops the run or is skipped. The context is
    ``rollout.max_model_len``, or the model's ``max_position_embeddings`` when that is 0 (no
    length check when the model declares none). The frames come back with a fresh 0..n-1 index.
    ConfigError (naming ``model.path``) when the model's tokenizer or config cannot be read.
    """
    # a reward file scores every row whatever its data_source: no ground-truth check by a built-in verifier
    custom_reward = reward_function(cfg) is not None
    tokenizer, context, context_from = model_context(
        cfg.model.path, cfg.model.trust_remote_code, cfg.rollout.max_model_len
    )
    out = RunDatasets(train=None, test=pd.DataFrame(), tokenizer=tokenizer)
    keys = (("data.train", cfg.data.train),) if train else ()
    extra = tuple((f"data.extra_tests[{i}]", p) for i, p in enumerate(cfg.data.extra_tests))
    v, on_bad = cfg.verify, cfg.data.on_bad_rows
    for key, path in (*keys, ("data.test", cfg.data.test), *extra):
        df, problems = read_dataset(path, on_bad_rows=on_bad)
        df = keep_difficulties(df, cfg.data.difficulties, path)
        rows = len(df) + len(problems)
        # each check: (frame, *args) -> (the rows kept, the problems of those skipped), or DatasetError
        checks: list[tuple[Callable[..., tuple[pd.DataFrame, list[Problem]]], tuple[Any, ...]]] = []
        if not custom_reward:
            checks.append((check_ground_truths, (path, on_bad, v.unknown_sources, v.workers, v.timeout_s)))
        checks.append((_render_checked, (tokenizer, cfg.data.prompt_format, path, on_bad)))
        if context is not None:
            checks.append((check_prompt_lengths, (context, cfg.rollout.max_tokens, path, on_bad, context_from)))
        for check, args in checks:
            try:
                df, found = check(df, *args)
            except DatasetError as e:
                if not problems or not e.problems:
                    raise
                # skipping: the rows left by the earlier checks all fail this one; report the whole file's rows
                every = sorted(problems + e.problems, key=lambda p: p.row or 0)
                raise DatasetError(path, every, note=all_bad_note(rows)) from e
            problems = sorted(problems + found, key=lambda p: p.row or 0)
        if problems:
            out.skipped[key] = (str(path), problems)
        if key.startswith("data.extra_tests"):
            out.extra_tests[test_set_name(path)] = df.reset_index(drop=True)
        else:
            setattr(out, key.removeprefix("data."), df.reset_index(drop=True))
        if out.train is not None and key != "data.train":  # held-out prompts that are training prompts too
            out.train_file = str(cfg.data.train)
            out.overlap[key] = (str(path), shared_prompts(out.train, df), len(df))
    return out


def _render_checked(
    df: pd.DataFrame, tokenizer: Any, prompt_format: PromptFormat, path: str | os.PathLike[str], on_bad_rows: OnBadRows
) -> tuple[pd.DataFrame, list[Problem]]:
    """``render_prompts``, its unrendered rows refused or skipped as every other check's bad rows are."""
    out, unrendered = render_prompts(df, tokenizer, prompt_format)
    refuse_or_skip(path, len(df), unrendered, on_bad_rows)
    return out, unrendered


def keep_difficulties(df: pd.DataFrame, levels: Sequence[int], path: str | os.PathLike[str]) -> pd.DataFrame:
    """The rows of ``df`` whose difficulty is in ``levels`` (``data.difficulties``; empty keeps every row);
    ConfigError when the file has no difficulty levels, or none of its rows is of those levels."""
    if not levels:
        return df
    present = sorted(int(x) for x in df["difficulty"].unique()) if "difficulty" in df else []
    if not present or present == [-1]:
        raise ConfigError(
            f"data.difficulties = {list(levels)}: {path} has no difficulty levels (extra_info.difficulty or a "
            "difficulty column); set data.difficulties=[] (coba eval: --difficulties all) to keep every row"
        )
    kept = df[df["difficulty"].isin(list(levels))]
    if kept.empty:
        raise ConfigError(
            f"data.difficulties = {list(levels)}: no row of {path} is of those levels (it has levels "
            f"{', '.join(map(str, present))})"
        )
    return kept.reset_index(drop=True)


def sample_eval_prompts(test: pd.DataFrame, prompts: int, seed: int) -> pd.DataFrame:
    """The held-out prompts an evaluation scores: a sample of ``prompts`` rows seeded by ``seed`` (the run
    config's data.eval_prompts and run.seed), or every row when ``prompts`` is 0 or not below their count.

    >>> test = pd.DataFrame({"prompt_id": list("abcde")})
    >>> sample_eval_prompts(test, 2, seed=0)["prompt_id"].tolist(), len(sample_eval_prompts(test, 0, seed=0))
    (['c', 'a'], 5)
    """
    return test.sample(prompts, random_state=seed).reset_index(drop=True) if 0 < prompts < len(test) else test


def eval_prompt_set(cfg: Config, test: pd.DataFrame, extra: Mapping[str, pd.DataFrame] | None = None) -> pd.DataFrame:
    """The prompts every evaluation scores, with their ``test_set``: the ``data.eval_prompts`` sample
    (seeded by ``run.seed``) of data.test (``MAIN_TEST_SET``), and the same positions of each extra set
    (``data.extra_tests``: the same problems when the files list them in the same order), whose
    prompt ids are prefixed with the set's name so that every row of an evaluation has its own id."""
    n, seed = cfg.data.eval_prompts, cfg.run.seed
    frames = [sample_eval_prompts(test, n, seed).assign(test_set=MAIN_TEST_SET)]
    for name, df in (extra or {}).items():
        renamed = {"test_set": name, "prompt_id": lambda d, name=name: name + "/" + d["prompt_id"]}
        frames.append(sample_eval_prompts(df, n, seed).assign(**renamed))
    return pd.concat(frames, ignore_index=True)
