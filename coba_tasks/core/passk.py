"""pass@k: the chance that at least one of k completions drawn from a prompt's n is solved.

With c of n completions solved, the unbiased estimator of pass@k (Chen et al., 2021, "Evaluating Large
Language Models Trained on Code") is

    pass@k = 1 - C(n - c, k) / C(n, k)        (1 <= k <= n)

the share of the C(n, k) subsets of k completions that hold at least one solved one. pass@1 is c / n (the
prompt's avg@n) and pass@n is 1 when any completion is solved. A held-out set's pass@k is the mean over
its prompts. Exact integer binomials: no I/O, numpy in, numpy out.
"""

from __future__ import annotations

from math import comb

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of a prompt with ``c`` of ``n`` completions solved.

    >>> pass_at_k(4, 1, 1), pass_at_k(4, 1, 2), pass_at_k(4, 1, 4), pass_at_k(4, 0, 4)
    (0.25, 0.5, 1.0, 0.0)
    >>> pass_at_k(4, 5, 1)
    Traceback (most recent call last):
    ValueError: pass@k needs 0 <= c <= n and 1 <= k <= n; got n=4, c=5, k=1
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    total = comb(n, k)
    return (total - comb(n - c, k)) / total  # one division of exact integers: correctly rounded


def mean_pass_at_k(n: np.ndarray, c: np.ndarray, k: int) -> float:
    """The mean pass@k over prompts with ``n[i]`` completions of which ``c[i]`` solved (NaN for no prompts).

    >>> mean_pass_at_k(np.array([4, 4]), np.array([1, 0]), 2)
    0.25
    """
    n, c = np.asarray(n, dtype=np.int64), np.asarray(c, dtype=np.int64)
    if len(n) == 0:
        return float("nan")
    return float(np.mean([pass_at_k(int(ni), int(ci), k) for ni, ci in zip(n, c, strict=True)]))


def pass_at_ks(n: np.ndarray, c: np.ndarray) -> dict[int, float]:
    """pass@k for k = 1 .. the fewest completions any prompt has: {k: mean pass@k}.

    >>> pass_at_ks(np.array([2, 2]), np.array([1, 2]))
    {1: 0.75, 2: 1.0}
    """
    n = np.asarray(n, dtype=np.int64)
    if len(n) == 0:
        return {}
    return {k: mean_pass_at_k(n, c, k) for k in range(1, int(n.min()) + 1)}
