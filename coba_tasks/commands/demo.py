"""The allocation demo: CoBA-RL's schedule on a simulated training run (no model, no GPU).

A batch of prompts at five difficulty levels is "trained on" by a simulated policy whose skill
grows every step. Each step: rollouts are drawn with the budgets the allocator chose (binomial
draws from each prompt's true success probability), the observed pass rates update the
``CapabilityTracker``, and the next step's budgets are allocated from them. The printout shows
the mechanism of the paper: while the failure rate is high, the Beta density peaks at easy prompts
and they get the rollouts (exploit); as the policy improves the peak moves to hard prompts
(explore). Knapsack-RL and uniform budgets on the same pass rates are shown beside it.

Run it with ``coba demo`` (or ``make demo-allocation``); ``--steps``, ``--prompts``, ``--group-size``.
The command's declaration and handler are here too (``COMMAND``, ``cmd_demo``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from coba_tasks.commands.args import Command, option, positive_int

if TYPE_CHECKING:
    import numpy as np

LEVELS = 5


@dataclass(frozen=True)
class DemoConfig:
    """Settings of the simulated run."""

    steps: int = 12
    prompts: int = 100  # M, split evenly over the difficulty levels
    group_size: int = 16  # G: B_total = M * G
    min_budget: int = 2
    max_budget: int = 128
    seed: int = 0


def _true_pass_prob(skill: float, level: np.ndarray) -> np.ndarray:
    """Success probability of one rollout: a logistic curve in (skill - difficulty)."""
    import numpy as np

    return 1.0 / (1.0 + np.exp(-(skill - 1.6 * level)))


def simulate(cfg: DemoConfig, emit: Callable[[str], None] = print) -> dict:
    """Run the simulation, print a table per step through ``emit``, return the figures."""
    import numpy as np

    from coba_tasks.core.allocation import plan_allocation
    from coba_tasks.core.capability import CapabilityTracker, beta_mode

    rng = np.random.default_rng(cfg.seed)
    level = np.arange(cfg.prompts) % LEVELS
    total = cfg.prompts * cfg.group_size
    tracker = CapabilityTracker()
    pass_rates = np.full(cfg.prompts, np.nan)  # unseen before the first visit
    bounds = {"min_budget": cfg.min_budget, "max_budget": cfg.max_budget}
    rows = []
    emit(
        f"CoBA-RL allocation demo: M = {cfg.prompts} prompts at {LEVELS} difficulty levels, "
        f"B_total = {total} rollouts per step, bounds [{cfg.min_budget}, {cfg.max_budget}]"
    )
    emit("Each step: roll out with the chosen budgets, verify, update F -> (alpha, beta), allocate the next step.")
    emit("")
    header = f"{'step':>4} {'F':>5} {'alpha':>6} {'beta':>6} {'mode':>5} {'tau':>5}  mean CoBA budget by level 0..4"
    emit(header + "    knapsack by level 0..4")
    for step in range(cfg.steps):
        skill = -0.5 + 0.75 * step  # the simulated policy improves every step
        plan = plan_allocation(pass_rates, total, alpha=tracker.alpha, beta=tracker.beta, **bounds)
        knap = plan_allocation(pass_rates, total, strategy="knapsack", **bounds)
        by_level, knap_level = (
            [float(b[level == lv].mean()) for lv in range(LEVELS)] for b in (plan.budgets, knap.budgets)
        )
        successes = rng.binomial(plan.budgets, _true_pass_prob(skill, level))
        pass_rates = successes / plan.budgets
        alpha, beta = tracker.alpha, tracker.beta
        tracker.update(pass_rates)
        mode = beta_mode(alpha, beta) if alpha > 1 and beta > 1 else float("nan")
        tau = "  -  " if np.isnan(plan.tau) else f"{plan.tau:5.2f}"
        emit(
            f"{step:>4} {tracker.failure_rate:5.2f} {alpha:6.2f} {beta:6.2f} {mode:5.2f} {tau} "
            + " ".join(f"{b:6.1f}" for b in by_level)
            + "    "
            + " ".join(f"{b:5.1f}" for b in knap_level)
        )
        rows.append(
            {
                "step": step,
                "failure_rate": tracker.failure_rate,
                "alpha": alpha,
                "beta": beta,
                "budget_by_level": by_level,
                "knapsack_by_level": knap_level,
                "fallback": plan.fallback,
            }
        )
    emit("")
    emit("F: failure rate observed at the step. alpha, beta: the shape its allocation used (from the previous F);")
    emit("mode: the pass rate that shape favours. Step 0 is uniform: no prompt has a pass rate yet.")
    emit("Early (F high): the mode is near 1 and easy prompts (level 0) get the rollouts: exploit.")
    emit("Later (F low): the mode moves towards 0 and hard prompts (level 4) get them: explore.")
    return {"steps": rows}


def cmd_demo(args: argparse.Namespace) -> int:
    """Run ``coba demo``: the simulation's table, printed."""
    simulate(DemoConfig(steps=args.steps, prompts=args.prompts, group_size=args.group_size, seed=args.seed), emit=print)
    return 0


COMMAND = Command(
    "demo",
    help="allocation demo on a simulated training run",
    description="Show CoBA-RL's budget schedule on a simulated run: how (alpha, beta) follow the failure rate "
    "and how the rollout budget moves from easy prompts (exploit) to hard ones (explore).",
    examples=["coba demo", "coba demo --steps 20 --prompts 200 --group-size 8"],
    options=[
        option("--steps", type=positive_int, default=12, help="training steps to simulate (default 12)"),
        option("--prompts", type=positive_int, default=100, help="prompts per batch, M (default 100)"),
        option("--group-size", type=positive_int, default=16, help="mean group size G; B_total = M * G"),
        option("--seed", type=int, default=0, help="random seed (default 0)"),
    ],
    func=cmd_demo,
)
