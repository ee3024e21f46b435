"""Property tests on bad input: the dataset loader and the config loader fail only with their own errors.

- Datasets: random Parquet tables (random column sets and types, nulls, empty strings, duplicated
  ids), random bytes and damaged Parquet files either load into the documented frame (non-empty
  prompts and ground truths, unique ids) or raise ``DatasetError`` naming the file; never anything
  else. With ``on_bad_rows="skip"`` every row is either kept or reported once.
- Configs: random nested dicts, YAML texts and ``--set`` overrides either give a valid config
  (which survives a round trip) or raise a one-line ``ConfigError`` that names a key or section.
"""

from __future__ import annotations

import decimal
import tempfile
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coba_tasks.pipeline.config import (
    DEFAULT_CONFIG_PATH,
    Config,
    config_from_dict,
    config_hash,
    config_to_dict,
    load_config,
)
from coba_tasks.pipeline.config_fields import SECTIONS, ConfigError
from coba_tasks.pipeline.data import LOADED_COLUMNS, MESSAGE_TYPE, DatasetError, read_dataset

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ---------------------------------------------------------------------------------------------
# Datasets

_words = st.sampled_from(["", " ", "\t", "1+1=", "2", "2.0", "x", "What is 3*3?", "9"])
_text = _words | st.text(max_size=6)
_maybe_text = st.none() | _text
_message = st.none() | st.fixed_dictionaries(
    {"role": st.none() | st.sampled_from(["user", "system", "assistant", ""]), "content": _maybe_text}
)
_reward_type = pa.struct([("style", pa.string()), ("ground_truth", pa.string())])

# name -> (Arrow type, strategy of one cell); the cells are drawn from small pools so ids repeat
CELL_TYPES: dict[str, tuple[pa.DataType, st.SearchStrategy]] = {
    "string": (pa.string(), _maybe_text),
    "large_string": (pa.large_string(), _maybe_text),
    "int": (pa.int64(), st.none() | st.sampled_from([0, 1, -1, 7]) | st.integers(-(2**63), 2**63 - 1)),
    "uint": (pa.uint64(), st.none() | st.integers(0, 2**64 - 1)),
    "float": (pa.float64(), st.none() | st.sampled_from([0.0, 1.0, 2.5]) | st.floats()),
    "bool": (pa.bool_(), st.none() | st.booleans()),
    "binary": (pa.binary(), st.none() | st.binary(max_size=6)),
    "null": (pa.null(), st.none()),
    "date": (pa.date32(), st.none() | st.dates()),
    "decimal": (pa.decimal128(6, 2), st.none() | st.decimals(min_value=-99, max_value=99, places=2)),
    "messages": (pa.list_(MESSAGE_TYPE), st.none() | st.lists(_message, max_size=3)),
    "string_list": (pa.list_(pa.string()), st.none() | st.lists(_maybe_text, max_size=3)),
    "int_list": (pa.list_(pa.int64()), st.none() | st.lists(st.integers(-5, 5), max_size=3)),
    "reward": (
        _reward_type,
        st.none() | st.fixed_dictionaries({"style": _maybe_text, "ground_truth": _maybe_text}),
    ),
    "reward_number": (
        pa.struct([("ground_truth", pa.float64())]),
        st.none() | st.fixed_dictionaries({"ground_truth": st.none() | st.floats()}),
    ),
    "reward_no_truth": (pa.struct([("style", pa.string())]), st.none() | st.fixed_dictionaries({"style": _text})),
    "extra": (
        pa.struct([("index", pa.int64()), ("difficulty", pa.string())]),
        st.none()
        | st.fixed_dictionaries(
            {
                "index": st.none() | st.integers(0, 3),
                "difficulty": st.none() | st.sampled_from(["0", "-2", "hard", "²", "99999999999999999999", " 3"]),
            }
        ),
    ),
    "extra_float": (
        pa.struct([("index", pa.string()), ("difficulty", pa.float64())]),
        st.none() | st.fixed_dictionaries({"index": _maybe_text, "difficulty": st.none() | st.floats()}),
    ),
}
DICTIONARY = "dictionary"  # a dictionary-encoded string column (what pandas writes for a category)
COLUMN_NAMES = (
    "prompt",
    "answer",
    "data_source",
    "reward_model",
    "extra_info",
    "ability",
    "difficulty",
    "prompt_id",
    "other",
)
# column -> the types that make a loadable table; the fuzzer mixes them with any other type
USEFUL_TYPES = {
    "prompt": ["string", "messages"],
    "answer": ["string", "int", "float"],
    "data_source": ["string"],
    "reward_model": ["reward", "reward_number"],
    "extra_info": ["extra", "extra_float"],
    "difficulty": ["int", "string", "float"],
    "prompt_id": ["string", "int"],
}


@st.composite
def tables(draw: st.DrawFn) -> pa.Table:
    n_rows = draw(st.integers(0, 6))
    names = draw(st.lists(st.sampled_from(COLUMN_NAMES), min_size=1, max_size=6, unique=True))
    if draw(st.booleans()):  # most tables have a layout's required columns
        names = list(
            dict.fromkeys(
                [*draw(st.sampled_from([["prompt", "answer"], ["data_source", "prompt", "reward_model"]])), *names]
            )
        )
    columns = []
    for name in names:
        kinds = [*USEFUL_TYPES.get(name, []), *CELL_TYPES, DICTIONARY]
        kind = draw(
            st.sampled_from(USEFUL_TYPES.get(name, []) or kinds) if draw(st.booleans()) else st.sampled_from(kinds)
        )
        if kind == DICTIONARY:
            cells = draw(st.lists(_maybe_text, min_size=n_rows, max_size=n_rows))
            columns.append(pa.array(cells, type=pa.string()).dictionary_encode())
            continue
        arrow_type, cell = CELL_TYPES[kind]
        cells = draw(st.lists(cell, min_size=n_rows, max_size=n_rows))
        columns.append(pa.array(cells, type=arrow_type))
    if draw(st.integers(0, 9)) == 0:  # a column name written twice
        names.append(names[0])
        columns.append(columns[0])
    return pa.Table.from_arrays(columns, names=names)


def _check_loaded(path: Path, on_bad_rows: str) -> None:
    """Load ``path``: the documented frame, or DatasetError naming the file, and nothing else."""
    try:
        df, problems = read_dataset(path, on_bad_rows=on_bad_rows)
    except DatasetError as e:
        assert str(path) in str(e)
        return
    assert list(df.columns) == list(LOADED_COLUMNS)
    assert len(df) >= 1 and df["prompt_id"].is_unique
    assert df["difficulty"].dtype == "int64"
    assert all(isinstance(t, str) and t.strip() for t in df["prompt_text"])
    assert all(isinstance(t, str) and t.strip() for t in df["ground_truth"])
    assert all(isinstance(v, str) for c in ("prompt_id", "data_source", "ability") for v in df[c])
    assert all(m and all(isinstance(x["content"], str) for x in m) for m in df["messages"])
    if on_bad_rows == "error":
        assert problems == []
    else:  # every row of the file is kept or reported, not both
        n_rows = pq.read_metadata(path).num_rows
        bad = {p.row for p in problems}
        assert None not in bad and bad.isdisjoint(df.index)
        assert sorted([*bad, *df.index]) == list(range(n_rows))


@FUZZ
@given(table=tables(), on_bad_rows=st.sampled_from(["error", "skip"]))
def test_random_tables_load_or_raise_dataset_error(table: pa.Table, on_bad_rows: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "data.parquet"
        pq.write_table(table, path)
        _check_loaded(path, on_bad_rows)


def _valid_file_bytes() -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ok.parquet"
        rows = {
            "prompt": [f"{k}+1=" for k in range(5)],
            "answer": [str(k + 1) for k in range(5)],
            "difficulty": [1] * 5,
        }
        pd.DataFrame(rows).to_parquet(path)
        return path.read_bytes()


VALID = _valid_file_bytes()


@st.composite
def damaged_files(draw: st.DrawFn) -> bytes:
    how = draw(st.sampled_from(["random", "truncated", "flipped", "magic"]))
    if how == "random":
        return draw(st.binary(max_size=200))
    if how == "magic":  # looks like Parquet at both ends
        return b"PAR1" + draw(st.binary(max_size=200)) + b"PAR1"
    if how == "truncated":
        return VALID[: draw(st.integers(0, len(VALID) - 1))]
    data = bytearray(VALID)
    for _ in range(draw(st.integers(1, 4))):
        data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    return bytes(data)


@FUZZ
@given(content=damaged_files(), on_bad_rows=st.sampled_from(["error", "skip"]))
def test_random_and_damaged_bytes_load_or_raise_dataset_error(content: bytes, on_bad_rows: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "data.parquet"
        path.write_bytes(content)
        _check_loaded(path, on_bad_rows)


# ---------------------------------------------------------------------------------------------
# Configs

FIELDS = {name: list(cls.model_fields) for name, cls in SECTIONS.items()}
ALL_KEYS = [f"{s}.{k}" for s, keys in FIELDS.items() for k in keys]
_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-3, 300)
    | st.integers(-(10**30), 10**30)
    | st.floats()
    | st.sampled_from(["", "skip", "error", "adaptive", "coba", "uniform", "../x", "/abs", "a/b", "1e-4", "nan"])
    | st.text(max_size=8)
)
_values = st.recursive(
    _scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_scalars, inner, max_size=2), max_leaves=5
)


@st.composite
def config_dicts(draw: st.DrawFn) -> object:
    """Mostly the right sections and keys with random values; sometimes junk anywhere."""
    if draw(st.integers(0, 9)) == 0:
        return draw(_values)
    out: dict = {}
    for name in draw(st.lists(st.sampled_from([*SECTIONS, "trainer", "Run", ""]), max_size=4, unique=True)):
        if draw(st.integers(0, 9)) == 0:
            out[name] = draw(_values)
            continue
        keys = draw(st.lists(st.sampled_from([*FIELDS.get(name, ["x"]), "lrr", "SECTION"]), max_size=4, unique=True))
        out[name] = {k: draw(_values) for k in keys}
    return out


def _check_config(make) -> None:
    """``make()`` gives a valid config, or a one-line ConfigError that names a key or a section."""
    try:
        cfg = make()
    except ConfigError as e:
        message = str(e)
        assert message and "\n" not in message
        assert (
            any(key in message for key in ALL_KEYS)
            or "config key" in message
            or "section" in message
            or "invalid YAML" in message
            or "section.key=value" in message
        ), message
        return
    assert isinstance(cfg, Config)
    assert config_from_dict(config_to_dict(cfg)) == cfg
    assert len(config_hash(cfg)) == 16
    a = cfg.allocation
    assert 2 <= a.min_budget <= a.group_size <= a.max_budget
    assert "/" not in cfg.run.name and not cfg.run.name.startswith(".")


@FUZZ
@given(data=config_dicts())
def test_random_config_dicts_give_a_config_or_a_config_error(data: object) -> None:
    _check_config(lambda: config_from_dict(data))


DEMO_LINES = DEFAULT_CONFIG_PATH.read_text().splitlines()


@st.composite
def yaml_texts(draw: st.DrawFn) -> str:
    how = draw(st.sampled_from(["dump", "text", "edited"]))
    if how == "dump":
        return yaml.safe_dump(draw(config_dicts()), default_flow_style=draw(st.booleans()))
    if how == "text":
        return draw(st.text(max_size=60))
    lines = list(DEMO_LINES)  # the shipped config with a few lines deleted, duplicated or altered
    for _ in range(draw(st.integers(1, 3))):
        k = draw(st.integers(0, len(lines) - 1))
        edit = draw(st.sampled_from(["delete", "duplicate", "replace", "indent"]))
        if edit == "delete":
            del lines[k]
        elif edit == "duplicate":
            lines.insert(k, lines[k])
        elif edit == "indent":
            lines[k] = " " + lines[k]
        else:
            key, sep, _ = lines[k].partition(":")
            lines[k] = f"{key}{sep} {draw(st.text(max_size=8))}" if sep else draw(st.text(max_size=20))
        if not lines:
            break
    return "\n".join(lines) + "\n"


@FUZZ
@given(text=yaml_texts())
def test_random_yaml_texts_give_a_config_or_a_config_error(text: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "c.yaml"
        try:
            path.write_text(text, encoding="utf-8")
        except UnicodeEncodeError:  # a lone surrogate: not a file anyone can write
            return
        _check_config(lambda: load_config(path))


_override_values = st.text(max_size=12) | _values.map(
    lambda v: yaml.safe_dump(v, default_flow_style=True).strip().removesuffix("...").strip()
)


@FUZZ
@given(
    overrides=st.lists(
        st.tuples(st.sampled_from([*ALL_KEYS, "optim", "x.y", "data.on_bad_rows", ""]), _override_values).map(
            lambda kv: f"{kv[0]}={kv[1]}"
        )
        | st.text(max_size=15),
        max_size=4,
    )
)
def test_random_set_overrides_give_a_config_or_a_config_error(overrides: list[str]) -> None:
    _check_config(lambda: load_config(None, overrides))


@pytest.mark.parametrize("text", ["data:\n  on_bad_rows: skip\n", "data:\n  on_bad_rows: error\n"])
def test_on_bad_rows_from_a_file(tmp_path: Path, text: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    assert load_config(path).data.on_bad_rows == text.split()[-1]


def test_decimal_ground_truth_is_a_bad_row_not_a_crash(tmp_path: Path) -> None:
    path = tmp_path / "d.parquet"
    table = pa.table(
        {"prompt": ["1+1=", "2+2="], "answer": pa.array([decimal.Decimal("2.00"), None], pa.decimal128(6, 2))}
    )
    pq.write_table(table, path)
    with pytest.raises(DatasetError, match="row 0, column answer: ground truth must be a string or a number"):
        read_dataset(path)
