"""The census of docs/results.md ("Where allocation pays, measured per prompt"), read by the rules its plan fixed
before any of its runs: per set and level the problems that solve none, a band's worth (1-6 of 32; 2-12 of 64)
and more; the rule that stops the study; the share of the gate run's level-1 all-wrong groups whose prompt solves
at least once in 64 at the nearest checkpoint; and the carry/borrow hypothesis, tested two ways.

    .venv/bin/python scripts/census_report.py docs/census

Reads the census tables (``coba eval --out``) and the gate run's per-prompt visits kept in that folder, and the
problems' texts from data/ (the files the census sampled); writes nothing.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

import pandas as pd
from scipy import stats

from coba_tasks.pipeline.data import load_dataset

ROOT = Path(__file__).resolve().parents[1]

# fixed by the plan before the census
BAND = {32: (1, 6), 64: (2, 12)}  # successes of a problem in the band, by completions per problem
TRAIN_MIN, HELD_OUT_MIN = 24, 60  # fewer training or held-out problems in the band: a decisive negative
POOL_CHECKPOINTS = (4, 8, 12)
NEAREST = {**dict.fromkeys(range(3, 7), 4), **dict.fromkeys(range(7, 11), 8), **dict.fromkeys(range(11, 16), 12)}
POOL_FILE = "data/arith_chat_train_l01.parquet"
CANDIDATES = {  # census table -> (the file it sampled, its level)
    "train-l1-unused": ("data/arith_chat_train_l1_unused.parquet", 1),
    "test-l1": ("data/arith_chat_test.parquet", 1),
    "test-l2": ("data/arith_chat_test.parquet", 2),
}
HELD_OUT = ("test-l1", "test-l2")
PROBLEM = re.compile(r"Compute (\d+)([+-])(\d+)\.")


def needs_carry_or_borrow(text: str) -> bool:
    """Whether ``a + b`` has a column whose digits sum to 10 or more, or ``a - b`` (worked as the larger minus the
    smaller) a column where the larger number's digit is the smaller.

    >>> [needs_carry_or_borrow(f"Compute {p}.") for p in ("8+56", "30+9", "44-5", "4-6", "46-30", "9+1")]
    [True, False, True, False, False, True]
    """
    match = PROBLEM.search(text)
    if match is None:
        raise ValueError(f"not a problem a + b or a - b: {text!r}")
    a, op, b = int(match[1]), match[2], int(match[3])
    if op == "-":
        a, b = max(a, b), min(a, b)
    while a or b:
        x, y = a % 10, b % 10
        if (op == "+" and x + y >= 10) or (op == "-" and x < y):
            return True
        a, b = a // 10, b // 10
    return False


def classes(solved: pd.Series, samples: int) -> dict[str, int]:
    """Problems by successes: none, below the band (1 of 64 only), in it, above it."""
    lo, hi = BAND[samples]
    return {
        "none": int((solved == 0).sum()),
        "below": int(((solved > 0) & (solved < lo)).sum()),
        "band": int(solved.between(lo, hi).sum()),
        "above": int((solved > hi).sum()),
    }


def with_problems(table: pd.DataFrame, path: Path) -> pd.DataFrame:
    """The census table with each problem's text and whether it needs a carry or a borrow."""
    texts = load_dataset(path).set_index("prompt_id")["prompt_text"]
    out = table.assign(prompt_id=table["prompt_id"].astype(str))
    out["text"] = out["prompt_id"].map(texts)
    if out["text"].isna().any():
        raise ValueError(
            f"{path} lacks prompts of the census table: {out.loc[out['text'].isna(), 'prompt_id'].tolist()}"
        )
    out["carry_borrow"] = out["text"].map(needs_carry_or_borrow)
    return out


def census(folder: Path, root: Path = ROOT) -> dict[str, Any]:
    """The census's figures by the plan's rules, from the tables in ``folder`` and the problems in ``root``/data."""
    pool = {k: with_problems(pd.read_parquet(folder / f"pool-{k}.parquet"), root / POOL_FILE) for k in POOL_CHECKPOINTS}
    cand = {n: with_problems(pd.read_parquet(folder / f"{n}.parquet"), root / f) for n, (f, _) in CANDIDATES.items()}
    for name, (_, level) in CANDIDATES.items():
        if set(cand[name]["difficulty"]) != {level} or set(cand[name]["samples"]) != {32}:
            raise ValueError(f"{name}: expected level {level} at 32 completions a problem")
    counts = []
    tables = [(f"pool at checkpoint {k} (64)", t) for k, t in pool.items()]
    tables += [(f"{name} at checkpoint 4 (32)", t) for name, t in cand.items()]
    for label, t in tables:
        for level, part in t.groupby("difficulty"):
            c = classes(part["solved"], int(part["samples"].iloc[0]))
            counts.append({"set": label, "level": int(level), "n": len(part), **c, "mean": part["accuracy"].mean()})

    pool4_l1 = pool[4][pool[4]["difficulty"] == 1]
    training = classes(cand["train-l1-unused"]["solved"], 32)["band"] + classes(pool4_l1["solved"], 64)["band"]
    held_out = sum(classes(cand[n]["solved"], 32)["band"] for n in HELD_OUT)

    visits = pd.read_parquet(folder / "gate-prompt-visits.parquet")
    visits = visits.assign(prompt_id=visits["prompt_id"].astype(str))
    wrong = visits[(visits["level"] == 1) & visits["step"].between(3, 15) & (visits["successes"] == 0)]
    wrong = wrong[wrong["generated"] > 0]
    solved_at = {k: t.set_index("prompt_id")["solved"] for k, t in pool.items()}
    hit = [int(solved_at[NEAREST[int(s)]][p] > 0) for s, p in zip(wrong["step"], wrong["prompt_id"], strict=True)]

    carry = {}
    for level, names in {1: ["train-l1-unused", "test-l1"], 2: ["test-l2"]}.items():
        t = pd.concat([cand[n] for n in names])
        without, with_ = t.loc[~t["carry_borrow"], "accuracy"], t.loc[t["carry_borrow"], "accuracy"]
        row: dict[str, Any] = {"sets": names, "without": len(without), "with": len(with_)}
        row |= {"mean_without": without.mean(), "mean_with": with_.mean()}
        if min(len(without), len(with_)) >= 2:
            welch = stats.ttest_ind(without, with_, equal_var=False)
            ci = welch.confidence_interval(0.95)
            row |= {"difference": without.mean() - with_.mean(), "ci": (ci.low, ci.high), "welch_p": welch.pvalue}
            row["mann_whitney_p"] = stats.mannwhitneyu(without, with_, alternative="two-sided").pvalue
        carry[level] = row
    solved = pd.concat([t[t["difficulty"] == 1].set_index("prompt_id")["solved"] for t in pool.values()], axis=1)
    never = solved.sum(axis=1) == 0
    cb = pool4_l1.set_index("prompt_id")["carry_borrow"].reindex(solved.index)
    fisher_table = [
        [int((never & cb).sum()), int((never & ~cb).sum())],
        [int((~never & cb).sum()), int((~never & ~cb).sum())],
    ]
    fisher = stats.fisher_exact(fisher_table)
    return {
        "counts": counts,
        "training_band": training,
        "held_out_band": held_out,
        "stop": training < TRAIN_MIN or held_out < HELD_OUT_MIN,
        "wrong_groups": len(wrong),
        "wrong_prompts": int(wrong["prompt_id"].nunique()),
        "wrong_with_success": int(sum(hit)),
        "carry": carry,
        "fisher_table": fisher_table,
        "fisher_p": float(fisher.pvalue),
        "fisher_odds": float(fisher.statistic),
    }


def print_census(f: dict[str, Any]) -> None:
    print("Problems by successes (band: 1-6 of 32, 2-12 of 64; below: 1 of 64)")
    print(f"  {'set':<38} {'level':>5} {'n':>4} {'none':>5} {'below':>6} {'band':>5} {'above':>6} {'mean pass':>10}")
    for c in f["counts"]:
        print(
            f"  {c['set']:<38} {c['level']:>5} {c['n']:>4} {c['none']:>5} {c['below']:>6} {c['band']:>5}"
            f" {c['above']:>6} {c['mean']:>10.3f}"
        )
    print("\nThe rule that stops the study")
    print(
        f"  training problems in the band (unused level 1 + the pool's level 1, checkpoint 4): {f['training_band']}"
        f" (fewer than {TRAIN_MIN} stops)"
    )
    print(
        f"  held-out problems in the band (level 1 + level 2, checkpoint 4): {f['held_out_band']}"
        f" (fewer than {HELD_OUT_MIN} stops)"
    )
    verdict = "a decisive negative: the study stops here" if f["stop"] else "the band exists: stage B is planned next"
    print(f"  verdict: {verdict}")
    n = f["wrong_groups"]
    print("\nThe gate run's level-1 all-wrong groups, steps 3-15")
    share = f" ({f['wrong_with_success'] / n:.1%})" if n else ""
    print(
        f"  {n} groups of {f['wrong_prompts']} prompts; their prompt solves at least once in 64 at the nearest "
        f"checkpoint: {f['wrong_with_success']}{share}"
    )
    print("\nCarry/borrow (two-sided, 0.05)")
    for level, r in f["carry"].items():
        head = (
            f"  level {level} ({' + '.join(r['sets'])}): without {r['without']} mean {r['mean_without']:.3f}, "
            f"with {r['with']} mean {r['mean_with']:.3f}"
        )
        if "ci" not in r:
            print(head + ": too few to compare")
            continue
        print(
            f"{head}; difference {r['difference']:+.3f} (Welch 95% [{r['ci'][0]:+.3f}, {r['ci'][1]:+.3f}], "
            f"p {r['welch_p']:.2g}); Mann-Whitney p {r['mann_whitney_p']:.2g}"
        )
    t = f["fisher_table"]
    print(
        f"  the pool's level-1 prompts: never solved in 3 x 64: {t[0][0]} with, {t[0][1]} without; solved: {t[1][0]}"
        f" with, {t[1][1]} without; Fisher's exact p {f['fisher_p']:.2g} (odds ratio {f['fisher_odds']:.2f})"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="the census folder (docs/census)")
    print_census(census(parser.parse_args(argv).folder))
    return 0


if __name__ == "__main__":
    sys.exit(main())
