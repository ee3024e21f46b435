"""The positive control of docs/results.md ("The positive control (stage B)"), read by the rules its plan fixed
before its runs: the early stop after the first 3 seeds (does Knapsack-RL turn more all-wrong band groups mixed
than uniform?), the primary contrast (Knapsack-RL - uniform on the mean of held-out avg@8 at steps 6 and 12,
paired over seeds; CoBA-RL - uniform as secondary) and the mechanism tables by level.

    .venv/bin/python scripts/band_control.py runs/band-control-400 [runs/band-control-403]

Reads the tables of one or more ``coba compare`` directories (``--kept`` copies too); writes nothing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import pandas as pd
from scipy import stats

FIRST_SEEDS = (400, 401, 402)  # the early stop reads these pairs
PLANNED_PAIRS = 8
BAND_LEVEL = 1  # the pool's band problems (level 0: the easy half)
MID, LAST = 6, 12
ARMS = ("knapsack", "coba")  # each against uniform


def read(dirs: list[Path], name: str) -> pd.DataFrame:
    return pd.concat([pd.read_parquet(d / f"{name}.parquet") for d in dirs], ignore_index=True)


def early_stop(levels: pd.DataFrame) -> dict[str, Any]:
    """Per first-3 pair: the band groups all wrong at their prompt's previous visit and mixed now, summed over the
    run, uniform's and Knapsack-RL's; stop unless Knapsack-RL's is above in at least 2 of the 3 pairs."""
    band = levels[levels["difficulty"] == BAND_LEVEL]
    turned = band.groupby(["strategy", "seed"])["wrong_to_mixed"].sum()
    pairs = {
        s: (int(turned[("uniform", s)]), int(turned[("knapsack", s)]))
        for s in FIRST_SEEDS
        if ("uniform", s) in turned and ("knapsack", s) in turned
    }
    above = sum(k > u for u, k in pairs.values())
    return {"pairs": pairs, "above": above, "complete": len(pairs) == len(FIRST_SEEDS), "stop": above < 2}


def contrast(results: pd.DataFrame, arm: str) -> dict[str, Any] | None:
    """``arm`` - uniform on the mean of avg@8 at steps 6 and 12, paired over the seeds both have."""
    acc = results.pivot_table(index=["strategy", "seed"], columns="step", values="accuracy")
    both = acc[[MID, LAST]].mean(axis=1)  # a run without one of the two steps is NaN and left out
    runs = both.dropna()
    seeds = sorted(set(runs.loc["uniform"].index) & set(runs.loc[arm].index)) if arm in runs.index else []
    if len(seeds) < 2:
        return None
    ours, uniform = both.loc[arm].loc[seeds], both.loc["uniform"].loc[seeds]
    diff = ours - uniform
    n, sd = len(diff), float(diff.std(ddof=1))
    test = stats.ttest_rel(ours, uniform)
    ci = test.confidence_interval(0.95)
    detectable = (stats.t.ppf(0.975, n - 1) + stats.t.ppf(0.80, n - 1)) * sd / n**0.5
    gain = float((acc.loc["uniform"].loc[seeds, LAST] - acc.loc["uniform"].loc[seeds, MID]).mean())
    return {
        "pairs": n,
        "difference": float(diff.mean()),
        "ci": (float(ci.low), float(ci.high)),
        "p": float(test.pvalue),
        "detectable": detectable,
        "uniform_gain_6_12": gain,
        "per_seed": {int(s): float(d) for s, d in diff.items()},
    }


def mechanisms(levels: pd.DataFrame, budgets: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    """Per arm, means over seeds of per-run sums or means: budget a band prompt, band groups mixed and all wrong,
    all-wrong -> mixed, first solves, the estimates' error, N_eff, gradient norm, tokens with an advantage."""
    band = levels[levels["difficulty"] == BAND_LEVEL].groupby(["strategy", "seed"])
    per_run = pd.DataFrame(
        {
            "band mixed": band["mixed"].sum(),
            "band all wrong": band["all_wrong"].sum(),
            "band wrong->mixed": band["wrong_to_mixed"].sum(),
            "band first solved": band["first_solved"].sum(),
            "band estimate MAE": band["estimate_mae"].mean(),
        }
    )
    b = budgets.groupby(["strategy", "seed", "difficulty"])[["total_budget", "prompts"]].sum()
    rate = (b["total_budget"] / b["prompts"]).unstack("difficulty")
    per_run["budget/prompt L0"], per_run["budget/prompt L1"] = rate.get(0), rate.get(BAND_LEVEL)
    s = steps.groupby(["strategy", "seed"])
    per_run["N_eff"] = s["effective_prompts"].mean()
    per_run["grad norm"] = s["grad_norm"].mean()
    per_run["nonzero tokens"] = s["nonzero_token_share"].mean()
    return per_run.groupby("strategy").mean()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dirs", nargs="+", type=Path, help="coba compare directories of the positive control")
    dirs = parser.parse_args(argv).dirs
    results, levels = read(dirs, "results"), read(dirs, "steps_by_level")
    pd.set_option("display.width", 200)
    print("Held-out avg@8 (band problems; mean over seeds) by step, and by level at the last step")
    table = results.pivot_table(index="strategy", columns="step", values="accuracy", aggfunc="mean")
    table["seeds"] = results.groupby("strategy")["seed"].nunique()
    for level in (1, 2):
        column = f"accuracy_level{level}"
        if column in results:
            table[f"L{level} at {LAST}"] = results[results["step"] == LAST].groupby("strategy")[column].mean()
    print(table.round(3).to_string())

    stop = early_stop(levels)
    print("\nEarly stop (first 3 pairs): band groups all wrong at the previous visit and mixed now, uniform / knapsack")
    for seed, (u, k) in stop["pairs"].items():
        print(f"  seed {seed}: {u} / {k}{'  knapsack above' if k > u else ''}")
    if stop["complete"]:
        verdict = "stop: the mechanism does not run here" if stop["stop"] else "go on to seeds 403-407"
        print(f"  knapsack above uniform in {stop['above']} of 3 pairs: {verdict}")
    else:
        print("  not all 3 pairs are done: no verdict yet")

    for arm in ARMS:
        c = contrast(results, arm)
        if c is None:
            continue
        role = "primary" if arm == "knapsack" else "secondary"
        status = (
            "" if c["pairs"] >= PLANNED_PAIRS else f" (interim: {c['pairs']} of {PLANNED_PAIRS} pairs, not the test)"
        )
        print(f"\n{arm} - uniform, mean of avg@8 at steps {MID} and {LAST} ({role}){status}")
        print(
            f"  {c['difference']:+.4f} [{c['ci'][0]:+.4f}, {c['ci'][1]:+.4f}], paired t p {c['p']:.3g}; smallest "
            f"detectable {c['detectable']:.4f}; uniform's own gain {MID}->{LAST} {c['uniform_gain_6_12']:+.4f}"
        )
        print("  per seed: " + ", ".join(f"{s} {d:+.3f}" for s, d in c["per_seed"].items()))

    print("\nMechanisms (per run, means over seeds)")
    print(mechanisms(levels, read(dirs, "budget_by_level"), read(dirs, "steps")).round(3).to_string())
    return 0


if __name__ == "__main__":
    sys.exit(main())
