"""Atomic file writes (a reader never sees a half-written file), and the output directories a command builds.

A file is written to a temporary (``.<name>.<hex>.tmp``) beside its destination, fsynced, renamed into place,
and the directory fsynced; on any failure the temporary is removed and the destination untouched. Only a
killed process leaves a temporary behind: readers never look at those (``remove_stale_temporaries``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:
    import pandas as pd
    import pyarrow as pa

_TMP_HEX = 8  # hex digits of the random part of a temporary's name


def _temporary_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{secrets.token_hex(_TMP_HEX // 2)}.tmp")


def atomic_write(path: str | os.PathLike[str], write: Callable[[IO[bytes]], object]) -> Path:
    """Call ``write`` on a temporary file beside ``path``, fsync it, rename it into place, fsync the directory.
    On failure ``path`` is left as it was and the exception propagates with a note naming ``path``."""
    path = Path(path)
    tmp = _temporary_name(path)
    try:
        with open(tmp, "xb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):  # e.g. the directory turned read-only: keep the original error
            tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            exc.add_note(f"while writing {path} (atomically: it was left as it was before this write)")
        raise
    fsync_dir(path.parent)
    return path


def write_parquet(data: pd.DataFrame | pa.Table, path: str | os.PathLike[str]) -> Path:
    """Write a pandas DataFrame (without its index) or a pyarrow Table as zstd Parquet, atomically: the one
    Parquet writer of the package. Schema metadata is dropped, so equal tables give equal bytes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = data if isinstance(data, pa.Table) else pa.Table.from_pandas(data, preserve_index=False)
    table = table.replace_schema_metadata(None)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write(path, lambda f: pq.write_table(table, f, compression="zstd"))


def remove_stale_temporaries(path: str | os.PathLike[str]) -> list[Path]:
    """Remove (and return) the temporaries that killed writers of ``path`` left beside it; only for the one
    writer of ``path`` (a run directory under its run lock): a concurrent writer's would go too."""
    path = Path(path)
    pattern = re.compile(rf"\.{re.escape(path.name)}\.[0-9a-f]{{{_TMP_HEX}}}\.tmp")
    removed: list[Path] = []
    try:
        names = os.listdir(path.parent)
    except OSError:
        return removed
    for name in names:
        if pattern.fullmatch(name):
            try:
                (path.parent / name).unlink(missing_ok=True)
            except OSError:
                continue
            removed.append(path.parent / name)
    return removed


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Make a rename in ``directory`` durable (POSIX); a no-op where directories cannot be opened."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------
# Output directories that a command builds (a bootstrapped or converted model): built in a temporary
# sibling, renamed into place, and never replacing a directory that holds files the command did not write.


class OutputDirError(ValueError):
    """An output directory that cannot be used as it is; the message says what is there and what to do."""


def fresh_marked_dir(out: str | os.PathLike[str], marker: str, maker: str) -> Path:
    """``out`` made empty for a new output of the script ``maker``: created when missing, replaced when an
    earlier run made it (the file ``marker`` inside, which this writes again). ``OutputDirError`` when it holds
    anything else: nothing of it is removed."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        if not (out / marker).is_file():
            raise OutputDirError(f"{out} exists and is not an earlier {maker} output: pass another --out")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / marker).write_text(f"made by {maker}; removed by its next run with the same --out\n")
    return out


def files_of(folder: str | os.PathLike[str]) -> dict[str, int]:
    """Every regular file under ``folder`` as its '/'-separated relative path -> size in bytes, sorted."""
    root = Path(folder)
    return {p.relative_to(root).as_posix(): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}


def read_json_record(path: str | os.PathLike[str]) -> dict | None:
    """The JSON object in ``path``, or None when it is missing, unreadable or not an object."""
    try:
        record = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def written_files(out: Path, record_file: str, default_files: Iterable[str] = ()) -> set[str] | None:
    """The files the builder wrote into ``out`` by its record ``out/record_file`` (``default_files`` for a record
    that does not list them), the record included; None without a record. ``OutputDirError`` when the record
    lists a name outside ``out``: ``--force`` removes what the record lists, so such a record is never trusted."""
    record = read_json_record(out / record_file)
    if record is None:
        return None
    listed = record.get("files")
    names = set(listed) if isinstance(listed, dict) and listed else set(default_files)
    root = out.resolve()
    for name in sorted(names):
        if not _names_a_file_inside(root, name):  # removing it could remove somebody's file elsewhere
            raise OutputDirError(
                f"{out / record_file} lists {name!r}, not a file inside {out}; nothing was removed, --force "
                "included: this is not a directory the builder wrote, choose another output directory"
            )
    return names | {record_file}


def _names_a_file_inside(root: Path, name: str) -> bool:
    """Whether the record entry ``name`` is a relative path without ``..`` that stays inside the resolved
    directory ``root`` once every symlink on its way (itself included) is followed."""
    path = Path(name)
    if not path.parts or path.is_absolute() or ".." in path.parts:
        return False
    target = (root / path).resolve()
    return target != root and target.is_relative_to(root)


def check_output_dir(
    out: str | os.PathLike[str], record_file: str, what: str, default_files: Iterable[str] = ()
) -> bool:
    """Whether ``out`` holds a previous build (True) or nothing (False: missing or empty). ``OutputDirError``
    when ``out`` is a file or holds anything its record does not list: never replaced, ``--force`` or not."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise OutputDirError(f"{out} exists and is not a directory; choose another output directory")
    if not out.is_dir() or not any(out.iterdir()):
        return False
    ours = written_files(out, record_file, default_files)
    if ours is None:
        raise OutputDirError(
            f"{out} is not empty and holds no {record_file} (it is not a {what}); nothing was removed: "
            "choose another output directory, or empty this one yourself"
        )
    foreign = sorted(set(files_of(out)) - ours)
    if foreign:
        listed = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise OutputDirError(
            f"{out} holds files that no {what} build wrote ({listed}); nothing was removed, --force included: "
            "move them elsewhere or choose another output directory"
        )
    return True


def new_temporary_dir(out: str | os.PathLike[str]) -> Path:
    """A new empty directory ``.<name>.<hex>.tmp`` beside ``out`` (created here, so nobody else's)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temporary_name(out)
    tmp.mkdir()
    return tmp


def publish_dir(tmp: Path, out: Path, record_file: str, default_files: Iterable[str] = ()) -> list[str]:
    """Rename the finished directory ``tmp`` to ``out``; a previous build at ``out`` is moved aside first,
    then only the files its record lists are removed. Returns what was left of it (files written there
    since the check): kept, in the ``.<name>.<hex>.old`` directory beside ``out``; [] normally."""
    old = out.with_name(f".{out.name}.{secrets.token_hex(_TMP_HEX // 2)}.old")
    previous = out.is_dir()
    if previous:
        ours = written_files(out, record_file, default_files) or set()
        out.rename(old)
    elif out.exists():
        raise OutputDirError(f"{out} exists and is not a directory; choose another output directory")
    try:
        tmp.rename(out)
    except BaseException:
        if previous:
            old.rename(out)
        raise
    fsync_dir(out.parent)
    if not previous:
        return []
    for name in ours:
        with contextlib.suppress(OSError):
            (old / name).unlink()
    for folder in sorted((p for p in old.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        with contextlib.suppress(OSError):
            folder.rmdir()  # only empty ones
    left = sorted(files_of(old))
    if not left:
        old.rmdir()
    return [f"{old}/{name}" for name in left]


def content_sha256(path: str | os.PathLike[str]) -> str:
    """The sha256 of a file's bytes; of a directory, the sha256 of one line ``path<TAB>bytes<TAB>sha256``
    per file under it (sorted, hidden files and folders left out): what identifies a dataset or a model."""
    path = Path(path)
    if path.is_file():
        return sha256_file(path)
    digest = hashlib.sha256()
    for name, size in files_of(path).items():
        if any(part.startswith(".") for part in Path(name).parts):
            continue
        digest.update(f"{name}\t{size}\t{sha256_file(path / name)}\n".encode())
    return digest.hexdigest()


def sha256_file(path: str | os.PathLike[str]) -> str:
    """The sha256 of a file's bytes, hex."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()
