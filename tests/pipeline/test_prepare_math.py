"""data/prepare_math.py on tiny synthetic files shaped like the hub's DAPO-Math-17K, MATH-500 and AIME."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from scripts_loader import load_script

from coba_tasks.engines.verify import score
from coba_tasks.pipeline.data import load_dataset, prompt_hash

ROOT = Path(__file__).resolve().parents[2]


pm = load_script("data/prepare_math.py")

# the hub's DAPO-Math-17K schema: message structs are {content, role}, ground truths are strings
DAPO_SCHEMA = pa.schema(
    [
        ("data_source", pa.string()),
        ("prompt", pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string())])),
        ("extra_info", pa.struct([("index", pa.string())])),
    ]
)


def dapo_row(problem: str, truth: str, uuid: str) -> dict:
    return {
        "data_source": "math_dapo",
        "prompt": [{"content": pm.DAPO_TEMPLATE.format(problem=problem), "role": "user"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": truth, "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": uuid},
    }


def write_dapo(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows, schema=DAPO_SCHEMA), path)
    return path


@pytest.fixture
def dapo_file(tmp_path: Path) -> Path:
    rows = [
        dapo_row("What is $1+1$?", "2", "uuid-a1"),
        dapo_row("Find $x$ if $2x = 1$.", "\\frac{1}{2}", "uuid-b1"),
        dapo_row("What is $1+1$?", "2", "uuid-a2"),  # the hub repeats every prompt
        dapo_row("How many primes are below 10?", "4", "uuid-c1"),
        dapo_row("What is $1+1$?", "2", "uuid-a3"),
        dapo_row("Find $x$ if $2x = 1$.", "0.5", "uuid-b2"),  # a duplicate with another ground truth
        dapo_row("An empty answer?", "", "uuid-d1"),
    ]
    return write_dapo(tmp_path / "dapo-math-17k.parquet", rows)


@pytest.fixture
def math500_file(tmp_path: Path) -> Path:
    rows = [
        {
            "problem": "Compute $\\frac{1}{4}+\\frac{1}{4}$.",
            "solution": "...",
            "answer": "\\frac{1}{2}",
            "subject": "Prealgebra",
            "level": 2,
            "unique_id": "test/prealgebra/1.json",
        },
        {
            "problem": "What is $3^2$?",
            "solution": "...",
            "answer": "9",
            "subject": "Algebra",
            "level": 1,
            "unique_id": "test/algebra/2.json",
        },
        {
            "problem": "What is $3^2$?",
            "solution": "...",
            "answer": "9",
            "subject": "Algebra",
            "level": 1,
            "unique_id": "test/algebra/2-copy.json",
        },
    ]
    path = tmp_path / "test.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def aime_file(tmp_path: Path) -> Path:
    table = pa.table(
        {
            "id": pa.array([60, 61], pa.int64()),
            "problem": ["Find the remainder when $2^{10}$ is divided by $1000$.", "Find $m+n$ where $m/n = 1/2$."],
            "solution": ["...", "..."],
            "answer": pa.array([24, 3], pa.int64()),  # AIME answers are integers
            "url": ["u1", "u2"],
            "year": pa.array([2024, 2024], pa.int64()),
        }
    )
    path = tmp_path / "aime24.parquet"
    pq.write_table(table, path)
    return path


def test_dapo_is_deduplicated_with_stable_ids_and_loads(dapo_file, tmp_path, capsys):
    out = tmp_path / "dapo.parquet"
    assert pm.main(["--input", str(dapo_file), "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "read 7 rows" in printed and "dropped 3 duplicate rows (1 prompts had differing answers" in printed
    assert "1 rows without a problem or answer" in printed and "wrote 3 prompts" in printed
    df = load_dataset(out)
    assert df["ground_truth"].tolist() == ["2", "\\frac{1}{2}", "4"]  # file order, first row of each prompt
    assert set(df["data_source"]) == {"math_dapo"} and set(df["difficulty"]) == {-1}
    assert df["prompt_text"].iloc[0] == pm.DAPO_TEMPLATE.format(problem="What is $1+1$?")  # the prompt, as it was
    assert df["prompt_id"].tolist() == [prompt_hash(m) for m in df["messages"]]
    extra = pq.read_table(out)["extra_info"].to_pylist()
    assert [e["source_index"] for e in extra] == ["uuid-a1", "uuid-b1", "uuid-c1"]

    # the ids do not depend on the file order or on the duplicates; a rerun writes the same bytes
    rows = pq.read_table(dapo_file).to_pylist()
    shuffled = write_dapo(tmp_path / "shuffled.parquet", rows[::-1])
    out2 = tmp_path / "dapo2.parquet"
    assert pm.main(["--input", str(shuffled), "--output", str(out2)]) == 0
    assert sorted(load_dataset(out2)["prompt_id"]) == sorted(df["prompt_id"])
    again = tmp_path / "again.parquet"
    assert pm.main(["--input", str(dapo_file), "--output", str(again)]) == 0
    assert again.read_bytes() == out.read_bytes()


def test_math500_and_aime_flat_files_get_the_dapo_prompt(math500_file, aime_file, tmp_path):
    out = tmp_path / "math500.parquet"
    assert pm.main(["--input", str(math500_file), "--output", str(out), "--source", "math500"]) == 0
    df = load_dataset(out)
    assert len(df) == 2 and set(df["data_source"]) == {"math500"}
    assert df["ground_truth"].tolist() == ["\\frac{1}{2}", "9"] and df["difficulty"].tolist() == [2, 1]
    assert df["prompt_text"].iloc[1] == pm.DAPO_TEMPLATE.format(problem="What is $3^2$?")
    extra = pq.read_table(out)["extra_info"].to_pylist()
    assert [e["source_index"] for e in extra] == ["test/prealgebra/1.json", "test/algebra/2.json"]

    out = tmp_path / "aime.parquet"
    assert pm.main(["--input", str(aime_file), "--output", str(out), "--source", "aime24", "--template", "boxed"]) == 0
    df = load_dataset(out)
    assert df["ground_truth"].tolist() == ["24", "3"] and set(df["data_source"]) == {"aime24"}
    assert df["prompt_text"].iloc[0].endswith("put your final answer within \\boxed{}.")
    assert [e["source_index"] for e in pq.read_table(out)["extra_info"].to_pylist()] == ["60", "61"]


def test_question_answer_columns_several_inputs_and_a_limit(tmp_path):
    a = tmp_path / "aime25.jsonl"
    a.write_text(json.dumps({"Question": "What is $2+3$?", "Answer": 5}) + "\n")
    b = tmp_path / "more.jsonl"
    b.write_text(
        json.dumps({"question": "What is $2+3$?", "answer": "5"})
        + "\n"  # the same prompt as in the first file
        + json.dumps({"question": "What is $7-3$?", "answer": "4"})
        + "\n"
        + json.dumps({"question": "What is $7-4$?", "answer": "3"})
        + "\n"
    )
    prepared = pm.prepare([a, b], source="aime25")
    assert [r["ground_truth"] for r in prepared.records] == ["5", "4", "3"] and prepared.duplicates == 1
    assert len(pm.prepare([a, b], limit=2).records) == 2


def test_bad_inputs_are_refused(dapo_file, tmp_path):
    with pytest.raises(ValueError, match="a veRL file keeps its prompts as they are"):
        pm.prepare([dapo_file], template="boxed")
    other = tmp_path / "other.parquet"
    pq.write_table(pa.table({"text": ["x"], "label": ["y"]}), other)
    with pytest.raises(ValueError, match="needs a problem column"):
        pm.prepare([other])
    assert pm.main(["--input", str(other), "--output", str(tmp_path / "o.parquet")]) == 1
    with pytest.raises(SystemExit) as exit_info:
        pm.main(["--help"])
    assert exit_info.value.code == 0


def test_check_answers_drops_a_ground_truth_math_verify_cannot_read(tmp_path):
    path = write_dapo(
        tmp_path / "d.parquet", [dapo_row("Half?", "\\frac{1}{2}", "u1"), dapo_row("Broken?", "???", "u2")]
    )
    prepared = pm.prepare([path], check_answers=True)
    assert [r["ground_truth"] for r in prepared.records] == ["\\frac{1}{2}"]
    assert len(prepared.unreadable_answers) == 1 and "'???'" in prepared.unreadable_answers[0]


@pytest.mark.parametrize("source", ["math_dapo", "math500", "aime24", "aime25"])
def test_written_sources_verify_boxed_and_answer_line_completions(source):
    truth = "\\frac{1}{2}"
    assert str(score("So $x = \\boxed{\\frac{1}{2}}$.", truth, source).verdict) == "correct"
    assert str(score("2x = 1, so x is one half.\nAnswer: 1/2", truth, source).verdict) == "correct"
    assert str(score("**Answer:** $\\frac{1}{2}$", truth, source).verdict) == "correct"
    assert str(score("Answer: 1/3", truth, source).verdict) == "wrong"
    assert str(score("I cannot tell.", truth, source).verdict) == "no_answer"
    assert str(score("Answer: 24", "24", source).verdict) == "correct"  # AIME: integers


def test_an_output_that_is_an_input_or_exists_is_refused(dapo_file, tmp_path, capsys):
    """--input raw.parquet --output raw.parquet exited 0 and the source, with its extra columns, was gone."""
    source = dapo_file.read_bytes()
    for argv in (["--output", str(dapo_file)], ["--output", str(dapo_file), "--overwrite"]):
        assert pm.main(["--input", str(dapo_file), *argv]) == 1
        assert dapo_file.read_bytes() == source
        assert "is one of the --input files; nothing was written" in capsys.readouterr().err
    out = tmp_path / "dapo.parquet"
    out.write_text("mine")
    assert pm.main(["--input", str(dapo_file), "--output", str(out)]) == 1
    assert out.read_text() == "mine" and "exists; nothing was written" in capsys.readouterr().err
    assert pm.main(["--input", str(dapo_file), "--output", str(out), "--overwrite"]) == 0
    assert len(load_dataset(out)) == 3
