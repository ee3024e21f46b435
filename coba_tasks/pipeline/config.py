"""The run configuration: one typed, frozen pydantic model, validated on load and saved with every run.

A config file is a YAML mapping of sections (``run``, ``data``, ``model``, ``rollout``,
``allocation``, ``optim``, ``verify``), each a mapping of keys to values; a key left out takes the
default written beside its field below (docs/config.md lists them all, with what they mean;
``config_reference`` writes that page).

    cfg = load_config("configs/demo.yaml", ["optim.lr=3e-5", "allocation.strategy=uniform"])
    cfg.budget_per_step()            # B_total = M * G rollouts per training step
    check_paths(cfg)                 # data files and model directory exist (before a run starts)
    check_platform(cfg)              # settings this machine cannot honour (sleep mode or TP without CUDA, ...)

Each section is a pydantic model (frozen, no unknown keys, no NaN or infinity) whose fields carry
their bounds, word lists (``Literal``) and descriptions; checks that span keys are the sections' and
``Config``'s model validators. A ``Config`` that exists is valid, however it was built. Every
failure is a ``ConfigError`` (a ``ValueError``) with a one-line message that names the dotted key
(``optim.lr``) and says how to fix it (``_config_error`` turns pydantic's ValidationError into it).

Type rules: an int is accepted where a float is expected, and so is a string that reads as a
number (PyYAML reads ``3e-5`` as a string: YAML 1.1 wants ``3.0e-5``); NaN and infinities are
refused; a bool is never taken for a number, nor a number or a string for a bool. Overrides (the
CLI's ``--set section.key=value``) are parsed with YAML, except for string fields, which take the
text verbatim (so ``--set run.name=2024`` is the name "2024", not an error).
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Union, get_args, get_origin

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from coba_tasks.core.allocators import Mode, strategies
from coba_tasks.core.solvers import coba_solvers
from coba_tasks.engines.rollout import backends

PROJECT_ROOT = Path(__file__).resolve().parents[2]  # coba_tasks/<layer>/this file
DEFAULT_CONFIG_PATH = PROJECT_ROOT / "configs" / "demo.yaml"
MAX_SEED = 2**63 - 1  # torch.manual_seed takes at most a 64-bit seed

# The word-valued keys: each Literal is the one list of its words (readers take typing.get_args of it)
Dtype = Literal["float32", "bfloat16", "float16", "auto"]  # model.dtype
OnBadRows = Literal["error", "skip"]  # data.on_bad_rows (coba_tasks.pipeline.data_problems)
PromptFormat = Literal["auto", "chat", "raw"]  # data.prompt_format (coba_tasks.pipeline.data_prompts.render_prompts)
UnknownSources = Literal["error", "math"]  # verify.unknown_sources (coba_tasks.pipeline.data_run)
Schedule = Literal["adaptive", "reversed", "fixed"]  # allocation.schedule: the paper's ablations reverse or fix it
ModeName = Literal["paper", "released"]  # allocation.mode: the values of coba_tasks.core.allocators.Mode
# optim.rollout_correction: coba_tasks.core.grpo.RolloutCorrection's values (not imported here: it pulls in torch)
RolloutCorrectionLevel = Literal["none", "token", "sequence"]
DTYPES = get_args(Dtype)
assert set(get_args(ModeName)) == {m.value for m in Mode}, "allocation.mode's words are Mode's values"

# Keys added after runs were made: left out of config_hash while at these defaults, so a run made
# before the key existed keeps its hash (and can be resumed); any other value is hashed.
HASH_NEUTRAL_DEFAULTS: dict[tuple[str, str], Any] = {
    ("data", "on_bad_rows"): "error",
    ("data", "prompt_format"): "auto",
    ("run", "eval_top_p"): 1.0,
    ("rollout", "sleep_during_update"): False,
    ("rollout", "engines"): 1,
    ("optim", "fsdp_processes"): 1,
    ("rollout", "tensor_parallel_size"): 1,
    ("optim", "lr_warmup_steps"): 0,
    ("optim", "shared_prefix"): True,
    ("run", "keep_checkpoints"): 0,
    ("verify", "unknown_sources"): "error",
    ("optim", "skip_zero_advantage"): True,
    ("model", "lora_rank"): 0,
    ("model", "lora_alpha"): 32.0,
    ("model", "lora_target_modules"): "all-linear",
    ("data", "extra_tests"): [],
    ("data", "difficulties"): [],
    ("verify", "reward_function"): "",
    ("verify", "pass_threshold"): 1.0,
    ("optim", "rollout_correction"): "none",
    ("optim", "rollout_correction_cap"): 2.0,
    ("optim", "rollout_mask_threshold"): 0.0,
    ("run", "trackers"): [],
}
TRACKERS = ("tensorboard", "mlflow", "wandb")  # run.trackers: the experiment trackers a run can log to
MAIN_TEST_SET = "test"  # the eval table's test_set of data.test; an extra test's is its file name without .parquet


def test_set_name(path: str) -> str:
    """The name an extra held-out set is reported under: its file name without the suffix.

    >>> test_set_name("data/arith_chat_test_reworded.parquet")
    'arith_chat_test_reworded'
    """
    return Path(path).name.removesuffix(".parquet")


_NAME_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")


class ConfigError(ValueError):
    """An invalid configuration; the message is one line that names the key and the fix."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))
        self.source: tuple[Any, ...] = ()  # (ValidationError, section prefix) it was made from, if any


# ---------------------------------------------------------------------------------------------
# Field types: what pydantic's lax mode would take that a config must not
# ---------------------------------------------------------------------------------------------


def _not_bool(value: Any) -> Any:
    if isinstance(value, bool):  # pydantic takes true for 1.0
        raise PydanticCustomError("float_type", "a bool is not a number")
    return value


def _a_list(value: Any) -> Any:
    if not isinstance(value, list | tuple):  # pydantic takes a dict, a set or a generator for a tuple
        raise PydanticCustomError("tuple_type", "expected a list")
    return value


def _rule(check: Callable[[Any], bool], message: str) -> AfterValidator:
    """A check of one value; its failure is reported with the field's ``fix`` (else ``message``)."""

    def run(value: Any) -> Any:
        if not check(value):
            raise PydanticCustomError("config", message)
        return value

    return AfterValidator(run)


def _registered(registry: Callable[[], Sequence[str]]) -> AfterValidator:
    """The one check of a name against its registry (strategies, solvers, rollout backends)."""

    def run(value: str) -> str:
        if value not in registry():
            raise PydanticCustomError("config", "must be one of {names}", {"names": ", ".join(registry())})
        return value

    run.registry = registry  # type: ignore[attr-defined]  # (docs/config.md lists the names)
    return AfterValidator(run)


def _names(value: Any) -> Any:
    """A list of names, also as one comma-separated string (``--set run.trackers=tensorboard,mlflow``);
    an empty value (``--set run.trackers=``) is the empty list."""
    if value is None:
        return []
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return _a_list(value)


def _known_trackers(names: tuple[str, ...]) -> bool:
    return all(n in TRACKERS for n in names) and len(set(names)) == len(names)


def _fspath(value: Any) -> Any:
    return os.fspath(value) if isinstance(value, os.PathLike) else value  # a Path is taken as its text


Number = Annotated[float, BeforeValidator(_not_bool)]
Text = Annotated[str, BeforeValidator(_fspath)]  # a plain string (or a path): --set takes its text verbatim
NonBlank = Annotated[Text, _rule(lambda v: bool(v.strip()), "must not be blank")]


def _key(default: Any, description: str, fix: str | None = None, **bounds: Any) -> Any:
    """A config key: its default, its description (docs/config.md) and bounds; ``fix`` is the message of a
    value out of them (else the bounds or word list, said in words)."""
    return Field(default, description=description, json_schema_extra={"fix": fix} if fix else None, **bounds)


class _Section(BaseModel):
    """A config section: frozen, no unknown keys, no NaN or infinity; errors as one-line ConfigErrors."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)
    SECTION: ClassVar[str] = ""

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise _config_error(e, prefix=(self.SECTION,) if self.SECTION else ()) from None

    def _fail(self, name: str, how: str) -> None:
        raise ConfigError(f"{self.SECTION}.{name} = {_short(getattr(self, name))}: {how}")


# ---------------------------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------------------------


class RunConfig(_Section):
    """The run as a whole: its name, seed, length and evaluation schedule."""

    SECTION: ClassVar[str] = "run"

    name: Annotated[Text, _rule(lambda v: bool(_NAME_RE.fullmatch(v)) and len(v) <= 200, "not a run name")] = _key(
        "demo",
        "run directory runs/<name>/: letters, digits, '-', '_', '.', not starting with '.'",
        "must be one path component (at most 200 characters) of letters, digits, '-', '_' and '.', "
        "not starting with '.' (e.g. coba-lr1e-4); it names the run directory runs/<name>/",
    )
    seed: StrictInt = _key(
        0,
        "root of every seed (rollouts, shuffling, init): seeds derive from (seed, step, prompt id)",
        ge=0,
        le=MAX_SEED,
    )
    steps: StrictInt = _key(
        20, "training steps; one step takes M prompts through rollout, verify, allocate, update", ge=1
    )
    eval_every: StrictInt = _key(
        5, "evaluate on held-out prompts every this many steps; 0 = only before and after training", ge=0
    )
    eval_samples: StrictInt = _key(
        1, "samples per held-out prompt (avg@k at eval_temperature); 1 with temperature 0 = greedy", ge=1
    )
    eval_temperature: Number = _key(0.0, "sampling temperature of evaluation; 0 = greedy", ge=0)
    eval_top_p: Number = _key(
        1.0, "nucleus sampling mass of a sampled evaluation, in (0, 1] (paper: 0.9 at temperature 1.0)", gt=0, le=1
    )
    eval_greedy: StrictBool = _key(
        True, "with a sampled evaluation, also measure greedy accuracy (eval accuracy_greedy)"
    )
    keep_checkpoints: StrictInt = _key(
        0, "checkpoints kept on disk, the newest; 0 = all (a rerun of update t needs checkpoint t)", ge=0
    )
    trackers: Annotated[tuple[str, ...], BeforeValidator(_names), _rule(_known_trackers, "not known trackers")] = _key(
        (),
        "experiment trackers each step's figures are logged to, offline under <run_dir>/trackers/ "
        f"({', '.join(TRACKERS)}; see Experiment trackers in docs/operations.md); empty = none",
        f"must be a list of distinct tracker names among {', '.join(TRACKERS)}, e.g. [tensorboard, mlflow] "
        "or --set run.trackers=tensorboard,mlflow",
    )

    @model_validator(mode="after")
    def _samples_need_sampling(self) -> RunConfig:
        if self.eval_samples > 1 and self.eval_temperature == 0:
            self._fail(
                "eval_samples",
                "more than one sample needs run.eval_temperature > 0 (greedy decoding repeats one completion); "
                "set run.eval_samples=1 or run.eval_temperature=1.0",
            )
        return self


def _distinct_test_sets(paths: tuple[str, ...]) -> bool:
    names = [test_set_name(p) for p in paths]
    return all(p.strip() for p in paths) and len(set(names)) == len(names) and MAIN_TEST_SET not in names


class DataConfig(_Section):
    """Datasets: veRL-format (or flat prompt/answer) Parquet files."""

    SECTION: ClassVar[str] = "data"

    train: NonBlank = _key(
        "data/arith_train.parquet",
        "training prompts (Parquet); relative paths are from the working directory",
        "must name a Parquet file",
    )
    test: NonBlank = _key(
        "data/arith_test.parquet", "held-out prompts for evaluation (Parquet)", "must name a Parquet file"
    )
    extra_tests: Annotated[
        tuple[str, ...], BeforeValidator(_a_list), _rule(_distinct_test_sets, "not distinct test sets")
    ] = _key(
        (),
        "more held-out sets, each evaluated beside data.test and reported under its file name (e.g. the same "
        "problems worded differently); the same eval_prompts sample (positions) is taken of each",
        f"must be Parquet files with distinct file names other than {MAIN_TEST_SET}.parquet "
        "(each set is reported under its file name), e.g. [data/arith_chat_test_reworded.parquet]",
    )
    difficulties: Annotated[tuple[StrictInt, ...], BeforeValidator(_a_list)] = _key(
        (),
        "keep only the rows of these difficulty levels (extra_info.difficulty), in data.train, data.test and "
        "data.extra_tests; empty = every row",
    )
    prompts_per_step: StrictInt = _key(32, "M, prompts in each training step's batch", ge=1)
    eval_prompts: StrictInt = _key(
        0, "held-out prompts used per evaluation (a seeded sample); 0 = all of data.test", ge=0
    )
    train_prompts: StrictInt = _key(
        0, "training pool: a seeded sample of this many prompts of data.train; 0 = all", ge=0
    )
    shuffle: StrictBool = _key(
        True, "shuffle the prompt order of each epoch (a pass over the training pool) with run.seed"
    )
    on_bad_rows: OnBadRows = _key(
        "error",
        "a bad row (or over-long prompt): error = refuse the run; skip = drop it, list it",
        "must be error (a bad row stops the run before it starts) or skip (bad rows are dropped and "
        "listed in the run's bad_rows.parquet)",
    )
    prompt_format: PromptFormat = _key(
        "auto",
        "chat: the tokenizer's chat template; raw: last user message as text; auto: chat if any",
        "must be auto (the chat template when the tokenizer has one), chat (the tokenizer's chat template "
        "over the whole message list) or raw (the last user message as plain text: base models)",
    )


class ModelConfig(_Section):
    """The policy: a Hugging Face causal LM checkpoint directory."""

    SECTION: ClassVar[str] = "model"

    path: NonBlank = _key(
        "models/arith-tiny",
        "local HF checkpoint directory (config.json, weights, tokenizer)",
        "must name a model directory",
    )
    dtype: Dtype = _key("float32", "weights dtype for training and rollouts: float32, bfloat16, float16 or auto")
    trust_remote_code: StrictBool = _key(
        False, "allow the checkpoint's own modelling code (only for checkpoints you trust)"
    )
    gradient_checkpointing: StrictBool = _key(
        False, "recompute activations in the backward pass: less memory, more time"
    )
    lora_rank: StrictInt = _key(
        0, "0 = full fine-tuning; r > 0 = train LoRA adapters of rank r (peft) on the target modules", ge=0
    )
    lora_alpha: Number = _key(32.0, "LoRA scale alpha: the update is (alpha / r) * B @ A", gt=0)
    lora_target_modules: Annotated[Text, _rule(lambda v: bool(v.strip(", ")), "no modules")] = _key(
        "all-linear",
        "all-linear (every linear layer but the output) or names, comma-separated",
        "must be all-linear or module names separated by commas (e.g. q_proj,v_proj)",
    )


class RolloutConfig(_Section):
    """Rollout generation: the engine and how completions are sampled."""

    SECTION: ClassVar[str] = "rollout"

    backend: Annotated[Text, _registered(backends)] = _key(
        "vllm", "rollout engine (coba_tasks.engines.rollout.backends()): vllm, vllm-ray, or transformers (fallback)"
    )
    temperature: Number = _key(
        1.0,
        "sampling temperature of training rollouts (> 0); the update trains on log_softmax(z / T)",
        "must be > 0: training rollouts are sampled (greedy ones would make every group's rewards equal); "
        "1.0 is the paper's",
        gt=0,
    )
    top_p: Number = _key(
        1.0,
        "nucleus sampling of training rollouts: 1.0 only (docs/method.md says why)",
        "must be 1.0: a nucleus-truncated sampler draws from a distribution the policy gradient does not see "
        "(docs/method.md, 'Log-probabilities'); run.eval_top_p sets the evaluation's nucleus",
        ge=1,
        le=1,
    )
    max_tokens: StrictInt = _key(12, "most tokens generated per completion", ge=1)
    max_model_len: StrictInt = _key(64, "engine context length (prompt + completion); 0 = the model's own", ge=0)
    gpu_memory_utilization: Number = _key(0.5, "share of GPU memory vLLM may take (ignored on CPU)", gt=0, le=1)
    in_process: StrictBool | None = _key(
        None, "run the vLLM engine in this process; null = auto (yes on CPU, no on GPU)"
    )
    sleep_during_update: StrictBool = _key(False, "free the engine's GPU memory while the GRPO update runs (CUDA only)")
    engines: StrictInt = _key(
        1, "vLLM engines (Ray actors) of the vllm-ray backend (docs/scale_out.md); 1 for the others", ge=1
    )
    tensor_parallel_size: StrictInt = _key(
        1, "GPUs each vLLM engine is split over (vLLM's tensor parallelism; CUDA only)", ge=1
    )

    @model_validator(mode="after")
    def _consistent(self) -> RolloutConfig:
        if self.max_model_len and self.max_model_len <= self.max_tokens:
            self._fail(
                "max_model_len",
                f"must exceed rollout.max_tokens ({self.max_tokens}) to leave room for the prompt, "
                "or be 0 for the model's own context length",
            )
        if self.engines != 1 and self.backend != "vllm-ray":
            self._fail(
                "engines",
                f"must be 1 with rollout.backend={self.backend}: only the vllm-ray backend runs several engines",
            )
        if self.tensor_parallel_size != 1 and self.backend == "transformers":
            self._fail(
                "tensor_parallel_size",
                "must be 1 with rollout.backend=transformers: only vLLM splits a model over GPUs",
            )
        if self.tensor_parallel_size != 1 and self.in_process is True:
            self._fail(
                "tensor_parallel_size",
                "must be 1 with rollout.in_process=true (vLLM's in-process executor runs one worker); "
                "set rollout.in_process=null",
            )
        return self


_TAU = "must be 'adaptive' or a positive number (the saturation scale of eta, docs/method.md)"


class AllocationConfig(_Section):
    """Rollout-budget allocation (docs/method.md)."""

    SECTION: ClassVar[str] = "allocation"

    strategy: Annotated[Text, _registered(strategies)] = _key(
        "coba", "allocator (coba_tasks.core.allocators.strategies()): coba, knapsack or uniform"
    )
    mode: ModeName = _key(
        "paper", "coba variant: paper (heap over all prompts) or released (the authors' released code)"
    )
    solver: Annotated[Text, _registered(coba_solvers)] = _key(
        "heap", "coba solver: heap (Algorithm 1), threshold (closed form) or dp (exact, slow)"
    )
    group_size: StrictInt = _key(16, "G, the mean group size: B_total = M * G rollouts per step", ge=1)
    min_budget: StrictInt = _key(
        2,
        "B_low, fewest rollouts per prompt (>= 2: a group of one has no advantage)",
        "must be >= 2: a GRPO group of one rollout has no advantage (set allocation.min_budget=2)",
        ge=2,
    )
    max_budget: StrictInt = _key(128, "B_up, most rollouts per prompt (>= allocation.min_budget)")
    schedule: Schedule = _key("adaptive", "(alpha, beta): adaptive (from F), reversed (explore then exploit) or fixed")
    fixed_alpha: Number = _key(5.5, "alpha of the Beta density when schedule is fixed", gt=0)
    fixed_beta: Number = _key(5.5, "beta of the Beta density when schedule is fixed", gt=0)
    tau: Literal["adaptive"] | float = _key(
        "adaptive", "saturation scale of eta(B, p): adaptive (from the spread of pass rates) or a number > 0", _TAU
    )
    kappa: Number = _key(
        11.0,
        "alpha + beta of the Beta density (> 2)",
        "must be > 2 so that alpha and beta can both exceed 1 (paper: 11)",
        gt=2,
    )
    gamma: Number = _key(10.0, "steepness of the sigmoid applied to the failure rate when it is <= 0.5", gt=0)
    capability_window: StrictInt = _key(1, "steps in the moving average of the failure rate", ge=1)
    pass_rate_window: StrictInt = _key(1, "a prompt's last visits whose pass rates give its p_i", ge=1)

    @field_validator("tau", mode="before")
    @classmethod
    def _tau(cls, value: Any) -> Any:
        """'adaptive', or a positive number (a numeric string too)."""
        if isinstance(value, bool):
            raise PydanticCustomError("float_type", "a bool is not a number")
        if value == "adaptive" or not isinstance(value, str | int | float):
            return value  # 'adaptive'; None, a list: the union's type error
        try:
            number = float(value)
        except (ValueError, OverflowError):
            raise PydanticCustomError("config", _TAU) from None
        if number != number or number in (float("inf"), float("-inf")):
            raise PydanticCustomError("finite_number", "expected a finite number")
        if number <= 0:
            raise PydanticCustomError("config", _TAU)
        return number

    @model_validator(mode="after")
    def _budgets(self) -> AllocationConfig:
        if self.max_budget < self.min_budget:
            self._fail("max_budget", f"must be >= allocation.min_budget ({self.min_budget})")
        return self


class OptimConfig(_Section):
    """The GRPO update: AdamW and the clipped token-mean loss (docs/method.md)."""

    SECTION: ClassVar[str] = "optim"

    lr: Number = _key(1e-4, "AdamW learning rate (the paper uses 1e-6 for 7B models)", gt=0)
    weight_decay: Number = _key(0.0, "AdamW decoupled weight decay", ge=0)
    betas: Annotated[
        tuple[Number, Number], BeforeValidator(_a_list), _rule(lambda v: all(0 <= b < 1 for b in v), "out of [0, 1)")
    ] = _key((0.9, 0.999), "AdamW (beta1, beta2), each in [0, 1)", "must be two numbers in [0, 1), e.g. [0.9, 0.999]")
    eps: Number = _key(1e-8, "AdamW denominator epsilon", gt=0)
    max_grad_norm: Number = _key(1.0, "clip the global gradient norm to this value", gt=0)
    micro_batch_size: StrictInt = _key(
        64, "sequences per forward/backward pass: bounds memory whatever the budgets", ge=1
    )
    mini_batches: StrictInt = _key(
        1, "optimizer steps per epoch over a step's rollouts (veRL's PPO mini-batches)", ge=1
    )
    clip_low: Number = _key(0.2, "ratio clipped below at 1 - clip_low", gt=0, lt=1)
    clip_high: Number = _key(0.28, 'ratio clipped above at 1 + clip_high ("clip-higher")', gt=0)
    kl_coef: Number = _key(0.0, "coefficient of the KL penalty to the initial policy; 0 = none (the default)", ge=0)
    update_epochs: StrictInt = _key(1, "optimiser passes over each step's rollouts", ge=1)
    lr_warmup_steps: StrictInt = _key(
        0, "linear warm-up: training step k (from 0) updates at lr * min(1, (k + 1) / N); 0 = none", ge=0
    )
    fsdp_processes: StrictInt = _key(
        1, "1 = the update in the flow process; N > 1 = each update a torchrun job of N FSDP ranks", ge=1
    )
    shared_prefix: StrictBool = _key(
        True, "encode each group's prompt once in the update (same loss and gradients, faster)"
    )
    skip_zero_advantage: StrictBool = _key(
        True, "leave advantage-0 rows out of the passes when kl_coef is 0 (same gradients)"
    )
    rollout_correction: RolloutCorrectionLevel = _key(
        "none",
        "truncated importance sampling pi_trainer / pi_sampler on the loss (veRL's rollout_is, TRL's "
        "vllm_importance_sampling_correction): none, token (a ratio per token) or sequence (one per completion)",
        "must be none (no correction), token (weight each token by min(pi_old / pi_sampler, cap)) or sequence "
        "(weight each completion by min(product of its token ratios, cap))",
    )
    rollout_correction_cap: Number = _key(
        2.0,
        "the truncation C: the weight is min(ratio, C) (veRL's rollout_is_threshold, TRL's "
        "vllm_importance_sampling_cap)",
        gt=0,
    )
    rollout_mask_threshold: Number = _key(
        0.0,
        "tau > 1: tokens (token level) or completions (sequence level) whose ratio is outside [1/tau, tau] are "
        "left out of the loss (veRL's rollout_rs_threshold); 0 = no masking",
        ge=0,
    )

    @model_validator(mode="after")
    def _rollout_correction(self) -> OptimConfig:
        if self.rollout_mask_threshold != 0 and not self.rollout_mask_threshold > 1:
            self._fail(
                "rollout_mask_threshold",
                "masks ratios outside [1/tau, tau], so it must be > 1; set it above 1 (e.g. 5) or to 0 for no masking",
            )
        if self.rollout_mask_threshold > 0 and self.rollout_correction == "none":
            self._fail(
                "rollout_mask_threshold",
                "masks at the level of optim.rollout_correction, which is none; set optim.rollout_correction=token "
                "(or sequence) or leave optim.rollout_mask_threshold at 0",
            )
        return self


class VerifyConfig(_Section):
    """Reward verification in a process pool."""

    SECTION: ClassVar[str] = "verify"

    workers: StrictInt = _key(2, "verifier processes", ge=1)
    timeout_s: Number = _key(5.0, "hard wall-clock limit per completion, seconds; over it counts as a timeout", gt=0)
    unknown_sources: UnknownSources = _key(
        "error",
        "a data_source without a verifier: error = refuse the run; math = math-verify",
        "must be error (a data_source without a registered verifier stops the run before it starts) or math "
        "(math-verify scores such rows)",
    )
    reward_function: Text = _key(
        "",
        "your reward instead of the built-in verifiers: path/to/file.py[:function] with veRL's compute_score "
        "signature (docs/operations.md); empty = the built-in verifiers",
    )
    pass_threshold: Number = _key(1.0, "a reward_function score >= this counts as solved (the pass rates CoBA-RL uses)")

    @model_validator(mode="after")
    def _reward_function(self) -> VerifyConfig:
        if self.reward_function.strip():
            from coba_tasks.engines.reward_file import split_spec

            try:
                split_spec(self.reward_function)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        elif self.pass_threshold != 1.0:
            self._fail(
                "pass_threshold",
                "applies to verify.reward_function's scores only (the built-in verifiers score 1 = solved); "
                "set verify.reward_function or leave verify.pass_threshold at 1.0",
            )
        return self


class Config(_Section):
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


SECTIONS: dict[str, type[_Section]] = {
    "run": RunConfig,
    "data": DataConfig,
    "model": ModelConfig,
    "rollout": RolloutConfig,
    "allocation": AllocationConfig,
    "optim": OptimConfig,
    "verify": VerifyConfig,
}


# ---------------------------------------------------------------------------------------------
# Loading, overrides, saving
# ---------------------------------------------------------------------------------------------


def load_config(path: str | os.PathLike[str] | None = None, overrides: Sequence[str] = ()) -> Config:
    """Read a YAML config file, apply ``section.key=value`` overrides, validate.

    Args:
        path: the YAML file; None reads ``configs/demo.yaml`` of the project.
        overrides: the CLI's ``--set`` strings, applied in order (a later one wins).

    Raises:
        ConfigError: missing or unreadable file, invalid YAML (with file and line), unknown
            section or key, wrong type, or a value out of range.

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
        raise ConfigError(f"cannot read config file {file}: {e}") from e
    raw = _parse_yaml(text, str(file))
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{file}: expected a mapping of sections ({', '.join(SECTIONS)}), got {_show(raw)}")
    # an unknown key is the file's (overrides' keys are checked as they are applied): named with the file
    return _validate(_apply_overrides(raw, overrides), f" in {file}")


def apply_overrides(cfg: Config, overrides: Sequence[str]) -> Config:
    """A new Config: ``cfg`` with ``section.key=value`` overrides applied and validated again.

    >>> apply_overrides(Config(), ["allocation.strategy=uniform"]).allocation.strategy
    'uniform'
    """
    return config_from_dict(_apply_overrides(config_to_dict(cfg), overrides))


def config_from_dict(data: Mapping[str, Any]) -> Config:
    """Build and validate a Config from a mapping of sections (what ``config_to_dict`` gives).

    Sections and keys left out take their defaults; unknown ones are a ConfigError.
    """
    if not isinstance(data, Mapping):
        raise ConfigError(f"a config is a mapping of sections ({', '.join(SECTIONS)}), got {_show(data)}")
    return _validate(data, "")


def config_to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    """Plain nested dict of the config (JSON- and YAML-safe: tuples become lists)."""
    return cfg.model_dump(mode="json")


def config_hash(cfg: Config) -> str:
    """First 16 hex digits of the sha256 of the config's canonical JSON (sorted keys, no spaces).

    Keys of ``HASH_NEUTRAL_DEFAULTS`` at their default are left out (added later; older runs keep their hash).
    """
    data = config_to_dict(cfg)
    for (section, key), default in HASH_NEUTRAL_DEFAULTS.items():
        if data[section][key] == default:
            del data[section][key]
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def config_reference() -> str:
    """docs/config.md: every section and key with its default, what it takes and what it means, from the fields.

    Written by ``python -m coba_tasks.pipeline.config`` (tests/pipeline/test_config.py checks it is up to date).
    """
    lines = [
        "# Config reference",
        "",
        "<!-- Generated from the field descriptions of coba_tasks/pipeline/config.py by",
        "     `python -m coba_tasks.pipeline.config`; edit the descriptions there, not this file. -->",
        "",
        "A config file is a YAML mapping of these sections, each a mapping of keys to values; a key left out",
        "takes the default below, so a file lists only where its recipe departs from them (configs/demo.yaml).",
        "`coba run --set section.key=value` sets one key. Every value is checked on load; a wrong one is one",
        "line naming the key and what it must be.",
    ]
    for name, cls in SECTIONS.items():
        lines += [
            "",
            f"## {name}",
            "",
            str(cls.__doc__),
            "",
            "| key | default | takes | meaning |",
            "|---|---|---|---|",
        ]
        for key, field in cls.model_fields.items():
            default = yaml.safe_dump(_plain(field.default), default_flow_style=True).strip().removesuffix("...").strip()
            takes, meaning = (
                t.replace("|", "\\|").replace("<", "&lt;") for t in (_takes(field), str(field.description))
            )
            lines.append(f"| `{key}` | `{default}` | {takes} | {meaning} |")
    return "\n".join(lines) + "\n"


def _takes(field: Any) -> str:
    hint = field.annotation
    if get_origin(hint) is Literal:
        return " or ".join(f"`{a}`" for a in get_args(hint))
    registry = next((m.func.registry for m in field.metadata if hasattr(getattr(m, "func", None), "registry")), None)
    if registry is not None:
        return "a registered name: " + ", ".join(f"`{n}`" for n in registry())
    words = _expected(hint)
    bounds = _bounds_text(field).removeprefix("must be ")
    return f"{words}, {bounds}" if bounds else words


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def check_paths(cfg: Config, root: str | os.PathLike[str] | None = None) -> None:
    """Check that the datasets and the model directory exist; ConfigError naming the key if not.

    Relative paths are resolved against ``root`` (default: the working directory). Kept apart
    from ``load_config`` because the demo bootstraps the model when it is missing.
    """
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
        what = "does not exist" if not model.exists() else "has no config.json (not a Hugging Face model directory)"
        raise ConfigError(
            f"model.path: {cfg.model.path} {what}{where(cfg.model.path)};"
            " build the default model with `coba bootstrap`, or set model.path to a local Hugging Face checkpoint"
        )


def check_platform(cfg: Config) -> None:
    """Refuse settings this machine cannot honour, before a run starts; ConfigError naming the key.

    ``rollout.sleep_during_update`` needs a backend that can sleep here: vLLM's sleep mode exists
    only on CUDA (its CPU platform raises "Sleep mode is not supported on current platform").
    ``rollout.tensor_parallel_size`` > 1 needs CUDA: vLLM's CPU build does not split an engine here.
    ``optim.fsdp_processes``: on CUDA each FSDP rank takes one GPU of this machine (NCCL, one rank per
    device), so more ranks than GPUs are refused; without CUDA the ranks are gloo processes on the CPU,
    any number of them. Kept apart from ``load_config`` so that a GPU config can be loaded and checked
    on any machine.
    """
    import torch

    from coba_tasks.engines.rollout import sleep_unavailable

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
    n = cfg.optim.fsdp_processes
    if n > 1 and cuda and n > torch.cuda.device_count():
        raise ConfigError(
            f"optim.fsdp_processes = {n}: each FSDP process needs a GPU of its own and this machine has "
            f"{torch.cuda.device_count()}; set optim.fsdp_processes to at most {torch.cuda.device_count()}"
        )


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


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


def _apply_overrides(raw: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """A copy of the raw sections with each ``section.key=value`` override set."""
    if isinstance(overrides, str):
        raise ConfigError(f"overrides must be a list of section.key=value strings, got the string {overrides!r}")
    out: dict[str, Any] = {name: dict(body) if isinstance(body, Mapping) else body for name, body in raw.items()}
    for item in overrides:
        if not isinstance(item, str) or "=" not in item:
            raise ConfigError(f"override {_show(item)} must look like section.key=value, e.g. optim.lr=3e-5")
        dotted, text = (s.strip() for s in item.split("=", 1))
        name, _, key = dotted.partition(".")
        if name not in SECTIONS:
            raise ConfigError(_unknown_section(name, f" in --set {item}"))
        if key not in SECTIONS[name].model_fields:
            raise ConfigError(_unknown_key(name, key, f" in --set {item}"))
        if not isinstance(out.get(name) or {}, Mapping):
            raise ConfigError(f"config section {name!r} must be a mapping of key: value, got {_show(out[name])}")
        value = text if _verbatim(SECTIONS[name], key) else _parse_yaml(text, f"--set {dotted}")
        out[name] = {**(out.get(name) or {}), key: value}
    return out


def _verbatim(cls: type[_Section], key: str) -> bool:
    """Whether ``--set`` gives this key its text as it is: a string field (a word list's too)."""
    hint = cls.model_fields[key].annotation
    return hint is str or (get_origin(hint) is Literal and all(isinstance(a, str) for a in get_args(hint)))


def _validate(data: Mapping[str, Any], where: str) -> Config:
    """``Config.model_validate`` with its ValidationError as a one-line ConfigError."""
    for name, body in data.items():  # (a key that is not a string cannot be a keyword of the sections' __init__)
        if not isinstance(name, str) or name not in SECTIONS:
            raise ConfigError(_unknown_section(str(name), where))
        for key in body if isinstance(body, Mapping) else ():
            if not isinstance(key, str) or key not in SECTIONS[name].model_fields:
                raise ConfigError(_unknown_key(name, str(key), where))
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise _config_error(e, where=where) from None


# pydantic's error types: a key or section that should not be there, or is not a mapping; a value out of
# its bounds or word list (or failing a field's own check, "config"); the rest say the type is wrong
_STRUCTURE = ("extra_forbidden", "model_type", "model_attributes_type", "dict_type")
_VALUE = (
    "greater_than",
    "greater_than_equal",
    "less_than",
    "less_than_equal",
    "literal_error",
    "config",
    "value_error",
)


def _config_error(error: ValidationError, prefix: tuple[str, ...] = (), where: str = "") -> ConfigError:
    """The first problem of a ValidationError as one line that names the dotted key and the fix.

    ``where`` (`` in <file>``) is said of an unknown section or key; ``prefix`` is the section's name when
    a section was validated by itself (its errors' locations start at the key).
    """
    errors = error.errors()
    err = next((e for e in errors if e["type"] in _STRUCTURE), errors[0])
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, ConfigError):  # a section's own (pydantic calls its __init__) or a check across keys
        return _config_error(*cause.source, where=where) if cause.source else cause
    loc, kind, value = (*prefix, *err["loc"]), err["type"], err["input"]
    out = _one_line(loc, kind, value, err, where)
    out.source = (error, prefix)  # a Config validating this section says it again with the file's name
    return out


def _one_line(loc: tuple[Any, ...], kind: str, value: Any, err: Any, where: str) -> ConfigError:
    if not loc:
        return ConfigError(f"a config is a mapping of sections ({', '.join(SECTIONS)}), got {_show(value)}")
    section = str(loc[0])
    if len(loc) == 1:
        if kind == "extra_forbidden":
            return ConfigError(_unknown_section(section, where))
        return ConfigError(f"config section {section!r}{where} must be a mapping of key: value, got {_show(value)}")
    key = str(loc[1])
    if kind == "extra_forbidden":
        return ConfigError(_unknown_key(section, key, where))
    field = SECTIONS[section].model_fields[key]
    if kind in _VALUE and not any(isinstance(p, str) for p in loc[2:]):  # (a union's member: a type error)
        fix = (field.json_schema_extra or {}).get("fix") if isinstance(field.json_schema_extra, dict) else None
        return ConfigError(
            f"{section}.{key} = {_short(_as_read(field.annotation, value))}: {fix or _rule_text(field, err)}"
        )
    index = (
        "" if kind in ("missing", "too_short", "too_long") else "".join(f"[{p}]" for p in loc[2:] if isinstance(p, int))
    )
    expected = "a finite number" if kind == "finite_number" else _expected(field.annotation, element=bool(index))
    return ConfigError(f"{section}.{key}{index}: expected {expected}, got {_show(value)}")


def _unknown_section(name: str, where: str) -> str:
    return (
        f"unknown config section {name!r}{where}{_did_you_mean(name, SECTIONS)}; valid sections: {', '.join(SECTIONS)}"
    )


def _unknown_key(section: str, key: str, where: str) -> str:
    valid = list(SECTIONS[section].model_fields)
    return (
        f"unknown config key '{section}.{key}'{where}{_did_you_mean(key, valid)};"
        f" valid keys of {section}: {', '.join(valid)}"
    )


def _rule_text(field: Any, err: Any) -> str:
    """A field's bounds or words, said as ``must be ...`` (its check's own message otherwise)."""
    if err["type"] == "literal_error":
        return f"must be one of {', '.join(map(str, get_args(field.annotation)))}"
    if err["type"] in ("config", "value_error"):
        return str(err["msg"]).removeprefix("Value error, ")
    return f"{_bounds_text(field) or err['msg']} ({field.description})"


def _bounds_text(field: Any) -> str:
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


def _expected(hint: Any, element: bool = False) -> str:
    """What a key of type ``hint`` takes, in words (``element``: an item of a list-valued key)."""
    hint = _strip(hint)
    origin, args = get_origin(hint), get_args(hint)
    if origin is tuple:
        word = _expected(args[0])
        if element:
            return word
        plural = word.split()[-1] + "s"
        return f"a list of {plural}" if len(args) == 2 and args[1] is Ellipsis else f"a list of {len(args)} {plural}"
    if origin in (Union, type(int | None)):
        words = " or ".join(_expected(a) for a in args if a is not type(None))
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


def _short(value: Any, limit: int = 60) -> str:
    text = repr(_plain(value))
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _show(value: Any) -> str:
    return f"{_short(value)} ({type(value).__name__})"


def _did_you_mean(word: Any, valid: Sequence[str] | Mapping[str, Any]) -> str:
    close = difflib.get_close_matches(str(word), list(valid), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


if __name__ == "__main__":  # python -m coba_tasks.pipeline.config [PATH]: write the reference (docs/config.md)
    import sys

    out = Path(sys.argv[1]) if len(sys.argv) > 1 else PROJECT_ROOT / "docs" / "config.md"
    out.write_text(config_reference(), encoding="utf-8")
    print(f"wrote {out}")
