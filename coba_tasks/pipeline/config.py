"""The run configuration: one typed, frozen pydantic model, validated on load and saved with every run.

A config file is a YAML mapping of sections, each a mapping of keys to values; a key left out takes the default
written beside its field in ``config_sections`` (docs/config.md, written by ``config_docs``). This module puts
the sections together as ``Config`` and reads, overrides, hashes and checks it; ``config_fields`` holds the
field types and the error messages. A ``Config`` that exists is valid, however it was built; every failure is a
``ConfigError`` (a ``ValueError``) of one line naming the dotted key (``optim.lr``) and the fix.

    cfg = load_config("configs/demo.yaml", ["optim.lr=3e-5", "allocation.strategy=uniform"])
    check_paths(cfg); check_platform(cfg)   # before a run starts: files exist, this machine can honour it

Type rules: an int, or a string that reads as a number (PyYAML reads ``3e-5`` as a string: YAML 1.1 wants
``3.0e-5``), is taken as a float; NaN and infinities are refused; a bool is never a number, nor a number or a
string a bool. ``--set`` values are parsed with YAML, except for string fields, which take the text verbatim
(``--set run.name=2024`` is the name "2024").
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml
from pydantic import Field, ValidationError, model_validator

from coba_tasks.pipeline.config_fields import (
    SECTIONS,
    ConfigError,
    Section,
    config_error,
    show,
    unknown_key,
    unknown_section,
)
from coba_tasks.pipeline.config_sections import (
    ROUND_SAMPLING_KEYS,
    AllocationConfig,
    DataConfig,
    ModelConfig,
    OptimConfig,
    RolloutConfig,
    RunConfig,
    VerifyConfig,
)

PROJECT_ROOT = Path(__file__).resolve().parents[2]  # coba_tasks/<layer>/this file
DEFAULT_CONFIG_PATH = PROJECT_ROOT / "configs" / "demo.yaml"

# Keys added after runs were made: left out of config_hash while at their default (``HASH_NEUTRAL_DEFAULTS``), so
# a run made before the key existed keeps its hash (and can be resumed); any other value is hashed.
HASH_NEUTRAL_KEYS: tuple[tuple[str, str], ...] = tuple(
    (section, key)
    for section, keys in {
        "run": (
            "eval_top_p",
            "keep_checkpoints",
            "checkpoint_every",
            "trackers",
            "rollouts_timeout_s",
            "update_timeout_s",
            "eval_timeout_s",
            "rollout_budget",
            "eval_every_rollouts",
        ),
        "data": ("on_bad_rows", "prompt_format", "extra_tests", "difficulties"),
        "model": ("lora_rank", "lora_alpha", "lora_target_modules"),
        "rollout": ("sleep_during_update", "engines", "tensor_parallel_size", "weight_transport"),
        "allocation": (
            "estimator",
            "prior_strength",
            "posterior_decay",
            "pilot_rollouts",
            *ROUND_SAMPLING_KEYS,
        ),
        "optim": (
            "fsdp_processes",
            "lr_warmup_steps",
            "lr_schedule",
            "shared_prefix",
            "skip_zero_advantage",
            "rollout_correction",
            "rollout_correction_cap",
            "rollout_mask_threshold",
            "prompt_weighting",
        ),
        "verify": ("unknown_sources", "reward_function", "pass_threshold", "gsm8k_answer", "max_error_share"),
    }.items()
    for key in keys
)


class Config(Section):
    """A whole run's configuration; immutable, valid by construction."""

    run: RunConfig = Field(default_factory=RunConfig, description="name, seed, steps, evaluation schedule")
    data: DataConfig = Field(default_factory=DataConfig, description="datasets and batch size M")
    model: ModelConfig = Field(default_factory=ModelConfig, description="the policy checkpoint")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="rollout engine and sampling")
    allocation: AllocationConfig = Field(default_factory=AllocationConfig, description="rollout budgets")
    optim: OptimConfig = Field(default_factory=OptimConfig, description="the GRPO update")
    verify: VerifyConfig = Field(default_factory=VerifyConfig, description="reward verification")

    @model_validator(mode="before")
    @classmethod
    def _sections(cls, data: Any) -> Any:
        """An empty section (``optim:`` with nothing under it) takes its defaults."""
        if isinstance(data, Mapping):
            return {name: body for name, body in data.items() if body is not None}
        return data

    @model_validator(mode="after")
    def _across_sections(self) -> Config:
        if self.model.lora_rank > 0 and self.optim.fsdp_processes > 1:
            raise ConfigError(
                f"model.lora_rank = {self.model.lora_rank} with optim.fsdp_processes = {self.optim.fsdp_processes}: "
                "LoRA with FSDP is not supported; set optim.fsdp_processes=1 or model.lora_rank=0"
            )
        if self.run.checkpoint_every > 1 and self.optim.fsdp_processes > 1:
            raise ConfigError(
                f"run.checkpoint_every = {self.run.checkpoint_every} with optim.fsdp_processes = "
                f"{self.optim.fsdp_processes}: each FSDP update starts from the previous step's checkpoint; set "
                "run.checkpoint_every=1"
            )
        a, m = self.allocation, self.data.prompts_per_step
        if not a.min_budget <= a.group_size <= a.max_budget:
            total = m * a.group_size
            raise ConfigError(
                f"allocation.group_size = {a.group_size} is outside [allocation.min_budget, allocation.max_budget]"
                f" = [{a.min_budget}, {a.max_budget}]: B_total = M * G = {m} * {a.group_size} = {total} cannot be"
                f" split into {m} groups of {a.min_budget} to {a.max_budget} rollouts (needs {m * a.min_budget}"
                f" <= B_total <= {m * a.max_budget}); set group_size between {a.min_budget} and {a.max_budget}"
            )
        return self

    def budget_per_step(self) -> int:
        """B_total = M * G, the rollouts of one training step."""
        return self.data.prompts_per_step * self.allocation.group_size


_DEFAULTS = Config().model_dump(mode="json")
HASH_NEUTRAL_DEFAULTS: dict[tuple[str, str], Any] = {(s, k): _DEFAULTS[s][k] for s, k in HASH_NEUTRAL_KEYS}


# --- Loading, overrides, saving


def load_config(
    path: str | os.PathLike[str] | None = None, overrides: Sequence[str] = (), untrusted: str | None = None
) -> Config:
    """Read a YAML config file (None: the project's ``configs/demo.yaml``), apply the ``--set`` overrides in order,
    validate. ``untrusted``: the name of the parameter that gave ``path`` when its caller may not read the file
    (a deployment's ``config_path``): the file's errors then never show its text (``_read_untrusted``).

    >>> cfg = load_config(overrides=["data.prompts_per_step=4", "allocation.group_size=8", "optim.lr=3e-5"])
    >>> cfg.budget_per_step(), cfg.optim.lr
    (32, 3e-05)
    """
    file = Path(path) if path is not None else DEFAULT_CONFIG_PATH
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(
            f"config file {file} does not exist (the shipped ones are in {PROJECT_ROOT / 'configs'})"
        ) from None
    except IsADirectoryError:
        raise ConfigError(f"config file {file} is a directory; pass a YAML file such as configs/demo.yaml") from None
    except (OSError, UnicodeDecodeError) as e:
        if untrusted:
            why = "not UTF-8 text" if isinstance(e, UnicodeDecodeError) else e.strerror
            raise ConfigError(_withheld(untrusted, file, f": cannot be read ({why})")) from None
        raise ConfigError(f"cannot read config file {file}: {e}") from e
    raw = _read_untrusted(text, file, untrusted) if untrusted else _parse_yaml(text, str(file))
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{file}: expected a mapping of sections ({', '.join(SECTIONS)}), got {show(raw)}")
    # an unknown key is the file's (overrides' keys are checked as they are applied): named with the file
    return _validate(_apply_overrides(raw, overrides), f" in {file}")


def apply_overrides(cfg: Config, overrides: Sequence[str]) -> Config:
    """A new Config: ``cfg`` with ``section.key=value`` overrides applied and validated again.

    >>> apply_overrides(Config(), ["allocation.strategy=uniform"]).allocation.strategy
    'uniform'
    """
    return config_from_dict(_apply_overrides(config_to_dict(cfg), overrides))


def config_from_dict(data: Mapping[str, Any]) -> Config:
    """Build and validate a Config from a mapping of sections (what ``config_to_dict`` gives)."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"a config is a mapping of sections ({', '.join(SECTIONS)}), got {show(data)}")
    return _validate(data, "")


def config_to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    """Plain nested dict of the config (JSON- and YAML-safe: tuples become lists)."""
    return cfg.model_dump(mode="json")


def config_hash(cfg: Config) -> str:
    """First 16 hex digits of the sha256 of the config's canonical JSON, without ``HASH_NEUTRAL_DEFAULTS``."""
    data = config_to_dict(cfg)
    for (section, key), default in HASH_NEUTRAL_DEFAULTS.items():
        if data[section][key] == default:
            del data[section][key]
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# owner/name, as the Hugging Face Hub names a model (a model.path of this form that is not a directory)
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def check_paths(cfg: Config, root: str | os.PathLike[str] | None = None) -> None:
    """ConfigError naming the key unless the datasets and the model directory exist (relative to ``root``,
    default the working directory). Apart from ``load_config``: the demo bootstraps a missing model."""
    base = Path(root) if root is not None else Path.cwd()

    def resolve(p: str) -> Path:
        return base / Path(p).expanduser()

    def where(p: str) -> str:
        return "" if Path(p).expanduser().is_absolute() else f" (relative to {base})"

    extra = [(f"data.extra_tests[{i}]", p) for i, p in enumerate(cfg.data.extra_tests)]
    for key, value in (("data.train", cfg.data.train), ("data.test", cfg.data.test), *extra):
        if not resolve(value).exists():
            raise ConfigError(
                f"{key}: {value} does not exist{where(value)}; point {key} at a veRL or flat Parquet file,"
                " or regenerate the arithmetic task with `python data/make_arith.py`"
            )
    model = resolve(cfg.model.path)
    if not (model / "config.json").is_file():
        owner = str(cfg.model.path).split("/", 1)[0]  # a Hub id's owner is not a directory here
        if (
            not model.exists()
            and HUB_ID.fullmatch(str(cfg.model.path))
            and owner != "models"
            and not resolve(owner).exists()
        ):
            local = f"models/{str(cfg.model.path).rsplit('/', 1)[-1]}"
            raise ConfigError(
                f"model.path: {cfg.model.path} is not a directory{where(cfg.model.path)} but looks like a Hugging "
                f"Face Hub id; coba-rl downloads nothing: fetch it first (`hf download {cfg.model.path} --local-dir "
                f"{local}`) and set model.path={local}"
            )
        what = "does not exist" if not model.exists() else "has no config.json (not a Hugging Face model directory)"
        raise ConfigError(
            f"model.path: {cfg.model.path} {what}{where(cfg.model.path)};"
            " build the default model with `coba bootstrap`, or set model.path to a local Hugging Face checkpoint"
        )


def check_platform(cfg: Config) -> None:
    """ConfigError naming the key for settings this machine cannot honour: sleep mode where the backend cannot
    sleep (vLLM's exists only on CUDA), tensor parallelism without CUDA, a weight transport the vLLM engine
    cannot use where it runs here (``weight_transport_refusal``), more FSDP ranks than GPUs on CUDA
    (without CUDA they are gloo processes, any number). Apart from ``load_config``, so that a GPU config can be
    loaded and checked on any machine."""
    import torch

    from coba_tasks.engines.rollout import engine_in_process, sleep_unavailable, weight_transport_refusal

    if cfg.rollout.sleep_during_update:
        why = sleep_unavailable(cfg.rollout.backend)
        if why:
            raise ConfigError(
                f"rollout.sleep_during_update = true: {why}; set rollout.sleep_during_update=false on this machine"
            )
    cuda = torch.cuda.is_available()
    tp = cfg.rollout.tensor_parallel_size
    if tp > 1 and not cuda:
        raise ConfigError(
            f"rollout.tensor_parallel_size = {tp}: tensor parallelism needs CUDA GPUs and this machine has none "
            "(vLLM's CPU build runs one worker per engine); set rollout.tensor_parallel_size=1 on this machine"
        )
    r = cfg.rollout
    if r.backend == "vllm":  # the engine's own rule, where it runs (vllm-ray's engines run where Ray puts them)
        why = weight_transport_refusal(r.weight_transport, engine_in_process(r.in_process, not cuda), not cuda, tp)
        if why:
            raise ConfigError(
                f"rollout.weight_transport = '{r.weight_transport}': {why}, on this machine "
                f"({'with' if cuda else 'without'} CUDA); set rollout.weight_transport=auto"
            )
    n = cfg.optim.fsdp_processes
    if n > 1 and cuda and n > torch.cuda.device_count():
        raise ConfigError(
            f"optim.fsdp_processes = {n}: each FSDP process needs a GPU of its own and this machine has "
            f"{torch.cuda.device_count()}; set optim.fsdp_processes to at most {torch.cuda.device_count()}"
        )


# the module each tracker of run.trackers imports; its pip extra of pyproject.toml has the tracker's name
TRACKER_MODULES = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}


def check_installed(trackers: Sequence[str]) -> None:
    """ConfigError naming the pip extra for a tracker of ``run.trackers`` whose library is not installed."""
    import importlib.util

    for name in trackers:
        if importlib.util.find_spec(TRACKER_MODULES[name]) is None:
            raise ConfigError(
                f"run.trackers: {name} is not installed; install it with pip install -e '.[{name}]' "
                f"(or '.[trackers]' for all three), or take {name} out of run.trackers"
            )


# --- Helpers


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key written twice in one mapping (PyYAML keeps the last silently)."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: dict[str, int] = {}
    for key_node, _ in node.value:
        if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
            if key_node.value in seen:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"key {key_node.value!r} appears twice (first on line {seen[key_node.value] + 1})",
                    key_node.start_mark,
                )
            seen[key_node.value] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=True)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _parse_yaml(text: str, where: str) -> Any:
    """YAML text to Python; ConfigError with file, line and column when it is not valid YAML."""
    try:
        return yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass: safe
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        at = f"{where}:{mark.line + 1}:{mark.column + 1}" if mark else where
        raise ConfigError(f"{at}: invalid YAML: {e.problem or e.context}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: invalid YAML: {e}") from e


def _withheld(name: str, file: Path, what: str) -> str:
    return (
        f"{name} {file}{what}; the file's text is not shown to the caller of a deployment: check the file where it "
        f"is (`coba run --config {file}` says what is wrong)"
    )


def _read_untrusted(text: str, file: Path, name: str) -> Mapping[str, Any]:
    """The checked sections of a file whose caller may not read it (``load_config``'s ``untrusted``): an error
    names the file, the line of bad YAML, or a section or key of the config (never one the file made up), and
    says nothing the file says; no exception that would is chained to it."""
    try:
        raw = yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass: safe
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        raise ConfigError(
            _withheld(name, file, f":{mark.line + 1}:{mark.column + 1}: invalid YAML" if mark else ": invalid YAML")
        ) from None
    except yaml.YAMLError:
        raise ConfigError(_withheld(name, file, ": invalid YAML")) from None
    raw = {} if raw is None else raw
    if not isinstance(raw, Mapping):
        got = f"a {type(raw).__name__}"
        raise ConfigError(_withheld(name, file, f": expected a mapping of sections ({', '.join(SECTIONS)}), got {got}"))
    for section, body in raw.items():
        if section not in SECTIONS:
            raise ConfigError(_withheld(name, file, f": an unknown section (valid sections: {', '.join(SECTIONS)})"))
        if body is not None and not isinstance(body, Mapping):
            raise ConfigError(_withheld(name, file, f": section {section} is not a mapping of key: value"))
        if any(k not in SECTIONS[section].model_fields for k in body or {}):
            valid = ", ".join(SECTIONS[section].model_fields)
            raise ConfigError(_withheld(name, file, f": an unknown key of {section} (valid keys: {valid})"))
    try:
        _validate(raw, "")
    except ConfigError as e:
        dotted = re.match(r"(\w+)\.(\w+)", str(e))  # the key a message starts with, when it is one of the config's
        field = SECTIONS[dotted[1]].model_fields.get(dotted[2]) if dotted and dotted[1] in SECTIONS else None
        what = ": a value is not valid"
        if dotted and field:
            what = f": the value of {dotted[0]} ({field.description}) is not valid"
        raise ConfigError(_withheld(name, file, what)) from None
    return raw


def _apply_overrides(raw: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """A copy of the raw sections with each ``section.key=value`` override set."""
    if isinstance(overrides, str):
        raise ConfigError(f"overrides must be a list of section.key=value strings, got the string {overrides!r}")
    out: dict[str, Any] = {name: dict(body) if isinstance(body, Mapping) else body for name, body in raw.items()}
    for item in overrides:
        if not isinstance(item, str) or "=" not in item:
            raise ConfigError(f"override {show(item)} must look like section.key=value, e.g. optim.lr=3e-5")
        dotted, text = (s.strip() for s in item.split("=", 1))
        name, _, key = dotted.partition(".")
        if name not in SECTIONS:
            raise ConfigError(unknown_section(name, f" in --set {item}", dotted))
        if key not in SECTIONS[name].model_fields:
            raise ConfigError(unknown_key(name, key, f" in --set {item}"))
        if not isinstance(out.get(name) or {}, Mapping):
            raise ConfigError(f"config section {name!r} must be a mapping of key: value, got {show(out[name])}")
        value = text if _verbatim(SECTIONS[name], key) else _parse_yaml(text, f"--set {dotted}")
        out[name] = {**(out.get(name) or {}), key: value}
    return out


def _verbatim(cls: type[Section], key: str) -> bool:
    """Whether ``--set`` gives this key its text as it is: a string field (a word list's too)."""
    hint = cls.model_fields[key].annotation
    return hint is str or (get_origin(hint) is Literal and all(isinstance(a, str) for a in get_args(hint)))


def _validate(data: Mapping[str, Any], where: str) -> Config:
    """``Config.model_validate`` with its ValidationError as a one-line ConfigError."""
    for name, body in data.items():  # (a key that is not a string cannot be a keyword of the sections' __init__)
        if not isinstance(name, str) or name not in SECTIONS:
            raise ConfigError(unknown_section(str(name), where))
        for key in body if isinstance(body, Mapping) else ():
            if not isinstance(key, str) or key not in SECTIONS[name].model_fields:
                raise ConfigError(unknown_key(name, str(key), where))
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise config_error(e, where=where) from None
