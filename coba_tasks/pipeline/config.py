"""The run configuration: one typed, frozen object, validated on load and saved with every run.

A config file is a YAML mapping of sections (``run``, ``data``, ``model``, ``rollout``,
``allocation``, ``optim``, ``verify``), each a mapping of keys to values; a key left out takes the
default written beside its field below. ``configs/demo.yaml`` spells every key out.

    cfg = load_config("configs/demo.yaml", ["optim.lr=3e-5", "allocation.strategy=uniform"])
    cfg.budget_per_step()            # B_total = M * G rollouts per training step
    check_paths(cfg)                 # data files and model directory exist (before a run starts)
    check_platform(cfg)              # settings this machine cannot honour (sleep mode or TP without CUDA, ...)

Validation happens in each section's ``__post_init__`` (types, then ranges) and in
``Config.__post_init__`` (checks that span sections), so a ``Config`` that exists is valid,
however it was built. Every failure is a ``ConfigError`` (a ``ValueError``) with a one-line
message that names the dotted key (``optim.lr``) and says how to fix it.

Type rules: an int is accepted where a float is expected, and so is a string that ``float()``
reads (PyYAML reads ``3e-5`` as a string: YAML 1.1 wants ``3.0e-5``); NaN and infinities are
refused; a bool is never taken for a number. Overrides (the CLI's ``--set section.key=value``)
are parsed with YAML, except for plain string fields, which take the text verbatim (so
``--set run.name=2024`` is the name "2024", not an error).
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
import numbers
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from functools import cache
from pathlib import Path
from types import UnionType
from typing import Any, ClassVar, Union, get_args, get_origin, get_type_hints

import yaml

from coba_tasks.core.allocators import Mode, strategies
from coba_tasks.core.solvers import coba_solvers
from coba_tasks.engines.rollout import backends

PROJECT_ROOT = Path(__file__).resolve().parents[2]  # coba_tasks/<layer>/this file
DEFAULT_CONFIG_PATH = PROJECT_ROOT / "configs" / "demo.yaml"
DTYPES = ("float32", "bfloat16", "float16", "auto")
MAX_SEED = 2**63 - 1  # torch.manual_seed takes at most a 64-bit seed
ON_BAD_ROWS = ("error", "skip")  # data.on_bad_rows (coba_tasks.pipeline.data_problems reads the same two words)
PROMPT_FORMATS = ("auto", "chat", "raw")  # data.prompt_format (coba_tasks.pipeline.data_prompts.render_prompts)
UNKNOWN_SOURCES = ("error", "math")  # verify.unknown_sources (coba_tasks.pipeline.data_run.check_ground_truths)
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
}
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


# ---------------------------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunConfig:
    """The run as a whole: its name, seed, length and evaluation schedule."""

    SECTION: ClassVar[str] = "run"

    name: str = "demo"  # run directory runs/<name>/: letters, digits, '-', '_', '.', not starting with '.'
    seed: int = 0  # root of every seed (rollouts, shuffling, init): seeds derive from (seed, step, prompt id)
    steps: int = 20  # training steps; one step takes M prompts through rollout, verify, allocate, update
    eval_every: int = 5  # evaluate on held-out prompts every this many steps; 0 = only before and after training
    eval_samples: int = 1  # samples per held-out prompt (avg@k at eval_temperature); 1 with temperature 0 = greedy
    eval_temperature: float = 0.0  # sampling temperature of evaluation; 0 = greedy
    eval_top_p: float = 1.0  # nucleus sampling mass of a sampled evaluation, in (0, 1] (paper: 0.9 at temperature 1.0)
    eval_greedy: bool = True  # with a sampled evaluation, also measure greedy accuracy (eval accuracy_greedy)
    keep_checkpoints: int = 0  # checkpoints kept on disk, the newest; 0 = all (a rerun of update t needs checkpoint t)

    def __post_init__(self) -> None:
        _coerce_fields(self)
        _check(
            self,
            "name",
            bool(_NAME_RE.fullmatch(self.name)) and len(self.name) <= 200,
            "must be one path component (at most 200 characters) of letters, digits, '-', '_' and '.', "
            "not starting with '.' (e.g. coba-lr1e-4); it names the run directory runs/<name>/",
        )
        _check(self, "seed", 0 <= self.seed <= MAX_SEED, f"must be in [0, {MAX_SEED}]")
        _check(self, "steps", self.steps >= 1, "must be >= 1 (the number of training steps)")
        _check(
            self,
            "keep_checkpoints",
            self.keep_checkpoints >= 0,
            "must be >= 0 (0 keeps every checkpoint; N keeps the newest N, the one a resume needs among them)",
        )
        _check(self, "eval_every", self.eval_every >= 0, "must be >= 0 (0 evaluates only before and after training)")
        _check(self, "eval_samples", self.eval_samples >= 1, "must be >= 1 (samples per held-out prompt)")
        _check(self, "eval_temperature", self.eval_temperature >= 0, "must be >= 0 (0 = greedy)")
        _check(self, "eval_top_p", 0 < self.eval_top_p <= 1, "must be in (0, 1] (1.0 = no nucleus truncation)")
        _check(
            self,
            "eval_samples",
            self.eval_samples == 1 or self.eval_temperature > 0,
            "more than one sample needs run.eval_temperature > 0 (greedy decoding repeats one completion); "
            "set run.eval_samples=1 or run.eval_temperature=1.0",
        )


@dataclass(frozen=True)
class DataConfig:
    """Datasets: veRL-format (or flat prompt/answer) Parquet files."""

    SECTION: ClassVar[str] = "data"

    train: str = "data/arith_train.parquet"  # training prompts (Parquet); relative paths are from the working dir
    test: str = "data/arith_test.parquet"  # held-out prompts for evaluation (Parquet)
    # more held-out sets, each evaluated beside data.test and reported under its file name (e.g. the same
    # problems worded differently); the same eval_prompts sample (positions) is taken of each
    extra_tests: tuple[str, ...] = ()
    # keep only the rows of these difficulty levels (extra_info.difficulty), in data.train, data.test and
    # data.extra_tests; empty = every row
    difficulties: tuple[int, ...] = ()
    prompts_per_step: int = 32  # M, prompts in each training step's batch
    eval_prompts: int = 0  # held-out prompts used per evaluation (a seeded sample); 0 = all of data.test
    train_prompts: int = 0  # training pool: a seeded sample of this many prompts of data.train; 0 = all
    shuffle: bool = True  # shuffle the prompt order of each epoch (a pass over the training pool) with run.seed
    on_bad_rows: str = "error"  # a bad row (or over-long prompt): error = refuse the run; skip = drop it, list it
    prompt_format: str = (
        "auto"  # chat: the tokenizer's chat template; raw: last user message as text; auto: chat if any
    )

    def __post_init__(self) -> None:
        _coerce_fields(self)
        _check(self, "train", bool(self.train.strip()), "must name a Parquet file")
        _check(self, "test", bool(self.test.strip()), "must name a Parquet file")
        names = [test_set_name(p) for p in self.extra_tests]
        _check(
            self,
            "extra_tests",
            all(p.strip() for p in self.extra_tests) and len(set(names)) == len(names) and MAIN_TEST_SET not in names,
            f"must be Parquet files with distinct file names other than {MAIN_TEST_SET}.parquet "
            "(each set is reported under its file name), e.g. [data/arith_chat_test_reworded.parquet]",
        )
        _check(
            self,
            "on_bad_rows",
            self.on_bad_rows in ON_BAD_ROWS,
            "must be error (a bad row stops the run before it starts) or skip (bad rows are dropped and "
            "listed in the run's bad_rows.parquet)",
        )
        _check(
            self,
            "prompt_format",
            self.prompt_format in PROMPT_FORMATS,
            "must be auto (the chat template when the tokenizer has one), chat (the tokenizer's chat template "
            "over the whole message list) or raw (the last user message as plain text: base models)",
        )
        _check(self, "prompts_per_step", self.prompts_per_step >= 1, "must be >= 1 (M, prompts per step)")
        _check(self, "eval_prompts", self.eval_prompts >= 0, "must be >= 0 (0 = every prompt of data.test)")
        _check(self, "train_prompts", self.train_prompts >= 0, "must be >= 0 (0 = every prompt of data.train)")


@dataclass(frozen=True)
class ModelConfig:
    """The policy: a Hugging Face causal LM checkpoint directory."""

    SECTION: ClassVar[str] = "model"

    path: str = "models/arith-tiny"  # local HF checkpoint directory (config.json, weights, tokenizer)
    dtype: str = "float32"  # weights dtype for training and rollouts: float32, bfloat16, float16 or auto
    trust_remote_code: bool = False  # allow the checkpoint's own modelling code (only for checkpoints you trust)
    gradient_checkpointing: bool = False  # recompute activations in the backward pass: less memory, more time
    lora_rank: int = 0  # 0 = full fine-tuning; r > 0 = train LoRA adapters of rank r (peft) on the target modules
    lora_alpha: float = 32.0  # LoRA scale alpha: the update is (alpha / r) * B @ A
    lora_target_modules: str = "all-linear"  # all-linear (every linear layer but the output) or names, comma-separated

    def __post_init__(self) -> None:
        _coerce_fields(self)
        _check(self, "path", bool(self.path.strip()), "must name a model directory")
        _check(self, "dtype", self.dtype in DTYPES, f"must be one of {', '.join(DTYPES)}")
        _check(self, "lora_rank", self.lora_rank >= 0, "must be >= 0 (0 = full fine-tuning, e.g. 16 for LoRA)")
        _check(self, "lora_alpha", self.lora_alpha > 0, "must be > 0 (the LoRA scale is lora_alpha / lora_rank)")
        _check(
            self,
            "lora_target_modules",
            bool(self.lora_target_modules.strip(", ")),
            "must be all-linear or module names separated by commas (e.g. q_proj,v_proj)",
        )


@dataclass(frozen=True)
class RolloutConfig:
    """Rollout generation: the engine and how completions are sampled."""

    SECTION: ClassVar[str] = "rollout"

    backend: str = (
        "vllm"  # rollout engine (coba_tasks.engines.rollout.backends()): vllm, vllm-ray, or transformers (fallback)
    )
    temperature: float = 1.0  # sampling temperature of training rollouts (> 0); the update trains on log_softmax(z / T)
    top_p: float = 1.0  # nucleus sampling of training rollouts: 1.0 only (docs/method.md says why)
    max_tokens: int = 12  # most tokens generated per completion
    max_model_len: int = 64  # engine context length (prompt + completion); 0 = the model's own
    gpu_memory_utilization: float = 0.5  # share of GPU memory vLLM may take (ignored on CPU)
    in_process: bool | None = None  # run the vLLM engine in this process; null = auto (yes on CPU, no on GPU)
    sleep_during_update: bool = False  # free the engine's GPU memory while the GRPO update runs (CUDA only)
    engines: int = 1  # vLLM engines (Ray actors) of the vllm-ray backend (docs/scale_out.md); 1 for the others
    tensor_parallel_size: int = 1  # GPUs each vLLM engine is split over (vLLM's tensor parallelism; CUDA only)

    def __post_init__(self) -> None:
        _coerce_fields(self)
        _check(self, "backend", self.backend in backends(), f"must be one of {', '.join(backends())}")
        _check(
            self,
            "temperature",
            self.temperature > 0,
            "must be > 0: training rollouts are sampled (greedy ones would make every group's rewards equal); "
            "1.0 is the paper's",
        )
        _check(
            self,
            "top_p",
            self.top_p == 1.0,
            "must be 1.0: a nucleus-truncated sampler draws from a distribution the policy gradient does not see "
            "(docs/method.md, 'Log-probabilities'); run.eval_top_p sets the evaluation's nucleus",
        )
        _check(self, "max_tokens", self.max_tokens >= 1, "must be >= 1 (tokens per completion)")
        _check(self, "max_model_len", self.max_model_len >= 0, "must be >= 0 (0 = the model's own context length)")
        _check(
            self,
            "max_model_len",
            self.max_model_len == 0 or self.max_model_len > self.max_tokens,
            f"must exceed rollout.max_tokens ({self.max_tokens}) to leave room for the prompt, "
            "or be 0 for the model's own context length",
        )
        _check(self, "gpu_memory_utilization", 0 < self.gpu_memory_utilization <= 1, "must be in (0, 1], e.g. 0.5")
        _check(self, "engines", self.engines >= 1, "must be >= 1 (vLLM engines of the vllm-ray backend)")
        _check(
            self,
            "engines",
            self.engines == 1 or self.backend == "vllm-ray",
            f"must be 1 with rollout.backend={self.backend}: only the vllm-ray backend runs several engines",
        )
        _check(self, "tensor_parallel_size", self.tensor_parallel_size >= 1, "must be >= 1 (GPUs per vLLM engine)")
        _check(
            self,
            "tensor_parallel_size",
            self.tensor_parallel_size == 1 or self.backend != "transformers",
            "must be 1 with rollout.backend=transformers: only vLLM splits a model over GPUs",
        )
        _check(
            self,
            "tensor_parallel_size",
            self.tensor_parallel_size == 1 or self.in_process is not True,
            "must be 1 with rollout.in_process=true (vLLM's in-process executor runs one worker); "
            "set rollout.in_process=null",
        )


# the schedule of (alpha, beta): adaptive (from the failure rate); the paper's ablations reverse it or fix it
SCHEDULES = ("adaptive", "reversed", "fixed")


@dataclass(frozen=True)
class AllocationConfig:
    """Rollout-budget allocation (docs/method.md)."""

    SECTION: ClassVar[str] = "allocation"

    strategy: str = "coba"  # allocator (coba_tasks.core.allocators.strategies()): coba, knapsack or uniform
    mode: str = "paper"  # coba variant: paper (heap over all prompts) or released (the authors' released code)
    solver: str = "heap"  # coba solver: heap (Algorithm 1), threshold (closed form) or dp (exact, slow)
    group_size: int = 16  # G, the mean group size: B_total = M * G rollouts per step
    min_budget: int = 2  # B_low, fewest rollouts per prompt (>= 2: a group of one has no advantage)
    max_budget: int = 128  # B_up, most rollouts per prompt
    schedule: str = "adaptive"  # (alpha, beta): adaptive (from F), reversed (explore then exploit) or fixed
    fixed_alpha: float = 5.5  # alpha of the Beta density when schedule is fixed
    fixed_beta: float = 5.5  # beta of the Beta density when schedule is fixed
    tau: str | float = "adaptive"  # saturation scale of eta(B, p): adaptive (from the spread of pass rates) or > 0
    kappa: float = 11.0  # alpha + beta of the Beta density (> 2)
    gamma: float = 10.0  # steepness of the sigmoid applied to the failure rate when it is <= 0.5
    capability_window: int = 1  # steps in the moving average of the failure rate
    pass_rate_window: int = 1  # a prompt's last visits whose pass rates give its p_i

    def __post_init__(self) -> None:
        _coerce_fields(self)
        _check(self, "strategy", self.strategy in strategies(), f"must be one of {', '.join(strategies())}")
        modes = [m.value for m in Mode]
        _check(self, "mode", self.mode in modes, f"must be one of {', '.join(modes)}")
        _check(self, "solver", self.solver in coba_solvers(), f"must be one of {', '.join(coba_solvers())}")
        _check(self, "schedule", self.schedule in SCHEDULES, f"must be one of {', '.join(SCHEDULES)}")
        _check(self, "fixed_alpha", self.fixed_alpha > 0, "must be > 0 (alpha of Beta(alpha, beta))")
        _check(self, "fixed_beta", self.fixed_beta > 0, "must be > 0 (beta of Beta(alpha, beta))")
        _check(self, "group_size", self.group_size >= 1, "must be >= 1 (G, the mean rollouts per prompt)")
        _check(
            self,
            "min_budget",
            self.min_budget >= 2,
            "must be >= 2: a GRPO group of one rollout has no advantage (set allocation.min_budget=2)",
        )
        _check(
            self,
            "max_budget",
            self.max_budget >= self.min_budget,
            f"must be >= allocation.min_budget ({self.min_budget})",
        )
        if isinstance(self.tau, str) and self.tau != "adaptive":
            try:
                object.__setattr__(self, "tau", _as_float("allocation.tau", self.tau))
            except ConfigError:
                _fail(
                    self, "tau", "must be 'adaptive' or a positive number (the saturation scale of eta, docs/method.md)"
                )
        _check(
            self,
            "tau",
            self.tau == "adaptive" or self.tau > 0,
            "must be 'adaptive' or a positive number (the saturation scale of eta, docs/method.md)",
        )
        _check(self, "kappa", self.kappa > 2, "must be > 2 so that alpha and beta can both exceed 1 (paper: 11)")
        _check(self, "gamma", self.gamma > 0, "must be > 0 (steepness of the sigmoid; paper: 10)")
        _check(self, "capability_window", self.capability_window >= 1, "must be >= 1 (steps averaged)")
        _check(self, "pass_rate_window", self.pass_rate_window >= 1, "must be >= 1 (visits averaged)")


@dataclass(frozen=True)
class OptimConfig:
    """The GRPO update: AdamW and the clipped token-mean loss (docs/method.md)."""

    SECTION: ClassVar[str] = "optim"

    lr: float = 1e-4  # AdamW learning rate (the paper uses 1e-6 for 7B models)
    weight_decay: float = 0.0  # AdamW decoupled weight decay
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW (beta1, beta2), each in [0, 1)
    eps: float = 1e-8  # AdamW denominator epsilon
    max_grad_norm: float = 1.0  # clip the global gradient norm to this value
    micro_batch_size: int = 64  # sequences per forward/backward pass: bounds memory whatever the budgets
    mini_batches: int = 1  # optimizer steps per epoch over a step's rollouts (veRL's PPO mini-batches)
    clip_low: float = 0.2  # ratio clipped below at 1 - clip_low
    clip_high: float = 0.28  # ratio clipped above at 1 + clip_high ("clip-higher")
    kl_coef: float = 0.0  # coefficient of the KL penalty to the initial policy; 0 = none (the default)
    update_epochs: int = 1  # optimiser passes over each step's rollouts
    lr_warmup_steps: int = 0  # linear warm-up: training step k (from 0) updates at lr * min(1, (k + 1) / N); 0 = none
    fsdp_processes: int = 1  # 1 = the update in the flow process; N > 1 = each update a torchrun job of N FSDP ranks
    shared_prefix: bool = True  # encode each group's prompt once in the update (same loss and gradients, faster)
    skip_zero_advantage: bool = True  # leave advantage-0 rows out of the passes when kl_coef is 0 (same gradients)

    def __post_init__(self) -> None:
        _coerce_fields(self)
        _check(self, "lr", self.lr > 0, "must be > 0 (the AdamW step size, e.g. 1e-4)")
        _check(self, "lr_warmup_steps", self.lr_warmup_steps >= 0, "must be >= 0 (training steps; 0 = no warm-up)")
        _check(self, "weight_decay", self.weight_decay >= 0, "must be >= 0 (0 = no weight decay)")
        _check(self, "betas", all(0 <= b < 1 for b in self.betas), "must be two numbers in [0, 1), e.g. [0.9, 0.999]")
        _check(self, "eps", self.eps > 0, "must be > 0, e.g. 1e-8")
        _check(self, "max_grad_norm", self.max_grad_norm > 0, "must be > 0, e.g. 1.0")
        _check(self, "micro_batch_size", self.micro_batch_size >= 1, "must be >= 1 (sequences per forward/backward)")
        _check(self, "mini_batches", self.mini_batches >= 1, "must be >= 1 (optimizer steps per epoch)")
        _check(self, "clip_low", 0 < self.clip_low < 1, "must be in (0, 1): the ratio is clipped below at 1 - clip_low")
        _check(self, "clip_high", self.clip_high > 0, "must be > 0: the ratio is clipped above at 1 + clip_high")
        _check(self, "kl_coef", self.kl_coef >= 0, "must be >= 0 (0 = no KL term)")
        _check(self, "update_epochs", self.update_epochs >= 1, "must be >= 1")
        _check(
            self,
            "fsdp_processes",
            self.fsdp_processes >= 1,
            "must be >= 1 (1 = the update in the flow process; N > 1 = FSDP over N processes, one GPU each)",
        )


@dataclass(frozen=True)
class VerifyConfig:
    """Reward verification in a process pool."""

    SECTION: ClassVar[str] = "verify"

    workers: int = 2  # verifier processes
    timeout_s: float = 5.0  # hard wall-clock limit per completion, seconds; over it counts as a timeout
    unknown_sources: str = "error"  # a data_source without a verifier: error = refuse the run; math = math-verify
    # your reward instead of the built-in verifiers: path/to/file.py[:function] with veRL's compute_score
    # signature (coba_tasks/engines/reward_file.py); empty = the built-in verifiers
    reward_function: str = ""
    pass_threshold: float = 1.0  # a reward_function score >= this counts as solved (the pass rates CoBA-RL uses)

    def __post_init__(self) -> None:
        _coerce_fields(self)
        if self.reward_function.strip():
            from coba_tasks.engines.reward_file import split_spec

            try:
                split_spec(self.reward_function)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        _check(
            self,
            "pass_threshold",
            self.pass_threshold == 1.0 or bool(self.reward_function.strip()),
            "applies to verify.reward_function's scores only (the built-in verifiers score 1 = solved); "
            "set verify.reward_function or leave verify.pass_threshold at 1.0",
        )
        _check(self, "workers", self.workers >= 1, "must be >= 1 (verifier processes)")
        _check(self, "timeout_s", self.timeout_s > 0, "must be > 0 (seconds per completion)")
        _check(
            self,
            "unknown_sources",
            self.unknown_sources in UNKNOWN_SOURCES,
            "must be error (a data_source without a registered verifier stops the run before it starts) or math "
            "(math-verify scores such rows)",
        )


@dataclass(frozen=True)
class Config:
    """A whole run's configuration; immutable, valid by construction."""

    run: RunConfig = field(default_factory=RunConfig)  # name, seed, steps, evaluation schedule
    data: DataConfig = field(default_factory=DataConfig)  # datasets and batch size M
    model: ModelConfig = field(default_factory=ModelConfig)  # the policy checkpoint
    rollout: RolloutConfig = field(default_factory=RolloutConfig)  # rollout engine and sampling
    allocation: AllocationConfig = field(default_factory=AllocationConfig)  # rollout budgets
    optim: OptimConfig = field(default_factory=OptimConfig)  # the GRPO update
    verify: VerifyConfig = field(default_factory=VerifyConfig)  # reward verification

    def __post_init__(self) -> None:
        for f in fields(self):
            cls = SECTIONS[f.name]
            if not isinstance(getattr(self, f.name), cls):
                raise ConfigError(
                    f"config section {f.name!r} must be of type {cls.__name__}, got {_show(getattr(self, f.name))}"
                )
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

    def budget_per_step(self) -> int:
        """B_total = M * G, the rollouts of one training step."""
        return self.data.prompts_per_step * self.allocation.group_size


SECTIONS: dict[str, type] = {
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
    _check_keys(raw, f" in {file}")
    return config_from_dict(_apply_overrides(raw, overrides))


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
    _check_keys(data, "")
    return Config(**{name: cls(**(data.get(name) or {})) for name, cls in SECTIONS.items()})


def config_to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    """Plain nested dict of the config (JSON- and YAML-safe: tuples become lists)."""
    return {
        name: {f.name: _plain(getattr(section, f.name)) for f in fields(section)}
        for name in SECTIONS
        for section in [getattr(cfg, name)]
    }


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


def _check_keys(data: Mapping[Any, Any], where: str) -> None:
    """Unknown sections and keys, and sections that are not mappings, as ConfigErrors."""
    for name, body in data.items():
        if name not in SECTIONS:
            raise ConfigError(
                f"unknown config section {str(name)!r}{where}{_did_you_mean(name, SECTIONS)};"
                f" valid sections: {', '.join(SECTIONS)}"
            )
        if body is not None and not isinstance(body, Mapping):
            raise ConfigError(f"config section {name!r}{where} must be a mapping of key: value, got {_show(body)}")
        valid = _field_names(SECTIONS[name])
        for key in body or {}:
            if key not in valid:
                raise ConfigError(
                    f"unknown config key '{name}.{key}'{where}{_did_you_mean(key, valid)};"
                    f" valid keys of {name}: {', '.join(valid)}"
                )


def _apply_overrides(raw: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """A copy of the raw sections with each ``section.key=value`` override set."""
    if isinstance(overrides, str):
        raise ConfigError(f"overrides must be a list of section.key=value strings, got the string {overrides!r}")
    out: dict[str, Any] = {name: dict(body or {}) for name, body in raw.items()}
    for item in overrides:
        if not isinstance(item, str) or "=" not in item:
            raise ConfigError(f"override {_show(item)} must look like section.key=value, e.g. optim.lr=3e-5")
        dotted, text = (s.strip() for s in item.split("=", 1))
        name, _, key = dotted.partition(".")
        if name not in SECTIONS:
            raise ConfigError(
                f"unknown config section {name!r} in --set {item}{_did_you_mean(name, SECTIONS)};"
                f" valid sections: {', '.join(SECTIONS)}"
            )
        valid = _field_names(SECTIONS[name])
        if key not in valid:
            raise ConfigError(
                f"unknown config key '{dotted}' in --set {item}{_did_you_mean(key, valid)};"
                f" valid keys of {name}: {', '.join(valid)}"
            )
        hint = _field_hints(SECTIONS[name])[key]
        out.setdefault(name, {})[key] = text if hint is str else _parse_yaml(text, f"--set {dotted}")
    return out


def _coerce_fields(section: Any) -> None:
    """Check each field's type against its annotation, converting where that is lossless."""
    hints = _field_hints(type(section))
    for f in fields(section):
        value = getattr(section, f.name)
        new = _coerce(f"{section.SECTION}.{f.name}", value, hints[f.name])
        if new is not value:
            object.__setattr__(section, f.name, new)


def _coerce(key: str, value: Any, hint: Any) -> Any:
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, UnionType):  # bool | None, str | float
        if value is None and type(None) in args:
            return None
        if (str in args and isinstance(value, str)) or (bool in args and isinstance(value, bool)):
            return value
        if float in args and _is_number(value):
            return _as_float(key, value)
        kinds = [a for a in args if a is not type(None)]
        expected = " or ".join(_type_word(a) for a in kinds) + (" or null" if type(None) in args else "")
        raise ConfigError(f"{key}: expected {expected}, got {_show(value)}")
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:  # tuple[str, ...]: a list of any length
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{key}: expected a list of {_type_word(args[0]).split()[-1]}s, got {_show(value)}")
        return tuple(_coerce(f"{key}[{i}]", v, args[0]) for i, v in enumerate(value))
    if origin is tuple:  # tuple[float, float]
        if not isinstance(value, list | tuple) or len(value) != len(args):
            raise ConfigError(
                f"{key}: expected a list of {len(args)} {_type_word(args[0]).split()[-1]}s, got {_show(value)}"
            )
        return tuple(_coerce(f"{key}[{i}]", v, a) for i, (v, a) in enumerate(zip(value, args, strict=True)))
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            return int(value)
    elif hint is float:
        return _as_float(key, value)
    elif hint is str:
        if isinstance(value, str):
            return value
        if isinstance(value, os.PathLike) and isinstance(os.fspath(value), str):
            return os.fspath(value)
    else:  # pragma: no cover - a field annotation this module does not know
        raise TypeError(f"{key}: unsupported annotation {hint!r}")
    raise ConfigError(f"{key}: expected {_type_word(hint)}, got {_show(value)}")


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _as_float(key: str, value: Any) -> float:
    """A finite float from a number or a numeric string; ConfigError otherwise."""
    if isinstance(value, str):
        try:
            out = float(value)
        except ValueError:
            raise ConfigError(f"{key}: expected a number, got {_show(value)}") from None
    elif _is_number(value):
        try:
            out = float(value)
        except OverflowError:
            raise ConfigError(f"{key}: {_show(value)} is too large for a float") from None
    else:
        raise ConfigError(f"{key}: expected a number, got {_show(value)}")
    if not math.isfinite(out):
        raise ConfigError(f"{key}: expected a finite number, got {_show(value)}")
    return out


def _check(section: Any, name: str, ok: bool, how: str) -> None:
    if not ok:
        _fail(section, name, how)


def _fail(section: Any, name: str, how: str) -> None:
    raise ConfigError(f"{section.SECTION}.{name} = {_short(getattr(section, name))}: {how}")


def _type_word(t: Any) -> str:
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(
        t, getattr(t, "__name__", str(t))
    )


def _short(value: Any, limit: int = 60) -> str:
    text = repr(_plain(value))
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _show(value: Any) -> str:
    return f"{_short(value)} ({type(value).__name__})"


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _did_you_mean(word: Any, valid: Sequence[str] | Mapping[str, Any]) -> str:
    close = difflib.get_close_matches(str(word), list(valid), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


@cache
def _field_hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


@cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))
