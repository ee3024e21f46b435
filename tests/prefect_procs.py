"""Real Prefect servers, workers and a PostgreSQL cluster as subprocesses, for the deployment tests.

- ``Processes``: the subprocesses of one test (or module), each in its own process group with its output
  in a log file; ``stop_all`` ends them, ``tails`` shows the end of every log when a test fails.
- ``Postgres``: a throwaway PostgreSQL cluster (``initdb`` in a temporary directory, a free loopback port,
  trust authentication, the ``prefect`` database with ``pg_trgm``), started and stopped with ``pg_ctl``.
  As root the cluster runs as the ``postgres`` user (the server refuses to run as root).
- ``prefect_env`` / ``start_server`` / ``wait_healthy`` / ``wait_final`` / ``flow_run_id`` /
  ``flow_run_logs``: a server and its clients.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[1]
PREFECT = [sys.executable, "-m", "prefect"]
COBA = [sys.executable, "-m", "coba_tasks.commands.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(path: Path, lines: int = 60) -> str:
    if not path.exists():
        return f"--- {path.name}: (no file)"
    text = path.read_text(errors="replace").splitlines()[-lines:]
    return f"--- last {len(text)} lines of {path.name}:\n" + "\n".join(text)


def kill_group(proc: subprocess.Popen, waits: tuple[tuple[int, float], ...]) -> None:
    """Send each signal to ``proc``'s process group until it exits; SIGKILL what is left of the group."""
    for sig, wait_s in waits:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(wait_s)
            break
        except subprocess.TimeoutExpired:
            continue
    # children of the group (flow runs, vLLM, verifier workers) outliving their parent
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


class Processes:
    """The subprocesses of one test, each in its own process group, with its output in a log file."""

    def __init__(self, logs: Path, env: dict[str, str]) -> None:
        self.logs, self.env = logs, env
        self.started: list[tuple[str, subprocess.Popen]] = []
        self.log_files: list[Path] = []

    def log(self, name: str) -> Path:
        path = self.logs / f"{name}.log"
        if path not in self.log_files:
            self.log_files.append(path)
        return path

    def start(self, name: str, args: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
        with open(self.log(name), "ab") as out:
            proc = subprocess.Popen(
                args, cwd=cwd, env=env or self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.started.append((name, proc))
        return proc

    def run(
        self, name: str, args: list[str], cwd: Path, timeout: float = 180, env: dict[str, str] | None = None
    ) -> str:
        """Run a command to completion; its output (also in <name>.log) if it succeeds, else fail."""
        path = self.log(name)
        with open(path, "wb") as out:
            rc = subprocess.run(
                args, cwd=cwd, env=env or self.env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout
            ).returncode
        text = path.read_text(errors="replace")
        assert rc == 0, f"{' '.join(args[2:])} exited {rc}:\n{tail(path)}"
        return text

    def stop(self, proc: subprocess.Popen) -> None:
        """SIGINT, then SIGTERM, then SIGKILL to the process group.

        The server stops on SIGINT in seconds; the worker (Prefect 3.7.7) often waits after the first
        signal and kills itself on the second.
        """
        kill_group(proc, ((signal.SIGINT, 5), (signal.SIGTERM, 10), (signal.SIGKILL, 10)))

    def stop_all(self) -> None:
        """Stop every process still running, latest first (the workers before the server)."""
        for _, proc in reversed(self.started):
            self.stop(proc)

    def tails(self) -> str:
        return "\n".join(tail(p) for p in self.log_files)


def wait_healthy(url: str, server: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert server.poll() is None, f"prefect server exited with {server.returncode}"
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"prefect server did not answer {url}/health within {timeout_s} s")


PERMISSIONS = ("COBA_ALLOW_REMOTE_CODE", "COBA_ALLOW_REWARD_FILES")  # set by `coba run` for its own config


def prefect_env(home: Path, url: str, **extra: str) -> dict[str, str]:
    """This process's environment without its PREFECT_ settings and the permissions a command gives itself
    (a worker's own code and reward-file permissions come from ``extra`` only), pointed at the server at ``url``."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_") and k not in PERMISSIONS}
    return {
        **base,
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_API_URL": url,
        "PREFECT_CLI_PROMPT": "false",
        "PREFECT_WORKER_QUERY_SECONDS": "2",  # poll the pool every 2 s (default 10)
        "PREFECT_LOGGING_EXTRA_LOGGERS": "coba_tasks",
        "PWD": str(PROJECT),  # what `{{ $PWD }}` in prefect.yaml's pull step reads at `prefect deploy`
        "PREFECT_CLI_COLORS": "false",
        "COLUMNS": "200",
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        **extra,
    }


def start_server(procs: Processes, name: str, port: int, env: dict[str, str], cwd: Path) -> subprocess.Popen:
    """``prefect server start`` on 127.0.0.1:``port`` (its environment without PREFECT_API_URL)."""
    server_env = {k: v for k, v in env.items() if k != "PREFECT_API_URL"}
    return procs.start(
        name,
        [*PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port), "--analytics-off"],
        cwd=cwd,
        env=server_env,
    )


def flow_run_id(output: str) -> uuid.UUID:
    found = re.search(r"UUID: ([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})", output)
    assert found, f"no flow run id in the output of prefect deployment run:\n{output}"
    return uuid.UUID(found.group(1))


def wait_final(client, run_id: uuid.UUID, workers, timeout_s: float = 300):
    """The flow run once its state is final; fails if it is not within ``timeout_s`` or a worker exits."""
    workers = workers if isinstance(workers, list | tuple) else [workers]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        run = client.read_flow_run(run_id)
        if run.state is not None and run.state.is_final():
            return run
        for w in workers:
            assert w.poll() is None, f"a worker exited with {w.returncode} during flow run {run_id}"
        time.sleep(1)
    raise AssertionError(f"flow run {run_id} not finished within {timeout_s} s (state {run.state_name})")


def flow_run_logs(client, run_id: uuid.UUID, expect: str | None = None, timeout_s: float = 60) -> str:
    """The flow run's log messages, oldest first, one per line.

    With ``expect``, wait (up to ``timeout_s``) until a message holds it: the flow run's process ships its
    logs in batches, and those of a run that failed at once reach the server after its Failed state."""
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort

    deadline = time.monotonic() + timeout_s
    while True:
        logs = client.read_logs(
            log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])), sort=LogSort.TIMESTAMP_ASC, limit=200
        )
        text = "\n".join(log.message for log in logs)
        if expect is None or expect in text or time.monotonic() > deadline:
            return text
        time.sleep(0.5)


# ---------------------------------------------------------------------------------------------
# PostgreSQL


def postgres_bindir() -> Path | None:
    """The directory of initdb/pg_ctl (Debian keeps them in /usr/lib/postgresql/<major>/bin), or None."""
    found = shutil.which("initdb")
    if found:
        return Path(found).resolve().parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    return Path(versions[-1]).parent if versions else None


class Postgres:
    """A PostgreSQL cluster of its own in a temporary directory, on a free loopback port.

    ``url`` is the SQLAlchemy URL Prefect's server takes (PREFECT_API_DATABASE_CONNECTION_URL).
    """

    def __init__(self, bindir: Path) -> None:
        self.bindir = bindir
        self.root = Path(tempfile.mkdtemp(prefix="coba-pg-"))
        self.data, self.log = self.root / "data", self.root / "postgres.log"
        self.port = free_port()
        self.user = None
        if os.geteuid() == 0:  # postgres refuses root: the cluster belongs to the postgres user
            self.user = "postgres"
            entry = pwd.getpwnam(self.user)
            os.chown(self.root, entry.pw_uid, entry.pw_gid)
        self.url = f"postgresql+asyncpg://postgres@127.0.0.1:{self.port}/prefect"

    def _run(self, *args: str, timeout: float = 60) -> str:
        argv = [str(self.bindir / args[0]), *args[1:]]
        if self.user:
            argv = ["runuser", "-u", self.user, "--", *argv]
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=self.root)
        assert out.returncode == 0, f"{' '.join(argv)} exited {out.returncode}:\n{out.stdout}\n{out.stderr}"
        return out.stdout

    def init(self) -> None:
        """initdb (UTF-8, trust authentication, superuser postgres), start, create the prefect database."""
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-instructions")
        self.start()
        self.psql("postgres", "CREATE DATABASE prefect")
        self.psql("prefect", "CREATE EXTENSION IF NOT EXISTS pg_trgm")

    def start(self) -> None:
        opts = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1"
        self._run("pg_ctl", "-D", str(self.data), "-o", opts, "-l", str(self.log), "-w", "start")

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop")

    def psql(self, database: str, sql: str) -> str:
        return self._run(
            "psql",
            "-h",
            "127.0.0.1",
            "-p",
            str(self.port),
            "-U",
            "postgres",
            "-d",
            database,
            "-v",
            "ON_ERROR_STOP=1",
            "-At",
            "-c",
            sql,
        )

    def database_bytes(self) -> int:
        return int(self.psql("prefect", "SELECT pg_database_size('prefect')").strip())

    def close(self) -> None:
        with contextlib.suppress(AssertionError, subprocess.TimeoutExpired):
            self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (from /proc), parents before children."""
    children: dict[int, list[int]] = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            text = Path(stat).read_text()
        except OSError:
            continue
        fields = text.rsplit(")", 1)[1].split()
        children.setdefault(int(fields[1]), []).append(int(Path(stat).parent.name))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop(0)
        tree.append(p)
        todo.extend(children.get(p, []))
    return tree


def pid_of_flow_run(run_id: uuid.UUID) -> int | None:
    """The pid of the process whose environment says it runs flow run ``run_id`` (the process worker sets
    PREFECT__FLOW_RUN_ID for the flow run's process), or None."""
    needle = f"PREFECT__FLOW_RUN_ID={run_id}".encode()
    found = []
    for env in glob.glob("/proc/[0-9]*/environ"):
        try:
            if needle in Path(env).read_bytes().split(b"\0"):
                found.append(int(Path(env).parent.name))
        except OSError:
            continue
    # the flow run's own children inherit the variable: the topmost one is the flow run
    for pid in found:
        try:
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
        if ppid not in found:
            return pid
    return None
