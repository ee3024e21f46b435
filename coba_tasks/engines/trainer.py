"""The GRPO update: the training model that lives in the flow process between steps.

One ``PolicyTrainer`` holds the policy (a Hugging Face causal LM) and its AdamW optimizer for the
whole run. ``update`` takes one step's rollouts (prompt and completion token ids, one advantage per
rollout) and makes ``mini_batches`` optimizer steps per epoch, ``update_epochs`` epochs (veRL's PPO
mini-batches: the rollouts are shuffled, seeded by the update count, and cut into that many parts):

1. logp_old: the training model's log-probabilities of the sampled tokens *before* the update
   (not the sampler's), computed without gradients.
2. The clipped surrogate with clip-higher and token-mean over the whole batch
   (``coba_tasks.core.grpo.policy_loss``), accumulated over micro-batches of ``micro_batch_size``
   sequences with the mini-batch's token count as the normaliser, so memory stays bounded
   whatever the budgets are and the gradient equals the whole mini-batch's one. After the first
   optimizer step the ratio to logp_old moves away from 1 and the clip starts to act.
3. Optional KL to the reference (the starting model) when ``kl_coef > 0``; entropy is measured,
   not optimised (coefficient 0).

Precision: the training model keeps float32 weights and AdamW state whatever ``dtype`` says; with
``dtype`` bfloat16 or float16 the forward and backward passes run under ``torch.autocast`` in that
dtype (mixed precision, as veRL's FSDP does), and the checkpoint's ``model.safetensors`` is written
in it for the rollout engine, the float32 weights going to ``trainer/master.safetensors``. Pure
bfloat16 weights would not train at the paper's lr 1e-6: an AdamW step of ~1e-6 is below half a
bfloat16 ulp of nearly every weight (measured: 98.5% of weights N(0, 0.02) never moved in 10 steps).

Checkpoints are Hugging Face layout with safetensors (the rollout engine reloads them in place)
plus ``trainer/optimizer.safetensors`` (AdamW moments and steps as tensors, the torch RNG state) and
``trainer/trainer_state.json`` (param groups, update count, the caller's extra state), so a resumed
run continues exactly. No pickle anywhere.

Data parallelism: ``update`` reads which rows it computes, and how its sums meet other processes',
from ``self.shard`` (a ``DataShard``: the whole batch in one process). ``coba_tasks.engines.fsdp_update``
runs the same ``update`` in several processes with the policy wrapped by FSDP and a ``DataShard``
that holds one rank's share of each mini-batch; nothing else changes.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file, save_model

from coba_tasks.core.grpo import entropy_from_logits, kl_penalty, masked_mean, policy_loss, token_logprobs
from coba_tasks.engines.shared_prefix import group_by_prompt, shared_prefix_pass, supports_shared_prefix

# Kept in a subdirectory: vLLM's reload reads every *.safetensors file beside the model.
OPTIMIZER_FILE = "trainer/optimizer.safetensors"
MASTER_FILE = "trainer/master.safetensors"  # float32 weights, when model.safetensors is in a lower precision
TRAINER_STATE_FILE = "trainer/trainer_state.json"


@dataclass(frozen=True)
class UpdateSettings:
    """What the update needs from the run's config."""

    lr: float = 1e-4
    lr_warmup_steps: int = 0  # linear warm-up over this many updates (training steps); 0 = none
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    max_grad_norm: float = 1.0
    micro_batch_size: int = 64
    mini_batches: int = 1
    clip_low: float = 0.2
    clip_high: float = 0.28
    kl_coef: float = 0.0
    update_epochs: int = 1
    dtype: str = "float32"
    trust_remote_code: bool = False
    gradient_checkpointing: bool = False
    threads: int = 1
    shared_prefix: bool = True  # encode each group's prompt once (coba_tasks.engines.shared_prefix)


def warmup_lr(lr: float, warmup_steps: int, update: int) -> float:
    """The learning rate of update ``update`` (from 0): linear warm-up ``lr * (update + 1) / warmup_steps``
    for the first ``warmup_steps`` updates, then ``lr`` (veRL's constant schedule with warm-up).

    AdamW's first steps move every weight by about the learning rate whatever its gradient's noise; a
    warm-up keeps those steps small while the moment estimates settle."""
    if warmup_steps <= 0:
        return lr
    return lr * min(1.0, (update + 1) / warmup_steps)


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
    diff = (theirs - ours.double()).abs()
    return float(diff.mean()), float(diff.max())


def _padded(rows: Sequence[torch.Tensor | None], like: torch.Tensor) -> torch.Tensor:
    """Per-row 1-D tensors placed left-aligned in a zero tensor shaped like ``like`` (n, C)."""
    out = torch.zeros_like(like)
    for i, t in enumerate(rows):
        if t is not None:
            out[i, : len(t)] = t.to(out.dtype)
    return out.detach()


def make_optimizer(model: torch.nn.Module, settings: UpdateSettings) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (two groups: ndim >= 2 decayed, the rest not)."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": settings.weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=settings.lr,
        betas=settings.betas,
        eps=settings.eps,
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


class PolicyTrainer:
    """The policy being trained and its optimizer (one per run)."""

    def __init__(self, model_path: str | Path, settings: UpdateSettings, seed: int = 0) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(settings.threads)
        torch.manual_seed(seed)
        self.settings = settings
        dtype = torch.float32 if settings.dtype in ("float32", "auto") else getattr(torch, settings.dtype)
        self.compute_dtype = dtype  # autocast dtype; the weights below stay float32 (mixed precision)
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=settings.trust_remote_code)
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=torch.float32, trust_remote_code=settings.trust_remote_code
        ).to(self.device)
        if settings.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        self.ref_model = None
        if settings.kl_coef > 0:
            self.ref_model = AutoModelForCausalLM.from_pretrained(
                model_path, dtype=dtype, trust_remote_code=settings.trust_remote_code
            ).to(self.device)
            self.ref_model.eval().requires_grad_(False)
        self.optimizer = make_optimizer(self.model, settings)
        self.shard = DataShard()  # the whole batch here; coba_tasks.engines.fsdp_update sets one rank's share
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.updates = 0
        self.timings: dict[str, float] = {}  # seconds of the last update: forward, backward, optimizer

    # -- log-probabilities ----------------------------------------------------------------------
    def _logprobs(self, model, ids: torch.Tensor, attn: torch.Tensor, with_entropy: bool = False):
        """Per-token log p of ids[:, 1:] given the prefix: (B, T-1); and entropy (B, T-1) if asked."""
        mixed = self.compute_dtype != torch.float32
        with torch.autocast(device_type=self.device, dtype=self.compute_dtype, enabled=mixed):
            logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()  # (B, T-1, V)
        logp = token_logprobs(logits, ids[:, 1:])
        ent = entropy_from_logits(logits) if with_entropy else None
        return logp, ent

    def _all_logprobs(self, model, ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Per-token log p of every row, (B, T-1), without gradients, in micro-batches; each process
        computes its share of the rows and the shares are summed (the other rows are zeros)."""
        n = ids.shape[0]
        mine = self.shard.mine(torch.arange(n, device=ids.device))
        out = torch.zeros((n, ids.shape[1] - 1), dtype=torch.float32, device=ids.device)
        for b in self.shard.micro_batches(n, self.settings.micro_batch_size):
            idx = mine[b]
            if idx.numel() == 0:  # an idle pass keeps FSDP's collectives in step across processes
                self._logprobs(model, ids[:1], attn[:1])
                continue
            out[idx] = self._logprobs(model, ids[idx], attn[idx])[0]
        return self.shard.sum(out)

    def _idle_pass(self, ids: torch.Tensor, attn: torch.Tensor) -> None:
        """A forward and backward with a zero loss: a process with no rows left in a mini-batch still
        takes part in FSDP's all-gathers and reduce-scatters (its gradient contribution is 0)."""
        logp, _ = self._logprobs(self.model, ids[:1], attn[:1])
        (logp.sum() * 0.0).backward()

    # -- the update -----------------------------------------------------------------------------
    def update(
        self,
        prompt_ids: Sequence[Sequence[int]],
        completion_ids: Sequence[Sequence[int]],
        advantages: np.ndarray | torch.Tensor,
        sampler_logprobs: Sequence[Sequence[float]] | None = None,
    ) -> dict[str, float]:
        """One GRPO update on a step's rollouts; returns its metrics.

        ``sampler_logprobs`` (one list per rollout, one float per completion token: the rollout
        engine's log p of the tokens it sampled) are compared with the trainer's own log p of the same
        tokens before the update: ``logprob_diff_mean`` and ``logprob_diff_max`` are the mean and the
        largest |sampler - trainer| over the completion tokens (NaN when not given). They measure the
        train/rollout mismatch: a stale weight reload, another tokenization or a dtype difference.
        """
        if len(prompt_ids) == 0:
            raise ValueError("GRPO update on an empty batch")
        if self.shared_prefix_unavailable() is None:
            return self._update_shared_prefix(prompt_ids, completion_ids, advantages, sampler_logprobs)
        return self._update_full_sequences(prompt_ids, completion_ids, advantages, sampler_logprobs)

    def shared_prefix_unavailable(self) -> str | None:
        """Why this trainer updates on full sequences; None when it encodes each group's prompt once."""
        if not self.settings.shared_prefix:
            return "optim.shared_prefix is false"
        if self.shard.world > 1:
            return "data-parallel (FSDP) processes run the full-sequence update in step with each other"
        return supports_shared_prefix(self.model)

    def _begin_update(self) -> dict[str, float]:
        """Sets this update's learning rate and train mode; returns the metric sums to fill."""
        for group in self.optimizer.param_groups:  # the warm-up follows the update count, so a resume agrees
            group["lr"] = warmup_lr(self.settings.lr, self.settings.lr_warmup_steps, self.updates)
        self.model.train()
        return {"loss": 0.0, "kl": 0.0, "entropy": 0.0, "clip_tokens": 0.0, "grad_norm": 0.0}

    def _mini_batch_steps(
        self,
        n: int,
        parts: int,
        tokens_of: Callable[[torch.Tensor], float],
        mini_batch: Callable[[torch.Tensor, float], None],
        totals: dict[str, float],
    ) -> int:
        """``update_epochs`` epochs over the ``n`` rows in ``parts`` mini-batches (shuffled when more than
        one; the order is seeded by the update count, so a resume agrees), one optimizer step each:
        ``mini_batch(rows, tokens)`` accumulates the gradients of the rows, whose completion tokens number
        ``tokens_of(rows)`` (a mini-batch without any is skipped). Returns the optimizer steps made."""
        gen = torch.Generator().manual_seed(self.updates)
        opt_steps = 0
        for _ in range(self.settings.update_epochs):
            order = torch.randperm(n, generator=gen) if parts > 1 else torch.arange(n)
            for rows in torch.tensor_split(order, parts):
                mb_tokens = tokens_of(rows)
                if mb_tokens == 0:
                    continue
                self.optimizer.zero_grad(set_to_none=True)
                mini_batch(rows, mb_tokens)
                self._optimizer_step(totals)
                opt_steps += 1
        return opt_steps

    def _finish_update(
        self, totals: dict[str, float], token_count: float, n: int, opt_steps: int, gap: tuple[float, float]
    ) -> dict[str, float]:
        s = self.settings
        self.optimizer.zero_grad(set_to_none=True)  # free the gradients' memory until the next update
        self.model.eval()
        self.updates += 1
        totals.update(self.shard.sum_floats({k: v for k, v in totals.items() if k != "grad_norm"}))
        seen = token_count * s.update_epochs  # every token is seen once per epoch
        grad_norm = totals["grad_norm"] / max(opt_steps, 1)
        return {
            "loss": totals["loss"] / seen,
            "clip_frac": totals["clip_tokens"] / seen,
            "grad_norm": grad_norm if math.isfinite(grad_norm) else float("nan"),
            "entropy": totals["entropy"] / seen,
            "kl": totals["kl"] / seen,
            "tokens": int(token_count),
            "sequences": int(n),
            "optimizer_steps": opt_steps,
            "lr": float(self.optimizer.param_groups[0]["lr"]),
            "logprob_diff_mean": gap[0],
            "logprob_diff_max": gap[1],
        }

    def _time(self, what: str, since: float) -> None:
        self.timings[what] = self.timings.get(what, 0.0) + time.perf_counter() - since

    def _optimizer_step(self, totals: dict[str, float]) -> None:
        t0 = time.perf_counter()
        grad_norm = self.shard.clip_grad_norm_(self.model.parameters(), self.settings.max_grad_norm)
        totals["grad_norm"] += float(grad_norm)
        self.optimizer.step()
        self._time("optimizer", t0)

    def _update_shared_prefix(
        self,
        prompt_ids: Sequence[Sequence[int]],
        completion_ids: Sequence[Sequence[int]],
        advantages: np.ndarray | torch.Tensor,
        sampler_logprobs: Sequence[Sequence[float]] | None,
    ) -> dict[str, float]:
        """``update`` with each group's prompt encoded once and the output projection only at completion
        tokens (``coba_tasks.engines.shared_prefix``). The same loss and gradients as the full-sequence
        update, within float rounding. With one optimizer step (``mini_batches`` 1, ``update_epochs`` 1)
        logp_old is the same forward's log-probabilities, detached: the weights have not moved yet, so a
        separate pass would compute the same numbers again."""
        s = self.settings
        n = len(prompt_ids)
        adv = torch.as_tensor(np.asarray(advantages, dtype=np.float32), device=self.device)
        lengths = [len(c) for c in completion_ids]
        token_count = float(sum(lengths))
        if token_count == 0:
            raise ValueError("GRPO update: no completion tokens in the batch")
        parts = max(1, min(s.mini_batches, n))
        one_step = parts == 1 and s.update_epochs == 1
        self.timings = {}
        old_rows: list[torch.Tensor | None] = [None] * n  # the trainer's log p before the update, per row
        ref_rows: list[torch.Tensor | None] = [None] * n
        if not one_step:
            self.model.eval()  # dropout off; logp_old from the model before the update
            self._grouped_logprobs(self.model, prompt_ids, completion_ids, old_rows)
        if self.ref_model is not None:
            self._grouped_logprobs(self.ref_model, prompt_ids, completion_ids, ref_rows)

        totals = self._begin_update()

        def mini_batch(rows: torch.Tensor, mb_tokens: float) -> None:
            def on_chunk(idx, logp, mask, logits):
                if one_step:
                    for i, r in enumerate(idx.tolist()):
                        old_rows[r] = logp[i][mask[i]].detach()
                    old = logp.detach()
                else:
                    old = _padded([old_rows[r] for r in idx.tolist()], logp)
                weights = mask.to(logp.dtype)
                loss, stats = policy_loss(logp, old, adv[idx], weights, s.clip_low, s.clip_high, token_count=mb_tokens)
                if self.ref_model is not None:
                    ref = _padded([ref_rows[r] for r in idx.tolist()], logp)
                    kl = masked_mean(kl_penalty(logp, ref, weights), weights, mb_tokens)
                    loss = loss + s.kl_coef * kl
                    totals["kl"] += float(kl.detach()) * mb_tokens
                totals["loss"] += float(loss.detach()) * mb_tokens
                n_tok = float(weights.sum())
                if n_tok > 0:
                    totals["clip_tokens"] += stats["clip_frac"] * n_tok
                with torch.no_grad():
                    totals["entropy"] += float(entropy_from_logits(logits.detach()[None]).sum())
                return loss

            shared_prefix_pass(
                self.model,
                group_by_prompt(prompt_ids, rows.tolist()),
                completion_ids,
                on_chunk,
                chunk=s.micro_batch_size,
                grad=True,
                autocast_dtype=self.compute_dtype,
                timings=self.timings,
            )

        opt_steps = self._mini_batch_steps(
            n, parts, lambda rows: float(sum(lengths[int(r)] for r in rows)), mini_batch, totals
        )
        gap = sampler_gap_rows(old_rows, sampler_logprobs, completion_ids)
        return self._finish_update(totals, token_count, n, opt_steps, gap)

    def _grouped_logprobs(
        self, model, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]], out: list
    ) -> None:
        """Each row's completion-token log-probabilities under ``model``, without gradients, into ``out``."""

        def keep(idx, logp, mask, logits):
            for i, r in enumerate(idx.tolist()):
                out[r] = logp[i][mask[i]].detach()

        with torch.no_grad():
            shared_prefix_pass(
                model,
                group_by_prompt(prompt_ids),
                completion_ids,
                keep,
                chunk=self.settings.micro_batch_size,
                grad=False,
                autocast_dtype=self.compute_dtype,
                timings=self.timings,
            )

    def _update_full_sequences(
        self,
        prompt_ids: Sequence[Sequence[int]],
        completion_ids: Sequence[Sequence[int]],
        advantages: np.ndarray | torch.Tensor,
        sampler_logprobs: Sequence[Sequence[float]] | None,
    ) -> dict[str, float]:
        """``update`` on padded ``prompt + completion`` sequences: the reference, and what FSDP ranks run."""
        s = self.settings
        self.timings = {}
        ids, attn, comp = pad_sequences(prompt_ids, completion_ids, self.pad_id)
        ids, attn, comp = ids.to(self.device), attn.to(self.device), comp.to(self.device)
        mask = comp[:, 1:]  # (B, T-1): position t predicts token t+1
        adv = torch.as_tensor(np.asarray(advantages, dtype=np.float32), device=self.device)
        token_count = float(mask.sum())
        if token_count == 0:
            raise ValueError("GRPO update: no completion tokens in the batch")
        n = ids.shape[0]
        parts = max(1, min(s.mini_batches, n))
        with torch.no_grad():
            self.model.eval()  # dropout off; logp_old from the model before the update
            t0 = time.perf_counter()
            logp_old = self._all_logprobs(self.model, ids, attn)
            self._time("forward", t0)
            ref_logp = self._all_logprobs(self.ref_model, ids, attn) if self.ref_model is not None else None
        gap = sampler_gap(logp_old, mask, sampler_logprobs, completion_ids)

        totals = self._begin_update()

        def mini_batch(rows: torch.Tensor, mb_tokens: float) -> None:
            mine = self.shard.mine(rows.to(self.device))  # mb_tokens above counts every process's rows: token-mean
            for b in self.shard.micro_batches(rows.numel(), s.micro_batch_size):
                idx = mine[b]
                if idx.numel() == 0:
                    self._idle_pass(ids, attn)
                    continue
                t0 = time.perf_counter()
                logp, ent = self._logprobs(self.model, ids[idx], attn[idx], with_entropy=True)
                self._time("forward", t0)
                loss, stats = policy_loss(
                    logp, logp_old[idx], adv[idx], mask[idx], s.clip_low, s.clip_high, token_count=mb_tokens
                )
                if ref_logp is not None:
                    kl = masked_mean(kl_penalty(logp, ref_logp[idx], mask[idx]), mask[idx], mb_tokens)
                    loss = loss + s.kl_coef * kl
                    totals["kl"] += float(kl.detach()) * mb_tokens
                t0 = time.perf_counter()
                loss.backward()
                self._time("backward", t0)
                totals["loss"] += float(loss.detach()) * mb_tokens
                n_tok = float(mask[idx].sum())
                if n_tok > 0:
                    totals["clip_tokens"] += stats["clip_frac"] * n_tok
                totals["entropy"] += float(masked_mean(ent.detach(), mask[idx], token_count)) * token_count

        opt_steps = self._mini_batch_steps(
            n, parts, lambda rows: float(mask[rows.to(self.device)].sum()), mini_batch, totals
        )
        return self._finish_update(totals, token_count, n, opt_steps, gap)

    # -- checkpoints ----------------------------------------------------------------------------
    def save_checkpoint(self, out_dir: str | Path, extra_state: dict[str, Any] | None = None) -> Path:
        """Model + tokenizer (HF layout, safetensors), optimizer state (safetensors) and trainer state (JSON)."""
        tensors, groups = optimizer_to_tensors(self.optimizer)
        return write_checkpoint(
            out_dir, self.model, self.tokenizer, self.compute_dtype, tensors, groups, self.updates, extra_state
        )

    def load_checkpoint(self, ckpt_dir: str | Path) -> dict[str, Any]:
        """Restore weights, optimizer state and RNG from ``save_checkpoint`` output; returns the extra state."""
        from safetensors.torch import load_model

        ckpt = Path(ckpt_dir)
        master = ckpt / MASTER_FILE
        load_model(self.model, str(master if master.is_file() else ckpt / "model.safetensors"), strict=False)
        state = json.loads((ckpt / TRAINER_STATE_FILE).read_text())
        tensors = load_file(str(ckpt / OPTIMIZER_FILE))
        torch.set_rng_state(tensors.pop("rng.torch"))
        optimizer_from_tensors(self.optimizer, tensors, state["param_groups"])
        self.updates = int(state["updates"])
        return state


def write_checkpoint(
    out_dir: str | Path,
    model: torch.nn.Module,
    tokenizer: Any,
    compute_dtype: torch.dtype,
    optimizer_tensors: dict[str, torch.Tensor],
    param_groups: list[dict],
    updates: int,
    extra_state: dict[str, Any] | None = None,
    rng_state: torch.Tensor | None = None,
) -> Path:
    """Write a checkpoint: ``model`` (a plain, unsharded HF model holding the float32 weights) and
    ``tokenizer`` in HF layout, the optimizer tensors (``optimizer_to_tensors``) plus the torch RNG
    state (this process's unless ``rng_state``), and the trainer state JSON."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if compute_dtype == torch.float32:
        model.save_pretrained(out, safe_serialization=True)
    else:  # the engine's weights in the compute dtype; the float32 master weights for a resume
        cast: dict[int, torch.Tensor] = {}  # one copy per storage: tied weights stay tied (written once)
        low = {k: cast.setdefault(v.data_ptr(), v.to(compute_dtype)) for k, v in model.state_dict().items()}
        model.save_pretrained(out, state_dict=low, safe_serialization=True)
        (out / MASTER_FILE).parent.mkdir(exist_ok=True)
        save_model(model, str(out / MASTER_FILE))
    tokenizer.save_pretrained(out)
    tensors = dict(optimizer_tensors)
    tensors["rng.torch"] = torch.get_rng_state() if rng_state is None else rng_state
    (out / OPTIMIZER_FILE).parent.mkdir(exist_ok=True)
    save_file(tensors, str(out / OPTIMIZER_FILE))
    state = {"updates": updates, "param_groups": param_groups, **(extra_state or {})}
    (out / TRAINER_STATE_FILE).write_text(json.dumps(state, indent=2))
    return out


def optimizer_to_tensors(
    optimizer: torch.optim.Optimizer, full: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """Flatten an optimizer's state_dict into named tensors (safetensors) and JSON-safe param groups.

    ``full`` maps a state tensor to the whole tensor (FSDP: ``DTensor.full_tensor``, a collective that
    every process calls in the same order); by default tensors are taken as they are.
    """
    sd = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    for idx, st in sd["state"].items():
        for key, value in st.items():
            t = value if torch.is_tensor(value) else torch.tensor(value)
            if full is not None:
                t = full(t)
            tensors[f"state.{idx}.{key}"] = t.detach().cpu().contiguous()
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in sd["param_groups"]]
    return tensors, groups


def optimizer_from_tensors(
    optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], groups: list[dict]
) -> None:
    """Inverse of ``optimizer_to_tensors``."""
    state: dict[int, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        _, idx, key = name.split(".", 2)
        state.setdefault(int(idx), {})[key] = t
    restored = [{k: (tuple(v) if k == "betas" else v) for k, v in g.items()} for g in groups]
    optimizer.load_state_dict({"state": state, "param_groups": restored})
