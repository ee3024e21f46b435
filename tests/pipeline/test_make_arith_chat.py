"""Tests for data/make_arith_chat.py and the shipped data/arith_chat_*.parquet."""

from __future__ import annotations

import collections
import re
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest
from scripts_loader import load_script

from coba_tasks.engines.verify import score, verifier_for
from coba_tasks.pipeline.data import load_dataset, write_verl_parquet

DATA_DIR = Path(__file__).resolve().parents[2] / "data"


make_arith_chat = load_script("data/make_arith_chat.py")


SHIPPED = ("train", "test", "test_reworded", "train_l01", "train_l02", "train_l1_unused", "band_train", "band_test")


def test_shipped_files_equal_a_fresh_run(tmp_path: Path) -> None:
    make_arith_chat.main(["--out-dir", str(tmp_path)])
    for name in SHIPPED:
        fresh = (tmp_path / f"arith_chat_{name}.parquet").read_bytes()
        assert fresh == (DATA_DIR / f"arith_chat_{name}.parquet").read_bytes(), name


def test_the_reworded_set_holds_the_same_problems_in_other_words() -> None:
    test = pq.read_table(DATA_DIR / "arith_chat_test.parquet").to_pylist()
    reworded = pq.read_table(DATA_DIR / "arith_chat_test_reworded.parquet").to_pylist()
    assert len(reworded) == len(test) == 500
    wordings: collections.Counter[str] = collections.Counter()
    for old, new in zip(test, reworded, strict=True):
        assert (new["extra_info"], new["reward_model"], new["data_source"]) == (
            old["extra_info"],
            old["reward_model"],
            old["data_source"],
        )
        text, before = new["prompt"][0]["content"], old["prompt"][0]["content"]
        assert text != before and not text.startswith("Compute")
        assert text.replace(" ", "").count(before.removeprefix("Compute ").split(".")[0]) == 1  # the same expression
        wordings[text.split()[0]] += 1
    assert sorted(wordings) == ["Calculate", "Evaluate", "Find", "What"] and min(wordings.values()) == 125
    train_texts = {r["prompt"][0]["content"] for r in pq.read_table(DATA_DIR / "arith_chat_train.parquet").to_pylist()}
    assert not train_texts & {r["prompt"][0]["content"] for r in reworded}


@pytest.mark.parametrize("split", ["train", "test"])
def test_same_problems_ids_levels_and_answers(split: str) -> None:
    plain = pq.read_table(DATA_DIR / f"arith_{split}.parquet").to_pylist()
    chat = pq.read_table(DATA_DIR / f"arith_chat_{split}.parquet").to_pylist()
    assert len(chat) == len(plain) > 0
    for old, new in zip(plain, chat, strict=True):
        expression = old["prompt"][0]["content"].removesuffix("=")
        assert new["prompt"] == [
            {"role": "user", "content": f"Compute {expression}. End your reply with the final answer."}
        ]
        assert new["data_source"] == "arith_chat"
        assert (new["ability"], new["reward_model"], new["extra_info"]) == (
            old["ability"],
            old["reward_model"],
            old["extra_info"],
        )


@pytest.mark.parametrize("name", SHIPPED)
def test_the_prompts_ask_for_what_the_reward_scores(name: str) -> None:
    """The reward reads the last integer of the reply: no prompt asks for a format it does not require
    (an earlier wording asked for \\boxed{}, and training taught the model to drop it), and a reply that
    does what the prompt says, in any of the wordings, is scored by its last integer."""
    rows = pq.read_table(DATA_DIR / f"arith_chat_{name}.parquet").to_pylist()
    texts = {r["prompt"][0]["content"] for r in rows}
    assert not [t for t in texts if "boxed" in t.lower() or "\\" in t]
    assert all(re.search(r"\b(end|last|finish)", t, re.IGNORECASE) for t in texts)
    for row in rows[:50]:
        truth = row["reward_model"]["ground_truth"]
        reply = f"We work it out step by step. The answer is {truth}"
        assert score(reply, truth, "arith_chat").verdict.value == "correct", reply
        assert score(f"{reply}, and then {int(truth) + 1}", truth, "arith_chat").verdict.value == "wrong"


def test_the_loader_reads_the_chat_files() -> None:
    df = load_dataset(DATA_DIR / "arith_chat_test.parquet")
    assert len(df) == 500
    assert sorted(df["difficulty"].value_counts().items()) == [(level, 100) for level in range(5)]
    row = df.iloc[0]
    assert (row["prompt_id"], row["data_source"], row["ground_truth"]) == ("0", "arith_chat", "2")
    assert row["prompt_text"] == "Compute 8-6. End your reply with the final answer."


def test_math_verify_scores_a_boxed_answer() -> None:
    assert verifier_for("math").name == "math"
    rows = pq.read_table(DATA_DIR / "arith_chat_test.parquet").to_pylist()
    for row in (rows[0], rows[-1], *[r for r in rows if r["reward_model"]["ground_truth"].startswith("-")][:2]):
        truth = row["reward_model"]["ground_truth"]
        assert score(f"Step by step ... so the answer is \\boxed{{{truth}}}.", truth, "math").reward == 1.0
        assert score(f"The answer is \\boxed{{{int(truth) + 1}}}.", truth, "math").reward == 0.0


def test_the_question_written_back_scores_zero_with_the_files_verifier() -> None:
    """A model trained on math-verify's reward learned to answer "Compute 9-7" with "9-7": math-verify
    evaluates the expression. The files name a verifier that wants the number."""
    plain = pq.read_table(DATA_DIR / "arith_test.parquet").to_pylist()
    for name in ("arith_chat_train", "arith_chat_test", "arith_chat_test_reworded"):
        rows = pq.read_table(DATA_DIR / f"{name}.parquet").to_pylist()
        assert {r["data_source"] for r in rows} == {"arith_chat"}
    for old, row in zip(plain, pq.read_table(DATA_DIR / "arith_chat_test.parquet").to_pylist(), strict=True):
        expression, truth = old["prompt"][0]["content"].removesuffix("="), row["reward_model"]["ground_truth"]
        if re.match(rf"{re.escape(truth)}[-+]", expression):  # "8-0", "0+0": the first operand is the answer
            continue
        for echo in (expression, " ".join(expression.replace("-", " - ").replace("+", " + ").split())):
            assert score(echo, truth, row["data_source"]).reward == 0.0, echo
        assert score(f"{expression} = \\boxed{{{truth}}}", truth, row["data_source"]).reward == 1.0, expression


def test_a_prompt_without_the_equals_sign_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="followed by '='"):
        make_arith_chat.chat_message("36-48+54")
    rows = pq.read_table(DATA_DIR / "arith_test.parquet").slice(0, 3).to_pandas()
    rows["prompt"] = [[{"role": "user", "content": "1+1="}], [{"role": "user", "content": "2+2"}], rows["prompt"][2]]
    write_verl_parquet(rows, tmp_path / "arith_test.parquet")
    with pytest.raises(ValueError, match=r"followed by '=', got '2\+2'"):
        make_arith_chat.to_chat(tmp_path / "arith_test.parquet")
    two_turns = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]
    with pytest.raises(ValueError, match="one user message"):
        make_arith_chat.chat_row({"prompt": two_turns, "extra_info": {"index": 7}})


@pytest.mark.parametrize("hard", [1, 2])
def test_the_pools_with_a_hard_tail_are_level_0_and_100_problems_of_the_hard_level(hard: int) -> None:
    """docs/results.md's pre-registered pools: every level-0 training problem, then 100 of level 1 (or 2) drawn
    by numpy's generator of seed 0; rows as in the chat training file, none twice."""
    train = pq.read_table(DATA_DIR / "arith_chat_train.parquet").to_pylist()
    pool = pq.read_table(DATA_DIR / f"arith_chat_train_l0{hard}.parquet").to_pylist()
    levels = [row["extra_info"]["difficulty"] for row in pool]
    assert levels == [0] * 100 + [hard] * 100
    by_index = {row["extra_info"]["index"]: row for row in train}
    assert all(by_index[row["extra_info"]["index"]] == row for row in pool)
    assert len({row["extra_info"]["index"] for row in pool}) == 200
    assert [row for row in train if row["extra_info"]["difficulty"] == 0] == pool[:100]


def test_the_census_candidates_are_100_level_1_problems_no_pool_holds() -> None:
    """docs/results.md's census: 100 level-1 training problems that neither pool with a hard tail holds, rows as in
    the chat training file."""
    train = pq.read_table(DATA_DIR / "arith_chat_train.parquet").to_pylist()
    unused = pq.read_table(DATA_DIR / "arith_chat_train_l1_unused.parquet").to_pylist()
    assert [row["extra_info"]["difficulty"] for row in unused] == [1] * 100
    by_index = {row["extra_info"]["index"]: row for row in train}
    assert all(by_index[row["extra_info"]["index"]] == row for row in unused)
    pooled = {
        row["extra_info"]["index"] for row in pq.read_table(DATA_DIR / "arith_chat_train_l01.parquet").to_pylist()
    }
    assert len({row["extra_info"]["index"] for row in unused} - pooled) == 100


def test_the_positive_controls_files_hold_the_census_band() -> None:
    """band_train: 24 level-0 problems with answers not negative, then 24 unused level-1 problems the census solved
    1-6 times of 32; band_test: every held-out problem the census put in the band, none of them in the pool."""
    census = DATA_DIR.parent / "docs" / "census"
    solved = {
        name: dict(zip(t["prompt_id"].astype(str), t["solved"], strict=True))
        for name in ("train-l1-unused", "test-l1", "test-l2")
        for t in [pd.read_parquet(census / f"{name}.parquet")]
    }
    pool = pq.read_table(DATA_DIR / "arith_chat_band_train.parquet").to_pylist()
    levels = [r["extra_info"]["difficulty"] for r in pool]
    assert levels == [0] * 24 + [1] * 24
    assert all(int(r["reward_model"]["ground_truth"]) >= 0 for r in pool[:24])
    assert all(1 <= solved["train-l1-unused"][str(r["extra_info"]["index"])] <= 6 for r in pool[24:])
    held = pq.read_table(DATA_DIR / "arith_chat_band_test.parquet").to_pylist()
    in_band = {k for name in ("test-l1", "test-l2") for k, v in solved[name].items() if 1 <= v <= 6}
    assert sorted(str(r["extra_info"]["index"]) for r in held) == sorted(in_band, key=int) and len(held) == 73
    assert not {r["prompt"][0]["content"] for r in held} & {r["prompt"][0]["content"] for r in pool}


def test_without_census_tables_the_positive_controls_files_are_not_written(tmp_path: Path, capsys) -> None:
    make_arith_chat.main(["--out-dir", str(tmp_path), "--census-dir", str(tmp_path / "none")])
    assert not (tmp_path / "arith_chat_band_train.parquet").exists()
    assert "no census tables in" in capsys.readouterr().out
