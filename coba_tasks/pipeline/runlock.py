"""One writer per run directory: a lock file holding the owner's pid and host.

``coba run`` / ``coba resume`` (the training flow) take ``<run>/.lock`` before writing and drop it
at the end. A second run on the same directory is refused with the holder's pid; a lock whose
process is gone (on this host) is stale and taken over, so a SIGKILLed run can be resumed.

    with RunLock(run_dir):
        ...  # write the run
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

LOCK_FILE = ".lock"


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
        """Take the lock; RunLockedError if a live process on this host holds it."""
        me = {"pid": os.getpid(), "host": socket.gethostname()}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                other = self.holder()
                if other is None:  # half-written by a process that died at that moment: stale
                    self.path.unlink(missing_ok=True)
                    continue
                same_host = other.get("host") == me["host"]
                if other.get("pid") == me["pid"] and same_host:
                    self.held = True  # re-entrant within one process
                    return
                if same_host and not _alive(int(other.get("pid", -1))):
                    self.path.unlink(missing_ok=True)  # the holder is dead: take the lock over
                    continue
                raise RunLockedError(self._message(other)) from None
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            self.held = True
            return
        raise RunLockedError(f"{self.path.parent}: could not take the lock {self.path}")

    def release(self) -> None:
        """Drop the lock if this process holds it."""
        if self.held:
            other = self.holder()
            if other is not None and other.get("pid") == os.getpid():
                self.path.unlink(missing_ok=True)
            self.held = False

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
