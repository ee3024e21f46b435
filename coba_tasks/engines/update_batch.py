"""A step's rollouts as the GRPO update sees them: padded tensors, one process's share, the sampler gap.

Helpers of ``coba_tasks.engines.trainer.PolicyTrainer.update`` that need no model: ``pad_sequences``
(prompt + completion token ids as right-padded tensors and masks, also used by the warm-up and the
update benchmark), ``DataShard`` (which rows this process computes and how its sums meet the other
processes'; ``coba_tasks.engines.fsdp_update.DistributedShard`` is its data-parallel subclass) and
``sampler_gap`` / ``sampler_gap_rows`` (how far the rollout engine's log-probabilities of the sampled
tokens are from the trainer's: the update's ``logprob_diff_mean`` and ``logprob_diff_max``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch


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
