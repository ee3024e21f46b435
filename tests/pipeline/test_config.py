"""Run config: loading, overrides, type coercion, range and cross-field checks, saving, hashing."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from coba_tasks.core.allocation import strategies
from coba_tasks.core.solvers import coba_solvers
from coba_tasks.engines.rollout import backends
from coba_tasks.pipeline.config import (
    DEFAULT_CONFIG_PATH,
    HASH_NEUTRAL_DEFAULTS,
    PROJECT_ROOT,
    Config,
    apply_overrides,
    check_paths,
    config_from_dict,
    config_hash,
    config_to_dict,
    load_config,
)
from coba_tasks.pipeline.config_docs import config_reference
from coba_tasks.pipeline.config_fields import SECTIONS, ConfigError
from coba_tasks.pipeline.config_sections import AllocationConfig, OptimConfig, RunConfig
from coba_tasks.pipeline.store import RunStore

CONFIGS = PROJECT_ROOT / "configs"
TINY_DEMO = CONFIGS / "demo-tiny.yaml"  # the config-mechanics tests run on the tiny demo (M = 128, G = 16)


def write(tmp_path: Path, text: str, name: str = "c.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def all_keys() -> list[str]:
    return [f"{name}.{key}" for name, cls in SECTIONS.items() for key in cls.model_fields]


# ---------------------------------------------------------------------------------------------
# Loading the shipped configs and the defaults


def test_defaults_are_the_documented_values():
    cfg = Config()
    assert (cfg.run.name, cfg.run.seed, cfg.run.steps, cfg.run.eval_every) == ("demo", 0, 20, 5)
    assert (cfg.run.eval_samples, cfg.run.eval_temperature) == (1, 0.0)
    assert (cfg.data.prompts_per_step, cfg.data.eval_prompts, cfg.data.shuffle) == (32, 0, True)
    assert (cfg.model.path, cfg.model.dtype) == ("models/arith-tiny", "float32")
    assert (cfg.rollout.backend, cfg.rollout.max_tokens, cfg.rollout.in_process) == ("vllm", 12, None)
    a = cfg.allocation
    assert (a.strategy, a.mode, a.solver, a.group_size, a.min_budget, a.max_budget) == (
        "coba",
        "paper",
        "heap",
        16,
        2,
        128,
    )
    assert (a.tau, a.kappa, a.gamma, a.capability_window, a.pass_rate_window) == ("adaptive", 11.0, 10.0, 1, 1)
    o = cfg.optim
    assert (o.lr, o.betas, o.clip_low, o.clip_high, o.kl_coef, o.micro_batch_size) == (
        1e-4,
        (0.9, 0.999),
        0.2,
        0.28,
        0.0,
        64,
    )
    assert (cfg.verify.workers, cfg.verify.timeout_s) == (2, 5.0)
    assert cfg.data.on_bad_rows == "error"
    assert cfg.budget_per_step() == 32 * 16


def test_empty_file_gives_the_defaults(tmp_path):
    assert load_config(write(tmp_path, "# nothing\n")) == Config()
    assert load_config(write(tmp_path, "optim:\n", "empty-section.yaml")) == Config()


def only_departures(name: str) -> None:
    """A shipped config lists only the keys where its recipe departs from the defaults (config.py has them)."""
    raw = yaml.safe_load((CONFIGS / name).read_text())
    assert list(raw) == [s for s in SECTIONS if s in raw], name  # sections in the usual order
    defaults = config_to_dict(Config())
    same = [
        f"{s}.{k}"
        for s, body in raw.items()
        for k in body
        if config_to_dict(load_config(CONFIGS / name))[s][k] == defaults[s][k]
    ]
    assert not same, f"{name} repeats defaults: {same}"


def test_demo_yaml_is_the_default_and_lists_only_its_departures():
    cfg = load_config()
    assert cfg == load_config(DEFAULT_CONFIG_PATH) == load_config(CONFIGS / "demo.yaml")
    assert (cfg.run.steps, cfg.run.eval_every, cfg.data.prompts_per_step, cfg.allocation.group_size) == (10, 0, 16, 8)
    assert cfg.budget_per_step() == 128 and cfg.model.path == "models/smollm2-135m-instruct"
    assert cfg.allocation.strategy == "coba" and (cfg.model.lora_rank, cfg.optim.lr) == (16, 3e-4)
    r = cfg.run
    assert (r.eval_samples, r.eval_temperature, r.eval_top_p, r.eval_greedy) == (4, 1.0, 0.9, True)  # avg@4
    assert cfg.data.extra_tests == ("data/arith_chat_test_reworded.parquet",)
    for name in sorted(p.name for p in CONFIGS.glob("*.yaml")):  # no shipped config repeats a default
        only_departures(name)
    assert "docs/config.md" in (CONFIGS / "demo.yaml").read_text()  # where the rest are listed
    tiny = load_config(CONFIGS / "demo-tiny.yaml")
    assert tiny.budget_per_step() == 2048 and tiny.model.path == "models/arith-tiny" and tiny.run.name == "demo-tiny"


def test_tiny_test_yaml_is_small():
    cfg = load_config(CONFIGS / "tiny-test.yaml")
    assert cfg.run.name != Config().run.name  # its own run directory
    assert (cfg.run.steps, cfg.run.eval_every) == (2, 0)
    assert (cfg.data.prompts_per_step, cfg.data.eval_prompts) == (4, 10)
    assert (cfg.allocation.group_size, cfg.allocation.max_budget) == (4, 8)
    assert (cfg.optim.micro_batch_size, cfg.rollout.max_tokens) == (8, 8)
    assert cfg.budget_per_step() == 16


def test_shipped_configs_point_at_shipped_files():
    for name in ("demo.yaml", "demo-tiny.yaml", "tiny-test.yaml", "smollm2-arith.yaml"):
        cfg = load_config(CONFIGS / name)
        for path in (cfg.data.train, cfg.data.test, *cfg.data.extra_tests):
            assert (PROJECT_ROOT / path).is_file(), (name, path)


def test_config_is_frozen():
    cfg = load_config(TINY_DEMO)
    with pytest.raises(ValidationError, match="frozen"):
        cfg.optim.lr = 1.0  # type: ignore[misc]
    with pytest.raises(ValidationError, match="frozen"):
        cfg.run = RunConfig()  # type: ignore[misc]


# ---------------------------------------------------------------------------------------------
# Overrides and type coercion


def test_overrides_with_dotted_keys_and_types():
    cfg = load_config(
        TINY_DEMO,
        [
            "optim.lr=3e-5",  # PyYAML reads this as a string; a float field takes it
            "optim.clip_high=1",  # int -> float
            "optim.betas=[0.8, 0.99]",
            "data.prompts_per_step=4",
            "data.shuffle=false",
            "allocation.tau=4",
            "allocation.strategy=uniform",
            "rollout.in_process=true",
            "run.name=2024",  # plain string fields take the text verbatim
            " run.seed = 7 ",
        ],
    )
    assert cfg.optim.lr == 3e-5 and isinstance(cfg.optim.lr, float)
    assert cfg.optim.clip_high == 1.0 and isinstance(cfg.optim.clip_high, float)
    assert cfg.optim.betas == (0.8, 0.99)
    assert cfg.data.prompts_per_step == 4 and cfg.data.shuffle is False
    assert cfg.allocation.tau == 4.0 and isinstance(cfg.allocation.tau, float)
    assert cfg.allocation.strategy == "uniform"
    assert cfg.rollout.in_process is True
    assert cfg.run.name == "2024" and cfg.run.seed == 7
    assert cfg.budget_per_step() == 4 * 16
    # untouched keys keep the file's values
    assert cfg.run.steps == 24 and cfg.optim.kl_coef == 0.0


def test_later_override_wins_and_null_resets_optional():
    cfg = load_config(
        TINY_DEMO, ["optim.lr=1e-3", "optim.lr=2e-3", "rollout.in_process=true", "rollout.in_process=null"]
    )
    assert cfg.optim.lr == 2e-3 and cfg.rollout.in_process is None


def test_float_strings_in_files_are_numbers(tmp_path):
    cfg = load_config(write(tmp_path, "optim:\n  lr: 1e-5\n  eps: '1e-6'\nallocation:\n  tau: '2.5'\n"))
    assert (cfg.optim.lr, cfg.optim.eps, cfg.allocation.tau) == (1e-5, 1e-6, 2.5)


def test_apply_overrides_gives_a_new_validated_config():
    base = load_config(TINY_DEMO)
    other = apply_overrides(base, ["allocation.strategy=knapsack"])
    assert other.allocation.strategy == "knapsack" and base.allocation.strategy == "coba"
    assert other.model_copy(update={"allocation": base.allocation}) == base
    with pytest.raises(ConfigError, match=r"allocation\.strategy"):
        apply_overrides(base, ["allocation.strategy=best"])


# (override, what its error says): a key or section that does not exist, or no "=" at all
UNKNOWN_KEY_OVERRIDES = [
    ("optim.lrr=1", r"unknown config key 'optim\.lrr'.*did you mean 'lr'.*valid keys of optim: lr, weight_decay"),
    ("optimiser.lr=1", r"unknown config section 'optimiser'.*valid sections: run, data, model"),
    ("lr=1", r"unknown config section 'lr'"),
    # another trainer's name for a key: coba-rl's name for it
    ("optim.learning_rate=1e-5", r"'optim\.learning_rate'.*\(TRL's learning_rate is coba-rl's optim\.lr\); valid keys"),
    ("num_generations=8", r"section 'num_generations'.*TRL's num_generations is coba-rl's allocation\.group_size"),
    ("actor_rollout_ref.rollout.n=8", r"'actor_rollout_ref'.*veRL's rollout\.n is coba-rl's allocation\.group_size"),
    ("optim.ppo_mini_batch_size=4", r"coba-rl's optim\.mini_batches, a count where veRL's is a size"),
    ("optim.lr", r"must look like section\.key=value"),
]


def test_unknown_keys_in_a_file_name_the_file_and_key(tmp_path):
    path = write(tmp_path, "optim:\n  learning_rate: 0.1\n")
    with pytest.raises(
        ConfigError, match=r"unknown config key 'optim\.learning_rate' in .*c\.yaml.*valid keys of optim"
    ):
        load_config(path)
    with pytest.raises(ConfigError, match=r"unknown config section 'trainer' in .*c\.yaml"):
        load_config(write(tmp_path, "trainer:\n  lr: 0.1\n"))


# (override, what its error says): a value of the wrong type names the key, the expected type and the value
WRONG_TYPE_OVERRIDES = [
    ("optim.lr=fast", r"optim\.lr: expected a number, got 'fast' \(str\)"),
    ("optim.lr=true", r"optim\.lr: expected a number, got True \(bool\)"),
    ("optim.lr=.nan", r"optim\.lr: expected a finite number"),
    ("optim.lr=1e999", r"optim\.lr: expected a finite number"),
    ("run.steps=2.5", r"run\.steps: expected an integer, got 2\.5 \(float\)"),
    ("run.steps=true", r"run\.steps: expected an integer, got True \(bool\)"),
    ("data.shuffle=1", r"data\.shuffle: expected true or false, got 1 \(int\)"),
    ("optim.betas=0.9", r"optim\.betas: expected a list of 2 numbers, got 0\.9 \(float\)"),
    ("optim.betas=[0.9, x]", r"optim\.betas\[1\]: expected a number, got 'x'"),
    ("rollout.in_process=maybe", r"rollout\.in_process: expected true or false or null, got 'maybe'"),
    ("allocation.tau=[1]", r"allocation\.tau: expected a string or a number, got \[1\]"),
    ("allocation.tau=fast", r"allocation\.tau = 'fast': must be 'adaptive' or a positive number"),
    ("optim.lr=[1, 2", r"--set optim\.lr:1:\d+: invalid YAML"),
]


@pytest.mark.parametrize(("override", "pattern"), UNKNOWN_KEY_OVERRIDES + WRONG_TYPE_OVERRIDES)
def test_bad_override_names_the_dotted_key(override, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(TINY_DEMO, [override])


def test_wrong_type_in_a_file(tmp_path):
    with pytest.raises(ConfigError, match=r"run\.name: expected a string, got 2024 \(int\)"):
        load_config(write(tmp_path, "run:\n  name: 2024\n"))
    with pytest.raises(ConfigError, match=r"config section 'optim' in .* must be a mapping"):
        load_config(write(tmp_path, "optim: [1, 2]\n"))
    with pytest.raises(ConfigError, match=r"expected a mapping of sections"):
        load_config(write(tmp_path, "- run\n- data\n"))


# ---------------------------------------------------------------------------------------------
# Range checks and cross-field checks


@pytest.mark.parametrize(
    ("override", "pattern"),
    [
        ("run.name=../evil", r"run\.name = '\.\./evil': must be one path component"),
        ("run.name=.hidden", r"run\.name .*not starting with '\.'"),
        ("run.name=a b", r"run\.name"),
        ("run.seed=-1", r"run\.seed = -1: must be in \[0, "),
        ("run.steps=0", r"run\.steps = 0: must be >= 1"),
        ("run.eval_every=-1", r"run\.eval_every = -1: must be >= 0"),
        ("run.eval_samples=0", r"run\.eval_samples = 0: must be >= 1"),
        ("run.eval_temperature=0", r"run\.eval_samples = 16: .*needs run\.eval_temperature > 0"),
        ("run.eval_temperature=-0.5", r"run\.eval_temperature = -0\.5: must be >= 0"),
        ("data.prompts_per_step=0", r"data\.prompts_per_step = 0: must be >= 1"),
        ("data.eval_prompts=-3", r"data\.eval_prompts = -3: must be >= 0"),
        ("data.train=", r"data\.train = '': must name a Parquet file"),
        ("data.on_bad_rows=ignore", r"data\.on_bad_rows = 'ignore': must be error .* or skip .*bad_rows\.parquet"),
        ("model.dtype=fp8", r"model\.dtype = 'fp8': must be one of float32, bfloat16, float16, auto"),
        ("rollout.backend=sglang", r"rollout\.backend = 'sglang': must be one of transformers, vllm"),
        ("rollout.temperature=-1", r"rollout\.temperature = -1\.0: must be > 0: training rollouts are sampled"),
        ("rollout.temperature=0", r"rollout\.temperature = 0\.0: must be > 0: .*every group's rewards equal"),
        ("rollout.top_p=0", r"rollout\.top_p = 0\.0: must be 1\.0"),
        ("rollout.top_p=1.5", r"rollout\.top_p = 1\.5: must be 1\.0"),
        ("rollout.top_p=0.9", r"rollout\.top_p = 0\.9: must be 1\.0: a nucleus-truncated sampler .*run\.eval_top_p"),
        ("rollout.max_tokens=0", r"rollout\.max_tokens = 0: must be >= 1"),
        ("rollout.max_model_len=12", r"rollout\.max_model_len = 12: must exceed rollout\.max_tokens \(12\)"),
        ("rollout.gpu_memory_utilization=1.2", r"rollout\.gpu_memory_utilization = 1\.2: must be in \(0, 1\]"),
        (
            "allocation.strategy=best",
            r"allocation\.strategy = 'best': must be one of ada, coba, dynamic, knapsack, uniform",
        ),
        ("allocation.mode=fancy", r"allocation\.mode = 'fancy': must be one of paper, released"),
        ("allocation.solver=lp", r"allocation\.solver = 'lp': must be one of dp, heap, threshold"),
        ("allocation.min_budget=1", r"allocation\.min_budget = 1: .*a GRPO group of one rollout has no advantage"),
        ("allocation.max_budget=1", r"allocation\.max_budget = 1: must be >= allocation\.min_budget \(2\)"),
        ("allocation.tau=0", r"allocation\.tau = 0\.0: must be 'adaptive' or a positive number"),
        ("allocation.kappa=2", r"allocation\.kappa = 2\.0: must be > 2"),
        ("allocation.gamma=0", r"allocation\.gamma = 0\.0: must be > 0"),
        ("allocation.capability_window=0", r"allocation\.capability_window = 0: must be >= 1"),
        ("allocation.pass_rate_window=0", r"allocation\.pass_rate_window = 0: must be >= 1"),
        ("optim.lr=0", r"optim\.lr = 0\.0: must be > 0"),
        ("optim.weight_decay=-1e-2", r"optim\.weight_decay = -0\.01: must be >= 0"),
        ("optim.betas=[0.9, 1.0]", r"optim\.betas = \[0\.9, 1\.0\]: must be two numbers in \[0, 1\)"),
        ("optim.eps=0", r"optim\.eps = 0\.0: must be > 0"),
        ("optim.max_grad_norm=0", r"optim\.max_grad_norm = 0\.0: must be > 0"),
        ("optim.micro_batch_size=0", r"optim\.micro_batch_size = 0: must be >= 1"),
        ("optim.clip_low=0", r"optim\.clip_low = 0\.0: must be in \(0, 1\)"),
        ("optim.clip_low=1", r"optim\.clip_low = 1\.0: must be in \(0, 1\)"),
        ("optim.clip_high=0", r"optim\.clip_high = 0\.0: must be > 0"),
        ("optim.kl_coef=-0.1", r"optim\.kl_coef = -0\.1: must be >= 0"),
        ("optim.update_epochs=0", r"optim\.update_epochs = 0: must be >= 1"),
        ("optim.lr_warmup_steps=-1", r"optim\.lr_warmup_steps = -1: must be >= 0"),
        ("verify.workers=0", r"verify\.workers = 0: must be >= 1"),
        ("verify.timeout_s=0", r"verify\.timeout_s = 0\.0: must be in \(0, "),
    ],
)
def test_bad_values_name_the_key_and_the_fix(override, pattern):
    with pytest.raises(ConfigError, match=pattern) as info:
        load_config(TINY_DEMO, [override])
    assert "\n" not in str(info.value)


def test_values_at_the_edges_are_accepted():
    cfg = load_config(
        TINY_DEMO,
        [
            "run.eval_every=0",
            "run.eval_samples=4",
            "run.eval_temperature=1.0",
            "rollout.temperature=0.05",
            "rollout.top_p=1",
            "rollout.max_model_len=0",
            "optim.kl_coef=0",
            "optim.clip_high=1.5",
            "allocation.tau=0.5",
            "allocation.kappa=2.5",
            "allocation.min_budget=16",
            "allocation.max_budget=16",
            "run.eval_every=100",  # larger than run.steps: allowed (evaluates only before and after)
        ],
    )
    assert cfg.allocation.min_budget == cfg.allocation.group_size == cfg.allocation.max_budget == 16
    assert cfg.run.eval_every > cfg.run.steps and cfg.rollout.max_model_len == 0


def test_group_size_outside_the_bounds_is_infeasible_with_numbers():
    with pytest.raises(ConfigError, match=r"group_size = 200 .*\[2, 128\].*B_total = M \* G = 128 \* 200 = 25600"):
        load_config(TINY_DEMO, ["allocation.group_size=200"])
    with pytest.raises(ConfigError, match=r"group_size = 1 .*needs 256 <= B_total <= 16384"):
        load_config(TINY_DEMO, ["allocation.group_size=1"])
    with pytest.raises(ConfigError, match=r"group_size = 16 .*\[20, 32\]"):
        load_config(TINY_DEMO, ["allocation.min_budget=20", "allocation.max_budget=32"])


@pytest.mark.parametrize(
    "name", ["..", ".", "../runs/x", "a/b", "/tmp/evil", "a\\b", "~", "x" * 201, "", " ", "run\nname", "a:b"]
)
def test_run_name_cannot_leave_the_runs_directory(tmp_path, name):
    for make in (
        lambda: load_config(TINY_DEMO, [f"run.name={name}"]),
        lambda: load_config(write(tmp_path, yaml.safe_dump({"run": {"name": name}}))),
        lambda: RunConfig(name=name),
    ):
        with pytest.raises(ConfigError, match=r"^run\.name = .*must be one path component") as info:
            make()
        assert "\n" not in str(info.value)


def test_budget_bounds_name_the_key_and_the_feasible_range():
    cases = [
        (["allocation.min_budget=1"], r"^allocation\.min_budget = 1: must be >= 2"),
        (["allocation.min_budget=0", "allocation.group_size=4"], r"^allocation\.min_budget = 0: must be >= 2"),
        (["allocation.min_budget=8", "allocation.max_budget=4"], r"^allocation\.max_budget = 4: must be >= .*\(8\)"),
        (["allocation.group_size=1"], r"^allocation\.group_size = 1 is outside .*= \[2, 128\]"),
        (["allocation.group_size=129"], r"^allocation\.group_size = 129 is outside .*between 2 and 128"),
    ]
    for overrides, pattern in cases:
        with pytest.raises(ConfigError, match=pattern):
            load_config(TINY_DEMO, overrides)
    # B_total = M * G within [M * min_budget, M * max_budget]: the edges are feasible
    for g in (2, 128):
        assert load_config(TINY_DEMO, [f"allocation.group_size={g}"]).budget_per_step() == 128 * g


def test_on_bad_rows_is_error_or_skip_and_only_skip_changes_the_hash():
    cfg = load_config(TINY_DEMO)
    assert cfg.data.on_bad_rows == "error"
    skip = apply_overrides(cfg, ["data.on_bad_rows=skip"])
    assert skip.data.on_bad_rows == "skip" and config_hash(skip) != config_hash(cfg)
    # the key came after runs existed: at its default it is left out of the hash, so older runs keep theirs
    # (so are the other keys added later: run.eval_top_p, rollout.sleep_during_update)
    without = config_to_dict(cfg)
    assert ("data", "on_bad_rows") in HASH_NEUTRAL_DEFAULTS
    at_default = [(s, k) for (s, k), v in HASH_NEUTRAL_DEFAULTS.items() if without[s][k] == v]
    assert ("data", "on_bad_rows") in at_default and ("run", "eval_top_p") not in at_default  # demo: top-p 0.9
    for section, key in at_default:
        del without[section][key]
    text = json.dumps(without, sort_keys=True, separators=(",", ":"))
    assert config_hash(cfg) == hashlib.sha256(text.encode()).hexdigest()[:16]
    assert config_from_dict(without) == cfg  # an older run's config.yaml (no such key) loads with the default


def test_prompt_weighting_is_tokens_or_equal_and_hash_neutral_at_tokens():
    """optim.prompt_weighting: tokens (the default, the token mean) or equal; at its default a run keeps the hash
    it had before the key existed; the update is told it (coba_tasks.pipeline.policy.update_settings)."""
    from coba_tasks.pipeline.policy import update_settings

    cfg = load_config(TINY_DEMO)
    assert cfg.optim.prompt_weighting == "tokens" and update_settings(cfg).prompt_weighting == "tokens"
    assert HASH_NEUTRAL_DEFAULTS[("optim", "prompt_weighting")] == "tokens"
    without = config_to_dict(cfg)
    del without["optim"]["prompt_weighting"]
    assert config_from_dict(without) == cfg  # an older run's config.yaml loads with the default
    assert config_hash(apply_overrides(cfg, ["optim.prompt_weighting=tokens"])) == config_hash(cfg)
    equal = apply_overrides(cfg, ["optim.prompt_weighting=equal"])
    assert update_settings(equal).prompt_weighting == "equal" and config_hash(equal) != config_hash(cfg)
    with pytest.raises(ConfigError, match=r"^optim\.prompt_weighting = 'prompts': must be tokens .* or equal") as info:
        apply_overrides(cfg, ["optim.prompt_weighting=prompts"])
    assert "\n" not in str(info.value)


def test_estimator_keys_default_to_the_last_visit_and_keep_the_hash():
    """allocation.estimator (last, posterior, pilot), prior_strength, posterior_decay and pilot_rollouts: at their
    defaults a run keeps the hash it had before the keys existed; knapsack refuses another estimator (it has its
    own), and the pilot's k cannot exceed min_budget (every budget holds the pilot's rollouts)."""
    cfg = load_config(TINY_DEMO)
    a = cfg.allocation
    assert (a.estimator, a.prior_strength, a.posterior_decay, a.pilot_rollouts) == ("last", 2.0, 0.5, 2)
    keys = ("estimator", "prior_strength", "posterior_decay", "pilot_rollouts")
    without = config_to_dict(cfg)
    for key in keys:
        assert HASH_NEUTRAL_DEFAULTS[("allocation", key)] == getattr(a, key)
        del without["allocation"][key]
    assert config_from_dict(without) == cfg  # an older run's config.yaml loads with the defaults
    same = ["allocation.estimator=last", "allocation.prior_strength=2", "allocation.posterior_decay=0.5"]
    assert config_hash(apply_overrides(cfg, same)) == config_hash(cfg)
    changes = ("estimator=posterior", "estimator=pilot", "prior_strength=4", "posterior_decay=1", "pilot_rollouts=1")
    for change in changes:
        assert config_hash(apply_overrides(cfg, [f"allocation.{change}"])) != config_hash(cfg), change
    with pytest.raises(ConfigError, match=r"^allocation\.estimator = 'recent': must be last .* or pilot") as info:
        apply_overrides(cfg, ["allocation.estimator=recent"])
    assert "\n" not in str(info.value)
    knapsack = ["allocation.strategy=knapsack", "allocation.estimator=posterior"]
    with pytest.raises(ConfigError, match=r"^allocation\.estimator = 'posterior': knapsack has its own estimate"):
        apply_overrides(cfg, knapsack)
    assert apply_overrides(cfg, ["allocation.strategy=uniform", "allocation.estimator=pilot"]).allocation.estimator
    with pytest.raises(ConfigError, match=r"^allocation\.pilot_rollouts = 3: must be <= allocation\.min_budget \(2\)"):
        apply_overrides(cfg, ["allocation.estimator=pilot", "allocation.pilot_rollouts=3"])
    assert apply_overrides(cfg, ["allocation.pilot_rollouts=3"]).allocation.pilot_rollouts == 3  # unused: no pilot
    for bad in ("pilot_rollouts=0", "posterior_decay=1.5", "posterior_decay=-0.1", "prior_strength=0"):
        with pytest.raises(ConfigError, match=rf"^allocation\.{bad.split('=')[0]} = "):
            apply_overrides(cfg, [f"allocation.{bad}"])


def test_sections_validate_when_built_directly():
    with pytest.raises(ConfigError, match=r"optim\.lr = -1\.0"):
        OptimConfig(lr=-1)
    with pytest.raises(ConfigError, match=r"allocation\.group_size = 1"):
        Config(allocation=AllocationConfig(group_size=1))
    with pytest.raises(ConfigError, match=r"^optim\.lr = -1\.0: must be > 0"):
        Config(optim={"lr": -1.0})  # type: ignore[arg-type]
    assert Config(optim={"lr": 1.0}).optim == OptimConfig(lr=1.0)  # type: ignore[arg-type]  # a dict is validated
    with pytest.raises(ConfigError, match=r"config section 'optim' must be a mapping of key: value, got 1\.0"):
        Config(optim=1.0)  # type: ignore[arg-type]
    assert OptimConfig(betas=[0.5, 0.6]).betas == (0.5, 0.6)  # type: ignore[arg-type]
    assert config_from_dict({"data": {"train": Path("data/x.parquet")}}).data.train == "data/x.parquet"


def test_choices_follow_the_registries():
    for strategy in strategies():
        assert load_config(TINY_DEMO, [f"allocation.strategy={strategy}"]).allocation.strategy == strategy
    for solver in coba_solvers():
        assert load_config(TINY_DEMO, [f"allocation.solver={solver}"]).allocation.solver == solver
    for backend in backends():
        assert load_config(TINY_DEMO, [f"rollout.backend={backend}"]).rollout.backend == backend


# ---------------------------------------------------------------------------------------------
# Files: missing, invalid YAML


def test_missing_file_is_named(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=r"config file .*nope\.yaml does not exist"):
        load_config(missing)
    with pytest.raises(ConfigError, match=r"is a directory"):
        load_config(tmp_path)


def test_invalid_yaml_gives_file_and_line(tmp_path):
    path = write(tmp_path, "run:\n  steps: 3\noptim:\n  betas: [0.9, 0.99\n  lr: 1\n")
    with pytest.raises(ConfigError, match=r"c\.yaml:\d+:\d+: invalid YAML") as info:
        load_config(path)
    assert "\n" not in str(info.value)
    line = int(str(info.value).split("c.yaml:")[1].split(":")[0])
    assert 4 <= line <= 6  # at or just after the unclosed list


def test_duplicate_keys_are_refused_with_the_line(tmp_path):
    path = write(tmp_path, "optim:\n  lr: 0.1\n  lr: 0.2\n")
    with pytest.raises(ConfigError, match=r"c\.yaml:3:3: invalid YAML: key 'lr' appears twice \(first on line 2\)"):
        load_config(path)


# ---------------------------------------------------------------------------------------------
# Round trips, saving, hashing


def test_dict_round_trip_is_plain_and_exact():
    cfg = load_config(TINY_DEMO, ["allocation.tau=3.5", "optim.lr=3e-5", "rollout.in_process=false"])
    d = config_to_dict(cfg)
    assert list(d) == list(SECTIONS)
    assert json.loads(json.dumps(d)) == d  # JSON-safe: no tuples, Paths or enums
    assert d["optim"]["betas"] == [0.9, 0.999]
    assert config_from_dict(d) == cfg
    assert config_to_dict(config_from_dict(d)) == d


def test_config_from_dict_validates_like_load():
    assert config_from_dict({}) == Config()
    with pytest.raises(ConfigError, match=r"unknown config key 'optim\.lrr'"):
        config_from_dict({"optim": {"lrr": 1}})
    with pytest.raises(ConfigError, match=r"optim\.lr: expected a number"):
        config_from_dict({"optim": {"lr": "x"}})
    with pytest.raises(ConfigError, match=r"a config is a mapping of sections"):
        config_from_dict([1, 2])  # type: ignore[arg-type]


def _saved_with_a_run(cfg, root):
    """The config as a run directory keeps it (config.yaml, written by RunStore.create), loaded back."""
    RunStore(root).create(config_to_dict(cfg), config_hash(cfg), {})
    return load_config(root / "config.yaml")


def test_a_run_keeps_the_same_config(tmp_path):
    cfg = load_config(CONFIGS / "tiny-test.yaml", ["allocation.tau=2.5", "optim.eps=1e-7"])
    assert _saved_with_a_run(cfg, tmp_path / "run") == cfg
    assert _saved_with_a_run(load_config(TINY_DEMO), tmp_path / "demo") == load_config(TINY_DEMO)


@pytest.mark.parametrize("name", ["2024", "null", "yes", "1e5", "0x1F", "1.0", "a.b-c_d"])
def test_a_run_keeps_names_that_look_like_other_yaml_types(tmp_path, name):
    cfg = load_config(TINY_DEMO, [f"run.name={name}"])
    assert cfg.run.name == name
    assert _saved_with_a_run(cfg, tmp_path / "run").run.name == name


def test_hash_is_stable_and_changes_with_any_value():
    cfg = load_config(TINY_DEMO)
    h = config_hash(cfg)
    assert len(h) == 16 and int(h, 16) >= 0
    assert config_hash(load_config(TINY_DEMO)) == h == config_hash(config_from_dict(config_to_dict(cfg)))
    assert config_hash(apply_overrides(cfg, ["optim.lr=1e-4"])) == h  # same value, same hash
    assert config_hash(apply_overrides(cfg, ["optim.lr=2e-4"])) != h
    assert config_hash(apply_overrides(cfg, ["run.seed=1"])) != h
    assert config_hash(load_config(CONFIGS / "tiny-test.yaml")) != h


# ---------------------------------------------------------------------------------------------
# check_paths


def make_project(root: Path) -> None:
    (root / "data").mkdir()
    (root / "data" / "arith_train.parquet").write_bytes(b"x")
    (root / "data" / "arith_test.parquet").write_bytes(b"x")
    (root / "models" / "arith-tiny").mkdir(parents=True)
    (root / "models" / "arith-tiny" / "config.json").write_text("{}")


def test_check_paths_passes_on_a_complete_tree(tmp_path, monkeypatch):
    make_project(tmp_path)
    check_paths(Config(), root=tmp_path)
    monkeypatch.chdir(tmp_path)
    check_paths(Config())  # relative to the working directory by default


def test_check_paths_names_the_missing_dataset(tmp_path):
    make_project(tmp_path)
    cfg = apply_overrides(Config(), ["data.test=data/other.parquet"])
    with pytest.raises(ConfigError, match=r"data\.test: data/other\.parquet does not exist"):
        check_paths(cfg, root=tmp_path)
    (tmp_path / "data" / "arith_train.parquet").unlink()
    with pytest.raises(ConfigError, match=r"data\.train: data/arith_train\.parquet does not exist"):
        check_paths(Config(), root=tmp_path)


def test_every_other_trainers_name_leads_to_a_coba_rl_key():
    from coba_tasks.pipeline.config_fields import PEER_NAMES, SECTIONS

    for name, (key, _, _) in PEER_NAMES.items():
        section, _, field = key.partition(".")
        assert field in SECTIONS[section].model_fields, (name, key)
        assert name not in SECTIONS, name


def test_a_hugging_face_hub_id_as_the_model_is_answered_with_how_to_fetch_it(tmp_path):
    make_project(tmp_path)
    cfg = apply_overrides(Config(), ["model.path=HuggingFaceTB/SmolLM2-135M-Instruct"])
    hint = r"looks like a Hugging Face Hub id; coba-rl downloads nothing: fetch it first \(`hf download "
    with pytest.raises(ConfigError, match=hint + r"HuggingFaceTB/SmolLM2-135M-Instruct --local-dir models/SmolLM2"):
        check_paths(cfg, root=tmp_path)
    for local in ("models/absent", "data/absent"):  # a path under the project's folders is a local path
        with pytest.raises(ConfigError, match=r"does not exist.*coba bootstrap"):
            check_paths(apply_overrides(Config(), [f"model.path={local}"]), root=tmp_path)


def test_check_paths_suggests_bootstrap_for_the_model(tmp_path):
    make_project(tmp_path)
    (tmp_path / "models" / "arith-tiny" / "config.json").unlink()
    with pytest.raises(ConfigError, match=r"model\.path: models/arith-tiny has no config\.json.*coba bootstrap"):
        check_paths(Config(), root=tmp_path)
    cfg = apply_overrides(Config(), ["model.path=models/absent"])
    with pytest.raises(ConfigError, match=r"model\.path: models/absent does not exist.*coba bootstrap"):
        check_paths(cfg, root=tmp_path)


# ---------------------------------------------------------------------------------------------
# Property: no override text crashes with anything but ConfigError

yaml_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**400), max_value=10**400)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)


@settings(max_examples=300, deadline=None)
@given(key=st.sampled_from(all_keys()), value=yaml_values)
def test_random_override_values_only_raise_config_error(key, value):
    text = yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
    try:
        cfg = load_config(TINY_DEMO, [f"{key}={text}"])
    except ConfigError as e:
        assert str(e) and "\n" not in str(e)
    else:  # what was accepted is valid and survives a round trip
        assert config_from_dict(config_to_dict(cfg)) == cfg


@settings(max_examples=200, deadline=None)
@given(key=st.sampled_from([*all_keys(), "optim", "x.y", ".", ""]), text=st.text(max_size=20))
def test_random_override_text_only_raises_config_error(key, text):
    try:
        cfg = load_config(TINY_DEMO, [f"{key}={text}"])
    except ConfigError as e:
        assert str(e) and "\n" not in str(e)
    else:
        assert isinstance(cfg, Config) and config_hash(cfg) == config_hash(config_from_dict(config_to_dict(cfg)))


# ---------------------------------------------------------------------------------------------
# Keys of the one-GPU path, and the real-model configs


def test_eval_top_p_and_sleep_during_update_validate():
    cfg = Config()
    assert cfg.run.eval_top_p == 1.0 and cfg.rollout.sleep_during_update is False
    assert load_config(overrides=["run.eval_top_p=0.9"]).run.eval_top_p == 0.9
    for bad in ("0", "1.5", "-0.1"):
        with pytest.raises(ConfigError, match=r"^run\.eval_top_p = .*: must be in \(0, 1\]"):
            load_config(overrides=[f"run.eval_top_p={bad}"])
    assert load_config(overrides=["rollout.sleep_during_update=true"]).rollout.sleep_during_update is True
    with pytest.raises(ConfigError, match=r"^rollout\.sleep_during_update: expected true or false, got 'sometimes'"):
        load_config(overrides=["rollout.sleep_during_update=sometimes"])
    # both keys came after runs existed: left out of the hash at their defaults, hashed at any other value
    assert config_hash(apply_overrides(cfg, ["run.eval_top_p=0.9"])) != config_hash(cfg)
    assert config_hash(apply_overrides(cfg, ["rollout.sleep_during_update=true"])) != config_hash(cfg)


@pytest.mark.parametrize("name", ["qwen2.5-0.5b-math.yaml", "qwen2.5-7b-math.yaml"])
def test_real_model_configs_load_and_validate(name):
    cfg = load_config(CONFIGS / name)  # no model or data needed to load and validate
    assert cfg.model.dtype == "bfloat16" and cfg.model.gradient_checkpointing
    assert cfg.rollout.backend == "vllm" and cfg.rollout.sleep_during_update and cfg.rollout.temperature == 1.0
    assert cfg.rollout.max_model_len > cfg.rollout.max_tokens and 0 < cfg.rollout.gpu_memory_utilization < 1
    assert (cfg.optim.lr, cfg.optim.clip_low, cfg.optim.clip_high, cfg.optim.kl_coef) == (1e-6, 0.2, 0.28, 0.0)
    assert (cfg.run.eval_samples, cfg.run.eval_temperature, cfg.run.eval_top_p) == (16, 1.0, 0.9)
    assert (cfg.data.train, cfg.data.test) == ("data/math/dapo_math_17k.parquet", "data/math/math500.parquet")
    assert cfg.allocation.strategy == "coba"
    if "7b" in name:  # the paper's setup
        assert cfg.model.path == "models/Qwen2.5-7B"
        assert (cfg.data.prompts_per_step, cfg.allocation.group_size, cfg.rollout.max_tokens) == (256, 16, 4096)
        assert cfg.budget_per_step() == 4096
    else:  # scaled down for one GPU, with comments saying so
        assert cfg.model.path == "models/Qwen2.5-0.5B"
        assert cfg.rollout.max_tokens < 4096 and cfg.budget_per_step() < 4096
    with pytest.raises(ConfigError, match=r"^data\.train: data/math/dapo_math_17k\.parquet does not exist"):
        check_paths(cfg, root=PROJECT_ROOT / "tests")  # the recipe's files are made by the user


# ---------------------------------------------------------------------------------------------
# Pinned: the resolved configs and hashes computed before the config became pydantic models
# (tests/pipeline/config_pinned.json); existing run directories must keep their hash to stay resumable

PINNED = json.loads((Path(__file__).parent / "config_pinned.json").read_text())


@pytest.mark.parametrize("name", sorted(PINNED["configs"]))
def test_shipped_configs_resolve_to_the_pinned_values_and_hashes(name):
    cfg = load_config(CONFIGS / name)
    assert config_to_dict(cfg) == PINNED["configs"][name]
    assert config_hash(cfg) == PINNED["hashes"][name]


def test_every_shipped_config_is_pinned():
    assert sorted(p.name for p in CONFIGS.glob("*.yaml")) == sorted(PINNED["configs"])


@pytest.mark.parametrize("variant", sorted(PINNED["variants"]))
def test_hashes_of_overridden_defaults_are_pinned(variant):
    cfg = apply_overrides(Config(), PINNED["variants"][variant])
    assert config_hash(cfg) == PINNED["hashes"][f"Config()+{variant}"]


def test_docs_config_md_is_up_to_date():
    """docs/config.md is generated from the fields' descriptions: after changing one, run
    `python -m coba_tasks.pipeline.config_docs` to write it again."""
    assert (PROJECT_ROOT / "docs" / "config.md").read_text(encoding="utf-8") == config_reference()
    readme = (PROJECT_ROOT / "README.md").read_text(encoding="utf-8")
    assert "docs/config.md" in readme


def test_reward_function_and_pass_threshold(tmp_path):
    """verify.reward_function: a path.py[:function] string, verbatim from --set and from YAML; its format is
    checked here (the file itself where a run's datasets are: coba_tasks.pipeline.data.reward_function).
    verify.pass_threshold: any finite number, with a reward function only. Both at their defaults leave
    the hash of existing runs as it was."""
    cfg = load_config(TINY_DEMO)
    assert (cfg.verify.reward_function, cfg.verify.pass_threshold) == ("", 1.0)
    assert ("verify", "reward_function") in HASH_NEUTRAL_DEFAULTS and (
        "verify",
        "pass_threshold",
    ) in HASH_NEUTRAL_DEFAULTS
    without = config_to_dict(cfg)
    del without["verify"]["reward_function"], without["verify"]["pass_threshold"]
    assert config_from_dict(without) == cfg  # an older run's config.yaml loads with the defaults
    old = {
        s: {k: v for k, v in body.items() if (s, k) not in HASH_NEUTRAL_DEFAULTS or v != HASH_NEUTRAL_DEFAULTS[(s, k)]}
        for s, body in without.items()
    }
    text = json.dumps(old, sort_keys=True, separators=(",", ":"))
    assert config_hash(cfg) == hashlib.sha256(text.encode()).hexdigest()[:16]  # the hash without the two keys

    custom = load_config(
        TINY_DEMO, ["verify.reward_function=rewards/my reward.py:score_it", "verify.pass_threshold=0.5"]
    )
    assert custom.verify.reward_function == "rewards/my reward.py:score_it" and custom.verify.pass_threshold == 0.5
    assert config_hash(custom) != config_hash(cfg)
    assert config_hash(apply_overrides(custom, ["verify.pass_threshold=0.75"])) != config_hash(custom)
    assert (
        load_config(TINY_DEMO, ["verify.reward_function=r.py", "verify.pass_threshold=-1"]).verify.pass_threshold == -1
    )
    path = tmp_path / "cfg.yaml"  # a deployment's config file
    path.write_text("verify:\n  reward_function: /srv/rewards/verl_reward.py\n  pass_threshold: 0.9\n")
    assert load_config(path).verify == Config().verify.model_copy(
        update={"reward_function": "/srv/rewards/verl_reward.py", "pass_threshold": 0.9}
    )
    for overrides, pattern in [
        (
            ["verify.reward_function=rewards/mine"],
            r"^verify\.reward_function = 'rewards/mine': must be path/to/file\.py",
        ),
        (["verify.reward_function=r.py:no-such"], r"verify\.reward_function = 'r\.py:no-such'.*leave it empty"),
        (["verify.pass_threshold=0.5"], r"^verify\.pass_threshold = 0\.5: applies to verify\.reward_function's scores"),
        (["verify.reward_function=r.py", "verify.pass_threshold=nan"], r"verify\.pass_threshold: expected a finite"),
        (["verify.reward_function=r.py", "verify.pass_threshold=high"], r"verify\.pass_threshold: expected a number"),
    ]:
        with pytest.raises(ConfigError, match=pattern) as info:
            load_config(TINY_DEMO, overrides)
        assert "\n" not in str(info.value)


def test_run_trackers_take_a_list_or_comma_separated_names_and_refuse_unknown_ones():
    """run.trackers: a list, or names separated by commas from --set; a name not among the known trackers
    (or one given twice) is a one-line error naming the key; at its default (none) the hash is as before."""
    assert load_config(TINY_DEMO).run.trackers == ()
    assert ("run", "trackers") in HASH_NEUTRAL_DEFAULTS
    for text, names in (
        ("tensorboard,mlflow", ("tensorboard", "mlflow")),
        ("[tensorboard]", ("tensorboard",)),
        ("wandb", ("wandb",)),
        ("", ()),
        ("[]", ()),
    ):
        assert load_config(TINY_DEMO, [f"run.trackers={text}"]).run.trackers == names, text
    assert config_hash(load_config(TINY_DEMO, ["run.trackers=[]"])) == config_hash(load_config(TINY_DEMO))
    assert config_hash(load_config(TINY_DEMO, ["run.trackers=mlflow"])) != config_hash(load_config(TINY_DEMO))
    for bad in ("tensorbord", "[mlflow, mlflow]", "tensorboard,comet"):
        with pytest.raises(ConfigError, match=r"^run\.trackers = .*: must be a list of distinct tracker names among "):
            load_config(TINY_DEMO, [f"run.trackers={bad}"])


def test_a_tracker_whose_library_is_missing_is_one_line_naming_the_extra(monkeypatch):
    import importlib.util

    from coba_tasks.pipeline.config import check_installed

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n: None if n == "wandb" else real(n))
    with pytest.raises(ConfigError, match=r"^run\.trackers: wandb is not installed; install it with pip install -e "):
        check_installed(["tensorboard", "wandb"])
    check_installed(["tensorboard"])


def test_a_module_named_on_the_pytest_command_line_collects_no_function_of_the_package_as_a_test():
    """``test_set_name`` (a function of the package whose name starts with ``test``) was collected as a test
    where config_sections.py or data.py was named on the command line, and errored (no fixture ``path``)."""
    import subprocess
    import sys

    files = ["coba_tasks/pipeline/config_sections.py", "coba_tasks/pipeline/data.py"]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", "-p", "no:cacheprovider", *files],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:]
    collected = [line for line in done.stdout.splitlines() if "::" in line]
    # its doctest stays: the one item of that name, in config_sections.py
    assert [line for line in collected if "test_set_name" in line] == [
        "coba_tasks/pipeline/config_sections.py::coba_tasks.pipeline.config_sections.test_set_name"
    ]


def test_checkpoint_every_defaults_to_every_update_and_fsdp_needs_every_update():
    """run.checkpoint_every: 1 by default (the pinned hashes of the shipped configs are unchanged by the key), at
    least 1, and 1 under FSDP, whose updates each start from the previous step's checkpoint."""
    assert load_config(overrides=[]).run.checkpoint_every == 1
    with pytest.raises(ConfigError, match=r"^run\.checkpoint_every"):
        load_config(overrides=["run.checkpoint_every=0"])
    with pytest.raises(
        ConfigError, match=r"^run\.checkpoint_every = 2 with optim\.fsdp_processes = 2: each FSDP update starts"
    ):
        load_config(overrides=["run.checkpoint_every=2", "optim.fsdp_processes=2", "model.lora_rank=0"])


TASK_TIMEOUTS = ("rollouts_timeout_s", "update_timeout_s", "eval_timeout_s")


@pytest.mark.parametrize("key", TASK_TIMEOUTS)
def test_a_task_timeout_is_one_the_timers_can_take(key):
    """run.update_timeout_s = 1e10 passed validation, then failed the run's first task (Prefect's timer:
    "OverflowError: timestamp out of range for platform time_t") after its directory existed, a run that could
    never be resumed (its config is fixed by its hash). The bound is the timers' own: Prefect's alarm in the
    main thread (signal.setitimer) and its watcher thread elsewhere (threading's waits) take MAX_TIMEOUT_S
    seconds (about 292 years) and not a second more; above it the config is refused in one line with the range."""
    import signal
    import threading

    with pytest.raises(ConfigError) as info:
        load_config(TINY_DEMO, [f"run.{key}=1e10"])
    message = str(info.value)
    from coba_tasks.pipeline.config_sections import MAX_TIMEOUT_S

    assert message.startswith(f"run.{key} = 10000000000.0: must be in [0, {MAX_TIMEOUT_S}]"), message
    assert "\n" not in message
    assert getattr(load_config(TINY_DEMO, [f"run.{key}={MAX_TIMEOUT_S}"]).run, key) == MAX_TIMEOUT_S
    assert getattr(load_config(TINY_DEMO, [f"run.{key}=0"]).run, key) == 0  # none
    # the bound is the real one: what the timers take, and where they fail
    before = signal.setitimer(signal.ITIMER_REAL, MAX_TIMEOUT_S)
    signal.setitimer(signal.ITIMER_REAL, *before)
    assert threading.Lock().acquire(timeout=MAX_TIMEOUT_S) and MAX_TIMEOUT_S <= threading.TIMEOUT_MAX
    with pytest.raises(OverflowError):
        signal.setitimer(signal.ITIMER_REAL, MAX_TIMEOUT_S + 1)
    with pytest.raises(OverflowError):
        threading.Lock().acquire(timeout=MAX_TIMEOUT_S + 1)


def test_a_verifier_timeout_is_one_the_pool_can_wait_for():
    """verify.timeout_s = 1e7 passed validation, then the verifier pool's first wait for a verdict raised
    "OverflowError: timeout is too large" (multiprocessing's wait polls in milliseconds, a C int): refused on
    load in one line with the range; MAX_VERIFY_TIMEOUT_S is what the wait takes, and not a second more."""
    import multiprocessing
    from multiprocessing.connection import wait

    with pytest.raises(ConfigError) as info:
        load_config(TINY_DEMO, ["verify.timeout_s=1e7"])
    message = str(info.value)
    from coba_tasks.pipeline.config_sections import MAX_VERIFY_TIMEOUT_S

    assert message.startswith(f"verify.timeout_s = 10000000.0: must be in (0, {MAX_VERIFY_TIMEOUT_S}]"), message
    assert load_config(TINY_DEMO, [f"verify.timeout_s={MAX_VERIFY_TIMEOUT_S}"]).verify.timeout_s == MAX_VERIFY_TIMEOUT_S
    ours, theirs = multiprocessing.Pipe()
    theirs.send("verdict")
    assert wait([ours], timeout=MAX_VERIFY_TIMEOUT_S) == [ours]
    with pytest.raises(OverflowError):
        wait([ours], timeout=MAX_VERIFY_TIMEOUT_S + 1)


def test_a_weight_transport_the_engine_refuses_is_refused_by_the_config(tmp_path, monkeypatch, random_checkpoints):
    """rollout.weight_transport = bytes for an in-process engine was refused only by the engine's start, after
    the run directory existed (a run never resumable: its config is fixed by its hash). The engine's rule is
    now the config's: a transport no machine allows is refused on load, one this machine does not allow (the
    place of an engine with rollout.in_process = null) by check_platform, both before a run directory exists;
    for every place the config refuses exactly what the engine would."""
    import itertools

    import torch

    from coba_tasks.engines.rollout.vllm_backend import _transport
    from coba_tasks.pipeline.config import check_platform
    from coba_tasks.pipeline.run import resolve_run

    for overrides, why in (
        (["rollout.in_process=true", "rollout.weight_transport=bytes"], "the engine runs in this process"),
        (["rollout.in_process=false", "rollout.weight_transport=reference"], "the engine runs in a process of its"),
        (["rollout.tensor_parallel_size=2", "rollout.weight_transport=ipc"], "CUDA IPC needs an engine in a"),
        (["rollout.backend=vllm-ray", "rollout.in_process=true", "rollout.weight_transport=ipc"], "CUDA IPC needs"),
    ):
        with pytest.raises(ConfigError) as info:
            load_config(TINY_DEMO, overrides)
        message = str(info.value)
        transport = overrides[-1].split("=")[1]
        assert message.startswith(f"rollout.weight_transport = '{transport}': {why}"), message
        assert "\n" not in message and message.endswith("set rollout.weight_transport=auto"), message
    # the transformers engine takes no weight transport: nothing to refuse
    load_config(TINY_DEMO, ["rollout.backend=transformers", "rollout.in_process=true", "rollout.weight_transport=ipc"])

    # on this machine: before the run directory exists
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    model, _ = random_checkpoints
    config = load_config("configs/tiny-test.yaml", [f"model.path={model}", "rollout.weight_transport=bytes"])
    with pytest.raises(ConfigError, match=r"^rollout\.weight_transport = 'bytes': the engine runs in this process"):
        resolve_run(config=config, run_dir=str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()

    # the same rule as the engine's, wherever it runs
    for asked, in_process, cuda, tp in itertools.product(
        ("auto", "reference", "ipc", "bytes"), (None, True, False), (False, True), (1, 2)
    ):
        monkeypatch.setattr(torch.cuda, "is_available", lambda cuda=cuda: cuda)
        place = f"rollout.in_process={'null' if in_process is None else str(in_process).lower()}"
        overrides = [place, f"rollout.tensor_parallel_size={tp}", f"rollout.weight_transport={asked}"]
        try:
            check_platform(load_config(TINY_DEMO, overrides))
            refused = False
        except ConfigError as e:
            if not str(e).startswith("rollout.weight_transport"):
                continue  # another key's rule (tensor parallelism without CUDA or in process)
            refused = True
        try:
            _transport(asked, in_process=cuda is False if in_process is None else in_process, on_cpu=not cuda, tp=tp)
            engine_refuses = False
        except ValueError:
            engine_refuses = True
        assert refused == engine_refuses, (asked, in_process, cuda, tp)
