"""Fault injection for tests: where a run is asked to crash or fail, read once per run.

Both hooks fire inside a stage after its work is computed and before its table is recorded (the worst
moment). ``COBA_KILL_AT="<step>:<stage>"`` makes the process SIGKILL itself (a crash; ``"<step>:<stage>:TERM"``
or ``:INT``: that signal, a stop asked for); ``COBA_FAIL_FILE=
<path>`` raises ``InjectedFailure`` while that file exists and holds ``"<step>:<stage>"`` (a failure
that goes away, for task retries and ``prefect flow-run retry``). A run reads the two variables when
its resources start (``FaultHooks.from_env``, kept in ``RunResources.faults``); the stage runner asks
the run's hooks at each stage (``FaultHooks.at``), and nothing else reads the environment.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path

KILL_ENV = "COBA_KILL_AT"
FAIL_FILE_ENV = "COBA_FAIL_FILE"


class InjectedFailure(RuntimeError):
    """The failure COBA_FAIL_FILE asks for."""


@dataclass(frozen=True)
class FaultHooks:
    """Where this run is asked to crash (``kill_at``, ``"<step>:<stage>"``) or to fail (the file
    ``fail_file`` names the place while it exists); neither by default."""

    kill_at: str | None = None
    fail_file: str | None = None

    @classmethod
    def from_env(cls) -> FaultHooks:
        return cls(os.environ.get(KILL_ENV) or None, os.environ.get(FAIL_FILE_ENV) or None)

    def at(self, step: int, stage: str) -> None:
        """Kill the process or raise, when asked for at ``step``:``stage``.

        >>> FaultHooks().at(0, "rollouts")  # nothing asked: nothing happens
        """
        where = f"{step}:{stage}"
        if self.kill_at == where:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.kill_at and self.kill_at.startswith(f"{where}:"):  # "<step>:<stage>:TERM": that signal instead
            os.kill(os.getpid(), signal.Signals[f"SIG{self.kill_at.rsplit(':', 1)[1]}"])
        f = self.fail_file
        if f and os.path.isfile(f) and Path(f).read_text().strip() == where:
            raise InjectedFailure(f"injected failure in {stage} at step {step} ({FAIL_FILE_ENV}={f})")
