"""The Prefect tasks of the evaluation and bootstrap flows, each wrapping one function of this package (the
training step's tasks are in ``coba_tasks.pipeline.stages``).

Evaluation (``coba-eval``): ``evaluate-model`` and ``write-eval-table`` (``coba_tasks.pipeline.evaluation``);
``coba-eval-watch``: ``evaluate-checkpoint``.
Bootstrap (``coba-bootstrap``): ``build-model``, ``sft-warmup`` and ``sft-eval``
(``coba_tasks.engines.bootstrap``).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from coba_tasks.engines import bootstrap
from coba_tasks.pipeline import evaluation
from coba_tasks.pipeline.data import load_dataset
from coba_tasks.pipeline.evaluation import EvalSettings
from coba_tasks.pipeline.run import read_run_config
from coba_tasks.pipeline.store import RunStore


@task(name="evaluate-model", retries=1, retry_delay_seconds=2, cache_policy=NO_CACHE)
def evaluate_model_task(model_path: str, settings: EvalSettings, progress: bool = False) -> pd.DataFrame:
    """Per-prompt held-out accuracy of the model; the engine and the verifier pool live only in this task."""
    return evaluation.evaluate_model(model_path, settings, progress)


@task(name="evaluate-checkpoint", retries=1, retry_delay_seconds=2, cache_policy=NO_CACHE)
def evaluate_checkpoint_task(run_dir: str, step: int, eval_prompts: int = 0) -> pd.DataFrame:
    """Per-prompt held-out accuracy of the run's ``checkpoints/<step>`` as the run scores it
    (``evaluation.evaluate_run_checkpoint``); the engine and the verifier pool live only in this task."""
    store = RunStore.open(run_dir)
    return evaluation.evaluate_run_checkpoint(store, read_run_config(store), step, eval_prompts)


@task(name="write-eval-table", retries=1, cache_policy=NO_CACHE)
def write_eval_table_task(table: pd.DataFrame, out_path: str, overwrite: bool = False) -> str:
    """Write the per-prompt table as Parquet, atomically; an existing file only with ``overwrite``."""
    return evaluation.write_eval_table(table, out_path, overwrite)


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
