"""A step sampled in rounds (``allocation.strategy`` dynamic or ada; docs/method.md, sections 20 and 21): whether
it samples another round, which prompts that round samples, and which of the step's rollouts the update sees.
Each is a function of the step's rounds so far (``round_rewards``: every round's rewards, with its ``round``),
so that a resume between or inside rounds decides as the uninterrupted step did. The stages that sample and
score a round, and the step's rollouts and rewards written from its rounds, are ``coba_tasks.pipeline.stages``'.

    more, prompts = ada_next(round_rewards, r=1, batch=["a", "b"], alloc=alloc)   # another round? of which prompts
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from coba_tasks.core.ada import finished, kept_counts
from coba_tasks.core.dynamic import FilterMetric, trained_groups, varied_groups
from coba_tasks.engines.verify import VerdictKind

if TYPE_CHECKING:
    from coba_tasks.pipeline.config_sections import AllocationConfig

ROUND = "round"  # the round a rollout was sampled in (0, 1, ...)
USED = "used"  # whether the update trains on it (the step's rollouts table, a step sampled in rounds)


class RoundsError(ValueError):
    """A step sampled in rounds that cannot end as its strategy asks (one line: what happened, what to do)."""


def _rounds_done(round_rewards: pd.DataFrame | None) -> int:
    return 0 if round_rewards is None or round_rewards.empty else int(round_rewards[ROUND].max()) + 1


# --- dynamic (DAPO's dynamic sampling)


def metric_values(rewards: pd.DataFrame, metric: str) -> np.ndarray:
    """Each rollout's value of ``allocation.filter_metric``: ``acc`` 1.0 for a correct verdict, else 0.0;
    ``seq_reward`` its reward."""
    if metric == FilterMetric.ACC:
        return (rewards["verdict"].astype(str) == str(VerdictKind.CORRECT)).to_numpy(dtype=np.float64)
    return rewards["reward"].to_numpy(dtype=np.float64)


def dynamic_kept(round_rewards: pd.DataFrame, metric: str) -> list[tuple[str, int]]:
    """The groups kept so far, (prompt_id, round), in the order they were generated (round by round, each round's
    prompts in its order): those whose ``metric`` varies (``core.dynamic.varied_groups``). A prompt sampled in two
    rounds of one step (a generation batch across an epoch's end) is two groups."""
    kept: list[tuple[str, int]] = []
    for r, part in round_rewards.groupby(ROUND, sort=True):
        flags = varied_groups(part["prompt_id"].astype(str).tolist(), metric_values(part, metric))
        kept += [(pid, int(r)) for pid, keep in flags.items() if keep]
    return kept


def dynamic_next(
    round_rewards: pd.DataFrame | None, alloc: AllocationConfig, train_prompts: int, pool: int, step: int
) -> bool:
    """Whether the step samples another generation batch: yes while it holds fewer than ``train_prompts`` kept
    groups. At ``allocation.max_num_gen_batches`` batches short of them the run stops (``RoundsError``), as veRL's
    recipe raises; without a limit, once the batches have covered the training pool (``pool`` prompts)."""
    done = _rounds_done(round_rewards)
    if done == 0:
        return True
    kept = len(dynamic_kept(round_rewards, alloc.filter_metric))
    if kept >= train_prompts:
        return False
    size = gen_batch_size(alloc, train_prompts)
    limit = alloc.max_num_gen_batches
    if limit and done >= limit:
        raise RoundsError(
            f"step {step}: {kept} of the {train_prompts} mixed groups the update needs (data.prompts_per_step) after "
            f"{done} generation batches of {size} prompts, allocation.max_num_gen_batches: the run stops here, as "
            "veRL's DAPO recipe does; its steps so far are kept. Start a new run with a larger "
            "allocation.max_num_gen_batches (0 = no limit), or a pool and model whose groups mix more often"
        )
    if done * size >= pool:
        raise RoundsError(
            f"step {step}: {kept} of the {train_prompts} mixed groups the update needs (data.prompts_per_step) after "
            f"{done} generation batches covered the training pool of {pool} prompts: almost every group scores "
            "alike (all correct or all wrong); the run stops here, its steps so far kept. Start a new run on a pool "
            "of prompts this model solves sometimes, or with a smaller data.prompts_per_step"
        )
    return True


def gen_batch_size(alloc: AllocationConfig, train_prompts: int) -> int:
    """Prompts per generation batch: ``allocation.gen_batch_size``, else ``data.prompts_per_step``."""
    return int(alloc.gen_batch_size) or train_prompts


def dynamic_used(rollouts: pd.DataFrame, rewards: pd.DataFrame, metric: str, train_prompts: int) -> np.ndarray:
    """Per row of ``rollouts``: whether it belongs to the first ``train_prompts`` kept groups (rewards with the
    same rows, ``round`` included)."""
    chosen = set(trained_groups(dynamic_kept(rewards, metric), train_prompts))
    keys = zip(rollouts["prompt_id"].astype(str), rollouts[ROUND].astype(int), strict=True)
    return np.array([key in chosen for key in keys], dtype=bool)


# --- ada (Reinforce-Ada)


def positive(rewards: pd.DataFrame, threshold: float) -> np.ndarray:
    """Whether each rollout is positive: its reward above ``allocation.positive_threshold``."""
    return rewards["reward"].to_numpy(dtype=np.float64) > threshold


def ada_state(round_rewards: pd.DataFrame | None, batch: Sequence[str], alloc: AllocationConfig) -> pd.DataFrame:
    """Per prompt of ``batch`` (indexed by prompt_id): ``pos``, ``neg`` (its positive and negative rollouts so far)
    and ``done`` (its exit rule passed after one of the rounds so far: it is sampled no more)."""
    state = pd.DataFrame({"pos": 0, "neg": 0, "done": False}, index=pd.Index(list(batch), name="prompt_id"))
    if round_rewards is None or round_rewards.empty:
        return state
    n, choice = int(alloc.group_size), alloc.reinforce_ada_choice
    for _, part in round_rewards.groupby(ROUND, sort=True):  # the exit rule is checked after each round
        pos = pd.Series(positive(part, alloc.positive_threshold), index=part["prompt_id"].astype(str))
        counts = pos.groupby(level=0).agg(["sum", "size"])
        active = [p for p in counts.index if not state.at[p, "done"]]
        state.loc[active, "pos"] += counts.loc[active, "sum"].astype(int).to_numpy()
        state.loc[active, "neg"] += (counts.loc[active, "size"] - counts.loc[active, "sum"]).astype(int).to_numpy()
        for p in active:
            state.at[p, "done"] = finished(int(state.at[p, "pos"]), int(state.at[p, "neg"]), n, choice)
    return state


def ada_next(round_rewards: pd.DataFrame | None, batch: Sequence[str], alloc: AllocationConfig) -> list[str]:
    """The prompts the next round samples, in ``batch`` order: those not done, while fewer than
    ``allocation.max_rounds`` rounds are done (empty: the rounds are over)."""
    if _rounds_done(round_rewards) >= alloc.max_rounds:
        return []
    state = ada_state(round_rewards, batch, alloc)
    return [p for p in batch if not state.at[p, "done"]]


def ada_used(rewards: pd.DataFrame, batch: Sequence[str], alloc: AllocationConfig) -> np.ndarray:
    """Per row of ``rewards`` (the step's rounds, ``round`` included): whether the update sees it: per prompt the
    first positives and negatives in the order they were generated, as many as ``core.ada.kept_counts`` gives."""
    state = ada_state(rewards, batch, alloc)
    n, choice = int(alloc.group_size), alloc.reinforce_ada_choice
    order = rewards.reset_index(drop=True).assign(_pos=positive(rewards, alloc.positive_threshold))
    order = order.sort_values([ROUND, "sample_idx"], kind="stable")
    used = np.zeros(len(rewards), dtype=bool)
    for pid, part in order.groupby(order["prompt_id"].astype(str), sort=False):
        take_pos, take_neg = kept_counts(
            int(state.at[pid, "pos"]), int(state.at[pid, "neg"]), n, choice, bool(state.at[pid, "done"])
        )
        used[part.index[part["_pos"].to_numpy()][:take_pos]] = True
        used[part.index[~part["_pos"].to_numpy()][:take_neg]] = True
    return used


def ada_counts(rewards: pd.DataFrame, alloc: AllocationConfig) -> tuple[np.ndarray, np.ndarray]:
    """Per row of ``rewards``: its prompt's positive and negative rollouts over the whole step (the pool of its
    baseline under ``allocation.global_stat_est``)."""
    pos = pd.Series(positive(rewards, alloc.positive_threshold), index=rewards.index)
    pid = rewards["prompt_id"].astype(str)
    total_pos = pos.groupby(pid).transform("sum").to_numpy(dtype=np.float64)
    total = pid.groupby(pid).transform("size").to_numpy(dtype=np.float64)
    return total_pos, total - total_pos
