"""Held-out evaluation, its one home: in a training run (the task ``evaluate_step(run_dir, t)`` writes
``steps/t/eval.parquet`` at the ``eval_steps``) and of any model directory (the ``coba-eval`` flow:
``EvalSettings`` is its typed, frozen parameter; ``check_eval_inputs`` refuses what cannot be evaluated or
written before an engine starts; ``evaluate_model``; ``write_eval_table``) and of a run's checkpoint outside
its run (``coba-eval-watch``: ``evaluate_run_checkpoint``, as the run scores it). ``evaluate`` does the scoring.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from coba_tasks.engines.checkpoint import CHECKPOINT_MANIFEST, verify_checkpoint
from coba_tasks.engines.fileio import content_sha256, write_parquet
from coba_tasks.engines.lora import (
    base_model_of,
    check_adapter_base,
    is_adapter_checkpoint,
    merge_adapter_checkpoint,
)
from coba_tasks.engines.reward_file import RewardFunction
from coba_tasks.engines.rollout import RolloutBackend, SamplingConfig, backends, make_backend
from coba_tasks.engines.verify import Gsm8kAnswer, VerdictKind, solved
from coba_tasks.engines.verify_pool import VerifierPool
from coba_tasks.pipeline.config import Config
from coba_tasks.pipeline.config_fields import Section
from coba_tasks.pipeline.config_sections import (
    DataConfig,
    Dtype,
    ModelConfig,
    PromptFormat,
    RolloutConfig,
    RunConfig,
    UnknownSources,
    VerifyConfig,
)
from coba_tasks.pipeline.data import (
    DatasetError,
    check_ground_truths,
    check_prompt_lengths,
    eval_prompt_set,
    keep_difficulties,
    load_dataset,
    load_run_datasets,
    model_context,
    render_prompts,
    sample_eval_prompts,
)
from coba_tasks.pipeline.deployment import check_reward_files
from coba_tasks.pipeline.policy import whole_checkpoint
from coba_tasks.pipeline.progress import first_step_not_done, rollouts_generated, run_length
from coba_tasks.pipeline.run import RunResources, check_remote_code, verifier_pool
from coba_tasks.pipeline.stages import check_error_share, reward_table, rollout_tables, stage
from coba_tasks.pipeline.store import SUMMARY_FILE, RunStore, StoreError, Table

# each setting's key in a run's config (section, key): its default there, and where from_config reads it
CONFIG_KEYS: dict[str, tuple[type[Section], str]] = {
    "test_path": (DataConfig, "test"),
    "samples": (RunConfig, "eval_samples"),
    "temperature": (RunConfig, "eval_temperature"),
    "top_p": (RunConfig, "eval_top_p"),
    "greedy": (RunConfig, "eval_greedy"),
    "max_tokens": (RolloutConfig, "max_tokens"),
    "backend": (RolloutConfig, "backend"),
    "eval_prompts": (DataConfig, "eval_prompts"),
    "difficulties": (DataConfig, "difficulties"),
    "seed": (RunConfig, "seed"),
    "dtype": (ModelConfig, "dtype"),
    "max_model_len": (RolloutConfig, "max_model_len"),
    "prompt_format": (DataConfig, "prompt_format"),
    "unknown_sources": (VerifyConfig, "unknown_sources"),
    "gsm8k_answer": (VerifyConfig, "gsm8k_answer"),
    "max_error_share": (VerifyConfig, "max_error_share"),
}


# --- What an evaluation scores: its schedule in a run, its prompts, the scoring

BOXED = "\\boxed{"  # the answer format of math prompts ("put your final answer within \\boxed{}")


def eval_steps(steps: int, every: int) -> list[int]:
    """The steps whose weights a training run evaluates on held-out prompts: 0 (before training), every
    ``every`` steps (0: none in between) and ``steps`` (after training).

    >>> eval_steps(12, 5), eval_steps(12, 0), eval_steps(12, 6)
    ([0, 5, 10, 12], [0, 12], [0, 6, 12])
    """
    between = range(every, steps, every) if every else range(0)
    return sorted({0, *between, steps})


def run_eval_steps(store: Any, cfg: Config) -> list[int]:
    """The steps whose weights the run in ``store`` evaluates: ``eval_steps`` of its length (``run_length``: fewer
    than ``run.steps`` under ``run.rollout_budget``), and under ``run.eval_every_rollouts`` N each step t + 1
    after a step t whose rollouts took the rollouts generated past a multiple of N (the steps done so far
    decide)."""
    length, every = run_length(store, cfg), cfg.run.eval_every_rollouts
    steps = set(eval_steps(length, cfg.run.eval_every))
    if every:
        total = 0
        for step, n in enumerate(rollouts_generated(store, length)):
            if (total + n) // every > total // every:
                steps.add(step + 1)
            total += n
    return sorted(steps)


def evaluate(
    test: pd.DataFrame,
    engine: RolloutBackend,
    pool: Any,
    samples: int,
    temperature: float,
    max_tokens: int,
    seed: int,
    greedy: bool = False,
    top_p: float = 1.0,
    progress: bool = False,
    max_error_share: float = 1.0,
    where: str = "held-out evaluation",
) -> pd.DataFrame:
    """Per held-out prompt, the share of ``samples`` completions solved (verdict ``correct``), greedy when
    temperature is 0, and with ``greedy`` also ``accuracy_greedy``; ``samples`` and ``solved`` (pass@k's
    input), ``answered``, ``boxed``, ``errors``, ``timeouts`` (the columns: docs/design.md, "Step tables",
    ``eval``), and ``test``'s ``test_set``; what came back, kept: ``prompt_text`` (when ``test`` has it),
    ``sample_completion`` and ``sample_verdict`` (each prompt's first sampled completion; with ``greedy``,
    ``greedy_completion`` and ``greedy_verdict``).
    ``top_p``: the nucleus of a sampled evaluation. Each held-out set
    whose share of unscored completions is above ``max_error_share`` stops it (``ScoringError`` naming
    ``where`` and the set).
    """

    columns = ["reward", "answered", "boxed"]
    only_greedy = temperature == 0.0 and samples == 1
    kinds = [(samples, temperature)] + ([(1, 0.0)] if greedy and not only_greedy else [])
    batches = [
        (
            pd.DataFrame({"prompt_id": test["prompt_id"], "budget": n}),
            SamplingConfig(temperature=temp, top_p=top_p if temp > 0 else 1.0, max_tokens=max_tokens),
        )
        for n, temp in kinds
    ]
    # one engine call and one verification pass for the sampled and the greedy completions together
    tables = rollout_tables(batches, test, engine, run_seed=seed, step=-1, progress=progress)
    rolls = pd.concat([t.assign(_kind=k) for k, t in enumerate(tables)], ignore_index=True)
    rewards = reward_table(rolls, test, pool).assign(
        reward=lambda r: solved(r).astype(np.float64),  # accuracy: the share solved (a reward file's threshold)
        answered=lambda r: r["verdict"] != str(VerdictKind.NO_ANSWER),
        boxed=rolls["completion"].str.contains(BOXED, regex=False).to_numpy(),
        _kind=rolls["_kind"].to_numpy(),
    )
    if "test_set" in test:  # each held-out set on its own
        sets = rewards["prompt_id"].map(test.set_index("prompt_id")["test_set"])
        for name, part in rewards.groupby(sets, sort=False):
            check_error_share(part, f"{where} ({name})", max_error_share)
    else:
        check_error_share(rewards, where, max_error_share)

    def per_prompt(kind: int) -> pd.DataFrame:
        """Per prompt (in test order): mean reward, share of completions with an answer, share with \\boxed{}."""
        of_kind = rewards[rewards["_kind"] == kind]
        return of_kind.groupby("prompt_id", sort=False)[columns].mean().reindex(test["prompt_id"]).astype(np.float64)

    out = test[["prompt_id"]].copy()
    if "test_set" in test:  # the held-out set of each prompt (a run's data.test and data.extra_tests)
        out["test_set"] = test["test_set"].to_numpy()
    out["difficulty"] = test["difficulty"].to_numpy() if "difficulty" in test else -1
    sampled = per_prompt(0)
    out["accuracy"] = sampled["reward"].to_numpy()
    # what pass@k is computed from (coba_tasks.core.passk): completions drawn and solved, per prompt
    counts = rewards[rewards["_kind"] == 0].groupby("prompt_id", sort=False)["reward"].agg(["size", "sum"])
    counts = counts.reindex(test["prompt_id"])
    out["samples"] = counts["size"].to_numpy().astype(np.int64)
    out["solved"] = counts["sum"].round().to_numpy().astype(np.int64)
    out["answered"] = sampled["answered"].to_numpy()
    out["boxed"] = sampled["boxed"].to_numpy()
    for column, kind in (("errors", VerdictKind.ERROR), ("timeouts", VerdictKind.TIMEOUT)):
        count = (rewards["verdict"] == str(kind)).groupby(rewards["prompt_id"], sort=False).sum()
        out[column] = count.reindex(test["prompt_id"]).fillna(0).to_numpy().astype(np.int64)
    if greedy:
        out["accuracy_greedy"] = out["accuracy"].to_numpy() if only_greedy else per_prompt(1)["reward"].to_numpy()
    out["weight_version"] = engine.weight_version
    # what came back, kept: each prompt's first sampled completion and its verdict (and the greedy one's)
    if "prompt_text" in test:
        out["prompt_text"] = test["prompt_text"].astype(str).to_numpy()
    shown = rolls.assign(verdict=rewards["verdict"].to_numpy()).drop_duplicates(["_kind", "prompt_id"])
    for batch, name in ((0, "sample"), (1, "greedy")):
        first = shown[shown["_kind"] == batch].set_index("prompt_id").reindex(test["prompt_id"])
        if batch == 0 or (greedy and not only_greedy):
            out[f"{name}_completion"] = first["completion"].astype(object).to_numpy()
            out[f"{name}_verdict"] = first["verdict"].astype(object).to_numpy()
    return out.reset_index(drop=True)


# --- A model directory on a test file (coba-eval)


def _default(setting: str) -> Any:
    """The run config's default of ``setting``'s key."""
    section, key = CONFIG_KEYS[setting]
    return section.model_fields[key].default


def _setting(name: str, description: str, **constraints: Any) -> Any:
    """The field of setting ``name``: its run-config default, ``description`` ending in its config key, and
    ``constraints`` (``ge=1``, ...)."""
    section, key = CONFIG_KEYS[name]
    return Field(_default(name), description=f"{description} ({section.SECTION}.{key})", **constraints)


class EvalSettings(BaseModel):
    """How to evaluate a model on held-out prompts (the run config's evaluation fields, by another name)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    test_path: str = Field(_default("test_path"), description="held-out prompts (Parquet; a run's data.test)")
    samples: int = _setting("samples", "completions per prompt, avg@k", ge=1)
    temperature: float = _setting("temperature", "sampling temperature; 0 = greedy", ge=0)
    top_p: float = _setting("top_p", "nucleus of a sampled evaluation; 1.0 = none", gt=0, le=1)
    greedy: bool = _setting("greedy", "with a sampled evaluation, also decode greedily (accuracy_greedy)")
    max_tokens: int = _setting("max_tokens", "most tokens a completion has", ge=1)
    backend: str = _setting("backend", "rollout engine: vllm or transformers")
    eval_prompts: int = _setting("eval_prompts", "a seeded sample of this many prompts; 0 = all", ge=0)
    difficulties: tuple[int, ...] = _setting("difficulties", "keep the prompts of these levels; empty = every level")
    seed: int = _setting("seed", "seed of the prompt sample and of sampling")
    dtype: Dtype = _setting("dtype", "weights dtype")
    max_model_len: int = _setting("max_model_len", "engine context; 0 = the model's own", ge=0)
    prompt_format: PromptFormat = _setting("prompt_format", "prompt rendering")
    unknown_sources: UnknownSources = Field(
        _default("unknown_sources"),
        description="a data_source without a verifier: refuse it, or score it with math-verify",
    )
    gsm8k_answer: Gsm8kAnswer = _setting(
        "gsm8k_answer", "how GSM8K rows are scored: math-verify, or veRL's strict or flexible scorer"
    )
    max_error_share: float = _setting(
        "max_error_share", "share of completions scored error or timeout above which the evaluation stops", ge=0, le=1
    )

    @field_validator("backend")
    @classmethod
    def _known_backend(cls, value: str) -> str:
        if value not in backends():
            raise ValueError(f"unknown backend {value!r}; valid backends: {', '.join(backends())}")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> EvalSettings:
        if self.samples > 1 and self.temperature == 0:
            raise ValueError("samples > 1 needs temperature > 0 (greedy decoding repeats one completion)")
        if self.max_model_len and self.max_model_len <= self.max_tokens:
            raise ValueError(
                f"max_model_len must exceed max_tokens ({self.max_tokens}) to leave room for the prompt, or be 0 "
                f"for the model's own context length; got {self.max_model_len}"
            )
        return self

    @classmethod
    def from_config(cls, cfg: Config) -> EvalSettings:
        """The settings of a training run's held-out evaluations (its data.test, run.eval_*, rollout, model)."""
        return cls(
            **{name: getattr(getattr(cfg, section.SECTION), key) for name, (section, key) in CONFIG_KEYS.items()}
        )


def eval_settings(values: EvalSettings | dict[str, Any] | None = None, **changes: Any) -> EvalSettings:
    """``values`` (a model, a dict, or None for the defaults) with ``changes``, as a valid EvalSettings; else a
    ValueError of one line, each problem naming the field and what it needs.

    >>> eval_settings(samples=4, temperature=1.0).samples
    4
    >>> eval_settings({"samples": 0})
    Traceback (most recent call last):
    ValueError: eval settings: samples: Input should be greater than or equal to 1 (got 0)
    """
    base = values.model_dump() if isinstance(values, EvalSettings) else dict(values or {})
    try:
        return EvalSettings(**{**base, **changes})
    except ValidationError as e:
        raise ValueError("eval settings: " + "; ".join(_one_line(err) for err in e.errors())) from None


def _one_line(err: Any) -> str:
    """``field: message (got value)`` for one pydantic error (a check across fields names no field)."""
    field = ".".join(str(x) for x in err["loc"])
    message = err["msg"].removeprefix("Value error, ")
    got = f" (got {err['input']!r})" if field and not isinstance(err["input"], dict) else ""
    return f"{field}: {message}{got}" if field else message


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
    before an engine starts."""
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
    """Refuse an ``out_path`` that is an input of the evaluation (symlinks followed), ``overwrite`` or not, and
    what ``refuse_existing_out_path`` refuses."""
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


EVAL_TABLE_COLUMNS = ("prompt_id", "accuracy", "weight_version")  # what marks a per-prompt evaluation table


def is_eval_table(path: str | Path) -> bool:
    """Whether ``path`` is a Parquet file with ``EVAL_TABLE_COLUMNS`` (read from its schema alone)."""
    try:
        names = set(pq.read_schema(path).names)
    except (OSError, ValueError):  # not Parquet, unreadable
        return False
    return set(EVAL_TABLE_COLUMNS) <= names


def refuse_existing_out_path(out_path: str, overwrite: bool) -> None:
    """Refuse a directory, or an existing file unless ``overwrite`` and it is an earlier evaluation's table."""
    if Path(out_path).is_dir():
        raise ValueError(f"out_path {out_path} is a directory; give the path of the Parquet file to write")
    if Path(out_path).exists() and not overwrite:
        raise ValueError(
            f"out_path {out_path} already exists; nothing was written: choose another out_path, or pass "
            "overwrite=True to replace it"
        )
    if Path(out_path).exists() and not is_eval_table(out_path):
        raise ValueError(
            f"out_path {out_path} exists and is not an evaluation table (a Parquet file with "
            f"{', '.join(EVAL_TABLE_COLUMNS)}); overwrite=True replaces only an earlier evaluation's table: "
            "choose another out_path"
        )


def evaluate_model(model_path: str, settings: EvalSettings, progress: bool = False) -> pd.DataFrame:
    """Per-prompt held-out accuracy of the model (the engine and the verifier pool live only in this call),
    after the checks a training run makes of its prompts: ground truths, unknown data_sources, prompt lengths."""
    s = settings
    loaded = keep_difficulties(load_dataset(s.test_path), s.difficulties, s.test_path)  # as a run keeps them
    checked, _ = check_ground_truths(loaded, s.test_path, "error", s.unknown_sources, VERIFY.workers, VERIFY.timeout_s)
    with contextlib.ExitStack() as stack:
        engine_path = engine_weights(model_path, s.dtype, stack)
        tokenizer, context, context_from = model_context(engine_path, False, s.max_model_len)
        selected = sample_eval_prompts(checked, s.eval_prompts, s.seed)  # as a training run draws its held-out set
        test, unrendered = render_prompts(selected, tokenizer, s.prompt_format)
        if unrendered:
            raise DatasetError(s.test_path, unrendered)
        if context is not None:  # the same check and message as a run's (coba_tasks.pipeline.data)
            check_prompt_lengths(
                test,
                context,
                s.max_tokens,
                s.test_path,
                "error",
                context_from.replace("rollout.max_model_len", "max_model_len"),
            )
        engine = make_backend(s.backend, engine_path, dtype=s.dtype, max_model_len=s.max_model_len or None, seed=s.seed)
        stack.callback(engine.close)  # after the pool's (the stack closes in reverse)
        engine.weight_version = checkpoint_version(model_path)
        pool = stack.enter_context(
            VerifierPool(workers=VERIFY.workers, timeout_s=VERIFY.timeout_s, gsm8k_answer=s.gsm8k_answer)
        )
        table = evaluate(
            test,
            engine,
            pool,
            s.samples,
            s.temperature,
            s.max_tokens,
            s.seed,
            greedy=s.greedy,
            top_p=s.top_p,
            progress=progress,
            max_error_share=s.max_error_share,
        )
        return table.assign(data_source=test["data_source"].to_numpy()) if "data_source" in test else table


def engine_weights(model_path: str, dtype: str, stack: contextlib.ExitStack) -> str:
    """The model directory an engine samples ``model_path``'s policy from: itself, or a LoRA checkpoint merged
    into its base (in ``dtype``) in a temporary directory that ``stack`` removes."""
    if not is_adapter_checkpoint(model_path):
        return model_path
    merged = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="coba-eval-"))) / "merged"
    return str(merge_adapter_checkpoint(model_path, merged, getattr(torch, dtype, torch.float32)))


def write_eval_table(table: pd.DataFrame, out_path: str, overwrite: bool = False) -> str:
    """Write the per-prompt table as Parquet, atomically; an existing ``out_path`` (one that appeared during
    the evaluation, too) is replaced only with ``overwrite``."""
    refuse_existing_out_path(out_path, overwrite)
    return str(write_parquet(table, Path(out_path).resolve()))


# --- A run's checkpoint outside its run (coba-eval-watch), scored as the run scores it


def scoring_inputs(cfg: Config) -> dict[str, str]:
    """Config key -> path of the files a run's held-out evaluation reads (data.test, data.extra_tests, the reward
    file), under the keys of run.json's inputs (``run.run_inputs``)."""
    extra = {f"data.extra_tests[{i}]": p for i, p in enumerate(cfg.data.extra_tests)}
    spec = cfg.verify.reward_function.strip()
    reward = {"verify.reward_function": RewardFunction.from_spec(spec).path} if spec else {}
    return {"data.test": cfg.data.test, **extra, **reward}


def check_run_scoring(store: RunStore, cfg: Config) -> None:
    """Refuse, in one line, what would score the run's checkpoints otherwise than its own evaluations: a reward
    file or a model's own code this process may not run (``check_reward_files``, ``check_remote_code``), a
    held-out file or reward file that is not the one the run started with (its sha256 in run.json)."""
    check_reward_files(cfg)
    check_remote_code(cfg)
    recorded = store.run_info.get("inputs") or {}
    for key, path in scoring_inputs(cfg).items():
        now = content_sha256(path) if Path(path).is_file() else "missing"
        if now != (recorded.get(key) or {}).get("sha256"):
            raise StoreError(
                f"coba-eval-watch: {key} ({path}) is not the file run {store.root} started with (its sha256 in "
                "run.json differs), so the figures would not be the run's; restore it, or evaluate the checkpoint "
                "with coba eval; nothing evaluated"
            )


def sample_each_set(test: pd.DataFrame, prompts: int, seed: int) -> pd.DataFrame:
    """``sample_eval_prompts`` of each held-out set of ``test`` (column ``test_set``); 0: every prompt."""
    if not prompts:
        return test
    sets = (part.reset_index(drop=True) for _, part in test.groupby("test_set", sort=False))
    return pd.concat([sample_eval_prompts(part, prompts, seed) for part in sets], ignore_index=True)


def watched_checkpoint(store: RunStore, posted: int | None, before_hashing: Callable[[], None]) -> int | None:
    """The checkpoint the watch shows, the newest first: one an earlier watch posted (``posted``: nothing to do),
    one the run evaluated itself, or the first whose files are as its checkpoint.json lists them (the only one
    hashed, after ``before_hashing``); None when there is none."""
    for step in sorted(store.checkpoints(), reverse=True):
        if step == posted or store.is_done(step, Table.EVAL):
            return step
        before_hashing()  # what would refuse the evaluation refuses it before gigabytes are read
        if whole_checkpoint(store, step):
            return step
    return None


def evaluate_run_checkpoint(store: RunStore, cfg: Config, step: int, eval_prompts: int = 0) -> pd.DataFrame:
    """Per-prompt held-out accuracy of ``checkpoints/<step>`` as the run's own evaluation of those weights
    (``evaluate_step``) computes it, in an engine of its own: the run's held-out prompts (data.test and
    data.extra_tests: ``eval_prompt_set`` of ``load_run_datasets``), its verifier pool (``verifier_pool``: its
    reward file, if any), its run.eval_* settings; ``eval_prompts`` > 0: a seeded sample of each set. What cannot
    be matched is refused first (``check_run_scoring``)."""
    check_run_scoring(store, cfg)
    data = load_run_datasets(cfg, train=False)
    test = sample_each_set(eval_prompt_set(cfg, data.test, data.extra_tests), eval_prompts, cfg.run.seed)
    r, ckpt = cfg.run, store.checkpoint_dir(step)
    with contextlib.ExitStack() as stack:
        engine = make_backend(
            cfg.rollout.backend,
            engine_weights(str(ckpt), cfg.model.dtype, stack),
            dtype=cfg.model.dtype,
            max_model_len=cfg.rollout.max_model_len or None,
            seed=r.seed,
            trust_remote_code=cfg.model.trust_remote_code,
        )
        stack.callback(engine.close)  # after the pool's (the stack closes in reverse)
        engine.weight_version = step
        pool = stack.enter_context(verifier_pool(cfg))
        return evaluate(
            test,
            engine,
            pool,
            r.eval_samples,
            r.eval_temperature,
            cfg.rollout.max_tokens,
            r.seed,
            greedy=r.eval_greedy,
            top_p=r.eval_top_p,
            max_error_share=cfg.verify.max_error_share,
            where=f"held-out evaluation of {ckpt}",
        )


def pool_census(
    store: RunStore, cfg: Config, model_path: str, samples: int, prompts: int = 0, progress: bool = False
) -> pd.DataFrame:
    """Per prompt of the run's training pool (its prompts.parquet, as the run rendered them; ``prompts`` > 0: a
    seeded sample), ``solved`` of ``samples`` completions of ``model_path`` (a model directory, a checkpoint of
    this run or another, a LoRA checkpoint) at the run's training sampling (rollout.temperature, top_p,
    max_tokens), scored by the run's verifier pool (its reward file too): where a prompt lies between never and
    always solved, so which prompts more samples would crack. ``accuracy`` is solved / samples."""
    check_reward_files(cfg)
    check_remote_code(cfg)
    pool_prompts = store.read_run_table("prompts")
    if prompts:
        pool_prompts = sample_eval_prompts(pool_prompts, prompts, cfg.run.seed)
    ro = cfg.rollout
    with contextlib.ExitStack() as stack:
        engine = make_backend(
            ro.backend,
            engine_weights(model_path, cfg.model.dtype, stack),
            dtype=cfg.model.dtype,
            max_model_len=ro.max_model_len or None,
            seed=cfg.run.seed,
            trust_remote_code=cfg.model.trust_remote_code,
        )
        stack.callback(engine.close)
        engine.weight_version = checkpoint_version(model_path)
        pool = stack.enter_context(verifier_pool(cfg))
        return evaluate(
            pool_prompts,
            engine,
            pool,
            samples,
            ro.temperature,
            ro.max_tokens,
            cfg.run.seed,
            top_p=ro.top_p,
            progress=progress,
            max_error_share=cfg.verify.max_error_share,
            where=f"census of {model_path} on {store.root}'s training pool",
        )


# --- In a training run: the task, the weights it scores, which evaluations are due


@stage(Table.EVAL)
def evaluate_step(res: RunResources, step: int) -> pd.DataFrame:
    """Held-out accuracy of the weights after ``step`` updates (``Policy.holding``: loaded when the engine holds
    others, as in an evaluation recomputed later)."""
    r = res.cfg.run
    with res.policy.holding(step):
        table = evaluate(
            res.test,
            res.engine,
            res.pool,
            r.eval_samples,
            r.eval_temperature,
            res.cfg.rollout.max_tokens,
            r.seed,
            greedy=r.eval_greedy,
            top_p=r.eval_top_p,
            progress=sys.stderr.isatty(),  # the engine's progress bar, on a terminal
            max_error_share=res.cfg.verify.max_error_share,
            where=f"held-out evaluation at step {step}",
        )
    if set(table["weight_version"]) != {step}:  # never a table of other weights under this step's name
        raise StoreError(f"held-out evaluation at step {step} ran on weight version(s) {set(table['weight_version'])}")
    return table


def run_complete(store: RunStore, cfg: Config) -> bool:
    """Whether nothing of the run in ``store`` is left to compute: its summary written, every step done and every
    held-out evaluation its schedule asks for done (one left missing, say because its weights could not be
    rebuilt on that machine, is computed by the next resume)."""
    steps = run_length(store, cfg)
    return (
        (store.root / SUMMARY_FILE).is_file()
        and first_step_not_done(store, steps) >= steps
        and all(store.is_done(e, Table.EVAL) for e in run_eval_steps(store, cfg))
    )


def due_evaluations(res: RunResources, first: int) -> list[int]:
    """The held-out evaluations between training's first and last, at most ``first`` (the step a run continues
    at), not done (a kill after an update, a rerun or repair leaves one): the flow computes them first."""
    due = run_eval_steps(res.store, res.cfg)[1:-1]  # the evaluations before and after training have their own
    return [e for e in due if e <= first and not res.store.is_done(e, Table.EVAL)]


def eval_plan(res: RunResources) -> str:
    """What an evaluation of the run computes, in words: ``90 + 90 held-out prompts x (4 samples + greedy)``."""
    r = res.cfg.run
    sizes = res.test["test_set"].value_counts(sort=False) if "test_set" in res.test else [len(res.test)]
    kinds = f"{r.eval_samples} sample{'s' if r.eval_samples > 1 else ''} at T {r.eval_temperature:g}"
    if r.eval_temperature == 0 and r.eval_samples == 1:
        kinds = "greedy"
    elif r.eval_greedy:
        kinds += " + greedy"
    return f"{' + '.join(str(int(n)) for n in sizes)} held-out prompts x ({kinds})"
