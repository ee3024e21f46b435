"""Stage functions on tiny inputs, without Prefect."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from coba_tasks.core.capability import CapabilityTracker
from coba_tasks.pipeline import prompt_history, stages, update_batch
from coba_tasks.pipeline.config import Config
from coba_tasks.pipeline.config_sections import AllocationConfig

# the allocation section of a real config (model_copy: the keys below as given, as a test of a function may)
ALLOC = Config().allocation.model_copy(
    update=dict(strategy="coba", mode="paper", solver="heap", group_size=4, min_budget=2, max_budget=8, tau="adaptive")
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
    rates = prompt_history.pass_rates(rewards)
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
    h = prompt_history.empty_history()
    h = prompt_history.update_history(h, rewards_table({"a": [1, 0], "b": [0, 0]}), step=0, window=2)
    h = prompt_history.update_history(h, rewards_table({"a": [1, 1]}), step=1, window=2)
    h = prompt_history.update_history(h, rewards_table({"a": [0, 0]}), step=2, window=2)
    rec = h.set_index("prompt_id")
    assert rec.loc["a", "pass_rates"] == [1.0, 0.0] and rec.loc["a", "last_step"] == 2
    assert rec.loc["b", "pass_rates"] == [0.0] and rec.loc["b", "last_step"] == 0


def test_budget_table_uniform_first_then_from_history():
    first = stages.budget_table(["a", "b", "c"], prompt_history.empty_history(), CapabilityTracker(), ALLOC)
    assert first["budget"].tolist() == [4, 4, 4] and "unseen" in first["fallback"].iloc[0]
    h = prompt_history.update_history(
        prompt_history.empty_history(), rewards_table({"a": [1, 1, 1, 0], "b": [0, 0, 0, 1]}), 0, 1
    )
    nxt = stages.budget_table(["a", "b", "c"], h, CapabilityTracker(), ALLOC)
    assert nxt["budget"].sum() == 12 and nxt["pass_rate_est"].tolist()[:2] == [0.75, 0.25]
    assert np.isnan(nxt["pass_rate_est"].iloc[2])
    assert nxt["budget"].iloc[0] > nxt["budget"].iloc[1]  # (9, 2) before any update: exploit the easy prompt


def test_history_pools_the_solved_flags_knapsack_rl_averages():
    first = rewards_table({"a": [1, 0, 1, 1, 0, 0, 1, 1], "b": [0, 0]}).iloc[::-1]  # rows in another order
    h = prompt_history.update_history(prompt_history.empty_history(), first, step=0, window=1)
    h = prompt_history.update_history(h, rewards_table({"a": [0, 0, 0, 0]}), step=1, window=1)
    rec = h.set_index("prompt_id")
    assert list(rec.loc["a", "pooled_solved"]) == [1, 0, 1, 1, 0, 0, 1, 1, 0, 0, 0, 0]  # sample order, oldest first
    assert list(rec.loc["b", "pooled_solved"]) == [0, 0] and rec.loc["a", "pass_rates"] == [0.0]
    h = prompt_history.update_history(
        h, rewards_table({"a": [1] * 16}), step=2, window=1
    )  # 16 or more: that visit alone
    assert list(h.set_index("prompt_id").loc["a", "pooled_solved"]) == [1] * 16


def test_budget_table_knapsack_uses_its_pooled_estimate():
    alloc = ALLOC.model_copy(update={"strategy": "knapsack", "group_size": 8, "max_budget": 32})
    h = prompt_history.update_history(prompt_history.empty_history(), rewards_table({"a": [1] * 8, "b": [0, 0]}), 0, 1)
    h = prompt_history.update_history(h, rewards_table({"a": [0] * 4}), 1, 1)
    table = stages.budget_table(["a", "b", "c"], h, CapabilityTracker(), alloc)
    # a: 12 flags, estimate 8 / 12 (its last visit's pass rate is 0); b: 2 flags, c: none -> no estimate
    assert table["pass_rate_est"].iloc[0] == pytest.approx(2 / 3) and table["pass_rate_est"].iloc[1:].isna().all()
    # start 2, 8, 8 (G); a's cost int(log 0.1 / log(2/3)) = 5 < 6 spare: the surplus 1 goes to b (no estimate
    # counts with the prompts at 0), the knapsack gives a 5
    assert table["budget"].tolist() == [7, 9, 8]
    assert table["group"].tolist() == ["mixed", "no_estimate", "no_estimate"]


def test_budget_table_records_the_age_of_each_estimate():
    """estimate_age: the step the budget is for minus the prompt's last visit; NaN without an estimate."""
    h = prompt_history.update_history(prompt_history.empty_history(), rewards_table({"a": [1, 0], "b": [0, 1]}), 3, 1)
    h = prompt_history.update_history(h, rewards_table({"b": [1, 1], "c": [0, 0]}), 5, 1)
    table = stages.budget_table(["a", "b", "c", "d"], h, CapabilityTracker(), ALLOC, step=6)
    ages = table["estimate_age"].tolist()
    assert ages[:3] == [3.0, 1.0, 1.0] and np.isnan(ages[3])  # a seen at 3, b and c at 5, d never
    inferred = stages.budget_table(["a", "b", "c", "d"], h, CapabilityTracker(), ALLOC)  # step: newest visit + 1
    assert inferred["estimate_age"].iloc[:3].tolist() == [3.0, 1.0, 1.0]
    assert (
        stages.budget_table(["a"], prompt_history.empty_history(), CapabilityTracker(), ALLOC)["estimate_age"]
        .isna()
        .all()
    )
    # knapsack: a prompt seen but without an estimate (fewer than 8 pooled flags) has no age either
    knap = ALLOC.model_copy(update={"strategy": "knapsack"})
    assert stages.budget_table(["a", "b"], h, CapabilityTracker(), knap, step=6)["estimate_age"].isna().all()


def test_advantages_follow_rollout_order_and_groups():
    rewards = rewards_table({"a": [1, 0], "b": [1, 1, 1]})
    rollouts = rewards[["prompt_id", "sample_idx"]].iloc[::-1].reset_index(drop=True)  # another order
    adv = update_batch.advantages_for(rollouts, rewards)
    assert adv[:3].tolist() == [0.0, 0.0, 0.0]  # group b: all equal
    assert adv[3] < 0 < adv[4]  # a/1 failed, a/0 succeeded
    with pytest.raises(ValueError, match="single rollout"):
        update_batch.advantages_for(rewards.iloc[:1][["prompt_id", "sample_idx"]], rewards.iloc[:1])


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


# ---------------------------------------------------------------------------------------------
# Estimators (allocation.estimator): last, posterior, pilot


VISITS = [  # three steps' rewards: a prompt visited once, twice, thrice; g and h never
    {"a": [1, 0, 0, 0], "b": [1, 1, 1, 0], "c": [0, 0], "d": [1, 1, 1, 1, 1, 1]},
    {"a": [1, 1], "e": [0, 1, 0, 0, 0, 0, 0, 1], "f": [0] * 8},
    {"a": [1, 0, 1, 0, 1, 1, 1, 1, 1, 0], "b": [0, 0, 0, 0], "f": [1, 0]},
]
BATCH = ["a", "b", "c", "d", "e", "f", "g", "h"]


def _after_visits(window: int = 1) -> tuple[pd.DataFrame, CapabilityTracker]:
    h, tracker = prompt_history.empty_history(), CapabilityTracker()
    for t, groups in enumerate(VISITS):
        r = rewards_table(groups)
        h = prompt_history.update_history(h, r, t, window)
        tracker.update(prompt_history.pass_rates(r).to_numpy())
    return h, tracker


def _alloc(**keys) -> AllocationConfig:
    return ALLOC.model_copy(update={"group_size": 6, "max_budget": 16, **keys})


def test_the_last_estimator_allocates_as_before_and_says_what_its_estimates_rest_on():
    """estimator=last (the default) gives the budgets the allocation gave before estimators were a choice
    (pinned: computed with the code before), whatever the strategy; the table says which estimator and how
    many rollouts each estimate rests on (those of the visits averaged; none for a prompt never visited)."""
    pinned = {
        (1, ()): [6, 2, 2, 2, 2, 12, 11, 11],
        (1, (("mode", "released"),)): [6, 6, 5, 2, 2, 9, 9, 9],
        (1, (("strategy", "uniform"),)): [6] * 8,
        (1, (("strategy", "knapsack"),)): [5, 6, 6, 6, 7, 6, 6, 6],
        (2, ()): [2, 6, 2, 2, 2, 2, 16, 16],
        (2, (("mode", "released"),)): [2, 2, 9, 2, 2, 2, 15, 14],
    }
    for (window, keys), budgets in pinned.items():
        h, tracker = _after_visits(window)
        before = stages.budget_table(BATCH, h, tracker, _alloc(**dict(keys)))  # no estimator key: as before
        table = stages.budget_table(BATCH, h, tracker, _alloc(estimator="last", **dict(keys)))
        pd.testing.assert_frame_equal(table, before, check_exact=True)
        assert table["budget"].tolist() == budgets, (window, keys)
        assert (table["estimator"] == "last").all() and (table["pilot_rollouts"] == 0).all()
    h, tracker = _after_visits(window=2)
    table = stages.budget_table(BATCH, h, tracker, _alloc(estimator="last"))
    assert table["pass_rate_est"].tolist()[:2] == [0.85, 0.375]  # a: (1 + 0.7) / 2, b: (0.75 + 0) / 2
    assert table["estimate_rollouts"].tolist() == [12.0, 8.0, 2.0, 6.0, 8.0, 10.0, 0.0, 0.0]  # a: 2 + 10
    knapsack = stages.budget_table(BATCH, h, tracker, _alloc(strategy="knapsack"))
    # Knapsack-RL's own estimate rests on its pooled flags (none: no estimate)
    assert knapsack["estimate_rollouts"].tolist() == [16.0, 8.0, 0.0, 0.0, 8.0, 10.0, 0.0, 0.0]


def test_history_carries_the_posterior_counts_from_visit_to_visit():
    """Each visit decays a prompt's counts by d and adds its successes and failures; a prompt's first visit
    starts from the prior s * (pbar, 1 - pbar), pbar the pass rate of the rollouts scored before it."""
    h = prompt_history.update_history(
        prompt_history.empty_history(), rewards_table({"a": [1, 0, 0, 0], "b": [0, 0]}), 0, 2
    )
    rec = h.set_index("prompt_id")
    # nothing scored before step 0: pbar = 0.5, prior (1, 1), decayed to (0.5, 0.5), then the visit
    assert (rec.loc["a", "posterior_a"], rec.loc["a", "posterior_b"]) == (1.5, 3.5)
    assert (rec.loc["b", "posterior_a"], rec.loc["b", "posterior_b"]) == (0.5, 2.5)
    assert (rec.loc["a", "rollouts_scored"], rec.loc["a", "rollouts_solved"]) == (4, 1)
    h = prompt_history.update_history(h, rewards_table({"a": [1, 1], "c": [0, 0, 0, 1]}), 1, 2)
    rec = h.set_index("prompt_id")
    assert (rec.loc["a", "posterior_a"], rec.loc["a", "posterior_b"]) == (2.75, 1.75)  # 0.5 * (1.5, 3.5) + (2, 0)
    # c's prior from pbar = 1 / 6 (one of the 6 rollouts of step 0 solved): (1/3, 5/3), decayed, then (1, 3)
    assert rec.loc["c", "posterior_a"] == pytest.approx(1 / 6 + 1) and rec.loc["c", "posterior_b"] == pytest.approx(
        5 / 6 + 3
    )
    assert list(rec.loc["a", "visit_rollouts"]) == [4, 2] and list(rec.loc["b", "visit_rollouts"]) == [2]
    assert h["rollouts_scored"].sum() == 12 and h["rollouts_solved"].sum() == 4
    assert h["rollouts_scored"].dtype == np.int64 and h["posterior_a"].dtype == np.float64
    # the prior strength and decay are the run's
    other = prompt_history.update_history(
        prompt_history.empty_history(), rewards_table({"a": [1, 0]}), 0, 1, prior_strength=4, decay=1
    )
    assert (other["posterior_a"].iloc[0], other["posterior_b"].iloc[0]) == (3.0, 3.0)


def test_budget_table_posterior_allocates_on_the_posterior_mean():
    """estimator=posterior: each prompt's estimate is its posterior mean, resting on a + b; a prompt never
    visited gets the prior (pbar, s); before any rollout is scored every estimate is NaN (uniform)."""
    from coba_tasks.core.capability import counts_before, global_pass_rate, posterior_mean

    h, tracker = _after_visits()
    alloc = _alloc(estimator="posterior", prior_strength=2.0, posterior_decay=0.5)
    table = stages.budget_table(BATCH, h, tracker, alloc)
    rec = h.set_index("prompt_id").reindex(BATCH)
    pbar = global_pass_rate(h["rollouts_solved"].sum(), h["rollouts_scored"].sum())
    a, b = counts_before(rec["posterior_a"], rec["posterior_b"], pbar, 2.0)
    np.testing.assert_array_equal(table["pass_rate_est"], posterior_mean(a, b))
    np.testing.assert_array_equal(table["estimate_rollouts"], a + b)
    assert table["pass_rate_est"].iloc[6] == pytest.approx(pbar) and table["estimate_rollouts"].iloc[6] == 2.0
    assert 0 < table["pass_rate_est"].iloc[2] < 0.5  # c: 0/2 at its only visit, not estimated at 0
    assert int(table["budget"].sum()) == 8 * 6 and table["budget"].between(2, 16).all()
    assert (table["estimator"] == "posterior").all() and table["fallback"].eq("").all()
    last = stages.budget_table(BATCH, h, tracker, _alloc())
    assert table["budget"].tolist() != last["budget"].tolist()
    first = stages.budget_table(BATCH, prompt_history.empty_history(), CapabilityTracker(), alloc)
    assert first["budget"].tolist() == [6] * 8 and first["pass_rate_est"].isna().all()
    assert "unseen" in first["fallback"].iloc[0] and (first["estimate_rollouts"] == 0).all()


def test_budget_table_pilot_allocates_the_rest_on_the_posterior_after_the_pilot():
    """estimator=pilot: the estimate is the posterior after the pilot's k rollouts per prompt joined the visit;
    every budget counts the pilot's k (>= B_low >= k) and they sum to B_total; the table records k."""
    from coba_tasks.core.capability import counts_before, global_pass_rate, posterior_mean, visit

    h, tracker = _after_visits()
    alloc = _alloc(estimator="pilot", prior_strength=2.0, posterior_decay=0.5, pilot_rollouts=2)
    outcomes = [[1, 1], [0, 0], [1, 0], [1, 1], [0, 0], [0, 1], [1, 1], [0, 0]]
    pilot = rewards_table(dict(zip(BATCH, outcomes, strict=True))).iloc[::-1]  # rows in any order
    table = stages.budget_table(BATCH, h, tracker, alloc, pilot)
    rec = h.set_index("prompt_id").reindex(BATCH)
    pbar = global_pass_rate(h["rollouts_solved"].sum(), h["rollouts_scored"].sum())  # before the pilot
    a, b = counts_before(rec["posterior_a"], rec["posterior_b"], pbar, 2.0)
    won = np.array([sum(o) for o in outcomes])
    a, b = visit(a, b, won, 2 - won, 0.5)
    np.testing.assert_array_equal(table["pass_rate_est"], posterior_mean(a, b))
    np.testing.assert_array_equal(table["estimate_rollouts"], a + b)
    assert int(table["budget"].sum()) == 8 * 6 and table["budget"].between(2, 16).all()
    assert (table["pilot_rollouts"] == 2).all() and (table["estimator"] == "pilot").all()
    assert (table["estimate_age"] == 0).all()  # the estimate's newest rollouts are this step's pilot
    # at step 0 the pilot is all there is: estimates from it, not the uniform fallback
    first = stages.budget_table(BATCH, prompt_history.empty_history(), CapabilityTracker(), alloc, pilot)
    assert first["pass_rate_est"].notna().all() and first["fallback"].eq("").all()
    assert (first["estimate_age"] == 0).all()
    assert first["pass_rate_est"].iloc[0] == pytest.approx(2.5 / 3) and first["estimate_rollouts"].iloc[0] == 3.0
    with pytest.raises(ValueError, match="needs the pilot's rewards"):
        stages.budget_table(BATCH, h, tracker, alloc)
    with pytest.raises(ValueError, match="no rollouts of prompt h"):
        stages.budget_table(BATCH, h, tracker, alloc, pilot[pilot["prompt_id"] != "h"])
    # a pilot larger than B_low (the config refuses it): a ValueError, not an assert that python -O drops
    big = _alloc(estimator="pilot", prior_strength=2.0, posterior_decay=0.5, pilot_rollouts=3)
    with pytest.raises(ValueError, match=r"below the pilot's 3 rollouts; allocation\.pilot_rollouts must be <="):
        stages.budget_table(BATCH, h, tracker, big, pilot)


class _Engine:
    """Each request's n rows, the completion naming its seed and index."""

    def __init__(self):
        self.requests = []

    def generate_many(self, batches, progress=False):
        from coba_tasks.engines.rollout import Rollout

        out = []
        for requests, _ in batches:
            self.requests += requests
            out.append(
                [
                    Rollout(r.prompt_id, j, f"{r.seed}/{j}", (j,), 1, "stop", r.seed, 3, (-0.5,))
                    for r in requests
                    for j in range(r.n)
                ]
            )
        return out


class _Pool:
    """Scores a completion right when its index in the wave is even; counts what it scored."""

    def __init__(self):
        self.scored = 0

    def score(self, items):
        from coba_tasks.engines.verify import Verdict, VerdictKind

        self.scored += len(items)
        even = [int(c.split("/")[1]) % 2 == 0 for c, *_ in items]
        return [Verdict(float(e), VerdictKind.CORRECT if e else VerdictKind.WRONG, "x", "") for e in even]


def test_the_pilots_second_round_joins_its_groups_with_seeds_of_its_own():
    """A pilot step's rounds: round 0 is k of each prompt of the batch, round 1 each budget less k (a prompt whose
    budget is its pilot gets none), numbered on from k and sampled with the second round's seed; the step's
    rollouts hold each group together in budget order, its pilot first."""
    from coba_tasks.engines.rollout import SamplingConfig, rollout_seed

    prompts = pd.DataFrame(
        {
            "prompt_id": ["p", "q"],
            "prompt_token_ids": [[1, 2], [3]],
            "prompt_rendered": ["1+1=", "2+2="],
            "ground_truth": ["2", "4"],
            "data_source": ["arith", "arith"],
        }
    )
    engine, sampling = _Engine(), SamplingConfig()
    first = stages.rollout_table(stages.pilot_budget(["q", "p"], 2), prompts, engine, sampling, 7, 4)
    assert first["seed"].tolist() == [rollout_seed(7, 4, "q")] * 2 + [rollout_seed(7, 4, "p")] * 2
    budget = pd.DataFrame({"prompt_id": ["q", "p"], "budget": [5, 2]})
    rest = stages.second_round_budget(budget, 2)
    assert rest["prompt_id"].tolist() == ["q"] and rest["budget"].tolist() == [3]  # p's budget is its pilot
    second = stages.rollout_table(rest, prompts, engine, sampling, 7, 4, wave=1)
    second["sample_idx"] += 2
    rows = pd.concat([first.assign(round=0), second.assign(round=1)], ignore_index=True)
    both = stages.in_budget_order(rows, budget)
    assert both["prompt_id"].tolist() == ["q"] * 5 + ["p"] * 2
    assert both["sample_idx"].tolist() == [0, 1, 2, 3, 4, 0, 1] and both["round"].tolist() == [0, 0, 1, 1, 1, 0, 0]
    pilot_seed, later = rollout_seed(7, 4, "q"), rollout_seed(7, 4, "q", wave=1)
    assert later != pilot_seed and both["seed"].tolist()[:5] == [pilot_seed] * 2 + [later] * 3
    assert both["completion"].tolist()[2:5] == [f"{later}/0", f"{later}/1", f"{later}/2"]
    with pytest.raises(ValueError, match="below its prompt's pilot"):
        stages.second_round_budget(budget, 3)
    with pytest.raises(ValueError, match="not the budget's"):
        stages.in_budget_order(rows, budget[budget["prompt_id"] == "q"])


def test_a_reward_files_extra_keys_never_overwrite_each_other():
    """``reward`` (a rewards-table column) was renamed to ``extra_reward`` and overwrote a real ``extra_reward``."""
    from coba_tasks.pipeline.stages import extra_columns

    cols = extra_columns([{"reward": 0.5, "extra_reward": 2.0, "verdict": "x"}, {"reward": 1.0, "extra_reward": 3.0}])
    assert cols["extra_extra_reward"].tolist() == [0.5, 1.0] and cols["extra_reward"].tolist() == [2.0, 3.0]
    assert cols["extra_verdict"].tolist() == ["x", None] and len(cols) == 3


def _store_with_update(tmp_path, columns: dict, checkpoints=(1, 3)):
    from coba_tasks.pipeline.store import RunStore, Table

    store = RunStore(tmp_path / "run")
    store.create({"run": {}}, "abc", {})
    store.write_table(0, Table.UPDATE, pd.DataFrame([columns]))
    for k in checkpoints:
        store.checkpoint_dir(k).mkdir(parents=True)
        (store.checkpoint_dir(k) / "checkpoint.json").write_text("{}")
    (store.root / "checkpoints" / "7").mkdir()  # not a checkpoint: never named
    return store


def test_a_replay_of_an_update_without_a_weights_digest_is_refused_naming_what_the_rerun_deletes(tmp_path):
    """An update table written before the weights digest: its replay could not prove the weights, so it is refused
    before any training, in one line; the rerun it advises names the checkpoints it would delete."""
    store = _store_with_update(tmp_path, {"step": 0, "loss": 0.5, "grad_norm": 1.0})
    from coba_tasks.pipeline.policy import InProcessPolicy, ReplayError

    with pytest.raises(ReplayError) as info:
        InProcessPolicy(SimpleNamespace(store=store)).replay(0, "the base model")
    message = str(info.value)
    assert info.value.step == 0 and "\n" not in message
    assert message.startswith(
        "step 0: update.parquet records no digest of the weights after the update (written by an earlier build), "
        "so a replay from the base model could not prove it rebuilds them; continue the run on the machine that "
        "trained it, or train again from step 0 with "
    )
    assert message.endswith(
        f"`coba rerun --run-dir {store.root} --step 0 --stage update --yes` (it deletes the tables from its update "
        "stage of step 0 on and checkpoints/000001, checkpoints/000003)"
    )


def test_every_rerun_a_message_advises_names_what_it_deletes(tmp_path):
    from coba_tasks.pipeline.policy import checked_checkpoint
    from coba_tasks.pipeline.progress import rerun_line
    from coba_tasks.pipeline.store import StoreError

    store = _store_with_update(tmp_path, {"step": 0}, checkpoints=(2, 4, 6))
    root = store.root
    assert rerun_line(store, 3, "rollouts") == (
        f"`coba rerun --run-dir {root} --step 3 --stage rollouts --yes` (it deletes the tables from its rollouts "
        "stage of step 3 on and checkpoints/000004, checkpoints/000006)"
    )
    assert rerun_line(store, 6, "update").endswith("(it deletes the tables from its update stage of step 6 on)")
    assert rerun_line(store, 2, "eval").endswith("(it deletes steps/000002/eval.parquet)")
    with pytest.raises(StoreError) as info:  # a damaged checkpoint: the rerun that writes it again, and the rest
        checked_checkpoint(store, 4)
    assert str(info.value).endswith(
        f"recompute it with `coba rerun --run-dir {root} --step 3 --stage update --yes` (it deletes the tables from "
        "its update stage of step 3 on and checkpoints/000004, checkpoints/000006)"
    )


def test_a_runs_engine_used_before_it_starts_says_so():
    """RunResources' engine and verifier pool have their own types; before ``RunResources.start`` a use of either
    is one error that names it, not an AttributeError on None."""
    from coba_tasks.pipeline.policy import InProcessPolicy, TorchrunPolicy
    from coba_tasks.pipeline.run import RunResources

    res = RunResources(cfg=Config(), store=None, prompts=pd.DataFrame(), test=pd.DataFrame())
    with pytest.raises(RuntimeError, match=r"the run's rollout engine is not started \(weight_version asked for\)"):
        _ = res.engine.weight_version
    with pytest.raises(RuntimeError, match="the run's verifier pool is not started"):
        res.pool.score([])
    assert type(res.policy) is InProcessPolicy
    with pytest.raises(RuntimeError, match="the run's trainer is not started"):
        _ = res.policy.trainer
    fsdp = Config().model_copy(update={"optim": Config().optim.model_copy(update={"fsdp_processes": 2})})
    assert (
        type(RunResources(cfg=fsdp, store=None, prompts=pd.DataFrame(), test=pd.DataFrame()).policy) is TorchrunPolicy
    )
