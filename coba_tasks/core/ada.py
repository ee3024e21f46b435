"""Reinforce-Ada as its authors ship it (RLHFlow/Reinforce-Ada; docs/method.md, section 21): each prompt of the
step is sampled in rounds of ``round_repeat`` rollouts until its rollouts so far pass its exit rule (or
``max_rounds`` rounds), then the group the update sees is ``n`` of them chosen by class, and each trained rollout's
advantage is its reward minus the prompt's pass rate over every rollout it got in the step.

A rollout is positive when its reward is above ``positive_threshold``.

    >>> finished(pos=2, neg=5, n=4, choice=AdaChoice.BALANCED), finished(1, 0, 4, AdaChoice.POSITIVE_FOCUSED)
    (True, True)
    >>> kept_counts(pos=6, neg=2, n=4, choice=AdaChoice.BALANCED, done=True)
    (2, 2)
"""

from __future__ import annotations

import math
from enum import StrEnum

import numpy as np


class AdaChoice(StrEnum):
    """The exit rule of a prompt (``reinforce_ada_choice``): ``balanced``, at least n/2 positive and n - n/2
    negative rollouts; ``positive_focused``, at least one positive."""

    BALANCED = "balanced"
    POSITIVE_FOCUSED = "positive_focused"


def finished(pos: int, neg: int, n: int, choice: AdaChoice | str) -> bool:
    """Whether a prompt with ``pos`` positive and ``neg`` negative rollouts so far leaves the rounds."""
    if choice == AdaChoice.BALANCED:
        return pos >= n // 2 and neg >= n - n // 2
    return pos >= 1


def kept_counts(pos: int, neg: int, n: int, choice: AdaChoice | str, done: bool) -> tuple[int, int]:
    """(positives, negatives) of the group the update sees, from a prompt's ``pos`` and ``neg`` rollouts: the first
    ones of each class in the order they were generated. A prompt that passed its exit rule (``done``) keeps
    min(n/2, pos) positives and the rest of ``n`` in negatives as far as there are, the shortfall from the class
    that has more; one that did not (``max_rounds`` reached) keeps min(n, pos + neg) the same way, under
    ``positive_focused`` with min(take - 1, ceil(n * pos / (pos + neg))), at least 1, positives meant."""
    if done:
        take = n
        want_pos = min(n // 2, pos)
        want_neg = min(n - want_pos, neg)
    else:
        take = min(n, pos + neg)
        if choice == AdaChoice.POSITIVE_FOCUSED:
            share = pos / (pos + neg) if pos + neg else 0.0
            target_pos = max(min(math.ceil(share * n), take - 1), 1)
            target_neg = take - target_pos
        else:
            target_pos, target_neg = n // 2, n - n // 2
        want_pos, want_neg = min(pos, target_pos), min(neg, target_neg)
    short = take - want_pos - want_neg
    if short > 0:  # the class with rollouts left makes up the rest, positives first
        if pos > want_pos:
            want_pos += min(pos - want_pos, short)
        elif neg > want_neg:
            want_neg += min(neg - want_neg, short)
    return want_pos, want_neg


def global_advantages(
    rewards: np.ndarray, pos_total: np.ndarray, neg_total: np.ndarray, norm_by_std: bool, eps: float = 1e-6
) -> np.ndarray:
    """Each trained rollout's advantage against its prompt's pool of every rollout of the step (the authors'
    ``global_stat_est``): ``reward - p`` with p = pos / (pos + neg), divided by (the pool's unbiased standard
    deviation, at least ``eps``) + ``eps`` when ``norm_by_std``; a pool of at most one rollout: mean 0, std 1.
    ``rewards``, ``pos_total`` and ``neg_total`` are per trained rollout (the counts of its prompt)."""
    total = pos_total + neg_total
    mean = np.where(total > 1, pos_total / np.maximum(total, 1), 0.0)
    adv = np.asarray(rewards, dtype=np.float64) - mean
    if not norm_by_std:
        return adv
    # the unbiased standard deviation of a pool of pos ones and neg zeros: pos * neg / (N (N - 1)) its variance
    var = pos_total * neg_total / np.maximum(total * (total - 1), 1)
    std = np.where(total > 1, np.maximum(np.sqrt(var), eps), 1.0)
    return adv / (std + eps)
