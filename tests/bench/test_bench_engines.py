"""The engines' benchmarks: every verifier item counted, the rollout figures reported (no timing judged)."""

import math


def test_bench_verify_counts_every_item():
    from coba_tasks.bench.engines_bench import bench_verify, format_verify

    result = bench_verify(arith_items=200, math_items=12, workers=1)
    assert sum(result["arith"]["verdicts"].values()) == 200
    assert result["arith"]["verdicts"]["correct"] > 0 and result["arith"]["verdicts"]["wrong"] > 0
    assert sum(result["math"]["verdicts"].values()) == 12
    assert result["math"]["verdicts"]["correct"] >= 6  # two in three items are right answers
    assert "items/s" in format_verify(result)


def test_bench_rollout_on_the_transformers_backend(random_checkpoints):
    from coba_tasks.bench.engines_bench import bench_rollout, format_rollout

    a, _ = random_checkpoints
    result = bench_rollout(str(a), prompts=3, group_size=2, max_tokens=4, backends=("transformers",))
    r = result["backends"]["transformers"]
    assert r["completions"] == 6 and r["tokens"] > 0
    # times are reported, not judged: finite and non-negative, and the rate is their quotient
    assert all(math.isfinite(r[k]) and r[k] >= 0 for k in ("start_s", "generate_s", "tokens_per_s"))
    assert r["tokens_per_s"] == r["tokens"] / r["generate_s"]
    assert "transformers" in format_rollout(result)
