"""Output directories built by a command (coba_tasks/engines/fileio.py): refused, replaced, never emptied."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from coba_tasks.engines.fileio import OutputDirError, check_output_dir, files_of, new_temporary_dir, publish_dir

RECORD = "built.json"


def _build(folder: Path, payload: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "weights.bin").write_text(payload)
    (folder / "sub").mkdir(exist_ok=True)
    (folder / "sub" / "part.txt").write_text(payload)
    (folder / RECORD).write_text(json.dumps({"files": files_of(folder)}))
    return folder


def test_missing_and_empty_directories_are_free(tmp_path: Path) -> None:
    assert check_output_dir(tmp_path / "absent", RECORD, "build") is False
    (tmp_path / "empty").mkdir()
    assert check_output_dir(tmp_path / "empty", RECORD, "build") is False


def test_a_file_or_a_directory_of_someone_else_is_refused(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(OutputDirError, match="is not a directory"):
        check_output_dir(tmp_path / "f", RECORD, "build")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "mine.txt").write_text("x")
    with pytest.raises(OutputDirError, match=r"holds no built\.json \(it is not a build\); nothing was removed"):
        check_output_dir(tmp_path / "d", RECORD, "build")


def test_files_the_record_does_not_list_are_named(tmp_path: Path) -> None:
    out = _build(tmp_path / "out", "a")
    assert check_output_dir(out, RECORD, "build") is True
    (out / "sub" / "notes.md").write_text("mine")
    with pytest.raises(OutputDirError, match=r"holds files that no build build wrote \(sub/notes\.md\)"):
        check_output_dir(out, RECORD, "build")


def test_a_record_without_a_file_list_allows_only_the_default_names(tmp_path: Path) -> None:
    out = tmp_path / "old"
    out.mkdir()
    (out / RECORD).write_text("{}")
    (out / "weights.bin").write_text("a")
    assert check_output_dir(out, RECORD, "build", default_files=("weights.bin",)) is True
    with pytest.raises(OutputDirError, match=r"\(weights\.bin\)"):
        check_output_dir(out, RECORD, "build")


def test_publish_replaces_only_what_the_record_lists(tmp_path: Path) -> None:
    out = _build(tmp_path / "out", "old")
    (out / "late.txt").write_text("written after the check")  # e.g. by the user while the build ran
    tmp = _build(new_temporary_dir(out), "new")
    kept = publish_dir(tmp, out, RECORD)
    assert (out / "weights.bin").read_text() == "new" and not (out / "late.txt").exists()
    assert len(kept) == 1 and kept[0].endswith("/late.txt") and Path(kept[0]).read_text() == "written after the check"
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".old")) == ["out"]


def test_publish_into_nothing_and_a_clean_replace_leave_no_temporary(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert publish_dir(_build(new_temporary_dir(out), "a"), out, RECORD) == []
    assert publish_dir(_build(new_temporary_dir(out), "b"), out, RECORD) == []
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and (out / "weights.bin").read_text() == "b"


def test_write_parquet_takes_frames_and_tables_and_gives_equal_bytes_for_equal_tables(tmp_path: Path) -> None:
    import pandas as pd
    import pyarrow as pa

    from coba_tasks.engines.fileio import write_parquet

    df = pd.DataFrame({"a": [1, 2, 3], "b": ["x", "y", "z"]}, index=[7, 8, 9])
    from_frame = write_parquet(df, tmp_path / "deep" / "frame.parquet")  # the parent is created
    from_table = write_parquet(pa.Table.from_pandas(df, preserve_index=False), tmp_path / "table.parquet")
    assert from_frame.read_bytes() == from_table.read_bytes()  # no pandas metadata, no index
    pd.testing.assert_frame_equal(pd.read_parquet(from_frame), df.reset_index(drop=True))


def test_write_parquet_leaves_the_old_file_when_the_table_cannot_be_written(tmp_path: Path) -> None:
    import pandas as pd

    from coba_tasks.engines.fileio import write_parquet

    path = write_parquet(pd.DataFrame({"a": [1]}), tmp_path / "t.parquet")
    before = path.read_bytes()
    with pytest.raises(Exception):  # noqa: B017 (pyarrow's error type for a mixed column varies)
        write_parquet(pd.DataFrame({"a": [1, "two", 3.0 + 1j]}), path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["t.parquet"]


def _record_listing(out: Path, *names: str) -> Path:
    """A build at ``out`` whose record also lists ``names`` (a record written by hand, or tampered with)."""
    _build(out, "old")
    listed = {**files_of(out), **dict.fromkeys(names, 1)}
    (out / RECORD).write_text(json.dumps({"files": listed}))
    return out


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "symlinked_file", "symlinked_folder"])
def test_a_record_naming_a_file_outside_makes_the_directory_foreign(tmp_path: Path, kind: str) -> None:
    """A record listing a name outside its directory (``..``, absolute, or through a symlink) is refused by the
    check and by the publish, --force or not: nothing is removed, the victim outside least of all."""
    victim = tmp_path / "thesis.tex"
    victim.write_text("years of work")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "thesis.tex").write_text("years of work")
    out = tmp_path / "out"
    if kind == "dotdot":
        _record_listing(out, "../thesis.tex")
    elif kind == "absolute":
        _record_listing(out, str(victim))
    elif kind == "symlinked_file":
        _record_listing(out, "link.tex")
        (out / "link.tex").symlink_to(victim)
    else:
        _record_listing(out, "sub/docs/thesis.tex")
        (out / "sub" / "docs").symlink_to(tmp_path / "docs")
    before = {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()}
    with pytest.raises(OutputDirError, match=r"lists '.*', not a file inside .*out; nothing was removed") as caught:
        check_output_dir(out, RECORD, "build")
    assert "\n" not in str(caught.value)
    tmp = _build(new_temporary_dir(out), "new")
    with pytest.raises(OutputDirError, match=r"not a file inside .*nothing was removed"):
        publish_dir(tmp, out, RECORD)
    assert {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file() and tmp not in p.parents} == before
    assert (out / "weights.bin").read_text() == "old"


def test_a_symlink_that_stays_inside_is_the_builders(tmp_path: Path) -> None:
    out = _record_listing(tmp_path / "out", "alias.bin")
    (out / "alias.bin").symlink_to("weights.bin")  # relative, inside the directory
    assert check_output_dir(out, RECORD, "build") is True
    assert publish_dir(_build(new_temporary_dir(out), "new"), out, RECORD) == []
    assert (out / "weights.bin").read_text() == "new"


def test_a_marked_output_dir_is_replaced_and_any_other_refused(tmp_path):
    from coba_tasks.engines.fileio import fresh_marked_dir

    out = fresh_marked_dir(tmp_path / "out", ".made", "scripts/x.py")  # created
    (out / "figures.json").write_text("{}")
    assert fresh_marked_dir(out, ".made", "scripts/x.py") == out  # an earlier run's: replaced
    assert sorted(p.name for p in out.iterdir()) == [".made"]
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    with pytest.raises(OutputDirError, match=r"theirs exists and is not an earlier scripts/x\.py output"):
        fresh_marked_dir(theirs, ".made", "scripts/x.py")
    assert (theirs / "notes.txt").read_text() == "mine"
