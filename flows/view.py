"""What a training run shows in Prefect: its flow run named after it from its creation (``flow_run_title``) and
tagged with its strategy, seed and config (``run_tags``), its artifacts, its events.

Every artifact key starts with the run's scope (``run_scope``: the run directory's name and a short hash of its
absolute path), so two runs never share a collection, in ``coba compare`` as anywhere:

- ``<scope>-progress``: steps done of ``run.steps`` (a progress artifact, updated after every step);
- ``<scope>-steps``: one row per done step (``readers.figures.step_row``: pass rate, failure rate and Beta
  shape, budgets, mixed groups, N_eff, loss, grad norm, seconds), updated after every step;
- ``<scope>-budget``: the step's allocation (prompt, estimate, budget, value, marginal gain), a version a step;
- ``<scope>-heldout``: every held-out evaluation of the run so far (``readers.figures.heldout_rows``: avg@k,
  greedy, pass@k, by level, one row per held-out set), a version per evaluation;
- ``<scope>-report``: the report (``coba report``: its headline figures, its plots inline), when the run ends.

Events (resource ``coba.run.<scope>``, for automations): ``coba.step.finished`` (payload: the step's row),
``coba.run.failed`` (payload: the error in one line and the command that continues the run; not for a stop asked
for by Ctrl-C or SIGTERM),
``coba.run.no-signal`` (a run's ``NO_SIGNAL_STEPS``-th step in a row without a mixed group) and
``coba.evaluation.finished`` (payload: the evaluation's rows). Everything is read from the run's tables. The
Prefect UI renders artifacts' descriptions and table cells as markdown: the texts of the run (its directory,
held-out set names, prompt ids) go there escaped (``readers.text.markdown_text``), the events keep them as they are.

``coba-eval-watch`` (``RunWatch``) adds ``<scope>-watch``: the held-out evaluation of the run's newest
checkpoint while it trains, a version per checkpoint, with the same event.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any
from uuid import UUID

import pandas as pd
from prefect import get_run_logger
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import ArtifactUpdate
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
from prefect.client.schemas.sorting import ArtifactSort
from prefect.events import emit_event
from prefect.runtime import flow_run

from coba_tasks.pipeline import deployment
from coba_tasks.pipeline.config import Config, config_hash
from coba_tasks.pipeline.run import RunResources, resolve_run
from coba_tasks.pipeline.store import Table
from coba_tasks.pipeline.tables import after_updates
from coba_tasks.readers.figures import NO_SIGNAL_STEPS, heldout_rows, step_row
from coba_tasks.readers.text import markdown_text

STEP_EVENT = "coba.step.finished"
FAILED_EVENT = "coba.run.failed"
NO_SIGNAL_EVENT = "coba.run.no-signal"
EVAL_EVENT = "coba.evaluation.finished"
BUDGET_COLUMNS = ("prompt_id", "pass_rate_est", "budget", "value", "marginal_gain")


def run_scope(root: str | os.PathLike[str]) -> str:
    """The prefix of a run's artifact keys: its directory's name (lowercase letters, digits and dashes, as Prefect
    requires of keys) and 6 hex digits of its absolute path's sha256 (two runs of one name in two places differ).

    >>> run_scope("/work/runs/Demo_1")
    'demo-1-b5c5e4'
    """
    path = Path(root).resolve()
    slug = re.sub(r"[^a-z0-9]+", "-", path.name.lower()).strip("-")[:48].strip("-") or "run"
    return f"{slug}-{hashlib.sha256(str(path).encode()).hexdigest()[:6]}"


def run_title(root: str | os.PathLike[str], strategy: str, seed: int) -> str:
    """A run's flow-run name: its directory (from the working directory when inside it), its allocation
    strategy and seed.

    >>> run_title("/nowhere/runs/demo", "coba", 0)
    '/nowhere/runs/demo (coba, seed 0)'
    """
    path = Path(root).resolve()
    try:
        shown = path.relative_to(Path.cwd())
    except ValueError:
        shown = path
    return f"{shown} ({strategy}, seed {seed})"


def flow_run_title() -> str:
    """The name Prefect gives a ``coba-train`` flow run as it creates it (the flow's ``flow_run_name``, called
    before the run starts): ``run_title`` of the run its parameters start or continue, so the worker's lines after
    it, the terminal's, every event and a run that fails early carry it. Parameters that are refused (the flow then
    stops on them in one line) give the run directory or config asked for, marked refused."""
    params = dict(flow_run.parameters or {})
    try:
        cfg, root, _ = resolve_run(
            params.get("config_path"),
            params.get("run_name"),
            params.get("run_dir"),
            params.get("overrides"),
            params.get("config"),
            bool(params.get("resume")),
            deployment.started_by_deployment(),
        )
    except Exception:  # the flow reports it in its first line; a name needs no reason
        asked = params.get("run_dir") or params.get("config_path") or "configs/demo.yaml"
        return f"{asked} (refused: see the flow run's log)"
    return run_title(root, cfg.allocation.strategy, cfg.run.seed)


def run_tags(cfg: Config) -> list[str]:
    """A run's tags in Prefect, to filter its flow runs by: ``strategy:<allocation.strategy>``, ``seed:<run.seed>``
    and ``config:<the first 8 digits of its config hash>`` (runs of one config share it).

    >>> from coba_tasks.pipeline.config import Config
    >>> run_tags(Config())[:2]
    ['strategy:coba', 'seed:0']
    """
    return [f"strategy:{cfg.allocation.strategy}", f"seed:{cfg.run.seed}", f"config:{config_hash(cfg)[:8]}"]


def run_failed(root: str | os.PathLike[str], cfg: Config, exc: BaseException) -> None:
    """The event ``coba.run.failed`` of the run in ``root``: what stopped it, in one line, and how to continue it
    (``automations/run-failed.yaml`` turns it into a notification). Never raises: the run's own error is the one
    the user must see."""
    try:
        title = run_title(root, cfg.allocation.strategy, cfg.run.seed)
        line = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:500]
        payload = {"error": f"{type(exc).__name__}: {line}", "resume": f"coba resume --run-dir {root}"}
        emit_event(FAILED_EVENT, resource=run_resource(run_scope(root), title), payload=payload)
    except Exception:  # no event server: the flow's own failure is the error the user sees
        pass


def table_cells(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` for a table artifact: each text cell as markdown that shows it as written (``markdown_text``)."""
    return [{k: markdown_text(v) if isinstance(v, str) else v for k, v in row.items()} for row in rows]


def run_resource(scope: str, title: str) -> dict[str, str]:
    """The Prefect event resource of a run: ``coba.run.<scope>``, named by its title."""
    return {"prefect.resource.id": f"coba.run.{scope}", "prefect.resource.name": title}


class RunView:
    """A run's window in Prefect for one flow run of it (``train_flow``): it tags the flow run (``run_tags``) and
    posts the artifacts and events of the module docstring as steps and evaluations finish."""

    def __init__(self, res: RunResources, first: int) -> None:
        self.store, self.cfg = res.store, res.cfg
        self.scope = run_scope(res.store.root)
        self.title = run_title(res.store.root, res.cfg.allocation.strategy, res.cfg.run.seed)
        self.resource = run_resource(self.scope, self.title)
        self.shown = markdown_text(self.title)  # the title in an artifact's description (markdown)
        self.rows = {s: step_row(self.store, s) for s in range(first)}  # the steps done before this flow run
        self.evaluations = {s: self._evaluation(s) for s in self.store.steps() if self.store.is_done(s, Table.EVAL)}
        self.table_id: Any = None
        if flow_run.id:  # named at its creation (``flow_run_title``); tagged here, beside a deployment's own tags
            with get_client(sync_client=True) as client:
                tags = client.read_flow_run(flow_run.id).tags
                client.update_flow_run(flow_run.id, tags=list(dict.fromkeys([*tags, *run_tags(res.cfg)])))
        progress_id = create_progress_artifact(
            progress=self._percent(), key=f"{self.scope}-progress", description=self._progress_text()
        )
        assert isinstance(progress_id, UUID)  # called from synchronous code: the artifact's id, not a coroutine
        self.progress_id = progress_id

    def _generated(self) -> int:
        return max((int(r.get("rollouts_generated_total") or 0) for r in self.rows.values()), default=0)

    def _percent(self) -> float:
        budget = self.cfg.run.rollout_budget  # under a rollout budget the run ends when its rollouts reach it
        done = self._generated() / budget if budget else len(self.rows) / max(1, self.cfg.run.steps)
        return 100.0 * min(1.0, done)

    def _progress_text(self) -> str:
        text = f"{self.shown}: {len(self.rows)} of {self.cfg.run.steps} steps done"
        budget = self.cfg.run.rollout_budget
        return text + (f", {self._generated():,} of {budget:,} rollouts generated" if budget else "")

    def step_done(self, step: int, figures: dict[str, dict[str, Any]], no_signal: int) -> None:
        """After step ``step``: its row in the step table, the progress, its budgets, its events."""
        row = self.rows[step] = step_row(self.store, step, figures)
        rows = [self.rows[s] for s in sorted(self.rows)]
        description = f"{self.shown}: the figures of every done step"
        if self.table_id is None:
            self.table_id = create_table_artifact(
                table=table_cells(rows), key=f"{self.scope}-steps", description=description
            )
        else:
            with get_client(sync_client=True) as client:
                client.update_artifact(self.table_id, ArtifactUpdate(data=json.dumps(table_cells(rows))))
        update_progress_artifact(self.progress_id, self._percent(), description=self._progress_text())
        allocated = self.store.read_table(step, Table.BUDGET)[list(BUDGET_COLUMNS)]
        create_table_artifact(
            key=f"{self.scope}-budget",
            table=table_cells(allocated.round(4).to_dict("records")),
            description=f"{self.shown}: the rollout budgets of step {step}",
        )
        emit_event(STEP_EVENT, resource=self.resource, payload=row)
        if no_signal == NO_SIGNAL_STEPS:
            payload = {"step": step, "steps_without_signal": no_signal}
            emit_event(NO_SIGNAL_EVENT, resource=self.resource, payload=payload)

    def evaluation_done(self, step: int) -> None:
        """After the held-out evaluation of the weights after ``step`` updates: the run's evaluations table,
        its event."""
        rows = self.evaluations[step] = self._evaluation(step)
        every = [r for s in sorted(self.evaluations) for r in self.evaluations[s]]
        create_table_artifact(
            table=table_cells(every),
            key=f"{self.scope}-heldout",
            description=f"{self.shown}: held-out evaluations, the newest {after_updates(step)}",
        )
        emit_event(EVAL_EVENT, resource=self.resource, payload={"step": step, "rows": rows})

    def _evaluation(self, step: int) -> list[dict[str, Any]]:
        return heldout_rows(self.store.read_table(step, Table.EVAL), step)

    def report(self, html: Path, markdown: str) -> None:
        """The run's report, its plots inline (``readers.report.report_artifacts_markdown``)."""
        create_markdown_artifact(key=f"{self.scope}-report", markdown=markdown, description=f"{self.shown}: report")
        get_run_logger().info(f"report: {html} (in Prefect: the artifact {self.scope}-report)")


class RunWatch:
    """What ``coba-eval-watch`` (``flows.eval.watch_flow``) shows of a run it watches: the artifact
    ``<scope>-watch``, a version per checkpoint evaluated, and the run's ``coba.evaluation.finished`` event."""

    def __init__(self, root: str | os.PathLike[str], cfg: Config) -> None:
        self.scope = run_scope(root)
        self.title = run_title(root, cfg.allocation.strategy, cfg.run.seed)
        self.key = f"{self.scope}-watch"
        self.resource = run_resource(self.scope, self.title)

    def posted_step(self) -> int | None:
        """The step of the newest version of ``<scope>-watch`` (the checkpoint it evaluated); None: none yet."""
        with get_client(sync_client=True) as client:
            newest = client.read_artifacts(
                artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[self.key])),
                sort=ArtifactSort.CREATED_DESC,
                limit=1,
            )
        steps = [row.get("step") for row in json.loads(str(newest[0].data))] if newest else []
        return steps[0] if steps else None

    def post(self, step: int, table: pd.DataFrame, source: str) -> list[dict[str, Any]]:
        """The evaluation table of the weights after ``step`` updates as a version of ``<scope>-watch`` and an
        event; its rows."""
        rows = heldout_rows(table, step)
        description = f"{markdown_text(self.title)}: held-out evaluation after {step} updates ({source})"
        create_table_artifact(table=table_cells(rows), key=self.key, description=description)
        emit_event(EVAL_EVENT, resource=self.resource, payload={"step": step, "rows": rows, "by": "coba-eval-watch"})
        return rows
