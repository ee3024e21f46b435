"""The allocation benchmark: its reference heap is Algorithm 1, and the report has every figure."""

import math

import numpy as np

from coba_tasks.commands.bench import bench_allocate, format_allocate, plain_python_heap
from coba_tasks.core.allocation import allocate
from coba_tasks.core.values import adaptive_tau


def test_plain_python_heap_is_algorithm_1():
    rng = np.random.default_rng(11)
    for m, total in ((7, 40), (50, 800), (200, 200 * 16)):
        p = rng.uniform(size=m)
        ref = plain_python_heap(p, total, 2, 64, 3.0, 8.0, adaptive_tau(p))
        assert np.array_equal(ref, allocate(p, total, alpha=3.0, beta=8.0, max_budget=64))


def test_bench_reports_every_figure():
    result = bench_allocate(quick=True, sizes=(512, 1024))
    ps = result["paper_setting"]
    assert set(ps["seconds"]) == {"heap", "threshold", "dp", "plain_heap"}
    assert all(math.isfinite(v) and v >= 0 for v in ps["seconds"].values())  # reported, not judged
    objectives = list(ps["objective"].values())
    assert max(objectives) - min(objectives) < 1e-9 * max(objectives)  # every solver reaches the optimum
    assert ps["same_allocation"] == {"threshold_vs_heap": True, "plain_heap_vs_heap": True}
    assert [r["M"] for r in result["sweep"]] == [512, 1024]
    assert result["sweep"][0]["dp_s"] is not None  # the paper's size runs the DP
    text = format_allocate(result)
    assert "Paper setting: M = 512, B_total = 8192" in text and "dp / heap" in text and "1,024" in text


def test_bench_verify_counts_every_item():
    from coba_tasks.commands.bench import bench_verify, format_verify

    result = bench_verify(arith_items=200, math_items=12, workers=1)
    assert sum(result["arith"]["verdicts"].values()) == 200
    assert result["arith"]["verdicts"]["correct"] > 0 and result["arith"]["verdicts"]["wrong"] > 0
    assert sum(result["math"]["verdicts"].values()) == 12
    assert result["math"]["verdicts"]["correct"] >= 6  # two in three items are right answers
    assert "items/s" in format_verify(result)


def test_bench_rollout_on_the_transformers_backend(random_checkpoints):
    from coba_tasks.commands.bench import bench_rollout, format_rollout

    a, _ = random_checkpoints
    result = bench_rollout(str(a), prompts=3, group_size=2, max_tokens=4, backends=("transformers",))
    r = result["backends"]["transformers"]
    assert r["completions"] == 6 and r["tokens"] > 0
    # times are reported, not judged: finite and non-negative, and the rate is their quotient
    assert all(math.isfinite(r[k]) and r[k] >= 0 for k in ("start_s", "generate_s", "tokens_per_s"))
    assert r["tokens_per_s"] == r["tokens"] / r["generate_s"]
    assert "transformers" in format_rollout(result)
