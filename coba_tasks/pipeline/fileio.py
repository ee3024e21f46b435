"""Atomic file writes: a reader never sees a half-written file.

Every file of a run (Parquet tables, manifests, JSON, YAML) is written to a temporary name beside
its destination, fsynced, renamed into place, and the directory fsynced; on any failure (a full
disk, a read-only directory, an exception in ``write``) the temporary file is removed, the
destination is untouched and the error is raised with a note naming the destination. Only a killed
process leaves a temporary (``.<name>.<hex>.tmp``) behind: readers never look at those, and
``remove_stale_temporaries`` clears them where the caller is the only writer.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import IO

_TMP_HEX = 8  # hex digits of the random part of a temporary's name


def _temporary_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{secrets.token_hex(_TMP_HEX // 2)}.tmp")


def atomic_write(path: str | os.PathLike[str], write: Callable[[IO[bytes]], object]) -> Path:
    """Call ``write`` on a temporary file beside ``path``, fsync it, rename it into place, fsync the directory.

    On failure the temporary is removed, ``path`` keeps its old content (or stays absent), and the
    exception propagates unchanged apart from a note (``add_note``) naming ``path``.
    """
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


def remove_stale_temporaries(path: str | os.PathLike[str]) -> list[Path]:
    """Remove the temporaries (``.<name>.<hex>.tmp``) that killed writers of ``path`` left beside it.

    Only for a caller that is the one writer of ``path`` (a run directory under its run lock): a
    concurrent writer's temporary would be removed under it. Returns the removed paths.
    """
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
