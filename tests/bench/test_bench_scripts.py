"""The retired benchmarks, now scripts (``scripts/bench_eval.py``, ``scripts/bench_lora.py``): ``bench_eval`` on the
tiny model measures the same before and now and reports every figure (no timing judged); both scripts parse their
options and word their figures."""

from __future__ import annotations

import json
import math

import pytest
from scripts_loader import load_script


@pytest.mark.slow
def test_bench_eval_measures_the_same_both_ways(random_checkpoints, capsys):
    script = load_script("scripts/bench_eval.py")

    model, _ = random_checkpoints
    args = ["--config", "configs/tiny-test.yaml", "--repeats", "1", "--json"]
    for override in (
        f"model.path={model}",
        "run.eval_samples=4",
        "run.eval_temperature=1.0",
        "data.eval_prompts=6",
        "run.eval_top_p=0.8",
    ):
        args += ["--set", override]
    assert script.main(args) == 0
    out = capsys.readouterr().out
    result = json.loads(out)
    assert out.count("\n") == 1 and result["same_figures"] is True and result["prompts"] == 6
    assert set(result["seconds"]) == {"separate", "one_call_sort", "one_call", "sampled_only"}
    assert all(math.isfinite(v) and v > 0 for v in result["seconds"].values())
    assert 0 <= result["accuracy"] <= 1 and math.isfinite(result["now_over_before"])
    assert math.isfinite(result["sort_free_over_sort"])
    with pytest.raises(ValueError, match=r"needs run\.eval_samples >= 2"):
        script.bench_eval("configs/tiny-test.yaml", [f"model.path={model}"], progress=lambda m: None)


def test_bench_eval_script_refuses_bad_input(capsys):
    script = load_script("scripts/bench_eval.py")

    with pytest.raises(SystemExit):
        script.main(["--repeats", "0"])
    assert "must be a positive integer, got 0" in capsys.readouterr().err
    assert script.main(["--config", "configs/no-such.yaml"]) == 2  # a message, not a traceback
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "does not exist" in err and "Traceback" not in err


def test_bench_lora_script_words_its_figures(capsys):
    script = load_script("scripts/bench_lora.py")

    with pytest.raises(SystemExit) as exit_info:
        script.main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert all(f"--{name}" in text for name in ("checkpoint", "model", "test", "prompts", "n", "lora-rank", "json"))
    side = {"per_update_s": 2.01, "generate_s": 70.6, "tokens_per_s": 129.1, "gap_mean": 6.2e-6, "gap_max": 6.2e-5}
    result = {"checkpoint": "ckpt", "rank": 16, "base": "base", "prompts": 32, "group_size": 8, "max_tokens": 48}
    result |= {"merged": side, "vllm_lora": {**side, "tokens_per_s": 25.4}}
    result |= {"vllm_lora_over_merged_tokens_per_s": 25.4 / 129.1, "same_completions": 1.0}
    text = script.format_lora(result)
    assert "ckpt (rank 16) on base; 32 prompts x 8, at most 48 tokens" in text
    assert "per update   2.01 s" in text and "( 129.1 tokens/s)" in text and "gap mean 6.2e-06" in text
    assert "vLLM LoRA / merged tokens per second: 0.20; completions equal: 100%" in text
