"""`coba compare`: uniform GRPO vs Knapsack-RL vs CoBA-RL (and its ablations) on the same budget.

Every (strategy, seed) pair is one ordinary training run in ``<out>/<strategy>-seed<k>/`` made from
the same config: the same starting model, data, rollouts per step (B_total = M * G), number of
steps and seeds; only the allocation differs. A run that finished is kept, a run that stopped is
resumed (its done stages are not recomputed), so ``coba compare`` continues where it stopped. Each
run trains in a process of its own, so a finished run's memory goes back to the system.
Held-out accuracy is measured as avg@k at temperature 1 and greedily every ``eval_every`` steps.

Then the runs are read back into tables in ``<out>/``:

    results.parquet      strategy, seed, step, accuracy (avg@k), accuracy_greedy, one column per level
    steps.parquet        strategy, seed, step, S, F, alpha, beta, effective gradient ratio (share of
                         groups with non-zero reward variance) and effective rollout ratio (share of
                         rollouts in such groups: the samples that carry a gradient)
    budget_by_level.parquet  strategy, seed, step, difficulty, prompts, mean and total budget
    transitions.parquet  strategy, seed, from_class, to_class, prompts: how a prompt's class (all
                         wrong / mixed / all right) changes from one visit to the next (the paper's Fig. 7)
    compare.png          accuracy per step (mean and spread over seeds), effective gradient ratio, budget by level

    coba compare --strategies uniform,knapsack,coba --seeds 3 --steps 24
"""

from __future__ import annotations

import argparse
import io
import itertools
import json
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from coba_tasks.commands.args import Command, option
from coba_tasks.commands.console import VERBOSE_OPTION
from coba_tasks.engines.fileio import atomic_write, write_parquet

# strategy name -> config overrides (on top of the config file)
PRESETS: dict[str, tuple[str, ...]] = {
    "uniform": ("allocation.strategy=uniform",),
    "knapsack": ("allocation.strategy=knapsack",),
    "coba": ("allocation.strategy=coba", "allocation.mode=paper", "allocation.schedule=adaptive"),
    "coba-released": ("allocation.strategy=coba", "allocation.mode=released", "allocation.schedule=adaptive"),
    "coba-reversed": ("allocation.strategy=coba", "allocation.mode=paper", "allocation.schedule=reversed"),
    "coba-fixed": ("allocation.strategy=coba", "allocation.mode=paper", "allocation.schedule=fixed"),
}
CLASSES = ("all_wrong", "mixed", "all_right")
Log = Callable[[str], None]


def parse_strategies(text: str) -> list[str]:
    """``"uniform,coba"`` -> ["uniform", "coba"]; unknown names are an error that lists the valid ones."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in names if s not in PRESETS]
    if bad or not names:
        raise ValueError(f"unknown strategy {', '.join(bad) or '(none)'}; choose from {', '.join(PRESETS)}")
    if len(set(names)) != len(names):
        raise ValueError(f"a strategy is listed twice: {text}")
    return names


def run_overrides(strategy: str, seed: int, steps: int, eval_samples: int, eval_every: int) -> list[str]:
    """The overrides that make run (strategy, seed) of a comparison."""
    return [
        *PRESETS[strategy],
        f"run.seed={seed}",
        f"run.steps={steps}",
        f"run.eval_every={eval_every}",
        f"run.eval_samples={eval_samples}",
        f"run.eval_temperature={1.0 if eval_samples > 1 else 0.0}",
        "run.eval_greedy=true",
        f"run.name={strategy}-seed{seed}",
    ]


def run_all(
    out: Path,
    strategies: Sequence[str],
    seeds: int,
    steps: int,
    config_path: str | None = None,
    overrides: Sequence[str] = (),
    eval_samples: int = 4,
    eval_every: int = 6,
    log: Log = print,
) -> list[Path]:
    """Train every (strategy, seed) that has not finished; returns the run directories."""
    from coba_tasks.pipeline.config import load_config

    runs = []
    total = len(strategies) * seeds
    for i, (strategy, seed) in enumerate(((s, k) for s in strategies for k in range(seeds)), start=1):
        ov = [*overrides, *run_overrides(strategy, seed, steps, eval_samples, eval_every)]
        if load_config(config_path, ov).model.trust_remote_code:  # a bad override fails here, before any run
            from coba_tasks.pipeline.run import allow_remote_code

            allow_remote_code()  # the user's own command asks for the model's code (the runs' processes inherit it)
        run_dir = out / f"{strategy}-seed{seed}"
        runs.append(run_dir)
        if (run_dir / "summary.json").is_file():
            log(f"[{i}/{total}] {run_dir.name}: finished earlier, kept")
            continue
        resume = (run_dir / "run.json").is_file()
        log(f"[{i}/{total}] {run_dir.name}: " + ("resuming where it stopped" if resume else f"training {steps} steps"))
        _train_in_own_process(config_path, ov, run_dir, resume)
        summary = json.loads((run_dir / "summary.json").read_text())
        log(
            f"[{i}/{total}] {run_dir.name}: held-out {summary['heldout_accuracy_before']:.3f} -> "
            f"{summary['heldout_accuracy_after']:.3f} (greedy {summary['heldout_greedy_before']:.3f} -> "
            f"{summary['heldout_greedy_after']:.3f}), {summary['wall_seconds']:.0f} s"
        )
    return runs


class RunFailedError(RuntimeError):
    """A run of the comparison ended without finishing (its process exited with an error or was killed)."""


def _train_one(config_path: str | None, overrides: list[str], run_dir: str, resume: bool) -> None:
    """The training flow of one run of the comparison (the target of its own process)."""
    from flows.train import train_flow

    if resume:
        train_flow(run_dir=run_dir, resume=True)
    else:
        train_flow(config_path=config_path, overrides=overrides, run_dir=run_dir)


def _train_in_own_process(config_path: str | None, overrides: list[str], run_dir: Path, resume: bool) -> None:
    """Train one run in a spawned process and wait for it.

    A process per run gives the memory of a finished run (an in-process vLLM engine, the model and its
    optimizer state) back to the system: in one process, a SmolLM2 comparison grew by about 3 GB a run
    (8.2 GB at the start of the fourth run, 12.2 GB during it) until the kernel killed it. A run that
    dies stops the comparison with its name; running the command again resumes it.
    """
    import multiprocessing

    proc = multiprocessing.get_context("spawn").Process(
        target=_train_one, args=(config_path, list(overrides), str(run_dir), resume), name=f"coba-{run_dir.name}"
    )
    proc.start()
    try:
        proc.join()
    except BaseException:  # Ctrl+C: the child got the signal too; do not leave it behind
        proc.join(30)
        if proc.is_alive():
            proc.kill()
        raise
    if proc.exitcode != 0 or not (run_dir / "summary.json").is_file():
        raise RunFailedError(
            f"run {run_dir} did not finish (its process exited with {proc.exitcode}); its output is above. "
            "Run the same coba compare command again to resume it."
        )


# ---------------------------------------------------------------------------------------------
# Reading the runs back
# ---------------------------------------------------------------------------------------------


def _allocation_beta(t: Any, step: int) -> dict[str, float]:
    """``alloc_alpha``, ``alloc_beta``: the Beta parameters in the step's budget table, NaN when absent."""
    from coba_tasks.pipeline.store import Stage

    if Stage.BUDGET in t.done[step]:
        b = t.table(step, Stage.BUDGET)
        if {"alpha", "beta"} <= set(b.columns) and len(b):
            return {"alloc_alpha": float(b["alpha"].iloc[0]), "alloc_beta": float(b["beta"].iloc[0])}
    return {"alloc_alpha": math.nan, "alloc_beta": math.nan}


def _class_of(rate: float) -> str:
    return "all_wrong" if rate == 0.0 else ("all_right" if rate == 1.0 else "mixed")


def collect(run_dirs: Sequence[Path]) -> dict[str, pd.DataFrame]:
    """The comparison's tables (see the module docstring) from finished or partial runs."""
    from coba_tasks.pipeline import stages
    from coba_tasks.pipeline.store import Stage, Table
    from coba_tasks.pipeline.summary import eval_figures, load_run

    results, steps_rows, budget_rows, transitions = [], [], [], []
    for run_dir in run_dirs:
        if not (run_dir / "run.json").is_file():
            continue
        t = load_run(run_dir)
        planned = t.config_value("run", "steps")
        strategy, seed = run_dir.name.rsplit("-seed", 1)
        key = {"strategy": strategy, "seed": int(seed)}
        prompts = t.prompts()
        level = (
            prompts.set_index("prompt_id")["difficulty"] if prompts is not None and "difficulty" in prompts else None
        )
        visits: dict[str, list[tuple[int, float]]] = {}
        for step in t.steps:
            done = t.done[step]
            if Table.EVAL in done:
                ev = eval_figures(t.table(step, Table.EVAL))
                row = {**key, "step": step, "accuracy": ev["accuracy"], "accuracy_greedy": ev["greedy"]}
                row |= {"answered": ev["answered"], "boxed": ev["boxed"]}
                for lv, acc in ev["by_difficulty"].items():
                    row[f"accuracy_level{lv}"] = acc
                results.append(row)
            if Stage.CAPABILITY in done and Stage.REWARDS in done:
                cap = t.table(step, Stage.CAPABILITY).iloc[0]
                rewards = t.table(step, Stage.REWARDS)
                rates = stages.pass_rates(rewards)
                sizes = rewards.groupby("prompt_id").size()
                mixed = ((rates > 0) & (rates < 1)).reindex(sizes.index)
                steps_rows.append(
                    {
                        **key,
                        "step": step,
                        **{k: float(cap[k]) for k in ("S", "F", "alpha_used", "beta_used", "alpha", "beta")},
                        # the Beta parameters the step's budgets were allocated with (fixed and reversed
                        # schedules differ from the tracker's alpha, beta); NaN for strategies without them
                        **_allocation_beta(t, step),
                        "effective_gradient_ratio": 1.0 - float(cap["zero_variance_groups"]),
                        # share of the step's rollouts in groups with non-zero reward variance (non-zero advantage)
                        "effective_rollout_ratio": float(sizes[mixed].sum() / sizes.sum()),
                    }
                )
                for pid, rate in rates.items():
                    visits.setdefault(pid, []).append((step, float(rate)))
            if step < planned and Stage.BUDGET in done and level is not None:
                b = t.table(step, Stage.BUDGET)
                b = b.assign(difficulty=level.reindex(b["prompt_id"]).to_numpy())
                for lv, grp in b.groupby("difficulty"):
                    budget_rows.append(
                        {
                            **key,
                            "step": step,
                            "difficulty": int(lv),
                            "prompts": len(grp),
                            "mean_budget": float(grp["budget"].mean()),
                            "total_budget": int(grp["budget"].sum()),
                        }
                    )
        counts: dict[tuple[str, str], int] = {}
        for seq in visits.values():
            seq.sort()
            for (_, a), (_, b) in itertools.pairwise(seq):
                pair = (_class_of(a), _class_of(b))
                counts[pair] = counts.get(pair, 0) + 1
        for a in CLASSES:
            for b in CLASSES:
                transitions.append({**key, "from_class": a, "to_class": b, "prompts": counts.get((a, b), 0)})
    return {
        "results": pd.DataFrame(results),
        "steps": pd.DataFrame(steps_rows),
        "budget_by_level": pd.DataFrame(budget_rows),
        "transitions": pd.DataFrame(transitions),
    }


def final_table(results: pd.DataFrame) -> pd.DataFrame:
    """Per strategy: held-out accuracy before and after (mean and std over seeds) and the gain."""
    if results.empty:
        return pd.DataFrame()
    rows = []
    for strategy, grp in results.groupby("strategy", sort=False):
        first = grp[grp["step"] == grp["step"].min()].set_index("seed")
        last = grp[grp["step"] == grp["step"].max()].set_index("seed")
        row: dict[str, Any] = {"strategy": strategy, "seeds": len(last), "step": int(grp["step"].max())}
        for col, name in (("accuracy", "avg"), ("accuracy_greedy", "greedy")):
            gain = (last[col] - first[col].reindex(last.index)).to_numpy()
            row[f"{name}_before"] = float(first[col].mean())
            row[f"{name}_after"] = float(last[col].mean())
            row[f"{name}_after_std"] = float(last[col].std(ddof=1)) if len(last) > 1 else math.nan
            row[f"{name}_gain"] = float(np.mean(gain))
            row[f"{name}_gain_std"] = float(np.std(gain, ddof=1)) if len(gain) > 1 else math.nan
        rows.append(row)
    return pd.DataFrame(rows)


def write_tables(out: Path, tables: dict[str, pd.DataFrame]) -> None:
    """Each table as ``<out>/<name>.parquet`` (atomic)."""
    for name, df in tables.items():
        write_parquet(df, out / f"{name}.parquet")


def plot(out: Path, tables: dict[str, pd.DataFrame]) -> Path:
    """compare.png: avg@k and greedy accuracy per step, the share of rollouts with reward variance, budget by
    level, the capability schedule (alpha, beta) and the answer-format rates per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results, steps, budget = tables["results"], tables["steps"], tables["budget_by_level"]
    fig, axes = plt.subplots(3, 2, figsize=(13, 13.5))
    strategies = list(dict.fromkeys(results["strategy"])) if not results.empty else []
    colors = {s: plt.cm.tab10(i % 10) for i, s in enumerate(strategies)}
    for ax, col, title in (
        (axes[0, 0], "accuracy", "held-out accuracy, avg@k at temperature 1"),
        (axes[0, 1], "accuracy_greedy", "held-out accuracy, greedy"),
    ):
        for s in strategies:
            g = results[results["strategy"] == s].groupby("step")[col]
            mean, std = g.mean(), g.std(ddof=1).fillna(0.0)
            ax.plot(mean.index, mean.to_numpy(), marker="o", color=colors[s], label=s)
            ax.fill_between(mean.index, (mean - std).to_numpy(), (mean + std).to_numpy(), color=colors[s], alpha=0.15)
        ax.set(title=title, xlabel="step", ylabel="accuracy (mean +- std over seeds)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax = axes[1, 0]
    for s in strategies:
        g = steps[steps["strategy"] == s].groupby("step")[["effective_rollout_ratio", "effective_gradient_ratio"]]
        g = g.mean()
        ax.plot(g.index, g["effective_rollout_ratio"].to_numpy(), color=colors[s], label=f"{s}: rollouts")
        ax.plot(g.index, g["effective_gradient_ratio"].to_numpy(), color=colors[s], ls=":", label=f"{s}: groups")
    ax.set(
        title="share with non-zero reward variance: rollouts (solid), groups (dotted)", xlabel="step", ylim=(0, 1.02)
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax = axes[1, 1]
    if not budget.empty:
        share = budget.groupby(["strategy", "difficulty"])["total_budget"].sum().unstack("difficulty").fillna(0)
        share = share.div(share.sum(axis=1), axis=0).reindex([s for s in strategies if s in share.index])
        left = np.zeros(len(share))
        for j, lv in enumerate(share.columns):
            ax.barh(
                share.index,
                share[lv],
                left=left,
                color=plt.cm.viridis(j / max(1, len(share.columns) - 1)),
                label=f"level {lv}",
            )
            left += share[lv].to_numpy()
        ax.set(title="share of rollouts by difficulty level (all steps)", xlim=(0, 1))
        ax.legend(fontsize=8, ncols=len(share.columns), loc="lower center", bbox_to_anchor=(0.5, -0.25))
    ax = axes[2, 0]
    for s in strategies:
        g = steps[steps["strategy"] == s].groupby("step")[["alloc_alpha", "alloc_beta"]].mean()
        ax.plot(g.index, g["alloc_alpha"].to_numpy(), color=colors[s], label=f"{s}: alpha")
        ax.plot(g.index, g["alloc_beta"].to_numpy(), color=colors[s], ls="--", label=f"{s}: beta")
    ax.set(title="Beta(alpha, beta) the budgets were allocated with: alpha (solid), beta (dashed)", xlabel="step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncols=2)
    ax = axes[2, 1]
    for s in strategies:
        g = results[results["strategy"] == s].groupby("step")
        for col, ls, what in (("boxed", "-", "\\boxed{} answers"), ("answered", ":", "an answer at all")):
            if col in results and results[col].notna().any():
                ax.plot(g[col].mean().index, g[col].mean().to_numpy(), color=colors[s], ls=ls, label=f"{s}: {what}")
    ax.set(title="held-out completions with \\boxed{} (solid), with any answer (dotted)", xlabel="step", ylim=(0, 1.02))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    path = out / "compare.png"
    atomic_write(path, lambda f: f.write(buf.getvalue()))
    return path


def format_final(final: pd.DataFrame) -> str:
    """The per-strategy table as text."""
    if final.empty:
        return "no finished evaluations yet"
    lines = [
        f"{'strategy':<15} {'seeds':>5}  {'avg@k before -> after (std)':<30} {'gain (std)':<18} "
        f"{'greedy before -> after (std)':<30} {'gain (std)':<18}"
    ]
    for r in final.itertuples():
        lines.append(
            f"{r.strategy:<15} {r.seeds:>5}  {r.avg_before:.3f} -> {r.avg_after:.3f} ({r.avg_after_std:.3f})"
            f"{'':<7} {r.avg_gain:+.3f} ({r.avg_gain_std:.3f}){'':<3} "
            f"{r.greedy_before:.3f} -> {r.greedy_after:.3f} ({r.greedy_after_std:.3f}){'':<7} "
            f"{r.greedy_gain:+.3f} ({r.greedy_gain_std:.3f})"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

EXAMPLES = [
    "coba compare --strategies uniform,knapsack,coba,coba-released --seeds 3 --steps 24",
    "coba compare --strategies coba,coba-reversed,coba-fixed --seeds 3 --steps 24 --out runs/compare",
    "coba compare --seeds 1 --steps 4 --set data.train_prompts=256 --out runs/compare-quick",
    "coba compare --out runs/compare --collect-only      # redraw tables and plot from the runs there",
]


def cmd_compare(args: argparse.Namespace) -> int:
    """Run (or continue) the comparison, then write its tables and plot and print the summary."""
    strategies = parse_strategies(args.strategies)
    for name in ("seeds", "steps", "eval_samples"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.collect_only:
        from coba_tasks.pipeline.prefect_env import configure_prefect

        configure_prefect()
        try:
            run_all(
                out, strategies, args.seeds, args.steps, args.config, args.set or [], args.eval_samples, args.eval_every
            )
        except RunFailedError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    run_dirs = [out / f"{s}-seed{k}" for s in strategies for k in range(args.seeds)]
    tables = collect(run_dirs)
    if tables["results"].empty:
        raise ValueError(f"no evaluated runs in {out} yet")
    write_tables(out, tables)
    png = plot(out, tables)
    final = final_table(tables["results"])
    text = json.dumps(final.to_dict("records"), indent=2)
    atomic_write(out / "final.json", lambda f: f.write(text.encode()))
    print(format_final(final))
    cols = ["effective_rollout_ratio", "effective_gradient_ratio"]
    eff = tables["steps"].groupby("strategy", sort=False)[cols].mean()
    print(
        "share of rollouts / groups with non-zero reward variance (mean over steps): "
        + "  ".join(
            f"{k} {r.effective_rollout_ratio:.3f} / {r.effective_gradient_ratio:.3f}" for k, r in eff.iterrows()
        )
    )
    print(f"tables: {out}/results.parquet steps.parquet budget_by_level.parquet transitions.parquet; plot: {png}")
    return 0


COMMAND = Command(
    "compare",
    help="uniform vs knapsack vs CoBA-RL (and ablations) on the same rollout budget",
    description="Train one run per (strategy, seed) from the same config (same model start, data, rollouts per "
    "step, steps and seeds; only the allocation differs), then write results.parquet, steps.parquet, "
    "budget_by_level.parquet, transitions.parquet and compare.png into --out. Finished runs are kept and stopped "
    f"ones resumed, so the command continues where it stopped. Strategies: {', '.join(PRESETS)} "
    "(coba-reversed: explore then exploit; coba-fixed: allocation.fixed_alpha/fixed_beta at every step).",
    examples=EXAMPLES,
    options=[
        option("--config", default=None, help="YAML config (default configs/demo.yaml)"),
        option("--strategies", default="uniform,knapsack,coba,coba-released", help="comma-separated"),
        option("--seeds", type=int, default=3, help="seeds 0..N-1 per strategy (default 3)"),
        option("--steps", type=int, default=24, help="training steps per run (default 24)"),
        option("--eval-samples", type=int, default=4, help="k of avg@k at temperature 1 (default 4)"),
        option("--eval-every", type=int, default=6, help="evaluate every N steps (default 6)"),
        option("--out", default="runs/compare", help="directory of the runs and tables (default runs/compare)"),
        option("--set", action="append", metavar="KEY=VALUE", help="override a config value for every run"),
        option("--collect-only", action="store_true", help="do not train: tables and plot from the runs in --out"),
        VERBOSE_OPTION,
    ],
    func=cmd_compare,
)
