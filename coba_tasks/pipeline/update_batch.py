"""What one update trains on, from a step's tables: the rollouts and rewards it trains on (a step sampled in
rounds: the used ones), their GRPO advantages and groups, the token ids the trainer reads, and the row
update.parquet keeps of it. The policy's update (``coba_tasks.pipeline.policy``) and the benchmarks read them."""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from coba_tasks.core.ada import global_advantages
from coba_tasks.core.allocation import Strategy
from coba_tasks.core.grpo import (
    RewardScaleError,
    group_advantages,
    reward_scale_message,
    unbounded_rewards,
    zero_variance_share,
)
from coba_tasks.pipeline.config_sections import AllocationConfig
from coba_tasks.pipeline.rounds import ROUND, USED, ada_counts


def advantages_for(rollouts: pd.DataFrame, rewards: pd.DataFrame) -> np.ndarray:
    """GRPO advantages aligned with ``rollouts`` rows, grouped by prompt id; a reward that is not finite or
    beyond +/- ``REWARD_BOUND`` is a ``RewardScaleError`` naming the prompt."""
    merged = rollouts[["prompt_id", "sample_idx"]].merge(rewards, on=["prompt_id", "sample_idx"], how="left")
    if merged["reward"].isna().any():
        raise ValueError("rewards do not cover every rollout (prompt_id, sample_idx)")
    ids = torch.as_tensor(pd.factorize(merged["prompt_id"])[0])
    reward = torch.tensor(merged["reward"].to_numpy(dtype=np.float64))
    bad = unbounded_rewards(reward)  # refused naming the prompt (group_advantages knows only group numbers)
    if bad.numel():
        row = merged.iloc[int(bad[0])]
        where = f"prompt {row['prompt_id']} (sample {row['sample_idx']})"
        raise RewardScaleError(reward_scale_message(where, float(row["reward"])))
    return group_advantages(reward, ids).numpy()


def trained(
    rolled: pd.DataFrame, scored: pd.DataFrame, alloc: AllocationConfig
) -> tuple[pd.DataFrame, pd.DataFrame, np.ndarray, np.ndarray]:
    """What the update trains on: the rollouts and their rewards (a step sampled in rounds: the ``used`` ones),
    their advantages and each one's group (``optim.prompt_weighting``). GRPO's group advantages by prompt
    (dynamic: by prompt and round, a generation batch's group); ada: the reward minus its prompt's pass rate over
    every rollout of the step (``allocation.global_stat_est``; else over its trained group), divided by that
    pool's standard deviation under ``allocation.norm_adv_by_std_in_grpo`` (docs/method.md, section 21)."""
    if USED not in rolled:
        return rolled, scored, advantages_for(rolled, scored), pd.factorize(rolled["prompt_id"])[0]
    mask = rolled[USED].to_numpy(dtype=bool)
    if alloc.strategy != Strategy.ADA:  # dynamic: a group is a prompt's rollouts in one generation batch
        keyed = rolled.assign(prompt_id=rolled["prompt_id"].astype(str) + "@" + rolled[ROUND].astype(str))
        keyed_scores = scored.assign(prompt_id=keyed["prompt_id"].to_numpy())
        adv = advantages_for(keyed[mask], keyed_scores[mask])
        return rolled[mask], scored[mask], adv, pd.factorize(keyed["prompt_id"][mask])[0]
    reward = scored["reward"].to_numpy(dtype=np.float64)
    bad = unbounded_rewards(torch.tensor(reward))
    if bad.numel():
        row = scored.iloc[int(bad[0])]
        where = f"prompt {row['prompt_id']} (sample {row['sample_idx']})"
        raise RewardScaleError(reward_scale_message(where, float(row["reward"])))
    used = scored[mask]
    if alloc.global_stat_est:
        pos, neg = ada_counts(scored, alloc)
        adv = global_advantages(reward[mask], pos[mask], neg[mask], alloc.norm_adv_by_std_in_grpo)
    elif alloc.norm_adv_by_std_in_grpo:
        adv = advantages_for(rolled[mask], used)
    else:
        adv = reward[mask] - used.groupby("prompt_id")["reward"].transform("mean").to_numpy(dtype=np.float64)
    return rolled[mask], used, adv, pd.factorize(rolled["prompt_id"][mask])[0]


def update_sequences(
    rollouts: pd.DataFrame, prompts: pd.DataFrame
) -> tuple[list[list[int]], list[list[int]], list[list[float]] | None]:
    """Per rollout row: the prompt's token ids (those the engine received), the completion's, the sampler's
    log p of each completion token."""
    ids = prompts.set_index("prompt_id")["prompt_token_ids"]
    prompt_ids = [list(ids[p]) for p in rollouts["prompt_id"]]
    completion_ids = [list(t) for t in rollouts["token_ids"]]
    logprobs = [list(x) for x in rollouts["logprobs"]]
    return prompt_ids, completion_ids, logprobs


def update_row(step: int, metrics: dict[str, float], rollouts: pd.DataFrame, rewards: pd.DataFrame) -> pd.DataFrame:
    """update.parquet: the update's metrics, the share of zero-variance groups, the rollouts it trained on
    (``rollouts``; what the step generated: the metrics' ``rollouts_generated`` and ``tokens_generated``)."""
    ids = torch.as_tensor(pd.factorize(rewards["prompt_id"])[0])
    zero = zero_variance_share(torch.tensor(rewards["reward"].to_numpy(dtype=np.float64)), ids)
    return pd.DataFrame([{"step": step, **metrics, "zero_variance_groups": zero, "rollouts": len(rollouts)}])
