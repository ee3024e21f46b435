"""scripts/allocation_regime.py: CoBA-RL's concentration by prompts per step, from a comparison's kept tables."""

from __future__ import annotations

import json

import numpy as np
import pytest
from scripts_loader import ROOT, load_script

KEPT = ROOT / "docs" / "compare-explore"


def test_a_group_is_mixed_with_the_binomial_probability_and_never_at_0_or_1():
    script = load_script("scripts/allocation_regime.py")
    got = script.mixed_probability(np.array([2.0, 2.0, 8.0, 3.0]), np.array([0.5, 0.0, 1.0, 0.25]))
    assert got.tolist() == pytest.approx([0.5, 0.0, 0.0, 1 - 0.25**3 - 0.75**3])


def test_when_floor_and_cap_equal_the_group_size_coba_is_uniform_and_so_are_its_figures():
    script = load_script("scripts/allocation_regime.py")
    draw, shapes = script.estimate_sampler(KEPT, "coba")
    (row,) = script.regime_rows(draw, shapes, [16], [8], [8], [8], draws=5, seed=0)
    assert row["budget_neff"] == pytest.approx(1.0)
    assert row["update_neff"] == pytest.approx(row["uniform_update_neff"])
    assert row["at_cap"] == pytest.approx(1.0)


def test_coba_concentrates_a_share_of_the_batch_so_its_update_rests_on_more_prompts_as_the_batch_grows():
    script = load_script("scripts/allocation_regime.py")
    draw, shapes = script.estimate_sampler(KEPT, "coba")
    small, large = script.regime_rows(draw, shapes, [16, 64], [8], [32], [2], draws=20, seed=0)
    for row in (small, large):
        assert 0 < row["budget_neff"] < 0.6 and row["update_neff"] < row["uniform_update_neff"]
        assert 0 < row["to_0_or_1"] < 1 and 0 <= row["at_cap"] <= 1
    assert large["update_neff"] > 2.5 * small["update_neff"]
    # a floor above the group size, or a group size above the cap, is not a valid allocation: no row
    assert script.regime_rows(draw, shapes, [16], [8], [32], [16], draws=1, seed=0) == []


def test_the_script_prints_rows_as_json_and_refuses_what_it_cannot_use(capsys, tmp_path):
    script = load_script("scripts/allocation_regime.py")
    args = ["--kept", str(KEPT), "--prompts", "16", "--group-size", "8", "--max-budget", "32", "--min-budget", "2,4"]
    assert script.main([*args, "--draws", "3", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["min_budget"] for r in rows] == [2, 4] and all(r["prompts"] == 16 for r in rows)
    with pytest.raises(SystemExit):
        script.main([*args, "--strategy", "nope"])
    assert "has no runs of strategy 'nope'; it has coba" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        script.main(["--kept", str(tmp_path)])
    assert "budget_by_pass_rate.parquet does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        script.main([*args, "--prompts", "16,x"])
    assert "expected comma-separated integers" in capsys.readouterr().err
