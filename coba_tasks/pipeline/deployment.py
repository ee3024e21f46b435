"""What a flow run started from a deployment may reach on its worker: paths inside the project (or the roots
the worker names in ``COBA_DEPLOYMENT_ROOTS``), outputs (a run directory too) under ``runs/`` or those roots,
sizes and times under caps (``COBA_DEPLOYMENT_CAPS``; a task's timeout never off), a reward file only where the
worker allows it (``COBA_ALLOW_REWARD_FILES=1``), and no file's text in an error (docs/workers.md, the
deployment rules). A deployment's parameters come from whoever reaches the Prefect API and run with the
worker's rights; the commands and the Python API are their user's own, and their paths go anywhere. The flows
ask ``started_by_deployment()`` and, when true, check every path before reading or writing anything.
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
CAPS_ENV = "COBA_DEPLOYMENT_CAPS"
# What a deployment's parameters may ask of a worker unless its environment raises the cap (CAPS_ENV): each
# key's largest value (data.eval_prompts = 0, every held-out prompt, is bounded by the held-out file, and
# rollout.max_model_len = 0, the model's own context, by the model, which a deployment can only name inside the
# project or the worker's roots). Each bounds how long a flow run holds its worker (the one coba-gpu slot).
DEPLOYMENT_CAPS: dict[str, int] = {
    "verify.workers": 16,  # verifier processes, all started at once
    "run.steps": 10_000,
    "run.eval_samples": 64,
    "data.eval_prompts": 10_000,
    "data.prompts_per_step": 4_096,
    "allocation.max_budget": 1_024,
    "rollout.max_tokens": 32_768,
    "rollout.max_model_len": 131_072,  # the engine's context: its KV cache
    "optim.update_epochs": 16,  # passes over each step's rollouts
    "optim.mini_batches": 64,  # optimizer steps per pass
    "model.lora_rank": 256,
    "verify.timeout_s": 60,  # seconds per completion (and for a reward file's import)
    "run.rollouts_timeout_s": 86_400,  # seconds a task may run, a day; 0 (none) refused: TIMEOUTS
    "run.update_timeout_s": 86_400,
    "run.eval_timeout_s": 86_400,
}
# Caps of a timeout whose 0 means none: a deployment may not ask for 0, nor a worker's environment cap it at 0
TIMEOUTS = ("run.rollouts_timeout_s", "run.update_timeout_s", "run.eval_timeout_s")


def started_by_deployment() -> bool:
    """True inside a flow run of a deployment (a worker's); False in a flow called directly and outside any flow."""
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    flow_run = getattr(context, "flow_run", None)
    return getattr(flow_run, "deployment_id", None) is not None


def allowed_roots() -> tuple[Path, ...]:
    """Where a deployment's paths may point: the project and each directory of ``COBA_DEPLOYMENT_ROOTS``."""
    named = [Path(p).expanduser() for p in os.environ.get(ROOTS_ENV, "").split(os.pathsep) if p.strip()]
    return tuple(dict.fromkeys(p.resolve() for p in (PROJECT_ROOT, *named)))


def _refuse_outside(paths: Mapping[str, str | os.PathLike[str] | None], roots: tuple[Path, ...], why: str) -> None:
    """ConfigError ``<key> = <value>: <why>`` for the first path of ``paths`` (None or empty: not given) that
    resolves outside every root; a relative path is from the working directory (the project, in a flow run)."""
    for key, value in paths.items():
        if value is None or not str(value).strip():
            continue
        given = Path(value).expanduser()
        real = (given if given.is_absolute() else Path.cwd() / given).resolve()
        if not any(real.is_relative_to(root) for root in roots):
            shown = f"{value}" + (f" (it resolves to {real})" if real != given else "")
            raise ConfigError(f"{key} = {shown}: {why}")


def check_deployment_paths(paths: Mapping[str, str | os.PathLike[str] | None]) -> None:
    """ConfigError naming the parameter or config key (``paths``' keys) of a path outside ``allowed_roots()``."""
    roots = allowed_roots()
    _refuse_outside(
        paths,
        roots,
        f"outside the project and the roots its worker names ({' or '.join(map(str, roots))}), where a "
        f"deployment's paths stay; point it inside, or start the worker with {ROOTS_ENV}=<dir>{os.pathsep}<dir> "
        "naming the directories its flow runs may use",
    )


def output_roots() -> tuple[Path, ...]:
    """Where a deployment's flow runs write the files they are given: ``runs/`` and ``COBA_DEPLOYMENT_ROOTS``."""
    named = allowed_roots()[1:]
    return tuple(dict.fromkeys(((PROJECT_ROOT / "runs").resolve(), *named)))


def check_deployment_outputs(paths: Mapping[str, str | os.PathLike[str] | None]) -> None:
    """``check_deployment_paths`` for outputs, under ``output_roots()``: never the project's own files."""
    roots = output_roots()
    _refuse_outside(
        paths,
        roots,
        f"a deployment writes its outputs only under {' or '.join(map(str, roots))} (the project's runs/ or the "
        f"roots its worker names in {ROOTS_ENV}); point it there",
    )


def deployment_caps() -> dict[str, int]:
    """``DEPLOYMENT_CAPS`` with the worker's own (``COBA_DEPLOYMENT_CAPS``: ``key=value`` pairs, comma-separated);
    a malformed entry is one line naming it."""
    caps = dict(DEPLOYMENT_CAPS)
    for item in filter(None, (x.strip() for x in os.environ.get(CAPS_ENV, "").split(","))):
        key, _, value = item.partition("=")
        if key.strip() not in caps or not value.strip().isdigit():
            raise ConfigError(
                f"{CAPS_ENV}: {item!r} is not <key>=<whole number> for one of {', '.join(caps)}; fix the worker's "
                "environment"
            )
        if key.strip() in TIMEOUTS and int(value) == 0:
            raise ConfigError(
                f"{CAPS_ENV}: {item!r}: a deployment's task timeouts cannot be switched off (0 = none); give the "
                "longest a task may run, in seconds; fix the worker's environment"
            )
        caps[key.strip()] = int(value)
    return caps


def check_deployment_limits(values: Mapping[str, float | None]) -> None:
    """ConfigError naming the key, its cap and how the worker raises it, for a value above its cap, or a timeout
    of ``TIMEOUTS`` switched off (0; None: not given)."""
    caps = deployment_caps()
    for key, value in values.items():
        if value is not None and key in TIMEOUTS and value == 0:
            raise ConfigError(
                f"{key} = {value}: a deployment's flow run may not switch its timeout off (0 = none: a stuck task "
                f"would hold its worker for ever); give at most {caps[key]} seconds, the worker's cap"
            )
        if value is not None and key in caps and value > caps[key]:
            raise ConfigError(
                f"{key} = {value}: above the cap of {caps[key]} on what a deployment's flow run may ask of its "
                f"worker; ask for less, or start the worker with {CAPS_ENV}={key}=<n> if it can take it"
            )


def config_limits(cfg: Config) -> dict[str, float]:
    """The values of ``cfg`` that ``check_deployment_limits`` caps."""
    return {key: getattr(getattr(cfg, section), name) for key in DEPLOYMENT_CAPS for section, name in [key.split(".")]}


def check_reward_files(cfg: Config) -> None:
    """Refuse ``verify.reward_function`` unless this process's environment allows reward files, as a model's own
    code (``run.check_remote_code``): a flow's parameters come from whoever reaches the Prefect API."""
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
