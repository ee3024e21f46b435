"""A run's figures as text: the rows ``coba inspect``, the end of ``coba run`` and the report's headline table
show (``summary_rows`` of ``figures.run_summary``), step ranges, and the markdown tables of the flows' artifacts."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from itertools import groupby
from typing import Any

from coba_tasks.pipeline.config_sections import MAIN_TEST_SET
from coba_tasks.readers.figures import NO_SIGNAL_FIX, UPDATE_FIELDS


def step_ranges(steps: Sequence[int]) -> str:
    """'0-5, 8, 10-12' for sorted step numbers.

    >>> step_ranges([0, 1, 2, 3, 4, 5, 8, 10, 11, 12]), step_ranges([])
    ('0-5, 8, 10-12', '')
    """
    runs = [[s for _, s in run] for _, run in groupby(enumerate(steps), lambda i_s: i_s[1] - i_s[0])]
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


MARKDOWN_MARKS = re.compile(r"([\\`*_\[\]<!|~&#])")  # what makes text a link, an image, HTML, code, emphasis or a cell


def markdown_text(value: Any) -> str:
    r"""``value`` as markdown that shows it as written, on one line (newlines become spaces): each character
    that marks a link, an image, HTML, code, emphasis or a table cell backslash-escaped. Every text of a
    dataset, a path or a name placed in an artifact goes through it.

    >>> print(markdown_text("![x](https://a.example/x.png) | a_b\n<b>"))
    \!\[x\](https://a.example/x.png) \| a\_b \<b>
    """
    return MARKDOWN_MARKS.sub(r"\\\1", re.sub(r"[\r\n]+", " ", str(value)))


def figure_table(title: str, rows: list[tuple[str, Any]]) -> str:
    """A markdown page of ``rows`` as a two-column table under ``title`` (markdown: its texts escaped by the
    caller), each cell shown as written (``markdown_text``): what the flows' artifacts and the report's Prefect
    summary show.

    >>> print(figure_table("# Step 0", [("rollouts", 128), ("loss", "-0.0123")]), end="")
    # Step 0
    <BLANKLINE>
    | figure | value |
    |---|---|
    | rollouts | 128 |
    | loss | -0.0123 |
    """
    cells = (f"| {markdown_text(k)} | {markdown_text(v)} |" for k, v in rows)
    return "\n".join([title, "", "| figure | value |", "|---|---|", *cells]) + "\n"


def run_status(s: dict[str, Any]) -> str:
    """ "finished, 10/10 steps done, 347 s" or "not finished (running or stopped), 3/10 steps done"."""
    planned = s.get("steps_planned")
    done_text = f"{s.get('steps_done', 0)}/{planned if planned is not None else '?'} steps done"
    if not s.get("finished"):
        return f"not finished (running or stopped), {done_text}"
    wall = s.get("wall_seconds")
    return f"finished, {done_text}" + (f", {wall:.0f} s" if isinstance(wall, (int, float)) else "")


def summary_rows(s: dict[str, Any]) -> list[tuple[str, str]]:
    """``run_summary``'s figures (or the same read back from JSON) as (label, text) rows: held-out accuracy
    with its paired gain, greedy, answer rates, F, alpha and beta, budgets, verdicts, the last update."""
    rows: list[tuple[str, str]] = []
    latest = s.get("latest_step")
    last = s.get("last_step_done")
    step_line = f"{s.get('step_dirs', 0)} directories, last done {'-' if last is None else last}"
    rows.append(("steps", step_line + f", {s.get('total_rollouts', 0):,} rollouts"))
    rows += _rollout_rows(s)
    if latest is not None and not s.get("finished"):
        rows.append(("latest step", f"{latest['step']}: " + (", ".join(latest.get("tables") or []) or "nothing yet")))
    rows += _heldout_rows(s)
    rows += _capability_rows(s.get("capability") or {})
    rows += _budget_rows(s.get("budget"))
    verdicts = s.get("verdicts") or {}
    if verdicts:
        total = sum(verdicts.values())
        cells = [f"{k} {v:,} ({v / total:.0%})" if total else f"{k} {v:,}" for k, v in verdicts.items()]
        rows.append(("verdicts", "  ".join(cells)))
    gap = s.get("logprob_gap") or {}
    if gap.get("max") is not None:
        text = f"mean over steps {_num(gap.get('mean'), '.2e')}, largest token {gap['max']:.2e}"
        rows.append(("train/rollout log-prob gap", text))
    quiet = s.get("no_signal") or {}
    if quiet.get("steps"):
        n, done = len(quiet["steps"]), s.get("steps_done", 0)
        text = f"steps {step_ranges(quiet['steps'])} ({n} of {done}, {quiet['longest']} in a row): every group's "
        rows.append(("no signal", f"{text}rollouts scored alike, so the update learned nothing there; {NO_SIGNAL_FIX}"))
    rows += mechanism_rows(s.get("mechanisms"))
    upd = s.get("last_update")
    if upd:
        cells = [f"{k} {_num(upd[k], '.4g')}" for k in UPDATE_FIELDS if k in upd and k != "lr"]
        rows.append(("last update", f"step {upd['step']}: " + "  ".join(cells)))
    return rows


def _rollout_rows(s: dict[str, Any]) -> list[tuple[str, str]]:
    """What the run generated (every round, pilot and dropped group) against what its updates trained on."""
    generated, trained = s.get("total_rollouts", 0), s.get("rollouts_trained")
    if not trained:
        return []
    tokens = s.get("tokens_generated")
    token_text = f"; tokens {tokens:,} generated, {s.get('tokens_trained', 0):,} trained" if tokens is not None else ""
    return [("rollouts", f"{generated:,} generated, {trained:,} trained ({trained / generated:.0%}){token_text}")]


AGES_SHOWN = 5  # the text rows show estimates of ages 1 .. 5 one by one and the older ones together


def mechanism_rows(m: dict[str, Any] | None) -> list[tuple[str, str]]:
    """``run_summary``'s ``mechanisms`` as rows: N_eff, mixed groups, first solved and pass@2, the estimates
    against the realized pass rates, and the same by the estimates' age.

    >>> m = {"steps": 2, "prompts": 8.0, "effective_prompts": 3.25, "mixed_groups": 5.5, "first_solved": 7,
    ...      "train_pass_at_2": 0.5, "estimated": 12, "estimate_mae": 0.2, "estimate_bias": 0.125,
    ...      "estimate_corr": 0.5, "estimate_age_mean": 1.5,
    ...      "by_age": [{"age": 1, "prompts": 6, "estimate_mae": 0.1, "estimate_bias": 0.05},
    ...                 {"age": 2, "prompts": 2, "estimate_mae": 0.3, "estimate_bias": 0.2},
    ...                 {"age": 7, "prompts": 1, "estimate_mae": 0.5, "estimate_bias": -0.5},
    ...                 {"age": 9, "prompts": 3, "estimate_mae": 0.1, "estimate_bias": 0.1}]}
    >>> for label, text in mechanism_rows(m):
    ...     print(f"{label:<16} {text}")
    mechanisms       means over 2 steps: N_eff 3.25, mixed groups 5.5 of 8.0 prompts, pass@2 0.500; first solved 7
      estimates      MAE 0.200, bias +0.125 (realized - estimate), r 0.50, age 1.5 steps (12 estimated prompts)
      by age         1: 6 prompts MAE 0.100 bias +0.050  2: 2 prompts MAE 0.300 bias +0.200  >5: 4 prompts MAE 0.200 \
bias -0.050
    """
    if not m:
        return []
    text = (
        f"means over {m['steps']} steps: N_eff {_num(m.get('effective_prompts'), '.2f')}, mixed groups "
        f"{_num(m.get('mixed_groups'), '.1f')} of {_num(m.get('prompts'), '.1f')} prompts, pass@2 "
        f"{_num(m.get('train_pass_at_2'), '.3f')}; first solved {m.get('first_solved', 0)}"
    )
    rows = [("mechanisms", text)]
    if not m.get("estimated"):
        return [*rows, ("  estimates", "none yet (no prompt had an estimate when it was allocated)")]
    text = (
        f"MAE {_num(m.get('estimate_mae'), '.3f')}, bias {_num(m.get('estimate_bias'), '+.3f')} (realized - "
        f"estimate), r {_num(m.get('estimate_corr'), '.2f')}, age {_num(m.get('estimate_age_mean'), '.1f')} "
        f"steps ({m['estimated']:,} estimated prompts)"
    )
    rows.append(("  estimates", text))
    ages = m.get("by_age") or []
    shown = [a for a in ages if a["age"] <= AGES_SHOWN]
    older = [a for a in ages if a["age"] > AGES_SHOWN]
    if older:
        n = sum(a["prompts"] for a in older)
        means = {k: sum(a[k] * a["prompts"] for a in older) / n for k in ("estimate_mae", "estimate_bias")}
        shown.append({"age": f">{AGES_SHOWN}", "prompts": n, **means})
    if shown:
        cells = [
            f"{a['age']}: {a['prompts']:,} prompts MAE {_num(a['estimate_mae'], '.3f')} bias "
            f"{_num(a['estimate_bias'], '+.3f')}"
            for a in shown
        ]
        rows.append(("  by age", "  ".join(cells)))
    return rows


def _heldout_rows(s: dict[str, Any]) -> list[tuple[str, str]]:
    heldout = s.get("heldout") or []
    if not heldout:
        return [("held-out acc", "no eval yet")]
    first, last = heldout[0], heldout[-1]
    at = ", ".join(str(h["step"]) for h in heldout)
    acc = f"{_num(first.get('accuracy'), '.3f')} -> {_num(last.get('accuracy'), '.3f')}"
    rows = [("held-out acc", f"{acc}  (step {first['step']} -> step {last['step']}; evaluated at {at})")]
    a, b = first.get("by_difficulty") or {}, last.get("by_difficulty") or {}
    levels = _sorted_levels(set(a) | set(b))
    if levels:
        rows.append(
            ("  by difficulty", "  ".join(f"L{k} {_num(a.get(k), '.2f')}->{_num(b.get(k), '.2f')}" for k in levels))
        )
    before, after = s.get("heldout_before") or {}, s.get("heldout_after") or {}
    for name, g in (s.get("heldout_gain") or {}).items():  # avg@k, paired by prompt: step 0 -> the latest eval
        sets = [(x.get("test_sets") or {}).get(name) or {} for x in (before, after)]
        b, a = (before, after) if name == MAIN_TEST_SET else sets
        se = f" ± {g['se']:.3f} s.e." if g.get("se") is not None else ""
        acc = f"{name}: {_num(b.get('accuracy'), '.3f')} -> {_num(a.get('accuracy'), '.3f')}"
        rows.append(("  gain", f"{acc}, {_num(g.get('gain'), '+.3f')}{se} over {g.get('prompts', 0)} prompts"))
    for key, label, what in (
        ("greedy", "greedy", ""),
        ("answered", "answered", " (share of completions with an answer)"),
        ("boxed", "boxed", " (share of completions with \\boxed{})"),
    ):
        b0, b1 = before.get(key), after.get(key)
        if b0 is not None and b1 is not None and (key != "boxed" or b0 > 0 or b1 > 0):
            rows.append((f"  {label}", f"{b0:.3f} -> {b1:.3f}{what}"))
    p0, p1 = before.get("pass_at_k") or {}, after.get("pass_at_k") or {}
    ks = [k for k in p1 if k in p0 and k != "1"]  # pass@1 is avg@k, shown above
    if ks:
        rows.append(("  pass@k", "  ".join(f"@{k} {p0[k]:.3f} -> {p1[k]:.3f}" for k in ks)))
    return rows


def _capability_rows(cap: dict[str, Any]) -> list[tuple[str, str]]:
    first, last = cap.get("first"), cap.get("latest")
    if not (first and last):
        return [("failure rate F", "no capability table yet")]
    f0, f1 = _num(first.get("F"), ".3f"), _num(last.get("F"), ".3f")
    a0, b0 = _num(first.get("alpha_used"), ".2f"), _num(first.get("beta_used"), ".2f")
    a1, b1 = _num(last.get("alpha"), ".2f"), _num(last.get("beta"), ".2f")
    return [
        ("failure rate F", f"{f0} -> {f1}  (step {first['step']} -> step {last['step']})"),
        ("alpha, beta", f"({a0}, {b0}) used at step {first['step']} -> ({a1}, {b1}) after step {last['step']}"),
    ]


def _budget_rows(budget: dict[str, Any] | None) -> list[tuple[str, str]]:
    if not budget:
        return [("budget", "no done step yet")]
    text = f"min {_num(budget.get('min'), 'g')}  mean {_num(budget.get('mean'), '.2f')}  "
    text += f"max {_num(budget.get('max'), 'g')}  over {budget.get('steps')} steps ({budget.get('rows'):,} prompts)"
    rows = [("budget", text)]
    by_level = budget.get("mean_by_difficulty") or {}
    if by_level:
        levels = "  ".join(f"L{k} {_num(by_level[k], '.1f')}" for k in _sorted_levels(by_level))
        rows.append(("  by difficulty", levels))
    return rows


def _num(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return format(value, spec)


def _sorted_levels(levels: Any) -> list[str]:
    """Difficulty keys (strings, from JSON) in numeric order when they are numbers."""
    return sorted(levels, key=lambda k: (0, float(k), "") if _is_number(k) else (1, 0.0, str(k)))


def _is_number(text: Any) -> bool:
    try:
        float(text)
    except (TypeError, ValueError):
        return False
    return True
