"""What came back: a few prompts of a step with the budget the allocation gave them, the pass-rate estimate
it used, and their completions with rewards and verdicts (the report shows them per evaluated step); and a
held-out evaluation's completions (``heldout_samples``: the first sampled and the greedy completion it kept).

    samples = step_samples_for_eval(load_run("runs/demo"), eval_step=10)   # None when no step has them
    held_out = heldout_samples(load_run("runs/demo"), eval_step=10)       # None: the table kept none

A held-out evaluation at step ``t`` scores the weights after ``t`` updates; the training rollouts of those
weights are step ``t``'s. After the last update no training step follows, so the last evaluation is shown
with the last step that has rollouts. Completions are untrusted text: whoever shows them escapes them.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from coba_tasks.pipeline.store import Table
from coba_tasks.readers.tables import RunTables

PROMPTS_SHOWN = 4  # prompts per step: from the largest budget to the smallest
COMPLETIONS_SHOWN = 4  # completions per prompt, in sample order
TEXT_CHARS = 600  # a prompt or completion is cut here (the rest is in the tables)
NEEDED = (Table.ROLLOUTS, Table.REWARDS, Table.BUDGET)


def prompt_texts(t: RunTables, prompt_ids: pd.Series, chars: int) -> pd.Series:
    """The user's text of each prompt id (cut at ``chars``; "" where the run has none): a run's prompts table
    holds it as ``prompt_text`` (tables of older runs as ``prompt``)."""
    prompts = t.prompts()
    column = next((c for c in ("prompt_text", "prompt") if prompts is not None and c in prompts), None)
    if column is None:
        return pd.Series("", index=prompt_ids.index)
    text = prompts.drop_duplicates("prompt_id").set_index("prompt_id")[column].astype(str)
    return prompt_ids.map(text).fillna("").str.slice(0, chars)


def training_step_for(t: RunTables, eval_step: int) -> int | None:
    """The training step whose rollouts show the weights evaluated at ``eval_step``: ``eval_step`` itself when
    its rollouts, rewards and budget are done, else the latest earlier step that has them (None if none)."""
    steps = [s for s in t.steps if s <= eval_step and set(NEEDED) <= t.done.get(s, set())]
    return max(steps) if steps else None


def step_samples_for_eval(t: RunTables, eval_step: int) -> tuple[int, pd.DataFrame] | None:
    """(training step, its sample): ``PROMPTS_SHOWN`` prompts spread over the budgets of that step (largest
    to smallest), each with ``budget``, ``pass_rate_est`` (NaN: never seen), ``prompt`` text, and up to
    ``COMPLETIONS_SHOWN`` completions (``sample_idx``, ``completion``, ``reward``, ``verdict``), one row per
    completion; None when no step up to ``eval_step`` has its tables."""
    step = training_step_for(t, eval_step)
    if step is None:
        return None
    budget = t.table(step, Table.BUDGET)[["prompt_id", "budget", "pass_rate_est"]]
    budget = budget.sort_values(["budget", "prompt_id"], ascending=[False, True], kind="stable")
    picks = np.unique(np.linspace(0, len(budget) - 1, min(PROMPTS_SHOWN, len(budget))).round().astype(int))
    chosen = budget.iloc[picks].reset_index(drop=True)
    rollouts = t.table(step, Table.ROLLOUTS)[["prompt_id", "sample_idx", "completion"]]
    rewards = t.table(step, Table.REWARDS)[["prompt_id", "sample_idx", "reward", "verdict"]]
    rows = rollouts[rollouts["prompt_id"].isin(chosen["prompt_id"])].merge(
        rewards, on=["prompt_id", "sample_idx"], how="left"
    )
    rows = rows.sort_values(["prompt_id", "sample_idx"], kind="stable").groupby("prompt_id").head(COMPLETIONS_SHOWN)
    out = chosen.merge(rows, on="prompt_id", how="left")  # the chosen order: largest budget first
    out["prompt"] = prompt_texts(t, out["prompt_id"], TEXT_CHARS)
    out["completion"] = out["completion"].astype(str).str.slice(0, TEXT_CHARS)
    return step, out


def samples_sql(step: int) -> str:
    """The ``coba inspect --sql`` query that lists every completion of ``step`` with its reward and budget.

    >>> samples_sql(3).endswith("where r.step = 3 order by r.prompt_id, r.sample_idx")
    True
    """
    return (
        "select r.prompt_id, b.budget, b.pass_rate_est, r.sample_idx, r.completion, w.reward, w.verdict "
        "from rollouts r join rewards w using (step, prompt_id, sample_idx) join budget b using (step, prompt_id) "
        f"where r.step = {step} order by r.prompt_id, r.sample_idx"
    )


HELDOUT_PER_LEVEL = 2  # held-out prompts shown per difficulty level: one the policy solved, one it did not


def heldout_samples(t: RunTables, eval_step: int) -> pd.DataFrame | None:
    """The held-out evaluation of the weights after ``eval_step`` updates, what it kept of its completions: per
    difficulty level of the main held-out set up to ``HELDOUT_PER_LEVEL`` prompts (one the sampled completion
    solved and one it did not, where there are), with ``prompt_text``, ``accuracy``, ``sample_completion`` and
    ``sample_verdict`` (and ``greedy_completion``, ``greedy_verdict`` when the run decodes greedily too), texts cut
    at ``TEXT_CHARS``. None when the table kept no completion (runs made before it did)."""
    table = t.table(eval_step, Table.EVAL)
    if "sample_completion" not in table:
        return None
    main = table[table["test_set"] == "test"] if "test_set" in table else table
    picks = []
    for _, level in main.groupby("difficulty", sort=True):
        right = level["sample_verdict"].astype(str) == "correct"
        for part in (level[right], level[~right]):
            picks.append(part.head(1))
    shown = pd.concat(picks).groupby("difficulty", sort=True).head(HELDOUT_PER_LEVEL).reset_index(drop=True)
    for column in ("prompt_text", "sample_completion", "greedy_completion"):
        if column in shown:
            shown[column] = shown[column].astype(str).str.slice(0, TEXT_CHARS)
    return shown
