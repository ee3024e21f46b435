"""DAPO's dynamic sampling as veRL's DAPO recipe runs it (docs/method.md, section 20): a step samples
generation batches of new prompts, ``n`` rollouts each, keeps the groups whose metric varies, and trains on the
first ``train_prompts`` groups it kept; the rest of what it generated is not trained on.

    kept = varied_groups(["a", "a", "b", "b"], np.array([1.0, 0.0, 1.0, 1.0]))   # {"a": True, "b": False}
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum
from typing import TypeVar

import numpy as np


class FilterMetric(StrEnum):
    """What a group must vary in to be kept (veRL's ``algorithm.filter_groups.metric``): ``acc``, each rollout's
    correctness (verdict ``correct``: 1, else 0); ``seq_reward``, its reward."""

    ACC = "acc"
    SEQ_REWARD = "seq_reward"


def varied_groups(prompt_ids: Sequence[str], values: np.ndarray) -> dict[str, bool]:
    """Per prompt, in the order first seen: whether its rollouts' ``values`` vary (population standard deviation
    above 0) or it has one rollout, the recipe's rule for a group it keeps."""
    groups: dict[str, list[float]] = {}
    for pid, v in zip(prompt_ids, np.asarray(values, dtype=np.float64).tolist(), strict=True):
        groups.setdefault(pid, []).append(v)
    return {pid: len(vs) == 1 or float(np.std(vs)) > 0 for pid, vs in groups.items()}


G = TypeVar("G")  # a group's key: a prompt id, or (prompt id, round)


def trained_groups(kept_in_order: Sequence[G], train_prompts: int) -> list[G]:
    """The groups the update trains on: the first ``train_prompts`` kept groups in the order they were generated
    (earlier generation batches first); the later ones are dropped, as the recipe cuts its batch."""
    return list(kept_in_order[:train_prompts])
