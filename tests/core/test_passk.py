"""pass@k's unbiased estimator against counting every subset of k completions."""

from __future__ import annotations

from itertools import combinations, pairwise

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from coba_tasks.core.passk import mean_pass_at_k, pass_at_k, pass_at_ks


@settings(max_examples=300, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=10), st.data())
def test_pass_at_k_is_the_share_of_k_subsets_holding_a_solved_completion(solved, data):
    n, c = len(solved), sum(solved)
    k = data.draw(st.integers(1, n))
    subsets = list(combinations(solved, k))
    assert pass_at_k(n, c, k) == sum(any(s) for s in subsets) / len(subsets)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 64).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n))))
def test_pass_at_1_is_the_average_pass_at_n_is_any_and_it_rises_with_k(nc):
    n, c = nc
    values = [pass_at_k(n, c, k) for k in range(1, n + 1)]
    assert abs(values[0] - c / n) < 1e-12
    assert values[-1] == (1.0 if c else 0.0)
    assert all(a <= b + 1e-12 for a, b in pairwise(values))


def test_a_set_is_the_mean_over_its_prompts_up_to_its_fewest_completions():
    n, c = np.array([4, 4, 8]), np.array([0, 2, 8])
    assert mean_pass_at_k(n, c, 1) == (0 + 0.5 + 1) / 3
    assert list(pass_at_ks(n, c)) == [1, 2, 3, 4]
    assert pass_at_ks(n, c)[4] == (0 + 1 + 1) / 3
    assert pass_at_ks(np.array([], dtype=int), np.array([], dtype=int)) == {}
