"""Prefect's environment for coba-rl (which Prefect, imported before, reads again) and its local server, started.

The embedded default is Prefect's ephemeral API server on SQLite. Its state goes to
``PREFECT_HOME``, which we point inside the project (``.prefect/``, git-ignored) unless the user
set it, so a run never writes a surprise directory elsewhere; analytics are off. A
``PREFECT_API_URL`` in the environment (a real server, e.g. for workers) is used as is.

``start_local_server`` starts that local server before a command's flow, in place of Prefect's own start
(the first Prefect client would start it), for three reasons. Its first start creates the database (the
migrations: about 20 s of CPU time), which a machine whose cores are busy stretches to minutes: the
wait is ``PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS``, ``STARTUP_TIMEOUT_S`` (600 s) unless the
user set it, and a start that takes long says so. Prefect's own wait keeps polling a server process
that has exited until its timeout (and restarts one whose start failed, taking it for a port in use),
where this one stops at once. And a server that cannot start is ``PrefectServerError``: one line naming
what happened, the server's log (``PREFECT_HOME/local-server.log``) and the fix, which ``coba`` prints
instead of a traceback. docs/operations.md, "The local Prefect server", has the measured start times.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]  # coba_tasks/<layer>/this file
STARTUP_TIMEOUT_S = 600  # a first start took 20 s on 2 cores at a load of 1.8, 166 s at a load of 10 (operations.md)
NOTE_AFTER_S = 15.0  # a start still waiting after this says so (a later start takes 7 s on 2 idle cores)
SERVER_LOG = "local-server.log"  # in PREFECT_HOME: the local server's output, appended at each start
TIMEOUT_SETTING = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"
USE_A_SERVER = (
    "or use a server of your own: start one (prefect server start) and export PREFECT_API_URL=http://127.0.0.1:4200/api"
)
UVICORN_STARTUP_FAILURE = 3  # uvicorn's exit code for a failed start: the app's start-up, or a port in use


class PrefectServerError(RuntimeError):
    """Prefect's local server did not start; the message is one line: what happened and what to do."""


def configure_prefect(home: str | Path | None = None) -> dict[str, str]:
    """Fill in Prefect's settings for the embedded default; values already set win. Returns them. Prefect
    imported already reads them again (``prefect.context.refresh_global_settings_context``)."""
    defaults = {
        "PREFECT_HOME": str(Path(home) if home else PROJECT_ROOT / ".prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        TIMEOUT_SETTING: str(STARTUP_TIMEOUT_S),
        # our library logs through the standard logging module; show it in flow-run logs too
        "PREFECT_LOGGING_EXTRA_LOGGERS": "coba_tasks",
    }
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    Path(os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)
    if "prefect.context" in sys.modules:
        # Prefect read its settings from the environment when it was imported (building coba's parser imports
        # it): read them again, or these would reach only the server's process, not this one's clients
        from prefect.context import refresh_global_settings_context

        refresh_global_settings_context()
    return {k: os.environ[k] for k in defaults}


def _note(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def start_local_server(note: Callable[[str], None] = _note) -> str | None:
    """Start Prefect's local (ephemeral) server for this process and wait until it answers; its API URL.

    Nothing to do (returns the URL, or None where Prefect allows no local server) when ``PREFECT_API_URL``
    names a server or this process's local server runs already. Otherwise the server Prefect would start
    (``SubprocessASGIServer``, the same command and environment) is started here, its output appended to
    ``PREFECT_HOME/local-server.log``, and registered as Prefect's, so that every Prefect client of this
    process uses it. ``note`` gets a line when the start is the database's first (its migrations) or
    takes longer than ``NOTE_AFTER_S``. Raises ``PrefectServerError`` (one line) when the server exits
    before it answers or does not answer within ``PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS``; the
    process is stopped then."""
    from prefect.settings import (
        PREFECT_API_DATABASE_CONNECTION_URL,
        PREFECT_API_URL,
        PREFECT_HOME,
        PREFECT_SERVER_ALLOW_EPHEMERAL_MODE,
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS,
    )

    if PREFECT_API_URL.value() or not PREFECT_SERVER_ALLOW_EPHEMERAL_MODE.value():
        return PREFECT_API_URL.value()
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()
    if server.running:
        return server.api_url
    timeout_s = PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value()
    home = Path(PREFECT_HOME.value())
    home.mkdir(parents=True, exist_ok=True)
    log_path = home / SERVER_LOG
    database = _sqlite_file(str(PREFECT_API_DATABASE_CONNECTION_URL.value() or ""))
    first = database is not None and not database.exists()
    if first:
        note(
            f"starting Prefect's local server: its first start creates its database {database} (20 s on 2 idle "
            f"cores, minutes on a busy machine); waiting up to {timeout_s} s ({TIMEOUT_SETTING})"
        )
    moved = f"a damaged database: move {database} away, " if database is not None else ""
    try:
        fix = f"fix what the log says ({moved}{USE_A_SERVER})"
        _wait_healthy(server, log_path, timeout_s, None if first else note, fix)
    except BaseException:
        server.stop()  # also on Ctrl-C: no server left behind, and Prefect's next client starts afresh
        raise
    import atexit

    atexit.register(server.stop)  # as Prefect's start does
    return server.api_url


def _wait_healthy(server, log_path: Path, timeout_s: int, note: Callable[[str], None] | None, fix: str) -> None:
    """Start ``server``'s process (again on another port if its port was taken meanwhile) and poll its health
    endpoint until it answers 200 (``note``, unless None, gets a line after ``NOTE_AFTER_S``);
    ``PrefectServerError`` when the process exits first (its message ends in ``fix``) or ``timeout_s`` runs out."""
    import httpx

    t0 = time.monotonic()
    with open(log_path, "ab") as log:
        log.write(f"--- coba: Prefect's local server started by pid {os.getpid()} at {time.ctime()}\n".encode())
        log.flush()
        offset = log.tell()
        server.running = True  # what Prefect's start sets first: another client of this process waits for us
        _spawn(server, log)
        retries = 0
        with httpx.Client(timeout=5.0) as client:
            while True:
                code = server.server_process.poll()
                taken = code == UVICORN_STARTUP_FAILURE and not server.is_port_available(server.port)
                if taken and retries < 3:  # another process took the port between the choice and the bind
                    retries += 1
                    _spawn(server, log)
                    continue
                if code is not None:
                    raise PrefectServerError(
                        f"Prefect's local server exited with code {code} while starting "
                        f"({_last_error(log_path, offset)}; its log: {log_path}): {fix}"
                    )
                try:
                    if client.get(f"{server.api_url}/health").status_code == 200:
                        return
                except httpx.HTTPError:  # not listening yet, or too busy to answer
                    pass
                waited = time.monotonic() - t0
                if waited > timeout_s:
                    longer = f"{TIMEOUT_SETTING}={max(2 * timeout_s, STARTUP_TIMEOUT_S)}"
                    raise PrefectServerError(
                        f"Prefect's local server did not answer within {timeout_s} s of its start ({TIMEOUT_SETTING}; "
                        f"its log: {log_path}): give it longer ({longer}), {USE_A_SERVER}"
                    )
                if note is not None and waited > NOTE_AFTER_S:
                    note, say = None, note
                    say(
                        f"Prefect's local server is still starting after {waited:.0f} s (a busy machine is slow); "
                        f"waiting up to {timeout_s} s ({TIMEOUT_SETTING})"
                    )
                time.sleep(0.2)


def _spawn(server, log) -> None:
    """``server``'s process on a free port, as Prefect starts it (``SubprocessASGIServer._run_uvicorn_command``),
    with its output in ``log``."""
    import subprocess

    import prefect
    from prefect.settings import get_current_settings

    server.port = server.find_available_port()
    env = {
        **os.environ,
        "PREFECT_UI_ENABLED": "0",
        "PREFECT__SERVER_EPHEMERAL": "1",
        "PREFECT__SERVER_FINAL": "1",
        **get_current_settings().to_environment_variables(exclude_unset=True),
    }
    argv = [sys.executable, "-m", "uvicorn", "--app-dir", str(prefect.__module_path__.parent)]
    argv += ["--factory", "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(server.port)]
    argv += ["--log-level", "error", "--lifespan", "on"]
    server.server_process = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log)


def _sqlite_file(url: str) -> Path | None:
    """The database file of a SQLite connection URL (``sqlite+aiosqlite:////abs/prefect.db``), else None."""
    if not url.startswith("sqlite") or ":memory:" in url or ":///" not in url:
        return None
    return Path(url.split(":///", 1)[1].split("?", 1)[0])


def _last_error(log_path: Path, offset: int) -> str:
    """The last exception line (``module.Error: text``) the server wrote after ``offset`` of its log, else its
    last line, shortened to one line."""
    with open(log_path, "rb") as f:
        f.seek(offset)
        lines = [ln.strip() for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.match(r"^[A-Za-z_][\w.]*(Error|Exception)\b.*", ln)]
    last = (errors or lines or ["it wrote nothing"])[-1]
    return last if len(last) <= 300 else last[:297] + "..."
