"""Tests for coba_tasks/pipeline/store.py: the run directory, its manifests and its atomic writes."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from datetime import datetime
from pathlib import Path

import pandas as pd
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from coba_tasks.pipeline import store as store_module
from coba_tasks.pipeline.store import (
    MANIFEST_FILE,
    SCHEMA_VERSION,
    STAGES,
    STEP_ORDER,
    RunStore,
    StoreError,
    Table,
    step_stages,
)

CONFIG = {"run": {"seed": 7, "steps": 3}, "allocation": {"strategy": "coba", "mode": "paper"}, "lr": 1e-6}
VERSIONS = {"coba-rl": "0.1.0", "pandas": pd.__version__}


@pytest.fixture
def run(tmp_path: Path) -> RunStore:
    store = RunStore(tmp_path / "runs" / "demo")
    store.create(CONFIG, "cfg-hash-1", VERSIONS)
    return store


def rollouts_frame() -> pd.DataFrame:
    """A rollouts-like table: strings (one non-ASCII, one empty), ragged list<int>, ints, floats."""
    return pd.DataFrame(
        {
            "prompt_id": ["p0", "p0", "p1"],
            "sample_idx": [0, 1, 0],
            "completion": ["12", "", "näive ∑ 3"],
            "token_ids": [[5, 6, 7], [], [1]],
            "reward": [1.0, 0.0, 0.5],
        }
    )


def assert_rollouts_equal(got: pd.DataFrame, want: pd.DataFrame) -> None:
    assert list(got.columns) == list(want.columns)
    assert got["prompt_id"].tolist() == want["prompt_id"].tolist()
    assert got["sample_idx"].tolist() == want["sample_idx"].tolist()
    assert got["completion"].tolist() == want["completion"].tolist()
    assert [list(x) for x in got["token_ids"]] == [list(x) for x in want["token_ids"]]
    assert got["reward"].tolist() == want["reward"].tolist()


def hidden_files(directory: Path) -> list[str]:
    """Temporary files (``.<name>.<hex>.tmp``) left in a directory."""
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


# ---------------------------------------------------------------------------------------------
# Creating and opening a run


def test_create_writes_config_and_run_json_and_open_reads_them(run: RunStore) -> None:
    assert yaml.safe_load((run.root / "config.yaml").read_text()) == CONFIG
    assert run.read_config() == CONFIG
    info = json.loads((run.root / "run.json").read_text())
    assert info["schema_version"] == SCHEMA_VERSION
    assert info["config_hash"] == "cfg-hash-1"
    assert info["versions"] == VERSIONS
    assert datetime.fromisoformat(info["created"]).tzinfo is not None
    opened = RunStore.open(run.root)
    assert opened.config_hash == "cfg-hash-1"
    assert opened.run_info == info
    assert hidden_files(run.root) == []


def test_create_refuses_an_existing_run_and_suggests_resume(run: RunStore) -> None:
    before = (run.root / "run.json").read_bytes()
    with pytest.raises(StoreError, match="coba resume") as info:
        RunStore(run.root).create({"other": 1}, "cfg-hash-2", VERSIONS)
    assert str(run.root) in str(info.value)
    assert (run.root / "run.json").read_bytes() == before  # untouched
    assert run.read_config() == CONFIG


def test_create_refuses_a_directory_with_run_files_but_no_run_json(tmp_path: Path) -> None:
    (tmp_path / "steps" / "000000").mkdir(parents=True)
    with pytest.raises(StoreError, match=r"steps.*no run\.json"):
        RunStore(tmp_path).create(CONFIG, "h", VERSIONS)
    assert not (tmp_path / "run.json").exists()


def test_create_refuses_an_empty_config_hash(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="config_hash"):
        RunStore(tmp_path / "r").create(CONFIG, "", VERSIONS)
    assert not (tmp_path / "r" / "run.json").exists()


def test_open_without_a_run_is_refused(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match=r"no run here \(run\.json is missing\)"):
        RunStore.open(tmp_path)


def test_open_refuses_another_schema_version_with_a_clear_message(run: RunStore) -> None:
    path = run.root / "run.json"
    info = json.loads(path.read_text())
    info["schema_version"] = SCHEMA_VERSION + 1
    path.write_text(json.dumps(info))
    message = f"written by schema version {SCHEMA_VERSION + 1}; this build reads version {SCHEMA_VERSION}"
    with pytest.raises(StoreError, match=message) as caught:
        RunStore.open(run.root)
    assert isinstance(caught.value, ValueError)


def test_a_run_of_the_schema_before_the_one_list_step_is_refused_naming_its_build(run: RunStore) -> None:
    """Schema 1 wrote a step's budget at the end of the step before (and one for a step after the last): this
    build refuses such a run directory in one line that names the builds that can continue it."""
    path = run.root / "run.json"
    info = json.loads(path.read_text())
    info["schema_version"] = 1
    path.write_text(json.dumps(info))
    with pytest.raises(StoreError, match=r"schema version 1; this build reads version 2\. .*commit e79713f") as caught:
        RunStore.open(run.root)
    assert "\n" not in str(caught.value)


def test_writing_into_a_directory_that_was_never_created_is_refused(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="no run here"):
        RunStore(tmp_path).write_table(0, Table.ROLLOUTS, rollouts_frame())
    assert not (tmp_path / "steps").exists()


# ---------------------------------------------------------------------------------------------
# Paths and names


def test_step_checkpoint_and_report_dirs(run: RunStore) -> None:
    assert run.step_dir(7) == run.root / "steps" / "000007"
    assert run.checkpoint_dir(7) == run.root / "checkpoints" / "000007"
    assert run.report_dir() == run.root / "report"
    assert run.step_dir(0).name == "000000"
    assert run.step_dir(1_234_567).name == "1234567"  # wider steps still parse back
    assert run.table_path(3, Table.BUDGET) == run.root / "steps" / "000003" / "budget.parquet"
    assert not run.step_dir(7).exists()  # paths are not created by asking


@pytest.mark.parametrize("bad", [-1, True, 1.5, "7"])
def test_bad_steps_are_refused(run: RunStore, bad: object) -> None:
    with pytest.raises(StoreError, match="non-negative integer"):
        run.step_dir(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "name", ["../rollouts", "a/b", "/etc/passwd", "..", ".", "", ".hidden", "_manifest", "rollouts.parquet", "a\\b"]
)
def test_table_names_that_could_escape_or_clash_are_refused(run: RunStore, name: str) -> None:
    for call in (
        lambda: run.write_table(0, name, rollouts_frame()),
        lambda: run.read_table(0, name),
        lambda: run.is_done(0, name),
        lambda: run.invalidate(0, name),
        lambda: run.write_run_table(name, rollouts_frame()),
    ):
        with pytest.raises(StoreError, match="table name"):
            call()
    assert not (run.root / "steps").exists()
    assert sorted(p.name for p in run.root.iterdir()) == ["config.yaml", "run.json"]


@pytest.mark.parametrize(
    "relpath",
    [
        "../x.json",
        "/tmp/x.json",
        "a/../../x.json",
        "a\\x.json",
        ".x.json",
        "",
        "run.json",
        "steps/000001/_manifest.json",
    ],
)
def test_json_paths_that_escape_or_clobber_store_files_are_refused(run: RunStore, relpath: str) -> None:
    with pytest.raises(StoreError):
        run.write_json(relpath, {"x": 1})
    assert not (run.root.parent / "x.json").exists()
    assert json.loads((run.root / "run.json").read_text())["config_hash"] == "cfg-hash-1"


def test_json_path_through_a_symlink_out_of_the_run_is_refused(run: RunStore, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (run.root / "link").symlink_to(outside)
    with pytest.raises(StoreError, match="outside the run directory"):
        run.write_json("link/x.json", {"x": 1})
    assert list(outside.iterdir()) == []


def test_one_step_is_one_list_with_its_budget_first() -> None:
    assert [s.value for s in STAGES] == ["budget", "rollouts", "rewards", "capability", "update"]
    assert step_stages("once") == STAGES
    assert step_stages("pilot") == (Table.ROUND, Table.ROUND_REWARDS, *STAGES)  # the pilot (round 0) leads
    # in rounds: the round pair after the budget (repeated while the strategy asks), then the step's own tables
    assert step_stages("rounds") == (Table.BUDGET, Table.ROUND, Table.ROUND_REWARDS, *STAGES[1:])
    assert set(Table) == {*STEP_ORDER, Table.HISTORY, Table.EVAL} and len(Table) == 9
    assert all(name == Table.REWARDS for name in (Table.REWARDS, "rewards"))  # a Table or its name reads a table


# ---------------------------------------------------------------------------------------------
# Step tables: round trip, manifest, done-ness


def test_round_trip_keeps_strings_and_list_columns_and_drops_the_index(run: RunStore) -> None:
    df = rollouts_frame()
    df.index = [10, 20, 30]  # a non-default index is not written
    path = run.write_table(2, Table.ROLLOUTS, df)
    assert path == run.step_dir(2) / "rollouts.parquet"
    got = run.read_table(2, "rollouts")
    assert_rollouts_equal(got, df)
    assert list(got.index) == [0, 1, 2]
    assert hidden_files(run.step_dir(2)) == []


@settings(max_examples=25, deadline=None)
@given(
    token_ids=st.lists(st.lists(st.integers(-(2**62), 2**62), max_size=6), min_size=1, max_size=8),
    text=st.text(max_size=20),
)
def test_round_trip_property(token_ids: list[list[int]], text: str) -> None:
    df = pd.DataFrame({"token_ids": token_ids, "completion": [text] * len(token_ids)})
    with tempfile.TemporaryDirectory() as tmp:
        store = RunStore(Path(tmp) / "r")
        store.create({}, "h", {})
        store.write_table(0, "rollouts", df)
        got = store.read_table(0, "rollouts")
    assert [list(x) for x in got["token_ids"]] == token_ids
    assert got["completion"].tolist() == [text] * len(token_ids)


def test_manifest_entry_fields(run: RunStore) -> None:
    path = run.write_table(5, Table.REWARDS, rollouts_frame())
    entry = run.manifest(5)["rewards"]
    assert entry["file"] == "rewards.parquet"
    assert entry["rows"] == 3
    assert entry["bytes"] == path.stat().st_size
    assert entry["schema_version"] == SCHEMA_VERSION
    assert entry["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert entry["config_hash"] == "cfg-hash-1"
    assert datetime.fromisoformat(entry["written_at"]).tzinfo is not None
    on_disk = json.loads((run.step_dir(5) / MANIFEST_FILE).read_text())
    assert on_disk == {"schema_version": SCHEMA_VERSION, "entries": {"rewards": entry}}


def test_equal_frames_give_equal_bytes(run: RunStore) -> None:
    run.write_table(0, "rollouts", rollouts_frame())
    run.write_table(1, "rollouts", rollouts_frame())
    assert run.manifest(0)["rollouts"]["sha256"] == run.manifest(1)["rollouts"]["sha256"]


def test_rewriting_a_table_updates_its_entry(run: RunStore) -> None:
    run.write_table(0, "update", pd.DataFrame({"loss": [0.5]}))
    run.write_table(0, "update", pd.DataFrame({"loss": [0.5, 0.4]}))
    assert run.manifest(0)["update"]["rows"] == 2
    assert run.read_table(0, "update")["loss"].tolist() == [0.5, 0.4]


def test_is_done_before_after_write_and_after_invalidate(run: RunStore) -> None:
    assert not run.is_done(3, Table.CAPABILITY)
    assert run.manifest(3) == {}
    run.write_table(3, Table.CAPABILITY, pd.DataFrame({"step": [3], "S": [0.5]}))
    run.write_table(3, Table.UPDATE, pd.DataFrame({"loss": [0.1]}))
    assert run.is_done(3, "capability")
    run.invalidate(3, Table.CAPABILITY)
    assert not run.is_done(3, Table.CAPABILITY)
    assert not (run.step_dir(3) / "capability.parquet").exists()
    assert set(run.manifest(3)) == {"update"}  # the other entry stays
    assert run.is_done(3, Table.UPDATE)
    run.invalidate(3, Table.CAPABILITY)  # twice is fine
    with pytest.raises(StoreError, match="not done"):
        run.read_table(3, Table.CAPABILITY)


def test_invalidate_removes_the_entry_before_the_file(run: RunStore, monkeypatch: pytest.MonkeyPatch) -> None:
    path = run.write_table(0, "rewards", rollouts_frame())

    def fail_unlink(self: Path, missing_ok: bool = False) -> None:
        raise OSError("disk went away")

    monkeypatch.setattr(Path, "unlink", fail_unlink)
    with pytest.raises(OSError, match="disk went away"):
        run.invalidate(0, "rewards")
    assert path.exists()  # the file could not be removed ...
    assert not run.is_done(0, "rewards")  # ... but the stage no longer counts as done


def test_a_file_without_its_manifest_entry_is_not_done(run: RunStore) -> None:
    run.write_table(0, "rollouts", rollouts_frame())
    (run.step_dir(0) / "rollouts.parquet").unlink()
    assert not run.is_done(0, "rollouts")  # entry without file
    with pytest.raises(StoreError, match=r"missing; run `coba resume --repair`"):
        run.read_table(0, "rollouts")


# ---------------------------------------------------------------------------------------------
# Integrity


def test_altered_bytes_fail_the_checksum_and_point_to_repair(run: RunStore) -> None:
    path = run.write_table(1, Table.ROLLOUTS, rollouts_frame())
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, different bytes
    path.write_bytes(bytes(data))
    with pytest.raises(StoreError, match="sha256") as info:
        run.read_table(1, Table.ROLLOUTS)
    message = str(info.value)
    assert str(path) in message
    assert "coba resume --repair" in message
    assert run.is_done(1, Table.ROLLOUTS)  # is_done does not hash; reading does


def test_truncated_file_is_refused_with_or_without_verification(run: RunStore) -> None:
    path = run.write_table(1, Table.REWARDS, rollouts_frame())
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(StoreError, match="truncated") as info:
        run.read_table(1, Table.REWARDS)
    assert str(path) in str(info.value) and "coba resume --repair" in str(info.value)
    with pytest.raises(StoreError, match="unreadable Parquet") as info:
        run.read_table(1, Table.REWARDS, verify=False)
    assert "coba resume --repair" in str(info.value)


def test_verify_false_skips_the_hash(run: RunStore) -> None:
    run.write_table(0, "rollouts", rollouts_frame())
    manifest_path = run.step_dir(0) / MANIFEST_FILE
    data = json.loads(manifest_path.read_text())
    data["entries"]["rollouts"]["sha256"] = "0" * 64
    manifest_path.write_text(json.dumps(data))
    with pytest.raises(StoreError, match="sha256"):
        run.read_table(0, "rollouts")
    assert_rollouts_equal(run.read_table(0, "rollouts", verify=False), rollouts_frame())


# ---------------------------------------------------------------------------------------------
# Failures during a write


def test_failed_rename_leaves_no_file_no_temp_and_no_entry(run: RunStore, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail_replace(src: object, dst: object) -> None:
        raise OSError("no space left on device")

    monkeypatch.setattr(store_module.os, "replace", fail_replace)
    with pytest.raises(OSError, match="no space left"):
        run.write_table(4, Table.ROLLOUTS, rollouts_frame())
    monkeypatch.undo()
    step_dir = run.step_dir(4)
    assert not (step_dir / "rollouts.parquet").exists()
    assert hidden_files(step_dir) == []
    assert not run.is_done(4, Table.ROLLOUTS)
    assert run.manifest(4) == {}


def test_writer_failing_midway_leaves_nothing_visible(run: RunStore, monkeypatch: pytest.MonkeyPatch) -> None:
    def half_write(table: object, f: object, **kwargs: object) -> None:
        f.write(b"PAR1 half a file")  # type: ignore[attr-defined]
        raise RuntimeError("killed mid-write")

    monkeypatch.setattr(store_module.pq, "write_table", half_write)
    with pytest.raises(RuntimeError, match="killed mid-write"):
        run.write_table(4, Table.REWARDS, rollouts_frame())
    step_dir = run.step_dir(4)
    assert sorted(p.name for p in step_dir.iterdir()) == []
    assert not run.is_done(4, Table.REWARDS)


def test_crash_between_rename_and_manifest_leaves_the_stage_not_done(
    run: RunStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    def crash(directory: Path, entries: object) -> None:
        raise KeyboardInterrupt  # the process dies before the manifest entry is written

    monkeypatch.setattr(store_module, "_write_manifest", crash)
    with pytest.raises(KeyboardInterrupt):
        run.write_table(6, Table.UPDATE, pd.DataFrame({"loss": [0.3]}))
    monkeypatch.undo()
    assert (run.step_dir(6) / "update.parquet").exists()  # complete (renamed) but unrecorded
    assert not run.is_done(6, Table.UPDATE)
    assert run.steps_done([Table.UPDATE]) == []


def test_failed_rewrite_of_a_done_table_leaves_it_not_done(run: RunStore, monkeypatch: pytest.MonkeyPatch) -> None:
    run.write_table(0, "budget", pd.DataFrame({"prompt_id": ["a"], "budget": [4]}))

    def fail_replace(src: Path, dst: Path) -> None:
        if Path(dst).suffix == ".parquet":
            raise OSError("preempted")
        os.rename(src, dst)

    monkeypatch.setattr(store_module.os, "replace", fail_replace)
    with pytest.raises(OSError, match="preempted"):
        run.write_table(0, "budget", pd.DataFrame({"prompt_id": ["a"], "budget": [8]}))
    monkeypatch.undo()
    # the old entry was removed before the new bytes were written: no entry describes other bytes
    assert not run.is_done(0, "budget")
    assert hidden_files(run.step_dir(0)) == []


# ---------------------------------------------------------------------------------------------
# Steps done


def test_steps_done_checks_every_named_table_in_each_step_directory(run: RunStore) -> None:
    one_row = pd.DataFrame({"x": [1]})
    for step in (0, 1):
        for stage in STAGES:
            run.write_table(step, stage, one_row)
    run.write_table(2, Table.BUDGET, one_row)
    run.write_table(2, Table.ROLLOUTS, one_row)  # step 2 stopped after its rollouts
    (run.root / "steps" / "notes").mkdir()  # not a step directory: ignored
    assert run.steps() == [0, 1, 2]
    assert run.steps_done() == [0, 1]
    assert run.steps_done() == [0, 1]
    assert run.steps_done([Table.ROLLOUTS, Table.BUDGET]) == [0, 1, 2]
    assert run.steps_done(["update"]) == [0, 1]
    assert run.steps_done([]) == [0, 1, 2]
    run.invalidate(1, Table.REWARDS)
    assert run.steps_done() == [0]


def test_steps_done_of_a_fresh_run_is_empty(run: RunStore) -> None:
    assert run.steps() == []
    assert run.steps_done() == []


# ---------------------------------------------------------------------------------------------
# Run-level tables and JSON


def test_run_tables_round_trip_and_are_tracked_in_the_root_manifest(run: RunStore) -> None:
    prompts = pd.DataFrame({"prompt_id": ["a", "b"], "prompt_text": ["1+1=", "2+2="], "difficulty": [0, 1]})
    history = pd.DataFrame({"prompt_id": ["a", "b"], "pass_rates": [[0.5, 0.25], []]})
    assert not run.has_run_table("prompts")
    path = run.write_run_table("prompts", prompts)
    run.write_run_table("history", history)
    assert path == run.root / "prompts.parquet"
    pd.testing.assert_frame_equal(run.read_run_table("prompts"), prompts, check_dtype=False)
    assert [list(x) for x in run.read_run_table("history")["pass_rates"]] == [[0.5, 0.25], []]
    entries = json.loads((run.root / MANIFEST_FILE).read_text())["entries"]
    assert set(entries) == {"prompts", "history"}
    assert entries["prompts"]["rows"] == 2
    assert entries["prompts"]["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert entries["history"]["config_hash"] == "cfg-hash-1"
    assert run.has_run_table("history")


def test_run_table_checksum_is_verified(run: RunStore) -> None:
    path = run.write_run_table("history", pd.DataFrame({"prompt_id": ["a"], "pass_rate": [0.5]}))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(StoreError, match=r"history\.parquet.*coba resume --repair"):
        run.read_run_table("history")


def test_json_round_trip_creates_folders_and_leaves_no_temp(run: RunStore) -> None:
    summary = {"steps": 3, "reward/mean": 0.42, "strategies": ["coba"], "name": "ünïcode"}
    assert run.write_json("summary.json", summary) == run.root / "summary.json"
    assert run.read_json("summary.json") == summary
    meta_path = run.write_json("checkpoints/000002/meta.json", {"step": 2})
    assert meta_path == run.checkpoint_dir(2) / "meta.json"
    assert run.read_json("checkpoints/000002/meta.json") == {"step": 2}
    run.write_json("summary.json", {"steps": 4})  # overwrite in place
    assert run.read_json("summary.json") == {"steps": 4}
    assert hidden_files(run.root) == [] and hidden_files(run.checkpoint_dir(2)) == []


def test_json_needs_a_json_suffix_and_missing_files_raise(run: RunStore) -> None:
    with pytest.raises(StoreError, match=r"\.json"):
        run.write_json("summary.txt", {})
    with pytest.raises(FileNotFoundError):
        run.read_json("summary.json")


def _fake_checkpoint(path: Path) -> None:
    """A directory with a checkpoint's manifest (what ``RunStore.checkpoints`` looks for), nothing verified."""
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(b"x")
    (path / "checkpoint.json").write_text("{}")


def test_prune_checkpoints_keeps_the_newest(run: RunStore) -> None:
    for step in (1, 2, 3, 10):
        _fake_checkpoint(run.checkpoint_dir(step))
    assert run.prune_checkpoints(0, upto=10) == []  # 0 keeps every checkpoint
    gone = run.prune_checkpoints(2, upto=10)
    assert gone == [run.checkpoint_dir(1), run.checkpoint_dir(2)]
    assert sorted(p.name for p in (run.root / "checkpoints").iterdir()) == ["000003", "000010"]
    assert run.prune_checkpoints(5, upto=10) == []


def test_pruning_keeps_real_checkpoints_whatever_else_is_under_checkpoints(run: RunStore) -> None:
    """A stray ``checkpoints/7``, a table another program wrote as ``checkpoints/999999/x.parquet`` and a
    directory named as a step without a checkpoint's manifest are not checkpoints: a prune keeping 2 keeps the two
    newest real ones at or below the run's version and deletes neither the strays nor anything above that version
    (before, the strays took the two places and every real checkpoint was deleted)."""
    for step in (2, 4, 6):
        _fake_checkpoint(run.checkpoint_dir(step))
    stray = run.root / "checkpoints" / "7"
    stray.mkdir()
    (stray / "notes.txt").write_text("mine")
    (run.checkpoint_dir(999999)).mkdir()
    (run.checkpoint_dir(999999) / "x.parquet").write_bytes(b"PAR1")
    run.checkpoint_dir(5).mkdir()  # a step's name, no checkpoint.json
    _fake_checkpoint(run.checkpoint_dir(8))  # above the run's version: not the run's (yet), never deleted here
    assert run.checkpoints() == [2, 4, 6, 8]
    assert run.prune_checkpoints(2, upto=6) == [run.checkpoint_dir(2)]
    left = sorted(p.name for p in (run.root / "checkpoints").iterdir())
    assert left == ["000004", "000005", "000006", "000008", "7", "999999"]
    assert (stray / "notes.txt").read_text() == "mine"


def test_prune_checkpoints_refuses_a_checkpoints_link_out_of_the_run(run: RunStore, tmp_path: Path) -> None:
    """checkpoints/ a symlink to another disk: nothing is deleted there; the message names the link and the fix
    (the rule of `coba rerun` and `coba inspect --sql`: resolved, inside the run)."""
    elsewhere = tmp_path / "big-disk" / "ckpts"
    for step in (1, 2, 3):
        _fake_checkpoint(elsewhere / f"{step:06d}")
    (run.root / "checkpoints").symlink_to(elsewhere)
    with pytest.raises(StoreError, match=r"outside the run directory .*replace the link by the real") as info:
        run.prune_checkpoints(1, upto=3)
    assert "\n" not in str(info.value) and "checkpoints" in str(info.value)
    assert sorted(p.name for p in elsewhere.iterdir()) == ["000001", "000002", "000003"]
