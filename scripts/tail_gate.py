"""The gate of the pre-registered test on a pool with a hard tail (docs/results.md, "Where allocation should
pay"): criteria G1-G4 on one uniform run's `coba compare` tables, each with its figure and its verdict, then
what the plan says comes next (the arms, a fallback, or the end of the study).

    .venv/bin/coba compare --config configs/demo.yaml --steps 16 --eval-every 8 --eval-samples 8 --seeds 300-300 \\
      --strategies uniform --set data.train=data/arith_chat_train_l01.parquet --set data.difficulties=[0,1] \\
      --set data.eval_prompts=0 --set data.extra_tests=[] --out runs/tail-gate300
    .venv/bin/python scripts/tail_gate.py runs/tail-gate300 --seed 300

Reads steps_by_level.parquet and results.parquet of the comparison's directory; writes nothing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import pandas as pd

# the criteria as the plan fixes them
ALIKE_SHARE = 0.40  # G1: steps 3-15, groups scored alike
LEARNABLE_SHARE = 0.15  # G2: steps 3-15, all groups that are hard-level all-wrong and mixed at another visit
HARD_PASS = 0.10  # G3: hard-level training pass rate over steps 12-15, and twice that of steps 0-2
HELD_OUT = (0.10, 0.60)  # G4: held-out hard-level avg@k at the last step, and 0.05 above step 0
HELD_OUT_GAIN = 0.05
FALLBACK_A = 0.05  # hard-level training pass rate over steps 12-15 below this: start from the demo's adapter
FALLBACK_B = 0.60  # held-out hard-level avg@k at step 8 above this: the next level instead
EXTEND_GAIN = 0.03  # uniform's held-out hard-level gain from step 8 to the last below this: run 24 steps


def gate(levels: pd.DataFrame, results: pd.DataFrame, hard: int, last: int) -> dict[str, Any]:
    """The figures and verdicts of G1-G4 for one run's ``steps_by_level`` and ``results`` rows."""

    def steps(lo: int, hi: int, level: int | None = None) -> pd.DataFrame:
        rows = levels[levels["step"].between(lo, hi)]
        return rows if level is None else rows[rows["difficulty"] == level]

    def pass_rate(rows: pd.DataFrame) -> float:  # mean over the groups of their share correct
        return float((rows["pass_rate"] * rows["groups"]).sum() / rows["groups"].sum())

    middle = steps(3, last - 1)
    alike = float(middle["alike"].sum() / middle["groups"].sum())
    learnable = float(steps(3, last - 1, hard)["wrong_learnable"].sum() / middle["groups"].sum())
    early, late = pass_rate(steps(0, 2, hard)), pass_rate(steps(last - 4, last - 1, hard))
    held = results.set_index("step")[f"accuracy_level{hard}"]
    out = {
        "G1 alike share, steps 3-15": (alike, alike >= ALIKE_SHARE),
        "G2 learnable all-wrong share, steps 3-15": (learnable, learnable >= LEARNABLE_SHARE),
        "G3 hard-level pass rate, steps 0-2 -> 12-15": (
            (early, late),
            late >= HARD_PASS and late >= 2 * early,
        ),
        "G4 held-out hard level, step 0 -> last": (
            (float(held[0]), float(held[last])),
            HELD_OUT[0] <= held[last] <= HELD_OUT[1] and held[last] >= held[0] + HELD_OUT_GAIN,
        ),
    }
    passed = all(ok for _, ok in out.values())
    if passed:
        gain = float(held[last] - held[8]) if 8 in held.index else float("nan")
        nxt = f"the gate passes; uniform's held-out hard-level gain from step 8 to {last} is {gain:.3f}: " + (
            "below 0.03, so the arms run 24 steps" if gain < EXTEND_GAIN else "the arms run as planned"
        )
    elif late < FALLBACK_A:
        nxt = "fallback (a): every arm starts from the demo-trained adapter and trains on the hard level"
    elif 8 in held.index and held[8] > FALLBACK_B:
        nxt = "fallback (b): the next level takes the hard level's place"
    else:
        nxt = (
            "no fallback fits (c): the study ends; the hard level's tail that uniform GRPO leaves all wrong is not "
            "cracked in this run (which prompts more samples would crack: a per-prompt census of pass rates)"
        )
    return {"criteria": out, "passed": passed, "next": nxt}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="the comparison's --out directory")
    parser.add_argument("--seed", type=int, default=300, help="the gate run's seed (default: %(default)s)")
    parser.add_argument("--hard", type=int, default=1, help="the hard level (default: %(default)s; 2 in fallback b)")
    args = parser.parse_args(argv)
    levels = pd.read_parquet(args.out / "steps_by_level.parquet")
    results = pd.read_parquet(args.out / "results.parquet")
    mine = {"strategy": "uniform", "seed": args.seed}
    levels = levels[(levels["strategy"] == mine["strategy"]) & (levels["seed"] == mine["seed"])]
    results = results[(results["strategy"] == mine["strategy"]) & (results["seed"] == mine["seed"])]
    if levels.empty or results.empty:
        raise SystemExit(f"{args.out}: no uniform run of seed {args.seed} in its tables")
    last = int(results["step"].max())
    verdict = gate(levels, results, args.hard, last)
    for name, (figure, ok) in verdict["criteria"].items():
        shown = " -> ".join(f"{x:.3f}" for x in figure) if isinstance(figure, tuple) else f"{figure:.3f}"
        print(f"{name:<46} {shown:<16} {'pass' if ok else 'FAIL'}")
    print(verdict["next"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
