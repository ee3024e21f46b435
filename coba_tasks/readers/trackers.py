"""Experiment trackers (``run.trackers``): each step's figures logged to TensorBoard, MLflow and Weights & Biases.

Everything is logged *from the run directory's tables* once a step is complete (its update table done,
and its held-out evaluation when one is scheduled after it), so a resumed or rerun step logs what is on
disk. A tracker's step is the number of updates done: step 0 holds the evaluation before training,
step k the figures of training step k - 1 (the tables in ``steps/<k-1>``) and the evaluation of the
weights after k updates (``steps/<k>/eval.parquet``) when there is one.

Offline, under the run directory::

    trackers/state.json       per tracker: the last step logged and its run id (a resume continues them)
    trackers/tensorboard/     TensorBoard event files (torch.utils.tensorboard)
    trackers/mlflow/          an MLflow store: mlflow.db (SQLite) and artifacts/
    trackers/wandb/           Weights & Biases offline runs (`wandb sync` uploads them)

A resumed run continues the same tracker run and logs only the steps not logged yet. Each logged step's
tables are fingerprinted (their manifests' sha256) in state.json; a step whose tables changed since is
logged again: TensorBoard rewinds its run, MLflow and W&B log the whole run again into a new tracker run
(docs/operations.md, "Experiment trackers").
One adapter per library behind ``_Tracker``; the flow calls ``open_trackers``, ``Trackers.log_new``
after each step and evaluation, and ``Trackers.close``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import time
import uuid
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

import pandas as pd

from coba_tasks.pipeline.config import Config, check_installed, config_to_dict
from coba_tasks.pipeline.config_sections import TRACKERS
from coba_tasks.pipeline.evaluation import run_eval_steps
from coba_tasks.pipeline.progress import run_length
from coba_tasks.pipeline.store import STAGES, RunStore, Table
from coba_tasks.readers.figures import budget_figures, capability_figures, eval_figures, update_figures
from coba_tasks.readers.mechanisms import step_mechanisms
from coba_tasks.readers.samples import prompt_texts
from coba_tasks.readers.tables import RunTables, load_run

TRACKERS_DIR = "trackers"
STATE_FILE = f"{TRACKERS_DIR}/state.json"
SAMPLES = 4  # sample completions logged per step
SAMPLE_CHARS = 400  # a sample completion is cut to this many characters


# --- The figures of a tracker step, from the tables


def step_complete(t: RunTables, k: int, steps: int, evals: Collection[int]) -> bool:
    """Whether tracker step ``k`` has all its tables: the update of step k - 1, and the evaluation when ``k`` is
    among ``evals`` (``evaluation.run_eval_steps``); none past the run's ``steps`` (``progress.run_length``)."""
    if k > steps:
        return False
    trained = k == 0 or Table.UPDATE in t.done.get(k - 1, set())
    evaluated = k not in evals or Table.EVAL in t.done.get(k, set())
    return trained and evaluated


def step_fingerprint(store: RunStore, k: int) -> str:
    """The sha256 of the manifest entries of the tables tracker step ``k`` is logged from: the stage tables
    of training step k - 1 and the evaluation of the weights after k updates. It changes when a rerun
    recomputes (or removes) any of them."""
    entries = [(k, Table.EVAL.value, store.manifest(k).get(Table.EVAL, {}).get("sha256"))]
    if k > 0:
        done = store.manifest(k - 1)
        entries += [(k - 1, stage.value, done.get(stage, {}).get("sha256")) for stage in STAGES]
    return hashlib.sha256(json.dumps(entries).encode()).hexdigest()


def first_stale_step(store: RunStore, fingerprints: Mapping[str, str], last: int) -> int | None:
    """The first tracker step up to ``last`` whose tables are not the ones it was logged from (None when every
    logged step is current; steps logged before fingerprints were kept count as current)."""
    for k in range(last + 1):
        if str(k) in fingerprints and fingerprints[str(k)] != step_fingerprint(store, k):
            return k
    return None


def step_metrics(t: RunTables, k: int) -> dict[str, float]:
    """The figures of tracker step ``k`` (finite numbers only), by name ``group/figure``."""
    out: dict[str, Any] = {"progress/updates": k}
    s = k - 1
    done = t.done.get(s, set()) if k > 0 else set()
    if Table.CAPABILITY in done:
        cap = capability_figures(t.table(s, Table.CAPABILITY))
        out |= {"train/pass_rate": cap.get("S"), "train/F": cap.get("F")}
        out |= {f"capability/{c}": cap.get(c) for c in ("alpha", "beta", "alpha_used", "beta_used")}
        out["budget/zero_variance_share"] = cap.get("zero_variance_groups")
    if Table.REWARDS in done:
        rewards = t.table(s, Table.REWARDS)
        out["train/reward_mean"] = rewards["reward"].astype(float).mean()
        out["train/rollouts"] = len(rewards)
    if Table.BUDGET in done:
        out |= {f"budget/{k}": v for k, v in budget_figures(t.table(s, Table.BUDGET)).items()}
    if {Table.BUDGET, Table.REWARDS} <= done:  # readers.mechanisms: estimates against realized pass rates, N_eff
        out |= {f"mechanisms/{name}": v for name, v in step_mechanisms(t, s)[0].items()}
    if Table.UPDATE in done:
        upd = update_figures(t.table(s, Table.UPDATE))
        for c in ("loss", "grad_norm", "clip_frac", "entropy", "kl", "lr", "tokens"):
            out[f"update/{c}"] = upd.get(c)
        out["update/sampler_trainer_gap"] = upd.get("logprob_diff_mean")
        out["update/sampler_trainer_gap_max"] = upd.get("logprob_diff_max")
    if k > 0 and t.store.step_json_path(s, "timing").is_file():
        try:
            seconds = t.store.read_step_json(s, "timing")
        except (OSError, ValueError):
            seconds = {}
        out |= {f"time/{stage}_seconds": v for stage, v in seconds.items()}
        out["time/step_seconds"] = sum(v for v in seconds.values() if isinstance(v, int | float))
    if Table.EVAL in t.done.get(k, set()):
        ev = eval_figures(t.table(k, Table.EVAL))
        out |= {f"heldout/{c}": ev.get(c) for c in ("accuracy", "greedy", "answered", "boxed")}
        out |= {f"heldout/accuracy_L{level}": v for level, v in ev["by_difficulty"].items()}
        out |= {f"heldout/pass_at_{k}": v for k, v in ev["pass_at_k"].items()}  # MLflow refuses "@" in a name
        for name, figures in (ev.get("test_sets") or {}).items():
            out[f"heldout/{name}/accuracy"] = figures["accuracy"]
    return {key: float(v) for key, v in out.items() if _finite(v)}


def step_samples(t: RunTables, k: int, n: int = SAMPLES) -> pd.DataFrame | None:
    """A few sample completions of training step k - 1 with their rewards (the first ``n`` prompts' first
    completion), or None at step 0 or when the tables are not done."""
    s = k - 1
    if k == 0 or not {Table.ROLLOUTS, Table.REWARDS} <= t.done.get(s, set()):
        return None
    rollouts = t.table(s, Table.ROLLOUTS)[["prompt_id", "sample_idx", "completion"]]
    rewards = t.table(s, Table.REWARDS)[["prompt_id", "sample_idx", "reward", "verdict"]]
    rows = rollouts.merge(rewards, on=["prompt_id", "sample_idx"], how="inner")
    rows = rows.sort_values(["prompt_id", "sample_idx"], kind="stable").drop_duplicates("prompt_id").head(n)
    rows = rows.assign(
        step=s,
        prompt=prompt_texts(t, rows["prompt_id"], SAMPLE_CHARS),
        completion=rows["completion"].astype(str).str.slice(0, SAMPLE_CHARS),
        reward=rows["reward"].astype(float),
        sample_idx=rows["sample_idx"].astype(int),
    )
    cols = ["step", "prompt_id", "prompt", "completion", "reward", "verdict"]
    return rows[cols].reset_index(drop=True)


def flat_config(cfg: Config) -> dict[str, Any]:
    """The config as hyper-parameters: ``section.key`` -> value (lists as text)."""
    return {
        f"{section}.{key}": (v if isinstance(v, bool | int | float | str) else json.dumps(v))
        for section, body in config_to_dict(cfg).items()
        for key, v in body.items()
    }


def _finite(v: Any) -> bool:
    try:
        return v is not None and not isinstance(v, str) and math.isfinite(float(v))
    except (TypeError, ValueError):
        return False


# --- Adapters: one per library


class _Tracker:
    """The common interface: ``start`` (open or continue the tracker run; returns its id), ``log`` (one
    tracker step's figures and samples), ``close``; ``logged_through`` is the last step the library itself
    holds (``-1`` when unknown)."""

    name = ""
    rewinds = False  # whether ``start`` with an earlier ``last`` drops the steps after it (else: a new run)

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def start(self, run_id: str | None, last: int, run_name: str, params: dict[str, Any]) -> str | None:
        raise NotImplementedError

    def logged_through(self) -> int:
        return -1

    def log(self, step: int, metrics: Mapping[str, float], samples: pd.DataFrame | None) -> None:
        raise NotImplementedError

    def supersede(self, old_run_id: str) -> None:
        """Mark the earlier tracker run ``old_run_id`` as replaced by this one (where the library can)."""

    def close(self) -> None:
        pass


class _TensorBoard(_Tracker):
    name = "tensorboard"
    rewinds = True  # purge_step hides every event at or after it

    def start(self, run_id: str | None, last: int, run_name: str, params: dict[str, Any]) -> str | None:
        from torch.utils.tensorboard import SummaryWriter

        self.directory.mkdir(parents=True, exist_ok=True)
        # a resumed run: events of steps after the last recorded one (a crash mid-log) are purged
        self.writer = SummaryWriter(str(self.directory), purge_step=last + 1 if last >= 0 else None)
        if last < 0:
            rows = "".join(f"| {k} | {_md(v)} |\n" for k, v in params.items())
            self.writer.add_text("config", f"run {run_name}\n\n| key | value |\n|---|---|\n{rows}", 0)
        return None

    def log(self, step: int, metrics: Mapping[str, float], samples: pd.DataFrame | None) -> None:
        for key, v in metrics.items():
            self.writer.add_scalar(key, v, step)
        if samples is not None and len(samples):
            self.writer.add_text("samples", _markdown_table(samples), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _MLflow(_Tracker):
    name = "mlflow"

    def start(self, run_id: str | None, last: int, run_name: str, params: dict[str, Any]) -> str | None:
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # offline: nothing leaves the machine
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.directory.mkdir(parents=True, exist_ok=True)
        self.client = MlflowClient(tracking_uri=store_uri(self.directory))
        if run_id is None:
            exp = self.client.get_experiment_by_name(run_name)
            artifacts = (self.directory / "artifacts").as_uri()
            eid = exp.experiment_id if exp else self.client.create_experiment(run_name, artifact_location=artifacts)
            run_id = self.client.create_run(eid, run_name=run_name).info.run_id
            items = [Param(k, str(v)[:6000]) for k, v in params.items()]
            for i in range(0, len(items), 100):
                self.client.log_batch(run_id, params=items[i : i + 100])
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.run_id = run_id
        return run_id

    def logged_through(self) -> int:
        updates = self.client.get_run(self.run_id).data.metrics.get("progress/updates")
        return -1 if updates is None else int(updates)

    def log(self, step: int, metrics: Mapping[str, float], samples: pd.DataFrame | None) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()])
        if samples is not None and len(samples):
            self.client.log_table(self.run_id, data=samples, artifact_file=f"samples/step_{step:06d}.json")

    def supersede(self, old_run_id: str) -> None:
        self.client.set_tag(old_run_id, "coba.superseded_by", self.run_id)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class _WandB(_Tracker):
    name = "wandb"

    def start(self, run_id: str | None, last: int, run_name: str, params: dict[str, Any]) -> str | None:
        import wandb

        self.directory.mkdir(parents=True, exist_ok=True)
        self.wandb = wandb
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "coba-rl"),
            name=run_name,
            id=run_id or uuid.uuid4().hex[:8],
            resume="allow",
            mode="offline",
            dir=str(self.directory.parent),  # wandb writes <dir>/wandb/
            config=params,
            settings=wandb.Settings(console="off", silent=True, x_disable_stats=True),
        )
        return self.run.id

    def log(self, step: int, metrics: Mapping[str, float], samples: pd.DataFrame | None) -> None:
        data: dict[str, Any] = dict(metrics)
        if samples is not None and len(samples):
            data["samples"] = self.wandb.Table(dataframe=samples)
        self.run.log(data, step=step)

    def close(self) -> None:
        self.run.finish()


_ADAPTERS: dict[str, type[_Tracker]] = {"tensorboard": _TensorBoard, "mlflow": _MLflow, "wandb": _WandB}
assert tuple(_ADAPTERS) == TRACKERS


def store_uri(directory: Path) -> str:
    """The MLflow tracking URI of a run's store (``mlflow ui --backend-store-uri`` takes it)."""
    return f"sqlite:///{(directory / 'mlflow.db').resolve()}"


# --- The trackers of a run


class Trackers:
    """The open trackers of one run directory and what each has logged (trackers/state.json)."""

    def __init__(self, root: str | os.PathLike[str], cfg: Config, warn: Callable[[str], None] = print) -> None:
        self.store, self.cfg, self.warn = RunStore(root), cfg, warn
        path = self.store.root / STATE_FILE
        self.state: dict[str, dict[str, Any]] = json.loads(path.read_text()) if path.is_file() else {}
        self.open: dict[str, _Tracker] = {}
        params = flat_config(cfg)
        for name in cfg.run.trackers:
            entry = self.state.setdefault(name, {"last_step": -1, "run_id": None})
            entry.setdefault("fingerprints", {})
            tracker = _ADAPTERS[name](self.store.root / TRACKERS_DIR / name)
            stale = first_stale_step(self.store, entry["fingerprints"], entry["last_step"])
            old_run = entry["run_id"] if stale is not None and not tracker.rewinds else None
            if stale is not None:  # recomputed since they were logged: log them again
                entry["last_step"] = stale - 1 if tracker.rewinds else -1
                entry["fingerprints"] = {k: v for k, v in entry["fingerprints"].items() if int(k) <= entry["last_step"]}
                again = "" if tracker.rewinds else f"; they go to a new {name} run with the whole run logged again"
                warn(f"tracker {name}: steps from step {stale} were recomputed since they were logged{again}")
            entry["run_id"] = tracker.start(
                None if old_run else entry["run_id"], entry["last_step"], cfg.run.name, params
            )
            if old_run:
                tracker.supersede(old_run)
            # a crash after the library took a step and before state.json recorded it: not logged twice
            entry["last_step"] = max(entry["last_step"], tracker.logged_through())
            self.open[name] = tracker
        if self.open:
            self._save()

    def log_new(self) -> list[int]:
        """Log every complete tracker step not logged yet, in order, to each open tracker; the steps logged.

        A tracker that fails is warned about and closed for the rest of the run (its state keeps the last
        step it logged, so a resume catches it up)."""
        if not self.open:
            return []
        t = load_run(self.store.root)
        steps, evals = run_length(self.store, self.cfg), set(run_eval_steps(self.store, self.cfg))
        logged: set[int] = set()
        for name, tracker in list(self.open.items()):
            entry = self.state[name]
            try:
                k = entry["last_step"] + 1
                while step_complete(t, k, steps, evals):
                    tracker.log(k, step_metrics(t, k), step_samples(t, k))
                    entry["last_step"] = k
                    entry["fingerprints"][str(k)] = step_fingerprint(self.store, k)
                    logged.add(k)
                    k += 1
            except Exception as exc:  # a tracker never stops training
                self.warn(f"tracker {name} failed ({type(exc).__name__}: {exc}); it logs nothing more in this run")
                self.open.pop(name)
                _quietly(tracker.close)
            finally:
                self._save()
        return sorted(logged)

    def close(self) -> None:
        for tracker in self.open.values():
            _quietly(tracker.close)
        self.open = {}

    def _save(self) -> None:
        self.store.write_json(STATE_FILE, self.state)


def open_trackers(root: str | os.PathLike[str], cfg: Config, warn: Callable[[str], None] = print) -> Trackers:
    """The run's trackers, each continuing its run of an earlier start (none open when run.trackers is
    empty: then nothing is written and ``log_new`` does nothing)."""
    check_installed(cfg.run.trackers)
    return Trackers(root, cfg, warn)


def _quietly(fn: Callable[[], Any]) -> None:
    with contextlib.suppress(Exception):
        fn()


def _md(v: Any) -> str:
    return str(v).replace("|", "\\|").replace("\n", " ")


def _markdown_table(df: pd.DataFrame) -> str:
    head = "| " + " | ".join(df.columns) + " |\n|" + "---|" * len(df.columns) + "\n"
    return head + "".join("| " + " | ".join(_md(v) for v in row) + " |\n" for row in df.itertuples(index=False))
