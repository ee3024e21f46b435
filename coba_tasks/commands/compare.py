"""`coba compare`: uniform GRPO vs Knapsack-RL vs CoBA-RL (and its ablations) on the same budget.

Every (strategy, seed) pair is one ordinary training run in ``<out>/<strategy>-seed<k>/`` made from
the same config: the same starting model, data, rollouts per step (B_total = M * G), number of
steps and seeds; only the allocation differs. Runs go seed by seed (every strategy on seed 0, then on
seed 1, ...), so a comparison stopped part-way holds complete pairs. A run that finished is kept, a
run that stopped is resumed (its done stages are not recomputed), so ``coba compare`` continues where
it stopped; ``--kept DIR`` names the tables of an earlier sitting (in another checkout, say), whose
finished runs are not trained again. ``--out``'s own tables count as an earlier sitting's too: the rows
of their finished runs that have no directory there, or that this command does not list, stay in the
tables. A run or row is kept or resumed only when the config hash it was made with is the one this
command gives that run; another config is refused in one line before anything trains (a resumed run
goes on with the config it started with, so it would mix two configs). Each run trains in a process of
its own, so a finished run's memory goes back to the system. Held-out accuracy is measured as avg@k
at temperature 1 and greedily every ``eval_every`` steps. Within a seed the runs are one run until the
first allocation that differs: the first run trains those steps once and forks the others from it
(``coba_tasks.commands.compare_fork``; bit for bit what training them from their start gives), unless
``--no-fork``.

Then the runs are read back into the tables, ``final.json`` and ``compare.png`` in ``<out>/``
(``coba_tasks.readers.comparison`` lists and computes them).

    coba compare --strategies uniform,knapsack,coba --seeds 3 --steps 24
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from coba_tasks.commands.args import Command, option
from coba_tasks.commands.console import VERBOSE_OPTION

if TYPE_CHECKING:
    import pandas as pd

    from coba_tasks.pipeline.config import Config

# strategy name -> config overrides (on top of the config file)
PRESETS: dict[str, tuple[str, ...]] = {
    "uniform": ("allocation.strategy=uniform",),
    "knapsack": ("allocation.strategy=knapsack",),
    "coba": ("allocation.strategy=coba", "allocation.mode=paper", "allocation.schedule=adaptive"),
    "coba-released": ("allocation.strategy=coba", "allocation.mode=released", "allocation.schedule=adaptive"),
    "coba-reversed": ("allocation.strategy=coba", "allocation.mode=paper", "allocation.schedule=reversed"),
    "coba-fixed": ("allocation.strategy=coba", "allocation.mode=paper", "allocation.schedule=fixed"),
    # what practitioners run against groups that score alike, each sampling a step in rounds (docs/method.md,
    # sections 20-21): their rollouts generated per step vary
    "dynamic": ("allocation.strategy=dynamic",),
    "ada": ("allocation.strategy=ada",),
}
# CoBA-RL (paper mode, adaptive schedule) with one mechanism changed: a lower cap, a higher floor, equal prompt
# weights in the loss, the decayed posterior or the pilot wave as the estimate (docs/method.md sections 2, 15)
_COBA = PRESETS["coba"]
PRESETS |= {
    "coba-cap16": (*_COBA, "allocation.max_budget=16"),
    "coba-min4": (*_COBA, "allocation.min_budget=4"),
    "coba-equal": (*_COBA, "optim.prompt_weighting=equal"),
    "coba-posterior": (*_COBA, "allocation.estimator=posterior"),
    "coba-pilot": (*_COBA, "allocation.estimator=pilot"),
}
# the combination docs/results.md's rule chose from the mechanisms of the exploration's seeds 0-1: the pilot's
# estimates had the lower error, equal weights and the cap of 16 the higher N_eff than coba's
PRESETS["coba-pilot-equal-cap16"] = (*PRESETS["coba-pilot"], "optim.prompt_weighting=equal", "allocation.max_budget=16")
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


FLAG_KEYS = {  # run keys a comparison sets from its own options: a --set of one is refused, naming the option
    "run.seed": "--seeds",
    "run.steps": "--steps",
    "run.eval_every": "--eval-every",
    "run.eval_samples": "--eval-samples",
    "run.eval_temperature": "--eval-samples (1: greedy; more: temperature 1)",
    "run.name": "--strategies and --seeds (each run is named STRATEGY-seedN)",
}
COMPARE_DEFAULTS = ["run.eval_greedy=true"]  # a comparison's defaults: the user's --set may change them


def check_overrides(overrides: Sequence[str]) -> None:
    """ValueError (one line) for a ``--set`` of a key the comparison sets from its own options: it would be
    overridden without a word.

    >>> check_overrides(["run.eval_greedy=false", "optim.lr=1e-4"])
    >>> check_overrides(["run.steps=5"])
    Traceback (most recent call last):
    ...
    ValueError: --set run.steps=5: coba compare sets run.steps from --steps; give that instead
    """
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        if key in FLAG_KEYS:
            raise ValueError(f"--set {item}: coba compare sets {key} from {FLAG_KEYS[key]}; give that instead")


def run_overrides(strategy: str, seed: int, steps: int, eval_samples: int, eval_every: int) -> list[str]:
    """The overrides that make run (strategy, seed) of a comparison (after ``COMPARE_DEFAULTS`` and the user's)."""
    return [
        *PRESETS[strategy],
        f"run.seed={seed}",
        f"run.steps={steps}",
        f"run.eval_every={eval_every}",
        f"run.eval_samples={eval_samples}",
        f"run.eval_temperature={1.0 if eval_samples > 1 else 0.0}",
        f"run.name={strategy}-seed{seed}",
    ]


def parse_seeds(text: str) -> list[int]:
    """``--seeds``: ``"3"`` -> [0, 1, 2]; ``"100-104"`` -> [100, ..., 104]; ``"0,7,9"`` -> [0, 7, 9]."""
    try:
        if "," in text:
            seeds = [int(part) for part in text.split(",") if part.strip()]
        elif "-" in text.strip().lstrip("-"):
            first, last = (int(part) for part in text.strip().split("-", 1))
            seeds = list(range(first, last + 1))
        else:
            seeds = list(range(int(text)))
    except ValueError:
        seeds = []
    if not seeds or min(seeds) < 0 or len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds {text!r}: give N (seeds 0..N-1, N >= 1), A-B (A <= B) or a list like 0,7,9")
    return seeds


def run_order(strategies: Sequence[str], seeds: int | Sequence[int]) -> list[tuple[str, int]]:
    """(strategy, seed) pairs seed by seed: every strategy on the first seed first, so a stopped comparison is
    paired. ``seeds``: N (0..N-1) or the seeds themselves."""
    return [(s, k) for k in (range(seeds) if isinstance(seeds, int) else seeds) for s in strategies]


class Earlier(NamedTuple):
    """A finished run of an earlier sitting, whose rows the tables keep when it has no directory here."""

    config_hash: str
    where: str  # the tables that hold its rows
    rows: int  # how many rows they hold of it
    fix: str  # the way out a refusal of its config names


def earlier_runs(
    out: Path, own: dict[str, pd.DataFrame], kept_dir: str | None, kept: dict[str, pd.DataFrame]
) -> dict[tuple[str, int], Earlier]:
    """(strategy, seed) -> ``Earlier`` for the finished runs in ``--out``'s own tables (this sitting rewrites
    them, so a row it left out would be lost) and then in ``--kept``'s."""
    from coba_tasks.readers import comparison as ct

    runs: dict[tuple[str, int], Earlier] = {}
    for tables, where, fix in ((own, out, "another --out"), (kept, kept_dir, "another --out and no --kept")):
        for key, digest in ct.finished_runs(tables).items():
            runs.setdefault(key, Earlier(digest, f"the tables in {where}", ct.run_rows(tables, key), fix))
    return runs


def plan_runs(
    runs: Sequence[tuple[str, int]],
    steps: int,
    config_path: str | None,
    overrides: Sequence[str],
    eval_samples: int,
    eval_every: int,
) -> dict[tuple[str, int], tuple[list[str], Config]]:
    """(strategy, seed) -> the run's overrides and the config they give it, for the runs of a strategy this
    version has; a bad override fails here, before any run."""
    from coba_tasks.pipeline.config import load_config

    check_overrides(overrides)
    planned = {}
    for strategy, seed in runs:
        if strategy in PRESETS:
            ov = [*COMPARE_DEFAULTS, *overrides, *run_overrides(strategy, seed, steps, eval_samples, eval_every)]
            planned[(strategy, seed)] = (ov, load_config(config_path, ov))
    return planned


def check_configs(
    out: Path,
    runs: Sequence[tuple[str, int]],
    planned: dict[tuple[str, int], tuple[list[str], Config]],
    earlier: dict[tuple[str, int], Earlier],
    run_dirs: bool = True,
) -> None:
    """Refuse, before any run is kept, resumed or trained, a run of ``runs`` made with another config than
    the one this command gives it (``planned``): its directory in ``out`` (the config hash in its run.json;
    not with ``run_dirs`` False, for ``--collect-only``, which neither keeps nor resumes) or, when it has
    none, an earlier sitting's finished run whose rows the tables would keep. Keeping or resuming it would
    put two configs in one comparison (a resumed run goes on with the config it started with)."""
    from coba_tasks.pipeline.config import config_hash
    from coba_tasks.pipeline.store import RunStore

    for strategy, seed in runs:
        name = f"{strategy}-seed{seed}"
        plan = planned.get((strategy, seed))
        ours = config_hash(plan[1]) if plan else f"none: no strategy {strategy} here"
        if (out / name / "run.json").is_file():
            theirs = RunStore.open(out / name).config_hash if run_dirs else ours
            where, fix = str(out), "another --out"
        elif (strategy, seed) in earlier:
            e = earlier[(strategy, seed)]
            theirs, where, fix = e.config_hash, f"{e.where} ({e.rows} rows of an earlier sitting)", e.fix
        else:
            continue
        if theirs != ours:
            raise ValueError(
                f"{name} in {where} was trained with another config (hash {theirs}, this one {ours}): "
                f"use the same config and options, or {fix}"
            )


def run_all(
    out: Path,
    order: Sequence[tuple[str, int]],
    planned: dict[tuple[str, int], tuple[list[str], Config]],
    steps: int,
    config_path: str | None = None,
    earlier: dict[tuple[str, int], Earlier] | None = None,
    log: Log = print,
    fork: bool = True,
) -> list[Path]:
    """Train every (strategy, seed) of ``order`` that has not finished, here or in an earlier sitting
    (``earlier``); returns the run directories of this sitting. ``check_configs`` has checked them. With
    ``fork``, the runs of a seed share the steps before their allocations part (``compare_fork``)."""
    from coba_tasks.commands import compare_fork as cf
    from coba_tasks.commands.train_cmd import allow_user_code

    runs = []
    earlier = earlier or {}
    for i, (strategy, seed) in enumerate(order, start=1):
        ov, cfg = planned[(strategy, seed)]
        allow_user_code(cfg)  # the runs' processes inherit it
        run_dir = out / f"{strategy}-seed{seed}"
        where = f"[{i}/{len(order)}] {run_dir.name}"
        if (run_dir / "summary.json").is_file():
            runs.append(run_dir)
            log(f"{where}: finished earlier, kept")
            continue
        if (strategy, seed) in earlier and not (run_dir / "run.json").is_file():
            log(f"{where}: finished in an earlier sitting, kept (its rows from {earlier[(strategy, seed)].where})")
            continue
        runs.append(run_dir)
        if fork and not (run_dir / "run.json").is_file():  # from a run of its seed trained before (or kept)
            cf.fork_from_siblings(run_dir, cfg, [out / f"{s}-seed{k}" for s, k in order if k == seed and s != strategy])
        resume = (run_dir / "run.json").is_file()
        forked = cf.fork_record(run_dir, steps) if resume else None
        doing = "resuming where it stopped" if resume else f"training {steps} steps"
        log(f"{where}: {cf.forked_text(*forked, steps) if forked else doing}")
        # the later runs of its seed that it can carry (not those kept from an earlier sitting's tables):
        # forked from it where their allocations part
        later = [key for key in order[i:] if key[1] == seed and key not in earlier]
        carried = cf.carried_runs(out, cfg, later, planned) if fork else []
        if carried:
            log(f"{where}: forks {', '.join(f'{s}-seed{k}' for s, k in carried)} from it where their allocations part")
        carry = [(str(out / f"{s}-seed{k}"), planned[(s, k)][0]) for s, k in carried]
        _train_in_own_process(config_path, ov, run_dir, resume, carry)
        summary = json.loads((run_dir / "summary.json").read_text())
        log(f"{where}: {held_out_line(summary)}")
    return runs


def held_out_line(summary: dict[str, Any]) -> str:
    """A finished run's held-out figures in words, from its summary.json; greedy only where it was measured.

    >>> held_out_line({"heldout_accuracy_before": 0.01, "heldout_accuracy_after": 0.25, "heldout_greedy_before": 0.1,
    ...                "heldout_greedy_after": 0.3, "wall_seconds": 275.2})
    'held-out 0.010 -> 0.250 (greedy 0.100 -> 0.300), 275 s'
    >>> held_out_line({"heldout_accuracy_before": 0.01, "heldout_accuracy_after": 0.25, "heldout_greedy_before": None,
    ...                "heldout_greedy_after": float("nan"), "wall_seconds": 275.2})
    'held-out 0.010 -> 0.250, 275 s'
    """
    greedy = [summary.get(f"heldout_greedy_{when}") for when in ("before", "after")]
    measured = all(g is not None and math.isfinite(g) for g in greedy)
    words = f"held-out {summary['heldout_accuracy_before']:.3f} -> {summary['heldout_accuracy_after']:.3f}"
    words += f" (greedy {greedy[0]:.3f} -> {greedy[1]:.3f})" if measured else ""
    return f"{words}, {summary['wall_seconds']:.0f} s"


class RunFailedError(RuntimeError):
    """A run of the comparison ended without finishing (its process exited with an error or was killed)."""


def _train_one(
    config_path: str | None, overrides: list[str], run_dir: str, resume: bool, carry: list[tuple[str, list[str]]]
) -> None:
    """The training flow of one run of the comparison (the target of its own process), which forks the runs
    of ``carry`` ((run directory, overrides) pairs) from it."""
    from coba_tasks.commands.prefect_env import PrefectServerError, start_local_server

    try:
        start_local_server()  # this process's own: a slow first start waited for, a failed one said in one line
    except PrefectServerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
    from flows.train import train_flow

    if carry:
        from coba_tasks.commands.compare_fork import carry as carry_runs
        from coba_tasks.pipeline.config import load_config

        carry_runs(run_dir, [(d, load_config(config_path, ov)) for d, ov in carry])
    if resume:
        train_flow(run_dir=run_dir, resume=True)
    else:
        train_flow(config_path=config_path, overrides=overrides, run_dir=run_dir)


def _train_in_own_process(
    config_path: str | None,
    overrides: list[str],
    run_dir: Path,
    resume: bool,
    carry: Sequence[tuple[str, list[str]]] = (),
) -> None:
    """Train one run in a spawned process (which forks the runs of ``carry`` from it) and wait for it.

    A process per run gives the memory of a finished run (an in-process vLLM engine, the model and its
    optimizer state) back to the system: in one process, a SmolLM2 comparison grew by about 3 GB a run
    (8.2 GB at the start of the fourth run, 12.2 GB during it) until the kernel killed it. A run that
    dies stops the comparison with its name; running the command again resumes it.
    """
    import multiprocessing

    proc = multiprocessing.get_context("spawn").Process(
        target=_train_one,
        args=(config_path, list(overrides), str(run_dir), resume, [(d, list(ov)) for d, ov in carry]),
        name=f"coba-{run_dir.name}",
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


# --- Command line

EXAMPLES = [
    "coba compare --strategies uniform,knapsack,coba,coba-released --seeds 3 --steps 24",
    "coba compare --strategies coba,coba-reversed,coba-fixed --seeds 3 --steps 24 --out runs/compare",
    "coba compare --seeds 1 --steps 4 --set data.train_prompts=256 --out runs/compare-quick",
    "coba compare --out runs/compare --collect-only      # redraw tables and plot from the runs there",
    "coba compare --seeds 5 --steps 12 --out runs/compare-demo --kept docs/compare-demo   # continue a comparison",
    "coba compare --strategies uniform,coba-posterior --seeds 100-109 --steps 12 --out runs/confirm   # fresh seeds",
    "coba compare --strategies uniform,coba,dynamic,ada --seeds 1 --steps 40 --eval-every 0 "
    "--set run.rollout_budget=1536 --set run.eval_every_rollouts=768   # equal rollouts generated",
]


def cmd_compare(args: argparse.Namespace) -> int:
    """Run (or continue) the comparison, then write its tables and plot and print the summary."""
    import pandas as pd

    from coba_tasks.readers import comparison as ct

    strategies = parse_strategies(args.strategies)
    seeds = parse_seeds(str(args.seeds))
    for name in ("steps", "eval_samples"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    out = Path(args.out)
    kept_dir = getattr(args, "kept", None)
    kept = ct.read_tables(Path(kept_dir)) if kept_dir else {name: pd.DataFrame() for name in ct.TABLES}
    if kept_dir and kept["runs"].empty:
        raise ValueError(f"--kept {kept_dir}: no runs.parquet there (the tables of an earlier coba compare)")
    own = ct.read_tables(out)  # an earlier sitting's tables, which this one rewrites
    earlier = earlier_runs(out, own, kept_dir, kept)
    order = run_order(strategies, seeds)
    # the finished runs in --out's tables that this command does not list stay in them
    listed = [*order, *(key for key in ct.finished_runs(own) if key not in order)]
    planned = plan_runs(listed, args.steps, args.config, args.set or [], args.eval_samples, args.eval_every)
    check_configs(out, listed, planned, earlier, run_dirs=not args.collect_only)
    out.mkdir(parents=True, exist_ok=True)
    if not args.collect_only:
        from coba_tasks.commands.prefect_env import configure_prefect

        configure_prefect()
        try:
            run_all(out, order, planned, args.steps, args.config, earlier, fork=not getattr(args, "no_fork", False))
        except RunFailedError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    tables = ct.assemble(listed, ct.collect([out / f"{s}-seed{k}" for s, k in listed]), own, kept)
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
    "steps, budget_by_level, budget_by_pass_rate, transitions, estimate_by_age, steps_by_level, prompt_visits), "
    "final.json and "
    "compare.png into "
    "--out and print the gain per strategy, the paired difference to uniform with its 95 % interval and the "
    "smallest detectable difference, where the rollouts went and the mechanisms per step (the estimates' error, "
    "N_eff, mixed groups, pass@2). Finished runs are kept (here or, with --kept, in an earlier "
    "sitting's tables) and stopped ones resumed, so the command continues where it stopped; the finished runs "
    "in --out's own tables that have no directory there, or that this command does not list, stay in its tables. "
    "A run made with another config than this command gives it (another --steps, --set...) is refused. "
    f"Strategies: {', '.join(PRESETS)} "
    "(coba-reversed: explore then exploit; coba-fixed: allocation.fixed_alpha/fixed_beta at every step; "
    "coba-cap16, coba-min4: max_budget 16, min_budget 4; coba-equal: optim.prompt_weighting=equal; "
    "coba-posterior, coba-pilot: that allocation.estimator; coba-pilot-equal-cap16: the three together).",
    examples=EXAMPLES,
    options=[
        option("--config", default=None, help="YAML config (default configs/demo.yaml)"),
        option("--strategies", default="uniform,knapsack,coba,coba-released", help="comma-separated"),
        option(
            "--seeds",
            default="3",
            help="N: seeds 0..N-1 per strategy (default 3); A-B: seeds A..B; or a list like 0,7,9",
        ),
        option(
            "--steps",
            type=int,
            default=24,
            help="training steps per run (default 24; with --set run.rollout_budget=N the most: a run stops at N "
            "rollouts generated)",
        ),
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
        option(
            "--no-fork",
            action="store_true",
            help="train every run from its start (by default the runs of a seed share the steps before their "
            "allocations part: the first run's, forked for the others)",
        ),
        VERBOSE_OPTION,
    ],
    func=cmd_compare,
)
