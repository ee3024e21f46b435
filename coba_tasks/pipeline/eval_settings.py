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

# each setting's key in a run's config (section, key): its default there, and where from_config reads it
CONFIG_KEYS: dict[str, tuple[type[Section], str]] = {
    "test_path": (DataConfig, "test"),
    "samples": (RunConfig, "eval_samples"),
    "temperature": (RunConfig, "eval_temperature"),
    "top_p": (RunConfig, "eval_top_p"),
    "max_tokens": (RolloutConfig, "max_tokens"),
    "backend": (RolloutConfig, "backend"),
    "eval_prompts": (DataConfig, "eval_prompts"),
    "seed": (RunConfig, "seed"),
    "dtype": (ModelConfig, "dtype"),
    "max_model_len": (RolloutConfig, "max_model_len"),
    "prompt_format": (DataConfig, "prompt_format"),
    "unknown_sources": (VerifyConfig, "unknown_sources"),
    "gsm8k_answer": (VerifyConfig, "gsm8k_answer"),
}


def _default(setting: str) -> Any:
    """The run config's default of ``setting``'s key: the one place the defaults are written."""
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
    max_tokens: int = _setting("max_tokens", "most tokens a completion has", ge=1)
    backend: str = _setting("backend", "rollout engine: vllm or transformers")
    eval_prompts: int = _setting("eval_prompts", "a seeded sample of this many prompts; 0 = all", ge=0)
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
