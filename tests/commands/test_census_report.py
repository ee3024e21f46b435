"""scripts/census_report.py: the census's rules (band, stop rule, the gate's all-wrong groups, carry/borrow) on
synthetic census tables of the real problem files."""

from __future__ import annotations

import pandas as pd
import pytest
from scripts_loader import ROOT, load_script

from coba_tasks.pipeline.data import load_dataset

census_report = load_script("scripts/census_report.py")


def test_a_problem_needs_a_carry_or_a_borrow_column_by_column():
    needs = census_report.needs_carry_or_borrow
    assert [needs(f"Compute {p}. End.") for p in ("8+56", "30+9", "95+4", "44-5", "4-6", "46-30", "30-46")] == [
        True,
        False,
        False,
        True,
        False,
        False,
        False,
    ]
    assert needs("Compute 52-38.") and needs("Compute 38-52.")  # 8 > 2: a borrow whichever way round
    with pytest.raises(ValueError, match="not a problem"):
        needs("Compute 3*4.")


def test_the_band_is_1_to_6_of_32_and_2_to_12_of_64():
    c32 = census_report.classes(pd.Series([0, 1, 6, 7, 32]), 32)
    assert c32 == {"none": 1, "below": 0, "band": 2, "above": 2}
    c64 = census_report.classes(pd.Series([0, 1, 2, 12, 13]), 64)
    assert c64 == {"none": 1, "below": 1, "band": 2, "above": 1}


def _table(ids, levels, solved, samples):
    return pd.DataFrame(
        {
            "prompt_id": ids,
            "difficulty": levels,
            "samples": samples,
            "solved": solved,
            "accuracy": [s / samples for s in solved],
        }
    )


def _folder(tmp_path, pool_l1_band: int, unused_band: int, held_out_band: int):
    """Census tables whose band counts are the arguments; the gate's visits: level-1 all-wrong groups of the first
    pool prompt at steps 5 and 11, of the second at step 8."""
    pool = load_dataset(ROOT / census_report.POOL_FILE)
    ids, levels = pool["prompt_id"].tolist(), pool["difficulty"].tolist()
    l1 = [i for i, lv in zip(ids, levels, strict=True) if lv == 1][:24]
    l0 = [i for i, lv in zip(ids, levels, strict=True) if lv == 0][:24]
    for k in (4, 8, 12):
        solved_l1 = [3] * pool_l1_band + [0] * (24 - pool_l1_band)
        if k == 12:
            solved_l1[0] = 0  # the first prompt: solved at checkpoint 4, never at 12
        _table(l0 + l1, [0] * 24 + [1] * 24, [64] * 24 + solved_l1, 64).to_parquet(tmp_path / f"pool-{k}.parquet")
    for name, (path, level) in census_report.CANDIDATES.items():
        data = load_dataset(ROOT / path)
        cand = data[data["difficulty"] == level]["prompt_id"].tolist()[:100]
        band = unused_band if name == "train-l1-unused" else (held_out_band if name == "test-l1" else 0)
        _table(cand, level, [2] * band + [0] * (len(cand) - band), 32).to_parquet(tmp_path / f"{name}.parquet")
    visits = pd.DataFrame(
        {"step": [5, 11, 8, 8], "prompt_id": [l1[0], l1[0], l1[1], l0[0]], "level": [1, 1, 1, 0]}
        | {"successes": [0, 0, 0, 0], "generated": [8, 8, 8, 8]}
    )
    visits.to_parquet(tmp_path / "gate-prompt-visits.parquet")
    return tmp_path


def test_enough_band_problems_go_on_and_one_fewer_stops(tmp_path):
    figures = census_report.census(_folder(tmp_path, pool_l1_band=4, unused_band=20, held_out_band=60), ROOT)
    assert (figures["training_band"], figures["held_out_band"], figures["stop"]) == (24, 60, False)
    pool4 = next(c for c in figures["counts"] if c["set"].startswith("pool at checkpoint 4") and c["level"] == 1)
    assert (pool4["n"], pool4["band"], pool4["none"]) == (24, 4, 20)
    figures = census_report.census(_folder(tmp_path, pool_l1_band=4, unused_band=19, held_out_band=60), ROOT)
    assert (figures["training_band"], figures["stop"]) == (23, True)
    figures = census_report.census(_folder(tmp_path, pool_l1_band=4, unused_band=20, held_out_band=59), ROOT)
    assert (figures["held_out_band"], figures["stop"]) == (59, True)


def test_the_gates_all_wrong_groups_are_read_at_the_nearest_checkpoint(tmp_path):
    figures = census_report.census(_folder(tmp_path, pool_l1_band=2, unused_band=30, held_out_band=70), ROOT)
    # level 1 only: prompt 0 at step 5 (checkpoint 4: solved 3) and 11 (checkpoint 12: 0), prompt 1 at 8 (8: 3)
    assert (figures["wrong_groups"], figures["wrong_prompts"], figures["wrong_with_success"]) == (3, 2, 2)
    never, solved = figures["fisher_table"]
    assert sum(never) == 22 and sum(solved) == 2  # never solved in 3 x 64: all but the two band prompts
