"""A run whose update cannot be finite stops at that step in one line, and keeps only finite checkpoints.

The stages run as plain functions (each stage task's body, ``Task.fn``: the code the Prefect flow runs) on the tiny
model with the first-character reward (tests/helpers_reward.py), so that the groups hold both rewards.
"""

from __future__ import annotations

import re
import textwrap

import pytest
import torch
from helpers_reward import data_overrides
from safetensors.torch import load_file

from coba_tasks.core.grpo import RewardScaleError
from coba_tasks.engines.update import NonFiniteUpdateError
from coba_tasks.pipeline.config import load_config
from coba_tasks.pipeline.store import RunStore, Table

HUGE_REWARD_FILE = textwrap.dedent(
    """\
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        head = solution_str[:1]
        return 1e200 if head.isascii() and (head.islower() or head.isdigit()) else 0.0
    """
)


def _open(tmp_path, model, overrides):
    from coba_tasks.pipeline import run

    cfg = load_config("configs/tiny-test.yaml", [f"model.path={model}", "rollout.backend=transformers", *overrides])
    root = (tmp_path / "run").resolve()
    res = run.open_run(root, cfg, continuing=False)
    res.policy.start()
    return res, root


def _stop_message(tmp_path, model, overrides, error: type[Exception], stopping_step: int) -> tuple[RunStore, str]:
    """Open a run, run its steps up to ``stopping_step``, which must raise ``error``, and close it; the run's
    store and the error's message, which is one line."""
    from coba_tasks.pipeline import run
    from coba_tasks.pipeline import stages as stage_step

    res, root = _open(tmp_path, model, overrides)
    try:
        for step in range(stopping_step):
            for stage_task, r in stage_step.step_tasks(res, step):  # one step, without Prefect
                stage_task.fn(str(root), step, r)
        with pytest.raises(error) as info:
            for stage_task, r in stage_step.step_tasks(res, stopping_step):  # one step, without Prefect
                stage_task.fn(str(root), stopping_step, r)
    finally:
        run.close_run(res)
    message = str(info.value)
    assert "\n" not in message
    return RunStore.open(root), message


def _finite_checkpoints(store: RunStore) -> list[int]:
    """The steps of the run's checkpoints, after checking that every tensor in them is finite."""
    steps = []
    for ckpt in sorted((store.root / "checkpoints").iterdir()):
        for f in ckpt.rglob("*.safetensors"):
            assert all(bool(torch.isfinite(t).all()) for t in load_file(str(f)).values() if t.is_floating_point()), f
        steps.append(int(ckpt.name))
    return steps


@pytest.mark.slow
def test_an_update_whose_gradient_overflows_stops_the_run_at_its_step(
    tmp_path, random_checkpoints, first_char_data, monkeypatch
):
    """optim.lr = 1e6, and the second update's gradient norm overflows: the run stops there naming the step and
    the setting, with the first checkpoint kept and no second one. The overflow is forced (the shard's gradient
    norm is inf from the second optimizer step on): what a real 1e6 does to the second update depends on the CPU's
    kernels (on one machine its gradient overflowed; on another the model saturated and its gradient was 0)."""
    from coba_tasks.engines.update import DataShard

    real, calls = DataShard.clip_grad_norm_, []

    def overflowing(self, params, max_norm):
        calls.append(1)
        norm = real(self, params, max_norm)
        return norm if len(calls) == 1 else torch.full_like(norm, float("inf"))

    monkeypatch.setattr(DataShard, "clip_grad_norm_", overflowing)
    overrides = [*data_overrides(first_char_data), "optim.lr=1e6"]
    store, message = _stop_message(tmp_path, random_checkpoints[0], overrides, NonFiniteUpdateError, 1)
    assert re.match(
        r"^step 1: the GRPO update's (loss|gradient norm) is (nan|inf|-inf) at optimizer step 1 of 1: ", message
    )
    assert "optim.lr (now 1e+06)" in message
    assert store.is_done(0, Table.UPDATE) and not store.is_done(1, Table.UPDATE)
    assert _finite_checkpoints(store) == [1]


@pytest.mark.slow
def test_a_reward_beyond_the_bound_stops_the_run_naming_the_step_the_prompt_and_the_value(
    tmp_path, random_checkpoints, monkeypatch
):
    from helpers_reward import TEST_PROMPTS, TRAIN_PROMPTS

    monkeypatch.setenv("COBA_ALLOW_REWARD_FILES", "1")  # the Python API, like a worker allowed to run reward files
    reward = tmp_path / "huge_reward.py"
    reward.write_text(HUGE_REWARD_FILE)
    import pandas as pd

    for name, prompts in (("train", TRAIN_PROMPTS), ("test", TEST_PROMPTS)):
        pd.DataFrame({"prompt": list(prompts), "answer": "0", "data_source": "my_task"}).to_parquet(
            tmp_path / f"{name}.parquet"
        )
    overrides = [
        f"data.train={tmp_path / 'train.parquet'}",
        f"data.test={tmp_path / 'test.parquet'}",
        f"verify.reward_function={reward}",
        "data.eval_prompts=2",
    ]
    store, message = _stop_message(tmp_path, random_checkpoints[0], overrides, RewardScaleError, 0)
    assert re.match(r"^step 0: prompt \S+ \(sample \d+\): reward 1e\+200 is beyond \+/- 1e\+30, ", message), message
    assert store.is_done(0, Table.REWARDS) and not store.is_done(0, Table.UPDATE)
    assert not (store.root / "checkpoints").exists() or _finite_checkpoints(store) == []
