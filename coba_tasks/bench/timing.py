"""How the benchmarks time a call, and the machine fact they print beside the times.

Times are medians over repeats inside one process; compare the ratios, not the absolute times (the
machines are shared and noisy).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any


def timed(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, float]:
    """``fn(*args, **kwargs)`` and its wall time in seconds."""
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0


def median_time(fn: Callable[[], Any], repeats: int, warmup: bool = True) -> tuple[float, Any]:
    """Median wall time of ``repeats`` calls (after one untimed call when ``warmup``) and the last result."""
    if warmup:
        fn()  # imports, caches
    times, out = [], None
    for _ in range(repeats):
        out, seconds = timed(fn)
        times.append(seconds)
    return statistics.median(times), out


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one, else the machine's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
