"""The settings of a held-out evaluation: one typed, frozen model, the ``coba-eval`` flow's parameter.

    settings = EvalSettings(test_path="data/arith_chat_test.parquet", samples=4, temperature=1.0, top_p=0.9)
    settings = EvalSettings.from_config(cfg)      # what a training run's evaluations use
    settings = eval_settings({"samples": 0})      # ValueError: one line naming the field and the fix

A Prefect deployment shows these fields (with their descriptions) in its parameter form and validates
them before the flow starts; the same checks run when the model is built in Python.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from coba_tasks.engines.rollout import backends
from coba_tasks.engines.verify import Gsm8kAnswer
from coba_tasks.pipeline.config import Config
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


def _default(section: type, key: str) -> Any:
    """The run config's default of ``section.key``: the one place the defaults are written."""
    return section.model_fields[key].default


class EvalSettings(BaseModel):
    """How to evaluate a model on held-out prompts (the run config's evaluation fields, by another name)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    test_path: str = Field(_default(DataConfig, "test"), description="held-out prompts (Parquet; a run's data.test)")
    samples: int = Field(
        _default(RunConfig, "eval_samples"), ge=1, description="completions per prompt, avg@k (run.eval_samples)"
    )
    temperature: float = Field(
        _default(RunConfig, "eval_temperature"),
        ge=0,
        description="sampling temperature; 0 = greedy (run.eval_temperature)",
    )
    top_p: float = Field(
        _default(RunConfig, "eval_top_p"),
        gt=0,
        le=1,
        description="nucleus of a sampled evaluation; 1.0 = none (run.eval_top_p)",
    )
    max_tokens: int = Field(
        _default(RolloutConfig, "max_tokens"), ge=1, description="most tokens a completion has (rollout.max_tokens)"
    )
    backend: str = Field(
        _default(RolloutConfig, "backend"), description="rollout engine: vllm or transformers (rollout.backend)"
    )
    eval_prompts: int = Field(
        _default(DataConfig, "eval_prompts"),
        ge=0,
        description="a seeded sample of this many prompts; 0 = all (data.eval_prompts)",
    )
    seed: int = Field(_default(RunConfig, "seed"), description="seed of the prompt sample and of sampling (run.seed)")
    dtype: Dtype = Field(_default(ModelConfig, "dtype"), description="weights dtype (model.dtype)")
    max_model_len: int = Field(
        _default(RolloutConfig, "max_model_len"),
        ge=0,
        description="engine context; 0 = the model's own (rollout.max_model_len)",
    )
    prompt_format: PromptFormat = Field(
        _default(DataConfig, "prompt_format"), description="prompt rendering (data.prompt_format)"
    )
    unknown_sources: UnknownSources = Field(
        _default(VerifyConfig, "unknown_sources"),
        description="a data_source without a verifier: refuse it, or score it with math-verify",
    )
    gsm8k_answer: Gsm8kAnswer = Field(
        _default(VerifyConfig, "gsm8k_answer"),
        description="how GSM8K rows are scored: math-verify, or veRL's strict or flexible scorer (verify.gsm8k_answer)",
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
            test_path=cfg.data.test,
            samples=cfg.run.eval_samples,
            temperature=cfg.run.eval_temperature,
            top_p=cfg.run.eval_top_p,
            max_tokens=cfg.rollout.max_tokens,
            backend=cfg.rollout.backend,
            eval_prompts=cfg.data.eval_prompts,
            seed=cfg.run.seed,
            dtype=cfg.model.dtype,
            max_model_len=cfg.rollout.max_model_len,
            prompt_format=cfg.data.prompt_format,
            unknown_sources=cfg.verify.unknown_sources,
            gsm8k_answer=cfg.verify.gsm8k_answer,
        )


def eval_settings(values: EvalSettings | dict[str, Any] | None = None, **changes: Any) -> EvalSettings:
    """``values`` (a model, a dict, or None for the defaults) with ``changes``, as a valid EvalSettings.

    Raises ValueError with one line a problem, each naming the field and what it needs.

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
