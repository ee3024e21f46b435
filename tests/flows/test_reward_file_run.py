"""A short training run on the tiny model scored by a veRL-style reward file (``verify.reward_function``).

The run's stages are called as plain functions (each stage task's body, ``Task.fn``: the same stage
code the Prefect flow runs, without the Prefect server), two steps on four prompts. The reward file reads each
prompt's ``extra_info`` (a veRL dataset) to pick what it does with it: a fractional float, a dict with
extra keys, a raise, or a sleep past ``verify.timeout_s``, each on completions whose first character is
not a lowercase letter or a digit (about 60 % of the random tiny model's samples).
"""

from __future__ import annotations

import hashlib
import textwrap

import numpy as np
import pandas as pd
import pytest
from helpers_reward import TEST_PROMPTS

from coba_tasks.engines.rollout import RolloutRequest, SamplingConfig
from coba_tasks.pipeline import update_batch
from coba_tasks.pipeline.config import load_config
from coba_tasks.pipeline.data import write_verl_parquet
from coba_tasks.pipeline.store import RunStore, Table

REWARD_FILE = textwrap.dedent(
    """\
    import time


    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        head = solution_str[:1]
        good = head.isascii() and (head.islower() or head.isdigit())
        mode = extra_info["mode"]
        if mode == "float":
            return 1.0 if good else 0.25
        if mode == "dict":
            return {"score": 0.75 if good else 0.0, "acc": good, "first": head}
        if not good and mode == "raise":
            raise ValueError("no grade for " + repr(head))
        if not good and mode == "slow":
            time.sleep(30)
        return 1.0
    """
)
MODES = ("float", "dict", "raise", "slow")
RAISE_LINE = REWARD_FILE.splitlines().index('        raise ValueError("no grade for " + repr(head))') + 1


def _verl_file(path, prompts, modes):
    rows = pd.DataFrame(
        {
            "data_source": "my_task",  # no built-in verifier has this name: the reward file scores it
            "prompt": [[{"role": "user", "content": p}] for p in prompts],
            "ability": "test",
            "reward_model": [{"style": "rule", "ground_truth": "0"} for _ in prompts],
            "extra_info": [{"index": i, "mode": m} for i, m in enumerate(modes)],
        }
    )
    return write_verl_parquet(rows, path)


def _good(completion: str) -> bool:
    head = completion[:1]
    return head.isascii() and (head.islower() or head.isdigit())


@pytest.mark.slow
def test_a_training_run_scored_by_a_verl_reward_file(tmp_path, random_checkpoints):
    from coba_tasks.pipeline import evaluation, run
    from coba_tasks.pipeline import stages as stage_step

    model, _ = random_checkpoints
    reward = tmp_path / "verl_reward.py"
    reward.write_text(REWARD_FILE)
    train = _verl_file(tmp_path / "train.parquet", ["12+7=", "3*4=", "40-9=", "5+5="], MODES)
    test = _verl_file(tmp_path / "test.parquet", TEST_PROMPTS[:4], ["float"] * 4)
    overrides = [
        f"model.path={model}",
        f"data.train={train}",
        f"data.test={test}",
        f"verify.reward_function={reward}",  # compute_score, veRL's default name
        "verify.pass_threshold=0.5",
        "verify.timeout_s=1.0",
        "data.eval_prompts=4",
        "rollout.backend=transformers",  # the subject is the reward file, not the engine
    ]
    cfg = load_config("configs/tiny-test.yaml", overrides)
    root = (tmp_path / "run").resolve()
    res = run.open_run(root, cfg, continuing=False)
    try:
        assert res.policy.start() == 0
        assert res.pool.reward_function is not None and res.pool.reward_function.pass_threshold == 0.5
        for step in range(2):
            for stage_task, r in stage_step.step_tasks(res, step):  # one step, without Prefect
                stage_task.fn(str(root), step, r)
        held_out = evaluation.evaluate(res.test, res.engine, res.pool, 1, 0.0, cfg.rollout.max_tokens, cfg.run.seed)
        greedy = res.engine.generate(  # the same greedy completions, to score by hand
            [RolloutRequest(r.prompt_id, tuple(r.prompt_token_ids), 1, 0) for r in res.test.itertuples()],
            SamplingConfig(temperature=0.0, max_tokens=cfg.rollout.max_tokens),
        )
    finally:
        run.close_run(res)

    store = RunStore.open(root)
    mode = dict(zip(res.prompts["prompt_id"], MODES, strict=True))
    seen: set[str] = set()
    for step in range(2):
        rollouts = store.read_table(step, Table.ROLLOUTS)
        rewards = store.read_table(step, Table.REWARDS)
        assert {"detail", "acc", "first"} <= set(rewards.columns)
        good = rollouts["completion"].map(_good).to_numpy()
        for m, g, row in zip(rewards["prompt_id"].map(mode), good, rewards.itertuples(), strict=True):
            want = {
                "float": (1.0 if g else 0.25, "correct" if g else "wrong"),
                "dict": (0.75 if g else 0.0, "correct" if g else "wrong"),
                "raise": (1.0, "correct") if g else (0.0, "error"),
                "slow": (1.0, "correct") if g else (0.0, "timeout"),
            }[m]
            assert (row.reward, row.verdict) == want, (step, m, row)
            seen.add(row.verdict)
            if m == "raise" and not g:
                assert row.detail.startswith("verl_reward.py:compute_score: ValueError: no grade for ")
                assert row.detail.endswith(f"(verl_reward.py line {RAISE_LINE})")
            if m == "dict":
                assert row.acc == g and row.first == rollouts["completion"][row.Index][:1]
            else:
                assert pd.isna(row.acc) and pd.isna(row.first)
        # the pass rates CoBA-RL allocates with: the share of scores >= 0.5 (verdict correct), per prompt
        rates = (rewards["verdict"] == "correct").groupby(rewards["prompt_id"]).mean()
        history = store.read_table(step, Table.HISTORY).set_index("prompt_id")["pass_rates"]
        assert all(history[pid][-1] == pytest.approx(rate) for pid, rate in rates.items())
        assert store.read_table(step, Table.CAPABILITY)["S"].iloc[0] == pytest.approx(rates.mean())
        assert float(store.read_table(step, Table.UPDATE)["grad_norm"].iloc[0]) > 0  # raw-score advantages
    assert {"correct", "wrong", "error", "timeout"} <= seen  # the run went on past raises and timeouts

    # `coba bench update --run-dir` times what the update of a step trained on: its rows and raw-score advantages
    from coba_tasks.bench.update_bench import run_batch

    prompt_ids, completion_ids, adv = run_batch(str(root), 1)
    rollouts, rewards = store.read_table(1, Table.ROLLOUTS), store.read_table(1, Table.REWARDS)
    assert len(prompt_ids) == len(completion_ids) == len(adv) == len(rollouts)
    assert completion_ids == [list(t) for t in rollouts["token_ids"]]
    np.testing.assert_array_equal(adv, update_batch.advantages_for(rollouts, rewards))
    assert np.any(adv != 0) and np.all(np.isfinite(adv))
    # held-out accuracy: the share of completions at or above the threshold (0.5): 1.0 (good) or 0.25 (not)
    assert held_out["accuracy"].tolist() == [1.0 if _good(r.completion) else 0.0 for r in greedy]
    assert held_out["errors"].tolist() == [0] * 4 and held_out["timeouts"].tolist() == [0] * 4


BROKEN_FILE = 'def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return {}["answer"]\n'
FIXED_FILE = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n"


def _one_step_config(tmp_path, model, reward):
    """configs/tiny-test.yaml cut to one step and 2 held-out prompts, scored by the reward file ``reward``."""
    train = _verl_file(tmp_path / "train.parquet", ["12+7=", "3*4=", "40-9=", "5+5="], ["float"] * 4)
    test = _verl_file(tmp_path / "test.parquet", TEST_PROMPTS[:2], ["float"] * 2)
    overrides = [f"model.path={model}", f"data.train={train}", f"data.test={test}", f"verify.reward_function={reward}"]
    overrides += ["run.steps=1", "data.eval_prompts=2", "rollout.backend=transformers"]  # not the engine's test
    return load_config("configs/tiny-test.yaml", overrides)


@pytest.mark.slow
def test_a_reward_file_that_fails_on_every_call_stops_the_run_and_a_resume_after_the_fix_recomputes_it(
    tmp_path, prefect_harness, random_checkpoints, monkeypatch
):
    """verify.max_error_share (0.5 by default): the held-out evaluation before training, the first thing the
    reward file scores, raises before its table is written (it reported accuracy 0 before), with one line naming
    the evaluation and its set, the share, the first error's detail and the key; fixed, the run resumes. (The
    rewards stage's stop is the same check: tests/pipeline/test_error_share.py.)"""
    from coba_tasks.pipeline.config import config_to_dict
    from flows.train import train_flow

    monkeypatch.setenv("COBA_ALLOW_REWARD_FILES", "1")  # the Python API, like a worker allowed to run reward files
    model, _ = random_checkpoints
    reward = tmp_path / "broken_reward.py"
    reward.write_text(BROKEN_FILE)
    cfg = _one_step_config(tmp_path, model, reward)
    run_dir = tmp_path / "run"
    state = train_flow(run_dir=str(run_dir), config=config_to_dict(cfg), return_state=True)
    assert state.is_failed(), "a step whose every verdict is error completed"
    from coba_tasks.pipeline.stages import ScoringError

    with pytest.raises(ScoringError) as info:
        state.result()
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(
        "held-out evaluation at step 0 (test): 2 of 2 completions scored error or timeout (100%), above "
        "verify.max_error_share"
    )
    assert "the first error: broken_reward.py:compute_score: KeyError: 'answer' (broken_reward.py line 2)" in message
    store = RunStore.open(run_dir)
    assert not store.is_done(0, Table.EVAL) and not store.is_done(0, Table.ROLLOUTS)  # nothing recorded, nothing ran

    reward.write_text(FIXED_FILE)  # the fix; the run started with the broken file, so the resume says so
    summary = train_flow(run_dir=str(run_dir), resume=True, allow_changed_inputs=True)
    rewards = RunStore.open(run_dir).read_table(0, Table.REWARDS)
    assert len(rewards) == 16 and (rewards["verdict"] == "correct").all() and summary["steps"] == 1
    held_out = RunStore.open(run_dir).read_table(0, Table.EVAL)
    assert held_out["accuracy"].tolist() == [1.0, 1.0] and held_out["errors"].tolist() == [0, 0]


def test_the_reward_file_is_a_hashed_input_and_a_continuing_run_refuses_an_edited_one(tmp_path, random_checkpoints):
    """run.json records the reward file's sha256 with the other inputs; a resume (or rerun) after editing it is
    refused in one line naming verify.reward_function, unless allow_changed_inputs (then a warning)."""
    from coba_tasks.pipeline import run
    from coba_tasks.pipeline.store import StoreError

    model, _ = random_checkpoints
    reward = tmp_path / "my_reward.py"
    reward.write_text(FIXED_FILE)
    cfg = _one_step_config(tmp_path, model, reward)
    root = (tmp_path / "run").resolve()
    run.close_run(run.open_run(root, cfg, continuing=False))
    store = RunStore.open(root)
    recorded = store.run_info["inputs"]["verify.reward_function"]
    assert recorded["path"] == str(reward.resolve())
    assert recorded["sha256"] == hashlib.sha256(FIXED_FILE.encode()).hexdigest()
    warnings: list[str] = []
    run.check_inputs(store, cfg, False, warnings.append)  # unchanged: nothing said
    assert warnings == []

    reward.write_text(FIXED_FILE.replace("1.0", "0.5"))
    with pytest.raises(StoreError) as info:
        run.open_run(root, cfg, continuing=True)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"verify.reward_function ({reward.resolve()}) is not what")
    assert "--allow-changed-inputs" in message
    run.check_inputs(store, cfg, True, warnings.append)
    assert len(warnings) == 1 and warnings[0].startswith("verify.reward_function (")
    assert "continuing as asked" in warnings[0]
