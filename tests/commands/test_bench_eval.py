"""`coba bench eval` on the tiny model: before and now measure the same, every figure is there (no timing judged)."""

from __future__ import annotations

import json
import math

import pytest


@pytest.mark.slow
def test_bench_eval_measures_the_same_both_ways(random_checkpoints, capsys):
    from coba_tasks.commands.cli import main

    model, _ = random_checkpoints
    args = ["bench", "eval", "--config", "configs/tiny-test.yaml", "--repeats", "1", "--json"]
    for override in (
        f"model.path={model}",
        "run.eval_samples=4",
        "run.eval_temperature=1.0",
        "data.eval_prompts=6",
        "run.eval_top_p=0.8",
    ):
        args += ["--set", override]
    assert main(args) == 0
    out = capsys.readouterr().out
    result = json.loads(out)
    assert out.count("\n") == 1 and result["same_figures"] is True and result["prompts"] == 6
    assert set(result["seconds"]) == {"separate", "one_call_sort", "one_call", "sampled_only"}
    assert all(math.isfinite(v) and v > 0 for v in result["seconds"].values())
    assert 0 <= result["accuracy"] <= 1 and math.isfinite(result["now_over_before"])
    assert math.isfinite(result["sort_free_over_sort"])
    with pytest.raises(ValueError, match=r"needs run\.eval_samples >= 2"):
        from coba_tasks.commands.bench_eval import bench_eval

        bench_eval("configs/tiny-test.yaml", [f"model.path={model}"], progress=lambda m: None)
