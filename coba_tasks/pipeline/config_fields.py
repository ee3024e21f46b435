"""The building blocks of the run configuration: the field types and their checks, ``config_key`` (a field:
its default, its description for docs/config.md, its bounds, the message of a value out of them), the
``Section`` base class (frozen, no unknown keys, no NaN or infinity) and ``config_error``, which makes
pydantic's ValidationError a one-line ``ConfigError`` naming the dotted key (``optim.lr``) and the fix.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any, ClassVar, Literal, Union, get_args, get_origin

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError
from pydantic_core import PydanticCustomError


class ConfigError(ValueError):
    """An invalid configuration; the message is one line that names the key and the fix."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))
        self.source: tuple[Any, ...] = ()  # (ValidationError, section prefix) it was made from, if any


# --- Field types: what pydantic's lax mode would take that a config must not


def _not_bool(value: Any) -> Any:
    if isinstance(value, bool):  # pydantic takes true for 1.0
        raise PydanticCustomError("float_type", "a bool is not a number")
    return value


def a_list(value: Any) -> Any:
    if not isinstance(value, list | tuple):  # pydantic takes a dict, a set or a generator for a tuple
        raise PydanticCustomError("tuple_type", "expected a list")
    return value


def rule(check: Callable[[Any], bool], message: str) -> AfterValidator:
    """A check of one value; its failure is reported with the field's ``fix`` (else ``message``)."""

    def run(value: Any) -> Any:
        if not check(value):
            raise PydanticCustomError("config", message)
        return value

    return AfterValidator(run)


def registered(registry: Callable[[], Sequence[str]]) -> AfterValidator:
    """The one check of a name against its registry (strategies, solvers, rollout backends)."""

    def run(value: str) -> str:
        if value not in registry():
            raise PydanticCustomError("config", "must be one of {names}", {"names": ", ".join(registry())})
        return value

    run.registry = registry  # type: ignore[attr-defined]  # (docs/config.md lists the names)
    return AfterValidator(run)


def name_list(value: Any) -> Any:
    """A list of names, also as one comma-separated string (``--set run.trackers=tensorboard,mlflow``);
    an empty value (``--set run.trackers=``) is the empty list."""
    if value is None:
        return []
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return a_list(value)


def _fspath(value: Any) -> Any:
    return os.fspath(value) if isinstance(value, os.PathLike) else value  # a Path is taken as its text


Number = Annotated[float, BeforeValidator(_not_bool)]
Text = Annotated[str, BeforeValidator(_fspath)]  # a plain string (or a path): --set takes its text verbatim
NonBlank = Annotated[Text, rule(lambda v: bool(v.strip()), "must not be blank")]


def config_key(default: Any, description: str, fix: str | None = None, **bounds: Any) -> Any:
    """A config key: its default, its description (docs/config.md) and bounds; ``fix`` is the message of a
    value out of them (else the bounds or word list, said in words)."""
    return Field(default, description=description, json_schema_extra={"fix": fix} if fix else None, **bounds)


SECTIONS: dict[str, type[Section]] = {}  # every section by its name, in the order defined (each registers itself)


class Section(BaseModel):
    """A config section: frozen, no unknown keys, no NaN or infinity; errors as one-line ConfigErrors. A subclass
    with a ``SECTION`` name registers itself in ``SECTIONS``; the whole ``Config`` has none."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)
    SECTION: ClassVar[str] = ""

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        if cls.SECTION:
            SECTIONS[cls.SECTION] = cls

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise config_error(e, prefix=(self.SECTION,) if self.SECTION else ()) from None

    def _fail(self, name: str, how: str) -> None:
        raise ConfigError(f"{self.SECTION}.{name} = {short(getattr(self, name))}: {how}")


# pydantic's error types: a key or section that should not be there, or is not a mapping; a value out of
# its bounds or word list (or failing a field's own check, "config"); the rest say the type is wrong
_STRUCTURE = ("extra_forbidden", "model_type", "model_attributes_type", "dict_type")
_BOUNDS = ("greater_than", "greater_than_equal", "less_than", "less_than_equal")
_VALUE = (*_BOUNDS, "literal_error", "config", "value_error")


def config_error(error: ValidationError, prefix: tuple[str, ...] = (), where: str = "") -> ConfigError:
    """The first problem of a ValidationError as one line that names the dotted key and the fix.

    ``where`` (`` in <file>``) is said of an unknown section or key; ``prefix`` is the section's name when
    a section was validated by itself (its errors' locations start at the key).
    """
    errors = error.errors()
    err = next((e for e in errors if e["type"] in _STRUCTURE), errors[0])
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, ConfigError):  # a section's own (pydantic calls its __init__) or a check across keys
        if not cause.source:
            return cause
        source_error, source_prefix = cause.source
        return config_error(source_error, source_prefix, where=where)
    loc, kind, value = (*prefix, *err["loc"]), err["type"], err["input"]
    out = _one_line(loc, kind, value, err, where)
    out.source = (error, prefix)  # a Config validating this section says it again with the file's name
    return out


def _one_line(loc: tuple[Any, ...], kind: str, value: Any, err: Any, where: str) -> ConfigError:
    if not loc:
        return ConfigError(f"a config is a mapping of sections ({', '.join(SECTIONS)}), got {show(value)}")
    section = str(loc[0])
    if len(loc) == 1:
        if kind == "extra_forbidden":
            return ConfigError(unknown_section(section, where))
        return ConfigError(f"config section {section!r}{where} must be a mapping of key: value, got {show(value)}")
    key = str(loc[1])
    if kind == "extra_forbidden":
        return ConfigError(unknown_key(section, key, where))
    field = SECTIONS[section].model_fields[key]
    if kind in _VALUE and not any(isinstance(p, str) for p in loc[2:]):  # (a union's member: a type error)
        fix = (field.json_schema_extra or {}).get("fix") if isinstance(field.json_schema_extra, dict) else None
        return ConfigError(
            f"{section}.{key} = {short(_as_read(field.annotation, value))}: {fix or _rule_text(field, err)}"
        )
    index = (
        "" if kind in ("missing", "too_short", "too_long") else "".join(f"[{p}]" for p in loc[2:] if isinstance(p, int))
    )
    expected = "a finite number" if kind == "finite_number" else expected_words(field.annotation, element=bool(index))
    return ConfigError(f"{section}.{key}{index}: expected {expected}, got {show(value)}")


# The names TRL (GRPOConfig) and veRL (its PPO/GRPO trainer config) give settings that coba-rl has under
# another name: name -> (coba-rl's key, whose name it is, how they differ). A user's unknown key or section
# whose last dotted part is one of them is answered with coba-rl's key.
PEER_NAMES: dict[str, tuple[str, str, str]] = {
    "learning_rate": ("optim.lr", "TRL's", ""),
    "lr": ("optim.lr", "veRL's actor.optim.", ""),
    "warmup_steps": ("optim.lr_warmup_steps", "TRL's", ""),
    "num_generations": ("allocation.group_size", "TRL's", ": rollouts per prompt"),
    "n": ("allocation.group_size", "veRL's rollout.", ": rollouts per prompt"),
    "max_completion_length": ("rollout.max_tokens", "TRL's", ""),
    "response_length": ("rollout.max_tokens", "veRL's rollout.", ""),
    "max_response_length": ("rollout.max_tokens", "veRL's data.", ""),
    "temperature": ("rollout.temperature", "TRL's and veRL's", ""),
    "top_p": ("rollout.top_p", "TRL's and veRL's", ""),
    "beta": ("optim.kl_coef", "TRL's", ": the KL coefficient"),
    "kl_loss_coef": ("optim.kl_coef", "veRL's actor.", ""),
    "epsilon": ("optim.clip_low", "TRL's", ""),
    "epsilon_high": ("optim.clip_high", "TRL's", ""),
    "clip_ratio": ("optim.clip_low", "veRL's actor.", ""),
    "clip_ratio_low": ("optim.clip_low", "veRL's actor.", ""),
    "clip_ratio_high": ("optim.clip_high", "veRL's actor.", ""),
    "num_iterations": ("optim.update_epochs", "TRL's", ""),
    "ppo_epochs": ("optim.update_epochs", "veRL's actor.", ""),
    "train_batch_size": ("data.prompts_per_step", "veRL's data.", ": prompts per step"),
    "ppo_mini_batch_size": (
        "optim.mini_batches",
        "veRL's actor.",
        ", a count where veRL's is a size: data.prompts_per_step / ppo_mini_batch_size",
    ),
    "ppo_micro_batch_size_per_gpu": ("optim.micro_batch_size", "veRL's actor.", ": sequences per forward/backward"),
    "per_device_train_batch_size": ("optim.micro_batch_size", "TRL's", ": sequences per forward/backward"),
    "max_grad_norm": ("optim.max_grad_norm", "TRL's", ""),
    "grad_clip": ("optim.max_grad_norm", "veRL's actor.", ""),
    "weight_decay": ("optim.weight_decay", "TRL's and veRL's", ""),
    "max_steps": ("run.steps", "TRL's", ""),
    "total_training_steps": ("run.steps", "veRL's trainer.", ""),
    "seed": ("run.seed", "TRL's and veRL's", ""),
    "model_name_or_path": ("model.path", "TRL's", ""),
    "gen_batch_size": ("allocation.gen_batch_size", "veRL's data.", ""),
    "max_num_gen_batches": ("allocation.max_num_gen_batches", "veRL's algorithm.filter_groups.", ""),
}


def peer_hint(dotted: str) -> str:
    """`` (TRL's learning_rate is coba-rl's optim.lr)`` where the last part of ``dotted`` is another trainer's name
    for a coba-rl key (``PEER_NAMES``); "" otherwise."""
    name = dotted.rsplit(".", 1)[-1]
    if name not in PEER_NAMES:
        return ""
    key, whose, note = PEER_NAMES[name]
    return f" ({whose}{'' if whose.endswith('.') else ' '}{name} is coba-rl's {key}{note})"


def unknown_section(name: str, where: str, dotted: str = "") -> str:
    hint = peer_hint(dotted or name) or did_you_mean(name, SECTIONS)
    return f"unknown config section {name!r}{where}{hint}; valid sections: {', '.join(SECTIONS)}"


def unknown_key(section: str, key: str, where: str) -> str:
    valid = list(SECTIONS[section].model_fields)
    return (
        f"unknown config key '{section}.{key}'{where}{peer_hint(key) or did_you_mean(key, valid)};"
        f" valid keys of {section}: {', '.join(valid)}"
    )


def _rule_text(field: Any, err: Any) -> str:
    """A field's bounds or words, said as ``must be ...`` (its check's own message otherwise)."""
    if err["type"] == "literal_error":
        return f"must be one of {', '.join(map(str, get_args(field.annotation)))}"
    if err["type"] in ("config", "value_error"):
        return str(err["msg"]).removeprefix("Value error, ")
    return f"{bounds_text(field) or err['msg']} ({field.description})"


def bounds_text(field: Any) -> str:
    b = {k: getattr(m, k) for m in field.metadata for k in ("gt", "ge", "lt", "le") if getattr(m, k, None) is not None}
    low = ("(", b["gt"]) if "gt" in b else ("[", b["ge"]) if "ge" in b else None
    high = (")", b["lt"]) if "lt" in b else ("]", b["le"]) if "le" in b else None
    if low and high:
        return f"must be {low[1]}" if low[1] == high[1] else f"must be in {low[0]}{low[1]}, {high[1]}{high[0]}"
    if low:
        return f"must be {'>' if low[0] == '(' else '>='} {low[1]}"
    if high:
        return f"must be {'<' if high[0] == ')' else '<='} {high[1]}"
    return ""


def _strip(hint: Any) -> Any:
    return get_args(hint)[0] if get_origin(hint) is Annotated else hint


def expected_words(hint: Any, element: bool = False) -> str:
    """What a key of type ``hint`` takes, in words (``element``: an item of a list-valued key)."""
    hint = _strip(hint)
    origin, args = get_origin(hint), get_args(hint)
    if origin is tuple:
        word = expected_words(args[0])
        if element:
            return word
        plural = word.split()[-1] + "s"
        return f"a list of {plural}" if len(args) == 2 and args[1] is Ellipsis else f"a list of {len(args)} {plural}"
    if origin in (Union, type(int | None)):
        words = " or ".join(expected_words(a) for a in args if a is not type(None))
        return words + (" or null" if type(None) in args else "")
    if origin is Literal:
        return "a string"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(hint, str(hint))


def _as_read(hint: Any, value: Any) -> Any:
    """A number as the key reads it (an int or a numeric string as a float where the key is a float)."""
    floats = float in (hint, *get_args(hint))
    if floats and isinstance(value, int | str) and not isinstance(value, bool):
        try:
            return float(value)
        except (ValueError, OverflowError):
            return value
    return value


def short(value: Any, limit: int = 60) -> str:
    text = repr(plain(value))
    return text if len(text) <= limit else text[: limit - 3] + "..."


def show(value: Any) -> str:
    return f"{short(value)} ({type(value).__name__})"


def did_you_mean(word: Any, valid: Sequence[str] | Mapping[str, Any]) -> str:
    close = difflib.get_close_matches(str(word), list(valid), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value
