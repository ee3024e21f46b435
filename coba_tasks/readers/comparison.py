"""The tables, statistics and plot of a comparison (``coba compare``).

``collect`` reads the run directories of a comparison into tables, one row per (strategy, seed) and
what the row is about:

    runs.parquet         strategy, seed, config_hash, finished, steps, rollouts, wall_seconds: the runs the
                         tables hold (a later sitting checks its runs against these hashes)
    results.parquet      strategy, seed, step, rollouts_spent (rollouts generated before the weights evaluated:
                         every round, pilot and dropped group; the x axis of runs that spend differently per
                         step), accuracy (avg@k), accuracy_greedy, answered, boxed, one column per level,
                         pass_at_1 .. pass_at_k (pass@k, unbiased, k up to the completions per prompt)
    steps.parquet        strategy, seed, step, S, F, alpha, beta, alloc_alpha, alloc_beta (the Beta the step's
                         budgets were allocated with), rollouts (generated), rollouts_trained (those its update
                         trained on), effective gradient ratio (share of groups
                         with non-zero reward variance), effective rollout ratio (share of rollouts in such
                         groups: the samples with a non-zero advantage), first_solved (prompts with a
                         correct rollout for the first time in the run) and ``mechanisms.STEP_COLUMNS``:
                         prompts, estimated, estimate_mae, estimate_bias, estimate_corr, estimate_age_mean
                         (the estimates the budget was allocated with against the realized pass rates),
                         effective_prompts (N_eff of the update), mixed_groups, train_pass_at_2
    budget_by_level.parquet      strategy, seed, step, difficulty, prompts, mean and total budget
    budget_by_pass_rate.parquet  strategy, seed, pass_rate_bin, prompts, rollouts: where the rollouts went, by
                         the pass-rate estimate each prompt was allocated with (``unseen``: no visit yet)
    transitions.parquet  strategy, seed, from_class, to_class, prompts: how a prompt's class (all wrong /
                         mixed / all right) changes from one visit to the next
    estimate_by_age.parquet  strategy, seed, age, prompts, estimate_mae, estimate_bias: the estimates' error
                         over the run by their age (``mechanisms.by_age``)
    steps_by_level.parquet   strategy, seed and ``mechanisms.LEVEL_COLUMNS``: per step and difficulty level the
                         groups, those scored alike, all wrong and mixed, their rollouts and pass rate, the
                         prompts first solved, the all-wrong -> mixed conversions, the all-wrong groups of
                         prompts mixed at another visit, the estimates' error (``mechanisms.level_mechanisms``)
    prompt_visits.parquet    strategy, seed and ``mechanisms.ROW_COLUMNS`` (and ``level`` where the prompts have
                         one): one row per prompt and visit, its rounds, rollouts generated, trained on and
                         solved, the budget and estimate it was allocated with (``mechanisms.prompt_visits``:
                         which prompts a strategy cracked, and at which visit)

``steps.parquet`` also holds each update's size: ``grad_norm`` (before clipping) and ``nonzero_token_share``
(the share of the step's completion tokens in groups with a non-zero advantage: the token-mean loss divides by
all of them, so an update on fewer wasted rollouts is a larger step).

``assemble`` adds the rows of runs finished in an earlier sitting (``--out``'s own tables, then those
of ``--kept``) for the runs that have no directory here. ``final_table``, ``paired_table`` and
``mechanism_table`` are what ``coba compare`` prints and writes to ``final.json``; ``plot`` draws ``compare.png``.
"""

from __future__ import annotations

import itertools
import json
import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from coba_tasks.engines.fileio import atomic_write, write_parquet

CLASSES = ("all_wrong", "mixed", "all_right")
KEYS = ["strategy", "seed"]
TABLES = ("runs", "results", "steps", "budget_by_level", "budget_by_pass_rate", "transitions", "estimate_by_age")
TABLES += ("steps_by_level", "prompt_visits")
# the per-step mechanisms mechanism_table averages (over steps, then seeds); NaN for tables made before them
STEP_MEANS = (
    "effective_prompts",
    "mixed_groups",
    "prompts",
    "estimate_mae",
    "estimate_bias",
    "estimate_corr",
    "estimate_age_mean",
    "train_pass_at_2",
)
# the pass-rate estimate a prompt was allocated with, in bins (right-closed; exact 0 and 1 apart): each bin
# strictly between 0 and 1 by its upper end
INTERIOR_PASS_RATE_BINS = {"(0, 0.25]": 0.25, "(0.25, 0.5]": 0.5, "(0.5, 0.75]": 0.75, "(0.75, 1)": 1.0}
PASS_RATE_BINS = ("unseen", "0", *INTERIOR_PASS_RATE_BINS, "1")
POWER = 0.8  # the power at which the smallest detectable difference is given
# the paper's capability schedule (its Fig. 5, Qwen2.5-7B-Instruct): alpha from about 8 down to about 3
PAPER_ALPHA_RANGE = (3.0, 8.0)
EXPLORE_ALPHA = 5.5  # alpha below this: the Beta puts its mass on prompts with pass rate above 0.5


def pass_rate_bin(rate: float) -> str:
    """The bin of ``PASS_RATE_BINS`` of one pass-rate estimate (NaN: never seen)."""
    if not math.isfinite(rate):
        return "unseen"
    if rate <= 0.0:
        return "0"
    if rate >= 1.0:
        return "1"
    return next(name for name, high in INTERIOR_PASS_RATE_BINS.items() if rate <= high)


def _class_of(rate: float) -> str:
    return "all_wrong" if rate == 0.0 else ("all_right" if rate == 1.0 else "mixed")


def _allocation_beta(t: Any, step: int) -> dict[str, float]:
    """``alloc_alpha``, ``alloc_beta``: the Beta parameters in the step's budget table, NaN when absent."""
    from coba_tasks.pipeline.store import Table

    if Table.BUDGET in t.done[step]:
        b = t.table(step, Table.BUDGET)
        if {"alpha", "beta"} <= set(b.columns) and len(b):
            return {"alloc_alpha": float(b["alpha"].iloc[0]), "alloc_beta": float(b["beta"].iloc[0])}
    return {"alloc_alpha": math.nan, "alloc_beta": math.nan}


def run_key(run_dir: Path) -> dict[str, Any]:
    """``{"strategy", "seed"}`` of a comparison's run directory ``<strategy>-seed<k>``."""
    strategy, seed = run_dir.name.rsplit("-seed", 1)
    return {"strategy": strategy, "seed": int(seed)}


def collect(run_dirs: Sequence[Path]) -> dict[str, pd.DataFrame]:
    """The comparison's tables (see the module docstring) from finished or partial runs."""
    from coba_tasks.readers.tables import load_run

    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in TABLES}
    for run_dir in run_dirs:
        if (run_dir / "run.json").is_file():
            for name, table_rows in _collect_run(load_run(run_dir), run_key(run_dir)).items():
                rows[name] += table_rows
    return {name: pd.DataFrame(r) for name, r in rows.items()}


def _collect_run(t: Any, key: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    from coba_tasks.pipeline import prompt_history
    from coba_tasks.pipeline.store import Table
    from coba_tasks.readers.figures import eval_figures
    from coba_tasks.readers.mechanisms import STEP_COLUMNS, by_age, level_mechanisms, prompt_visits, run_mechanisms

    out: dict[str, list[dict[str, Any]]] = {name: [] for name in TABLES}
    planned = t.config_value("run", "steps")
    prompts = t.prompts()
    level = prompts.set_index("prompt_id")["difficulty"] if prompts is not None and "difficulty" in prompts else None
    visits: dict[str, list[tuple[int, float]]] = {}
    mech = run_mechanisms(t)
    step_columns = [c for c in STEP_COLUMNS if c != "step"]
    per_step = mech.steps.set_index("step")[step_columns].to_dict("index")
    spent = 0  # rollouts of the steps before this one: what the model evaluated at this step trained on
    bin_prompts: Counter[str] = Counter()
    bin_rollouts: Counter[str] = Counter()
    for step in t.steps:
        done = t.done[step]
        if Table.EVAL in done:
            ev = eval_figures(t.table(step, Table.EVAL))
            row = {**key, "step": step, "rollouts_spent": spent, "accuracy": ev["accuracy"]}
            row |= {"accuracy_greedy": ev["greedy"], "answered": ev["answered"], "boxed": ev["boxed"]}
            row |= {f"accuracy_level{lv}": acc for lv, acc in ev["by_difficulty"].items()}
            row |= {f"pass_at_{k}": v for k, v in ev["pass_at_k"].items()}
            out["results"].append(row)
        if Table.CAPABILITY in done and Table.REWARDS in done:
            cap = t.table(step, Table.CAPABILITY).iloc[0]
            rewards = t.table(step, Table.REWARDS)
            rates = prompt_history.pass_rates(rewards)
            sizes = rewards.groupby("prompt_id").size()
            rollouts = int(sizes.sum())
            mixed = ((rates > 0) & (rates < 1)).reindex(sizes.index)
            out["steps"].append(
                {
                    **key,
                    "step": step,
                    **{k: float(cap[k]) for k in ("S", "F", "alpha_used", "beta_used", "alpha", "beta")},
                    # the Beta parameters the step's budgets were allocated with (fixed and reversed
                    # schedules differ from the tracker's alpha, beta); NaN for strategies without them
                    **_allocation_beta(t, step),
                    "rollouts": rollouts,
                    "rollouts_trained": _rollouts_trained(t, step),
                    "effective_gradient_ratio": 1.0 - float(cap["zero_variance_groups"]),
                    # share of the step's rollouts in groups with non-zero reward variance (non-zero advantage)
                    "effective_rollout_ratio": float(sizes[mixed].sum() / sizes.sum()),
                    # estimates against realized pass rates, N_eff, mixed groups, first solved, pass@2
                    **per_step.get(step, dict.fromkeys(step_columns, math.nan)),
                    **_update_size(t, step, mixed),
                }
            )
            spent += rollouts
            for pid, rate in rates.items():
                visits.setdefault(pid, []).append((step, float(rate)))
        if step < planned and Table.BUDGET in done:
            b = t.table(step, Table.BUDGET)
            for est, budget in zip(b["pass_rate_est"], b["budget"], strict=True):
                bin_prompts[pass_rate_bin(float(est))] += 1
                bin_rollouts[pass_rate_bin(float(est))] += int(budget)
            if level is not None:
                out["budget_by_level"] += [
                    {**key, "step": step, "difficulty": int(lv), "prompts": len(g)}
                    | {"mean_budget": float(g.mean()), "total_budget": int(g.sum())}
                    for lv, g in b.groupby(level.reindex(b["prompt_id"]).to_numpy())["budget"]
                ]
    out["budget_by_pass_rate"] = [
        {**key, "pass_rate_bin": name, "prompts": bin_prompts[name], "rollouts": bin_rollouts[name]}
        for name in PASS_RATE_BINS
    ]
    counts = Counter(
        (_class_of(a), _class_of(b)) for seq in visits.values() for (_, a), (_, b) in itertools.pairwise(sorted(seq))
    )
    out["transitions"] = [
        {**key, "from_class": a, "to_class": b, "prompts": counts[(a, b)]}
        for a, b in itertools.product(CLASSES, CLASSES)
    ]
    out["estimate_by_age"] += [{**key, **r} for r in by_age(mech.rows).to_dict("records")]
    out["prompt_visits"] += [{**key, **r} for r in prompt_visits(t, mech.rows).to_dict("records")]
    if level is not None:
        out["steps_by_level"] += [{**key, **r} for r in level_mechanisms(mech.rows, level).to_dict("records")]
    summary = t.summary_file() or {}
    run = {"config_hash": t.store.config_hash, "finished": bool(summary), "steps": int(planned), "rollouts": spent}
    out["runs"].append({**key, **run, "wall_seconds": float(summary.get("wall_seconds", math.nan))})
    return out


def _rollouts_trained(t: Any, step: int) -> float:
    """The rollouts the update of ``step`` trained on (NaN before it is done)."""
    from coba_tasks.pipeline.store import Table

    update = t.table(step, Table.UPDATE) if Table.UPDATE in t.done[step] else None
    return float(update["rollouts"].iloc[0]) if update is not None and "rollouts" in update else math.nan


def _update_size(t: Any, step: int, mixed: pd.Series) -> dict[str, float]:
    """``grad_norm`` of the step's update (NaN before it is done) and ``nonzero_token_share``: the share of the
    step's completion tokens in the groups ``mixed`` marks (prompt_id -> bool)."""
    from coba_tasks.pipeline.store import Table

    grad = math.nan
    if Table.UPDATE in t.done[step]:
        update = t.table(step, Table.UPDATE)
        grad = float(update["grad_norm"].iloc[0]) if "grad_norm" in update and len(update) else math.nan
    share = math.nan
    if Table.ROLLOUTS in t.done[step]:
        ro = t.store.read_table(step, Table.ROLLOUTS, verify=False, columns=("prompt_id", "n_tokens"))
        tokens = ro.groupby(ro["prompt_id"].astype(str))["n_tokens"].sum()
        flags = mixed.copy()
        flags.index = flags.index.astype(str)
        total = float(tokens.sum())
        share = (
            float(tokens[flags.reindex(tokens.index, fill_value=False).to_numpy(dtype=bool)].sum()) / total
            if total
            else math.nan
        )
    return {"grad_norm": grad, "nonzero_token_share": share}


def read_tables(directory: Path) -> dict[str, pd.DataFrame]:
    """The tables a comparison wrote into ``directory`` (empty frames for the ones absent)."""
    paths = {name: directory / f"{name}.parquet" for name in TABLES}
    return {name: pd.read_parquet(path) if path.is_file() else pd.DataFrame() for name, path in paths.items()}


def finished_runs(tables: dict[str, pd.DataFrame]) -> dict[tuple[str, int], str]:
    """(strategy, seed) -> config hash of every finished run in ``tables["runs"]``."""
    runs = tables["runs"]
    if runs.empty:
        return {}
    done = runs[runs["finished"]]
    return {(str(r.strategy), int(r.seed)): str(r.config_hash) for r in done.itertuples()}


def run_rows(tables: dict[str, pd.DataFrame], key: tuple[str, int]) -> int:
    """How many rows ``tables`` hold of run (strategy, seed) ``key``."""
    return sum(int(((f["strategy"] == key[0]) & (f["seed"] == key[1])).sum()) for f in tables.values() if not f.empty)


def assemble(
    order: Sequence[tuple[str, int]], here: dict[str, pd.DataFrame], *kept: dict[str, pd.DataFrame]
) -> dict[str, pd.DataFrame]:
    """The tables of the runs ``order`` lists, in that order: each run's rows from ``here`` (the run
    directories of this sitting) when it has rows there, else from the first of ``kept`` (earlier
    sittings' tables, finished runs only) that has it finished."""
    present = set() if here["runs"].empty else set(zip(here["runs"]["strategy"], here["runs"]["seed"], strict=True))
    done_before = [finished_runs(tables) for tables in kept]
    merged = {}
    for name in TABLES:
        parts = []
        for strategy, seed in order:
            earlier = (t for t, done in zip(kept, done_before, strict=True) if (strategy, seed) in done)
            source = here if (strategy, seed) in present else next(earlier, None)
            frame = None if source is None else source[name]
            if frame is not None and not frame.empty:
                parts.append(frame[(frame["strategy"] == strategy) & (frame["seed"] == seed)])
        merged[name] = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()
    return merged


def finished_only(tables: dict[str, pd.DataFrame]) -> dict[str, pd.DataFrame]:
    """The rows of the finished runs: what the statistics compare (a stopped run's last evaluation is not
    its final one)."""
    done = pd.MultiIndex.from_tuples(list(finished_runs(tables)), names=KEYS)
    return {
        name: frame[pd.MultiIndex.from_frame(frame[KEYS]).isin(done)] if not frame.empty else frame
        for name, frame in tables.items()
    }


def write_tables(out: Path, tables: dict[str, pd.DataFrame]) -> None:
    """Each table as ``<out>/<name>.parquet`` (atomic)."""
    for name, df in tables.items():
        write_parquet(df, out / f"{name}.parquet")


# --- Statistics


def _first_last(results: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Per (strategy, seed): the first and the last evaluation (index strategy, seed)."""
    ordered = results.sort_values("step", kind="stable")
    return ordered.groupby(KEYS).first(), ordered.groupby(KEYS).last()


def measures(results: pd.DataFrame) -> list[tuple[str, str, str]]:
    """(results column, final table's name, paired table's name) of what the tables compare: avg@k, greedy,
    and pass@k at the largest k every row has (none for rows of runs made before pass@k was measured, or
    at k = 1, where it is avg@k).

    >>> measures(pd.DataFrame({"accuracy": [0.5], "accuracy_greedy": [0.5], "pass_at_1": [0.5], "pass_at_4": [0.9]}))
    [('accuracy', 'avg', 'avg'), ('accuracy_greedy', 'greedy', 'greedy'), ('pass_at_4', 'pass_at_4', 'pass@4')]
    """
    out = [("accuracy", "avg", "avg"), ("accuracy_greedy", "greedy", "greedy")]
    ks = [int(c.removeprefix("pass_at_")) for c in results.columns if c.startswith("pass_at_")]
    ks = [k for k in ks if k > 1 and results[f"pass_at_{k}"].notna().all()]
    return out + ([(f"pass_at_{max(ks)}", f"pass_at_{max(ks)}", f"pass@{max(ks)}")] if ks else [])


def final_table(results: pd.DataFrame, runs: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per strategy: held-out accuracy before and after (mean and std over seeds), the gain, and the gain
    per thousand rollouts trained on."""
    if results.empty:
        return pd.DataFrame()
    first, last = _first_last(results)
    rows = []
    for strategy in dict.fromkeys(results["strategy"]):
        f, la = first.loc[strategy], last.loc[strategy]
        row: dict[str, Any] = {"strategy": strategy, "seeds": len(la), "step": int(la["step"].max())}
        row["rollouts"] = float(la["rollouts_spent"].mean()) if "rollouts_spent" in la else math.nan
        for col, name, _ in measures(results):
            gain = (la[col] - f[col]).to_numpy()
            row[f"{name}_before"] = float(f[col].mean())
            row[f"{name}_after"] = float(la[col].mean())
            row[f"{name}_after_std"] = float(la[col].std(ddof=1)) if len(la) > 1 else math.nan
            row[f"{name}_gain"] = float(np.mean(gain))
            row[f"{name}_gain_std"] = float(np.std(gain, ddof=1)) if len(gain) > 1 else math.nan
            spent = la["rollouts_spent"].to_numpy(dtype=float) if "rollouts_spent" in la else np.full(len(gain), np.nan)
            with np.errstate(divide="ignore", invalid="ignore"):
                row[f"{name}_gain_per_1k_rollouts"] = float(np.mean(gain / (spent / 1000.0)))
        rows.append(row)
    return pd.DataFrame(rows)


def paired_difference(diffs: Sequence[float], power: float = POWER) -> dict[str, float]:
    """Mean of paired differences, its 95 % t interval, and the smallest true difference a two-sided 5 %
    paired t-test of this many pairs detects with probability ``power``, at the measured spread:
    (t_{0.975, n-1} + t_{power, n-1}) * sd / sqrt(n). NaN where fewer than 2 pairs, and where all the
    differences are equal (to float rounding): a t-test of zero spread is undefined, not p = 0."""
    from scipy import stats

    d = np.asarray(diffs, dtype=float)
    n = len(d)
    mean = float(d.mean()) if n else math.nan
    if n < 2 or np.allclose(d, d[0], rtol=0.0, atol=1e-12):
        nans = dict.fromkeys(("ci_low", "ci_high", "mdd", "p"), math.nan)
        return {"pairs": n, "mean": mean, "sd": math.nan if n < 2 else 0.0, **nans}
    test = stats.ttest_1samp(d, 0.0)  # the paired t-test: the differences against 0 (se > 0: equal ones above)
    interval = test.confidence_interval(0.95)
    sd = float(d.std(ddof=1))
    mdd = (float(stats.t.ppf(0.975, n - 1)) + float(stats.t.ppf(power, n - 1))) * sd / math.sqrt(n)
    ci = {"ci_low": float(interval.low), "ci_high": float(interval.high)}
    return {"pairs": n, "mean": mean, "sd": sd, **ci, "mdd": mdd, "p": float(test.pvalue)}


def paired_table(results: pd.DataFrame, baseline: str = "uniform") -> pd.DataFrame:
    """Per strategy but ``baseline``, per measure (avg@k, greedy, pass@k), over the seeds both finished: the final
    held-out accuracy minus the baseline's on the same seed (the same pool, held-out sample and start),
    with ``paired_difference``'s interval and smallest detectable difference, and the mean rollouts generated
    before each side's final evaluation (``rollouts``, ``baseline_rollouts``: equal, up to one step's, where the
    runs end at ``run.rollout_budget``)."""
    if results.empty or baseline not in set(results["strategy"]):
        return pd.DataFrame()
    _, last = _first_last(results)
    base = last.loc[baseline]
    rows = []
    for strategy in dict.fromkeys(results["strategy"]):
        if strategy == baseline:
            continue
        mine = last.loc[strategy]
        seeds = sorted(set(mine.index) & set(base.index))
        for col, _, measure in measures(results):
            diffs = (mine.loc[seeds, col] - base.loc[seeds, col]).to_numpy()
            stats_ = paired_difference(diffs)
            has = "rollouts_spent" in mine  # tables kept from before it was recorded have none
            spent = {
                "rollouts": float(mine.loc[seeds, "rollouts_spent"].mean()) if has else math.nan,
                "baseline_rollouts": float(base.loc[seeds, "rollouts_spent"].mean()) if has else math.nan,
            }
            row = {"strategy": strategy, "baseline": baseline, "measure": measure, "seeds": str(seeds)}
            rows.append(row | stats_ | spent)
    return pd.DataFrame(rows)


def mechanism_table(tables: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """Per strategy (means over seeds): share of rollouts with a non-zero advantage, prompts solved for the
    first time per run, the share of rollouts by the pass-rate estimate they were allocated with, the
    steps on the explore side of the schedule (alloc_alpha below ``EXPLORE_ALPHA``), the means over steps
    of ``STEP_MEANS`` (N_eff, mixed groups, prompts, the estimates' MAE, bias, correlation and age, pass@2;
    NaN for tables made before them) and, from ``estimate_by_age``, the MAE and bias of the estimates one
    step old (``estimate_mae_age1``, ``estimate_bias_age1``) and older (``..._older``), over every run's
    estimated prompts."""
    steps, by_bin = tables["steps"], tables["budget_by_pass_rate"]
    ages = tables.get("estimate_by_age", pd.DataFrame())
    if steps.empty:
        return pd.DataFrame()
    rows = []
    for strategy in dict.fromkeys(steps["strategy"]):
        s = steps[steps["strategy"] == strategy]
        per_seed = s.groupby("seed")
        row: dict[str, Any] = {
            "strategy": strategy,
            "seeds": per_seed.ngroups,
            "nonzero_advantage_share": float(per_seed["effective_rollout_ratio"].mean().mean()),
            "first_solved_per_run": float(per_seed["first_solved"].sum().mean()),
            "train_pass_rate_last": float(per_seed.apply(lambda g: g.sort_values("step")["S"].iloc[-1]).mean()),
            "explore_steps_per_run": float(per_seed["alloc_alpha"].apply(lambda a: (a < EXPLORE_ALPHA).sum()).mean()),
        }
        for col in STEP_MEANS:  # mean over steps per seed (NaN steps left out), then over seeds
            row[col] = float(per_seed[col].mean().mean()) if col in s and s[col].notna().any() else math.nan
        mine = ages[ages["strategy"] == strategy] if "age" in ages else pd.DataFrame(columns=["age", "prompts"])
        for name, part in (("age1", mine[mine["age"] == 1]), ("older", mine[mine["age"] > 1])):
            n = part["prompts"].sum()
            for col in ("estimate_mae", "estimate_bias"):
                row[f"{col}_{name}"] = float((part[col] * part["prompts"]).sum() / n) if n else math.nan
        if not by_bin.empty:
            b = by_bin[by_bin["strategy"] == strategy].groupby("pass_rate_bin")["rollouts"].sum()
            total = b.sum()
            row |= {
                f"rollouts_share {name}": float(b.get(name, 0) / total) if total else math.nan
                for name in PASS_RATE_BINS
            }
        rows.append(row)
    return pd.DataFrame(rows)


def format_report(final: pd.DataFrame, paired: pd.DataFrame, mechanism: pd.DataFrame) -> str:
    """What ``coba compare`` prints: the gain per strategy, the paired differences, the mechanism."""
    if final.empty:
        return "no finished evaluations yet"

    def spread(x: float) -> str:  # a standard deviation, which one seed does not have
        return "-" if math.isnan(x) else f"{x:.3f}"

    w = max([15, *(len(str(s)) for s in final["strategy"])])  # the strategy column fits the longest name
    passes = [c.removesuffix("_after") for c in final.columns if c.startswith("pass_at_") and c.endswith("_after")]
    shown = [("avg", "avg@k"), ("greedy", "greedy")] + [(p, p.replace("_at_", "@")) for p in passes]
    lines = [
        f"{'strategy':<{w}} {'seeds':>5}  "
        + "".join(f"{label + ' before -> after (std)':<30} {'gain (std)':<18} " for _, label in shown)
        + f"{'avg@k gain / 1k rollouts':<10}"
    ]

    def cells(r: dict[str, Any], m: str) -> str:  # measure m: before -> after (std), gain (std)
        moved = f"{r[m + '_before']:.3f} -> {r[m + '_after']:.3f} ({spread(r[m + '_after_std'])})"
        gain = f"{r[m + '_gain']:+.3f} ({spread(r[m + '_gain_std'])})"
        return f"{moved:<30} {gain:<18} "

    for r in final.to_dict("records"):
        row = "".join(cells(r, m) for m, _ in shown)
        lines.append(f"{r['strategy']:<{w}} {r['seeds']:>5}  {row}{r['avg_gain_per_1k_rollouts']:+.4f}")
    if not paired.empty:
        lines += [
            "",
            f"paired difference to {paired['baseline'].iloc[0]} on the same seed (final accuracy): "
            f"mean [95 % interval], smallest difference detectable with {POWER:.0%} power",
        ]
        spent = paired[["rollouts", "baseline_rollouts"]].dropna() if "rollouts" in paired else paired.iloc[:0]
        if len(spent) and not (spent["rollouts"] == spent["baseline_rollouts"]).all():
            r = paired.iloc[0]  # arms that spend differently per step: the rollouts each had generated
            lines.append(
                f"  (evaluated after {r['rollouts']:,.0f} rollouts generated, {r['baseline']} after "
                f"{r['baseline_rollouts']:,.0f}; means over the seeds paired)"
            )
        for r in paired.itertuples():
            head = f"  {r.strategy:<{w}} {r.measure:<7} {r.pairs} seeds  {r.mean:+.3f}"
            if r.pairs < 2:  # no spread to make an interval from
                lines.append(f"{head}  (the interval and the detectable difference need 2 paired seeds)")
            elif r.sd == 0:  # no spread: the t interval is undefined
                lines.append(f"{head}  (all {r.pairs} differences equal: no spread for an interval)")
            else:
                lines.append(f"{head} [{r.ci_low:+.3f}, {r.ci_high:+.3f}]  detectable {r.mdd:.3f}")
    if not mechanism.empty:
        lines += ["", "where the rollouts went (means over seeds):"]
        for r in mechanism.to_dict("records"):
            bins = "  ".join(
                f"{name} {r[f'rollouts_share {name}']:.2f}" for name in PASS_RATE_BINS if f"rollouts_share {name}" in r
            )
            lines.append(
                f"  {r['strategy']:<{w}} non-zero advantage {r['nonzero_advantage_share']:.3f}, first solved "
                f"{r['first_solved_per_run']:.1f}/run, explore steps {r['explore_steps_per_run']:.1f}/run; "
                f"by pass rate: {bins}"
            )
        lines += [
            "",
            "per step (means over steps and seeds): N_eff of the update, mixed groups of the prompts, pass@2 of the "
            "groups; the estimates the budget used against the realized pass rates (MAE, bias = realized - "
            "estimate, r), their age in steps, MAE and bias by age",
            *(_mechanism_line(r, w) for r in mechanism.to_dict("records")),
        ]
    return "\n".join(lines)


def _mechanism_line(r: dict[str, Any], w: int) -> str:
    """One strategy's per-step mechanisms as text ("n/a" for what its tables do not hold), its name ``w`` wide."""

    def num(key: str, spec: str) -> str:
        v = r.get(key, math.nan)
        return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)

    if all(num(c, "g") == "n/a" for c in STEP_MEANS):
        return f"  {r['strategy']:<{w}} n/a (its tables were collected before these were measured)"
    return (
        f"  {r['strategy']:<{w}} N_eff {num('effective_prompts', '.2f')}, mixed {num('mixed_groups', '.1f')} of "
        f"{num('prompts', '.1f')}, pass@2 {num('train_pass_at_2', '.3f')}; estimates MAE {num('estimate_mae', '.3f')}"
        f", bias {num('estimate_bias', '+.3f')}, r {num('estimate_corr', '.2f')}, age {num('estimate_age_mean', '.1f')}"
        f"; age 1: MAE {num('estimate_mae_age1', '.3f')} bias {num('estimate_bias_age1', '+.3f')}, older: MAE "
        f"{num('estimate_mae_older', '.3f')} bias {num('estimate_bias_older', '+.3f')}"
    )


def write_final(out: Path, final: pd.DataFrame, paired: pd.DataFrame, mechanism: pd.DataFrame) -> None:
    """final.json: the three tables as lists of records."""
    record = {
        name: json.loads(frame.to_json(orient="records"))
        for name, frame in (("final", final), ("paired", paired), ("mechanism", mechanism))
    }
    atomic_write(out / "final.json", lambda f: f.write(json.dumps(record, indent=2).encode()))


# --- The plot


def plot(out: Path, tables: dict[str, pd.DataFrame]) -> Path:
    """compare.png: avg@k and greedy accuracy against rollouts spent, the share of rollouts with reward
    variance, budget by pass-rate estimate, the capability schedule (alpha, beta) against the paper's
    range, and the answer-format rates per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results, steps, by_bin = tables["results"], tables["steps"], tables["budget_by_pass_rate"]
    fig, axes = plt.subplots(3, 2, figsize=(13, 14.5))
    strategies = list(dict.fromkeys(results["strategy"])) if not results.empty else []
    colors = {s: plt.cm.tab10(i % 10) for i, s in enumerate(strategies)}
    x = "rollouts_spent" if "rollouts_spent" in results else "step"

    def per_step(ax: Any, frame: pd.DataFrame, lines: Sequence[tuple[str, str, str]]) -> None:
        for s in strategies:  # the mean over seeds per step of each (column, line style, label) of lines
            g = frame[frame["strategy"] == s].groupby("step")
            for col, ls, what in lines:
                mean = g[col].mean()
                ax.plot(mean.index, mean.to_numpy(), color=colors[s], ls=ls, label=f"{s}: {what}")

    for ax, col, title in (
        (axes[0, 0], "accuracy", "held-out accuracy, avg@k at temperature 1"),
        (axes[0, 1], "accuracy_greedy", "held-out accuracy, greedy"),
    ):
        for s in strategies:
            g = results[results["strategy"] == s].groupby(x)[col]
            mean, std = g.mean(), g.std(ddof=1).fillna(0.0)
            ax.plot(mean.index, mean.to_numpy(), marker="o", color=colors[s], label=s)
            ax.fill_between(mean.index, (mean - std).to_numpy(), (mean + std).to_numpy(), color=colors[s], alpha=0.15)
        ax.set(
            title=title,
            xlabel="rollouts trained on" if x != "step" else "step",
            ylabel="accuracy (mean +- std over seeds)",
        )
        ax.legend(fontsize=8)
    ax = axes[1, 0]
    per_step(ax, steps, [("effective_rollout_ratio", "-", "rollouts"), ("effective_gradient_ratio", ":", "groups")])
    ax.set(
        title="share with non-zero reward variance: rollouts (solid), groups (dotted)", xlabel="step", ylim=(0, 1.02)
    )
    ax.legend(fontsize=8)
    ax = axes[1, 1]
    if not by_bin.empty:
        share = by_bin.groupby(["strategy", "pass_rate_bin"])["rollouts"].sum().unstack("pass_rate_bin").fillna(0)
        share = share.reindex(columns=[b for b in PASS_RATE_BINS if b in share.columns])
        share = share.div(share.sum(axis=1), axis=0).reindex([s for s in strategies if s in share.index])
        left = np.zeros(len(share))
        for j, name in enumerate(share.columns):
            color = plt.cm.viridis(j / max(1, len(share.columns) - 1))
            ax.barh(share.index, share[name], left=left, color=color, label=name)
            left += share[name].to_numpy()
        ax.set(title="rollouts by the pass-rate estimate they were given with (all steps)", xlim=(0, 1))
        ax.legend(fontsize=8, ncols=4, loc="lower center", bbox_to_anchor=(0.5, -0.3))
    ax = axes[2, 0]
    ax.axhspan(*PAPER_ALPHA_RANGE, color="0.85", label="the paper's alpha over training (about 8 -> 3)")
    ax.axhline(EXPLORE_ALPHA, color="0.4", ls=":", lw=1, label=f"alpha {EXPLORE_ALPHA}: explore side below")
    per_step(ax, steps, [("alloc_alpha", "-", "alpha"), ("alloc_beta", "--", "beta")])
    ax.set(title="allocation Beta(alpha, beta): alpha solid, beta dashed", xlabel="step")
    ax.legend(fontsize=7, ncols=3, loc="upper center", bbox_to_anchor=(0.5, -0.16))
    ax = axes[2, 1]
    answers = (("boxed", "-", "\\boxed{} answers"), ("answered", ":", "an answer at all"))
    per_step(ax, results, [a for a in answers if a[0] in results and results[a[0]].notna().any()])
    ax.set(title="held-out completions with \\boxed{} (solid), with any answer (dotted)", xlabel="step", ylim=(0, 1.02))
    ax.legend(fontsize=7)
    for ax in (*axes[0], axes[1, 0], *axes[2]):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path = atomic_write(out / "compare.png", lambda f: fig.savefig(f, format="png", dpi=100))
    plt.close(fig)
    return path
