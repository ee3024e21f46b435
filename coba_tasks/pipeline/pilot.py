"""``allocation.estimator = pilot``: a step's rollouts in two waves (docs/method.md, section 2).

Per step t, in this order (each a table of steps/t, so a resume between them continues exactly):

    pilot          k = allocation.pilot_rollouts completions per prompt of the batch  -> pilot.parquet
    pilot_rewards  the pilot scored                                                   -> pilot_rewards.parquet
    budget         the posterior after the pilot -> B_i for the whole step (>= B_low >= k,
                   sum B_total): the allocation of step t, made at its start        -> budget.parquet
    rollouts       the second wave, B_i - k per prompt, beside the pilot's k            -> rollouts.parquet
    rewards        the second wave scored, beside the pilot's rewards                   -> rewards.parquet

The pilot's rollouts stay in their groups: rollouts(t) holds both waves (the pilot's ``sample_idx`` 0 .. k-1,
the second wave's k .. B_i - 1), so the rewards, the capability stage, the history and the GRPO advantages all
see groups of B_i. The pilot's seeds are each group's usual ``rollout_seed(run seed, t, prompt)``, the second
wave's ``rollout_seed(..., wave=1)``: given the run seed, step and prompt, each rollout is fixed by its wave
and its index in the wave, and the waves never share a seed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from coba_tasks.engines.rollout import RolloutBackend, SamplingConfig
from coba_tasks.pipeline.stages import reward_table, rollout_table

KEY = ["prompt_id", "sample_idx"]


def pilot_budget(batch: Sequence[str], k: int) -> pd.DataFrame:
    """The pilot's request: ``k`` rollouts for each prompt of ``batch``."""
    if k < 1:
        raise ValueError(f"the pilot needs at least one rollout per prompt, got k={k}")
    return pd.DataFrame({"prompt_id": list(batch), "budget": np.full(len(batch), k, dtype=np.int64)})


def second_wave_table(
    budget: pd.DataFrame,
    pilot: pd.DataFrame,
    prompts: pd.DataFrame,
    engine: RolloutBackend,
    sampling: SamplingConfig,
    run_seed: int,
    step: int,
) -> pd.DataFrame:
    """The step's rollouts table: each prompt's pilot rollouts (``pilot``, a rollouts table) and its second
    wave, ``budget.budget`` minus the pilot's rollouts, sampled with the second wave's seeds and numbered on
    from the pilot's; rows by prompt in budget order, then by ``sample_idx``."""
    have = pilot.groupby("prompt_id", sort=False).size()
    missing = sorted(set(budget["prompt_id"]) - set(have.index))
    if missing or set(have.index) - set(budget["prompt_id"]):
        raise ValueError(f"the pilot's prompts are not the budget's (first not in both: {missing[:1]})")
    k = have.reindex(budget["prompt_id"]).to_numpy(dtype=np.int64)
    rest = budget[["prompt_id"]].assign(budget=budget["budget"].to_numpy(dtype=np.int64) - k)
    if (rest["budget"] < 0).any():
        raise ValueError("a budget below its prompt's pilot rollouts")
    rest = rest[rest["budget"] > 0]
    if rest.empty:  # every budget is the pilot's k: nothing more to sample
        return pilot.reset_index(drop=True)
    wave = rollout_table(rest, prompts, engine, sampling, run_seed, step, wave=1)
    wave["sample_idx"] += have.reindex(wave["prompt_id"]).to_numpy(dtype=np.int64)
    both = pd.concat([pilot, wave], ignore_index=True)
    order = {pid: i for i, pid in enumerate(budget["prompt_id"])}
    both["_order"] = both["prompt_id"].map(order)
    return both.sort_values(["_order", "sample_idx"], kind="stable").drop(columns="_order").reset_index(drop=True)


def merged_reward_table(
    rollouts: pd.DataFrame, pilot_rewards: pd.DataFrame, prompts: pd.DataFrame, pool: Any
) -> pd.DataFrame:
    """The step's rewards table: the pilot's rewards as they were scored (those the allocation used), the
    second wave's scored now; rows in ``rollouts`` order."""
    is_pilot = rollouts[KEY].merge(pilot_rewards[KEY].assign(_pilot=True), on=KEY, how="left")["_pilot"]
    fresh = rollouts[~is_pilot.fillna(False).astype(bool).to_numpy()]
    parts = [pilot_rewards] + ([reward_table(fresh, prompts, pool)] if len(fresh) else [])
    scored = pd.concat(parts, ignore_index=True)
    table = rollouts[KEY].merge(scored, on=KEY, how="left", validate="one_to_one")
    if table["verdict"].isna().any():
        raise ValueError("the pilot's rewards do not cover its rollouts")
    return table
