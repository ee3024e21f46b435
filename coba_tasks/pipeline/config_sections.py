"""The sections of the run configuration (``run``, ``data``, ``model``, ``rollout``, ``allocation``,
``optim``, ``verify``): one pydantic model each, whose fields carry their defaults, bounds, word lists
(``Literal``) and descriptions, and whose model validators check what spans keys of the section.
``coba_tasks.pipeline.config`` puts them together as ``Config`` and reads them from YAML.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import BeforeValidator, StrictBool, StrictInt, field_validator, model_validator
from pydantic_core import PydanticCustomError

from coba_tasks.core.ada import AdaChoice
from coba_tasks.core.allocation import IN_ROUNDS, Mode, Strategy, step_strategies
from coba_tasks.core.capability import DEFAULT_DECAY, DEFAULT_PILOT_ROLLOUTS, DEFAULT_PRIOR_STRENGTH, Estimator
from coba_tasks.core.dynamic import FilterMetric
from coba_tasks.core.solvers import coba_solvers
from coba_tasks.engines.rollout import TRANSPORT_BACKENDS, backends, engine_in_process, weight_transport_refusal
from coba_tasks.engines.verify import Gsm8kAnswer
from coba_tasks.pipeline.config_fields import (
    ConfigError,
    NonBlank,
    Number,
    Section,
    Text,
    a_list,
    config_key,
    name_list,
    registered,
    rule,
)

MAX_SEED = 2**63 - 1  # torch.manual_seed takes at most a 64-bit seed
# The longest task timeout (run.*_timeout_s), about 292 years: what Prefect's timers take, its alarm in the main
# thread (signal.setitimer) and its watcher thread's wait elsewhere (threading.TIMEOUT_MAX); a second more fails
# the task with "OverflowError: timestamp out of range for platform time_t" (tests/pipeline/test_config.py)
MAX_TIMEOUT_S = 9_223_372_036
# The longest verify.timeout_s, about 24 days: the verifier pool's wait for a verdict (multiprocessing's wait, a
# poll of milliseconds in a C int) takes it; a second more raises "OverflowError: timeout is too large"
MAX_VERIFY_TIMEOUT_S = 2_147_483

# The word-valued keys: each Literal is the one list of its words (readers take typing.get_args of it)
Dtype = Literal["float32", "bfloat16", "float16", "auto"]  # model.dtype
OnBadRows = Literal["error", "skip"]  # data.on_bad_rows (coba_tasks.pipeline.data)
PromptFormat = Literal["auto", "chat", "raw"]  # data.prompt_format (coba_tasks.pipeline.data.render_prompts)
UnknownSources = Literal["error", "math"]  # verify.unknown_sources (coba_tasks.pipeline.data)
Schedule = Literal["adaptive", "reversed", "fixed"]  # allocation.schedule: the paper's ablations reverse or fix it
ModeName = Literal["paper", "released"]  # allocation.mode: the values of coba_tasks.core.allocation.Mode
EstimatorName = Literal["last", "posterior", "pilot"]  # allocation.estimator: coba_tasks.core.capability.Estimator
FilterMetricName = Literal["acc", "seq_reward"]  # allocation.filter_metric: coba_tasks.core.dynamic.FilterMetric
AdaChoiceName = Literal["balanced", "positive_focused"]  # allocation.reinforce_ada_choice: core.ada.AdaChoice
# optim.rollout_correction: coba_tasks.core.grpo.RolloutCorrection's values (not imported here: it pulls in torch)
RolloutCorrectionLevel = Literal["none", "token", "sequence"]
# optim.prompt_weighting: coba_tasks.core.grpo.PromptWeighting's values (not imported here either)
PromptWeightingName = Literal["tokens", "equal"]
DTYPES = get_args(Dtype)
assert set(get_args(ModeName)) == {m.value for m in Mode}, "allocation.mode's words are Mode's values"
assert set(get_args(EstimatorName)) == {e.value for e in Estimator}, "allocation.estimator's words are Estimator's"
assert set(get_args(FilterMetricName)) == {m.value for m in FilterMetric}, "filter_metric's words are FilterMetric's"
assert set(get_args(AdaChoiceName)) == {c.value for c in AdaChoice}, "reinforce_ada_choice's words are AdaChoice's"

TRACKERS = ("tensorboard", "mlflow", "wandb")  # run.trackers: the experiment trackers a run can log to
MAIN_TEST_SET = "test"  # the eval table's test_set of data.test; an extra test's is its file name without .parquet


def test_set_name(path: str) -> str:
    """The name an extra held-out set is reported under: its file name without the suffix.

    >>> test_set_name("data/arith_chat_test_reworded.parquet")
    'arith_chat_test_reworded'
    """
    return Path(path).name.removesuffix(".parquet")


test_set_name.__test__ = False  # type: ignore[attr-defined]  # a function, not a test: pytest takes its doctest


_NAME_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")


def _known_trackers(names: tuple[str, ...]) -> bool:
    return all(n in TRACKERS for n in names) and len(set(names)) == len(names)


# --- Sections


class RunConfig(Section):
    """The run as a whole: its name, seed, length and evaluation schedule."""

    SECTION: ClassVar[str] = "run"

    name: Annotated[Text, rule(lambda v: bool(_NAME_RE.fullmatch(v)) and len(v) <= 200, "not a run name")] = config_key(
        "demo",
        "run directory runs/<name>/: letters, digits, '-', '_', '.', not starting with '.'",
        "must be one path component (at most 200 characters) of letters, digits, '-', '_' and '.', "
        "not starting with '.' (e.g. coba-lr1e-4); it names the run directory runs/<name>/",
    )
    seed: StrictInt = config_key(
        0,
        "root of every seed (rollouts, shuffling, init): seeds derive from (seed, step, prompt id)",
        ge=0,
        le=MAX_SEED,
    )
    steps: StrictInt = config_key(
        20, "training steps; one step takes M prompts through rollout, verify, allocate, update", ge=1
    )
    eval_every: StrictInt = config_key(
        5, "evaluate on held-out prompts every this many steps; 0 = only before and after training", ge=0
    )
    rollout_budget: StrictInt = config_key(
        0,
        "end training after the step whose rollouts take the run's rollouts generated (every round, pilot and "
        "dropped group counted) to at least this many; run.steps stays the most steps; 0 = run.steps steps",
        ge=0,
    )
    eval_every_rollouts: StrictInt = config_key(
        0,
        "also evaluate after each step whose rollouts take the run's rollouts generated past a multiple of this "
        "(runs that spend differently per step compared at equal rollouts generated); 0 = none",
        ge=0,
    )
    eval_samples: StrictInt = config_key(
        1, "samples per held-out prompt (avg@k at eval_temperature); 1 with temperature 0 = greedy", ge=1
    )
    eval_temperature: Number = config_key(0.0, "sampling temperature of evaluation; 0 = greedy", ge=0)
    eval_top_p: Number = config_key(
        1.0, "nucleus sampling mass of a sampled evaluation, in (0, 1] (paper: 0.9 at temperature 1.0)", gt=0, le=1
    )
    eval_greedy: StrictBool = config_key(
        True, "with a sampled evaluation, also measure greedy accuracy (eval accuracy_greedy)"
    )
    keep_checkpoints: StrictInt = config_key(
        0,
        "checkpoints kept on disk, the newest; 0 = all (a resume loads the newest at or below its step and replays "
        "the updates after it from the tables)",
        ge=0,
    )
    checkpoint_every: StrictInt = config_key(
        1,
        "write a checkpoint after every N-th update, after the last, and when a run is stopped (Ctrl-C, SIGTERM); "
        "a resume replays the updates since the newest from the tables (docs/operations.md, 'Checkpoints')",
        ge=1,
    )
    rollouts_timeout_s: Number = config_key(
        21600,
        "wall-clock limit of one step's rollouts task (and of each of its rounds), seconds; a task past it fails "
        "(retried once) and so does the flow run, instead of hanging on a stuck engine; 0 = none",
        ge=0,
        le=MAX_TIMEOUT_S,
    )
    update_timeout_s: Number = config_key(
        21600, "wall-clock limit of one step's update task, seconds (not retried); 0 = none", ge=0, le=MAX_TIMEOUT_S
    )
    eval_timeout_s: Number = config_key(
        21600,
        "wall-clock limit of one held-out evaluation task, seconds (retried once); 0 = none",
        ge=0,
        le=MAX_TIMEOUT_S,
    )
    trackers: Annotated[tuple[str, ...], BeforeValidator(name_list), rule(_known_trackers, "not known trackers")] = (
        config_key(
            (),
            "experiment trackers each step's figures are logged to, offline under <run_dir>/trackers/ "
            f"({', '.join(TRACKERS)}; see Experiment trackers in docs/operations.md); empty = none",
            f"must be a list of distinct tracker names among {', '.join(TRACKERS)}, e.g. [tensorboard, mlflow] "
            "or --set run.trackers=tensorboard,mlflow",
        )
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


class DataConfig(Section):
    """Datasets: veRL-format (or flat prompt/answer) Parquet files."""

    SECTION: ClassVar[str] = "data"

    train: NonBlank = config_key(
        "data/arith_train.parquet",
        "training prompts (Parquet); relative paths are from the working directory",
        "must name a Parquet file",
    )
    test: NonBlank = config_key(
        "data/arith_test.parquet", "held-out prompts for evaluation (Parquet)", "must name a Parquet file"
    )
    extra_tests: Annotated[
        tuple[str, ...], BeforeValidator(a_list), rule(_distinct_test_sets, "not distinct test sets")
    ] = config_key(
        (),
        "more held-out sets, each evaluated beside data.test and reported under its file name (e.g. the same "
        "problems worded differently); the same eval_prompts sample (positions) is taken of each",
        f"must be Parquet files with distinct file names other than {MAIN_TEST_SET}.parquet "
        "(each set is reported under its file name), e.g. [data/arith_chat_test_reworded.parquet]",
    )
    difficulties: Annotated[tuple[StrictInt, ...], BeforeValidator(a_list)] = config_key(
        (),
        "keep only the rows of these difficulty levels (extra_info.difficulty), in data.train, data.test and "
        "data.extra_tests; empty = every row",
    )
    prompts_per_step: StrictInt = config_key(32, "M, prompts in each training step's batch", ge=1)
    eval_prompts: StrictInt = config_key(
        0, "held-out prompts used per evaluation (a seeded sample); 0 = all of data.test", ge=0
    )
    train_prompts: StrictInt = config_key(
        0, "training pool: a seeded sample of this many prompts of data.train; 0 = all", ge=0
    )
    shuffle: StrictBool = config_key(
        True, "shuffle the prompt order of each epoch (a pass over the training pool) with run.seed"
    )
    on_bad_rows: OnBadRows = config_key(
        "error",
        "a bad row (or over-long prompt): error = refuse the run; skip = drop it, list it",
        "must be error (a bad row stops the run before it starts) or skip (bad rows are dropped and "
        "listed in the run's bad_rows.parquet)",
    )
    prompt_format: PromptFormat = config_key(
        "auto",
        "chat: the tokenizer's chat template; raw: last user message as text; auto: chat if any",
        "must be auto (the chat template when the tokenizer has one), chat (the tokenizer's chat template "
        "over the whole message list) or raw (the last user message as plain text: base models)",
    )


class ModelConfig(Section):
    """The policy: a Hugging Face causal LM checkpoint directory."""

    SECTION: ClassVar[str] = "model"

    path: NonBlank = config_key(
        "models/arith-tiny",
        "local HF checkpoint directory (config.json, weights, tokenizer)",
        "must name a model directory",
    )
    dtype: Dtype = config_key("float32", "weights dtype for training and rollouts: float32, bfloat16, float16 or auto")
    trust_remote_code: StrictBool = config_key(
        False, "allow the checkpoint's own modelling code (only for checkpoints you trust)"
    )
    gradient_checkpointing: StrictBool = config_key(
        False, "recompute activations in the backward pass: less memory, more time"
    )
    lora_rank: StrictInt = config_key(
        0, "0 = full fine-tuning; r > 0 = train LoRA adapters of rank r (peft) on the target modules", ge=0
    )
    lora_alpha: Number = config_key(32.0, "LoRA scale alpha: the update is (alpha / r) * B @ A", gt=0)
    lora_target_modules: Annotated[Text, rule(lambda v: bool(v.strip(", ")), "no modules")] = config_key(
        "all-linear",
        "all-linear (every linear layer but the output) or names, comma-separated",
        "must be all-linear or module names separated by commas (e.g. q_proj,v_proj)",
    )


class RolloutConfig(Section):
    """Rollout generation: the engine and how completions are sampled."""

    SECTION: ClassVar[str] = "rollout"

    backend: Annotated[Text, registered(backends)] = config_key(
        "vllm", "rollout engine (coba_tasks.engines.rollout.backends()): vllm, vllm-ray, or transformers (fallback)"
    )
    temperature: Number = config_key(
        1.0,
        "sampling temperature of training rollouts (> 0); the update trains on log_softmax(z / T)",
        "must be > 0: training rollouts are sampled (greedy ones would make every group's rewards equal); "
        "1.0 is the paper's",
        gt=0,
    )
    top_p: Number = config_key(
        1.0,
        "nucleus sampling of training rollouts: 1.0 only (docs/method.md says why)",
        "must be 1.0: a nucleus-truncated sampler draws from a distribution the policy gradient does not see "
        "(docs/method.md, 'Log-probabilities'); run.eval_top_p sets the evaluation's nucleus",
        ge=1,
        le=1,
    )
    max_tokens: StrictInt = config_key(12, "most tokens generated per completion", ge=1)
    max_model_len: StrictInt = config_key(64, "engine context length (prompt + completion); 0 = the model's own", ge=0)
    gpu_memory_utilization: Number = config_key(0.5, "share of GPU memory vLLM may take (ignored on CPU)", gt=0, le=1)
    in_process: StrictBool | None = config_key(
        None, "run the vLLM engine in this process; null = auto (yes on CPU, no on GPU)"
    )
    sleep_during_update: StrictBool = config_key(
        False, "free the engine's GPU memory while the GRPO update runs (CUDA only)"
    )
    weight_transport: Literal["auto", "reference", "ipc", "bytes"] = config_key(
        "auto",
        "how the vLLM engine takes the policy after each update, from memory: auto (reference in this process, "
        "ipc to an engine process on the GPU, else bytes), ipc (vLLM's CUDA IPC), bytes (one message); one the "
        "engine cannot use where it runs is refused before a run starts",
    )
    engines: StrictInt = config_key(
        1, "vLLM engines (Ray actors) of the vllm-ray backend (docs/scale_out.md); 1 for the others", ge=1
    )
    tensor_parallel_size: StrictInt = config_key(
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
        if self.backend in TRANSPORT_BACKENDS:  # a transport refused on every machine (check_platform: on this one)
            why = [
                weight_transport_refusal(
                    self.weight_transport, engine_in_process(self.in_process, cpu), cpu, self.tensor_parallel_size
                )
                for cpu in (True, False)
            ]
            if all(why):
                self._fail("weight_transport", f"{why[0]}; set rollout.weight_transport=auto")
        return self


_TAU = "must be 'adaptive' or a positive number (the saturation scale of eta, docs/method.md)"


# The allocation keys read by the strategies that sample a step in rounds alone (dynamic, ada): added together,
# hash-neutral at their defaults (config.HASH_NEUTRAL_KEYS), and no other strategy's steps depend on them (fork)
ROUND_SAMPLING_KEYS = (
    "gen_batch_size",
    "filter_metric",
    "max_num_gen_batches",
    "reinforce_ada_choice",
    "max_rounds",
    "round_repeat",
    "positive_threshold",
    "global_stat_est",
    "norm_adv_by_std_in_grpo",
)


class AllocationConfig(Section):
    """Rollout-budget allocation (docs/method.md)."""

    SECTION: ClassVar[str] = "allocation"

    strategy: Annotated[Text, registered(step_strategies)] = config_key(
        "coba",
        "how a step spends its rollouts: the allocators coba, knapsack or uniform (one budget per prompt), or "
        "dynamic (DAPO's dynamic sampling) or ada (Reinforce-Ada), which sample a step in rounds (docs/method.md)",
    )
    mode: ModeName = config_key(
        "paper", "coba variant: paper (heap over all prompts) or released (the authors' released code)"
    )
    solver: Annotated[Text, registered(coba_solvers)] = config_key(
        "heap",
        "coba solver: heap (Algorithm 1), threshold (closed form) or dp (exact, slow); knapsack always runs its DP",
    )
    group_size: StrictInt = config_key(16, "G, the mean group size: B_total = M * G rollouts per step", ge=1)
    min_budget: StrictInt = config_key(
        2,
        "B_low, fewest rollouts per prompt (>= 2: a group of one has no advantage)",
        "must be >= 2: a GRPO group of one rollout has no advantage (set allocation.min_budget=2)",
        ge=2,
    )
    max_budget: StrictInt = config_key(
        128,
        "B_up, most rollouts per prompt (>= allocation.min_budget); knapsack: the cap of its knapsack, and its"
        " surplus to prompts estimated at 0 may go above it",
    )
    schedule: Schedule = config_key(
        "adaptive", "(alpha, beta): adaptive (from F), reversed (explore then exploit) or fixed"
    )
    fixed_alpha: Number = config_key(5.5, "alpha of the Beta density when schedule is fixed", gt=0)
    fixed_beta: Number = config_key(5.5, "beta of the Beta density when schedule is fixed", gt=0)
    tau: Literal["adaptive"] | float = config_key(
        "adaptive", "saturation scale of eta(B, p): adaptive (from the spread of pass rates) or a number > 0", _TAU
    )
    kappa: Number = config_key(
        11.0,
        "alpha + beta of the Beta density (> 2)",
        "must be > 2 so that alpha and beta can both exceed 1 (paper: 11)",
        gt=2,
    )
    gamma: Number = config_key(10.0, "steepness of the sigmoid applied to the failure rate when it is <= 0.5", gt=0)
    capability_window: StrictInt = config_key(1, "steps in the moving average of the failure rate", ge=1)
    pass_rate_window: StrictInt = config_key(
        1, "a prompt's last visits whose pass rates give its p_i (knapsack pools its newest 16 rollouts instead)", ge=1
    )
    estimator: EstimatorName = config_key(
        "last",
        "each prompt's p_i for coba and uniform: last (mean pass rate of its last pass_rate_window visits), "
        "posterior (a Beta posterior, decayed per visit, prior from the global pass rate) or pilot (that "
        "posterior after a first wave of pilot_rollouts per prompt of the step itself); knapsack keeps its own",
        "must be last (the last visits' pass rate), posterior (a decayed Beta posterior per prompt) or pilot "
        "(the posterior after a pilot wave of the step's own rollouts)",
    )
    prior_strength: Number = config_key(
        DEFAULT_PRIOR_STRENGTH,
        "posterior, pilot: s, the prior's weight in rollouts: Beta(s * pbar, s * (1 - pbar)), pbar the pass rate "
        "of every rollout scored so far",
        gt=0,
    )
    posterior_decay: Number = config_key(
        DEFAULT_DECAY,
        "posterior, pilot: d in [0, 1], each visit multiplies a prompt's counts by d before adding its "
        "successes and failures (1 never forgets; 0 keeps the last visit only)",
        ge=0,
        le=1,
    )
    pilot_rollouts: StrictInt = config_key(
        DEFAULT_PILOT_ROLLOUTS,
        "pilot: k, the first wave's rollouts per prompt (1 <= k <= min_budget); they stay in their groups and the "
        "step's total stays B_total",
        ge=1,
    )
    # dynamic: veRL's DAPO recipe's knobs, under its names (data.train_batch_size is data.prompts_per_step,
    # actor_rollout_ref.rollout.n is group_size)
    gen_batch_size: StrictInt = config_key(
        0,
        "dynamic: prompts per generation batch, each sampled group_size times (veRL's data.gen_batch_size); "
        "0 = data.prompts_per_step",
        ge=0,
    )
    filter_metric: FilterMetricName = config_key(
        "acc",
        "dynamic: what a group must vary in to be trained on (veRL's algorithm.filter_groups.metric): acc "
        "(correct or not) or seq_reward (the reward)",
    )
    max_num_gen_batches: StrictInt = config_key(
        0,
        "dynamic: most generation batches a step samples; a step short of data.prompts_per_step mixed groups "
        "then stops the run, as veRL's recipe does; 0 = no limit (until the training pool runs out)",
        ge=0,
    )
    # ada: Reinforce-Ada's knobs, under the names of its authors' config (the group the update sees is group_size)
    reinforce_ada_choice: AdaChoiceName = config_key(
        "balanced",
        "ada: when a prompt leaves the rounds: balanced (group_size / 2 correct and as many wrong rollouts so "
        "far) or positive_focused (one correct)",
    )
    max_rounds: StrictInt = config_key(4, "ada: most rounds a step samples", ge=1)
    round_repeat: StrictInt = config_key(8, "ada: rollouts per prompt still in the rounds, per round", ge=1)
    positive_threshold: Number = config_key(0.7, "ada: a rollout whose reward is above this is positive")
    global_stat_est: StrictBool = config_key(
        True,
        "ada: each prompt's baseline from every rollout it got in the step, not only from the group the update "
        "sees (the authors' script: true)",
    )
    norm_adv_by_std_in_grpo: StrictBool = config_key(
        False,
        "ada: divide each advantage by the baseline's standard deviation (the authors' script: false; the other "
        "strategies always divide by their group's)",
    )

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

    @property
    def piloted(self) -> bool:
        """Whether each step starts with a pilot (``estimator = pilot``)."""
        return self.estimator == Estimator.PILOT

    @property
    def sampling(self) -> str:
        """How a step samples (``store.step_stages``): ``once`` (its budget), ``pilot`` (two rounds: a pilot, then
        the rest of the budget allocated on it) or ``rounds`` (``dynamic``, ``ada``: rounds decided from the rewards
        of the rounds before)."""
        if self.strategy in IN_ROUNDS:
            return "rounds"
        return "pilot" if self.piloted else "once"

    @property
    def rollouts_per_prompt(self) -> int:
        """The rollouts a prompt of a step's first round gets under ``dynamic`` (group_size) and ``ada``
        (round_repeat)."""
        return self.round_repeat if self.strategy == Strategy.ADA else self.group_size

    @model_validator(mode="after")
    def _budgets(self) -> AllocationConfig:
        if self.max_budget < self.min_budget:
            self._fail("max_budget", f"must be >= allocation.min_budget ({self.min_budget})")
        if self.estimator != Estimator.LAST and self.strategy == Strategy.KNAPSACK:
            self._fail(
                "estimator",
                "knapsack has its own estimate (the mean of a prompt's newest 16 rollouts); set "
                "allocation.estimator=last with knapsack, or allocation.strategy=coba or uniform",
            )
        if self.strategy in IN_ROUNDS and self.group_size < 2:
            self._fail(
                "group_size",
                f"must be >= 2 with {self.strategy}: the group the update sees is group_size rollouts, and a group of "
                "one has no advantage",
            )
        if self.strategy in IN_ROUNDS and self.estimator != Estimator.LAST:
            self._fail(
                "estimator",
                f"{self.strategy} samples its own rounds and uses no estimate; set allocation.estimator=last with "
                f"allocation.strategy={self.strategy}",
            )
        if self.piloted and self.pilot_rollouts > self.min_budget:
            self._fail(
                "pilot_rollouts",
                f"must be <= allocation.min_budget ({self.min_budget}): every budget holds its pilot's rollouts; "
                f"set allocation.pilot_rollouts to at most {self.min_budget}",
            )
        return self


class OptimConfig(Section):
    """The GRPO update: AdamW and the clipped token-mean loss (docs/method.md)."""

    SECTION: ClassVar[str] = "optim"

    lr: Number = config_key(1e-4, "AdamW learning rate (the paper uses 1e-6 for 7B models)", gt=0)
    weight_decay: Number = config_key(0.0, "AdamW decoupled weight decay", ge=0)
    betas: Annotated[
        tuple[Number, Number], BeforeValidator(a_list), rule(lambda v: all(0 <= b < 1 for b in v), "out of [0, 1)")
    ] = config_key(
        (0.9, 0.999), "AdamW (beta1, beta2), each in [0, 1)", "must be two numbers in [0, 1), e.g. [0.9, 0.999]"
    )
    eps: Number = config_key(1e-8, "AdamW denominator epsilon", gt=0)
    max_grad_norm: Number = config_key(1.0, "clip the global gradient norm to this value", gt=0)
    micro_batch_size: StrictInt = config_key(
        64, "sequences per forward/backward pass: bounds memory whatever the budgets", ge=1
    )
    mini_batches: StrictInt = config_key(
        1, "optimizer steps per epoch over a step's rollouts (veRL's PPO mini-batches)", ge=1
    )
    clip_low: Number = config_key(0.2, "ratio clipped below at 1 - clip_low", gt=0, lt=1)
    clip_high: Number = config_key(0.28, 'ratio clipped above at 1 + clip_high ("clip-higher")', gt=0)
    kl_coef: Number = config_key(
        0.0, "coefficient of the KL penalty to the initial policy; 0 = none (the default)", ge=0
    )
    update_epochs: StrictInt = config_key(1, "optimiser passes over each step's rollouts", ge=1)
    lr_warmup_steps: StrictInt = config_key(
        0, "linear warm-up: training step k (from 0) updates at lr * min(1, (k + 1) / N); 0 = none", ge=0
    )
    lr_schedule: Literal["constant", "linear", "cosine"] = config_key(
        "constant",
        "the learning rate after the warm-up: constant, or decayed to 0 over run.steps updates as transformers' "
        "linear or cosine schedule (under run.rollout_budget run.steps is the most steps: the decay spans them)",
    )
    fsdp_processes: StrictInt = config_key(
        1, "1 = the update in the flow process; N > 1 = each update a torchrun job of N FSDP ranks", ge=1
    )
    shared_prefix: StrictBool = config_key(
        True, "encode each group's prompt once in the update (same loss and gradients, faster)"
    )
    skip_zero_advantage: StrictBool = config_key(
        True, "leave advantage-0 rows out of the passes when kl_coef is 0 (same gradients)"
    )
    rollout_correction: RolloutCorrectionLevel = config_key(
        "none",
        "truncated importance sampling pi_trainer / pi_sampler on the loss (veRL's rollout_is, TRL's "
        "vllm_importance_sampling_correction): none, token (a ratio per token) or sequence (one per completion)",
        "must be none (no correction), token (weight each token by min(pi_old / pi_sampler, cap)) or sequence "
        "(weight each completion by min(product of its token ratios, cap))",
    )
    rollout_correction_cap: Number = config_key(
        2.0,
        "the truncation C: the weight is min(ratio, C) (veRL's rollout_is_threshold, TRL's "
        "vllm_importance_sampling_cap)",
        gt=0,
    )
    rollout_mask_threshold: Number = config_key(
        0.0,
        "tau > 1: tokens (token level) or completions (sequence level) whose ratio is outside [1/tau, tau] are "
        "left out of the loss (veRL's rollout_rs_threshold); 0 = no masking",
        ge=0,
    )
    prompt_weighting: PromptWeightingName = config_key(
        "tokens",
        "how the loss weighs a step's prompts: tokens = every completion token the same (the token mean, as veRL and "
        "the paper: a prompt weighs its tokens, so its weight grows with its rollouts); equal = each prompt's group "
        "the same (1/M, its tokens sharing it: more rollouts lower its gradient's variance, not raise its weight)",
        "must be tokens (every completion token of the step weighs the same) or equal (every prompt of the step "
        "weighs the same)",
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


class VerifyConfig(Section):
    """Reward verification in a process pool."""

    SECTION: ClassVar[str] = "verify"

    workers: StrictInt = config_key(2, "verifier processes", ge=1)
    timeout_s: Number = config_key(
        5.0, "hard wall-clock limit per completion, seconds; over it counts as a timeout", gt=0, le=MAX_VERIFY_TIMEOUT_S
    )
    unknown_sources: UnknownSources = config_key(
        "error",
        "a data_source without a verifier: error = refuse the run; math = math-verify",
        "must be error (a data_source without a registered verifier stops the run before it starts) or math "
        "(math-verify scores such rows)",
    )
    gsm8k_answer: Gsm8kAnswer = config_key(
        "math",
        "how an openai/gsm8k or gsm8k completion is scored: math = math-verify over the whole text; strict = veRL's "
        'GSM8K scorer (the number after the last "#### ", compared as text); flexible = veRL\'s flexible mode '
        '(the last number in the text); docs/design.md, "veRL datasets"',
        "must be math (math-verify, the default), strict (veRL's default GSM8K scorer: the number after the last "
        '"#### ") or flexible (veRL\'s flexible GSM8K scorer: the last number)',
    )
    reward_function: Text = config_key(
        "",
        "your reward instead of the built-in verifiers: path/to/file.py[:function] with veRL's compute_score "
        "signature (docs/operations.md); empty = the built-in verifiers",
    )
    pass_threshold: Number = config_key(
        1.0, "a reward_function score >= this counts as solved (the pass rates CoBA-RL uses)"
    )
    max_error_share: Number = config_key(
        0.5,
        "a step (or a held-out set of an evaluation) whose share of error and timeout verdicts is above this stops "
        "the run, showing the first error (1 = never stop)",
        ge=0,
        le=1,
    )

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
