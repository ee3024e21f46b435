"""Where CoBA-RL's budgets concentrate, by prompts per step, group size and cap: the allocation alone, no training.

    .venv/bin/python scripts/allocation_regime.py                                   # the demo's estimates, coba
    .venv/bin/python scripts/allocation_regime.py --prompts 16,64,256 --group-size 8,16 --max-budget 32,128
    .venv/bin/python scripts/allocation_regime.py --kept docs/compare-explore --strategy coba --json

The pass-rate estimates are drawn from what a comparison's arm allocated on (``--kept``'s
``budget_by_pass_rate.parquet``: the share of seen prompts estimated at 0, at 1 and in each interior bin,
uniform within a bin) and the Beta shape from its steps table (``alloc_alpha``, ``alloc_beta`` of a step with
estimates, one step drawn per batch). Each batch of M prompts is allocated by CoBA-RL (paper mode, adaptive tau)
with B_total = M * G, and by uniform GRPO. Printed per (M, G, B_up, B_low), as means over ``--draws`` batches:

- ``budget_neff``: (sum B)^2 / sum B^2 over the batch, divided by M (1 = uniform, 1/M = one prompt takes all);
- ``update_neff``: the effective number of prompts of the update, (sum w)^2 / sum w^2, with w = B * P(the group
  is mixed), the expected gradient weight of a prompt under the token-mean loss, taking the estimate as the true
  pass rate (a prompt estimated at 0 or 1 weighs 0); ``uniform_update_neff`` is the same for uniform GRPO;
- ``to_0_or_1``: the share of the rollouts given to prompts estimated at 0 or 1; ``at_cap``: the share of prompts
  at B_up.

The point (docs/results.md, "Stage 2"): CoBA-RL gives a fixed share of the batch most of the budget, so what a
step's update rests on grows with M; at 16 prompts a step it is a handful of prompts.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from coba_tasks.commands.compare_tables import INTERIOR_PASS_RATE_BINS as INTERIOR_BINS
from coba_tasks.core.allocation import plan_allocation
from coba_tasks.core.values import effective_number
from coba_tasks.core.values import mixed_group_probability as mixed_probability


def estimate_sampler(kept: Path, strategy: str):
    """(draw(rng, m) -> m pass-rate estimates, [(alpha, beta), ...]) measured on ``strategy``'s runs in ``kept``."""
    bins = pd.read_parquet(kept / "budget_by_pass_rate.parquet")
    steps = pd.read_parquet(kept / "steps.parquet")
    if strategy not in set(bins["strategy"]):
        known = ", ".join(sorted(set(bins["strategy"])))
        raise ValueError(f"{kept} has no runs of strategy {strategy!r}; it has {known}")
    counts = bins[(bins["strategy"] == strategy) & (bins["pass_rate_bin"] != "unseen")]
    counts = counts.groupby("pass_rate_bin")["prompts"].sum()
    unknown = set(counts.index) - {"0", "1", *INTERIOR_BINS}
    if unknown:
        raise ValueError(f"{kept}/budget_by_pass_rate.parquet has bins this script does not know: {sorted(unknown)}")
    labels = list(counts.index)
    probs = counts.to_numpy(dtype=np.float64) / counts.sum()
    shapes = steps[(steps["strategy"] == strategy) & (steps["estimated"] > 0)][["alloc_alpha", "alloc_beta"]]
    if shapes.empty:
        raise ValueError(f"{kept}/steps.parquet has no step of {strategy!r} that allocated on estimates")

    def draw(rng: np.random.Generator, m: int) -> np.ndarray:
        picked = rng.choice(len(labels), size=m, p=probs)
        p = np.empty(m)
        for i, j in enumerate(picked):
            label = labels[j]
            p[i] = float(label) if label in ("0", "1") else rng.uniform(*INTERIOR_BINS[label])
        return p

    return draw, [tuple(map(float, row)) for row in shapes.to_numpy()]


def regime_rows(
    draw,
    shapes: list[tuple[float, float]],
    prompts: list[int],
    group_sizes: list[int],
    max_budgets: list[int],
    min_budgets: list[int],
    draws: int,
    seed: int,
) -> list[dict[str, float]]:
    """One row per (M, G, B_up, B_low): the means over ``draws`` batches described in the module docstring."""
    rows = []
    for m in prompts:
        for g in group_sizes:
            for cap in max_budgets:
                for floor in min_budgets:
                    if not floor <= g <= cap:
                        continue
                    rng = np.random.default_rng(seed)
                    cells = []
                    for _ in range(draws):
                        p = draw(rng, m)
                        alpha, beta = shapes[rng.integers(len(shapes))]
                        plan = plan_allocation(
                            p, m * g, strategy="coba", min_budget=floor, max_budget=cap, alpha=alpha, beta=beta
                        )
                        b = plan.budgets.astype(np.float64)
                        uniform = np.full(m, float(g))
                        extreme = (p == 0.0) | (p == 1.0)
                        cells.append(
                            (
                                effective_number(b) / m,
                                effective_number(b * mixed_probability(b, p)),
                                effective_number(uniform * mixed_probability(uniform, p)),
                                float(b[extreme].sum() / b.sum()),
                                float(np.mean(b == cap)),
                            )
                        )
                    means = np.mean(cells, axis=0)
                    rows.append(
                        {
                            "prompts": m,
                            "group_size": g,
                            "max_budget": cap,
                            "min_budget": floor,
                            "budget_neff": float(means[0]),
                            "update_neff": float(means[1]),
                            "uniform_update_neff": float(means[2]),
                            "to_0_or_1": float(means[3]),
                            "at_cap": float(means[4]),
                        }
                    )
    return rows


def format_rows(rows: list[dict[str, float]]) -> str:
    head = "  M   G  B_up B_low  budget_neff/M  update_neff  uniform's  to_0_or_1  at_cap"
    lines = [head]
    for r in rows:
        lines.append(
            f"{r['prompts']:>4} {r['group_size']:>3} {r['max_budget']:>5} {r['min_budget']:>5}"
            f"  {r['budget_neff']:>13.2f}  {r['update_neff']:>11.1f}  {r['uniform_update_neff']:>9.1f}"
            f"  {r['to_0_or_1']:>9.2f}  {r['at_cap']:>6.2f}"
        )
    return "\n".join(lines)


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, e.g. 16,64; got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, e.g. 16,64; got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--kept", type=Path, default=Path("docs/compare-explore"), help="a comparison's tables")
    parser.add_argument("--strategy", default="coba", help="whose estimates and Beta shapes to draw (default coba)")
    parser.add_argument("--prompts", type=_int_list, default=[16, 64, 256], help="M, prompts per step")
    parser.add_argument("--group-size", type=_int_list, default=[8, 16], help="G: B_total = M * G")
    parser.add_argument("--max-budget", type=_int_list, default=[32, 128], help="B_up")
    parser.add_argument("--min-budget", type=_int_list, default=[2, 4], help="B_low")
    parser.add_argument("--draws", type=int, default=200, help="batches per row (default 200)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON lines")
    args = parser.parse_args(argv)
    if args.draws < 1:
        parser.error("--draws must be at least 1")
    for name in ("budget_by_pass_rate.parquet", "steps.parquet"):
        if not (args.kept / name).is_file():
            parser.error(f"{args.kept / name} does not exist; point --kept at a `coba compare` output directory")
    try:
        draw, shapes = estimate_sampler(args.kept, args.strategy)
    except ValueError as err:
        parser.error(str(err))
    rows = regime_rows(
        draw, shapes, args.prompts, args.group_size, args.max_budget, args.min_budget, args.draws, args.seed
    )
    if args.json:
        print("\n".join(json.dumps(r) for r in rows))
    else:
        print(format_rows(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
