"""``coba bench allocate``: the CoBA solvers (heap, threshold, DP) against a plain Python heap, and at scale.

Times are medians over repeats inside one process; compare the ratios, not the absolute times
(the machines are shared and noisy).

The allocation benchmark reproduces the setting of the paper's Table 4 (M = 512, B_total = 8192,
bounds [2, 128]; the paper reports heap 0.124 s, DP 115.05 s) and sweeps M up to one million.
It also times a plain Python heap, the textbook transcription of Algorithm 1 that evaluates
V(B, p) with math.exp / math.lgamma for every pop, as the reference for the optimised ``heap``.
"""

from __future__ import annotations

import heapq
import math
import platform
from collections.abc import Callable

import numpy as np

from coba_tasks.bench.timing import available_cpus, median_time
from coba_tasks.core.allocation import allocate, coba_objective
from coba_tasks.core.values import adaptive_tau

PAPER = {"M": 512, "B_total": 8192, "min_budget": 2, "max_budget": 128, "heap_s": 0.124, "dp_s": 115.05}
SWEEP_M = (512, 4096, 65_536, 1_000_000)
DP_LIMIT_S = 60.0
ALPHA, BETA = 5.5, 5.5  # the shape at a failure rate of 0.5, mid-training


def plain_python_heap(
    pass_rates: np.ndarray, total: int, low: int, up: int, alpha: float, beta: float, tau: float
) -> np.ndarray:
    """Algorithm 1 written plainly: V(B, p) evaluated with math.exp and math.lgamma at every pop."""

    def value(b: int, p: float) -> float:
        p = min(max(p, 0.01), 0.99)
        log_density = (
            (alpha - 1) * math.log(p)
            + (beta - 1) * math.log(1 - p)
            - (math.lgamma(alpha) + math.lgamma(beta) - math.lgamma(alpha + beta))
        )
        return (1.0 - math.exp(-(b / tau) * p * (1 - p))) * math.exp(log_density)

    ps = [float(x) for x in pass_rates]
    budgets = [low] * len(ps)
    heap = [(-(value(low + 1, p) - value(low, p)), i) for i, p in enumerate(ps)]
    heapq.heapify(heap)
    for _ in range(total - low * len(ps)):
        _, i = heapq.heappop(heap)
        budgets[i] += 1
        b = budgets[i]
        if b < up:
            heapq.heappush(heap, (-(value(b + 1, ps[i]) - value(b, ps[i])), i))
    return np.asarray(budgets, dtype=np.int64)


def bench_allocate(
    seed: int = 0,
    quick: bool = False,
    sizes: tuple[int, ...] | None = None,
    progress: Callable[[str], None] = lambda s: None,
) -> dict:
    """Run the allocation benchmark and return its figures (seconds).

    ``quick`` takes fewer repeats and sweeps only to M = 65536; ``sizes`` overrides the sweep.
    """
    rng = np.random.default_rng(seed)
    m, total, low, up = PAPER["M"], PAPER["B_total"], PAPER["min_budget"], PAPER["max_budget"]
    p = rng.uniform(0.0, 1.0, size=m)
    tau = adaptive_tau(p)

    def run(solver: str, pp: np.ndarray = p, tot: int = total) -> np.ndarray:
        return allocate(pp, tot, alpha=ALPHA, beta=BETA, solver=solver, min_budget=low, max_budget=up)

    progress("paper setting: heap, threshold, plain Python heap")
    heap_s, heap_b = median_time(lambda: run("heap"), 5 if quick else 21)
    thr_s, thr_b = median_time(lambda: run("threshold"), 5 if quick else 51)
    plain_s, plain_b = median_time(lambda: plain_python_heap(p, total, low, up, ALPHA, BETA, tau), 3 if quick else 7)
    progress("paper setting: dp")
    dp_s, dp_b = median_time(lambda: run("dp"), 1 if quick else 3)
    objective = {
        name: coba_objective(b, p, ALPHA, BETA, tau)
        for name, b in (("heap", heap_b), ("threshold", thr_b), ("dp", dp_b), ("plain_heap", plain_b))
    }
    paper = {
        "M": m,
        "B_total": total,
        "bounds": [low, up],
        "alpha": ALPHA,
        "beta": BETA,
        "tau": tau,
        "seconds": {"heap": heap_s, "threshold": thr_s, "dp": dp_s, "plain_heap": plain_s},
        "objective": objective,
        "same_allocation": {
            "threshold_vs_heap": bool(np.array_equal(thr_b, heap_b)),
            "plain_heap_vs_heap": bool(np.array_equal(plain_b, heap_b)),
        },
        "ratios": {
            "dp_over_heap": dp_s / heap_s,
            "dp_over_threshold": dp_s / thr_s,
            "heap_over_threshold": heap_s / thr_s,
            "plain_heap_over_heap": plain_s / heap_s,
        },
        "paper_seconds": {
            "heap": PAPER["heap_s"],
            "dp": PAPER["dp_s"],
            "dp_over_heap": PAPER["dp_s"] / PAPER["heap_s"],
        },
    }

    # DP cost is M * R * (B_up - B_low) and the heap's R * log2(M): predict each size from the
    # last measured one before running it, and skip what would take longer than DP_LIMIT_S.
    dp_unit = dp_s / (m * (total - low * m) * (up - low))
    heap_unit = heap_s / ((total - low * m) * math.log2(m))
    sweep = []
    for mm in sizes if sizes is not None else (SWEEP_M[:3] if quick else SWEEP_M):
        progress(f"sweep M = {mm:,}")
        pp = rng.uniform(0.0, 1.0, size=mm)
        tot = 16 * mm
        spare = tot - low * mm
        reps = 1 if mm >= 65_536 else 5
        t_s, t_b = median_time(lambda pp=pp, tot=tot: run("threshold", pp, tot), reps)
        row = {"M": mm, "B_total": tot, "threshold_s": t_s}
        predicted = heap_unit * spare * math.log2(mm)
        if predicted <= DP_LIMIT_S:
            h_s, h_b = median_time(lambda pp=pp, tot=tot: run("heap", pp, tot), reps)
            heap_unit = h_s / (spare * math.log2(mm))
            row.update(heap_s=h_s, heap_over_threshold=h_s / t_s, same_allocation=bool(np.array_equal(h_b, t_b)))
        else:
            row.update(heap_s=None, heap_predicted_s=predicted, heap_over_threshold=None, same_allocation=None)
        predicted = dp_unit * mm * spare * (up - low)
        if predicted <= DP_LIMIT_S:
            row["dp_s"] = median_time(lambda pp=pp, tot=tot: run("dp", pp, tot), 1)[0]
        else:
            row.update(dp_s=None, dp_predicted_s=predicted)
        sweep.append(row)
    return {
        "benchmark": "allocate",
        "machine": {"python": platform.python_version(), "processor": platform.machine(), "cpus": available_cpus()},
        "paper_setting": paper,
        "sweep": sweep,
        "goals": {
            "heap_at_least_5x_plain_heap": paper["ratios"]["plain_heap_over_heap"] >= 5.0,
            "threshold_below_1ms_at_paper_setting": thr_s < 1e-3,
            "threshold_below_2s_at_1M": next((r["threshold_s"] < 2.0 for r in sweep if r["M"] == 1_000_000), None),
        },
    }


def _fmt_s(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 1e-3:
        return f"{s * 1e6:.0f} us"
    if s < 1.0:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.2f} s"


def format_allocate(result: dict) -> str:
    """Human-readable report of ``bench_allocate``."""
    ps = result["paper_setting"]
    sec, rat = ps["seconds"], ps["ratios"]
    lines = [
        f"Allocation benchmark (median times in one run; {result['machine']['cpus']} CPUs)",
        "",
        f"Paper setting: M = {ps['M']}, B_total = {ps['B_total']}, bounds {ps['bounds']}, "
        f"p ~ U(0, 1), alpha = beta = {ps['alpha']}, tau = {ps['tau']:.2f} (adaptive)",
        f"  {'solver':<26}{'time':>12}{'objective':>14}",
    ]
    for name, label in (
        ("threshold", "threshold (closed form)"),
        ("heap", "heap (Algorithm 1)"),
        ("plain_heap", "plain Python heap"),
        ("dp", "dp (exact)"),
    ):
        lines.append(f"  {label:<26}{_fmt_s(sec[name]):>12}{ps['objective'][name]:>14.6f}")
    lines += [
        f"  dp / heap = {rat['dp_over_heap']:.0f}x   (paper: {ps['paper_seconds']['dp']} s / "
        f"{ps['paper_seconds']['heap']} s = {ps['paper_seconds']['dp_over_heap']:.0f}x)",
        f"  dp / threshold = {rat['dp_over_threshold']:.0f}x   heap / threshold = {rat['heap_over_threshold']:.1f}x   "
        f"plain heap / heap = {rat['plain_heap_over_heap']:.1f}x",
        f"  same allocation: threshold vs heap {ps['same_allocation']['threshold_vs_heap']}, "
        f"plain heap vs heap {ps['same_allocation']['plain_heap_vs_heap']}",
        "",
        "Scale sweep (B_total = 16 M, bounds [2, 128]):",
        f"  {'M':>10}{'threshold':>12}{'heap':>22}{'heap/thr':>10}{'dp':>22}  same",
    ]
    for r in result["sweep"]:
        dp = _fmt_s(r["dp_s"]) if r["dp_s"] is not None else f"skip (~{r['dp_predicted_s']:.0f} s)"
        heap = _fmt_s(r["heap_s"]) if r["heap_s"] is not None else f"skip (~{r['heap_predicted_s']:.0f} s)"
        ratio = f"{r['heap_over_threshold']:>9.1f}x" if r["heap_s"] is not None else f"{'-':>10}"
        lines.append(f"  {r['M']:>10,}{_fmt_s(r['threshold_s']):>12}{heap:>22}{ratio}{dp:>22}  {r['same_allocation']}")
    lines.append(f"  (skip: predicted from the last measured size to exceed {DP_LIMIT_S:.0f} s; not run)")
    g = result["goals"]
    lines += [
        "",
        "Goals: heap >= 5x plain heap: {}; threshold < 1 ms at paper setting: {}; threshold < 2 s at M = 1M: {}".format(
            *("yes" if v else ("not run" if v is None else "NO") for v in g.values())
        ),
    ]
    return "\n".join(lines)
