"""One writer per run directory: an exclusive ``flock`` on ``<run>/.lock``, held for the whole run.

``coba run`` / ``coba resume`` / ``coba rerun`` (the training flow) take the lock before writing and drop
it at the end. The kernel holds the lock for the process and drops it when the process ends, however it
ends (SIGKILL included): a second writer is refused while the first lives, and a crashed run can be
resumed at once. No pid is compared, so two processes with one hostname in different PID namespaces
(containers with host networking) cannot both take it, and a lock file left behind names nobody.

The file also holds the holder's pid and host (JSON), read only to say who holds the run. A lock file
written on another host is refused whatever its flock says (a network filesystem may not show another
host's locks); the message says to remove it if that process is gone.

    with RunLock(run_dir):
        ...  # write the run
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

LOCK_FILE = ".lock"
_PATIENCE_S = 0.5  # how long a refused flock is retried: another process's check_free holds it for a moment
_HELD: dict[str, int] = {}  # the lock files this process holds (real path) -> the descriptor holding the flock


class RunLockedError(ValueError):
    """Another live process holds the run directory."""


def _same_file(fd: int, path: Path) -> bool:
    """Whether the open ``fd`` is still the file at ``path`` (a released lock file is unlinked and recreated)."""
    try:
        here, there = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


class RunLock:
    """Exclusive lock on a run directory: a ``flock`` on its lock file, held until ``release`` or the process ends.

    Re-entrant within one process: a second ``RunLock`` on a directory this process holds is held at once,
    and only the one that took the flock drops it."""

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.path = Path(run_dir) / LOCK_FILE
        self.held = False
        self._fd: int | None = None  # set in the RunLock that took the flock

    def _key(self) -> str:
        return os.path.realpath(self.path)

    def holder(self) -> dict | None:
        """The lock file's contents (pid, host), or None when there is no (readable) lock file."""
        try:
            other = json.loads(self.path.read_text())
        except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
            return None
        return other if isinstance(other, dict) else None

    def _message(self, other: dict | None) -> str:
        who = "another process" if other is None else f"process {other.get('pid')} on {other.get('host')}"
        fix = "wait for it to finish, or stop it: the lock is free when it ends"
        if other is not None and other.get("host") != socket.gethostname():
            fix = "wait for it to finish, or remove the lock file if that process is gone (another host's lock)"
        return f"{self.path.parent} is in use by {who} (lock file {self.path}); {fix}"

    def _refuse_other_host(self) -> None:
        """RunLockedError when the lock file names another host: its flock may be invisible from here."""
        other = self.holder()
        if other is not None and other.get("host") != socket.gethostname():
            raise RunLockedError(self._message(other))

    def check_free(self) -> None:
        """RunLockedError if another process holds the lock (nothing is taken, no file is created)."""
        if self.held or self._key() in _HELD:
            return
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                raise RunLockedError(self._message(self.holder())) from None
            self._refuse_other_host()
        finally:
            os.close(fd)  # drops the probe's shared flock

    def acquire(self) -> None:
        """Take the lock; RunLockedError (one line naming the holder) if another process holds it.

        The flock is taken without waiting (retried for a moment only, as another process's ``check_free``
        holds it that long); a lock file unlinked by its releasing holder between our open and our flock is
        opened again, so two processes never hold two different files. The pid and host are written in place
        (the flock belongs to this file: it is never replaced by a rename).
        """
        key = self._key()
        if self.held or key in _HELD:
            self.held = True  # re-entrant within one process
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + _PATIENCE_S
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                if time.monotonic() < deadline:
                    time.sleep(0.02)
                    continue
                raise RunLockedError(self._message(self.holder())) from None
            if _same_file(fd, self.path):
                break
            os.close(fd)  # its holder released (unlinked) it meanwhile: take the new file
        try:
            self._refuse_other_host()
            me = json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, me, 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        _HELD[key], self._fd, self.held = fd, fd, True

    def release(self) -> None:
        """Drop the lock if this RunLock took it: the file is unlinked while still locked, then closed."""
        self.held = False
        fd, self._fd = self._fd, None
        if fd is None:
            return
        _HELD.pop(self._key(), None)
        try:
            if _same_file(fd, self.path):
                self.path.unlink(missing_ok=True)
        finally:
            os.close(fd)  # closing the descriptor drops the flock

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
