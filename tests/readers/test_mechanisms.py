"""The mechanisms of a run per step (coba_tasks.readers.mechanisms) from a hand-made run directory: the
estimates the allocation used against the realized pass rates, N_eff, mixed groups, first solved, pass@2."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from coba_tasks.core.grpo import effective_prompts
from coba_tasks.pipeline.store import RunStore, Table
from coba_tasks.readers import mechanisms
from coba_tasks.readers.figures import run_summary
from coba_tasks.readers.tables import load_run
from coba_tasks.readers.text import summary_rows

NAN = math.nan

# Three steps. Rollouts: (prompt, verdicts "c"orrect / "w"rong, tokens per rollout).
# step 0: uniform, nothing seen; a 2/4, b 0/4, c 4/4.             update says N_eff 1.0
# step 1: budget with estimate_age; a est 0.5 age 1 -> 5/6, b est 0 age 1 -> 1/2, d unseen -> 0/4.
#         update without effective_prompts: N_eff from tokens over the mixed a (6 x 10) and b (2 x 20)
# step 2: a budget made before estimate_age: the ages come from history(1);
#         c est 1 (last visit 0: age 2) -> 1/2, a est 5/6 age 1 -> 2/2, d est 0 age 1 -> 2/4.  N_eff 2.5
STEPS = {
    0: [("a", "ccww", 3), ("b", "wwww", 3), ("c", "cccc", 3)],
    1: [("a", "cccccw", 10), ("b", "cw", 20), ("d", "wwww", 7)],
    2: [("c", "cw", 5), ("a", "cc", 5), ("d", "ccww", 5)],
}
ESTIMATES = {0: [NAN, NAN, NAN], 1: [0.5, 0.0, NAN], 2: [1.0, 5 / 6, 0.0]}
AGES = {0: [NAN, NAN, NAN], 1: [1.0, 1.0, NAN], 2: None}  # None: the column is absent
N_EFF = {0: 1.0, 1: None, 2: 2.5}  # None: the update table has no effective_prompts


def _history(step: int) -> pd.DataFrame:
    last: dict[str, int] = {}
    for s in range(step + 1):
        last |= {pid: s for pid, _, _ in STEPS[s]}
    ids = sorted(last)
    return pd.DataFrame({"prompt_id": ids, "pass_rates": [[0.5]] * len(ids), "last_step": [last[i] for i in ids]})


def make_run(root: Path) -> RunStore:
    store = RunStore(root)
    store.create(config_dict={"run": {"steps": 3}, "allocation": {"strategy": "coba"}}, config_hash="h", versions={})
    for step, groups in STEPS.items():
        budget = {
            "prompt_id": [g[0] for g in groups],
            "pass_rate_est": ESTIMATES[step],
            "budget": [len(g[1]) for g in groups],
        }
        if AGES[step] is not None:
            budget["estimate_age"] = AGES[step]
        store.write_table(step, Table.BUDGET, pd.DataFrame(budget))
        rows = [(pid, j, v, tokens) for pid, verdicts, tokens in groups for j, v in enumerate(verdicts)]
        ids, idx = [r[0] for r in rows], [r[1] for r in rows]
        store.write_table(
            step,
            Table.ROLLOUTS,
            pd.DataFrame({"prompt_id": ids, "sample_idx": idx, "n_tokens": [r[3] for r in rows]}),
        )
        correct = [r[2] == "c" for r in rows]
        rewards = pd.DataFrame(
            {
                "prompt_id": ids,
                "sample_idx": idx,
                "reward": np.array(correct, dtype=np.float64),
                "verdict": ["correct" if c else "wrong" for c in correct],
            }
        )
        store.write_table(step, Table.REWARDS, rewards)
        store.write_table(step, Table.HISTORY, _history(step))
        update = {"step": step, "loss": 0.0}
        if N_EFF[step] is not None:
            update |= {"prompt_weighting": "tokens", "effective_prompts": N_EFF[step]}
        store.write_table(step, Table.UPDATE, pd.DataFrame([update]))
    return store


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_run(tmp_path_factory.mktemp("runs") / "m").root


CORR_2 = 36 / math.sqrt(186 * 54)  # estimates (1, 5/6, 0) against realized (1/2, 1, 1/2)


def test_each_step_measures_the_estimates_against_the_realized_pass_rates(run: Path):
    s = mechanisms.run_mechanisms(load_run(run)).steps.set_index("step")
    assert s.index.tolist() == [0, 1, 2] and list(s.reset_index().columns) == list(mechanisms.STEP_COLUMNS)
    assert s["prompts"].tolist() == [3, 3, 3] and s["estimated"].tolist() == [0, 2, 3]
    assert math.isnan(s.loc[0, "estimate_mae"]) and math.isnan(s.loc[0, "estimate_corr"])
    # step 1: |5/6 - 1/2| = 1/3 and |1/2 - 0| = 1/2, both did better than estimated; 2 prompts: no correlation
    assert s.loc[1, "estimate_mae"] == pytest.approx(5 / 12) and s.loc[1, "estimate_bias"] == pytest.approx(5 / 12)
    assert math.isnan(s.loc[1, "estimate_corr"]) and s.loc[1, "estimate_age_mean"] == 1.0
    # step 2 (no estimate_age column: ages from history(1)): errors -1/2, +1/6, +1/2
    assert s.loc[2, "estimate_mae"] == pytest.approx(7 / 18) and s.loc[2, "estimate_bias"] == pytest.approx(1 / 18)
    assert s.loc[2, "estimate_corr"] == pytest.approx(CORR_2) and s.loc[2, "estimate_age_mean"] == pytest.approx(4 / 3)


def test_each_step_counts_mixed_groups_first_solved_pass_at_2_and_n_eff(run: Path):
    s = mechanisms.run_mechanisms(load_run(run)).steps.set_index("step")
    assert s["mixed_groups"].tolist() == [1, 2, 2]  # a; a and b; c and d
    assert s["first_solved"].tolist() == [2, 1, 1]  # a and c; b; d
    # pass@2 = 1 - C(n - c, 2) / C(n, 2) per group: (5/6, 0, 1), (1, 1, 0), (1, 1, 5/6)
    assert s["train_pass_at_2"].tolist() == pytest.approx([11 / 18, 2 / 3, 17 / 18])
    # step 1 from its tables: W_a = 6 x 10 = 60, W_b = 2 x 20 = 40 (d is not mixed): 100^2 / (60^2 + 40^2)
    assert s["effective_prompts"].tolist() == pytest.approx([1.0, 10_000 / 5_200, 2.5])


def test_the_token_n_eff_is_the_updates_with_every_weight_one():
    ro = pd.DataFrame(
        {"prompt_id": list("aaabbcc"), "sample_idx": [0, 1, 2, 0, 1, 0, 1], "n_tokens": [3, 9, 4, 2, 8, 5, 5]}
    )
    reward = [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0]  # c all alike: no gradient
    mine = mechanisms.token_effective_prompts(ro, ro.assign(reward=reward))
    adv = torch.tensor([1.0, -0.5, -0.5, 1.0, -1.0, 0.0, 0.0])
    groups, lengths = torch.tensor([0, 0, 0, 1, 1, 2, 2]), torch.tensor([3, 9, 4, 2, 8, 5, 5])
    assert mine == pytest.approx(effective_prompts(groups, lengths, torch.ones(7), adv)) and mine == 26**2 / (
        16**2 + 10**2
    )
    assert mechanisms.token_effective_prompts(ro, ro.assign(reward=1.0)) == 0.0
    assert math.isnan(mechanisms.token_effective_prompts(ro.drop(columns="n_tokens"), ro.assign(reward=reward)))


def test_by_age_and_the_run_summary(run: Path):
    m = mechanisms.run_mechanisms(load_run(run))
    rows = m.rows.set_index(["step", "prompt_id"])
    assert rows.loc[(2, "c"), "age"] == 2.0 and rows.loc[(1, "d"), "seen"] == False  # noqa: E712
    assert rows.loc[(1, "a"), "realized"] == pytest.approx(5 / 6) and math.isnan(rows.loc[(1, "d"), "estimate"])
    ages = mechanisms.by_age(m.rows)
    assert ages["age"].tolist() == [1, 2] and ages["prompts"].tolist() == [4, 1]
    # age 1: +1/3, +1/2 (step 1), +1/6, +1/2 (step 2); age 2: -1/2
    assert ages["estimate_mae"].tolist() == pytest.approx([0.375, 0.5])
    assert ages["estimate_bias"].tolist() == pytest.approx([0.375, -0.5])

    summary = run_summary(run)["mechanisms"]
    assert (summary["steps"], summary["estimated"], summary["first_solved"]) == (3, 5, 4)
    assert summary["estimate_mae"] == pytest.approx((5 / 12 + 7 / 18) / 2)  # steps with an estimate
    assert summary["effective_prompts"] == pytest.approx((1.0 + 10_000 / 5_200 + 2.5) / 3)
    assert summary["mixed_groups"] == pytest.approx(5 / 3) and summary["train_pass_at_2"] == pytest.approx(20 / 27)
    assert [a["age"] for a in summary["by_age"]] == [1, 2]
    shown = dict(summary_rows(run_summary(run)))
    assert shown["mechanisms"].startswith("means over 3 steps: N_eff 1.81, mixed groups 1.7 of 3.0 prompts, pass@2")
    assert shown["  estimates"].startswith("MAE 0.403, bias +0.236 (realized - estimate), r 0.36, age 1.2 steps")
    assert shown["  by age"] == "1: 4 prompts MAE 0.375 bias +0.375  2: 1 prompts MAE 0.500 bias -0.500"


def test_a_run_without_rewards_has_no_mechanisms(tmp_path: Path):
    store = RunStore(tmp_path / "r")
    store.create(config_dict={"run": {"steps": 1}}, config_hash="h", versions={})
    store.write_table(0, Table.BUDGET, pd.DataFrame({"prompt_id": ["a"], "budget": [2]}))
    m = mechanisms.run_mechanisms(load_run(store.root))
    assert m.steps.empty and list(m.steps.columns) == list(mechanisms.STEP_COLUMNS)
    assert mechanisms.mechanism_summary(m) is None and mechanisms.by_age(m.rows).empty
    assert "mechanisms" not in dict(summary_rows(run_summary(store.root)))
