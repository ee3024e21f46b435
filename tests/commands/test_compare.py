"""`coba compare`: runs per (strategy, seed) from one config, continued where stopped, read back into tables."""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
from pathlib import Path

import pandas as pd
import pytest
from helpers_fork import fake_run
from helpers_reward import assert_updates_moved, write_first_char_reward_file

from coba_tasks.commands import compare
from coba_tasks.commands import compare_fork as cf
from coba_tasks.pipeline.config import load_config
from coba_tasks.pipeline.rerun import apply_rerun, plan_rerun
from coba_tasks.pipeline.store import RunStore, Table
from coba_tasks.readers import comparison as ct


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


def test_a_set_of_a_key_compare_sets_is_refused_and_eval_greedy_is_the_users():
    """A --set of run.eval_greedy reaches the runs (it was overridden by the comparison's own true, silently);
    a --set of a key an option of compare decides is refused in one line that names the option."""
    planned = compare.plan_runs([("uniform", 0)], 2, "configs/tiny-test.yaml", ["run.eval_greedy=false"], 4, 1)
    assert planned[("uniform", 0)][1].run.eval_greedy is False
    assert compare.plan_runs([("uniform", 0)], 2, "configs/tiny-test.yaml", [], 4, 1)[("uniform", 0)][1].run.eval_greedy
    for item, option in (("run.steps=5", "--steps"), ("run.seed=3", "--seeds"), ("run.eval_temperature=0.7", "--eval")):
        with pytest.raises(ValueError, match=rf"^--set {item}: coba compare sets .* from {option}"):
            compare.plan_runs([("uniform", 0)], 2, "configs/tiny-test.yaml", [item], 4, 1)


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
    assert compare.run_order(["uniform", "coba"], [100, 101]) == [
        ("uniform", 100), ("coba", 100), ("uniform", 101), ("coba", 101),
    ]  # fmt: skip


def test_the_help_names_every_table_compare_writes():
    assert all(name in compare.COMMAND.description for name in ct.TABLES)


def test_seeds_are_a_count_a_range_or_a_list_and_anything_else_is_refused_in_one_line():
    assert compare.parse_seeds("3") == [0, 1, 2] and compare.parse_seeds("100-103") == [100, 101, 102, 103]
    assert compare.parse_seeds("0,7,9") == [0, 7, 9] and compare.parse_seeds("5-5") == [5]
    for bad in ("0", "-2", "9-3", "a", "1,1", "", "3-x"):
        with pytest.raises(ValueError, match=r"--seeds .*give N"):
            compare.parse_seeds(bad)


def test_the_mechanism_arms_are_coba_with_one_key_changed():
    """Each of the experiment's arms is the coba preset plus the one key it names (the combination: its three keys),
    and loads as a config."""
    from coba_tasks.pipeline.fork import differing_keys

    root = Path(__file__).resolve().parents[2]
    coba = load_config(root / "configs/demo.yaml", list(compare.PRESETS["coba"]))
    changed = {
        "coba-cap16": ("allocation.max_budget", 16),
        "coba-min4": ("allocation.min_budget", 4),
        "coba-equal": ("optim.prompt_weighting", "equal"),
        "coba-posterior": ("allocation.estimator", "posterior"),
        "coba-pilot": ("allocation.estimator", "pilot"),
    }
    for name, (key, value) in changed.items():
        cfg = load_config(root / "configs/demo.yaml", list(compare.PRESETS[name]))
        assert differing_keys(coba, cfg) == [key], name
        section, field = key.split(".")
        assert getattr(getattr(cfg, section), field) == value, name
    combined = load_config(root / "configs/demo.yaml", list(compare.PRESETS["coba-pilot-equal-cap16"]))
    keys = ("allocation.estimator", "optim.prompt_weighting", "allocation.max_budget")
    assert differing_keys(coba, combined) == sorted(keys)
    assert (combined.allocation.estimator, combined.optim.prompt_weighting, combined.allocation.max_budget) == (
        "pilot",
        "equal",
        16,
    )


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


def test_paired_differences_that_are_all_equal_give_no_interval_and_the_report_says_why():
    """Knapsack's pass@4 was one prompt of 90 below uniform's on all five exploration seeds: the report said
    [-0.011, -0.011], detectable 0.000 and p = 0, a t-test of zero spread, which is undefined."""
    base, arm = [67, 67, 68, 68, 68], [66, 66, 67, 67, 67]
    d = ct.paired_difference([a / 90 - b / 90 for a, b in zip(arm, base, strict=True)])
    assert d["pairs"] == 5 and d["mean"] == pytest.approx(-1 / 90) and d["sd"] == 0.0
    assert all(math.isnan(d[k]) for k in ("ci_low", "ci_high", "mdd", "p"))
    rows = [("knapsack", k, a / 90) for k, a in enumerate(arm)] + [("uniform", k, b / 90) for k, b in enumerate(base)]
    results = pd.DataFrame(
        [{"strategy": s, "seed": k, "step": 4, "accuracy": a, "accuracy_greedy": 0.5} for s, k, a in rows]
    )
    results = pd.concat([results, results.assign(step=0, accuracy=0.2)], ignore_index=True)
    text = ct.format_report(ct.final_table(results), ct.paired_table(results), pd.DataFrame())
    line = next(x for x in text.splitlines() if x.lstrip().startswith("knapsack") and " avg " in x)
    assert "-0.011" in line and "all 5 differences equal" in line and "detectable" not in line and "nan" not in line


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
    varied = pd.concat([results, results.assign(seed=1, accuracy=results["accuracy"] + [0.0, 0.0, 0.0, 0.02])])
    assert "2 seeds  -0.040 [-0.167, +0.087]  detectable " in ct.format_report(
        ct.final_table(varied), ct.paired_table(varied), pd.DataFrame()
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
        "steps_by_level": pd.DataFrame([{**key, "step": 0, "difficulty": 1, "groups": 4, "alike": 2, "mixed": 2}]),
        "prompt_visits": pd.DataFrame(
            [{**key, "step": 0, "prompt_id": "a", "rounds": 1, "generated": 16, "trained": 16, "successes": 8}]
        ),
    }


def _mechanism_run(root, strategy: str, seed: int) -> None:
    """A finished 2-step run of `coba compare` written by hand: prompts a, b (step 0, uniform) then a, c."""
    store = RunStore(root / f"{strategy}-seed{seed}")
    store.create(config_dict={"run": {"steps": 2}, "allocation": {"strategy": strategy}}, config_hash="h", versions={})
    store.write_run_table("prompts", pd.DataFrame({"prompt_id": ["a", "b", "c"], "difficulty": [1, 1, 0]}))
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
    # by level (a, b level 1; c level 0): b all wrong at its one visit (never mixed: not learnable), a mixed
    # then all right, c first solved at step 1
    levels = tables["steps_by_level"].set_index(["step", "difficulty"])
    assert levels.loc[(0, 1), ["groups", "alike", "all_wrong", "mixed", "rollouts"]].tolist() == [2, 1, 1, 1, 6]
    assert levels.loc[(0, 1), ["first_solved", "wrong_learnable"]].tolist() == [1, 0]
    assert levels.loc[(1, 1), ["groups", "alike", "first_solved", "estimated", "estimate_mae"]].tolist() == [
        1, 1, 0, 1, 0.5
    ]  # fmt: skip
    assert levels.loc[(1, 0), ["groups", "mixed", "first_solved"]].tolist() == [1, 1, 1]


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
        f"coba-seed0 in the tables in {out} (9 rows of an earlier sitting) was trained with another config "
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


def _fake_training(calls: list, steps: int):
    """A stand-in for ``compare._train_in_own_process``: records the call; a run started from scratch is laid
    out as the flow would (``fake_run``), and every run gets a summary.json."""

    def train(config_path, overrides, run_dir, resume, carry=()):
        calls.append((run_dir.name, resume, [Path(d).name for d, _ in carry]))
        if not resume:
            fake_run(run_dir, load_config(config_path, overrides), steps)
        figures = ("accuracy", "greedy")
        summary = {f"heldout_{k}_{when}": 0.5 for k in figures for when in ("before", "after")}
        (run_dir / "summary.json").write_text(json.dumps({**summary, "wall_seconds": 1.0}))

    return train


def test_a_comparison_forks_the_later_runs_of_a_seed_or_trains_them_from_their_start(tmp_path, monkeypatch):
    """The first run of a seed carries the later ones (forked in its process, where their allocations part);
    a run with no directory is forked from a run of its seed already there (a comparison made before
    forking, or whose first run could not fork it), else trained from its start, as every run is with
    --no-fork. Runs laid out by ``fake_run``: pool 8, 4 prompts a step, so coba parts from uniform at step 2."""
    order = compare.run_order(["uniform", "coba"], 1)
    planned = compare.plan_runs(order, 3, "configs/tiny-test.yaml", ["data.train_prompts=8"], 2, 1)
    calls: list = []
    monkeypatch.setattr(compare, "_train_in_own_process", _fake_training(calls, 3))
    printed: list[str] = []
    compare.run_all(tmp_path / "a", order, planned, 3, "configs/tiny-test.yaml", log=printed.append)
    # uniform was to fork coba in its process; the stand-in did not, so coba is forked from its directory
    assert calls == [("uniform-seed0", False, ["coba-seed0"]), ("coba-seed0", True, [])]
    assert "[1/2] uniform-seed0: forks coba-seed0 from it where their allocations part" in printed
    assert (
        "[2/2] coba-seed0: forked from uniform-seed0 before step 2 (3 of 3), sharing its steps 0-1 and their "
        "evaluations: training 1 step"
    ) in printed
    forked = RunStore.open(tmp_path / "a" / "coba-seed0")
    assert cf.fork_record(forked.root, 3) == ("uniform-seed0", 2)
    forked.write_table(2, Table.ROLLOUTS, pd.DataFrame({"prompt_id": ["p0"], "sample_idx": [0]}))
    assert cf.fork_record(forked.root, 3) is None  # it has begun its own steps: a stopped run, resumed

    calls.clear()
    compare.run_all(tmp_path / "b", order, planned, 3, "configs/tiny-test.yaml", log=printed.append, fork=False)
    assert calls == [("uniform-seed0", False, []), ("coba-seed0", False, [])]

    # a run kept from an earlier sitting's tables is not carried (it would be trained again)
    calls.clear()
    earlier = {("coba", 0): compare.Earlier("h", "the tables in kept", 6, "another --out")}
    compare.run_all(tmp_path / "k", order, planned, 3, "configs/tiny-test.yaml", earlier, log=printed.append)
    assert calls == [("uniform-seed0", False, [])] and not (tmp_path / "k" / "coba-seed0").exists()

    # the checkpoint the fork would continue from is gone (run.keep_checkpoints): forked all the same (its
    # resume replays the update after the newest checkpoint kept)
    calls.clear()
    (tmp_path / "c").mkdir()
    fake_run(tmp_path / "c" / "uniform-seed0", planned[("uniform", 0)][1], 3)
    (tmp_path / "c" / "uniform-seed0" / "summary.json").write_text("{}")
    shutil.rmtree(tmp_path / "c" / "uniform-seed0" / "checkpoints" / "000002")
    compare.run_all(tmp_path / "c", order, planned, 3, "configs/tiny-test.yaml", log=printed.append)
    assert calls == [("coba-seed0", True, [])]
    assert any(line.startswith("[2/2] coba-seed0: forked from uniform-seed0") for line in printed[-2:])
    assert not (tmp_path / "c" / "coba-seed0" / "checkpoints" / "000002").exists()


def test_the_first_run_forks_each_carried_run_at_the_boundary_of_its_fork_point(tmp_path):
    """The watcher in the first run's process forks a run at the first step boundary that has all the fork
    needs (its fork point, and every step before it done), and once; one it cannot fork is said and left
    to train from its start. The first run here is laid out by ``fake_run`` (coba parts at step 2)."""
    from coba_tasks.pipeline.run import RunResources

    planned = compare.plan_runs(
        [("uniform", 0), ("coba", 0)], 3, "configs/tiny-test.yaml", ["data.train_prompts=8"], 2, 1
    )
    store = fake_run(tmp_path / "uniform-seed0", planned[("uniform", 0)][1], 3)
    res = RunResources(cfg=planned[("uniform", 0)][1], store=store, prompts=pd.DataFrame(), test=pd.DataFrame())
    said: list[str] = []
    carrier = cf.Carrier({tmp_path / "coba-seed0": planned[("coba", 0)][1]}, log=said.append)
    # resumed inside step 1, after its budget stage: coba's fork point (2) is known, step 1 is not done yet
    update = store.read_table(1, Table.UPDATE)
    store.invalidate(1, Table.UPDATE)
    carrier(res, 1)
    assert not (tmp_path / "coba-seed0").exists() and not said
    store.write_table(1, Table.UPDATE, update)
    carrier(res, 2)
    assert said == [
        "coba-seed0: forked from uniform-seed0 before step 2 (3 of 3), sharing its steps 0-1 and their evaluations: "
        "training 1 step"
    ]
    assert RunStore.open(tmp_path / "coba-seed0").read_config()["allocation"]["strategy"] == "coba"
    carrier(res, 3)
    assert len(said) == 1  # once
    # the checkpoint at its fork point pruned: forked all the same, its resume replays from checkpoints/000001
    shutil.rmtree(store.checkpoint_dir(2))
    late = cf.Carrier({tmp_path / "knapsack-seed0": planned[("coba", 0)][1]}, log=said.append)
    late(res, 3)
    assert said[-1].startswith("knapsack-seed0: forked from uniform-seed0")
    assert not RunStore.open(tmp_path / "knapsack-seed0").checkpoint_dir(2).exists()
    late(res, 3)
    assert len(said) == 2


def _assert_forked_equals_from_the_start(forked: RunStore, scratch: RunStore, carrier: RunStore) -> None:
    """A forked run and the same run trained from its start: every table, manifest entry and checkpoint file
    bit for bit; run.json but for its creation time; only timing differs elsewhere. The forked run did not
    train the shared steps: their timing records and checkpoints are the carrier's."""

    def tables(store: RunStore) -> dict:
        out = {(s, n): store.read_table(s, n) for s in store.steps() for n in store.manifest(s)}
        return out | {(-1, n): store.read_run_table(n) for n in ("prompts", "history")}

    ta, tb = tables(forked), tables(scratch)
    assert sorted(ta) == sorted(tb) and len(ta) == 3 * 7 + 1 + 2  # steps 0-2: 7 tables; step 3: eval; 2 of the run
    for key in ta:
        pd.testing.assert_frame_equal(ta[key], tb[key], check_exact=True, obj=str(key))
    for s in forked.steps():
        no_time = [{n: {k: v for k, v in e.items() if k != "written_at"} for n, e in st.manifest(s).items()}
                   for st in (forked, scratch)]  # fmt: skip
        assert no_time[0] == no_time[1], s
    for k in range(1, 4):
        fa, fb = forked.checkpoint_dir(k), scratch.checkpoint_dir(k)
        files = sorted(p.relative_to(fa) for p in fa.rglob("*") if p.is_file())
        assert files == sorted(p.relative_to(fb) for p in fb.rglob("*") if p.is_file()) and files, k
        assert all((fa / f).read_bytes() == (fb / f).read_bytes() for f in files), k
    ra, rb = forked.run_info, scratch.run_info
    assert {k for k in ra.keys() | rb.keys() if ra.get(k) != rb.get(k)} == {"created"}
    assert (forked.root / "config.yaml").read_bytes() == (scratch.root / "config.yaml").read_bytes()
    sa, sb = (json.loads((s.root / "summary.json").read_text()) for s in (forked, scratch))
    timing = {"wall_seconds", "stage_seconds", "step_seconds_mean", "prefect_overhead_seconds_per_step", "run_dir"}
    assert {k for k in sa if sa[k] != sb[k]} <= timing and sa.keys() == sb.keys()
    for s in (0, 1):  # the shared steps were timed once, in the carrier's process
        assert (forked.step_dir(s) / "timing.json").read_bytes() == (carrier.step_dir(s) / "timing.json").read_bytes()
    for k in (1, 2):
        ours, theirs = (st.checkpoint_dir(k) / "model.safetensors" for st in (forked, carrier))
        assert ours.stat().st_ino == theirs.stat().st_ino


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
    args = tiny_compare_args(out, model, strategies="uniform,coba", steps=3, eval_samples=2, eval_every=1)
    # a pool of 8 prompts, 4 a step: steps 0 and 1 visit unseen prompts, which every strategy allocates
    # uniformly, so coba is uniform's run until step 2; a reward the random model earns (helpers_reward), so
    # the pass rates differ (coba's budget of step 2 is its own) and every update moves the weights
    reward = write_first_char_reward_file(tmp_path)
    args.set = [*args.set, "data.train_prompts=8", f"verify.reward_function={reward}"]
    assert compare.cmd_compare(args) == 0
    printed = capsys.readouterr().out
    assert "uniform" in printed and "non-zero advantage" in printed
    assert "[1/2] uniform-seed0: forks coba-seed0 from it where their allocations part" in printed
    assert (
        "[2/2] coba-seed0: forked from uniform-seed0 before step 2 (3 of 3), sharing its steps 0-1 and their "
        "evaluations: training 1 step"
    ) in printed
    # coba trained from its start (--no-fork, alone in another directory) is the forked coba, bit for bit
    scratch = argparse.Namespace(**{**vars(args), "out": str(tmp_path / "scratch"), "strategies": "coba"})
    assert compare.cmd_compare(argparse.Namespace(**vars(scratch), no_fork=True)) == 0
    assert "[1/1] coba-seed0: training 3 steps" in capsys.readouterr().out
    forked, carrier = RunStore.open(out / "coba-seed0"), RunStore.open(out / "uniform-seed0")
    _assert_forked_equals_from_the_start(forked, RunStore.open(tmp_path / "scratch" / "coba-seed0"), carrier)
    assert_updates_moved(forked, model, 3)
    assert forked.read_table(2, "budget")["budget"].tolist() != carrier.read_table(2, "budget")["budget"].tolist()
    results = pd.read_parquet(out / "results.parquet")
    assert sorted(set(results["strategy"])) == ["coba", "uniform"] and sorted(set(results["step"])) == [0, 1, 2, 3]
    assert results[["accuracy", "accuracy_greedy"]].notna().all().all()
    steps = pd.read_parquet(out / "steps.parquet")
    ratios = steps[["effective_gradient_ratio", "effective_rollout_ratio"]].stack()
    assert len(steps) == 6 and ratios.between(0, 1).all()
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
    # by level: every step's groups and rollouts, each group alike or mixed; the update's size
    levels = pd.read_parquet(out / "steps_by_level.parquet")
    per = levels.groupby(["strategy", "step"])[["groups", "rollouts"]].sum()
    assert (per["groups"] == 4).all() and (per["rollouts"] == 4 * 4).all()
    assert (levels["alike"] + levels["mixed"] == levels["groups"]).all() and levels["pass_rate"].between(0, 1).all()
    assert (levels["wrong_learnable"] <= levels["all_wrong"]).all()
    assert steps["grad_norm"].notna().all() and steps["nonzero_token_share"].between(0, 1).all()
    no_signal = steps["mixed_groups"] == 0  # a step without a mixed group trains on no token
    assert (steps.loc[no_signal, "nonzero_token_share"] == 0).all()
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
    assert spent.loc[("coba", 3)] == 3 * 4 * 4  # three steps of M * G rollouts trained on
    by_bin = pd.read_parquet(out / "budget_by_pass_rate.parquet")
    assert (by_bin.groupby("strategy")["rollouts"].sum() == 3 * 4 * 4).all()

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
    other_here = argparse.Namespace(**{**vars(args), "steps": 4, "set": [*args.set, "optim.lr=0.5"]})
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


def test_the_report_columns_line_up_for_a_strategy_name_longer_than_the_default_width():
    """coba-pilot-equal-cap16 (22 characters) pushed its rows out of line with the header and the other rows."""
    long = "coba-pilot-equal-cap16"
    tables = _join(_tables("uniform", 0, 0.5), _tables(long, 0, 0.6), _tables("uniform", 1, 0.5), _tables(long, 1, 0.7))
    tables["steps"] = tables["steps"].assign(effective_prompts=5.0)
    results = tables["results"]  # and a step-0 evaluation of each run, so the final table has a before
    results = pd.concat([results, results.assign(step=0, accuracy=0.2, accuracy_greedy=0.2)], ignore_index=True)
    text = ct.format_report(ct.final_table(results), ct.paired_table(results), ct.mechanism_table(tables))
    lines = text.splitlines()
    header = lines[0]
    rows = [line for line in lines if line.startswith((long, "uniform"))]
    assert len(rows) == 2
    assert {row.index(" 2  ") for row in rows} == {header.index("seeds") + 3}  # the seeds column
    paired = [line for line in lines if line.lstrip().startswith(long) and " avg " in line]
    assert paired and all(line.index("avg") == len(f"  {long} ") for line in paired)
    mech = [line for line in lines if "N_eff" in line and line.lstrip().startswith(("uniform", long))]
    assert len(mech) == 2 and len({line.index("N_eff") for line in mech}) == 1


@pytest.mark.slow
def test_a_comparison_with_a_rollout_budget_pairs_its_arms_at_equal_rollouts_generated(
    tmp_path, prefect_harness, random_checkpoints, monkeypatch
):
    """Uniform GRPO spends 16 rollouts a step here; DAPO's dynamic sampling a varying number (generation batches of
    2 prompts until 4 groups vary). With run.rollout_budget 48 each arm ends at the step whose rollouts reach 48,
    after another number of steps, and the paired table pairs their final evaluations at the rollouts generated
    before them: at least 48 each, within one step's rollouts of each other; results.parquet has the x axis."""
    model, _ = random_checkpoints
    use_the_sessions_server(monkeypatch)
    out = tmp_path / "cmp"
    args = tiny_compare_args(out, model, strategies="uniform,dynamic", steps=20, eval_samples=1, eval_every=0)
    reward = write_first_char_reward_file(tmp_path)
    budget = ["run.rollout_budget=48", "allocation.gen_batch_size=2", f"verify.reward_function={reward}"]
    args.set = [*args.set, *budget]
    assert compare.cmd_compare(args) == 0
    results = pd.read_parquet(out / "results.parquet")
    last = results.sort_values("step").groupby("strategy").last()
    assert (last["rollouts_spent"] >= 48).all() and (last["step"] < 20).all()
    steps = pd.read_parquet(out / "steps.parquet")
    assert (steps.groupby("strategy")["rollouts"].sum() == last["rollouts_spent"]).all()
    widest = steps.groupby("strategy")["rollouts"].max().max()
    assert abs(last.loc["dynamic", "rollouts_spent"] - last.loc["uniform", "rollouts_spent"]) < widest
    assert (steps["rollouts_trained"] == 16).all()  # each update trained on 4 groups of 4
    assert (steps.loc[steps["strategy"] == "dynamic", "rollouts"] >= 16).all()
    visits = pd.read_parquet(out / "prompt_visits.parquet")  # one row per prompt and visit, each arm
    assert (visits.groupby("strategy")["generated"].sum() == last["rollouts_spent"]).all()
    assert (visits.groupby("strategy")["trained"].sum() == steps.groupby("strategy")["rollouts_trained"].sum()).all()
    paired = ct.paired_table(results).set_index("measure")
    assert paired.loc["avg", "rollouts"] == last.loc["dynamic", "rollouts_spent"]
    assert paired.loc["avg", "baseline_rollouts"] == last.loc["uniform", "rollouts_spent"]
