"""Prefect's environment for coba-rl: set before ``prefect`` is imported.

The embedded default is Prefect's ephemeral API server on SQLite. Its state goes to
``PREFECT_HOME``, which we point inside the project (``.prefect/``, git-ignored) unless the user
set it, so a run never writes a surprise directory elsewhere; analytics are off. A
``PREFECT_API_URL`` in the environment (a real server, e.g. for workers) is used as is.
"""

from __future__ import annotations

import os
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]  # coba_tasks/<layer>/this file


def configure_prefect(home: str | Path | None = None) -> dict[str, str]:
    """Fill in Prefect's settings for the embedded default; values already set win. Returns them."""
    defaults = {
        "PREFECT_HOME": str(Path(home) if home else PROJECT_ROOT / ".prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90",
        # our library logs through the standard logging module; show it in flow-run logs too
        "PREFECT_LOGGING_EXTRA_LOGGERS": "coba_tasks",
    }
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    Path(os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)
    return {k: os.environ[k] for k in defaults}
