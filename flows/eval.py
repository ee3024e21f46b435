"""The evaluation flow: held-out accuracy of a model directory on a test Parquet.

    prefect deployment run coba-eval/coba-eval --param model_path=runs/demo-1/checkpoints/000020
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

from coba_tasks.engines.lora import is_adapter_checkpoint, merge_adapter_checkpoint
from coba_tasks.engines.rollout import backends, make_backend
from coba_tasks.engines.trainer import CHECKPOINT_MANIFEST, verify_checkpoint
from coba_tasks.engines.verify import VerifierPool
from coba_tasks.pipeline import stages
from coba_tasks.pipeline.data import (
    PROMPT_FORMATS,
    UNKNOWN_SOURCES,
    DatasetError,
    check_ground_truths,
    check_prompt_lengths,
    load_dataset,
    model_context,
    render_prompts,
)
from coba_tasks.pipeline.fileio import atomic_write

VERIFY_WORKERS, VERIFY_TIMEOUT_S = 2, 5.0  # the defaults of the run config's verify section


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


def select_prompts(test: pd.DataFrame, eval_prompts: int, seed: int) -> pd.DataFrame:
    """A seeded sample of ``eval_prompts`` prompts (0 = all), drawn as the training flow draws its held-out set."""
    if eval_prompts and eval_prompts < len(test):
        return test.sample(eval_prompts, random_state=seed).reset_index(drop=True)
    return test


def _check_parameters(
    model_path: str,
    test_path: str,
    samples: int,
    temperature: float,
    max_tokens: int,
    backend: str,
    eval_prompts: int,
    top_p: float = 1.0,
    prompt_format: str = "auto",
    unknown_sources: str = "error",
    max_model_len: int = 0,
) -> None:
    """Refuse bad parameters before an engine starts; the messages say what to pass instead."""
    if not (Path(model_path) / "config.json").is_file() and not is_adapter_checkpoint(model_path):
        raise ValueError(
            f"model_path {model_path!r} is not a Hugging Face model directory (no config.json) nor a LoRA "
            "checkpoint (no adapter_config.json)"
        )
    if (Path(model_path) / CHECKPOINT_MANIFEST).is_file():  # a run's checkpoint: every file as it was written
        verify_checkpoint(model_path)
    if not Path(test_path).is_file():
        raise ValueError(f"test_path {test_path!r} does not exist (a Parquet file of held-out prompts)")
    if backend not in backends():
        raise ValueError(f"backend {backend!r} is unknown; valid backends: {', '.join(backends())}")
    if samples < 1:
        raise ValueError(f"samples must be >= 1 (completions per prompt), got {samples}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if samples > 1 and temperature == 0:
        raise ValueError("samples > 1 needs temperature > 0 (greedy decoding repeats one completion)")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (1.0 = no nucleus truncation), got {top_p}")
    if eval_prompts < 0:
        raise ValueError(f"eval_prompts must be >= 0 (0 = every prompt of the test set), got {eval_prompts}")
    if prompt_format not in PROMPT_FORMATS:
        raise ValueError(f"prompt_format must be one of {', '.join(PROMPT_FORMATS)}, got {prompt_format!r}")
    if unknown_sources not in UNKNOWN_SOURCES:
        raise ValueError(f"unknown_sources must be one of {', '.join(UNKNOWN_SOURCES)}, got {unknown_sources!r}")
    if max_model_len < 0 or (max_model_len and max_model_len <= max_tokens):
        raise ValueError(
            f"max_model_len must exceed max_tokens ({max_tokens}) to leave room for the prompt, or be 0 for the "
            f"model's own context length; got {max_model_len}"
        )


@task(name="heldout-eval", retries=1, retry_delay_seconds=2, cache_policy=NO_CACHE)
def evaluate_model(
    model_path: str,
    test_path: str,
    samples: int,
    temperature: float,
    max_tokens: int,
    backend: str,
    eval_prompts: int,
    seed: int,
    dtype: str,
    max_model_len: int,
    top_p: float = 1.0,
    prompt_format: str = "auto",
    unknown_sources: str = "error",
) -> pd.DataFrame:
    """Per-prompt held-out accuracy of the model; the engine and the verifier pool live only in this task.

    The prompts pass the checks a training run makes before anything starts: every ground truth read by
    its verifier (an unknown data_source refused, unless ``unknown_sources`` is ``math``), and every
    prompt with room for ``max_tokens`` in the context (``max_model_len``, or the model's own when 0)."""
    loaded = load_dataset(test_path)
    checked, _ = check_ground_truths(loaded, test_path, "error", unknown_sources, VERIFY_WORKERS, VERIFY_TIMEOUT_S)
    with contextlib.ExitStack() as stack:
        engine_path = model_path
        if is_adapter_checkpoint(model_path):  # a LoRA checkpoint: the engine samples from the merged weights
            merged = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="coba-eval-"))) / "merged"
            engine_path = str(merge_adapter_checkpoint(model_path, merged, getattr(torch, dtype, torch.float32)))
        tokenizer, context, context_from = model_context(engine_path, False, max_model_len)
        selected = select_prompts(checked, eval_prompts, seed)
        test, unrendered = render_prompts(selected, tokenizer, prompt_format)
        if unrendered:
            raise DatasetError(test_path, unrendered)
        if context is not None:  # the same check and message as a run's (coba_tasks.pipeline.data)
            check_prompt_lengths(
                test,
                context,
                max_tokens,
                test_path,
                "error",
                context_from.replace("rollout.max_model_len", "max_model_len"),
            )
        engine = make_backend(backend, engine_path, dtype=dtype, max_model_len=max_model_len or None, seed=seed)
        pool = None
        try:
            engine.weight_version = checkpoint_version(model_path)
            pool = VerifierPool(workers=VERIFY_WORKERS, timeout_s=VERIFY_TIMEOUT_S)
            return stages.evaluate(test, engine, pool, samples, temperature, max_tokens, seed, top_p=top_p)
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
    test_path: str = "data/arith_test.parquet",
    samples: int = 1,
    temperature: float = 0.0,
    max_tokens: int = 12,
    backend: str = "vllm",
    eval_prompts: int = 0,
    seed: int = 0,
    out_path: str | None = None,
    dtype: str = "float32",
    max_model_len: int = 64,
    top_p: float = 1.0,
    prompt_format: str = "auto",
    unknown_sources: str = "error",
) -> dict[str, Any]:
    """Held-out accuracy of ``model_path`` on ``test_path``: {"accuracy", "by_difficulty", "prompts"}.

    ``samples`` completions per prompt at ``temperature`` (1 at 0.0 = greedy), at most ``max_tokens``
    tokens each, generated by ``backend`` (vllm or transformers); ``eval_prompts`` a seeded sample of
    the test set (0 = all); ``out_path`` where to write the per-prompt table (Parquet), if anywhere.
    ``dtype`` and ``max_model_len`` (0 = the model's own) as in the run config's model and rollout sections;
    ``top_p`` the nucleus of a sampled evaluation (the run config's run.eval_top_p; the paper: 0.9);
    ``prompt_format`` how prompts are rendered (the run config's data.prompt_format: auto, chat or raw);
    ``unknown_sources`` what a data_source without a verifier does (the run config's verify.unknown_sources:
    error refuses the file, math scores it with math-verify). Ground truths and prompt lengths are checked
    as a training run checks them, before the engine starts.
    """
    log = get_run_logger()
    _check_parameters(
        model_path,
        test_path,
        samples,
        temperature,
        max_tokens,
        backend,
        eval_prompts,
        top_p,
        prompt_format,
        unknown_sources,
        max_model_len,
    )
    table = evaluate_model(
        model_path,
        test_path,
        samples,
        temperature,
        max_tokens,
        backend,
        eval_prompts,
        seed,
        dtype,
        max_model_len,
        top_p,
        prompt_format,
        unknown_sources,
    )
    written = write_table(table, out_path) if out_path else None
    by_level = table.groupby("difficulty")["accuracy"].mean()
    figures = {
        "accuracy": float(table["accuracy"].mean()),
        "by_difficulty": {str(k): float(v) for k, v in by_level.items()},
        "prompts": len(table),
    }
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
            f"| samples per prompt | {samples} (temperature {temperature}, top-p {top_p}) |\n"
            f"| accuracy | {figures['accuracy']:.3f} |\n"
            + "".join(f"| accuracy, level {k} | {v:.2f} |\n" for k, v in figures["by_difficulty"].items())
            + (f"| per-prompt table | {written} |\n" if written else "")
        ),
        description=f"held-out accuracy of {model_path}",
    )
    return figures
