"""How the allocation's mechanisms worked at each step of a run, computed once from its done tables.

Per allocated prompt of step t ``estimate_rows`` (estimate, realized pass rate, age, seen); per step
``STEP_COLUMNS`` (``run_mechanisms``). Each figure is defined in docs/design.md, "The mechanisms of each step".

``step_mechanisms`` gives one step's figures but ``first_solved`` (the trackers log them as ``mechanisms/...``);
``by_age`` groups the estimated prompts of all steps by age (prompts, MAE, bias per age);
``mechanism_summary`` gives the run's means over steps (``run_summary``'s ``mechanisms``). The held-out
pass@k is the eval table's (``figures.eval_figures``). No torch here: ``coba inspect`` stays quick.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from coba_tasks.core.passk import mean_pass_at_k
from coba_tasks.core.values import effective_number
from coba_tasks.engines.verify import solved
from coba_tasks.pipeline.store import Table
from coba_tasks.readers.tables import RunTables

PASS_AT = 2  # k of the training groups' pass@k: every group has at least allocation.min_budget >= 2 rollouts
MIN_CORR_PROMPTS = 3  # fewer estimated prompts than this: no correlation
STEP_COLUMNS = ("step", "prompts", "estimated", "estimate_mae", "estimate_bias", "estimate_corr", "estimate_age_mean")
STEP_COLUMNS += ("effective_prompts", "mixed_groups", "first_solved", f"train_pass_at_{PASS_AT}")
AGE_COLUMNS = ("age", "prompts", "estimate_mae", "estimate_bias")
# one row per prompt and visit (a step that sampled it): its rounds, the rollouts generated and trained on, the
# correct ones among them; the budget and estimate it was allocated with (NaN for a prompt the budget did not
# hold: a later generation batch of dynamic sampling), the share correct, the estimate's age, seen (estimated)
ROW_COLUMNS = ("step", "prompt_id", "rounds", "generated", "trained", "successes", "budget", "estimate", "realized")
ROW_COLUMNS += ("age", "seen")


LEVEL_COLUMNS = ("step", "difficulty", "groups", "alike", "all_wrong", "mixed", "rollouts", "pass_rate")
LEVEL_COLUMNS += ("first_solved", "wrong_to_mixed", "wrong_learnable", "estimated", "estimate_mae", "estimate_bias")


@dataclass(frozen=True)
class Mechanisms:
    """A run's mechanisms: ``steps`` (one row per step, ``STEP_COLUMNS``) and ``rows`` (one per allocated
    prompt of those steps, ``ROW_COLUMNS``)."""

    steps: pd.DataFrame
    rows: pd.DataFrame


def realized_rates(rewards: pd.DataFrame) -> pd.Series:
    """Per prompt (index prompt_id): the share of its rollouts solved, ``prompt_history.pass_rates`` without torch."""
    return solved(rewards).groupby(rewards["prompt_id"].astype(str), sort=False).mean()


def estimate_rows(
    budget: pd.DataFrame, rewards: pd.DataFrame, step: int, last_visit: dict[str, int] | None = None
) -> pd.DataFrame:
    """Per prompt of ``budget`` (the budget step ``step`` consumed): ``ROW_COLUMNS``. ``last_visit``
    (prompt -> last_step of history(step - 1)) gives the ages when the budget has no ``estimate_age``.

    >>> b = pd.DataFrame({"prompt_id": ["a", "b"], "budget": [2, 4], "pass_rate_est": [0.5, np.nan]})
    >>> r = pd.DataFrame({"prompt_id": ["a", "a", "b", "b", "b", "b"], "verdict": ["correct"] + ["wrong"] * 5})
    >>> estimate_rows(b, r, 3, {"a": 1, "b": 2})[["prompt_id", "estimate", "realized", "age", "seen"]]
      prompt_id  estimate  realized  age   seen
    0         a       0.5       0.5  2.0   True
    1         b       NaN       0.0  NaN  False
    """
    ids = budget["prompt_id"].astype(str)
    nan = pd.Series(np.nan, index=budget.index)
    estimate = pd.to_numeric(budget["pass_rate_est"], errors="coerce") if "pass_rate_est" in budget else nan
    if "estimate_age" in budget:
        age, known = pd.to_numeric(budget["estimate_age"], errors="coerce"), True
    elif last_visit is not None:
        last = ids.map(last_visit).astype(float)
        age, known = (step - last).where(estimate.notna()), True
    else:
        age, known = nan, False
    realized = ids.map(realized_rates(rewards)).astype(float)
    seen = estimate.notna() & (age.notna() if known else True)
    return pd.DataFrame(
        {
            "step": step,
            "prompt_id": ids.to_numpy(),
            "budget": budget["budget"].to_numpy() if "budget" in budget else np.nan,
            "estimate": estimate.to_numpy(dtype=np.float64),
            "realized": realized.to_numpy(dtype=np.float64),
            "age": age.to_numpy(dtype=np.float64),
            "seen": seen.to_numpy(dtype=bool),
        }
    )


def visit_rows(estimates: pd.DataFrame, rewards: pd.DataFrame, rollouts: pd.DataFrame | None) -> pd.DataFrame:
    """``ROW_COLUMNS`` of a step: its ``estimate_rows`` (the budget's prompts, in its order) beside every prompt
    it sampled (``rewards``; a prompt the budget did not hold gets no budget or estimate), with the rounds it was
    sampled in, its rollouts generated, trained on (``rollouts``' ``used``: all without one, or without
    ``rollouts``) and solved.

    >>> e = pd.DataFrame({"step": 3, "prompt_id": ["a"], "budget": [2], "estimate": [0.5], "realized": [0.5],
    ...                   "age": [1.0], "seen": [True]})
    >>> r = pd.DataFrame({"prompt_id": ["a", "a", "b", "b"], "verdict": ["correct", "wrong", "wrong", "wrong"]})
    >>> ro = pd.DataFrame({"prompt_id": list("aabb"), "round": [0, 0, 1, 1], "used": [True, True, False, False]})
    >>> visit_rows(e, r, ro)[["prompt_id", "rounds", "generated", "trained", "successes", "budget", "seen"]]
      prompt_id  rounds  generated  trained  successes  budget   seen
    0         a       1          2        2          1     2.0   True
    1         b       1          2        0          0     NaN  False
    """
    ids = rewards["prompt_id"].astype(str)
    counts = pd.DataFrame({"generated": ids.groupby(ids, sort=False).size()})
    counts["successes"] = solved(rewards).groupby(ids, sort=False).sum().astype(int)
    if rollouts is not None and "used" in rollouts:
        counts["trained"] = rollouts["used"].groupby(rollouts["prompt_id"].astype(str), sort=False).sum()
    else:
        counts["trained"] = counts["generated"]
    if rollouts is not None and "round" in rollouts:
        counts["rounds"] = rollouts["round"].groupby(rollouts["prompt_id"].astype(str), sort=False).nunique()
    else:
        counts["rounds"] = 1
    step = int(estimates["step"].iloc[0]) if len(estimates) else -1
    order = list(dict.fromkeys([*estimates["prompt_id"].astype(str), *counts.index]))
    out = estimates.assign(prompt_id=estimates["prompt_id"].astype(str)).set_index("prompt_id").reindex(order)
    out = out.join(counts).reset_index()
    realized = counts["successes"] / counts["generated"]
    out["realized"] = out["prompt_id"].map(realized).astype(float)
    out["step"] = step
    out["seen"] = out["seen"].fillna(False).astype(bool)
    for col in ("rounds", "generated", "trained", "successes"):
        out[col] = out[col].fillna(0).astype(np.int64)
    return out[list(ROW_COLUMNS)]


def estimate_figures(rows: pd.DataFrame) -> dict[str, float]:
    """``estimated``, ``estimate_mae``, ``estimate_bias``, ``estimate_corr`` and ``estimate_age_mean`` of
    ``estimate_rows`` (the seen prompts that were rolled out; NaN figures when there is none)."""
    seen = rows[rows["seen"] & rows["realized"].notna()]
    est, real = seen["estimate"].to_numpy(dtype=np.float64), seen["realized"].to_numpy(dtype=np.float64)
    n = len(seen)
    return {
        "estimated": n,
        "estimate_mae": float(np.mean(np.abs(est - real))) if n else math.nan,
        "estimate_bias": float(np.mean(real - est)) if n else math.nan,
        "estimate_corr": pearson(est, real),
        "estimate_age_mean": float(seen["age"].mean()) if n and seen["age"].notna().any() else math.nan,
    }


def pearson(x: np.ndarray, y: np.ndarray) -> float:
    """Pearson's r of ``x`` and ``y``; NaN with fewer than ``MIN_CORR_PROMPTS`` pairs or when one has no spread.

    >>> pearson(np.array([0.0, 0.5, 1.0]), np.array([0.25, 0.25, 1.0])), pearson(np.array([0.5] * 3), np.arange(3.0))
    (0.8660254037844387, nan)
    """
    if len(x) < MIN_CORR_PROMPTS:
        return math.nan
    dx, dy = x - x.mean(), y - y.mean()
    sxx, syy = float(dx @ dx), float(dy @ dy)
    if sxx <= 0.0 or syy <= 0.0:
        return math.nan
    return float(dx @ dy) / math.sqrt(sxx * syy)


def mixed_prompts(rewards: pd.DataFrame) -> pd.Series:
    """Per prompt (index prompt_id): whether its rewards are not all equal (its advantages are not all 0)."""
    return rewards.groupby(rewards["prompt_id"].astype(str), sort=False)["reward"].nunique() > 1


def token_effective_prompts(rollouts: pd.DataFrame, rewards: pd.DataFrame) -> float:
    """N_eff of an update under the token mean, from its tables: W_i = prompt i's completion tokens
    (``n_tokens``), over the prompts with mixed rewards; 0.0 when none is mixed, NaN without ``n_tokens``.
    The same as ``coba_tasks.core.grpo.effective_prompts`` with every row weight 1.

    >>> ro = pd.DataFrame({"prompt_id": list("aabbcc"), "sample_idx": [0, 1] * 3, "n_tokens": [6, 6, 1, 1, 4, 4]})
    >>> token_effective_prompts(ro, ro.assign(reward=[1.0, 0.0, 1.0, 0.0, 0.0, 0.0]))
    1.3243243243243243
    """
    if "n_tokens" not in rollouts or rollouts.empty:
        return math.nan
    tokens = rollouts.assign(prompt_id=rollouts["prompt_id"].astype(str)).groupby("prompt_id")["n_tokens"].sum()
    mixed = mixed_prompts(rewards)
    return effective_number(tokens.reindex(mixed[mixed].index).dropna().to_numpy(dtype=np.float64))


def effective_prompts_of(t: RunTables, step: int) -> float:
    """The step's N_eff: the update table's ``effective_prompts``, else ``token_effective_prompts`` (see the
    module docstring), else NaN."""
    done = t.done.get(step, set())
    if Table.UPDATE in done:
        update = t.table(step, Table.UPDATE)
        if "effective_prompts" in update and len(update):
            return float(update["effective_prompts"].iloc[0])
    if {Table.ROLLOUTS, Table.REWARDS} <= done:
        return token_effective_prompts(
            # the token ids and log-probs are most of the table's bytes: two columns, unhashed (as coba inspect --sql)
            t.store.read_table(step, Table.ROLLOUTS, verify=False, columns=("prompt_id", "n_tokens")),
            t.table(step, Table.REWARDS),
        )
    return math.nan


def group_figures(rewards: pd.DataFrame) -> dict[str, float]:
    """``prompts``, ``mixed_groups`` and ``train_pass_at_2`` of a rewards table.

    >>> r = pd.DataFrame({"prompt_id": list("aabbbb"), "reward": [1.0, 0, 1, 0, 0, 0]})
    >>> group_figures(r.assign(verdict=["correct", "wrong", "correct", "wrong", "wrong", "wrong"]))
    {'prompts': 2, 'mixed_groups': 2, 'train_pass_at_2': 0.75}
    """
    counts = solved(rewards).groupby(rewards["prompt_id"].astype(str), sort=False).agg(["size", "sum"])
    ok = counts["size"] >= PASS_AT
    pass_at = mean_pass_at_k(counts["size"][ok].to_numpy(), counts["sum"][ok].to_numpy(), PASS_AT)
    return {
        "prompts": len(counts),
        "mixed_groups": int(mixed_prompts(rewards).sum()),
        f"train_pass_at_{PASS_AT}": pass_at,
    }


def _last_visits(t: RunTables, step: int) -> dict[str, int] | None:
    """prompt -> last_step of history(step - 1) (an empty history before step 0); None when it is not done."""
    if step == 0:
        return {}
    if Table.HISTORY not in t.done.get(step - 1, set()):
        return None
    h = t.table(step - 1, Table.HISTORY)
    return dict(zip(h["prompt_id"].astype(str), h["last_step"].astype(int), strict=True))


def step_mechanisms(t: RunTables, step: int) -> tuple[dict[str, float], pd.DataFrame]:
    """The figures of step ``step`` but ``first_solved`` (which needs the steps before it) and its
    ``estimate_rows``; its budget and rewards tables must be done."""
    rewards = t.table(step, Table.REWARDS)
    estimates = estimate_rows(t.table(step, Table.BUDGET), rewards, step, _last_visits(t, step))
    rows = visit_rows(estimates, rewards, _sampling_columns(t, step))
    figures = {**group_figures(rewards), **estimate_figures(rows), "effective_prompts": effective_prompts_of(t, step)}
    return figures, rows


def _sampling_columns(t: RunTables, step: int) -> pd.DataFrame | None:
    """The step's rollouts' ``prompt_id``, ``round`` and ``used`` (a step sampled in rounds; after a pilot, which
    trains on every rollout, no ``used``), read alone and unhashed (the token ids are most of the table); None for
    a step sampled once."""
    if Table.ROLLOUTS not in t.done.get(step, set()) or Table.ROUND not in t.done.get(step, set()):
        return None
    piloted = t.config_value("allocation", "estimator") == "pilot"
    columns = ("prompt_id", "round") if piloted else ("prompt_id", "round", "used")
    return t.store.read_table(step, Table.ROLLOUTS, verify=False, columns=columns)


def run_mechanisms(t: RunTables) -> Mechanisms:
    """The mechanisms of every step of ``t`` with a done budget and rewards table."""
    seen_solved: set[str] = set()
    steps, rows = [], []
    for step in t.steps_with(Table.REWARDS):
        rewards = t.table(step, Table.REWARDS)
        correct = set(rewards["prompt_id"][solved(rewards)].astype(str))
        first = correct - seen_solved
        seen_solved |= correct
        if Table.BUDGET not in t.done[step]:
            continue
        figures, r = step_mechanisms(t, step)
        rows.append(r)
        steps.append({"step": step, **figures, "first_solved": len(first)})
    frame = pd.DataFrame(steps, columns=list(STEP_COLUMNS))
    every = pd.concat(rows, ignore_index=True) if rows else pd.DataFrame(columns=list(ROW_COLUMNS))
    return Mechanisms(steps=frame, rows=every)


def prompt_visits(t: RunTables, rows: pd.DataFrame | None = None) -> pd.DataFrame:
    """One row per prompt and visit of the run (``run_mechanisms``' ``rows``, or ``rows``), with its difficulty
    ``level`` where the prompts have one: the table ``coba inspect --mechanisms prompts`` shows and
    ``coba compare`` keeps (``prompt_visits.parquet``)."""
    rows = run_mechanisms(t).rows if rows is None else rows
    prompts = t.prompts()
    if prompts is None or "difficulty" not in prompts:
        return rows
    level = prompts.assign(prompt_id=prompts["prompt_id"].astype(str)).set_index("prompt_id")["difficulty"]
    return rows.assign(level=rows["prompt_id"].astype(str).map(level).to_numpy())


def by_age(rows: pd.DataFrame) -> pd.DataFrame:
    """The estimated prompts of ``estimate_rows`` (any number of steps) by the age of their estimate:
    ``AGE_COLUMNS`` (age in steps, ascending; prompts; MAE; bias = mean realized - estimate).

    >>> rows = pd.DataFrame({"estimate": [0.5, 0.5, 0.0], "realized": [1.0, 0.25, 0.5], "age": [1.0, 1.0, 3.0]})
    >>> by_age(rows.assign(seen=True))
       age  prompts  estimate_mae  estimate_bias
    0    1        2         0.375          0.125
    1    3        1         0.500          0.500
    """
    seen = rows[rows["seen"].astype(bool) & rows["realized"].notna() & rows["age"].notna()]
    if seen.empty:
        return pd.DataFrame(columns=list(AGE_COLUMNS))
    err = seen["realized"] - seen["estimate"]
    g = pd.DataFrame({"age": seen["age"].astype(int), "abs": err.abs(), "err": err}).groupby("age", sort=True)
    out = pd.DataFrame({"prompts": g.size(), "estimate_mae": g["abs"].mean(), "estimate_bias": g["err"].mean()})
    return out.reset_index()[list(AGE_COLUMNS)]


def mechanism_summary(m: Mechanisms) -> dict[str, Any] | None:
    """The run's means over its steps (``steps``, ``estimated`` and ``first_solved``: totals), with
    ``by_age`` as records; None before any step has a budget and rewards."""
    s = m.steps
    if s.empty:
        return None

    def mean(col: str) -> float:
        v = pd.to_numeric(s[col], errors="coerce")
        return float(v.mean()) if v.notna().any() else math.nan

    means = ("prompts", "estimate_mae", "estimate_bias", "estimate_corr", "estimate_age_mean", "effective_prompts")
    return {
        "steps": len(s),
        "estimated": int(s["estimated"].sum()),
        **{c: mean(c) for c in (*means, "mixed_groups", f"train_pass_at_{PASS_AT}")},
        "first_solved": int(s["first_solved"].sum()),
        "by_age": by_age(m.rows).to_dict("records"),
    }


def level_mechanisms(rows: pd.DataFrame, level: pd.Series) -> pd.DataFrame:
    """The mechanisms of each step by difficulty level (``LEVEL_COLUMNS``), from ``run_mechanisms``' ``rows``
    (one per allocated prompt and step) and ``level`` (prompt_id -> difficulty): per (step, level) the
    ``groups`` (prompts rolled out), those that scored ``alike`` (all wrong or all right: every advantage 0),
    ``all_wrong``, ``mixed``, the ``rollouts`` they got, their mean ``pass_rate`` (share correct), the prompts
    correct for the first time in the run (``first_solved``), those all wrong at their previous visit and
    mixed now (``wrong_to_mixed``), the all-wrong groups of prompts mixed at some other visit of the run
    (``wrong_learnable``: a hard prompt that more rollouts crack, not a hopeless one), and the estimates'
    error against the realized pass rate (``estimated`` prompts, ``estimate_mae``, ``estimate_bias``).

    >>> rows = pd.DataFrame({"step": [0, 0, 1, 1], "prompt_id": ["a", "b", "a", "b"], "budget": [4, 4, 2, 6],
    ...                      "estimate": [np.nan, np.nan, 0.0, 0.5], "realized": [0.0, 0.5, 0.5, 1.0],
    ...                      "age": [np.nan, np.nan, 1.0, 1.0], "seen": [False, False, True, True]})
    >>> out = level_mechanisms(rows, pd.Series({"a": 1, "b": 0}))
    >>> out[["step", "difficulty", "alike", "first_solved", "wrong_to_mixed", "wrong_learnable"]].to_dict("records")[:3]
    [{'step': 0, 'difficulty': 0, 'alike': 0, 'first_solved': 1, 'wrong_to_mixed': 0, 'wrong_learnable': 0}, \
{'step': 0, 'difficulty': 1, 'alike': 1, 'first_solved': 0, 'wrong_to_mixed': 0, 'wrong_learnable': 1}, \
{'step': 1, 'difficulty': 0, 'alike': 1, 'first_solved': 0, 'wrong_to_mixed': 0, 'wrong_learnable': 0}]
    """
    if rows.empty:
        return pd.DataFrame(columns=list(LEVEL_COLUMNS))
    r = rows.assign(difficulty=rows["prompt_id"].map(level)).sort_values(["prompt_id", "step"], kind="stable")
    r = r[r["realized"].notna() & r["difficulty"].notna()]
    wrong, right = r["realized"] == 0.0, r["realized"] == 1.0
    mixed = ~wrong & ~right
    by_prompt = r.groupby("prompt_id", sort=False)
    solved_before = (
        (r["realized"] > 0).groupby(r["prompt_id"], sort=False).transform(lambda x: x.cummax().shift(fill_value=False))
    )
    prev_wrong = wrong.groupby(r["prompt_id"], sort=False).shift(fill_value=False)
    seen = r["seen"] & r["estimate"].notna()
    error = (r["realized"] - r["estimate"]).where(seen)
    frame = pd.DataFrame(
        {
            "step": r["step"],
            "difficulty": r["difficulty"].astype(int),
            "groups": 1,
            "alike": (~mixed).astype(int),
            "all_wrong": wrong.astype(int),
            "mixed": mixed.astype(int),
            "rollouts": r["generated"] if "generated" in r else r["budget"],
            "pass_rate": r["realized"],
            "first_solved": ((r["realized"] > 0) & ~solved_before.astype(bool)).astype(int),
            "wrong_to_mixed": (prev_wrong.astype(bool) & mixed).astype(int),
            "wrong_learnable": (wrong & by_prompt["realized"].transform(lambda x: ((x > 0) & (x < 1)).any())).astype(
                int
            ),
            "estimated": seen.astype(int),
            "abs_error": error.abs(),
            "error": error,
        }
    )
    sums = frame.groupby(["step", "difficulty"]).agg(
        groups=("groups", "sum"),
        alike=("alike", "sum"),
        all_wrong=("all_wrong", "sum"),
        mixed=("mixed", "sum"),
        rollouts=("rollouts", "sum"),
        pass_rate=("pass_rate", "mean"),
        first_solved=("first_solved", "sum"),
        wrong_to_mixed=("wrong_to_mixed", "sum"),
        wrong_learnable=("wrong_learnable", "sum"),
        estimated=("estimated", "sum"),
        estimate_mae=("abs_error", "mean"),
        estimate_bias=("error", "mean"),
    )
    return sums.reset_index()[list(LEVEL_COLUMNS)]
