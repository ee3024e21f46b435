"""A step's rollouts as the GRPO update sees them: padded tensors, one process's share, the sampler gap.

Helpers of ``coba_tasks.engines.update.PolicyTrainer.update`` that need no model: ``pad_sequences``
(prompt + completion token ids as right-padded tensors and masks, also used by the warm-up and the
update benchmark), ``DataShard`` (which rows this process computes and how its sums meet the other
processes'; ``coba_tasks.engines.fsdp_update.DistributedShard`` is its data-parallel subclass) and
``sampler_gap`` / ``sampler_gap_rows`` (how far the rollout engine's log-probabilities of the sampled
tokens are from the trainer's: the update's ``logprob_diff_mean`` and ``logprob_diff_max``), and
``sampler_padded`` / ``rollout_ratio_stats`` (those figures laid out for the rollout correction, and
its ``is_*`` statistics), and ``PromptWeights`` (how the loss weighs the step's prompts, per mini-batch
and micro-batch).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from coba_tasks.core.grpo import (
    PromptWeighting,
    RolloutCorrection,
    effective_prompts,
    prompt_loss_weights,
    rollout_correction_stats,
    rollout_correction_weights,
)


class NonFiniteUpdateError(ValueError):
    """An update whose advantages, loss or gradient norm is not finite: stopped before the optimizer steps."""


_WAY_OUT = (  # a resume would compute the same update again: the way out is another setting or other rewards
    "nothing was stepped or saved; start a new run with a lower optim.lr (now {lr:g}), or check the rewards' "
    "scale (verify.reward_function)"
)


def check_advantages(advantages: np.ndarray | torch.Tensor, lr: float) -> None:
    """Refuse an update whose advantages are not all finite, before any pass (``NonFiniteUpdateError``
    naming the first such rollout)."""
    adv = torch.as_tensor(advantages).detach().double().cpu().flatten()
    bad = torch.nonzero(~torch.isfinite(adv)).flatten()
    if bad.numel():
        first = int(bad[0])
        raise NonFiniteUpdateError(
            f"the GRPO update's advantage of rollout {first} is {float(adv[first])} ({bad.numel()} of {adv.numel()} "
            f"not finite): " + _WAY_OUT.format(lr=lr)
        )


def check_optimizer_step(loss: float, grad_norm: float, step: int, steps: int, lr: float) -> None:
    """Refuse the optimizer step ``step`` of ``steps`` when its mini-batch's loss or the gradient norm is not
    finite (``NonFiniteUpdateError``): stepping would turn the weights and the AdamW moments into NaN, or
    step with a gradient clipped to zero. Every process of a data-parallel update passes the same (summed or
    global) figures, so all of them stop at the same step."""
    for what, value in (("loss", loss), ("gradient norm", grad_norm)):
        if not math.isfinite(value):
            raise NonFiniteUpdateError(
                f"the GRPO update's {what} is {value} at optimizer step {step} of {steps}: " + _WAY_OUT.format(lr=lr)
            )


def pad_sequences(
    prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded prompt + completion: (input_ids (B, T), attention_mask (B, T), completion_mask (B, T)).

    completion_mask[b, t] = 1 where token t of row b is a completion token (the ones the loss sees).
    """
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions, strict=True)]
    width = max(lengths)
    ids = torch.full((len(lengths), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(lengths), width), dtype=torch.long)
    comp = torch.zeros((len(lengths), width), dtype=torch.float32)
    for b, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        seq = list(p) + list(c)
        ids[b, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        attn[b, : len(seq)] = 1
        comp[b, len(p) : len(seq)] = 1.0
    return ids, attn, comp


class DataShard:
    """Which rows of a step's batch this process computes, and how its sums meet the other processes'.

    This base class is the single-process case (rank 0 of 1): every row, sums unchanged, the plain
    ``clip_grad_norm_``. ``coba_tasks.engines.fsdp_update.DistributedShard`` overrides ``rank``/``world``
    and the three collectives. Rank r takes rows r, r + world, ... of each mini-batch.
    """

    rank: int = 0
    world: int = 1
    distributed: bool = False  # the policy is sharded across processes (FSDP), one process included

    def mine(self, rows: torch.Tensor) -> torch.Tensor:
        """This process's share of ``rows`` (all of them in one process)."""
        return rows[self.rank :: self.world]

    def micro_batches(self, n: int, size: int) -> list[slice]:
        """Slices of ``mine(rows)`` for ``n`` rows, at most ``size`` each; every process gets as many
        slices as the largest share needs (trailing ones empty): under FSDP each forward and backward
        is a collective, so all processes must run the same number of passes."""
        local = len(range(self.rank, n, self.world))
        largest = -(-n // self.world)  # ceil(n / world)
        count = -(-largest // size)
        out = [slice(i, min(i + size, local)) for i in range(0, local, size)]
        return out + [slice(0, 0)] * (count - len(out))

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """The elementwise sum of ``t`` over the processes (in place)."""
        return t

    def sum_floats(self, values: dict[str, float]) -> dict[str, float]:
        """Each value summed over the processes."""
        return values

    def clip_grad_norm_(self, params: Iterable[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm to ``max_norm``; returns the norm before clipping."""
        return torch.nn.utils.clip_grad_norm_(params, max_norm)


def sampler_gap(
    logp: torch.Tensor,
    mask: torch.Tensor,
    sampler_logprobs: Sequence[Sequence[float]] | None,
    completion_ids: Sequence[Sequence[int]],
) -> tuple[float, float]:
    """(mean, max) of |sampler log p - trainer log p| over the completion tokens; NaNs without sampler figures.

    ``logp`` (B, T-1) and ``mask`` (B, T-1) as in the full-sequence update: the completion tokens of row
    b are the positions where ``mask[b]`` is 1, in order, one per entry of ``sampler_logprobs[b]``.
    """
    return _gap(logp[mask.bool()], sampler_logprobs, completion_ids)  # row-major: row 0's tokens, then row 1's


def sampler_gap_rows(
    trainer_rows: Sequence[torch.Tensor | None],
    sampler_logprobs: Sequence[Sequence[float]] | None,
    completion_ids: Sequence[Sequence[int]],
) -> tuple[float, float]:
    """``sampler_gap`` from one 1-D tensor per row of the trainer's completion-token log-probabilities."""
    ours = [t.double().cpu() if t is not None else torch.zeros(0, dtype=torch.float64) for t in trainer_rows]
    return _gap(torch.cat(ours) if ours else torch.zeros(0), sampler_logprobs, completion_ids)


def _gap(
    ours: torch.Tensor, sampler_logprobs: Sequence[Sequence[float]] | None, completion_ids: Sequence[Sequence[int]]
) -> tuple[float, float]:
    if sampler_logprobs is None:
        return float("nan"), float("nan")
    for b, (lp, c) in enumerate(zip(sampler_logprobs, completion_ids, strict=True)):
        if len(lp) != len(c):
            raise ValueError(f"rollout {b}: {len(lp)} sampler logprobs for {len(c)} completion tokens")
    theirs = torch.tensor([x for lp in sampler_logprobs for x in lp], dtype=torch.float64, device=ours.device)
    if theirs.numel() == 0:  # no token to compare: every row was left out (advantage 0) or had no tokens
        return float("nan"), float("nan")
    diff = (theirs - ours.double()).abs()
    return float(diff.mean()), float(diff.max())


def padded_rows(rows: Sequence[torch.Tensor | None], like: torch.Tensor) -> torch.Tensor:
    """Per-row 1-D tensors placed left-aligned in a zero tensor shaped like ``like`` (n, C)."""
    out = torch.zeros_like(like)
    for i, t in enumerate(rows):
        if t is not None:
            out[i, : len(t)] = t.to(out.dtype)
    return out.detach()


def sampler_padded(sampler_logprobs: Sequence[Sequence[float]], mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The sampler's log-probabilities laid out like the trainer's (``like``, (B, T-1)): the entries of
    ``sampler_logprobs[b]`` in order at the positions where ``mask[b]`` is 1, zeros elsewhere."""
    m = mask.bool()
    counts = m.sum(dim=1).tolist()
    for b, (lp, c) in enumerate(zip(sampler_logprobs, counts, strict=True)):
        if len(lp) != int(c):
            raise ValueError(f"rollout {b}: {len(lp)} sampler logprobs for {int(c)} completion tokens")
    out = torch.zeros_like(like)
    flat = [x for lp in sampler_logprobs for x in lp]
    out[m] = torch.tensor(flat, dtype=torch.float64).to(dtype=out.dtype, device=out.device)  # row-major
    return out.detach()


def rollout_ratio_stats(
    trainer_rows: Sequence[torch.Tensor | None],
    sampler_logprobs: Sequence[Sequence[float]] | None,
    level: str,
    cap: float,
    mask_threshold: float,
) -> dict[str, float]:
    """The update's ``is_ratio_mean``, ``is_ratio_max``, ``is_clipped_frac`` and ``is_masked_frac``
    (``coba_tasks.core.grpo.rollout_correction_stats``) from one 1-D tensor per row of the trainer's
    completion-token log-probabilities before the update and the sampler's figures of the same rows.

    ``level`` none (no correction): the token-level ratio, nothing clipped or masked. NaN ratios (and 0
    shares) without sampler figures or without tokens."""
    rows = [t.double().cpu() if t is not None else torch.zeros(0, dtype=torch.float64) for t in trainer_rows]
    width = max((len(t) for t in rows), default=0)
    if sampler_logprobs is None or width == 0:
        nan = float("nan")
        return {"is_ratio_mean": nan, "is_ratio_max": nan, "is_clipped_frac": 0.0, "is_masked_frac": 0.0}
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, t in enumerate(rows):
        mask[i, : len(t)] = True
    old = padded_rows(rows, mask.double())
    theirs = padded_rows([torch.tensor(list(lp), dtype=torch.float64) for lp in sampler_logprobs], mask.double())
    applied = RolloutCorrection(level) is not RolloutCorrection.NONE
    _, ratio, dropped = rollout_correction_weights(
        old, theirs, mask, level if applied else "token", cap, mask_threshold if applied else 0.0
    )
    return rollout_correction_stats(ratio, dropped, mask, cap if applied else None)


class PromptWeights:
    """How the update's loss weighs a step's prompts (``optim.prompt_weighting``; docs/method.md).

    ``coba_tasks.core.grpo.prompt_loss_weights`` gives each row a token weight c_r from the *whole step*
    (its prompt's share: 1 under ``tokens``, N / (M * T_i) under ``equal``); a mini-batch's loss is
    ``sum_r c_r sum_t L_rt / sum_r c_r T_r`` over its rows, the normaliser counting every row of the
    mini-batch (those left out of the passes too), as the token mean counts every token. With one
    mini-batch that is ``(1/M) sum_i (1/T_i) sum_{t in i} L_t`` under ``equal``; with several, each
    mini-batch weighs its tokens as the step does, normalised over the mini-batch (as the token mean
    divides by the mini-batch's tokens). Every process of a data-parallel update reads the whole step, so
    each computes the same weights and normalisers: the summed gradient is the single-process one.

    ``group_ids`` (one per row, the prompt it answers); None groups the rows by identical prompt token ids.
    """

    def __init__(
        self,
        weighting: str,
        prompt_ids: Sequence[Sequence[int]],
        completion_ids: Sequence[Sequence[int]],
        group_ids: Sequence[int] | np.ndarray | None = None,
    ) -> None:
        self.weighting = PromptWeighting(weighting)
        if group_ids is None:
            first: dict[tuple[int, ...], int] = {}
            group_ids = [first.setdefault(tuple(int(t) for t in p), len(first)) for p in prompt_ids]
        self.groups = torch.as_tensor(np.asarray(group_ids, dtype=np.int64))  # (n,)
        if self.groups.shape != (len(completion_ids),):
            raise ValueError(f"{self.groups.numel()} group ids for {len(completion_ids)} rollouts")
        self.lengths = torch.tensor([len(c) for c in completion_ids], dtype=torch.float64)  # (n,) T_r
        # (n,) c_r; None under tokens (every weight 1: the update multiplies by nothing, as before)
        self.row_weights: torch.Tensor | None = None
        if self.weighting is not PromptWeighting.TOKENS:
            self.row_weights = prompt_loss_weights(self.groups, self.lengths, self.weighting)

    def tokens(self, rows: torch.Tensor) -> float:
        """The normaliser of the mini-batch ``rows``: its completion tokens, each weighted by c_r."""
        rows = rows.cpu()
        if self.row_weights is None:
            return float(self.lengths[rows].sum())
        return float((self.row_weights[rows] * self.lengths[rows]).sum())

    def weigh(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """(B, T) per-token values of the rows ``idx`` times their rows' c_r; ``x`` itself under tokens."""
        if self.row_weights is None:
            return x
        return x * self.row_weights[idx.cpu()].to(device=x.device, dtype=x.dtype).unsqueeze(-1)

    def loss_weights(self, idx: torch.Tensor, rc: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor | None:
        """``policy_loss``'s (B, T) ``weights`` of the rows ``idx``: the rollout correction's ``rc`` (None when
        off) times the rows' c_r; ``rc`` itself under tokens."""
        if self.row_weights is None:
            return rc
        return self.weigh(torch.ones_like(like).detach() if rc is None else rc, idx)

    def figures(self, advantages: np.ndarray | torch.Tensor) -> dict[str, float | str]:
        """The update's ``prompt_weighting`` and ``effective_prompts`` (``coba_tasks.core.grpo.effective_prompts``
        over the prompts with a non-zero advantage, from the step's weights)."""
        adv = torch.as_tensor(advantages).detach().double().cpu().flatten()
        c = torch.ones_like(self.lengths) if self.row_weights is None else self.row_weights
        return {
            "prompt_weighting": self.weighting.value,
            "effective_prompts": effective_prompts(self.groups, self.lengths, c, adv),
        }
