"""`coba compare`: uniform GRPO vs Knapsack-RL vs CoBA-RL (and its ablations) on the same budget.

Every (strategy, seed) pair is one ordinary training run in ``<out>/<strategy>-seed<k>/`` made from
the same config: the same starting model, data, rollouts per step (B_total = M * G), number of
steps and seeds; only the allocation differs. Runs go seed by seed (every strategy on seed 0, then on
seed 1, ...), so a comparison stopped part-way holds complete pairs. A run that finished is kept, a
run that stopped is resumed (its done stages are not recomputed), so ``coba compare`` continues where
it stopped; ``--kept DIR`` names the tables of an earlier sitting (in another checkout, say), whose
finished runs are not trained again when their config hash matches. Each run trains in a process of
its own, so a finished run's memory goes back to the system. Held-out accuracy is measured as avg@k
at temperature 1 and greedily every ``eval_every`` steps.

Then the runs are read back into tables in ``<out>/`` (``coba_tasks.commands.compare_tables`` lists
them): runs, results (accuracy against steps and rollouts spent), steps (the schedule and the share
of rollouts with a non-zero advantage), budgets by level and by pass-rate estimate, class transitions,
``final.json`` (gain per strategy, the paired difference to uniform GRPO with its 95 % interval and
the smallest difference the design detects, where the rollouts went) and ``compare.png``.

    coba compare --strategies uniform,knapsack,coba --seeds 3 --steps 24
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pandas as pd

from coba_tasks.commands.args import Command, option
from coba_tasks.commands.console import VERBOSE_OPTION

# strategy name -> config overrides (on top of the config file)
PRESETS: dict[str, tuple[str, ...]] = {
    "uniform": ("allocation.strategy=uniform",),
    "knapsack": ("allocation.strategy=knapsack",),
    "coba": ("allocation.strategy=coba", "allocation.mode=paper", "allocation.schedule=adaptive"),
    "coba-released": ("allocation.strategy=coba", "allocation.mode=released", "allocation.schedule=adaptive"),
    "coba-reversed": ("allocation.strategy=coba", "allocation.mode=paper", "allocation.schedule=reversed"),
    "coba-fixed": ("allocation.strategy=coba", "allocation.mode=paper", "allocation.schedule=fixed"),
}
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


def run_order(strategies: Sequence[str], seeds: int) -> list[tuple[str, int]]:
    """(strategy, seed) pairs seed by seed: every strategy on seed 0 first, so a stopped comparison is paired."""
    return [(s, k) for k in range(seeds) for s in strategies]


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
    kept: dict[tuple[str, int], str] | None = None,
    kept_from: str = "",
) -> list[Path]:
    """Train every (strategy, seed) that has not finished, here or (``kept``: (strategy, seed) -> config
    hash of an earlier sitting's finished runs) before; returns the run directories of this sitting."""
    from coba_tasks.pipeline.config import config_hash, load_config

    runs = []
    order = run_order(strategies, seeds)
    for i, (strategy, seed) in enumerate(order, start=1):
        ov = [*overrides, *run_overrides(strategy, seed, steps, eval_samples, eval_every)]
        cfg = load_config(config_path, ov)  # a bad override fails here, before any run
        if cfg.model.trust_remote_code:
            from coba_tasks.pipeline.run import allow_remote_code

            allow_remote_code()  # the user's own command asks for the model's code (the runs' processes inherit it)
        run_dir = out / f"{strategy}-seed{seed}"
        where = f"[{i}/{len(order)}] {run_dir.name}"
        if (run_dir / "summary.json").is_file():
            runs.append(run_dir)
            log(f"{where}: finished earlier, kept")
            continue
        if kept and (strategy, seed) in kept and not (run_dir / "run.json").is_file():
            if kept[(strategy, seed)] != config_hash(cfg):
                raise ValueError(
                    f"{run_dir.name} in {kept_from} was trained with another config (hash {kept[(strategy, seed)]}, "
                    f"this one {config_hash(cfg)}): use the same config and options, or another --out and no --kept"
                )
            log(f"{where}: finished in an earlier sitting, kept (its rows from {kept_from})")
            continue
        runs.append(run_dir)
        resume = (run_dir / "run.json").is_file()
        log(f"{where}: " + ("resuming where it stopped" if resume else f"training {steps} steps"))
        _train_in_own_process(config_path, ov, run_dir, resume)
        summary = json.loads((run_dir / "summary.json").read_text())
        log(
            f"{where}: held-out {summary['heldout_accuracy_before']:.3f} -> "
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
# Command line
# ---------------------------------------------------------------------------------------------

EXAMPLES = [
    "coba compare --strategies uniform,knapsack,coba,coba-released --seeds 3 --steps 24",
    "coba compare --strategies coba,coba-reversed,coba-fixed --seeds 3 --steps 24 --out runs/compare",
    "coba compare --seeds 1 --steps 4 --set data.train_prompts=256 --out runs/compare-quick",
    "coba compare --out runs/compare --collect-only      # redraw tables and plot from the runs there",
    "coba compare --seeds 5 --steps 12 --out runs/compare-demo --kept docs/compare-demo   # continue a comparison",
]


def cmd_compare(args: argparse.Namespace) -> int:
    """Run (or continue) the comparison, then write its tables and plot and print the summary."""
    from coba_tasks.commands import compare_tables as ct

    strategies = parse_strategies(args.strategies)
    for name in ("seeds", "steps", "eval_samples"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    out = Path(args.out)
    kept_dir = getattr(args, "kept", None)
    kept = ct.read_tables(Path(kept_dir)) if kept_dir else {name: pd.DataFrame() for name in ct.TABLES}
    if kept_dir and kept["runs"].empty:
        raise ValueError(f"--kept {kept_dir}: no runs.parquet there (the tables of an earlier coba compare)")
    out.mkdir(parents=True, exist_ok=True)
    if not args.collect_only:
        from coba_tasks.pipeline.prefect_env import configure_prefect

        configure_prefect()
        try:
            run_all(
                out,
                strategies,
                args.seeds,
                args.steps,
                args.config,
                args.set or [],
                args.eval_samples,
                args.eval_every,
                kept=ct.finished_runs(kept),
                kept_from=str(kept_dir),
            )
        except RunFailedError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    order = run_order(strategies, args.seeds)
    tables = ct.assemble(order, ct.collect([out / f"{s}-seed{k}" for s, k in order]), kept)
    if tables["results"].empty:
        raise ValueError(f"no evaluated runs in {out} yet")
    ct.write_tables(out, tables)
    png = ct.plot(out, tables)
    done = ct.finished_only(tables)  # the statistics compare finished runs; the tables hold every run's rows
    final = ct.final_table(done["results"])
    paired = ct.paired_table(done["results"])
    mechanism = ct.mechanism_table(done)
    ct.write_final(out, final, paired, mechanism)
    print(ct.format_report(final, paired, mechanism))
    names = " ".join(f"{n}.parquet" for n in ct.TABLES)
    print(f"tables: {out}/{{{names}}} final.json; plot: {png}")
    return 0


COMMAND = Command(
    "compare",
    help="uniform vs knapsack vs CoBA-RL (and ablations) on the same rollout budget",
    description="Train one run per (strategy, seed) from the same config (same model start, data, rollouts per "
    "step, steps and seeds; only the allocation differs), seed by seed, then write the tables (runs, results, "
    "steps, budget_by_level, budget_by_pass_rate, transitions), final.json and compare.png into --out and print "
    "the gain per strategy, the paired difference to uniform with its 95 % interval and the smallest detectable "
    "difference, and where the rollouts went. Finished runs are kept (here or, with --kept, in an earlier "
    "sitting's tables) and stopped ones resumed, so the command continues where it stopped. "
    f"Strategies: {', '.join(PRESETS)} "
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
        option(
            "--kept",
            default=None,
            metavar="DIR",
            help="the tables of an earlier sitting (e.g. docs/compare-demo): its finished runs are not trained again",
        ),
        VERBOSE_OPTION,
    ],
    func=cmd_compare,
)
