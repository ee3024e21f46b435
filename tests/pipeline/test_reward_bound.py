"""Rewards whose magnitude would overflow the GRPO group statistics are refused, naming the prompt and value.

Rewards near 1e308 overflow a group's sum (NaN advantages); above ~1e154 its squared deviations
(the std is inf and every advantage silently 0). ``REWARD_BOUND`` (1e30) keeps the sum and the variance of
any group of float64 rewards finite; rewards at the bound still give the advantages a 0/1 reward gives.
"""

from __future__ import annotations

import re

import numpy as np
import pandas as pd
import pytest
import torch

from coba_tasks.core.grpo import REWARD_BOUND, RewardScaleError, group_advantages
from coba_tasks.pipeline import update_batch


def tables(rewards: list[float], group: int = 2) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Rollouts and rewards of prompts p0, p1, ... with ``group`` rollouts each, in order."""
    ids = [f"p{i // group}" for i in range(len(rewards))]
    idx = [i % group for i in range(len(rewards))]
    rollouts = pd.DataFrame({"prompt_id": ids, "sample_idx": idx})
    return rollouts, rollouts.assign(reward=np.array(rewards, dtype=np.float64))


@pytest.mark.parametrize("huge", [1e308, -1e200, 1e155, 2e30, float("inf"), float("-inf")])
def test_a_reward_beyond_the_bound_is_refused_naming_the_prompt(huge):
    rollouts, rewards = tables([1.0, 0.0, 0.0, huge, 1.0, 0.0])
    expected = rf"^prompt p1 \(sample 1\): reward {re.escape(f'{huge:g}')} is beyond \+/- 1e\+30, .*scale the reward"
    with pytest.raises(RewardScaleError, match=expected):
        update_batch.advantages_for(rollouts, rewards)


def test_group_advantages_refuses_a_reward_beyond_the_bound_naming_its_group():
    with pytest.raises(RewardScaleError, match=r"group id 7: reward 1e\+200"):
        group_advantages(torch.tensor([0.0, 1.0, 1e200, 0.0], dtype=torch.float64), torch.tensor([3, 3, 7, 7]))


def test_rewards_at_the_bound_give_finite_advantages_in_the_largest_groups():
    """+/- REWARD_BOUND in a group of 1,000,000 rollouts (far above any budget): the advantages are finite and
    those of 0/1 rewards in the same places (up to the std's 1e-6 epsilon, which a 0/1 group's std of ~0.5
    feels and a ~1e30 one does not)."""
    n = 1_000_000
    signs = torch.tensor([1.0, -1.0] * (n // 2) + [1.0, 1.0, -1.0], dtype=torch.float64)
    ids = torch.zeros(signs.numel(), dtype=torch.long)
    ids[-3:] = 1  # a second, small group
    adv = group_advantages(signs * REWARD_BOUND, ids)
    assert bool(torch.isfinite(adv).all())
    reference = group_advantages((signs > 0).to(torch.float64), ids)
    assert torch.allclose(adv, reference, rtol=1e-5, atol=0)
    rollouts, rewards = tables([REWARD_BOUND, -REWARD_BOUND, REWARD_BOUND, REWARD_BOUND])
    assert update_batch.advantages_for(rollouts, rewards).tolist() == pytest.approx(
        [0.7071, -0.7071, 0.0, 0.0], abs=1e-4
    )
