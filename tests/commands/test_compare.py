"""`coba compare`: runs per (strategy, seed) from one config, continued where stopped, read back into tables."""

from __future__ import annotations

import argparse
import math

import pandas as pd
import pytest

from coba_tasks.commands import compare
from coba_tasks.pipeline.rerun import apply_rerun, plan_rerun
from coba_tasks.pipeline.store import RunStore


def tiny_compare_args(out, model, **options) -> argparse.Namespace:
    """The arguments of `coba compare` on configs/tiny-test.yaml with ``model``, one seed, into ``out``."""
    return argparse.Namespace(
        config="configs/tiny-test.yaml",
        seeds=1,
        out=str(out),
        set=[f"model.path={model}", "data.train_prompts=6"],
        collect_only=False,
        **options,
    )


def test_parse_strategies():
    assert compare.parse_strategies("uniform, coba,coba-reversed") == ["uniform", "coba", "coba-reversed"]
    with pytest.raises(ValueError, match="unknown strategy grpo; choose from uniform, knapsack"):
        compare.parse_strategies("coba,grpo")
    with pytest.raises(ValueError, match="listed twice"):
        compare.parse_strategies("coba,coba")


def test_run_overrides_differ_only_in_allocation_and_seed():
    a = compare.run_overrides("uniform", 1, 10, 4, 5)
    b = compare.run_overrides("coba-fixed", 1, 10, 4, 5)
    common = {"run.seed=1", "run.steps=10", "run.eval_every=5", "run.eval_samples=4", "run.eval_temperature=1.0"}
    assert common <= set(a) and common <= set(b)
    assert {o for o in set(a) ^ set(b) if not o.startswith("run.name=")} == {
        "allocation.strategy=uniform",
        "allocation.strategy=coba",
        "allocation.mode=paper",
        "allocation.schedule=fixed",
    }


def test_final_table_means_and_spread():
    rows = []
    for seed, (a0, a1) in enumerate([(0.4, 0.5), (0.4, 0.7)]):
        rows += [
            {"strategy": "coba", "seed": seed, "step": 0, "accuracy": a0, "accuracy_greedy": 0.5},
            {"strategy": "coba", "seed": seed, "step": 4, "accuracy": a1, "accuracy_greedy": 0.5},
        ]
    final = compare.final_table(pd.DataFrame(rows)).iloc[0]
    assert final["avg_before"] == pytest.approx(0.4) and final["avg_after"] == pytest.approx(0.6)
    assert final["avg_gain"] == pytest.approx(0.2) and final["avg_gain_std"] == pytest.approx(math.sqrt(0.02))
    assert final["greedy_gain"] == 0.0 and final["seeds"] == 2 and final["step"] == 4


@pytest.mark.slow
def test_compare_runs_continues_and_collects(tmp_path, prefect_harness, random_checkpoints, capsys, monkeypatch):
    model, _ = random_checkpoints

    def not_here(*args, **kwargs):
        raise AssertionError("a comparison run trained in the comparing process")

    # every run trains in a process of its own (its memory goes back to the system when it ends)
    import flows.train

    monkeypatch.setattr(flows.train, "train_flow", not_here)
    out = tmp_path / "cmp"
    args = tiny_compare_args(out, model, strategies="uniform,coba", steps=2, eval_samples=2, eval_every=1)
    assert compare.cmd_compare(args) == 0
    printed = capsys.readouterr().out
    assert "uniform" in printed and "share of rollouts / groups with non-zero reward variance" in printed
    results = pd.read_parquet(out / "results.parquet")
    assert sorted(set(results["strategy"])) == ["coba", "uniform"] and sorted(set(results["step"])) == [0, 1, 2]
    assert results[["accuracy", "accuracy_greedy"]].notna().all().all()
    steps = pd.read_parquet(out / "steps.parquet")
    ratios = steps[["effective_gradient_ratio", "effective_rollout_ratio"]].stack()
    assert len(steps) == 4 and ratios.between(0, 1).all()
    # the Beta parameters of each step's allocation, as its budget table records them
    coba_steps = steps[steps["strategy"] == "coba"].set_index("step")
    for step in (0, 1):
        budget_table = RunStore.open(out / "coba-seed0").read_table(step, "budget")
        assert coba_steps.loc[step, "alloc_alpha"] == budget_table["alpha"].iloc[0]
        assert coba_steps.loc[step, "alloc_beta"] == budget_table["beta"].iloc[0]
    budget = pd.read_parquet(out / "budget_by_level.parquet")
    per_step = budget.groupby(["strategy", "step"])["total_budget"].sum()
    assert (per_step == 4 * 4).all()  # M * G of configs/tiny-test.yaml on every step, whatever the strategy
    transitions = pd.read_parquet(out / "transitions.parquet")
    assert len(transitions) == 2 * 9 and (transitions["prompts"] >= 0).all()
    assert (out / "compare.png").stat().st_size > 10_000

    # the same run of uniform and coba: identical first evaluation (same model start, same seeds)
    first = results[results["step"] == 0].set_index("strategy")
    assert first.loc["uniform", "accuracy"] == first.loc["coba", "accuracy"]

    # stop one run half-way: compare continues it and keeps the other
    store = RunStore.open(out / "coba-seed0")
    apply_rerun(store, plan_rerun(store, 1, "update"))
    assert not (out / "coba-seed0" / "summary.json").exists()
    assert compare.cmd_compare(args) == 0
    printed = capsys.readouterr().out
    assert "uniform-seed0: finished earlier, kept" in printed and "coba-seed0: resuming where it stopped" in printed
    assert (out / "coba-seed0" / "summary.json").is_file()
    again = pd.read_parquet(out / "results.parquet")
    pd.testing.assert_frame_equal(results, again)


def test_a_run_that_dies_stops_the_comparison_with_its_name(tmp_path, capsys):
    """A run whose process fails (here: a model path that does not exist) is named, with how to go on."""
    args = tiny_compare_args(
        tmp_path / "cmp", tmp_path / "no-model", strategies="uniform", steps=1, eval_samples=1, eval_every=0
    )
    assert compare.cmd_compare(args) == 1
    err = capsys.readouterr().err
    assert f"run {tmp_path / 'cmp' / 'uniform-seed0'} did not finish" in err and "again to resume" in err
