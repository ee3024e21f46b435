"""Tests for coba_tasks/pipeline/data*.py (loading, validation, rendering) and data/make_arith.py (the shipped task)."""

from __future__ import annotations

import json
import string
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scripts_loader import load_script

from coba_tasks.pipeline.config import apply_overrides, load_config
from coba_tasks.pipeline.config_fields import ConfigError
from coba_tasks.pipeline.data import (
    BAD_ROWS_COLUMNS,
    LOADED_COLUMNS,
    DatasetError,
    check_prompt_lengths,
    load_dataset,
    load_run_datasets,
    prompt_hash,
    read_dataset,
    render_prompts,
    write_verl_parquet,
)

DATA_DIR = Path(__file__).resolve().parents[2] / "data"


make_arith = load_script("data/make_arith.py")


def verl_rows(n: int = 3) -> list[dict]:
    """``n`` valid veRL rows with indices 10, 11, ... and difficulties 0, 1, ..."""
    return [
        {
            "data_source": "arith",
            "prompt": [{"role": "system", "content": "Answer."}, {"role": "user", "content": f"{k}+1="}],
            "ability": "arithmetic",
            "reward_model": {"style": "rule", "ground_truth": str(k + 1)},
            "extra_info": {"index": 10 + k, "difficulty": k, "split": "train"},
        }
        for k in range(n)
    ]


def write_rows(path: Path, rows: list[dict], schema: pa.Schema | None = None) -> Path:
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return path


def raises_dataset_error(path: Path, *fragments: str) -> DatasetError:
    """Load ``path``, expect a DatasetError, check that it names the file and each fragment."""
    with pytest.raises(DatasetError) as info:
        load_dataset(path)
    message = str(info.value)
    assert str(path) in message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return info.value


# ---------------------------------------------------------------------------------------------
# Loading


def test_verl_file_loads_with_ids_and_fields(tmp_path: Path) -> None:
    df = load_dataset(write_rows(tmp_path / "v.parquet", verl_rows(3)))
    assert list(df.columns) == list(LOADED_COLUMNS)
    assert df["prompt_id"].tolist() == ["10", "11", "12"]
    assert df["prompt_text"].tolist() == ["0+1=", "1+1=", "2+1="]  # the last user message, not the system one
    assert df["ground_truth"].tolist() == ["1", "2", "3"]
    assert df["difficulty"].tolist() == [0, 1, 2]
    assert df["difficulty"].dtype == "int64"
    assert set(df["data_source"]) == {"arith"}
    assert set(df["ability"]) == {"arithmetic"}
    assert df["messages"][1] == [{"role": "system", "content": "Answer."}, {"role": "user", "content": "1+1="}]


def test_flat_file_loads_with_default_source_and_hashed_ids(tmp_path: Path) -> None:
    path = tmp_path / "flat.parquet"
    pd.DataFrame({"prompt": ["What is 2+2?", "What is 3*3?"], "answer": ["4", "9"]}).to_parquet(path)
    df = load_dataset(path, default_source="gsm8k")
    assert df["prompt_text"].tolist() == ["What is 2+2?", "What is 3*3?"]
    assert df["ground_truth"].tolist() == ["4", "9"]
    assert df["messages"][0] == [{"role": "user", "content": "What is 2+2?"}]
    assert set(df["data_source"]) == {"gsm8k"}
    assert df["difficulty"].tolist() == [-1, -1]
    assert df["prompt_id"][0] == prompt_hash([{"role": "user", "content": "What is 2+2?"}])


def test_flat_file_numeric_answers_become_strings(tmp_path: Path) -> None:
    path = tmp_path / "flat.parquet"
    pd.DataFrame({"prompt": ["1+1=", "1-3="], "answer": [2, -2], "difficulty": [0, 3]}).to_parquet(path)
    df = load_dataset(path)
    assert df["ground_truth"].tolist() == ["2", "-2"]
    assert df["difficulty"].tolist() == [0, 3]
    assert set(df["data_source"]) == {"math"}


def test_prompt_id_falls_back_to_a_stable_hash(tmp_path: Path) -> None:
    rows = verl_rows(2)
    for row in rows:
        del row["extra_info"]
    first = load_dataset(write_rows(tmp_path / "a.parquet", rows))
    again = load_dataset(write_rows(tmp_path / "b.parquet", rows[::-1]))
    ids = first["prompt_id"].tolist()
    assert all(len(i) == 16 and set(i) <= set(string.hexdigits.lower()) for i in ids)
    assert ids[0] != ids[1]
    assert again["prompt_id"].tolist() == ids[::-1]  # the id follows the prompt, not the row
    assert first["difficulty"].tolist() == [-1, -1]


def test_prompt_hash_is_the_sha256_of_the_messages_json() -> None:
    messages = [{"role": "user", "content": "37+58="}]
    assert prompt_hash(messages) == prompt_hash([dict(m) for m in messages])
    assert prompt_hash(messages) != prompt_hash([{"role": "user", "content": "37+59="}])
    assert prompt_hash([{"role": "user", "content": "1+1="}]) == "415485a3e0e22f36"


# ---------------------------------------------------------------------------------------------
# Validation errors


def test_missing_column_is_named(tmp_path: Path) -> None:
    rows = verl_rows(2)
    for row in rows:
        del row["reward_model"]
    raises_dataset_error(write_rows(tmp_path / "x.parquet", rows), "column reward_model: missing")


def test_flat_table_without_answer_is_named(tmp_path: Path) -> None:
    path = tmp_path / "flat.parquet"
    pd.DataFrame({"prompt": ["1+1="]}).to_parquet(path)
    raises_dataset_error(path, "column answer: missing")


def test_null_ground_truth_names_row_and_column(tmp_path: Path) -> None:
    rows = verl_rows(3)
    rows[1]["reward_model"]["ground_truth"] = None
    error = raises_dataset_error(
        write_rows(tmp_path / "x.parquet", rows), "row 1, column reward_model.ground_truth: ground truth is null"
    )
    assert [(p.row, p.column) for p in error.problems] == [(1, "reward_model.ground_truth")]


def test_empty_ground_truth_names_row_and_column(tmp_path: Path) -> None:
    rows = verl_rows(3)
    rows[2]["reward_model"]["ground_truth"] = "  "
    raises_dataset_error(
        write_rows(tmp_path / "x.parquet", rows), "row 2, column reward_model.ground_truth: ground truth is empty"
    )


@pytest.mark.parametrize(
    ("frame", "message"),
    [
        ({"prompt": ["1+1=", "2+2="], "answer": ["2", ""]}, "row 1, column answer: ground truth is empty"),
        ({"prompt": ["1+1=", " "], "answer": ["2", "4"]}, "row 1, column prompt: prompt is empty"),
    ],
    ids=["answer", "prompt"],
)
def test_empty_flat_cell_names_row_and_column(tmp_path: Path, frame: dict, message: str) -> None:
    path = tmp_path / "flat.parquet"
    pd.DataFrame(frame).to_parquet(path)
    raises_dataset_error(path, message)


def test_empty_prompt_names_row_and_column(tmp_path: Path) -> None:
    rows = verl_rows(3)
    rows[0]["prompt"] = [{"role": "user", "content": ""}]
    raises_dataset_error(write_rows(tmp_path / "x.parquet", rows), "row 0, column prompt: prompt is empty")


def test_prompt_without_messages_names_row_and_column(tmp_path: Path) -> None:
    rows = verl_rows(2)
    rows[1]["prompt"] = []
    raises_dataset_error(write_rows(tmp_path / "x.parquet", rows), "row 1, column prompt: prompt has no messages")


def test_duplicated_id_names_both_rows(tmp_path: Path) -> None:
    rows = verl_rows(3)
    rows[2]["extra_info"]["index"] = rows[0]["extra_info"]["index"]
    raises_dataset_error(
        write_rows(tmp_path / "x.parquet", rows), "row 2, column extra_info.index: prompt id '10' duplicates row 0"
    )


@pytest.mark.parametrize("blank", ["", "   ", "\t"])
def test_blank_prompt_ids_are_bad_rows(tmp_path: Path, blank: str) -> None:
    """A blank id (veRL's extra_info.index or a flat file's prompt_id) names no prompt: the row is refused."""
    rows = verl_rows(3)
    rows[1]["extra_info"]["index"] = blank
    for row in rows[::2]:
        row["extra_info"]["index"] = str(row["extra_info"]["index"])
    raises_dataset_error(write_rows(tmp_path / "x.parquet", rows), "row 1, column extra_info.index: prompt id is blank")
    flat = tmp_path / "flat.parquet"
    pd.DataFrame({"prompt": ["1+1=", "2+2="], "answer": ["2", "4"], "prompt_id": ["a", blank]}).to_parquet(flat)
    raises_dataset_error(flat, "row 1, column prompt_id: prompt id is blank")


def test_a_nan_prompt_id_is_a_bad_row(tmp_path: Path) -> None:
    flat = tmp_path / "flat.parquet"
    table = {"prompt": ["1+1=", "2+2="], "answer": ["2", "4"], "prompt_id": [1.0, float("nan")]}
    pq.write_table(pa.table(table), flat)  # a NaN, not a null (a null id falls back to the prompt's hash)
    raises_dataset_error(flat, "row 1, column prompt_id: prompt id is NaN")


def test_duplicated_prompt_without_index_is_a_duplicated_hash(tmp_path: Path) -> None:
    path = tmp_path / "flat.parquet"
    pd.DataFrame({"prompt": ["1+1=", "2+2=", "1+1="], "answer": ["2", "4", "2"]}).to_parquet(path)
    raises_dataset_error(path, "row 2, column prompt: prompt id", "duplicates row 0")


def test_not_a_parquet_file(tmp_path: Path) -> None:
    path = tmp_path / "notes.parquet"
    path.write_text("prompt,answer\n1+1=,2\n")
    raises_dataset_error(path, "not a readable Parquet file")


def test_several_bad_rows_are_all_reported_up_to_a_limit(tmp_path: Path) -> None:
    rows = verl_rows(9)
    for k in (1, 3, 4, 5, 6, 7, 8):
        rows[k]["reward_model"]["ground_truth"] = ""
    rows[3]["prompt"] = [{"role": "user", "content": ""}]
    error = raises_dataset_error(
        write_rows(tmp_path / "x.parquet", rows),
        "row 1, column reward_model.ground_truth",
        "row 3, column prompt",
        "row 4, column reward_model.ground_truth",
        "and 2 more problems",
    )
    assert [p.row for p in error.problems] == [1, 3, 4, 5, 6, 7, 8]
    assert "row 8" not in str(error)


def test_bad_difficulty_is_named(tmp_path: Path) -> None:
    rows = verl_rows(2)
    rows[0]["extra_info"]["difficulty"] = "0"  # a string that holds an integer is fine
    rows[1]["extra_info"]["difficulty"] = "hard"
    schema = pa.schema(
        [
            ("data_source", pa.string()),
            ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
            ("ability", pa.string()),
            ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
            ("extra_info", pa.struct([("index", pa.int64()), ("difficulty", pa.string()), ("split", pa.string())])),
        ]
    )
    raises_dataset_error(write_rows(tmp_path / "x.parquet", rows, schema), "row 1, column extra_info.difficulty")


def test_dataset_error_is_a_value_error() -> None:
    assert issubclass(DatasetError, ValueError)


def test_null_prompt_names_row_and_column(tmp_path: Path) -> None:
    path = tmp_path / "flat.parquet"
    pd.DataFrame({"prompt": ["1+1=", None], "answer": ["2", "4"]}).to_parquet(path)
    raises_dataset_error(path, "row 1, column prompt: prompt is null")


def test_missing_file_is_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_dataset(tmp_path / "absent.parquet")


@pytest.mark.parametrize(
    "content",
    [b"", b"PAR1", b"PAR1" + bytes(range(256)) + b"PAR1", b"\x00" * 64],
    ids=["empty", "magic-only", "magic-around-garbage", "zeros"],
)
def test_bytes_that_are_not_parquet(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "x.parquet"
    path.write_bytes(content)
    raises_dataset_error(path, "not a readable Parquet file")


def test_truncated_parquet_file(tmp_path: Path) -> None:
    good = write_rows(tmp_path / "good.parquet", verl_rows(20)).read_bytes()
    path = tmp_path / "cut.parquet"
    path.write_bytes(good[: len(good) // 2])
    raises_dataset_error(path, "not a readable Parquet file")


def test_empty_table_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "flat.parquet"
    pd.DataFrame({"prompt": pd.Series([], dtype=str), "answer": pd.Series([], dtype=str)}).to_parquet(path)
    raises_dataset_error(path, "the table has no rows")


def test_prompt_of_the_wrong_type_is_named(tmp_path: Path) -> None:
    path = tmp_path / "flat.parquet"
    pd.DataFrame({"prompt": [1, 2], "answer": ["2", "4"]}).to_parquet(path)
    raises_dataset_error(path, "column prompt: has type int64")


def test_a_column_written_twice_is_named(tmp_path: Path) -> None:
    path = tmp_path / "twice.parquet"
    table = pa.table([pa.array(["1+1="]), pa.array(["2"]), pa.array(["3"])], names=["prompt", "answer", "answer"])
    pq.write_table(table, path)
    raises_dataset_error(path, "column answer: appears more than once")


@pytest.mark.parametrize("value", ["²", "10000000000000000000000", "1.5", "hard"])
def test_difficulty_that_is_not_a_64_bit_integer_is_a_bad_row(tmp_path: Path, value: str) -> None:
    path = tmp_path / "flat.parquet"
    pd.DataFrame({"prompt": ["1+1=", "2+2="], "answer": ["2", "4"], "difficulty": ["3", value]}).to_parquet(path)
    raises_dataset_error(path, "row 1, column difficulty: difficulty must be an integer")


def test_difficulty_beyond_int64_as_a_float_is_a_bad_row(tmp_path: Path) -> None:
    path = tmp_path / "flat.parquet"
    pd.DataFrame({"prompt": ["1+1=", "2+2="], "answer": ["2", "4"], "difficulty": [1.0, 1e30]}).to_parquet(path)
    raises_dataset_error(path, "row 1, column difficulty")


# ---------------------------------------------------------------------------------------------
# on_bad_rows="skip"


def test_skip_drops_bad_rows_and_returns_their_problems(tmp_path: Path) -> None:
    rows = verl_rows(6)
    rows[1]["reward_model"]["ground_truth"] = None
    rows[3]["prompt"] = [{"role": "user", "content": " "}]
    rows[5]["extra_info"]["index"] = rows[0]["extra_info"]["index"]  # a later duplicate: row 0 is kept
    path = write_rows(tmp_path / "x.parquet", rows)
    df, problems = read_dataset(path, on_bad_rows="skip")
    assert df["prompt_id"].tolist() == ["10", "12", "14"]
    assert df.index.tolist() == [0, 2, 4]  # the rows' numbers in the file
    assert [(p.row, p.column) for p in problems] == [
        (1, "reward_model.ground_truth"),
        (3, "prompt"),
        (5, "extra_info.index"),
    ]
    assert "duplicates row 0" in problems[2].message
    pd.testing.assert_frame_equal(load_dataset(path, on_bad_rows="skip"), df)
    with pytest.raises(DatasetError):  # the default still refuses the file
        load_dataset(path)


def test_skip_with_no_bad_row_is_the_plain_load(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "x.parquet", verl_rows(4))
    df, problems = read_dataset(path, on_bad_rows="skip")
    assert problems == []
    pd.testing.assert_frame_equal(df, load_dataset(path))
    assert isinstance(df.index, pd.RangeIndex)


def test_skip_refuses_a_file_whose_every_row_is_bad(tmp_path: Path) -> None:
    path = tmp_path / "flat.parquet"
    pd.DataFrame({"prompt": ["1+1=", "1+1="], "answer": ["", "2"]}).to_parquet(path)  # row 1 duplicates row 0...
    df, problems = read_dataset(path, on_bad_rows="skip")  # ...but row 0 is bad itself: row 1 is kept
    assert df["ground_truth"].tolist() == ["2"] and [p.row for p in problems] == [0]
    pd.DataFrame({"prompt": ["1+1=", " "], "answer": ["", "2"]}).to_parquet(path)
    with pytest.raises(DatasetError, match="every one of the 2 rows is bad") as info:
        load_dataset(path, on_bad_rows="skip")
    assert "row 0, column answer" in str(info.value) and "row 1, column prompt" in str(info.value)


def test_skip_does_not_skip_a_bad_file_or_column(tmp_path: Path) -> None:
    path = tmp_path / "flat.parquet"
    pd.DataFrame({"prompt": ["1+1="]}).to_parquet(path)
    with pytest.raises(DatasetError, match="column answer: missing"):
        load_dataset(path, on_bad_rows="skip")
    path.write_text("not parquet")
    with pytest.raises(DatasetError, match="not a readable Parquet file"):
        load_dataset(path, on_bad_rows="skip")


def test_on_bad_rows_must_be_error_or_skip(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="on_bad_rows must be one of error, skip"):
        load_dataset(write_rows(tmp_path / "x.parquet", verl_rows(1)), on_bad_rows="ignore")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# Prompt length against the context


def char_ids(texts: list[str]) -> list[list[int]]:
    """Stand-in rendered prompts: one token per character plus a BOS token."""
    return [[1] + [ord(c) for c in t] for t in texts]


def flat_frame(prompts: list[str]) -> pd.DataFrame:
    ids = [str(k) for k in range(len(prompts))]
    return pd.DataFrame({"prompt_text": prompts, "prompt_id": ids, "prompt_token_ids": char_ids(prompts)})


def test_a_prompt_longer_than_the_context_names_file_row_and_column() -> None:
    df = flat_frame(["1+1=", "x" * 899, "2+2="])
    with pytest.raises(DatasetError) as info:
        check_prompt_lengths(df, 64, 12, "data/x.parquet", context_from="rollout.max_model_len")
    assert str(info.value) == (
        "data/x.parquet: row 1, column prompt: prompt is 900 tokens; with rollout.max_tokens 12 it exceeds the"
        " context of 64 tokens (rollout.max_model_len)"
    )


def test_a_prompt_that_leaves_exactly_max_tokens_fits() -> None:
    df = flat_frame(["x" * 51, "x" * 52])  # 52 and 53 tokens; 64 - 12 = 52 fit
    kept, problems = check_prompt_lengths(df, 64, 12, "x.parquet", on_bad_rows="skip")
    assert kept["prompt_id"].tolist() == ["0"] and [p.row for p in problems] == [1]
    assert "prompt is 53 tokens" in problems[0].message


def test_skipped_long_prompts_are_named_by_their_row_in_the_file(tmp_path: Path) -> None:
    path = tmp_path / "flat.parquet"
    pd.DataFrame({"prompt": ["1+1=", "", "y" * 100, "3+3="], "answer": ["2", "0", "1", "6"]}).to_parquet(path)
    df, _ = read_dataset(path, on_bad_rows="skip")  # row 1 is skipped on load
    df["prompt_token_ids"] = char_ids(df["prompt_text"].tolist())
    kept, problems = check_prompt_lengths(df, 64, 12, path, on_bad_rows="skip")
    assert kept["prompt_text"].tolist() == ["1+1=", "3+3="]
    assert [(p.row, p.column) for p in problems] == [(2, "prompt")]


def test_every_prompt_too_long_is_an_error_even_when_skipping() -> None:
    with pytest.raises(DatasetError, match="every one of the 2 rows is bad"):
        check_prompt_lengths(flat_frame(["x" * 80, "y" * 90]), 64, 12, "x.parquet", "skip")


# ---------------------------------------------------------------------------------------------
# load_run_datasets: what a run start checks


def run_config(tmp_path: Path, model: Path, train_rows: list[str], *overrides: str):
    train = tmp_path / "train.parquet"
    answers = [str(k) for k in range(len(train_rows))]
    pd.DataFrame({"prompt": train_rows, "answer": answers}).to_parquet(train)
    test = write_rows(tmp_path / "test.parquet", verl_rows(3))
    base = [f"data.train={train}", f"data.test={test}", f"model.path={model}"]
    return apply_overrides(load_config("configs/demo-tiny.yaml", []), [*base, *overrides]), train


def test_run_datasets_check_lengths_against_the_models_context(tmp_path: Path, random_checkpoints) -> None:
    model, _ = random_checkpoints  # max_position_embeddings 64, one token per character
    cfg, train = run_config(tmp_path, model, ["1+1=", "z" * 200, ""], "rollout.max_model_len=0")
    with pytest.raises(DatasetError) as info:  # the rows' own problems are reported first, alone
        load_run_datasets(cfg)
    assert str(info.value) == f"{train}: row 2, column prompt: prompt is empty"
    cfg, train = run_config(tmp_path, model, ["1+1=", "z" * 200, "2+2="], "rollout.max_model_len=0")
    with pytest.raises(DatasetError) as info:
        load_run_datasets(cfg)
    message = str(info.value)
    assert f"{train}: row 1, column prompt: prompt is" in message
    assert "exceeds the context of 64 tokens (the model's max_position_embeddings" in message
    cfg, _ = run_config(tmp_path, model, ["1+1=", "z" * 200, "2+2="], "rollout.max_model_len=40")
    with pytest.raises(DatasetError, match=r"row 1, column prompt: .*context of 40 tokens \(rollout\.max_model_len\)"):
        load_run_datasets(cfg)


def test_run_datasets_skip_and_report(tmp_path: Path, random_checkpoints) -> None:
    model, _ = random_checkpoints
    cfg, train = run_config(tmp_path, model, ["1+1=", "z" * 200, "", "2+2=", "1+1="], "data.on_bad_rows=skip")
    data = load_run_datasets(cfg)
    assert data.train is not None and data.train["prompt_text"].tolist() == ["1+1=", "2+2="]
    assert isinstance(data.train.index, pd.RangeIndex) and len(data.test) == 3
    report = data.bad_rows()
    assert list(report.columns) == list(BAD_ROWS_COLUMNS)
    assert report[["key", "file", "row", "column"]].values.tolist() == [
        ["data.train", str(train), 1, "prompt"],
        ["data.train", str(train), 2, "prompt"],
        ["data.train", str(train), 4, "prompt"],
    ]
    assert report["message"].str.contains("tokens|empty|duplicates row 0").all()
    assert data.skip_lines() == [f"skipped 3 bad rows of {train} (see bad_rows.parquet)"]
    assert load_run_datasets(cfg, train=False).train is None


def test_run_datasets_count_test_prompts_also_in_the_training_file(tmp_path: Path, random_checkpoints) -> None:
    """A held-out prompt whose text is also a training prompt is counted in one warning line per test set."""
    model, _ = random_checkpoints
    cfg, train = run_config(tmp_path, model, ["0+1=", "5+5=", "2+1= "])  # the test rows are 0+1=, 1+1=, 2+1=
    data = load_run_datasets(cfg)
    test = tmp_path / "test.parquet"
    assert data.overlap_lines() == [
        f"warning: 2 of 3 prompts of {test} (data.test) have the same text as a prompt of {train} (data.train): "
        "held-out accuracy counts them; remove them from one of the files for a clean held-out set"
    ]
    clean, _ = run_config(tmp_path, model, ["7+7=", "8+8="])
    assert load_run_datasets(clean).overlap_lines() == []


def test_ground_truths_are_checked_by_their_verifier_at_load(tmp_path: Path) -> None:
    """A ground truth the row's verifier cannot read is a bad row (named by row and column), not a prompt
    whose every rollout scores `error` (pass rate 0, where CoBA-RL would spend budget)."""
    from coba_tasks.pipeline.data import check_ground_truths

    rows = verl_rows(4)
    rows[1]["reward_model"]["ground_truth"] = "4O"  # a malformed arithmetic answer (letter O)
    rows[3]["data_source"], rows[3]["reward_model"]["ground_truth"] = "math", "1/0"
    path = write_rows(tmp_path / "x.parquet", rows)
    df = load_dataset(path)
    with pytest.raises(DatasetError) as info:
        check_ground_truths(df, path)
    assert str(info.value).splitlines() == [
        f"{path}: row 1, column reward_model.ground_truth: arith: ground truth '4O' is not an integer",
        f"{path}: row 3, column reward_model.ground_truth: math: ground truth '1/0' is not a number (zoo)",
    ]
    kept, problems = check_ground_truths(df, path, on_bad_rows="skip")
    assert kept.index.tolist() == [0, 2] and [p.row for p in problems] == [1, 3]
    flat = tmp_path / "flat.parquet"
    pd.DataFrame({"prompt": ["a", "b"], "answer": ["\\frac{1}{2}", "\\sqrt{"]}).to_parquet(flat)
    with pytest.raises(DatasetError, match=r"row 1, column answer: math-verify cannot parse the ground truth"):
        check_ground_truths(load_dataset(flat), flat)


def test_a_missing_value_written_as_text_is_not_a_ground_truth(tmp_path: Path) -> None:
    rows = verl_rows(3)
    rows[0]["reward_model"]["ground_truth"] = "nan"  # math-verify reads 'nan' as a*n*n, and \boxed{nan} matches it
    rows[2]["reward_model"]["ground_truth"] = " None "
    raises_dataset_error(
        write_rows(tmp_path / "x.parquet", rows),
        "row 0, column reward_model.ground_truth: ground truth is 'nan', the text of a missing value",
        "row 2, column reward_model.ground_truth: ground truth is 'None'",
    )


def test_an_unknown_data_source_stops_the_load_unless_math_is_asked_for(tmp_path: Path) -> None:
    from coba_tasks.pipeline.data import check_ground_truths

    rows = verl_rows(3)
    rows[1]["data_source"] = rows[2]["data_source"] = "my_reward"
    path = write_rows(tmp_path / "x.parquet", rows)
    df = load_dataset(path)
    with pytest.raises(DatasetError) as info:
        check_ground_truths(df, path)
    message = str(info.value)
    assert message.startswith(f"{path}: data_source 'my_reward' (rows 1, 2) has no verifier; registered: ")
    assert "arith, " in message and "Register a verifier for it with @register_verifier(name)" in message
    assert "verify.unknown_sources=math" in message and "\n" not in message
    kept, problems = check_ground_truths(df, path, unknown_sources="math")  # math-verify reads '2' and '3'
    assert len(kept) == 3 and problems == []


def test_run_datasets_check_ground_truths_with_the_config(tmp_path: Path, random_checkpoints) -> None:
    model, _ = random_checkpoints
    rows = verl_rows(3)
    rows[2]["reward_model"]["ground_truth"] = "three"
    test = write_rows(tmp_path / "t.parquet", rows)
    cfg, _ = run_config(tmp_path, model, ["1+1=", "2+2="], f"data.test={test}")
    with pytest.raises(DatasetError, match=r"row 2, column reward_model\.ground_truth: arith: ground truth 'three'"):
        load_run_datasets(cfg)
    cfg, _ = run_config(tmp_path, model, ["1+1=", "2+2="], f"data.test={test}", "data.on_bad_rows=skip")
    data = load_run_datasets(cfg)
    assert len(data.test) == 2 and data.bad_rows()["row"].tolist() == [2]
    with pytest.raises(ConfigError, match=r"verify\.unknown_sources = 'ignore': must be error .* or math"):
        load_config(None, ["verify.unknown_sources=ignore"])


def test_run_datasets_name_model_path_when_the_model_is_unreadable(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    cfg, _ = run_config(tmp_path, tmp_path / "model", ["1+1="])
    with pytest.raises(ConfigError, match=r"^model\.path: cannot read the tokenizer"):
        load_run_datasets(cfg)


# ---------------------------------------------------------------------------------------------
# Writing


def test_write_verl_parquet_round_trips_and_leaves_no_temp_file(tmp_path: Path) -> None:
    path = write_verl_parquet(pd.DataFrame(verl_rows(4)), tmp_path / "sub" / "out.parquet")
    assert [p.name for p in path.parent.iterdir()] == ["out.parquet"]
    df = load_dataset(path)
    assert df["prompt_id"].tolist() == ["10", "11", "12", "13"]
    assert df["ground_truth"].tolist() == ["1", "2", "3", "4"]
    assert pq.read_schema(path).metadata is None or b"pandas" not in pq.read_schema(path).metadata


def test_write_verl_parquet_names_missing_columns(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="reward_model"):
        write_verl_parquet(pd.DataFrame(verl_rows(1)).drop(columns="reward_model"), tmp_path / "out.parquet")
    assert not list(tmp_path.iterdir())


# ---------------------------------------------------------------------------------------------
# The arithmetic generator and the shipped files


def test_split_counts_sum_to_the_total() -> None:
    assert make_arith.split_counts(500, [0.2] * 5) == [100] * 5
    shares = [level.train_share for level in make_arith.LEVELS]
    assert make_arith.split_counts(20_000, shares) == [100, 2500, 5800, 5800, 5800]
    assert make_arith.split_counts(7, [1.0] * 5) == [2, 2, 1, 1, 1]
    assert sum(make_arith.split_counts(101, shares)) == 101


def test_expression_text_and_value() -> None:
    expr = make_arith.Expression(((347,), (128,), (6, 17)), ("-", "+"))
    assert expr.text() == "347-128+6*17"
    assert expr.value() == 347 - 128 + 6 * 17


def test_generator_is_deterministic_for_a_seed(tmp_path: Path) -> None:
    args = ["--seed", "3", "--train-size", "600", "--test-size", "50"]
    make_arith.main([*args, "--out-dir", str(tmp_path / "a")])
    make_arith.main([*args, "--out-dir", str(tmp_path / "b")])
    for name in ("arith_train.parquet", "arith_test.parquet"):
        a, b = tmp_path / "a" / name, tmp_path / "b" / name
        pd.testing.assert_frame_equal(pd.read_parquet(a), pd.read_parquet(b))
        assert a.read_bytes() == b.read_bytes()
    other_train, _ = make_arith.make_splits(seed=4, train_size=600, test_size=50)
    assert not other_train.equals(pd.read_parquet(tmp_path / "a" / "arith_train.parquet"))


def test_generator_has_no_overlap_and_covers_every_level(tmp_path: Path) -> None:
    make_arith.main(["--seed", "1", "--train-size", "1000", "--test-size", "100", "--out-dir", str(tmp_path)])
    train = load_dataset(tmp_path / "arith_train.parquet")
    test = load_dataset(tmp_path / "arith_test.parquet")
    assert (len(train), len(test)) == (1000, 100)
    assert not set(train["prompt_text"]) & set(test["prompt_text"])
    assert not set(train["prompt_id"]) & set(test["prompt_id"])
    assert train["prompt_text"].is_unique and test["prompt_text"].is_unique
    assert test["difficulty"].value_counts().to_dict() == {level: 20 for level in range(5)}
    assert set(train["difficulty"]) == set(range(5))


def test_test_split_does_not_depend_on_train_size() -> None:
    _, small = make_arith.make_splits(seed=0, train_size=100, test_size=50)
    _, large = make_arith.make_splits(seed=0, train_size=2000, test_size=50)
    pd.testing.assert_frame_equal(small, large)


def test_generated_answers_are_the_values_of_the_expressions() -> None:
    train, _ = make_arith.make_splits(seed=2, train_size=500, test_size=0)
    for messages, reward_model in zip(train["prompt"], train["reward_model"], strict=True):
        text = messages[0]["content"]
        assert text.endswith("=") and set(text[:-1]) <= set("0123456789+-*")
        assert int(reward_model["ground_truth"]) == eval(text[:-1])  # trusted: our own digits and + - *


def test_an_exhausted_level_passes_its_share_on() -> None:
    # Level 0 has 200 distinct problems: a 1,000-row test split takes all of them.
    train, test = make_arith.make_splits(seed=0, train_size=1000, test_size=1000)
    train_levels = train["extra_info"].map(lambda e: e["difficulty"])
    assert len(train) == 1000
    assert (train_levels == 0).sum() == 0
    assert (test["extra_info"].map(lambda e: e["difficulty"]) == 0).sum() == 200
    with pytest.raises(ValueError, match="level 0 has only 200 distinct problems"):
        make_arith.make_splits(seed=0, train_size=10, test_size=1005)


@pytest.mark.slow
def test_shipped_files_are_the_seed_zero_output(tmp_path: Path) -> None:
    train, test = make_arith.make_splits(seed=0)
    for frame, name in ((train, "arith_train"), (test, "arith_test")):
        shipped = pd.read_parquet(DATA_DIR / f"{name}.parquet")
        expected = pd.read_parquet(write_verl_parquet(frame, tmp_path / f"{name}.parquet"))
        pd.testing.assert_frame_equal(shipped, expected)
    loaded = load_dataset(DATA_DIR / "arith_train.parquet")
    assert loaded["prompt_text"].str.len().max() <= 30
    total = sum((DATA_DIR / f"{n}.parquet").stat().st_size for n in ("arith_train", "arith_test"))
    assert total < 2_000_000


# ---------------------------------------------------------------------------------------------
# Property: any valid flat table round-trips

_text = st.text(alphabet=string.ascii_letters + string.digits + " +-*=?", min_size=1, max_size=20).filter(
    lambda s: s.strip() != ""
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    prompts=st.lists(_text, min_size=1, max_size=15, unique=True),
    answers=st.data(),
)
def test_valid_flat_tables_round_trip(tmp_path: Path, prompts: list[str], answers: st.DataObject) -> None:
    from coba_tasks.pipeline.data import MISSING_TEXTS

    valid = _text.filter(lambda s: s.strip().lower() not in MISSING_TEXTS)  # 'None', 'nan': a missing value
    truths = answers.draw(st.lists(valid, min_size=len(prompts), max_size=len(prompts)))
    path = tmp_path / "flat.parquet"
    pd.DataFrame({"prompt": prompts, "answer": truths}).to_parquet(path)
    df = load_dataset(path)
    assert df["prompt_text"].tolist() == prompts
    assert df["ground_truth"].tolist() == truths
    assert df["prompt_id"].is_unique
    assert df["prompt_id"].tolist() == [prompt_hash([{"role": "user", "content": p}]) for p in prompts]


# ---------------------------------------------------------------------------------------------
# render_prompts: what the model sees, tokenized once

CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def _char_tokenizer(bos: bool = False, template: str | None = None):
    """The tiny model's character tokenizer; optionally one that adds BOS (as Llama's does) or has a chat template."""
    from tokenizers.processors import TemplateProcessing

    from coba_tasks.engines.model import build_char_tokenizer

    tok = build_char_tokenizer()
    if bos:
        tok.backend_tokenizer.post_processor = TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", tok.bos_token_id)]
        )
    tok.chat_template = template
    return tok


def _chat_frame() -> pd.DataFrame:
    messages = [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1="}],
        [
            {"role": "user", "content": "2+2="},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "3+3="},
        ],
    ]
    return pd.DataFrame({"prompt_id": ["a", "b"], "prompt_text": ["1+1=", "3+3="], "messages": messages})


def test_chat_format_renders_every_message_and_the_generation_prompt() -> None:
    tok = _char_tokenizer(template=CHAT_TEMPLATE)
    df, problems = render_prompts(_chat_frame(), tok)  # auto: the tokenizer has a template
    assert problems == []
    assert df["prompt_rendered"].tolist() == [
        "<system>Be brief.</s><user>1+1=</s><assistant>",
        "<user>2+2=</s><assistant>4</s><user>3+3=</s><assistant>",
    ]
    # the ids are the rendered text's, with no special token added on top of what the template wrote
    assert df["prompt_token_ids"].tolist() == [
        tok(t, add_special_tokens=False).input_ids for t in df["prompt_rendered"]
    ]
    raw, _ = render_prompts(_chat_frame(), tok, "raw")
    assert raw["prompt_rendered"].tolist() == ["1+1=", "3+3="]


def test_raw_format_keeps_the_tokenizers_bos_so_sampler_and_trainer_see_one_sequence() -> None:
    tok = _char_tokenizer(bos=True)
    df, _ = render_prompts(_chat_frame(), tok)  # auto without a template: raw
    bos = tok.bos_token_id
    assert df["prompt_token_ids"].tolist() == [
        [bos, *tok("1+1=", add_special_tokens=False).input_ids],
        [bos, *tok("3+3=", add_special_tokens=False).input_ids],
    ]
    # a rollout request carries exactly these ids; the update reads the same column
    from coba_tasks.pipeline.update_batch import update_sequences

    rollouts = pd.DataFrame({"prompt_id": ["b", "a"], "token_ids": [[5, 2], [7]], "logprobs": [[-0.1, -0.2], [-0.3]]})
    prompt_ids, completion_ids, logprobs = update_sequences(rollouts, df)
    assert prompt_ids == [df["prompt_token_ids"][1], df["prompt_token_ids"][0]]
    assert completion_ids == [[5, 2], [7]] and logprobs == [[-0.1, -0.2], [-0.3]]


def test_a_tokenizer_without_a_rust_backend_gives_the_same_ids() -> None:
    """The fast path (the backend's batch encoder) and a tokenizer's own call agree; a tokenizer without a
    backend (a slow, Python one) is called as it is."""
    tok = _char_tokenizer(bos=True, template=CHAT_TEMPLATE)

    class Slow:  # what render_prompts uses of a tokenizer, without backend_tokenizer
        chat_template = tok.chat_template
        apply_chat_template = tok.apply_chat_template

        def __call__(self, texts, add_special_tokens):
            return tok(texts, add_special_tokens=add_special_tokens)

    for fmt in ("chat", "raw"):
        fast, _ = render_prompts(_chat_frame(), tok, fmt)
        slow, _ = render_prompts(_chat_frame(), Slow(), fmt)
        assert fast["prompt_token_ids"].tolist() == slow["prompt_token_ids"].tolist(), fmt
    assert fast["prompt_token_ids"][0][0] == tok.bos_token_id  # raw: the post-processor's BOS on both paths


def test_chat_format_without_a_template_is_refused_and_a_failing_template_names_the_row() -> None:
    with pytest.raises(ValueError, match=r"data\.prompt_format=chat but the model's tokenizer has no chat template"):
        render_prompts(_chat_frame(), _char_tokenizer(), "chat")
    with pytest.raises(ValueError, match="prompt format must be one of auto, chat, raw"):
        render_prompts(_chat_frame(), _char_tokenizer(), "jinja")  # type: ignore[arg-type]
    strict = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system') }}{% endif %}"
        "{{ m['content'] }}{% endfor %}"
    )
    df, problems = render_prompts(_chat_frame(), _char_tokenizer(template=strict))
    assert df["prompt_id"].tolist() == ["b"]
    assert [(p.row, p.column) for p in problems] == [(0, "prompt")]
    assert "the chat template cannot render this prompt" in problems[0].message and "no system" in problems[0].message


# ---------------------------------------------------------------------------------------------
# Files as veRL's own preprocessing writes them (tests/verl_files.py)


def test_a_verl_gsm8k_file_loads_as_it_is(tmp_path: Path) -> None:
    from verl_files import GSM8K_INSTRUCTION, write_verl_gsm8k

    path = write_verl_gsm8k(
        tmp_path / "train.parquet", [("Tom has 3 apples and buys 4. How many?", "7"), ("Q2?", "1200")]
    )
    assert pq.read_schema(path).metadata and b"huggingface" in pq.read_schema(path).metadata
    df = load_dataset(path)
    assert df["prompt_id"].tolist() == ["0", "1"]
    assert set(df["data_source"]) == {"openai/gsm8k"} and set(df["ability"]) == {"math"}
    assert df["ground_truth"].tolist() == ["7", "1200"]
    assert df["prompt_text"][0] == f"Tom has 3 apples and buys 4. How many? {GSM8K_INSTRUCTION}"
    assert df["messages"][0] == [{"role": "user", "content": df["prompt_text"][0]}]
    extra = json.loads(df["extra_info"][1])
    assert extra == {"split": "train", "index": 1, "answer": "Work it out.\n#### 1200", "question": "Q2?"}
    assert df["difficulty"].tolist() == [-1, -1]


@pytest.mark.parametrize("source", ["lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval"])
def test_a_verl_math_file_loads_as_it_is_with_its_leftover_columns(tmp_path: Path, source: str) -> None:
    from verl_files import MATH_INSTRUCTION, write_verl_math

    path = write_verl_math(tmp_path / "test.parquet", [("What is $1/2+1/4$?", "\\frac{3}{4}"), ("2^3?", "8")], source)
    assert pq.read_schema(path).names[:2] == ["level", "type"]  # MATH-lighteval's columns veRL leaves in
    df = load_dataset(path)
    assert df["data_source"].tolist() == [source, source]
    assert df["ground_truth"].tolist() == ["\\frac{3}{4}", "8"]
    assert df["prompt_text"][0].endswith(" " + MATH_INSTRUCTION)
    assert json.loads(df["extra_info"][0]) == {"split": "train", "index": 0}


def test_a_dictionary_encoded_prompt_column_loads_as_its_values(tmp_path: Path) -> None:
    """A flat table written from pandas with categorical columns stores them dictionary-encoded: valid
    Parquet, refused before ("prompt has type dictionary<...>"); it loads as the same strings."""
    frame = pd.DataFrame({"prompt": ["1+1=", "2+2=", "1+1=x"], "answer": ["2", "4", "2"]})
    plain = tmp_path / "plain.parquet"
    frame.to_parquet(plain)
    categorical = tmp_path / "categorical.parquet"
    frame.astype("category").to_parquet(categorical)
    assert pa.types.is_dictionary(pq.read_schema(categorical).field("prompt").type)
    pd.testing.assert_frame_equal(load_dataset(categorical), load_dataset(plain))
