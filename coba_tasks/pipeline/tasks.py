"""The Prefect tasks of coba-rl's flows: each wraps one stage or step function of this package, and the
flows in ``flows/`` only compose them.

Training (``coba-train``): one task per stage of a step, named as the stage and its table (``rollouts``,
``rewards``, ``capability``, ``budget``, ``update``; ``store.Stage``), and ``eval`` for the held-out
evaluation a run makes between steps; each runs ``stage_runner.run_stage`` over the run directory and
returns the stage's few figures. A task run is named ``<stage>-step-<step>``. The update is not
retried by Prefect (it moves the weights; a rerun starts from the checkpoint instead).

Evaluation (``coba-eval``): ``evaluate-model`` and ``write-eval-table`` (``coba_tasks.pipeline.heldout``).
Bootstrap (``coba-bootstrap``): ``build-model``, ``sft-warmup`` and ``sft-eval``
(``coba_tasks.engines.bootstrap``).

    >>> [t.name for t in STAGE_TASKS.values()]
    ['rollouts', 'rewards', 'capability', 'budget', 'update', 'eval']
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
from prefect import Task, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from coba_tasks.engines import bootstrap
from coba_tasks.pipeline import heldout, stage_runner
from coba_tasks.pipeline.data import load_dataset
from coba_tasks.pipeline.eval_settings import EvalSettings
from coba_tasks.pipeline.store import Stage, Table


def _run_stage(run_dir: str, step: int, stage: str) -> dict[str, Any]:
    """Run one stage of step ``step`` in the open run at ``run_dir`` (skipped when its table is done);
    its figures."""
    return stage_runner.stage_figures(stage, stage_runner.run_stage(run_dir, step, Table(stage)))


_STAGE = task(_run_stage, cache_policy=NO_CACHE, retries=1, retry_delay_seconds=2)
STAGE_TASKS: dict[Table, Task] = {
    table: _STAGE.with_options(
        name=table.value,
        task_run_name=f"{table.value}-step-{{step}}",
        retries=0 if table is Table.UPDATE else 1,
    )
    for table in (*(s.table for s in Stage), Table.EVAL)
}


def stage_task(run_dir: str, step: int, stage: Stage | Table) -> dict[str, Any]:
    """Stage ``stage`` (or ``Table.EVAL``) of step ``step`` as its Prefect task; its figures."""
    return STAGE_TASKS[Table(stage)](run_dir, step, str(stage))


@task(name="evaluate-model", retries=1, retry_delay_seconds=2, cache_policy=NO_CACHE)
def evaluate_model_task(model_path: str, settings: EvalSettings) -> pd.DataFrame:
    """Per-prompt held-out accuracy of the model; the engine and the verifier pool live only in this task."""
    return heldout.evaluate_model(model_path, settings)


@task(name="write-eval-table", retries=1, cache_policy=NO_CACHE)
def write_eval_table_task(table: pd.DataFrame, out_path: str, overwrite: bool = False) -> str:
    """Write the per-prompt table as Parquet, atomically; an existing file only with ``overwrite``."""
    return heldout.write_eval_table(table, out_path, overwrite)


@task(name="build-model", retries=1)
def build_model_task(work_dir: str, cfg: bootstrap.BootstrapConfig) -> str:
    """Build the character tokenizer and the randomly initialised tiny Llama."""
    return str(bootstrap.init_model(Path(work_dir) / "init", cfg))


@task(name="sft-warmup")
def warm_up_task(init_dir: str, train_path: str, work_dir: str, cfg: bootstrap.BootstrapConfig) -> tuple[str, dict]:
    """Supervised training on the train split (loss on the answer tokens)."""
    out = Path(work_dir) / "model"
    figures = bootstrap.train_sft(init_dir, load_dataset(train_path), out, cfg, log=get_run_logger().info)
    return str(out), figures


@task(name="sft-eval", retries=1)
def sft_eval_task(model_dir: str, test_path: str, cfg: bootstrap.BootstrapConfig) -> dict:
    """Greedy accuracy of the warmed-up model on the held-out split, by difficulty."""
    return bootstrap.evaluate_greedy(model_dir, load_dataset(test_path), cfg)
