"""A step sampled in rounds, worked by hand: which groups DAPO's dynamic sampling keeps and trains on, when it
samples again or stops the run; which prompts Reinforce-Ada samples again, the group the update sees and the
advantages against its pool (docs/method.md, sections 20 and 21)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from coba_tasks.core.ada import global_advantages, kept_counts
from coba_tasks.core.dynamic import varied_groups
from coba_tasks.pipeline.config import Config, apply_overrides
from coba_tasks.pipeline.config_fields import ConfigError
from coba_tasks.pipeline.rounds import (
    ROUND,
    RoundsError,
    ada_counts,
    ada_next,
    ada_state,
    ada_used,
    dynamic_kept,
    dynamic_next,
    dynamic_used,
)


def _rounds(*rounds: dict[str, list[float]]) -> pd.DataFrame:
    """A round_rewards table: per round, each prompt's rewards in order (sample_idx numbered on per prompt)."""
    rows, seen = [], {}
    for r, groups in enumerate(rounds):
        for pid, rewards in groups.items():
            for reward in rewards:
                rows.append((pid, seen.get(pid, 0), float(reward), "correct" if reward == 1 else "wrong", r))
                seen[pid] = seen.get(pid, 0) + 1
    return pd.DataFrame(rows, columns=["prompt_id", "sample_idx", "reward", "verdict", ROUND])


def _alloc(**keys):
    return apply_overrides(Config(), [f"allocation.{k}={v}" for k, v in keys.items()]).allocation


# --- dynamic


def test_dynamic_keeps_the_groups_that_vary_and_trains_on_the_first_it_kept():
    """Two generation batches of three prompts; the update wants 2 groups: after the first batch it holds one (a),
    so it samples again; after the second it holds three (a, d, e) and trains on the first two, a and d."""
    first = {"a": [1, 0], "b": [1, 1], "c": [0, 0]}
    second = {"d": [0, 1], "e": [1, 0], "f": [1, 1]}
    alloc = _alloc(strategy="dynamic", group_size=2, gen_batch_size=3)
    one = _rounds(first)
    assert dynamic_kept(one, "acc") == [("a", 0)]
    assert dynamic_next(None, alloc, 2, 6, step=0)  # round 0 always
    assert dynamic_next(one, alloc, train_prompts=2, pool=6, step=0)
    both = _rounds(first, second)
    assert dynamic_kept(both, "acc") == [("a", 0), ("d", 1), ("e", 1)]
    assert not dynamic_next(both, alloc, train_prompts=2, pool=6, step=0)
    used = dynamic_used(both, both, "acc", train_prompts=2)
    assert both.loc[used, "prompt_id"].tolist() == ["a", "a", "d", "d"]


def test_dynamic_reads_the_metric_it_is_given_and_keeps_a_single_rollout():
    """``seq_reward`` varies where ``acc`` does not (rewards 0.5 and 0.2, both wrong); veRL keeps a group of one."""
    table = _rounds({"a": [0.5, 0.2], "b": [1, 1], "c": [0.3]})
    assert dynamic_kept(table, "acc") == [("c", 0)]
    assert dynamic_kept(table, "seq_reward") == [("a", 0), ("c", 0)]
    assert varied_groups(["x", "x", "y"], np.array([1.0, 1.0, 0.0])) == {"x": False, "y": True}


def test_a_prompt_sampled_in_two_generation_batches_of_a_step_is_two_groups():
    table = _rounds({"a": [1, 1]}, {"a": [1, 0]})  # an epoch ended between them
    assert table["sample_idx"].tolist() == [0, 1, 2, 3]
    assert dynamic_kept(table, "acc") == [("a", 1)]


def test_dynamic_stops_the_run_at_its_limit_or_when_the_pool_is_covered():
    """At allocation.max_num_gen_batches short of mixed groups the run stops, as veRL's recipe raises; without a
    limit, once the batches covered the training pool; each in one line naming the way out."""
    alike = _rounds({"a": [1, 1], "b": [0, 0]}, {"c": [1, 1], "d": [1, 0]})
    limited = _alloc(strategy="dynamic", group_size=2, gen_batch_size=2, max_num_gen_batches=2)
    with pytest.raises(RoundsError) as info:
        dynamic_next(alike, limited, train_prompts=2, pool=100, step=3)
    message = str(info.value)
    assert message.startswith("step 3: 1 of the 2 mixed groups the update needs (data.prompts_per_step) after 2 ")
    assert "allocation.max_num_gen_batches" in message and "\n" not in message
    unlimited = _alloc(strategy="dynamic", group_size=2, gen_batch_size=2)
    assert dynamic_next(alike, unlimited, train_prompts=2, pool=100, step=3)  # no limit: on it goes
    with pytest.raises(RoundsError, match=r"covered the training pool of 4 prompts"):
        dynamic_next(alike, unlimited, train_prompts=2, pool=4, step=3)


# --- ada


def test_ada_samples_again_only_the_prompts_whose_group_is_not_balanced_yet():
    """n = 4, balanced: a prompt leaves once it has 2 positives and 2 negatives. After round 0 only a has them;
    after round 1 b has 7 positives and 1 negative, c 1 and 7: both go on, until max_rounds."""
    alloc = _alloc(strategy="ada", group_size=4, round_repeat=4, max_rounds=2)
    r0 = {"a": [1, 1, 0, 0], "b": [1, 1, 1, 1], "c": [0, 0, 0, 0]}
    r1 = {"b": [1, 0, 1, 1], "c": [0, 1, 0, 0]}
    assert ada_next(None, ["a", "b", "c"], alloc) == ["a", "b", "c"]
    assert ada_next(_rounds(r0), ["a", "b", "c"], alloc) == ["b", "c"]
    both = _rounds(r0, r1)
    state = ada_state(both, ["a", "b", "c"], alloc)
    assert state.to_dict("index") == {
        "a": {"pos": 2, "neg": 2, "done": True},
        "b": {"pos": 7, "neg": 1, "done": False},
        "c": {"pos": 1, "neg": 7, "done": False},
    }
    assert ada_next(both, ["a", "b", "c"], alloc) == []  # max_rounds = 2 rounds done
    assert ada_next(both, ["a", "b", "c"], _alloc(strategy="ada", group_size=4, max_rounds=3)) == ["b", "c"]


def test_ada_trains_on_the_first_rollouts_of_each_class():
    """The group the update sees, as the authors' code builds it: a (done): its first 2 positives and 2 negatives;
    b (7 positives, 1 negative, not done): 2 positives, its 1 negative, 1 more positive; c (1, 7): its positive and
    3 negatives; the first of each class in the order generated."""
    alloc = _alloc(strategy="ada", group_size=4, round_repeat=4, max_rounds=2)
    table = _rounds({"a": [1, 1, 0, 0], "b": [1, 1, 1, 1], "c": [0, 0, 0, 0]}, {"b": [1, 0, 1, 1], "c": [0, 1, 0, 0]})
    used = ada_used(table, ["a", "b", "c"], alloc)
    picked = table[used].groupby("prompt_id")["sample_idx"].apply(list).to_dict()
    assert picked == {"a": [0, 1, 2, 3], "b": [0, 1, 2, 5], "c": [0, 1, 2, 5]}
    assert int(used.sum()) == 12
    pos, neg = ada_counts(table, alloc)
    assert (pos[table["prompt_id"] == "b"] == 7).all() and (neg[table["prompt_id"] == "c"] == 7).all()


@pytest.mark.parametrize(
    ("pos", "neg", "choice", "done", "kept"),
    [
        (2, 6, "balanced", True, (2, 2)),
        (8, 0, "balanced", False, (4, 0)),  # never a negative: all positive (zero advantage against its pool)
        (0, 32, "balanced", False, (0, 4)),
        (1, 31, "balanced", False, (1, 3)),
        (1, 0, "positive_focused", True, (1, 0)),  # one rollout, one positive: a group of one
        (3, 5, "positive_focused", True, (2, 2)),
        (8, 0, "positive_focused", True, (4, 0)),
        (0, 8, "positive_focused", False, (0, 4)),  # no positive: ceil(0) = 0, at least 1 meant, negatives fill
        (1, 7, "positive_focused", False, (1, 3)),
        (1, 2, "balanced", False, (1, 2)),  # fewer than n rollouts: all of them
    ],
)
def test_the_kept_counts_follow_the_authors_rules(pos, neg, choice, done, kept):
    assert kept_counts(pos, neg, 4, choice, done) == kept


def test_ada_advantages_are_the_reward_minus_the_pass_rate_of_every_rollout_of_the_prompt():
    """b: 7 of 8 positive: a positive gets 1 - 7/8, a negative -7/8 (no division: the authors' script); with the
    division, by the pool's unbiased standard deviation (+ 1e-6)."""
    rewards, pos, neg = np.array([1.0, 0.0]), np.array([7.0, 7.0]), np.array([1.0, 1.0])
    assert global_advantages(rewards, pos, neg, norm_by_std=False).tolist() == [0.125, -0.875]
    std = np.sqrt(7 * 1 / (8 * 7)) + 1e-6
    np.testing.assert_allclose(global_advantages(rewards, pos, neg, True), [0.125 / std, -0.875 / std])
    assert global_advantages(np.array([1.0]), np.array([1.0]), np.array([0.0]), False).tolist() == [1.0]  # one: mean 0


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("allocation.filter_metric=score", r"allocation\.filter_metric = 'score': must be one of acc, seq_reward"),
        ("allocation.reinforce_ada_choice=balance", r"allocation\.reinforce_ada_choice = 'balance': must be one of"),
        ("allocation.max_rounds=0", r"allocation\.max_rounds = 0: must be >= 1"),
        ("allocation.round_repeat=0", r"allocation\.round_repeat = 0: must be >= 1"),
        ("allocation.max_num_gen_batches=-1", r"allocation\.max_num_gen_batches = -1: must be >= 0"),
    ],
)
def test_bad_round_settings_are_refused_in_one_line_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message) as info:
        apply_overrides(Config(), [override])
    assert "\n" not in str(info.value)


def test_a_strategy_sampled_in_rounds_takes_no_estimator_and_a_group_of_two():
    with pytest.raises(ConfigError, match=r"allocation\.estimator.*dynamic samples its own rounds"):
        apply_overrides(Config(), ["allocation.strategy=dynamic", "allocation.estimator=pilot"])
    with pytest.raises(ConfigError, match=r"allocation\.group_size = 1: .*ada"):
        apply_overrides(Config(), ["allocation.strategy=ada", "allocation.group_size=1"])
    assert apply_overrides(Config(), ["allocation.strategy=ada"]).allocation.sampling == "rounds"
    assert apply_overrides(Config(), ["allocation.estimator=pilot"]).allocation.sampling == "pilot"
    assert Config().allocation.sampling == "once"


# --- counted in rollouts generated


def _store_with_rollouts(tmp_path, counts: list[int]):
    from coba_tasks.pipeline.store import RunStore, Table

    store = RunStore(tmp_path / "run")
    store.create({"run": {}}, "abc", {})
    for step, n in enumerate(counts):
        store.write_table(step, Table.ROLLOUTS, pd.DataFrame({"prompt_id": ["p"] * n, "n_tokens": [3] * n}))
    return store


def test_a_rollout_budget_ends_the_run_after_the_step_that_reaches_it(tmp_path):
    """Steps that generated 16, 24, 40 and 16 rollouts: a budget of 40 is reached by step 1 (16 + 24), so the run
    is 2 steps; 81 by step 3; one no step reaches leaves run.steps; no budget: run.steps."""
    from coba_tasks.pipeline.progress import rollouts_generated, run_length

    store = _store_with_rollouts(tmp_path, [16, 24, 40, 16])
    cfg = lambda **run: apply_overrides(Config(), ["run.steps=10", *(f"run.{k}={v}" for k, v in run.items())])  # noqa: E731
    assert rollouts_generated(store, 10) == [16, 24, 40, 16]
    assert run_length(store, cfg(rollout_budget=40)) == 2
    assert run_length(store, cfg(rollout_budget=81)) == 4
    assert run_length(store, cfg(rollout_budget=97)) == 10  # not reached by the steps done so far
    assert run_length(store, cfg()) == 10


def test_evaluations_every_so_many_rollouts_generated_follow_the_steps_that_cross_them(tmp_path):
    """eval_every_rollouts 30: the totals 16, 40, 80, 96 cross 30 at step 1 and 60 at step 2 (one evaluation
    each, after the step: the weights after 2 and 3 updates), 90 at step 3; with the step schedule and the run's
    end beside them."""
    from coba_tasks.pipeline.evaluation import run_eval_steps

    store = _store_with_rollouts(tmp_path, [16, 24, 40, 16])
    cfg = apply_overrides(Config(), ["run.steps=10", "run.eval_every=0", "run.eval_every_rollouts=30"])
    assert run_eval_steps(store, cfg) == [0, 2, 3, 4, 10]
    budget = apply_overrides(cfg, ["run.rollout_budget=80", "run.eval_every=1"])
    assert run_eval_steps(store, budget) == [0, 1, 2, 3]  # the run ends after step 2: its last evaluation at 3
