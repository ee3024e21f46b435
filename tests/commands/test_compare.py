"""`coba compare`: runs per (strategy, seed) from one config, continued where stopped, read back into tables."""

from __future__ import annotations

import argparse
import json
import math
import re

import pandas as pd
import pytest

from coba_tasks.commands import compare
from coba_tasks.commands import compare_tables as ct
from coba_tasks.pipeline.rerun import apply_rerun, plan_rerun
from coba_tasks.pipeline.store import RunStore


def use_the_sessions_server(monkeypatch) -> None:
    """The runs' processes talk to the session's Prefect test server (``prefect_harness``): without
    PREFECT_API_URL in their environment each would start a temporary server of its own (10-40 s on 2 cores)."""
    from prefect.settings import PREFECT_API_URL

    monkeypatch.setenv("PREFECT_API_URL", str(PREFECT_API_URL.value()))


def tiny_compare_args(out, model, **options) -> argparse.Namespace:
    """The arguments of `coba compare` on configs/tiny-test.yaml with ``model``, one seed, into ``out``; rollouts
    from transformers (each run is a process of its own, and vLLM's import and start cost about 15 s a process
    on 2 cores; these tests are about the comparison, the vLLM runs are the flows' tests)."""
    return argparse.Namespace(
        config="configs/tiny-test.yaml",
        seeds=1,
        out=str(out),
        set=[f"model.path={model}", "data.train_prompts=6", "rollout.backend=transformers"],
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
    final = ct.final_table(pd.DataFrame(rows)).iloc[0]
    assert final["avg_before"] == pytest.approx(0.4) and final["avg_after"] == pytest.approx(0.6)
    assert final["avg_gain"] == pytest.approx(0.2) and final["avg_gain_std"] == pytest.approx(math.sqrt(0.02))
    assert final["greedy_gain"] == 0.0 and final["seeds"] == 2 and final["step"] == 4


def test_runs_go_seed_by_seed_so_a_stopped_comparison_is_paired():
    assert compare.run_order(["uniform", "coba"], 2) == [("uniform", 0), ("coba", 0), ("uniform", 1), ("coba", 1)]


def test_pass_rate_bins():
    rates = [math.nan, 0.0, 0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1.0]
    assert [ct.pass_rate_bin(r) for r in rates] == [
        "unseen", "0", "(0, 0.25]", "(0, 0.25]", "(0.25, 0.5]", "(0.25, 0.5]", "(0.5, 0.75]", "(0.5, 0.75]",
        "(0.75, 1)", "1",
    ]  # fmt: skip


def test_paired_difference_interval_and_smallest_detectable_difference():
    """Three pairs 0.1, 0.2, 0.3: mean 0.2, sd 0.1; t(0.975, 2) = 4.3027, t(0.8, 2) = 1.0607."""
    d = ct.paired_difference([0.1, 0.2, 0.3])
    se = 0.1 / math.sqrt(3)
    assert d["pairs"] == 3 and d["mean"] == pytest.approx(0.2) and d["sd"] == pytest.approx(0.1)
    assert (d["ci_low"], d["ci_high"]) == pytest.approx((0.2 - 4.302653 * se, 0.2 + 4.302653 * se))
    assert d["mdd"] == pytest.approx((4.302653 + 1.060660) * se)
    assert d["p"] == pytest.approx(0.0742, abs=1e-4)  # t = 3.46 on 2 degrees of freedom: the interval holds 0
    assert d["ci_low"] < 0 < d["ci_high"]
    one = ct.paired_difference([0.4])
    assert one["mean"] == 0.4 and math.isnan(one["ci_low"]) and math.isnan(one["mdd"]) and math.isnan(one["p"])


def test_paired_table_pairs_by_seed_and_uses_the_last_evaluation():
    rows = []
    for strategy, finals in (("uniform", [0.5, 0.6, 0.7]), ("coba", [0.6, 0.6, 0.9])):
        for seed, acc in enumerate(finals):
            rows.append({"strategy": strategy, "seed": seed, "step": 0, "accuracy": 0.2, "accuracy_greedy": 0.3})
            rows.append({"strategy": strategy, "seed": seed, "step": 8, "accuracy": acc, "accuracy_greedy": acc})
    rows.append({"strategy": "coba", "seed": 3, "step": 8, "accuracy": 0.0, "accuracy_greedy": 0.0})  # no pair
    paired = ct.paired_table(pd.DataFrame(rows)).set_index("measure")
    assert set(paired["strategy"]) == {"coba"} and paired.loc["avg", "pairs"] == 3
    assert paired.loc["avg", "mean"] == pytest.approx(0.1) and paired.loc["avg", "seeds"] == "[0, 1, 2]"


def test_the_report_of_one_seed_says_what_it_cannot_give_instead_of_nan():
    rows = []
    for strategy, final in (("uniform", 0.65), ("coba", 0.60)):
        start = {"strategy": strategy, "seed": 0, "accuracy": 0.2, "accuracy_greedy": 0.3}
        rows.append({**start, "step": 0, "rollouts_spent": 0})
        rows.append({**start, "step": 12, "rollouts_spent": 1000, "accuracy": final, "accuracy_greedy": final})
    results = pd.DataFrame(rows)
    text = ct.format_report(ct.final_table(results), ct.paired_table(results), pd.DataFrame())
    assert "nan" not in text
    assert "0.200 -> 0.650 (-)" in text and "+0.450 (-)" in text and "+0.4500" in text
    assert (
        "coba            avg     1 seeds  -0.050  (the interval and the detectable difference need 2 paired seeds)"
        in text
    )
    two = pd.concat([results, results.assign(seed=1)])
    assert "1 seeds" not in ct.format_report(ct.final_table(two), ct.paired_table(two), pd.DataFrame())
    assert "2 seeds  -0.050 [-0.050, -0.050]  detectable 0.000" in ct.format_report(
        ct.final_table(two), ct.paired_table(two), pd.DataFrame()
    )


def _tables(strategy: str, seed: int, accuracy: float, config_hash: str = "h") -> dict[str, pd.DataFrame]:
    """The tables of one finished run as `coba compare` writes them (one evaluation, one step), built directly."""
    key = {"strategy": strategy, "seed": seed}
    steps = {"S": 0.5, "alloc_alpha": 4.0, "alloc_beta": 4.0, "first_solved": 1, "rollouts": 16}
    steps |= {"step": 0, "effective_gradient_ratio": 0.5, "effective_rollout_ratio": 0.5}
    return {
        "runs": pd.DataFrame([{**key, "config_hash": config_hash, "finished": True, "steps": 1, "rollouts": 16}]),
        "results": pd.DataFrame(
            [{**key, "step": 4, "accuracy": accuracy, "accuracy_greedy": accuracy, "rollouts_spent": 16, "boxed": 1.0}]
        ),
        "steps": pd.DataFrame([{**key, **steps}]),
        "budget_by_level": pd.DataFrame([{**key, "step": 0, "difficulty": 1, "prompts": 4, "total_budget": 16}]),
        "budget_by_pass_rate": pd.DataFrame([{**key, "pass_rate_bin": "unseen", "prompts": 4, "rollouts": 16}]),
        "transitions": pd.DataFrame([{**key, "from_class": "mixed", "to_class": "mixed", "prompts": 0}]),
        "estimate_by_age": pd.DataFrame([{**key, "age": 1, "prompts": 4, "estimate_mae": 0.25, "estimate_bias": 0.1}]),
    }


def _mechanism_run(root, strategy: str, seed: int) -> None:
    """A finished 2-step run of `coba compare` written by hand: prompts a, b (step 0, uniform) then a, c."""
    store = RunStore(root / f"{strategy}-seed{seed}")
    store.create(config_dict={"run": {"steps": 2}, "allocation": {"strategy": strategy}}, config_hash="h", versions={})
    steps = {  # prompt -> (estimate, age, verdicts)
        0: {"a": (math.nan, math.nan, "cw"), "b": (math.nan, math.nan, "wwww")},
        1: {"a": (0.5, 1.0, "cccc"), "c": (math.nan, math.nan, "cw")},
    }
    for step, groups in steps.items():
        budget = {"prompt_id": list(groups), "pass_rate_est": [g[0] for g in groups.values()]}
        budget |= {"estimate_age": [g[1] for g in groups.values()], "budget": [len(g[2]) for g in groups.values()]}
        store.write_table(step, "budget", pd.DataFrame(budget).assign(alpha=2.0, beta=3.0))
        rows = [(pid, j, v) for pid, g in groups.items() for j, v in enumerate(g[2])]
        store.write_table(
            step,
            "rewards",
            pd.DataFrame(
                {
                    "prompt_id": [r[0] for r in rows],
                    "sample_idx": [r[1] for r in rows],
                    "reward": [float(r[2] == "c") for r in rows],
                    "verdict": ["correct" if r[2] == "c" else "wrong" for r in rows],
                }
            ),
        )
        cap = {"S": 0.5, "F": 0.5, "alpha_used": 2.0, "beta_used": 3.0, "alpha": 2.0, "beta": 3.0}
        store.write_table(step, "capability", pd.DataFrame([{**cap, "zero_variance_groups": 0.5}]))
        store.write_table(step, "update", pd.DataFrame([{"step": step, "effective_prompts": 1.0 + step}]))
    store.write_json("summary.json", {"wall_seconds": 1.0})


def test_collect_measures_the_mechanisms_of_each_step(tmp_path):
    _mechanism_run(tmp_path, "coba", 0)
    tables = ct.collect([tmp_path / "coba-seed0"])
    steps = tables["steps"].set_index("step")
    assert steps["effective_prompts"].tolist() == [1.0, 2.0] and steps["mixed_groups"].tolist() == [1, 1]
    assert steps["first_solved"].tolist() == [1, 1] and steps["estimated"].tolist() == [0, 1]
    assert steps["train_pass_at_2"].tolist() == [0.5, 1.0]  # pass@2 of (a, b) = (1, 0), of (a, c) = (1, 1)
    assert math.isnan(steps.loc[0, "estimate_mae"]) and steps.loc[1, "estimate_mae"] == 0.5
    assert steps.loc[1, "estimate_bias"] == 0.5 and steps.loc[1, "estimate_age_mean"] == 1.0
    assert tables["estimate_by_age"].drop(columns=["strategy", "seed"]).to_dict("records") == [
        {"age": 1, "prompts": 1, "estimate_mae": 0.5, "estimate_bias": 0.5}
    ]


def test_mechanism_table_averages_the_steps_then_the_seeds_and_prints_them():
    one = _tables("coba", 0, 0.5)
    two = _tables("coba", 1, 0.5)
    extra = {"effective_prompts": 4.0, "mixed_groups": 6, "prompts": 8, "estimate_mae": 0.2, "estimate_bias": 0.15}
    extra |= {"estimate_corr": 0.5, "estimate_age_mean": 2.0, "train_pass_at_2": 0.6}
    one["steps"] = pd.concat(
        [one["steps"].assign(**extra), one["steps"].assign(**{**extra, "step": 1, "effective_prompts": 2.0})]
    )
    two["steps"] = two["steps"].assign(**{**extra, "effective_prompts": 12.0, "estimate_corr": math.nan})
    two["estimate_by_age"] = pd.concat(
        [two["estimate_by_age"], two["estimate_by_age"].assign(age=3, prompts=2, estimate_mae=0.5, estimate_bias=-0.5)]
    )
    old = _tables("uniform", 0, 0.5)  # a run collected before the mechanisms were measured
    old["steps"] = old["steps"].drop(columns="first_solved").assign(first_solved=2)
    old["estimate_by_age"] = pd.DataFrame()
    tables = _join(one, two, old)
    mech = ct.mechanism_table(tables).set_index("strategy")
    assert mech.loc["coba", "effective_prompts"] == (3.0 + 12.0) / 2  # seed 0: steps 4 and 2; seed 1: 12
    assert mech.loc["coba", "estimate_corr"] == 0.5  # seed 1 has none
    assert mech.loc["coba", "mixed_groups"] == 6 and mech.loc["coba", "train_pass_at_2"] == pytest.approx(0.6)
    assert mech.loc["coba", "estimate_mae_age1"] == 0.25 and mech.loc["coba", "estimate_bias_age1"] == 0.1
    assert mech.loc["coba", "estimate_mae_older"] == 0.5 and mech.loc["coba", "estimate_bias_older"] == -0.5
    assert mech.loc["uniform", ["effective_prompts", "estimate_mae", "estimate_mae_age1"]].isna().all()
    text = ct.format_report(ct.final_table(tables["results"]), pd.DataFrame(), ct.mechanism_table(tables))
    assert (
        "  coba            N_eff 7.50, mixed 6.0 of 8.0, pass@2 0.600; estimates MAE 0.200, bias +0.150, r 0.50, "
        "age 2.0; age 1: MAE 0.250 bias +0.100, older: MAE 0.500 bias -0.500" in text
    )
    assert "  uniform         n/a (its tables were collected before these were measured)" in text


def _join(*tables: dict[str, pd.DataFrame]) -> dict[str, pd.DataFrame]:
    """The tables of several runs, one after another."""
    return {n: pd.concat([t[n] for t in tables], ignore_index=True) for n in ct.TABLES}


def _run_hash(args: argparse.Namespace, strategy: str, seed: int) -> str:
    """The config hash `coba compare` with ``args`` gives run (strategy, seed), computed here on its own."""
    from coba_tasks.pipeline.config import config_hash, load_config

    ov = compare.run_overrides(strategy, seed, args.steps, args.eval_samples, args.eval_every)
    return config_hash(load_config(args.config, [*args.set, *ov]))


def test_assemble_takes_this_sittings_runs_first_then_the_kept_finished_ones():
    here = _tables("coba", 0, 0.7)
    kept = _join(_tables("uniform", 0, 0.5), _tables("coba", 0, 0.1), _tables("uniform", 1, 0.6))
    kept["runs"].loc[kept["runs"]["seed"] == 1, "finished"] = False  # a run that stopped in the earlier sitting
    order = compare.run_order(["uniform", "coba"], 2)
    merged = ct.assemble(order, here, kept)
    got = merged["results"][["strategy", "seed", "accuracy"]].values.tolist()
    assert got == [["uniform", 0, 0.5], ["coba", 0, 0.7]]  # coba from here, uniform seed 1 not finished
    assert ct.finished_runs(kept) == {("uniform", 0): "h", ("coba", 0): "h"}
    done = ct.finished_only(kept)  # the statistics leave out the stopped run's rows
    assert done["results"][["strategy", "seed"]].values.tolist() == [["uniform", 0], ["coba", 0]]


def test_out_keeps_the_rows_of_its_earlier_sittings_finished_runs(tmp_path):
    """`--out`'s own tables are an earlier sitting's: the rows of its finished runs that have no directory
    there (copied tables, say), or that this command does not list, stay in the tables it writes."""
    out = tmp_path / "cmp"
    args = tiny_compare_args(out, tmp_path / "model", strategies="uniform", steps=1, eval_samples=1, eval_every=0)
    args.collect_only = True
    out.mkdir()
    hashes = {s: _run_hash(args, s, 0) for s in ("uniform", "coba")}
    ct.write_tables(out, _join(_tables("uniform", 0, 0.5, hashes["uniform"]), _tables("coba", 0, 0.7, hashes["coba"])))
    assert compare.cmd_compare(args) == 0
    results = pd.read_parquet(out / "results.parquet")
    assert results[["strategy", "seed", "accuracy"]].values.tolist() == [["uniform", 0, 0.5], ["coba", 0, 0.7]]
    assert pd.read_parquet(out / "runs.parquet")["config_hash"].tolist() == [hashes["uniform"], hashes["coba"]]
    final = json.loads((out / "final.json").read_text())["final"]
    assert [r["strategy"] for r in final] == ["uniform", "coba"]


def test_out_refuses_to_drop_an_earlier_run_made_with_another_config(tmp_path):
    """An earlier sitting's finished run in `--out`'s tables whose config is not this command's is neither
    mixed into the tables nor dropped from them: one line names it, its rows and the fix; no file changes."""
    out = tmp_path / "cmp"
    args = tiny_compare_args(out, tmp_path / "model", strategies="uniform", steps=1, eval_samples=1, eval_every=0)
    args.collect_only = True
    out.mkdir()
    ct.write_tables(out, _join(_tables("uniform", 0, 0.5, _run_hash(args, "uniform", 0)), _tables("coba", 0, 0.7)))
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(ValueError) as refused:
        compare.cmd_compare(args)
    assert str(refused.value) == (
        f"coba-seed0 in the tables in {out} (7 rows of an earlier sitting) was trained with another config "
        f"(hash h, this one {_run_hash(args, 'coba', 0)}): use the same config and options, or another --out"
    )
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_a_run_in_out_made_with_another_config_is_neither_kept_nor_resumed(tmp_path, capsys):
    """A run directory whose run.json records another config hash than the one this command gives that run
    (another --steps, --set...) is refused with one line before anything is kept, resumed or trained."""
    out = tmp_path / "cmp"
    args = tiny_compare_args(out, tmp_path / "model", strategies="uniform", steps=2, eval_samples=1, eval_every=0)
    run_dir = out / "uniform-seed0"
    RunStore(run_dir).create({}, "0123456789abcdef", {})  # made by another command (1 step, another lr...)
    (run_dir / "summary.json").write_text("{}")
    ours = _run_hash(args, "uniform", 0)
    refusal = (
        f"uniform-seed0 in {out} was trained with another config (hash 0123456789abcdef, this one {ours}): "
        "use the same config and options, or another --out"
    )
    with pytest.raises(ValueError) as refused:
        compare.cmd_compare(args)  # finished: not kept
    assert str(refused.value) == refusal and "kept" not in capsys.readouterr().out
    (run_dir / "summary.json").unlink()
    with pytest.raises(ValueError) as refused:
        compare.cmd_compare(args)  # stopped: not resumed
    assert str(refused.value) == refusal and sorted(p.name for p in run_dir.iterdir()) == ["config.yaml", "run.json"]
    # the run of this command's config passes the same check
    same = tmp_path / "same"
    RunStore(same / "uniform-seed0").create({}, ours, {})
    planned = compare.plan_runs([("uniform", 0)], 2, args.config, args.set, 1, 0)
    compare.check_configs(same, [("uniform", 0)], planned, {})
    with pytest.raises(ValueError, match=r"^uniform-seed0 in .* was trained with another config"):
        compare.check_configs(out, [("uniform", 0)], planned, {})


@pytest.mark.slow
def test_compare_runs_continues_and_collects(tmp_path, prefect_harness, random_checkpoints, capsys, monkeypatch):
    model, _ = random_checkpoints

    def not_here(*args, **kwargs):
        raise AssertionError("a comparison run trained in the comparing process")

    # every run trains in a process of its own (its memory goes back to the system when it ends)
    import flows.train

    monkeypatch.setattr(flows.train, "train_flow", not_here)
    use_the_sessions_server(monkeypatch)
    out = tmp_path / "cmp"
    args = tiny_compare_args(out, model, strategies="uniform,coba", steps=2, eval_samples=2, eval_every=1)
    assert compare.cmd_compare(args) == 0
    printed = capsys.readouterr().out
    assert "uniform" in printed and "non-zero advantage" in printed
    results = pd.read_parquet(out / "results.parquet")
    assert sorted(set(results["strategy"])) == ["coba", "uniform"] and sorted(set(results["step"])) == [0, 1, 2]
    assert results[["accuracy", "accuracy_greedy"]].notna().all().all()
    steps = pd.read_parquet(out / "steps.parquet")
    ratios = steps[["effective_gradient_ratio", "effective_rollout_ratio"]].stack()
    assert len(steps) == 4 and ratios.between(0, 1).all()
    # the mechanisms per step: N_eff from each update table; nothing estimated at step 0 (every prompt unseen)
    assert (
        steps["effective_prompts"].notna().all() and (steps["effective_prompts"] <= steps["mixed_groups"] + 1e-9).all()
    )
    assert (steps.loc[steps["step"] == 0, "estimated"] == 0).all() and (steps["prompts"] == 4).all()
    assert set(pd.read_parquet(out / "estimate_by_age.parquet").columns) >= {"strategy", "seed", "age", "prompts"}
    assert "per step (means over steps and seeds): N_eff of the update" in printed
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
    assert {"pairs", "ci_low", "ci_high", "mdd"} <= set(
        pd.DataFrame(json.loads((out / "final.json").read_text())["paired"])
    )
    assert "paired difference to uniform on the same seed" in printed and "where the rollouts went" in printed
    spent = results.set_index(["strategy", "step"])["rollouts_spent"]
    assert spent.loc[("coba", 2)] == 2 * 4 * 4  # two steps of M * G rollouts trained on
    by_bin = pd.read_parquet(out / "budget_by_pass_rate.parquet")
    assert (by_bin.groupby("strategy")["rollouts"].sum() == 2 * 4 * 4).all()

    # a later sitting in another directory: the finished runs come from the kept tables, none trains again
    later = argparse.Namespace(**{**vars(args), "out": str(tmp_path / "later"), "kept": str(out)})
    assert compare.cmd_compare(later) == 0
    printed = capsys.readouterr().out
    assert printed.count("finished in an earlier sitting, kept") == 2
    assert not (tmp_path / "later" / "uniform-seed0").exists()
    pd.testing.assert_frame_equal(results, pd.read_parquet(tmp_path / "later" / "results.parquet"))
    # ... unless the config differs from the one they were trained with
    other = argparse.Namespace(**{**vars(later), "set": [*args.set, "optim.lr=0.5"]})
    with pytest.raises(ValueError, match=r"uniform-seed0 in .* was trained with another config"):
        compare.cmd_compare(other)

    # a run in --out made with another config is neither kept nor resumed
    other_here = argparse.Namespace(**{**vars(args), "steps": 3, "set": [*args.set, "optim.lr=0.5"]})
    with pytest.raises(ValueError, match=rf"^uniform-seed0 in {re.escape(str(out))} was trained with another config"):
        compare.cmd_compare(other_here)
    assert "kept" not in capsys.readouterr().out
    store = RunStore.open(out / "coba-seed0")
    apply_rerun(store, plan_rerun(store, 1, "update"))
    with pytest.raises(ValueError, match=r"^coba-seed0 in .* was trained with another config"):
        compare.cmd_compare(argparse.Namespace(**{**vars(other_here), "strategies": "coba"}))
    assert not (out / "coba-seed0" / "summary.json").exists()

    # --out's own tables keep the finished runs that have no directory there, without --kept
    alone = argparse.Namespace(**{**vars(later), "kept": None})
    assert compare.cmd_compare(argparse.Namespace(**{**vars(alone), "collect_only": True})) == 0
    pd.testing.assert_frame_equal(results, pd.read_parquet(tmp_path / "later" / "results.parquet"))
    assert compare.cmd_compare(alone) == 0
    assert capsys.readouterr().out.count("finished in an earlier sitting, kept") == 2
    pd.testing.assert_frame_equal(results, pd.read_parquet(tmp_path / "later" / "results.parquet"))


def test_a_run_that_dies_stops_the_comparison_with_its_name(tmp_path, capsys, prefect_harness, monkeypatch):
    """A run whose process fails (here: a model path that does not exist) is named, with how to go on."""
    use_the_sessions_server(monkeypatch)
    args = tiny_compare_args(
        tmp_path / "cmp", tmp_path / "no-model", strategies="uniform", steps=1, eval_samples=1, eval_every=0
    )
    assert compare.cmd_compare(args) == 1
    err = capsys.readouterr().err
    assert f"run {tmp_path / 'cmp' / 'uniform-seed0'} did not finish" in err and "again to resume" in err
