"""``coba inspect`` (commands/inspection.py, readers/views.py, readers/sql.py) on small synthetic run directories."""

from __future__ import annotations

import argparse
import csv
import io
import json
from pathlib import Path

import duckdb
import pandas as pd
import pytest

from coba_tasks.commands.inspection import add_inspect_parser
from coba_tasks.pipeline.store import RunStore
from coba_tasks.readers import sql
from coba_tasks.readers.figures import run_summary
from coba_tasks.readers.sql import run_sql
from coba_tasks.readers.views import TABLE_NAMES, format_summary, render, show_table

CONFIG = {
    "run": {"name": "t", "seed": 0, "steps": 2, "eval_every": 2},
    "data": {"train": "train.parquet", "test": "test.parquet", "prompts_per_step": 4},
    "allocation": {"strategy": "coba", "mode": "paper", "group_size": 2, "min_budget": 1, "max_budget": 10},
    "optim": {"lr": 1e-4},
}
LONG_IDS = list(range(100))

# ---------------------------------------------------------------------------------------------
# A tiny run: prompts p0..p3 (difficulty 0, 0, 1, 2); steps 0 and 1 done; step 0 evaluated.
# Budgets used by step 0: 2 4 6 8, by step 1: 1 3 10 6  ->  min 1, mean 5, max 10;
# per difficulty: 0 -> (2 + 4 + 1 + 3) / 4 = 2.5, 1 -> (6 + 10) / 2 = 8, 2 -> (8 + 6) / 2 = 7.


def budget(values: list[int]) -> pd.DataFrame:
    n = len(values)
    return pd.DataFrame(
        {
            "prompt_id": [f"p{i}" for i in range(n)],
            "pass_rate_est": [0.5] * n,
            "budget": values,
            "value": [0.1] * n,
            "marginal_gain": [0.01] * n,
            "group": ["all"] * n,
            "alpha": [9.0] * n,
            "beta": [2.0] * n,
            "tau": [float("nan")] * n,
            "strategy": ["coba"] * n,
            "fallback": [""] * n,
        }
    )


def rollouts(rows: list[tuple[str, int, list[int]]], version: int) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "prompt_id": [r[0] for r in rows],
            "sample_idx": [r[1] for r in rows],
            "completion": ["42" for _ in rows],
            "token_ids": [r[2] for r in rows],
            "n_tokens": [len(r[2]) for r in rows],
            "finish_reason": ["stop" for _ in rows],
            "seed": [7 for _ in rows],
            "weight_version": [version for _ in rows],
        }
    )


def rewards(rows: list[tuple[str, int, float, str]]) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "prompt_id": [r[0] for r in rows],
            "sample_idx": [r[1] for r in rows],
            "reward": [r[2] for r in rows],
            "verdict": [r[3] for r in rows],
            "extracted_answer": ["42" for _ in rows],
        }
    )


def capability(step: int, f: float, used: tuple[float, float], new: tuple[float, float], verdicts: list[int]):
    names = ["correct", "wrong", "no_answer", "timeout", "error"]
    return pd.DataFrame(
        [
            {
                "step": step,
                "S": 1 - f,
                "F": f,
                "Fbar": f,
                "Ftil": f,
                "alpha_used": used[0],
                "beta_used": used[1],
                "alpha": new[0],
                "beta": new[1],
                "prompts": 4,
                "rollouts": sum(verdicts),
                "zero_variance_groups": 0.5,
                **{f"verdict_{n}": v for n, v in zip(names, verdicts, strict=True)},
                "tracker_state": json.dumps({"version": 1, "alpha": new[0]}),
            }
        ]
    )


def update(step: int, loss: float, kl: float = 0.0) -> pd.DataFrame:
    return pd.DataFrame(
        [
            {
                "step": step,
                "loss": loss,
                "clip_frac": 0.0,
                "grad_norm": 1.5,
                "entropy": 0.7,
                "kl": kl,
                "tokens": 10,
                "sequences": 3,
                "lr": 1e-4,
                "zero_variance_groups": 0.5,
                "rollouts": 3,
            }
        ]
    )


def evaluation(acc: list[float], version: int) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "prompt_id": ["e0", "e1", "e2", "e3"],
            "difficulty": [0, 0, 1, 1],
            "accuracy": acc,
            "weight_version": [version] * 4,
        }
    )


def history(step: int) -> pd.DataFrame:
    return pd.DataFrame({"prompt_id": ["p0", "p1"], "pass_rates": [[0.5], [0.25, 0.75]], "last_step": [step, step]})


def make_run(root: Path, last: tuple[str, ...] = ("budget", "eval"), finished: bool = True) -> RunStore:
    """Steps 0 and 1 done; step 2 holds the tables named in ``last``; summary.json when ``finished``."""
    store = RunStore(root)
    store.create(config_dict=CONFIG, config_hash="abc", versions={})
    store.write_run_table(
        "prompts",
        pd.DataFrame(
            {
                "prompt_id": ["p0", "p1", "p2", "p3"],
                "difficulty": [0, 0, 1, 2],
                "prompt_text": ["1+1=", "2+2=", "13*7=", "123*456="],
                "ground_truth": ["2", "4", "91", "56088"],
            }
        ),
    )
    # step 0
    store.write_table(0, "budget", budget([2, 4, 6, 8]))
    store.write_table(0, "eval", evaluation([1.0, 0.5, 0.0, 0.25], 0))  # mean 0.4375; L0 0.75, L1 0.125
    store.write_table(0, "rollouts", rollouts([("p0", 0, [1, 2]), ("p0", 1, LONG_IDS), ("p1", 0, [3])], 0))
    store.write_table(
        0, "rewards", rewards([("p0", 0, 1.0, "correct"), ("p0", 1, 0.0, "wrong"), ("p1", 0, 1.0, "correct")])
    )
    store.write_table(0, "history", history(0))
    store.write_table(0, "capability", capability(0, 0.5, (9.0, 2.0), (8.0, 3.0), [10, 5, 1, 0, 0]))
    store.write_table(0, "update", update(0, -0.5))
    # step 1
    store.write_table(1, "budget", budget([1, 3, 10, 6]))
    store.write_table(1, "rollouts", rollouts([("p2", 0, [4, 5]), ("p3", 0, [6])], 1))
    store.write_table(1, "rewards", rewards([("p2", 0, 0.0, "no_answer"), ("p3", 0, 1.0, "correct")]))
    store.write_table(1, "history", history(1))
    store.write_table(1, "capability", capability(1, 0.25, (8.0, 3.0), (7.5, 3.5), [20, 2, 0, 1, 0]))
    store.write_table(1, "update", update(1, 0.25, kl=float("nan")))
    # step 2
    tables = {
        "budget": budget([5, 5, 5, 5]),
        "eval": evaluation([1.0, 1.0, 0.5, 0.0], 2),  # mean 0.625; L0 1.0, L1 0.25
        "rollouts": rollouts([("p0", 0, [1]), ("p1", 0, [2]), ("p1", 1, [3]), ("p2", 0, [4])], 2),
        "rewards": rewards(
            [("p0", 0, 1.0, "correct"), ("p1", 0, 0.0, "wrong"), ("p1", 1, 0.0, "wrong"), ("p2", 0, 0.0, "timeout")]
        ),
    }
    for name in last:
        store.write_table(2, name, tables[name])
    if finished:
        store.write_json("summary.json", {"steps": 2, "wall_seconds": 12.5})
    return store


def add_strays(store: RunStore) -> None:
    """What a writer leaves mid-write at step 2: a temporary and a renamed file not yet in the manifest."""
    step_dir = store.step_dir(2)
    step_dir.mkdir(parents=True, exist_ok=True)
    (step_dir / ".rewards.parquet.abcd.tmp").write_bytes(b"PAR1 half a parquet file")
    assert not store.is_done(2, "rewards")
    rewards([("p0", 0, 99.0, "correct")]).to_parquet(step_dir / "rewards.parquet", index=False)
    assert not store.is_done(2, "rewards")  # the file is there, its manifest entry is not


# The runs below are only read, never changed: one of each per module keeps the tests fast.


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_run(tmp_path_factory.mktemp("runs") / "done").root


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run in progress: step 2 has only its budget (plus the leftovers of a writer at work)."""
    store = make_run(tmp_path_factory.mktemp("runs") / "live", last=("budget",), finished=False)
    add_strays(store)
    return store.root


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}


# ---------------------------------------------------------------------------------------------
# run_summary / format_summary


def test_summary_of_a_finished_run(run: Path):
    s = run_summary(run)
    assert s["run_dir"] == str(run.resolve())
    assert s["finished"] is True and s["wall_seconds"] == 12.5
    assert (s["strategy"], s["steps_planned"]) == ("coba", 2)
    assert (s["step_dirs"], s["steps_done"], s["last_step_done"]) == (3, 2, 1)
    assert s["latest_step"] == {"step": 2, "tables": ["budget", "eval"]}

    assert [h["step"] for h in s["heldout"]] == [0, 2]
    assert s["heldout"][0]["accuracy"] == pytest.approx(0.4375)
    assert s["heldout"][0]["by_difficulty"] == pytest.approx({"0": 0.75, "1": 0.125})
    assert s["heldout"][1]["accuracy"] == pytest.approx(0.625)
    assert s["heldout"][1]["by_difficulty"] == pytest.approx({"0": 1.0, "1": 0.25})
    assert s["heldout"][0]["prompts"] == 4

    first, latest = s["capability"]["first"], s["capability"]["latest"]
    assert (first["step"], first["F"], first["alpha_used"], first["beta_used"]) == (0, 0.5, 9.0, 2.0)
    assert (latest["step"], latest["F"], latest["alpha"], latest["beta"]) == (1, 0.25, 7.5, 3.5)

    b = s["budget"]  # budgets used by the done steps 0 and 1 (not step 2's)
    assert (b["steps"], b["rows"], b["min"], b["mean"], b["max"]) == (2, 8, 1.0, 5.0, 10.0)
    assert b["mean_by_difficulty"] == pytest.approx({"0": 2.5, "1": 8.0, "2": 7.0})

    assert s["verdicts"] == {"correct": 30, "wrong": 7, "no_answer": 1, "timeout": 1, "error": 0}
    assert s["total_rollouts"] == 5
    assert s["last_update"]["step"] == 1 and s["last_update"]["loss"] == 0.25
    assert s["last_update"]["kl"] is None  # NaN -> None
    json.dumps(s, allow_nan=False)  # plain JSON


def test_summary_of_a_run_in_progress(live: Path):
    s = run_summary(live)
    assert s["finished"] is False and s["wall_seconds"] is None
    assert (s["step_dirs"], s["steps_done"], s["last_step_done"]) == (3, 2, 1)
    assert s["latest_step"] == {"step": 2, "tables": ["budget"]}  # the strays are not tables
    assert [h["step"] for h in s["heldout"]] == [0]
    assert s["budget"]["steps"] == 2 and s["budget"]["max"] == 10.0
    assert s["total_rollouts"] == 5
    text = format_summary(s)
    assert "not finished" in text and "latest step" in text and "2: budget" in text


def test_summary_counts_rewards_verdicts_before_capability(tmp_path: Path):
    """Step 2 has rollouts and rewards but no capability table yet: its verdicts come from rewards."""
    store = make_run(tmp_path / "r", last=("budget", "rollouts", "rewards"), finished=False)
    s = run_summary(store.root)
    assert s["verdicts"] == {"correct": 31, "wrong": 9, "no_answer": 1, "timeout": 2, "error": 0}
    assert s["total_rollouts"] == 9
    assert s["steps_done"] == 2 and s["budget"]["steps"] == 2  # step 2 is not done: its budget is not counted


def test_summary_of_a_run_with_no_step_yet(tmp_path: Path):
    store = RunStore(tmp_path / "empty")
    store.create(config_dict=CONFIG, config_hash="abc", versions={})
    s = run_summary(store.root)
    assert (s["step_dirs"], s["steps_done"], s["total_rollouts"]) == (0, 0, 0)
    assert s["heldout"] == [] and s["budget"] is None and s["verdicts"] == {}
    text = format_summary(s)
    assert "no eval yet" in text and "no capability table yet" in text
    assert run_sql(store.root, "select count(*) as n from budget")["n"].tolist() == [0]
    with pytest.raises(ValueError, match="Permission Error"):  # no file allowed does not mean every file
        run_sql(store.root, "select * from read_csv('/etc/passwd')")


def test_format_summary(run: Path):
    text = format_summary(run_summary(run))
    lines = text.splitlines()
    assert lines[0] == f"run {run.resolve()}: finished, 2/2 steps done, 12 s, strategy coba"
    body = {ln[:16].strip(): ln[17:] for ln in lines[1:]}
    assert body["held-out acc"].startswith("0.438 -> 0.625  (step 0 -> step 2")
    assert body["failure rate F"].startswith("0.500 -> 0.250")
    assert body["alpha, beta"] == "(9.00, 2.00) used at step 0 -> (7.50, 3.50) after step 1"
    assert body["budget"].startswith("min 1  mean 5.00  max 10  over 2 steps")
    assert "correct 30 (77%)" in body["verdicts"] and "timeout 1" in body["verdicts"]
    by_level = [ln for ln in lines if ln.startswith("  by difficulty")]
    assert by_level == ["  by difficulty  L0 0.75->1.00  L1 0.12->0.25", "  by difficulty  L0 2.5  L1 8.0  L2 7.0"]
    gain = [ln[17:] for ln in lines if ln.startswith("  gain ")]
    assert (
        len(gain) == 1 and gain[0].startswith("test: 0.438 -> 0.625, +0.188 ± ") and gain[0].endswith("over 4 prompts")
    )
    assert all(ln[16] == " " for ln in lines[1:])  # the values start in one column
    assert format_summary(json.loads(json.dumps(run_summary(run)))) == text  # works on the JSON too


def test_not_a_run(tmp_path: Path):
    with pytest.raises(ValueError, match="no such run directory"):
        run_summary(tmp_path / "missing")
    with pytest.raises(ValueError, match="no run here"):
        run_summary(tmp_path)
    with pytest.raises(ValueError, match="no run here"):
        run_sql(tmp_path, "select 1")


# ---------------------------------------------------------------------------------------------
# show_table


def test_show_table_formats(run: Path):
    text = show_table(run, 0, "rewards")
    lines = text.splitlines()
    assert lines[0].split() == ["prompt_id", "sample_idx", "reward", "verdict", "extracted_answer"]
    assert len(lines) == 4 and lines[1].split()[:4] == ["p0", "0", "1.0", "correct"]

    rows = list(csv.DictReader(io.StringIO(show_table(run, 0, "rollouts", fmt="csv"))))
    assert [r["prompt_id"] for r in rows] == ["p0", "p0", "p1"]
    assert json.loads(rows[1]["token_ids"]) == LONG_IDS  # lists as JSON text in CSV

    records = json.loads(show_table(run, 0, "rollouts", fmt="json"))
    assert records[0] == {
        "prompt_id": "p0",
        "sample_idx": 0,
        "completion": "42",
        "token_ids": [1, 2],
        "n_tokens": 2,
        "finish_reason": "stop",
        "seed": 7,
        "weight_version": 0,
    }
    assert records[1]["token_ids"] == LONG_IDS
    assert json.loads(show_table(run, 0, "budget", fmt="json"))[0]["tau"] is None  # NaN -> null


def test_show_table_cuts_long_cells(run: Path):
    text = show_table(run, 0, "rollouts")
    row = text.splitlines()[2]
    assert "…] (100)" in row and "99" not in row.split("…")[0][-10:]
    assert max(len(ln) for ln in text.splitlines()) < 150
    assert "[1, 2]" in text.splitlines()[1]


def test_show_table_limit_and_columns(run: Path):
    text = show_table(run, 0, "rewards", limit=2, columns=["reward", "prompt_id"])
    lines = text.splitlines()
    assert lines[0].split() == ["reward", "prompt_id"]
    assert [ln.split() for ln in lines[1:3]] == [["1.0", "p0"], ["0.0", "p0"]]
    assert lines[3] == "(2 of 3 rows shown)"
    assert len(show_table(run, 0, "rewards", limit=0).splitlines()) == 4  # 0 = every row
    assert len(json.loads(show_table(run, 0, "rewards", limit=1, fmt="json"))) == 1
    assert "allocated from the tables of step 0" in show_table(run, 1, "budget")


def test_show_table_errors(run: Path, live: Path):
    with pytest.raises(ValueError, match=r"unknown column 'nope' .*valid columns: prompt_id, sample_idx, reward"):
        show_table(run, 0, "rewards", columns=["reward", "nope"])
    with pytest.raises(ValueError, match=r"stage 'rewards' is not done at step 2 .*done there: budget, eval"):
        show_table(run, 2, "rewards")
    with pytest.raises(ValueError, match=r"stage 'rewards' is not done at step 2 .*done there: budget\)"):
        show_table(live, 2, "rewards")  # the stray rewards.parquet and .tmp file do not count
    with pytest.raises(ValueError, match=r"step 7 has no directory .*steps there: 0-2"):
        show_table(run, 7, "budget")
    with pytest.raises(ValueError, match="unknown stage 'reward'"):
        show_table(run, 0, "reward")
    with pytest.raises(ValueError, match="unknown format 'xml'"):
        show_table(run, 0, "rewards", fmt="xml")
    with pytest.raises(ValueError, match="step must be a non-negative integer"):
        show_table(run, -1, "rewards")


HOSTILE = "\x1b]0;owned\x07\x1b[2J\rok\x08\x9b31m\u202egnp.exe\x7f"  # title, clear, overwrite, C1 CSI, bidi


def test_views_escape_control_characters_and_keep_newline_and_tab_readable(tmp_path: Path, capsys):
    """A completion full of terminal escapes reaches the terminal as text (\\x1b ...) in every format: nothing
    it holds moves the cursor, clears the screen or retitles the window; newline and tab stay readable."""
    store = make_run(tmp_path / "r")
    frame = rollouts([("p0", 0, [1]), ("p1", 0, [2])], 2)
    frame["completion"] = [HOSTILE, "line one\nline\ttwo"]
    frame["token_ids"] = [["\x1b[2J"], []]  # inside a list too
    store.write_table(2, "rollouts", frame)
    unsafe = ["\x1b", "\x07", "\r", "\x08", "\x9b", "\u202e", "\x7f"]
    for fmt in ("table", "csv", "json"):
        args = parse("--run-dir", str(store.root), "--step", "2", "--stage", "rollouts", "--format", fmt)
        assert args.func(args) == 0
        out = capsys.readouterr().out
        assert [c for c in unsafe if c in out] == [], fmt
    table = show_table(store.root, 2, "rollouts", columns=["completion"])
    assert "\\x1b]0;owned\\x07" in table and "\\rok\\x08\\x9b31m\\u202egnp" in table
    assert "line one\\nline\\ttwo" in table  # as the table showed them before (pandas writes \\t too)
    rows = list(csv.DictReader(io.StringIO(show_table(store.root, 2, "rollouts", fmt="csv"))))
    assert rows[0]["completion"].startswith("\\x1b]0;owned") and rows[1]["completion"] == "line one\nline\ttwo"
    records = json.loads(show_table(store.root, 2, "rollouts", fmt="json"))  # JSON escapes: the exact text back
    assert records[0]["completion"] == HOSTILE and records[0]["token_ids"] == ["\x1b[2J"]
    summary = format_summary({"run_dir": "runs/\x1b[2Jx", "strategy": "coba"})
    assert "\x1b" not in summary and "runs/\\x1b[2Jx" in summary


def test_csv_cells_that_a_spreadsheet_would_run_are_quoted_and_numbers_are_not():
    """OWASP's CSV-injection rule: a text cell starting with = + - @, tab or CR gets a leading single quote;
    numbers (a float column's -0.5, an answer "-3") are data and stay as they are."""
    df = pd.DataFrame(
        {
            "completion": ['=HYPERLINK("http://x")', "+1+cmd|' /C calc'!A0", "-2+3", "@SUM(A1)", "\tx", "\rx", "ok"],
            "extracted_answer": ["-3", "+4", "1e5", "-0.5", "=1", "", "7"],
            "advantage": [-0.5, 0.5, -1.0, 0.0, 1.0, -2.0, 3.0],
        }
    )
    df["=cmd"] = ["x"] * len(df)
    rows = list(csv.reader(io.StringIO(render(df, "csv"))))
    assert rows[0] == ["completion", "extracted_answer", "advantage", "'=cmd"]
    assert [r[0] for r in rows[1:]] == [
        '\'=HYPERLINK("http://x")',
        "'+1+cmd|' /C calc'!A0",
        "'-2+3",
        "'@SUM(A1)",
        "'\tx",
        "\\rx",  # CR is shown escaped, so it no longer starts the cell
        "ok",
    ]
    assert [r[1] for r in rows[1:]] == ["-3", "+4", "1e5", "-0.5", "'=1", "", "7"]
    assert [r[2] for r in rows[1:]] == ["-0.5", "0.5", "-1.0", "0.0", "1.0", "-2.0", "3.0"]


def test_render_empty_frame():
    assert render(pd.DataFrame({"a": [], "b": []})) == "(no rows; columns: a, b)"
    assert json.loads(render(pd.DataFrame({"a": []}), "json")) == []


# ---------------------------------------------------------------------------------------------
# run_sql: the views


def test_sql_views_union_steps(run: Path):
    got = run_sql(run, "select step, count(*) as n, sum(reward) as r from rewards group by step order by step")
    assert got["step"].tolist() == [0, 1] and got["n"].tolist() == [3, 2] and got["r"].tolist() == [2.0, 1.0]
    assert str(got["step"].dtype).lower().startswith("int")

    budgets = run_sql(run, "select step, sum(budget) as total from budget group by 1 order by 1")
    assert budgets.values.tolist() == [[0, 20], [1, 20], [2, 20]]  # step 2's budget is done too

    evals = run_sql(run, "select step, avg(accuracy) as acc from eval group by 1 order by 1")
    assert evals["step"].tolist() == [0, 2] and evals["acc"].tolist() == pytest.approx([0.4375, 0.625])

    caps = run_sql(run, "select * from capability order by step")
    assert caps.columns[0] == "step" and list(caps.columns).count("step") == 1
    assert caps["F"].tolist() == [0.5, 0.25]
    assert run_sql(run, 'select step, loss from "update" order by step').values.tolist() == [[0, -0.5], [1, 0.25]]
    assert run_sql(run, "select count(*) as n from history")["n"].tolist() == [4]

    ids = run_sql(run, "select token_ids from rollouts where step = 0 and sample_idx = 1")["token_ids"][0]
    assert list(ids) == LONG_IDS


def test_sql_join(run: Path):
    got = run_sql(
        run, "select b.step, avg(r.reward) from rewards r join budget b using (step, prompt_id) group by 1 order by 1"
    )
    assert got.iloc[:, 0].tolist() == [0, 1]
    assert got.iloc[:, 1].tolist() == pytest.approx([2 / 3, 0.5])
    by_level = run_sql(
        run,
        "with used as (select * from budget where step in (select step from capability)) "
        "select p.difficulty, avg(u.budget) as b from used u join prompts p using (prompt_id) group by 1 order by 1",
    )
    assert by_level.values.tolist() == [[0, 2.5], [1, 8.0], [2, 7.0]]  # as in run_summary


def test_sql_ignores_tables_mid_write(live: Path):
    assert run_sql(live, "select count(*) as n, max(reward) as m from rewards").values.tolist() == [[5, 1.0]]
    assert run_sql(live, "select distinct step from rewards order by 1")["step"].tolist() == [0, 1]
    assert run_sql(live, "select max(step) as s from budget")["s"].tolist() == [2]


def test_sql_stage_without_data(tmp_path: Path):
    store = RunStore(tmp_path / "r")
    store.create(config_dict=CONFIG, config_hash="abc", versions={})
    store.write_table(0, "budget", budget([2, 2]))
    assert run_sql(store.root, "select count(*) as n from budget")["n"].tolist() == [2]
    empty = run_sql(store.root, "select * from eval")
    assert list(empty.columns) == ["step"] and empty.empty
    with pytest.raises(ValueError, match=r"accuracy.*no data yet in: eval"):
        run_sql(store.root, "select avg(accuracy) from eval")
    assert run_sql(store.root, "select count(*) as n from prompts")["n"].tolist() == [0]  # no prompts table yet


def test_sql_errors_are_one_line(run: Path):
    with pytest.raises(ValueError, match='Referenced column "nope" not found') as exc:
        run_sql(run, "select nope from rewards")
    assert "\n" not in str(exc.value)
    with pytest.raises(ValueError, match="syntax error"):
        run_sql(run, "selec 1")
    with pytest.raises(ValueError, match="empty query"):
        run_sql(run, "  ")


# ---------------------------------------------------------------------------------------------
# run_sql: read-only


REFUSED = [
    "copy (select * from budget) to '{out}/copy.csv'",
    "copy budget to '{out}/copy.parquet' (format parquet)",
    "create table t as select * from budget",
    "create view v as select 1",
    "insert into budget select * from budget",
    "update budget set budget = 0",
    "delete from budget",
    "drop view budget",
    "attach '{out}/x.duckdb' as x",
    "detach memory",
    "install httpfs",
    "load httpfs",
    "pragma version",
    "set enable_external_access = true",
    "reset lock_configuration",
    "call pragma_version()",
    "export database '{out}/export'",
    "explain select 1",
    "select 1; select 2",
    "select * from budget; copy budget to '{out}/copy.csv'",
]


@pytest.mark.parametrize("query", REFUSED)
def test_sql_refuses_anything_but_one_select(run: Path, tmp_path: Path, query: str):
    out = tmp_path / "outside"
    out.mkdir()
    before = snapshot(run)
    with pytest.raises(ValueError, match="read-only: only SELECT"):
        run_sql(run, query.format(out=out))
    assert list(out.iterdir()) == [] and snapshot(run) == before


def test_sql_select_cannot_read_other_files(run: Path, live: Path, tmp_path: Path):
    secret = tmp_path / "secret.csv"
    secret.write_text("a,b\n1,2\n")
    outside = [
        f"select * from read_csv('{secret}')",
        f"select * from read_text('{secret}')",
        f"select * from read_blob('{secret}')",
        f"select * from glob('{tmp_path}/*')",
        f"select * from read_text('{run / 'config.yaml'}')",  # inside the run, but not a table
        f"select * from read_parquet('{run / 'steps' / '*' / '*.parquet'}')",
        f"select * from parquet_metadata('{live / 'steps' / '000002' / '.rewards.parquet.abcd.tmp'}')",
        "select * from read_csv('/etc/passwd')",
        # a table mid-write: its file exists but it is not in the manifest
        f"select * from read_parquet('{(live / 'steps' / '000002' / 'rewards.parquet').resolve()}')",
    ]
    for query in outside:
        with pytest.raises(ValueError, match="Permission Error"):
            run_sql(live if "live" in query else run, query)


def test_sql_refuses_a_table_that_is_a_symlink_out_of_the_run(tmp_path: Path):
    """A done table replaced by a link to a file elsewhere (the same bytes, so its manifest entry still matches):
    --sql refuses, naming the link and the fix, instead of reading outside the run."""
    store = make_run(tmp_path / "r")
    table = store.table_path(1, "rewards")
    elsewhere = tmp_path / "elsewhere.parquet"
    table.rename(elsewhere)
    table.symlink_to(elsewhere)
    with pytest.raises(ValueError, match=r"rewards\.parquet resolves to .*elsewhere\.parquet, outside the run") as info:
        run_sql(store.root, "select count(*) as n from budget")
    assert "\n" not in str(info.value) and "replace the link by the real" in str(info.value)


def test_sql_connection_is_locked_down_even_without_the_statement_check(run: Path, tmp_path: Path, monkeypatch):
    """The second line of defence alone: DuckDB itself refuses writes, file access and config changes."""
    monkeypatch.setattr(sql, "_check_select", lambda query, _duckdb: duckdb.extract_statements(query)[0])
    out = tmp_path / "outside"
    out.mkdir()
    for query in [
        f"copy (select 1) to '{out}/x.csv'",
        f"attach '{out}/x.duckdb' as x",
        "install httpfs",
        "load httpfs",
        "set enable_external_access = true",
        "set allowed_directories = ['/']",
        "set lock_configuration = false",
        f"export database '{out}/export'",
    ]:
        with pytest.raises(ValueError, match=r"Permission Error|configuration has been locked|disabled through config"):
            run_sql(run, query)
    assert list(out.iterdir()) == []
    # the views still read under the same lock
    assert run_sql(run, "select count(*) as n from rewards")["n"].tolist() == [5]


def test_sql_writes_nothing_into_the_run(run: Path, monkeypatch):
    monkeypatch.chdir(run)  # DuckDB's default temp directory is relative to the working directory
    before = snapshot(run)
    run_sql(run, "select r.*, b.budget from rewards r join budget b using (step, prompt_id) order by random()")
    assert snapshot(run) == before


# ---------------------------------------------------------------------------------------------
# The CLI


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="coba")
    add_inspect_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["inspect", *argv])


def test_cli_summary(run: Path, capsys):
    args = parse("--run-dir", str(run), "--json")
    assert args.func(args) == 0
    assert json.loads(capsys.readouterr().out) == run_summary(run)

    args = parse("--run-dir", str(run))
    assert args.func(args) == 0
    assert capsys.readouterr().out == format_summary(run_summary(run)) + "\n"


def test_cli_table(run: Path, capsys):
    args = parse(
        "--run-dir", str(run), "--step", "0", "--stage", "rewards", "--format", "csv", "--columns", "prompt_id,reward"
    )
    assert args.func(args) == 0
    assert capsys.readouterr().out.splitlines() == ["prompt_id,reward", "p0,1.0", "p0,0.0", "p1,1.0"]

    args = parse("--run-dir", str(run), "--step", "0", "--stage", "rewards", "--limit", "1", "--json")
    assert args.func(args) == 0
    assert [r["prompt_id"] for r in json.loads(capsys.readouterr().out)] == ["p0"]


def test_cli_sql(run: Path, capsys):
    query = "select step, count(*) as n from rollouts group by 1 order by 1"
    args = parse("--run-dir", str(run), "--sql", query, "--format", "json")
    assert args.func(args) == 0
    assert json.loads(capsys.readouterr().out) == [{"step": 0, "n": 3}, {"step": 1, "n": 2}]

    args = parse("--run-dir", str(run), "--sql", query)
    assert args.func(args) == 0
    assert [ln.split() for ln in capsys.readouterr().out.splitlines()] == [["step", "n"], ["0", "3"], ["1", "2"]]


def test_cli_errors(run: Path):
    for argv, message in [
        (["--step", "0"], "--step and --stage go together: --stage is missing"),
        (["--stage", "rewards"], "--step and --stage go together: --step is missing"),
        (
            ["--step", "0", "--stage", "rewards", "--sql", "select 1"],
            "choose one of --step/--stage, --sql, --prompts and --mechanisms",
        ),
        (["--json", "--format", "csv"], "contradict"),
        (["--limit", "3"], "apply to --step/--stage, --sql or --mechanisms"),
        (["--sql", "drop view budget"], "read-only: only SELECT"),
        (["--step", "2", "--stage", "update"], "not done at step 2"),
    ]:
        args = parse("--run-dir", str(run), *argv)
        with pytest.raises(ValueError, match=message):
            args.func(args)
    with pytest.raises(SystemExit):
        parse("--run-dir", str(run), "--step", "0", "--stage", "bogus")
    with pytest.raises(SystemExit):
        parse("--step", "0")  # --run-dir is required


def test_cli_mechanisms(tmp_path: Path, capsys):
    """--mechanisms: per step, by the estimates' age, per allocated prompt; the figures are the readers'
    (tests/readers/test_mechanisms.py), this is what the command prints."""
    store = RunStore(tmp_path / "r")
    store.create(config_dict=CONFIG, config_hash="abc", versions={})
    store.write_table(0, "budget", budget([2, 2]).assign(pass_rate_est=float("nan")))
    store.write_table(0, "rollouts", rollouts([("p0", 0, [1]), ("p0", 1, [2, 3]), ("p1", 0, [4]), ("p1", 1, [5])], 0))
    store.write_table(
        0,
        "rewards",
        rewards([("p0", 0, 1.0, "correct"), ("p0", 1, 0.0, "wrong"), ("p1", 0, 0.0, "wrong"), ("p1", 1, 0.0, "wrong")]),
    )
    store.write_table(0, "history", history(0))
    store.write_table(1, "budget", budget([2, 2]).assign(pass_rate_est=[0.5, 0.5], estimate_age=1.0))
    store.write_table(1, "rollouts", rollouts([("p0", 0, [1]), ("p0", 1, [2]), ("p1", 0, [3]), ("p1", 1, [4])], 1))
    store.write_table(
        1,
        "rewards",
        rewards(
            [("p0", 0, 1.0, "correct"), ("p0", 1, 1.0, "correct"), ("p1", 0, 1.0, "correct"), ("p1", 1, 0.0, "wrong")]
        ),
    )

    def cli(*argv: str) -> str:
        args = parse("--run-dir", str(store.root), *argv)
        assert args.func(args) == 0
        return capsys.readouterr().out

    steps = json.loads(cli("--mechanisms", "--format", "json"))
    assert [(r["step"], r["estimated"], r["mixed_groups"], r["first_solved"]) for r in steps] == [
        (0, 0, 1, 1),
        (1, 2, 1, 1),
    ]
    assert steps[1]["estimate_mae"] == 0.25 and steps[1]["estimate_bias"] == 0.25 and steps[1]["estimate_corr"] is None
    # N_eff from the tokens (the update tables are not written): p0's 3 tokens at step 0, p1's 2 at step 1
    assert [r["effective_prompts"] for r in steps] == [1.0, 1.0] and steps[0]["train_pass_at_2"] == 0.5
    text = cli("--mechanisms", "age").splitlines()
    assert text[0].split() == ["age", "prompts", "estimate_mae", "estimate_bias"] and text[1].split() == [
        "1",
        "2",
        "0.25",
        "0.25",
    ]
    assert text[2].startswith("(the estimated prompts of every step by the age of their estimate")
    prompts = cli("--mechanisms", "prompts", "--format", "csv", "--columns", "step,prompt_id,estimate,realized,age")
    assert prompts.splitlines() == [
        "step,prompt_id,estimate,realized,age",
        "0,p0,,0.5,",
        "0,p1,,0.0,",
        "1,p0,0.5,1.0,1.0",
        "1,p1,0.5,0.5,1.0",
    ]
    assert cli("--mechanisms", "--limit", "1").splitlines()[2] == "(1 of 2 rows shown)"
    with pytest.raises(ValueError, match="choose one of --step/--stage, --sql, --prompts and --mechanisms"):
        cli("--mechanisms", "--prompts")
    with pytest.raises(ValueError, match="unknown column 'bogus' in the steps view of --mechanisms"):
        cli("--mechanisms", "--columns", "bogus")
    with pytest.raises(SystemExit):
        parse("--run-dir", str(store.root), "--mechanisms", "bogus")


def test_cli_help_has_examples():
    parser = argparse.ArgumentParser(prog="coba")
    sub = add_inspect_parser(parser.add_subparsers())
    text = sub.format_help()
    assert "examples:" in text and "--sql" in text and "coba inspect --run-dir" in text
    assert all(name in text for name in TABLE_NAMES)
    assert "--mechanisms [{steps,age,prompts}]" in text and "--mechanisms age" in text
