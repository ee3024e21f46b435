"""What the commands print: the run's own lines, not the start-up chatter of the libraries below it.

A training run starts vLLM, transformers, torch and a Prefect server in its process. Each of them
logs what it is doing at start-up and at every weight reload (vLLM's "RotaryEmbedding: Failed to load
weights", torch's NUMA note, Prefect's "Finished in state Completed()" after every task, the
"Loading weights" progress bar), which buries the one line per step a user wants to read.
``quiet_libraries`` turns those down to errors while a command runs: each library reads its variable
when it is imported, so the command sets them first. The flow's own lines (Prefect's flow-run
logger: one line per step, the evaluations) stay. ``--verbose`` (or ``COBA_VERBOSE=1``) leaves every
library at its own level, and a variable the user set (``VLLM_LOGGING_LEVEL=INFO``, ...) always wins.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Iterator

from coba_tasks.commands.args import option

VERBOSE_ENV = "COBA_VERBOSE"
QUIET_ENV = {
    "VLLM_LOGGING_LEVEL": "ERROR",  # vLLM's engine start-up and reload warnings
    "TORCH_CPP_LOG_LEVEL": "ERROR",  # torch's C++ notes ("NUMA binding: Using MEMBIND policy ...")
    "TRANSFORMERS_VERBOSITY": "error",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # also transformers' "Loading weights" bar
    "PREFECT_LOGGING_LEVEL": "WARNING",  # Prefect's own notices (its temporary server) ...
    "PREFECT_LOGGING_LOGGERS_PREFECT_TASK_RUNS_LEVEL": "WARNING",  # ... and "Finished in state" per task
    "PREFECT_LOGGING_LOGGERS_PREFECT_FLOW_RUNS_LEVEL": "INFO",  # the run's progress lines
}


def verbose_requested(flag: bool = False) -> bool:
    """True when the user asked for the libraries' own output (``--verbose`` or ``COBA_VERBOSE=1``)."""
    return flag or os.environ.get(VERBOSE_ENV, "") not in ("", "0")


@contextlib.contextmanager
def quiet_libraries(enabled: bool = True) -> Iterator[dict[str, str]]:
    """While inside: the libraries' start-up and progress output down to errors (``QUIET_ENV`` where the
    user set nothing, and no deprecation notices from inside vLLM, torch, transformers or peft); yields
    the variables set. The environment and the warning filters are restored on exit."""
    applied = {k: v for k, v in QUIET_ENV.items() if k not in os.environ} if enabled else {}
    os.environ.update(applied)
    vllm_logger = logging.getLogger("vllm")  # vLLM logs at import, before it reads VLLM_LOGGING_LEVEL
    level = vllm_logger.level
    if "VLLM_LOGGING_LEVEL" in applied:
        vllm_logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            if enabled:
                for module in ("vllm", "torch", "transformers", "peft"):
                    warnings.filterwarnings("ignore", category=FutureWarning, module=module)
                    warnings.filterwarnings("ignore", category=DeprecationWarning, module=module)
            yield applied
    finally:
        for key in applied:
            os.environ.pop(key, None)
        vllm_logger.setLevel(level)


VERBOSE_OPTION = option(
    "--verbose",
    action="store_true",
    help="show the libraries' own logs (vLLM, torch, transformers, Prefect's per-task lines); also COBA_VERBOSE=1",
)  # on a command that starts the engines
