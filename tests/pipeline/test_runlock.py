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


@pytest.fixture
def other_process():
    """A live process that is not this one."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc.pid
    proc.kill()
    proc.wait()


def _write_lock(run_dir, pid, host=None):
    (run_dir / LOCK_FILE).write_text(json.dumps({"pid": pid, "host": host or socket.gethostname()}))


def test_acquire_release_and_reentry(tmp_path):
    lock = RunLock(tmp_path)
    with lock:
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
        RunLock(tmp_path).acquire()  # the same process may take it again
        RunLock(tmp_path).check_free()
    assert not (tmp_path / LOCK_FILE).exists()


def test_live_holder_refuses(tmp_path, other_process):
    _write_lock(tmp_path, other_process)
    with pytest.raises(RunLockedError, match=f"in use by process {other_process}"):
        RunLock(tmp_path).acquire()
    with pytest.raises(RunLockedError, match="remove the lock file if that process is gone"):
        RunLock(tmp_path).check_free()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == other_process  # left alone


def test_stale_and_garbage_locks_are_taken_over(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    _write_lock(tmp_path, int(dead.stdout))
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


def test_resume_and_rerun_refuse_a_run_in_use(tmp_path, other_process, capsys):
    store = RunStore(tmp_path / "run")
    store.create({"run": {"steps": 1}}, "h", {})
    _write_lock(store.root, other_process)
    assert cli_main(["resume", "--run-dir", str(store.root)]) == 2
    assert f"in use by process {other_process}" in capsys.readouterr().err
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
        dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
        _write_lock(tmp_path, int(dead.stdout))
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
