"""Stage functions on tiny inputs, without Prefect."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from coba_tasks.core.capability import CapabilityTracker
from coba_tasks.pipeline import stages

ALLOC = SimpleNamespace(
    strategy="coba", mode="paper", solver="heap", group_size=4, min_budget=2, max_budget=8, tau="adaptive"
)


def rewards_table(groups: dict[str, list[float]]) -> pd.DataFrame:
    rows = [(pid, j, r) for pid, rs in groups.items() for j, r in enumerate(rs)]
    df = pd.DataFrame(rows, columns=["prompt_id", "sample_idx", "reward"])
    df["verdict"] = np.where(df["reward"] == 1.0, "correct", "wrong")
    return df


def test_batches_cover_each_epoch_once():
    ids = [f"p{i}" for i in range(10)]
    seen = [p for step in range(5) for p in stages.batch_for_step(ids, step, 4, seed=3)]  # 20 = two epochs
    assert sorted(seen[:10]) == sorted(ids) and sorted(seen[10:]) == sorted(ids)
    # pinned: the batches of a seed are part of every recorded run (a change here changes which
    # prompts each step of a rerun trains on); step 2 straddles epochs 0 and 1
    assert stages.batch_for_step(ids, 0, 4, seed=3) == ["p9", "p6", "p0", "p2"]
    assert stages.batch_for_step(ids, 2, 4, seed=3) == ["p3", "p8", "p4", "p1"]
    assert stages.batch_for_step(ids, 0, 4, seed=3) != stages.batch_for_step(ids, 0, 4, seed=4)
    assert stages.batch_for_step(ids, 1, 4, seed=0, shuffle=False) == ["p4", "p5", "p6", "p7"]
    # a batch straddling two epochs never holds a prompt twice
    for step in range(40):
        batch = stages.batch_for_step(ids[:6], step, 4, seed=1)
        assert len(set(batch)) == 4
    assert stages.batch_for_step(ids, 2, 4, seed=0, shuffle=False) == ["p8", "p9", "p0", "p1"]
    with pytest.raises(ValueError, match="exceed the training pool"):
        stages.batch_for_step(ids, 0, 11, seed=0)


def test_pass_rates_and_capability():
    rewards = rewards_table({"a": [1, 1, 0, 0], "b": [0, 0], "c": [1, 1, 1]})
    rates = stages.pass_rates(rewards)
    assert rates.to_dict() == {"a": 0.5, "b": 0.0, "c": 1.0}
    table, tracker = stages.capability_table(0, rewards, CapabilityTracker())
    row = table.iloc[0]
    assert row["S"] == pytest.approx(0.5) and row["F"] == pytest.approx(0.5)  # mean over prompts
    assert (row["alpha_used"], row["beta_used"]) == (9.0, 2.0)
    assert row["alpha"] == pytest.approx(tracker.alpha) and row["rollouts"] == 9
    assert row["zero_variance_groups"] == pytest.approx(2 / 3)
    assert row["verdict_correct"] == 5 and row["verdict_wrong"] == 4 and row["verdict_timeout"] == 0
    assert stages.tracker_from_capability(table).to_dict() == tracker.to_dict()


def test_history_keeps_the_last_visits():
    h = stages.empty_history()
    h = stages.update_history(h, rewards_table({"a": [1, 0], "b": [0, 0]}), step=0, window=2)
    h = stages.update_history(h, rewards_table({"a": [1, 1]}), step=1, window=2)
    h = stages.update_history(h, rewards_table({"a": [0, 0]}), step=2, window=2)
    rec = h.set_index("prompt_id")
    assert rec.loc["a", "pass_rates"] == [1.0, 0.0] and rec.loc["a", "last_step"] == 2
    assert rec.loc["b", "pass_rates"] == [0.0] and rec.loc["b", "last_step"] == 0


def test_budget_table_uniform_first_then_from_history():
    first = stages.budget_table(["a", "b", "c"], stages.empty_history(), CapabilityTracker(), ALLOC)
    assert first["budget"].tolist() == [4, 4, 4] and "unseen" in first["fallback"].iloc[0]
    h = stages.update_history(stages.empty_history(), rewards_table({"a": [1, 1, 1, 0], "b": [0, 0, 0, 1]}), 0, 1)
    nxt = stages.budget_table(["a", "b", "c"], h, CapabilityTracker(), ALLOC)
    assert nxt["budget"].sum() == 12 and nxt["pass_rate_est"].tolist()[:2] == [0.75, 0.25]
    assert np.isnan(nxt["pass_rate_est"].iloc[2])
    assert nxt["budget"].iloc[0] > nxt["budget"].iloc[1]  # (9, 2) before any update: exploit the easy prompt


def test_history_pools_the_solved_flags_knapsack_rl_averages():
    first = rewards_table({"a": [1, 0, 1, 1, 0, 0, 1, 1], "b": [0, 0]}).iloc[::-1]  # rows in another order
    h = stages.update_history(stages.empty_history(), first, step=0, window=1)
    h = stages.update_history(h, rewards_table({"a": [0, 0, 0, 0]}), step=1, window=1)
    rec = h.set_index("prompt_id")
    assert list(rec.loc["a", "pooled_solved"]) == [1, 0, 1, 1, 0, 0, 1, 1, 0, 0, 0, 0]  # sample order, oldest first
    assert list(rec.loc["b", "pooled_solved"]) == [0, 0] and rec.loc["a", "pass_rates"] == [0.0]
    h = stages.update_history(h, rewards_table({"a": [1] * 16}), step=2, window=1)  # 16 or more: that visit alone
    assert list(h.set_index("prompt_id").loc["a", "pooled_solved"]) == [1] * 16
    # a history written before the column: the flags start empty
    old = stages.update_history(h.drop(columns="pooled_solved"), rewards_table({"b": [1, 1]}), step=3, window=1)
    assert list(old.set_index("prompt_id").loc["b", "pooled_solved"]) == [1, 1]


def test_budget_table_knapsack_uses_its_pooled_estimate():
    alloc = SimpleNamespace(**{**vars(ALLOC), "strategy": "knapsack", "group_size": 8, "max_budget": 32})
    h = stages.update_history(stages.empty_history(), rewards_table({"a": [1] * 8, "b": [0, 0]}), 0, 1)
    h = stages.update_history(h, rewards_table({"a": [0] * 4}), 1, 1)
    table = stages.budget_table(["a", "b", "c"], h, CapabilityTracker(), alloc)
    # a: 12 flags, estimate 8 / 12 (its last visit's pass rate is 0); b: 2 flags, c: none -> no estimate
    assert table["pass_rate_est"].iloc[0] == pytest.approx(2 / 3) and table["pass_rate_est"].iloc[1:].isna().all()
    # start 2, 8, 8 (G); a's cost int(log 0.1 / log(2/3)) = 5 < 6 spare: the surplus 1 goes to b (no estimate
    # counts with the prompts at 0), the knapsack gives a 5
    assert table["budget"].tolist() == [7, 9, 8]
    assert table["group"].tolist() == ["mixed", "no_estimate", "no_estimate"]
    # before the pooled flags existed: no prompt has an estimate, the budgets are uniform
    old = stages.budget_table(["a", "b", "c"], h.drop(columns="pooled_solved"), CapabilityTracker(), alloc)
    assert old["budget"].tolist() == [8, 8, 8] and old["pass_rate_est"].isna().all()


def test_budget_table_records_the_age_of_each_estimate():
    """estimate_age: the step the budget is for minus the prompt's last visit; NaN without an estimate."""
    h = stages.update_history(stages.empty_history(), rewards_table({"a": [1, 0], "b": [0, 1]}), 3, 1)
    h = stages.update_history(h, rewards_table({"b": [1, 1], "c": [0, 0]}), 5, 1)
    table = stages.budget_table(["a", "b", "c", "d"], h, CapabilityTracker(), ALLOC, step=6)
    ages = table["estimate_age"].tolist()
    assert ages[:3] == [3.0, 1.0, 1.0] and np.isnan(ages[3])  # a seen at 3, b and c at 5, d never
    inferred = stages.budget_table(["a", "b", "c", "d"], h, CapabilityTracker(), ALLOC)  # step: newest visit + 1
    assert inferred["estimate_age"].iloc[:3].tolist() == [3.0, 1.0, 1.0]
    assert stages.budget_table(["a"], stages.empty_history(), CapabilityTracker(), ALLOC)["estimate_age"].isna().all()
    # knapsack: a prompt seen but without an estimate (fewer than 8 pooled flags) has no age either
    knap = SimpleNamespace(**{**vars(ALLOC), "strategy": "knapsack"})
    assert stages.budget_table(["a", "b"], h, CapabilityTracker(), knap, step=6)["estimate_age"].isna().all()


def test_advantages_follow_rollout_order_and_groups():
    rewards = rewards_table({"a": [1, 0], "b": [1, 1, 1]})
    rollouts = rewards[["prompt_id", "sample_idx"]].iloc[::-1].reset_index(drop=True)  # another order
    adv = stages.advantages_for(rollouts, rewards)
    assert adv[:3].tolist() == [0.0, 0.0, 0.0]  # group b: all equal
    assert adv[3] < 0 < adv[4]  # a/1 failed, a/0 succeeded
    with pytest.raises(ValueError, match="single rollout"):
        stages.advantages_for(rewards.iloc[:1][["prompt_id", "sample_idx"]], rewards.iloc[:1])


def test_schedule_shape_adaptive_reversed_fixed():
    from coba_tasks.core.capability import CapabilityTracker
    from coba_tasks.pipeline.config_sections import AllocationConfig
    from coba_tasks.pipeline.stages import schedule_shape

    tracker = CapabilityTracker(kappa=11.0, window=1, gamma=10.0)
    tracker.update(np.array([0.9, 0.8, 1.0, 0.7]))  # S = 0.85, F = 0.15: explore, mode at a low pass rate
    a, b = schedule_shape(tracker, AllocationConfig())
    assert (a, b) == (tracker.alpha, tracker.beta) and a + b == pytest.approx(11.0)
    ra, rb = schedule_shape(tracker, AllocationConfig(schedule="reversed"))
    assert (ra, rb) == (b, a)
    # the reversed density peaks where the adaptive one's mirror image does
    assert (ra - 1) / (ra + rb - 2) == pytest.approx(1 - (a - 1) / (a + b - 2))
    assert schedule_shape(tracker, AllocationConfig(schedule="fixed", fixed_alpha=2, fixed_beta=3)) == (2.0, 3.0)
    with pytest.raises(ValueError, match=r"allocation\.schedule"):
        AllocationConfig(schedule="linear")
