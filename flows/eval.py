"""The evaluation flow: held-out accuracy of a model directory on a test Parquet.

    prefect deployment run coba-eval/coba-eval --param model_path=runs/demo-1/checkpoints/000020 \
        --param settings='{"test_path": "data/arith_chat_test.parquet", "samples": 4, "temperature": 1.0}'
    python -c "from flows.eval import eval_flow; print(eval_flow('models/arith-tiny'))"

The model is any Hugging Face model directory: a run's checkpoint (``runs/<name>/checkpoints/NNNNNN``)
or a model such as ``models/arith-tiny``. Two tasks in order, as in the training flow's
evaluation: ``heldout-eval`` starts the rollout engine and the verifier pool, scores every selected
prompt (``coba_tasks.pipeline.stages.evaluate``) and closes both; ``write-eval-table`` writes the per-prompt
table (prompt_id, difficulty, accuracy, weight_version) atomically where ``out_path`` says. The
figures go to a markdown artifact ``eval-<model>`` and are returned. Importing this module starts
nothing; relative paths are from the working directory (the project, in a deployment).
"""

from __future__ import annotations

import contextlib
import re
import tempfile
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from coba_tasks.engines.checkpoint import CHECKPOINT_MANIFEST, verify_checkpoint
from coba_tasks.engines.lora import is_adapter_checkpoint, merge_adapter_checkpoint
from coba_tasks.engines.rollout import make_backend
from coba_tasks.engines.verify_pool import VerifierPool
from coba_tasks.pipeline import stages
from coba_tasks.pipeline.config import VerifyConfig
from coba_tasks.pipeline.data import load_dataset
from coba_tasks.pipeline.data_problems import DatasetError
from coba_tasks.pipeline.data_prompts import check_prompt_lengths, model_context, render_prompts
from coba_tasks.pipeline.data_run import check_ground_truths
from coba_tasks.pipeline.eval_settings import EvalSettings, eval_settings
from coba_tasks.pipeline.fileio import atomic_write

VERIFY = VerifyConfig()  # the verifier pool of an evaluation: the run config's verify defaults


def checkpoint_version(model_path: str | Path) -> int:
    """The step of a run checkpoint (``checkpoints/000003`` holds the weights after 3 updates); 0 otherwise.

    >>> checkpoint_version("runs/demo/checkpoints/000003"), checkpoint_version("models/arith-tiny")
    (3, 0)
    """
    path = Path(model_path)
    return int(path.name) if path.parent.name == "checkpoints" and path.name.isdigit() else 0


def artifact_key(model_path: str | Path) -> str:
    """``eval-<model>``: lowercase letters, digits and dashes only, as Prefect requires of artifact keys.

    >>> artifact_key("runs/Demo_1/checkpoints/000003"), artifact_key("models/arith-tiny")
    ('eval-demo-1-step-000003', 'eval-arith-tiny')
    """
    path = Path(model_path).resolve()
    name = f"{path.parent.parent.name}-step-{path.name}" if path.parent.name == "checkpoints" else path.name
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:80].strip("-")
    return f"eval-{slug or 'model'}"


def _check_inputs(model_path: str, settings: EvalSettings) -> None:
    """Refuse a model or test file that cannot be evaluated before an engine starts; the messages say why."""
    if not (Path(model_path) / "config.json").is_file() and not is_adapter_checkpoint(model_path):
        raise ValueError(
            f"model_path {model_path!r} is not a Hugging Face model directory (no config.json) nor a LoRA "
            "checkpoint (no adapter_config.json)"
        )
    if (Path(model_path) / CHECKPOINT_MANIFEST).is_file():  # a run's checkpoint: every file as it was written
        verify_checkpoint(model_path)
    if not Path(settings.test_path).is_file():
        raise ValueError(f"test_path {settings.test_path!r} does not exist (a Parquet file of held-out prompts)")


@task(name="heldout-eval", retries=1, retry_delay_seconds=2, cache_policy=NO_CACHE)
def evaluate_model(model_path: str, settings: EvalSettings) -> pd.DataFrame:
    """Per-prompt held-out accuracy of the model; the engine and the verifier pool live only in this task.

    The prompts pass the checks a training run makes before anything starts: every ground truth read by
    its verifier (an unknown data_source refused, unless ``unknown_sources`` is ``math``), and every
    prompt with room for ``max_tokens`` in the context (``max_model_len``, or the model's own when 0)."""
    s = settings
    loaded = load_dataset(s.test_path)
    checked, _ = check_ground_truths(loaded, s.test_path, "error", s.unknown_sources, VERIFY.workers, VERIFY.timeout_s)
    with contextlib.ExitStack() as stack:
        engine_path = model_path
        if is_adapter_checkpoint(model_path):  # a LoRA checkpoint: the engine samples from the merged weights
            merged = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="coba-eval-"))) / "merged"
            engine_path = str(merge_adapter_checkpoint(model_path, merged, getattr(torch, s.dtype, torch.float32)))
        tokenizer, context, context_from = model_context(engine_path, False, s.max_model_len)
        selected = stages.eval_sample(checked, s.eval_prompts, s.seed)  # as a training run draws its held-out set
        test, unrendered = render_prompts(selected, tokenizer, s.prompt_format)
        if unrendered:
            raise DatasetError(s.test_path, unrendered)
        if context is not None:  # the same check and message as a run's (coba_tasks.pipeline.data_run)
            check_prompt_lengths(
                test,
                context,
                s.max_tokens,
                s.test_path,
                "error",
                context_from.replace("rollout.max_model_len", "max_model_len"),
            )
        engine = make_backend(s.backend, engine_path, dtype=s.dtype, max_model_len=s.max_model_len or None, seed=s.seed)
        pool = None
        try:
            engine.weight_version = checkpoint_version(model_path)
            pool = VerifierPool(workers=VERIFY.workers, timeout_s=VERIFY.timeout_s)
            return stages.evaluate(test, engine, pool, s.samples, s.temperature, s.max_tokens, s.seed, top_p=s.top_p)
        finally:
            if pool is not None:
                pool.close()
            engine.close()


@task(name="write-eval-table", retries=1, cache_policy=NO_CACHE)
def write_table(table: pd.DataFrame, out_path: str) -> str:
    """Write the per-prompt table as Parquet, atomically (a reader never sees half a file)."""
    path = Path(out_path).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda f: table.to_parquet(f, index=False))
    return str(path)


@flow(name="coba-eval")
def eval_flow(
    model_path: str,
    settings: EvalSettings | None = None,
    out_path: str | None = None,
) -> dict[str, Any]:
    """Held-out accuracy of ``model_path`` on ``settings.test_path``: {"accuracy", "by_difficulty", "prompts"}.

    ``settings`` (``EvalSettings``; a dict of its fields in a deployment, the defaults when left out):
    ``samples`` completions per prompt at ``temperature`` (1 at 0.0 = greedy) and ``top_p``, at most
    ``max_tokens`` tokens each, generated by ``backend``; ``eval_prompts`` a seeded sample of the test
    set (0 = all); ``dtype``, ``max_model_len``, ``prompt_format`` and ``unknown_sources`` as in a run
    config (``EvalSettings.from_config`` gives a run's). ``out_path`` is where to write the per-prompt
    table (Parquet), if anywhere. Ground truths and prompt lengths are checked as a training run checks
    them, before the engine starts.
    """
    log = get_run_logger()
    settings = eval_settings(settings)
    _check_inputs(model_path, settings)
    table = evaluate_model(model_path, settings)
    written = write_table(table, out_path) if out_path else None
    by_level = table.groupby("difficulty")["accuracy"].mean()
    figures = {
        "accuracy": float(table["accuracy"].mean()),
        "by_difficulty": {str(k): float(v) for k, v in by_level.items()},
        "prompts": len(table),
    }
    s = settings
    test_path = s.test_path
    levels = " | ".join(f"{k}: {v:.2f}" for k, v in figures["by_difficulty"].items())
    log.info(
        f"held-out accuracy of {model_path} on {test_path}: {figures['accuracy']:.3f} over {len(table)} prompts"
        f" ({levels})" + (f"; table in {written}" if written else "")
    )
    create_markdown_artifact(
        key=artifact_key(model_path),
        markdown=(
            f"# Held-out evaluation of {model_path}\n\n| figure | value |\n|---|---|\n"
            f"| test set | {test_path} |\n| prompts | {len(table)} |\n"
            f"| samples per prompt | {s.samples} (temperature {s.temperature}, top-p {s.top_p}) |\n"
            f"| accuracy | {figures['accuracy']:.3f} |\n"
            + "".join(f"| accuracy, level {k} | {v:.2f} |\n" for k, v in figures["by_difficulty"].items())
            + (f"| per-prompt table | {written} |\n" if written else "")
        ),
        description=f"held-out accuracy of {model_path}",
    )
    return figures
