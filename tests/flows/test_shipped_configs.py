"""Every shipped CPU config can learn: run on its model for two steps, some group holds both a right and a
wrong answer (a non-zero advantage). A config whose prompts, verifier and sampling leave every group
all-equal trains nothing, however long it runs.

Each config runs as the training flow runs it (its data, checks, prompt rendering, verifier and allocation),
through the stage functions: rollouts, rewards, failure-rate update and budget of step 0, then, when no
group of step 0 is mixed, the rollouts and rewards of step 1. The updates are left out (most of a step's
time, and nothing of what is checked here hangs on them: step 1 samples from the starting weights). The
SmolLM2 configs run on SmolLM2-135M-Instruct converted once per session; the tiny-model configs on the
default tiny model with a shortened warm-up (``WARM_UP_STEPS`` instead of 4,500 supervised steps: the same
architecture, tokenizer and data, weaker). Configs that differ only in what these stages never read
(``UPDATE_ONLY``: the optimizer, LoRA, the run's name, evaluation-only data) run the same steps row for
row, so they share one run.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from coba_tasks.pipeline.config import PROJECT_ROOT, load_config
from coba_tasks.pipeline.store import Table

pytestmark = pytest.mark.slow

CPU_CONFIGS = {  # shipped config -> the model it trains
    "demo.yaml": "smollm2",
    "smollm2-arith.yaml": "smollm2",
    "demo-tiny.yaml": "tiny",
    "tiny-test.yaml": "tiny",
}
GPU_CONFIGS = ("qwen2.5-0.5b-math.yaml", "qwen2.5-7b-math.yaml")  # a model from a hub and a GPU: not run here
WARM_UP_STEPS = 600
# keys that rollouts, rewards, the failure-rate update and the budget of steps 0-1 never read (no update runs)
UPDATE_ONLY = {"optim": None, "run": ("name", "keep_checkpoints"), "data": ("extra_tests",), "model": ("lora_rank",)}


def test_every_shipped_config_is_listed_here():
    shipped = {p.name for p in (PROJECT_ROOT / "configs").glob("*.yaml")}
    assert shipped == set(CPU_CONFIGS) | set(GPU_CONFIGS), "classify a new config in this file"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tiny model (``coba bootstrap``'s settings) after a shortened warm-up."""
    from coba_tasks.engines.bootstrap import BootstrapConfig, init_model, train_sft
    from coba_tasks.pipeline.data import load_dataset

    root = tmp_path_factory.mktemp("tiny")
    cfg = dataclasses.replace(BootstrapConfig(), steps=WARM_UP_STEPS, warmup_steps=50)
    init_model(root / "init", cfg)
    train_sft(
        root / "init", load_dataset(PROJECT_ROOT / "data/arith_train.parquet"), root / "model", cfg, log=lambda s: None
    )
    return root / "model"


def _first_steps_inputs(cfg) -> str:
    """The config less ``UPDATE_ONLY``: two configs with the same value run the same steps 0-1."""
    dumped = cfg.model_dump(mode="json")
    for section, keys in UPDATE_ONLY.items():
        if keys is None:
            dumped.pop(section)
        else:
            for k in keys:
                dumped[section].pop(k)
    return json.dumps(dumped, sort_keys=True)


def test_configs_sharing_a_run_differ_only_in_what_the_first_steps_never_read():
    demo, arith = (load_config(PROJECT_ROOT / "configs" / n) for n in ("demo.yaml", "smollm2-arith.yaml"))
    assert _first_steps_inputs(demo) == _first_steps_inputs(arith)
    assert demo.model.lora_rank != arith.model.lora_rank and demo.optim.lr != arith.optim.lr  # what differs
    tiny = load_config(PROJECT_ROOT / "configs" / "demo-tiny.yaml")
    assert _first_steps_inputs(tiny) != _first_steps_inputs(demo)  # the key tells other recipes apart


_FIRST_STEPS: dict[str, tuple[list[int], list[int]]] = {}  # inputs (with the model) -> mixed groups, groups


def _mixed_groups(rewards) -> int:
    """Groups (prompts) whose rewards are not all equal."""
    return int((rewards.groupby("prompt_id")["reward"].nunique() > 1).sum())


@pytest.mark.parametrize("name", sorted(CPU_CONFIGS))
def test_a_shipped_config_has_mixed_groups_in_its_first_steps(name, request, tmp_path, monkeypatch):
    from coba_tasks.pipeline import run
    from coba_tasks.pipeline import stages as stage_step

    model = request.getfixturevalue("smollm2_model" if CPU_CONFIGS[name] == "smollm2" else "tiny_model")
    monkeypatch.chdir(PROJECT_ROOT)  # the configs' data paths are from the project directory
    cfg = load_config(PROJECT_ROOT / "configs" / name, [f"model.path={model}", "run.steps=2"])
    inputs = _first_steps_inputs(cfg)
    if inputs in _FIRST_STEPS:  # another config with the same inputs ran these steps in this session
        mixed, groups = _FIRST_STEPS[inputs]
        assert sum(mixed) > 0, f"{name}: no group of steps 0-1 holds both a right and a wrong answer ({groups} groups)"
        return
    root = (tmp_path / "run").resolve()
    res = run.open_run(root, cfg, continuing=False, warn=lambda s: None)
    mixed, groups = [], []
    try:
        res.policy.start()
        for step in (0, 1):  # step 1 only when no group of step 0 is mixed: the assertion is over both
            stage_step.budget.fn(str(root), step)  # as plain calls, not Prefect tasks
            stage_step.rollouts.fn(str(root), step)
            stage_step.rewards.fn(str(root), step)
            if step == 0:  # the failure-rate update: what the budget of step 1 reads
                stage_step.capability.fn(str(root), 0)
            mixed.append(_mixed_groups(res.store.read_table(step, Table.REWARDS)))
            groups.append(len(res.store.read_table(step, Table.BUDGET)))
            if mixed[0] > 0:
                break
    finally:
        run.close_run(res)
    _FIRST_STEPS[inputs] = (mixed, groups)
    print(f"{name}: mixed groups {mixed} of {groups}")
    assert sum(mixed) > 0, f"{name}: no group of steps 0-1 holds both a right and a wrong answer ({groups} groups)"
