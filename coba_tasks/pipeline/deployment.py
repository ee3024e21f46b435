"""What a flow run started from a deployment may reach on its worker: paths inside the project (or the roots
the worker names), a reward file only where the worker allows it, and no file's text in an error.

Why. A deployment's parameters come from whoever reaches the Prefect API (docs/workers.md, "Who can reach
the API"), and the worker runs them with its own rights, on its own disk. The commands (``coba run``,
``coba resume``...) and the Python API are their user's own: their paths go anywhere.

- ``started_by_deployment()``: whether the flow run in progress belongs to a deployment (a worker picked
  it up); a flow called by ``coba run`` or from Python has none. The flows ask it and, when true, check
  every path they receive with ``check_deployment_paths`` before reading or writing anything, and load a
  ``config_path`` without quoting its text in errors.
- ``allowed_roots()``: the project, and the directories listed in ``COBA_DEPLOYMENT_ROOTS`` (separated as
  in ``PATH``) of the worker's environment. A path is inside when it is, once every symlink is resolved.
- ``check_deployment_outputs(paths)``: a file a deployment's flow run writes (``coba-eval``'s ``out_path``) goes
  under the project's ``runs/`` or a root the worker names, never among the project's own files (its code,
  data, ``.git``, ``.venv``), ``overwrite`` or not.
- ``check_reward_files(cfg)``: a reward file (``verify.reward_function``) is Python code: like
  ``model.trust_remote_code``, a flow runs it only where its process allows it
  (``COBA_ALLOW_REWARD_FILES=1``, in the worker's environment); the commands allow it for the config their
  user gives (``allow_reward_files``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from coba_tasks.pipeline.config import PROJECT_ROOT
from coba_tasks.pipeline.config_fields import ConfigError

if TYPE_CHECKING:
    from coba_tasks.pipeline.config import Config

ROOTS_ENV = "COBA_DEPLOYMENT_ROOTS"
REWARD_FILES_ENV = "COBA_ALLOW_REWARD_FILES"


def started_by_deployment() -> bool:
    """True inside a flow run that belongs to a deployment (what a worker runs); False in a flow called
    directly (``coba run``, Python) and outside any flow."""
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    flow_run = getattr(context, "flow_run", None)
    return getattr(flow_run, "deployment_id", None) is not None


def allowed_roots() -> tuple[Path, ...]:
    """Where a deployment's paths may point: the project and each directory of ``COBA_DEPLOYMENT_ROOTS``,
    resolved."""
    named = [Path(p).expanduser() for p in os.environ.get(ROOTS_ENV, "").split(os.pathsep) if p.strip()]
    return tuple(dict.fromkeys(p.resolve() for p in (PROJECT_ROOT, *named)))


def check_deployment_paths(paths: Mapping[str, str | os.PathLike[str] | None]) -> None:
    """Refuse (``ConfigError``, one line naming the parameter or key) a path outside ``allowed_roots()``.

    ``paths``: parameter or config key -> path as given (None or empty: not given, nothing to check). A
    relative path is taken from the working directory (the project, in a deployment's flow run)."""
    roots = allowed_roots()
    for key, value in paths.items():
        if value is None or not str(value).strip():
            continue
        given = Path(value).expanduser()
        real = (given if given.is_absolute() else Path.cwd() / given).resolve()
        if any(real.is_relative_to(root) for root in roots):
            continue
        shown = f" (it resolves to {real})" if real != given else ""
        inside = " or ".join(map(str, roots))
        raise ConfigError(
            f"{key} = {value}{shown}: outside the project and the roots its worker names ({inside}), where a "
            f"deployment's paths stay; point it inside, or start the worker with {ROOTS_ENV}=<dir>{os.pathsep}<dir> "
            "naming the directories its flow runs may use"
        )


def output_roots() -> tuple[Path, ...]:
    """Where a deployment's flow runs write files they are given the path of: the project's ``runs/`` and each
    directory of ``COBA_DEPLOYMENT_ROOTS``, resolved."""
    named = allowed_roots()[1:]
    return tuple(dict.fromkeys(((PROJECT_ROOT / "runs").resolve(), *named)))


def check_deployment_outputs(paths: Mapping[str, str | os.PathLike[str] | None]) -> None:
    """Refuse (``ConfigError``, one line naming the parameter) an output path outside ``output_roots()``: the
    project's code, data, ``.git`` or ``.venv`` are never a deployment's output. ``paths`` as
    ``check_deployment_paths`` takes them."""
    roots = output_roots()
    for key, value in paths.items():
        if value is None or not str(value).strip():
            continue
        given = Path(value).expanduser()
        real = (given if given.is_absolute() else Path.cwd() / given).resolve()
        if not any(real.is_relative_to(root) for root in roots):
            shown = f" (it resolves to {real})" if real != given else ""
            raise ConfigError(
                f"{key} = {value}{shown}: a deployment writes its outputs only under {' or '.join(map(str, roots))} "
                f"(the project's runs/ or the roots its worker names in {ROOTS_ENV}); point it there"
            )


def check_reward_files(cfg: Config) -> None:
    """Refuse ``verify.reward_function`` unless this process allows reward files (``COBA_ALLOW_REWARD_FILES=1``).

    A flow's parameters come from whoever reaches the Prefect API: a config that runs a Python file of the
    worker's disk must be allowed by the environment of the process that would run it, as a model's own code
    is (``run.check_remote_code``)."""
    spec = cfg.verify.reward_function.strip()
    if spec and os.environ.get(REWARD_FILES_ENV) != "1":
        raise ConfigError(
            f"verify.reward_function = {spec}: this process does not run a reward file's code unless its "
            f"environment allows it; set {REWARD_FILES_ENV}=1 where the worker (or the Python program) starts, "
            "for reward files you trust, or leave verify.reward_function empty for the built-in verifiers"
        )


def allow_reward_files() -> None:
    """Let this process (and those it starts) run a reward file: the user's own command gave the config."""
    os.environ[REWARD_FILES_ENV] = "1"
