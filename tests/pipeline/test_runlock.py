"""One writer per run directory: the lock file, its holder, stale locks, and the CLI's refusal."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from coba_tasks.commands.cli import main as cli_main
from coba_tasks.pipeline.runlock import LOCK_FILE, RunLock, RunLockedError
from coba_tasks.pipeline.store import RunStore


def _write_lock(run_dir, pid, host=None):
    (run_dir / LOCK_FILE).write_text(json.dumps({"pid": pid, "host": host or socket.gethostname()}))


HOLDER = """
import fcntl, json, os, socket, sys, time
path, named = sys.argv[1], int(sys.argv[2]) or os.getpid()
fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)  # what a run holds for its whole length
os.write(fd, json.dumps({"pid": named, "host": socket.gethostname()}).encode())
print("holding", flush=True)
time.sleep(120)
"""


@pytest.fixture
def hold_lock():
    """Start a process that holds the flock of ``run_dir``'s lock file, its JSON naming ``named`` (0: itself)."""
    procs = []

    def start(run_dir, named=0):
        proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(run_dir / LOCK_FILE), str(named)], stdout=subprocess.PIPE
        )
        procs.append(proc)
        assert proc.stdout.readline() == b"holding\n"
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def _dead_pid():
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True).stdout)


def test_acquire_release_and_reentry(tmp_path):
    lock = RunLock(tmp_path)
    with lock:
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
        RunLock(tmp_path).acquire()  # the same process may take it again
        RunLock(tmp_path).check_free()
    assert not (tmp_path / LOCK_FILE).exists()


def test_live_holder_refuses(tmp_path, hold_lock):
    holder = hold_lock(tmp_path)
    with pytest.raises(RunLockedError, match=f"in use by process {holder.pid}") as info:
        RunLock(tmp_path).acquire()
    assert "\n" not in str(info.value) and "the lock is free when it ends" in str(info.value)
    with pytest.raises(RunLockedError, match=f"in use by process {holder.pid}"):
        RunLock(tmp_path).check_free()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == holder.pid  # left alone


@pytest.mark.parametrize("named", ["init", "parent"])
def test_a_lock_file_whose_flock_nobody_holds_is_free_whatever_pid_it_names(tmp_path, named):
    """A run in another PID namespace on this host (a container with host networking) left a lock naming a pid
    that is alive here (pid 1, the test's parent): nobody holds its flock, so the run directory is free."""
    _write_lock(tmp_path, 1 if named == "init" else os.getppid())
    RunLock(tmp_path).check_free()
    with RunLock(tmp_path):
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()


def test_a_held_flock_refuses_whatever_pid_its_file_names(tmp_path, hold_lock):
    """A writer in another PID namespace holds the flock and its lock names a pid that is dead here: refused;
    once that writer is gone (killed: the kernel drops its flock), the lock is taken."""
    dead = _dead_pid()
    holder = hold_lock(tmp_path, named=dead)
    for attempt in (RunLock(tmp_path).acquire, RunLock(tmp_path).check_free):
        with pytest.raises(RunLockedError, match=f"in use by process {dead} on {socket.gethostname()}"):
            attempt()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == dead  # left alone
    holder.kill()
    holder.wait()
    with RunLock(tmp_path):
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()


def test_stale_and_garbage_locks_are_taken_over(tmp_path):
    _write_lock(tmp_path, _dead_pid())
    RunLock(tmp_path).check_free()
    with RunLock(tmp_path):
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    (tmp_path / LOCK_FILE).write_text("{half")  # a holder that died while writing it
    with RunLock(tmp_path):
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()


def test_other_host_lock_is_never_taken_over(tmp_path):
    _write_lock(tmp_path, 1, host="some-other-host")
    with pytest.raises(RunLockedError, match="on some-other-host"):
        RunLock(tmp_path).acquire()


def test_resume_and_rerun_refuse_a_run_in_use(tmp_path, hold_lock, capsys):
    store = RunStore(tmp_path / "run")
    store.create({"run": {"steps": 1}}, "h", {})
    holder = hold_lock(store.root)
    assert cli_main(["resume", "--run-dir", str(store.root)]) == 2
    assert f"in use by process {holder.pid}" in capsys.readouterr().err
    assert cli_main(["rerun", "--run-dir", str(store.root), "--step", "0", "--stage", "rewards", "--yes"]) == 2
    assert "in use by process" in capsys.readouterr().err


RACER = """
import os, sys, time
from coba_tasks.pipeline.runlock import RunLock, RunLockedError
run_dir, start, hold = sys.argv[1], float(sys.argv[2]), sys.argv[3]
while time.time() < start:
    pass
try:
    RunLock(run_dir).acquire()
except RunLockedError:
    print("refused", flush=True)
    sys.exit(0)
print("took", flush=True)
deadline = time.time() + 120
while os.path.exists(hold) and time.time() < deadline:  # hold the lock until every racer has answered
    time.sleep(0.05)
"""


@pytest.mark.parametrize("stale", [False, True], ids=["free", "stale-lock"])
def test_racing_processes_one_takes_the_lock(tmp_path, stale):
    """Processes starting on one run directory in the same instant (two workers given one run name): exactly
    one takes the lock, also when they all find a dead holder's lock to take over."""
    if stale:
        _write_lock(tmp_path, _dead_pid())
    hold = tmp_path.parent / f"{tmp_path.name}-hold"
    hold.touch()
    start = time.time() + 2.0
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", RACER, str(tmp_path), str(start), str(hold)], stdout=subprocess.PIPE, text=True
        )
        for _ in range(6)
    ]
    try:
        answers = sorted(p.stdout.readline().strip() for p in racers)  # the holder is still holding
    finally:
        hold.unlink()
        for p in racers:
            p.wait(timeout=60)
    assert answers == ["refused"] * 5 + ["took"], answers
    assert not list(tmp_path.glob("*.tmp"))


def test_a_failed_start_never_removes_a_lock_another_writer_took_since(tmp_path):
    """A start that failed released its lock, then removed its directory and the .lock in it: a second writer
    that had taken the lock in between lost its lock file (and a third could then take another). The failed
    start now removes only an empty directory; another's lock and the directory stay."""
    from coba_tasks.pipeline.run import remove_empty_run_dir

    root = tmp_path / "run"
    mine = RunLock(root)
    mine.acquire()
    mine.release()  # unlinks its own lock file
    other = RunLock(root)
    other.acquire()  # the second writer, before the first removes the directory
    try:
        remove_empty_run_dir(root)
        assert (root / LOCK_FILE).is_file() and other.held
    finally:
        other.release()
    remove_empty_run_dir(root)  # empty now: removed
    assert not root.exists()
