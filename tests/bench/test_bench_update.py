"""`coba bench update` on the tiny model: the figures are there and the two updates agree (no timings judged)."""

from __future__ import annotations

import json
import math

import pytest

from coba_tasks.bench.update_bench import bench_update, format_update, synthetic_batch


def test_synthetic_batch_shapes_groups_like_a_coba_step():
    prompts, completions, adv = synthetic_batch([2, 5], prompt_tokens=7, completion_tokens=3, vocab=50)
    assert len(prompts) == len(completions) == len(adv) == 7
    assert len({tuple(p) for p in prompts}) == 2 and prompts[0] == prompts[1] and prompts[2] == prompts[6]
    assert all(len(p) == 7 for p in prompts) and all(len(c) == 3 for c in completions)


@pytest.mark.slow
def test_bench_update_reports_agreement_and_every_figure(tied_checkpoints, capsys):
    from coba_tasks.commands.cli import main

    result = bench_update(
        str(tied_checkpoints[0]), groups=[2, 3, 6], prompt_tokens=9, completion_tokens=5, repeats=1, lora_rank=4
    )
    agree = result["agreement"]
    assert agree["loss_plain"] == pytest.approx(agree["loss_project"], rel=1e-5, abs=1e-7)
    assert agree["grad_max_rel_diff"] < 1e-5 and agree["grad_max_abs"] > 0
    assert agree["grad_norm_project"] == pytest.approx(agree["grad_norm_plain"], rel=1e-5)
    assert result["rollouts"] == {
        "source": "synthetic",
        "completions": 11,
        "groups": 3,
        "completion_tokens": 55,
        "prompt_tokens_per_completion": 9.0,
    }
    figures = [result["matmul_gflops"], result["speedup"], result["plain"]["seconds"], result["project"]["seconds"]]
    figures += [v for k, v in result["project"]["breakdown_s"].items() if k != "weight_reload"]
    assert all(isinstance(x, float) and math.isfinite(x) and x >= 0 for x in figures), result
    assert result["project"]["breakdown_s"]["weight_reload"] is None  # only with --reload
    # groups drawn at pass rates 0, 0.5 and 1: the first and the last are all-equal, their 8 rows are left out
    assert result["project"]["skipped_rows"] == 8 and result["skipped_row_share"] == pytest.approx(8 / 11)
    assert result["max_rel_grad_diff"] == agree["grad_max_rel_diff"] and result["speedup_vs_plain"] > 0
    lora = result["lora"]
    assert lora["rank"] == 4 and 0 < lora["trainable_parameters"] < result["parameters"] / 10
    assert lora["checkpoint_mb"] < result["project"]["checkpoint_mb"] / 2 and result["lora_speedup_vs_full"] > 0
    text = format_update(result)
    assert "speedup" in text and "agreement" in text and "LoRA rank 4" in text and "left out: 8 of 11" in text
    args = ["bench", "update", "--model", str(tied_checkpoints[0]), "--groups", "2,2", "--repeats", "1", "--json"]
    assert main([*args, "--lora-rank", "0"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1  # one JSON line
    line = json.loads(out)
    assert line["rollouts"]["completions"] == 4 and line["lora"] is None and line["lora_speedup_vs_full"] is None
    assert {"speedup_vs_plain", "max_rel_grad_diff", "lora_speedup_vs_full", "skipped_row_share"} <= set(line)
