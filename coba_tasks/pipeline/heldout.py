"""Held-out evaluation of a model directory (a run's checkpoint, a LoRA checkpoint or any Hugging Face
model) on a test Parquet: the work of the ``coba-eval`` flow, whose tasks (``coba_tasks.pipeline.tasks``)
call these functions.

``check_eval_inputs`` refuses a model or test file that cannot be evaluated, and an ``out_path`` that is an
input or (unless asked to overwrite) an existing file, before an engine starts;
``evaluate_model`` starts the rollout engine and the verifier pool, scores every selected prompt
(``stages.evaluate``, as a training run's evaluation does) and closes both; ``write_eval_table`` writes
the per-prompt table atomically.
"""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path

import pandas as pd
import torch

from coba_tasks.engines.checkpoint import CHECKPOINT_MANIFEST, verify_checkpoint
from coba_tasks.engines.fileio import write_parquet
from coba_tasks.engines.lora import (
    base_model_of,
    check_adapter_base,
    is_adapter_checkpoint,
    merge_adapter_checkpoint,
)
from coba_tasks.engines.rollout import make_backend
from coba_tasks.engines.verify_pool import VerifierPool
from coba_tasks.pipeline import stages
from coba_tasks.pipeline.config_sections import VerifyConfig
from coba_tasks.pipeline.data import load_dataset
from coba_tasks.pipeline.data_problems import DatasetError
from coba_tasks.pipeline.data_prompts import check_prompt_lengths, model_context, render_prompts
from coba_tasks.pipeline.data_run import check_ground_truths
from coba_tasks.pipeline.eval_settings import EvalSettings

VERIFY = VerifyConfig()  # the verifier pool of an evaluation: the run config's verify defaults


def checkpoint_version(model_path: str | Path) -> int:
    """The step of a run checkpoint (``checkpoints/000003`` holds the weights after 3 updates); 0 otherwise.

    >>> checkpoint_version("runs/demo/checkpoints/000003"), checkpoint_version("models/arith-tiny")
    (3, 0)
    """
    path = Path(model_path)
    return int(path.name) if path.parent.name == "checkpoints" and path.name.isdigit() else 0


def check_eval_inputs(
    model_path: str, settings: EvalSettings, out_path: str | None = None, overwrite: bool = False
) -> None:
    """Refuse a model or test file that cannot be evaluated, or an ``out_path`` that must not be written,
    before an engine starts (an evaluation is expensive); the messages say why."""
    if not (Path(model_path) / "config.json").is_file() and not is_adapter_checkpoint(model_path):
        raise ValueError(
            f"model_path {model_path!r} is not a Hugging Face model directory (no config.json) nor a LoRA "
            "checkpoint (no adapter_config.json)"
        )
    if (Path(model_path) / CHECKPOINT_MANIFEST).is_file():  # a run's checkpoint: every file as it was written
        verify_checkpoint(model_path)
    if is_adapter_checkpoint(model_path):  # a LoRA checkpoint: on the base model it was trained on
        check_adapter_base(model_path)
    if not Path(settings.test_path).is_file():
        raise ValueError(f"test_path {settings.test_path!r} does not exist (a Parquet file of held-out prompts)")
    if out_path:
        check_eval_output(out_path, model_path, settings, overwrite)


def check_eval_output(out_path: str, model_path: str, settings: EvalSettings, overwrite: bool) -> None:
    """Refuse an ``out_path`` that is an input of the evaluation (the test file, a file of the model or of a
    LoRA checkpoint's base model, under any name: symlinks are followed), overwrite or not, and an existing
    file unless ``overwrite``: the per-prompt table never replaces a user's file by surprise."""
    out = Path(out_path).resolve()
    inputs = [("test_path", Path(settings.test_path)), ("model", Path(model_path))]
    if is_adapter_checkpoint(model_path):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):  # unreadable: the merge says so
            inputs.append(("the LoRA checkpoint's base model", base_model_of(model_path)))
    for what, path in inputs:
        path = path.resolve()
        if out == path or (path.is_dir() and out.is_relative_to(path)):
            raise ValueError(
                f"out_path {out_path} is an input of this evaluation ({what} {path}); an input is never "
                "overwritten, overwrite=True included: choose another out_path"
            )
    refuse_existing_out_path(out_path, overwrite)


def refuse_existing_out_path(out_path: str, overwrite: bool) -> None:
    """Refuse an ``out_path`` that is a directory, or an existing file unless ``overwrite``."""
    if Path(out_path).is_dir():
        raise ValueError(f"out_path {out_path} is a directory; give the path of the Parquet file to write")
    if Path(out_path).exists() and not overwrite:
        raise ValueError(
            f"out_path {out_path} already exists; nothing was written: choose another out_path, or pass "
            "overwrite=True to replace it"
        )


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
            pool = VerifierPool(workers=VERIFY.workers, timeout_s=VERIFY.timeout_s, gsm8k_answer=s.gsm8k_answer)
            return stages.evaluate(test, engine, pool, s.samples, s.temperature, s.max_tokens, s.seed, top_p=s.top_p)
        finally:
            if pool is not None:
                pool.close()
            engine.close()


def write_eval_table(table: pd.DataFrame, out_path: str, overwrite: bool = False) -> str:
    """Write the per-prompt table as Parquet, atomically (a reader never sees half a file); an existing
    ``out_path`` (one that appeared during the evaluation, too) is replaced only with ``overwrite``."""
    refuse_existing_out_path(out_path, overwrite)
    return str(write_parquet(table, Path(out_path).resolve()))
