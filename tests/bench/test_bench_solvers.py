"""The allocation benchmark: its reference heap is Algorithm 1, and the report has every figure."""

import math

import numpy as np

from coba_tasks.bench.solvers_bench import bench_allocate, format_allocate, plain_python_heap
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
