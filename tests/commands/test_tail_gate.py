"""scripts/tail_gate.py: the pre-registered gate's criteria on synthetic tables of one uniform run."""

from __future__ import annotations

import pandas as pd
import pytest
from scripts_loader import load_script

tail_gate = load_script("scripts/tail_gate.py")


def _levels(hard_rate, alike=10, learnable=4):
    """16 steps, 8 groups of level 0 and 8 of level 1 a step; level 1's pass rate by step ``hard_rate(step)``."""
    rows = []
    for step in range(16):
        rows.append({"step": step, "difficulty": 0, "groups": 8, "alike": alike // 2, "pass_rate": 0.9})
        rows.append(
            {"step": step, "difficulty": 1, "groups": 8, "alike": alike - alike // 2, "pass_rate": hard_rate(step)}
        )
    frame = pd.DataFrame(rows)
    frame["wrong_learnable"] = [learnable if r.difficulty == 1 else 0 for r in frame.itertuples()]
    return frame


def _results(at0, at8, at16):
    return pd.DataFrame({"step": [0, 8, 16], "accuracy_level1": [at0, at8, at16]})


def test_a_pool_that_passes_every_criterion_goes_to_the_arms():
    out = tail_gate.gate(_levels(lambda s: 0.03 if s < 3 else 0.2), _results(0.03, 0.15, 0.3), hard=1, last=16)
    figures = {name.split()[0]: v for name, v in out["criteria"].items()}
    assert figures["G1"] == (10 / 16, True) and figures["G2"] == (4 / 16, True)
    assert figures["G3"] == ((pytest.approx(0.03), pytest.approx(0.2)), True) and figures["G4"][1]
    assert out["passed"] and out["next"].endswith("the arms run as planned")


def test_a_small_late_gain_extends_the_runs_to_24_steps():
    out = tail_gate.gate(_levels(lambda s: 0.03 if s < 3 else 0.2), _results(0.03, 0.29, 0.30), hard=1, last=16)
    assert out["passed"] and "below 0.03, so the arms run 24 steps" in out["next"]


@pytest.mark.parametrize(
    ("rate", "held", "expected"),
    [
        (lambda s: 0.01, (0.02, 0.03, 0.04), "fallback (a)"),  # level 1 never learned
        (lambda s: 0.1 if s < 3 else 0.8, (0.2, 0.7, 0.9), "fallback (b)"),  # saturated by step 8
        (lambda s: 0.1 if s < 3 else 0.15, (0.1, 0.12, 0.13), "no fallback fits (c)"),  # learned too little
    ],
)
def test_a_failed_gate_names_the_fallback_the_plan_fixed(rate, held, expected):
    out = tail_gate.gate(_levels(rate), _results(*held), hard=1, last=16)
    assert not out["passed"] and out["next"].startswith(expected)


def test_too_few_alike_or_learnable_groups_fail_g1_and_g2():
    out = tail_gate.gate(
        _levels(lambda s: 0.03 if s < 3 else 0.2, alike=4, learnable=1), _results(0.03, 0.15, 0.3), 1, 16
    )
    verdicts = {name.split()[0]: ok for name, (_, ok) in out["criteria"].items()}
    assert verdicts == {"G1": False, "G2": False, "G3": True, "G4": True} and not out["passed"]
