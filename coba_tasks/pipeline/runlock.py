"""One writer per run directory: a lock file holding the owner's pid and host.

``coba run`` / ``coba resume`` (the training flow) take ``<run>/.lock`` before writing and drop it
at the end. A second run on the same directory is refused with the holder's pid; a lock whose
process is gone (on this host) is stale and taken over, so a SIGKILLed run can be resumed.

    with RunLock(run_dir):
        ...  # write the run
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path

LOCK_FILE = ".lock"


@contextlib.contextmanager
def _directory_locked(directory: Path) -> Iterator[None]:
    """An exclusive flock on ``directory`` for the ``with`` block (released when the block ends or the process dies)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor drops the flock


class RunLockedError(ValueError):
    """Another live process holds the run directory."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


class RunLock:
    """Exclusive lock on a run directory (created with O_EXCL; stale locks of dead processes taken over)."""

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.path = Path(run_dir) / LOCK_FILE
        self.held = False

    def holder(self) -> dict | None:
        """The lock file's contents, or None when there is no (readable) lock."""
        try:
            return json.loads(self.path.read_text())
        except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
            return None

    def check_free(self) -> None:
        """RunLockedError if a live process on this host holds the lock (nothing is taken)."""
        other = self.holder()
        if other is None or other.get("pid") == os.getpid():
            return
        if other.get("host") != socket.gethostname() or _alive(int(other.get("pid", -1))):
            raise RunLockedError(self._message(other))

    def _message(self, other: dict) -> str:
        return (
            f"{self.path.parent} is in use by process {other.get('pid')} on {other.get('host')} "
            f"(lock file {self.path}); wait for it to finish, or remove the lock file if that process is gone"
        )

    def acquire(self) -> None:
        """Take the lock; RunLockedError if a live process on this host holds it.

        Check and take happen under an exclusive ``flock`` on the run directory, so two processes
        starting on one directory at the same moment (two workers given the same run name) cannot
        both see it free or both take over a stale lock; the lock file is written whole (a temporary
        file renamed into place), so a reader never sees it half-written.
        """
        me = {"pid": os.getpid(), "host": socket.gethostname()}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with _directory_locked(self.path.parent):
            other = self.holder()  # None: no lock, or an unreadable one (a crash mid-write before this scheme)
            if other is not None:
                same_host = other.get("host") == me["host"]
                if other.get("pid") == me["pid"] and same_host:
                    self.held = True  # re-entrant within one process
                    return
                if not same_host or _alive(int(other.get("pid", -1))):
                    raise RunLockedError(self._message(other))
                # the holder is dead: take the lock over
            tmp = self.path.with_name(f"{LOCK_FILE}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(me))
            os.replace(tmp, self.path)
            self.held = True

    def release(self) -> None:
        """Drop the lock if this process holds it."""
        if self.held:
            with _directory_locked(self.path.parent):
                other = self.holder()
                if other is not None and other.get("pid") == os.getpid():
                    self.path.unlink(missing_ok=True)
            self.held = False

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
