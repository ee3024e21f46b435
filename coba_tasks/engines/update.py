"""The GRPO update: the training model that lives in the flow process between steps (``PolicyTrainer``),
and the rollout engine put to sleep while it runs on a shared GPU (``engine_asleep``).

What ``update`` computes (mini-batches, the clipped token-mean loss, logp_old, KL, entropy, the rollout
correction, prompt weighting, the shared-prefix pass): docs/method.md, sections 14-19. Precision: float32
weights and AdamW state, autocast in ``dtype`` (as veRL's FSDP does): an AdamW step at lr 1e-6 is below half a
bfloat16 ulp of nearly every weight (docs/design.md, "Other decisions"). Checkpoints:
``coba_tasks.engines.checkpoint``; ``coba_tasks.engines.fsdp_update`` runs the same ``update`` in several
processes, each with a ``DataShard`` holding its share of each mini-batch.
"""

from __future__ import annotations

import functools
import math
import os
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from coba_tasks.core.grpo import (
    PromptWeighting,
    RolloutCorrection,
    effective_prompts,
    entropy_from_logits,
    kl_penalty,
    masked_mean,
    policy_loss,
    prompt_loss_weights,
    rollout_correction_stats,
    rollout_correction_weights,
    token_logprobs,
)
from coba_tasks.engines.checkpoint import (
    load_adapter_weights,
    load_optimizer_state,
    load_weights,
    optimizer_to_tensors,
    write_checkpoint,
)
from coba_tasks.engines.digest import params_digest
from coba_tasks.engines.shared_prefix import group_by_prompt, shared_prefix_pass, supports_shared_prefix

# -- what the update is told: its settings, the learning-rate schedule, the optimizer


@dataclass(frozen=True)
class UpdateSettings:
    """What the update needs from the run's config (``coba_tasks.pipeline.policy.update_settings``). No key has a
    default here, so what a benchmark or a test measures is what a run with the same keys computes."""

    lr: float
    lr_warmup_steps: int  # linear warm-up over this many updates (training steps); 0 = none
    lr_schedule: str  # after the warm-up: constant, linear or cosine (transformers' schedules), to 0 at ...
    lr_schedule_steps: int  # ... this many updates (run.steps)
    weight_decay: float
    betas: tuple[float, float]
    eps: float
    max_grad_norm: float
    micro_batch_size: int
    mini_batches: int
    clip_low: float
    clip_high: float
    kl_coef: float
    update_epochs: int
    dtype: str
    trust_remote_code: bool
    gradient_checkpointing: bool
    shared_prefix: bool  # encode each group's prompt once (coba_tasks.engines.shared_prefix)
    temperature: float  # the rollouts': every log-probability is of log_softmax(logits / temperature)
    skip_zero_advantage: bool  # rows of advantage exactly 0 left out of the passes when no KL term needs them
    lora_rank: int  # 0 = full fine-tuning (coba_tasks.engines.lora)
    lora_alpha: float
    lora_target_modules: str | tuple[str, ...]
    rollout_correction: str  # none | token | sequence (coba_tasks.core.grpo.rollout_correction_weights)
    rollout_correction_cap: float
    rollout_mask_threshold: float  # tau > 1 drops ratios outside [1/tau, tau]; 0 = none
    prompt_weighting: str  # tokens | equal (coba_tasks.core.grpo.prompt_loss_weights)
    # torch's CPU threads for the update: not a config key (a run keeps 1; `coba bench update` takes the machine's)
    threads: int = 1

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(
                f"the update's temperature must be > 0 (the rollouts' sampling temperature), got {self.temperature}"
            )
        if self.rollout_correction not in {k.value for k in RolloutCorrection}:
            raise ValueError(
                f"rollout_correction must be one of {[k.value for k in RolloutCorrection]}, "
                f"got {self.rollout_correction!r}"
            )
        if self.prompt_weighting not in {k.value for k in PromptWeighting}:
            raise ValueError(
                f"prompt_weighting must be one of {[k.value for k in PromptWeighting]}, got {self.prompt_weighting!r}"
            )
        if not self.rollout_correction_cap > 0:
            raise ValueError(f"rollout_correction_cap must be > 0, got {self.rollout_correction_cap}")
        if not (self.rollout_mask_threshold == 0 or self.rollout_mask_threshold > 1):
            raise ValueError(f"rollout_mask_threshold must be 0 (none) or > 1, got {self.rollout_mask_threshold}")

    @property
    def corrects_rollouts(self) -> bool:
        return self.rollout_correction != RolloutCorrection.NONE


def scheduled_lr(settings: UpdateSettings, update: int) -> float:
    """The learning rate of update ``update`` (from 0): ``warmup_lr`` during the warm-up and under the constant
    schedule, else the decay of transformers' schedule of that name (``get_scheduler``: linear or cosine from
    ``lr`` at the warm-up's end to 0 at ``lr_schedule_steps`` updates).

    >>> from types import SimpleNamespace
    >>> s = SimpleNamespace(lr=1.0, lr_warmup_steps=2, lr_schedule="linear", lr_schedule_steps=6)
    >>> [round(scheduled_lr(s, k), 3) for k in range(6)]
    [0.5, 1.0, 1.0, 0.75, 0.5, 0.25]
    """
    warmup = settings.lr_warmup_steps
    if settings.lr_schedule == "constant" or update < warmup:
        return warmup_lr(settings.lr, warmup, update)
    return settings.lr * _decay(settings.lr_schedule, warmup, settings.lr_schedule_steps)(update)


@functools.lru_cache(maxsize=8)
def _decay(schedule: str, warmup: int, steps: int) -> Callable[[int], float]:
    """transformers' multiplier of update k for ``schedule`` (its ``lr_lambda``), read off the scheduler it builds."""
    from transformers import get_scheduler

    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)  # get_scheduler needs one
    return get_scheduler(schedule, optimizer, num_warmup_steps=warmup, num_training_steps=steps).lr_lambdas[0]


def warmup_lr(lr: float, warmup_steps: int, update: int) -> float:
    """The learning rate of update ``update`` (from 0): linear warm-up over ``warmup_steps`` updates, then ``lr``
    (veRL's constant schedule with warm-up). AdamW's first steps move every weight by about the learning rate
    whatever its gradient's noise; a warm-up keeps those steps small while the moment estimates settle."""
    if warmup_steps <= 0:
        return lr
    return lr * min(1.0, (update + 1) / warmup_steps)


def make_optimizer(model: torch.nn.Module, settings: UpdateSettings) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (ndim >= 2)."""
    trained = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters only
    decay = [p for p in trained if p.ndim >= 2]
    rest = [p for p in trained if p.ndim < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": settings.weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=settings.lr,
        betas=settings.betas,
        eps=settings.eps,
    )


# -- a step's rollouts as the update sees them (no model needed)


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
    """Right-padded prompt + completion: (input_ids, attention_mask, completion_mask), each (B, T);
    completion_mask is 1 at the completion tokens (the ones the loss sees)."""
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
    """Which rows of a step's batch this process computes (rank r: rows r, r + world, ... of each mini-batch),
    and how its sums meet the other processes'. This base class is the single process;
    ``coba_tasks.engines.fsdp_update.DistributedShard`` overrides ``rank``/``world`` and the three collectives."""

    rank: int = 0
    world: int = 1
    distributed: bool = False  # the policy is sharded across processes (FSDP), one process included

    def mine(self, rows: torch.Tensor) -> torch.Tensor:
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

    def sum(self, t: torch.Tensor) -> torch.Tensor:  # elementwise over the processes, in place
        return t

    def sum_floats(self, values: dict[str, float]) -> dict[str, float]:
        return values

    def clip_grad_norm_(self, params: Iterable[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm; returns the norm before clipping."""
        return torch.nn.utils.clip_grad_norm_(params, max_norm)


def sampler_gap(
    logp: torch.Tensor,
    mask: torch.Tensor,
    sampler_logprobs: Sequence[Sequence[float]] | None,
    completion_ids: Sequence[Sequence[int]],
) -> tuple[float, float]:
    """(mean, max) of |sampler log p - trainer log p| over the completion tokens (where ``mask``, (B, T-1), is 1,
    one per entry of ``sampler_logprobs[b]``); NaNs without sampler figures."""
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
    """The update's ``is_*`` figures (``coba_tasks.core.grpo.rollout_correction_stats``) from the trainer's
    completion-token log-probabilities before the update (one 1-D tensor per row) and the sampler's. ``level``
    none: the token-level ratio, nothing clipped or masked. NaN ratios without sampler figures or tokens."""
    rows = [t.double().cpu() if t is not None else torch.zeros(0, dtype=torch.float64) for t in trainer_rows]
    width = max((len(t) for t in rows), default=0)
    if sampler_logprobs is None or width == 0:
        nan = float("nan")
        return {"is_ratio_mean": nan, "is_ratio_max": nan, "is_clipped_frac": 0.0, "is_masked_frac": 0.0}
    mask = torch.arange(width) < torch.tensor([len(t) for t in rows]).unsqueeze(1)  # (n, width)
    old = padded_rows(rows, mask.double())
    theirs = padded_rows([torch.tensor(list(lp), dtype=torch.float64) for lp in sampler_logprobs], mask.double())
    applied = RolloutCorrection(level) is not RolloutCorrection.NONE
    _, ratio, dropped = rollout_correction_weights(
        old, theirs, mask, level if applied else "token", cap, mask_threshold if applied else 0.0
    )
    return rollout_correction_stats(ratio, dropped, mask, cap if applied else None)


class PromptWeights:
    """How the update's loss weighs a step's prompts (``optim.prompt_weighting``): each row's token weight c_r,
    from the whole step (docs/method.md, "Prompt weighting"). ``group_ids``: each row's prompt; None groups the
    rows by identical prompt token ids."""

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
        """The update's ``prompt_weighting`` and ``effective_prompts`` (``coba_tasks.core.grpo.effective_prompts``)."""
        adv = torch.as_tensor(advantages).detach().double().cpu().flatten()
        c = torch.ones_like(self.lengths) if self.row_weights is None else self.row_weights
        return {
            "prompt_weighting": self.weighting.value,
            "effective_prompts": effective_prompts(self.groups, self.lengths, c, adv),
        }


# -- the training model


# -- an update that repeats bit for bit (docs/operations.md, "Checkpoints and replay")

CUBLAS_CONFIG = "CUBLAS_WORKSPACE_CONFIG"
REPEATABLE_CUBLAS = (":4096:8", ":16:8")  # the workspace settings under which cuBLAS repeats its results


def repeatable_setup(cuda: bool | None = None) -> str | None:
    """Make this process's updates repeat bit for bit where the device allows it; why they cannot otherwise.

    On CUDA (``cuda`` None: whether torch sees one): cuBLAS's workspace setting is fixed
    (``CUBLAS_WORKSPACE_CONFIG``, read once per process: call this before the rollout engine starts) and each
    update runs with torch's deterministic kernels (``deterministic_kernels``); a user's own setting other than
    ``REPEATABLE_CUBLAS`` is the reason returned. On the CPU, kernels repeat on one machine by themselves (another
    CPU or torch build may not: the replay's weights digest says so)."""
    if not (torch.cuda.is_available() if cuda is None else cuda):
        return None
    value = os.environ.setdefault(CUBLAS_CONFIG, REPEATABLE_CUBLAS[0])
    if value not in REPEATABLE_CUBLAS:
        return f"{CUBLAS_CONFIG}={value} (cuBLAS repeats its results only with {' or '.join(REPEATABLE_CUBLAS)})"
    return None


@contextmanager
def deterministic_kernels(enabled: bool) -> Iterator[list[str]]:
    """torch's deterministic kernels for the block when ``enabled`` (its own setting back after); yields a list
    that holds, after the block, torch's warning for each operation that ran without a deterministic kernel."""
    found: list[str] = []
    if not enabled:
        yield found
        return
    import torch.utils.deterministic as td

    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    fill = td.fill_uninitialized_memory  # filling every torch.empty with NaN: a cost, and no part of repeating
    torch.use_deterministic_algorithms(True, warn_only=True)
    td.fill_uninitialized_memory = False
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield found
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        td.fill_uninitialized_memory = fill
    for w in caught:
        if "determinis" in str(w.message).lower():
            found.append(str(w.message))
        else:  # any other warning shown as it would have been
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)


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
        self.model_path = str(model_path)
        self.peft_model = None  # with LoRA: the PeftModel; self.model is its base model, adapters in place
        if settings.lora_rank > 0:
            from coba_tasks.engines.lora import add_lora, base_sha256

            self.base_sha256 = base_sha256(model_path)  # recorded in each checkpoint, checked at a resume

            self.peft_model = add_lora(
                self.model, settings.lora_rank, settings.lora_alpha, settings.lora_target_modules
            )
            self.model = self.peft_model.get_base_model()
        if settings.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
            if self.peft_model is not None:  # frozen embeddings: checkpointed blocks need an input that wants grad
                self.model.enable_input_require_grads()
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
        # torch's warnings of the last update's operations that ran without a deterministic kernel (CUDA): an update
        # that will not repeat bit for bit, whose checkpoint the run writes (``coba_tasks.pipeline.stages``)
        self.not_repeatable: list[str] = []

    # -- log-probabilities ----------------------------------------------------------------------
    def _logprobs(self, model, ids: torch.Tensor, attn: torch.Tensor, with_entropy: bool = False):
        """Per-token log p of ids[:, 1:] given the prefix: (B, T-1); and entropy (B, T-1) if asked."""
        mixed = self.compute_dtype != torch.float32
        with torch.autocast(device_type=self.device, dtype=self.compute_dtype, enabled=mixed):
            logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]  # (B, T-1, V)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # float32 (float64 stays float64)
        if self.settings.temperature != 1.0:  # the sampling distribution: log_softmax(z / T)
            logits = logits / self.settings.temperature
        logp = token_logprobs(logits, ids[:, 1:])
        ent = entropy_from_logits(logits) if with_entropy else None
        return logp, ent

    def _all_logprobs(
        self, model, ids: torch.Tensor, attn: torch.Tensor, rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Per-token log p of every row (or of ``rows`` only; the others stay zeros), (B, T-1), without
        gradients, in micro-batches; each process computes its share of the rows and the shares are summed."""
        n = ids.shape[0]
        rows = torch.arange(n, device=ids.device) if rows is None else rows.to(ids.device)
        mine = self.shard.mine(rows)
        dtype = torch.promote_types(next(model.parameters()).dtype, torch.float32)
        out = torch.zeros((n, ids.shape[1] - 1), dtype=dtype, device=ids.device)
        for b in self.shard.micro_batches(rows.numel(), self.settings.micro_batch_size):
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
        group_ids: Sequence[int] | np.ndarray | None = None,
    ) -> dict[str, float]:
        """One GRPO update on a step's rollouts; returns its metrics. ``sampler_logprobs``: the engine's log p of
        each completion token (``logprob_diff_*``, the rollout correction); ``group_ids``: each rollout's prompt,
        for ``prompt_weighting`` (None: rollouts with identical prompt token ids are one prompt's)."""
        if len(prompt_ids) == 0:
            raise ValueError("GRPO update on an empty batch")
        check_advantages(advantages, self.settings.lr)  # never a pass, let alone a step, on a NaN advantage
        prompts = PromptWeights(self.settings.prompt_weighting, prompt_ids, completion_ids, group_ids)
        run = self._update_shared_prefix if self.shared_prefix_unavailable() is None else self._update_full_sequences
        with deterministic_kernels(self.device == "cuda") as self.not_repeatable:
            return run(prompt_ids, completion_ids, advantages, sampler_logprobs, prompts)

    def params_digest(self) -> str:
        """The digest of the trained parameters (LoRA: the adapters), computed on their device
        (``coba_tasks.engines.digest``): what a replayed update must give again."""
        return params_digest((n, p) for n, p in self.model.named_parameters() if p.requires_grad)

    def shared_prefix_unavailable(self) -> str | None:
        """Why this trainer updates on full sequences; None when it uses the shared-prefix pass."""
        if not self.settings.shared_prefix:
            return "optim.shared_prefix is false"
        if self.shard.distributed:  # one FSDP process too: the shared-prefix pass calls submodules FSDP does not gather
            return "data-parallel (FSDP) processes run the full-sequence update in step with each other"
        return supports_shared_prefix(self.model)

    def _sampler_needed(self, sampler_logprobs: Sequence[Sequence[float]] | None) -> None:
        if self.settings.corrects_rollouts and sampler_logprobs is None:
            raise ValueError(
                f"optim.rollout_correction = {self.settings.rollout_correction} needs the sampler's logprobs, "
                "but these rollouts have none (rollouts.parquet without a logprobs column); "
                "set optim.rollout_correction=none or sample the rollouts again"
            )

    def _ratio_stats(
        self, old_rows: Sequence[torch.Tensor | None], sampler_logprobs: Sequence[Sequence[float]] | None
    ) -> dict[str, float]:
        s = self.settings
        return rollout_ratio_stats(
            old_rows, sampler_logprobs, s.rollout_correction, s.rollout_correction_cap, s.rollout_mask_threshold
        )

    def _correction_weights(self, logp_old: torch.Tensor, logp_sampler: torch.Tensor, mask: torch.Tensor):
        """The rollout correction's (B, T) loss weights, or None when it is off."""
        s = self.settings
        if not s.corrects_rollouts:
            return None
        weights, _, _ = rollout_correction_weights(
            logp_old, logp_sampler, mask, s.rollout_correction, s.rollout_correction_cap, s.rollout_mask_threshold
        )
        return weights

    def _chunk_loss(
        self,
        totals: dict[str, float],
        prompts: PromptWeights,
        idx: torch.Tensor,
        logp: torch.Tensor,
        old: torch.Tensor,
        adv: torch.Tensor,
        mask: torch.Tensor,
        rc: torch.Tensor | None,
        ref: torch.Tensor | None,
        mb_tokens: float,
    ) -> torch.Tensor:
        """The loss of the rows ``idx`` (their (B, T) ``logp``, ``old``, float ``mask``, the rollout correction's
        ``rc`` and the reference's ``ref`` log-probabilities, None when off), normalised by ``mb_tokens``; adds
        its loss, KL and clipped tokens to ``totals``."""
        s = self.settings
        weights = prompts.loss_weights(idx, rc, logp)  # times each row's prompt weight (none under tokens)
        loss, stats = policy_loss(
            logp, old, adv[idx], mask, s.clip_low, s.clip_high, token_count=mb_tokens, weights=weights
        )
        if ref is not None:
            kl = masked_mean(prompts.weigh(kl_penalty(logp, ref, mask), idx), mask, mb_tokens)
            loss = loss + s.kl_coef * kl
            totals["kl"] += float(kl.detach()) * mb_tokens
        totals["loss"] += float(loss.detach()) * mb_tokens
        n_tok = float(mask.sum())
        if n_tok > 0:
            totals["clip_tokens"] += stats["clip_frac"] * n_tok
        return loss

    def _begin_update(self) -> dict[str, float]:
        """Sets the learning rate and train mode; returns the metric sums to fill."""
        for group in self.optimizer.param_groups:  # the warm-up follows the update count, so a resume agrees
            group["lr"] = scheduled_lr(self.settings, self.updates)
        self.model.train()
        return {"loss": 0.0, "kl": 0.0, "entropy": 0.0, "entropy_tokens": 0.0, "clip_tokens": 0.0, "grad_norm": 0.0}

    def _trained_rows(self, adv: torch.Tensor) -> torch.Tensor:
        """(n,) bool, the rows that go through the passes: all but those of advantage exactly 0 when nothing else
        needs their gradient (docs/method.md, "Rows that teach nothing are not computed")."""
        if not self.settings.skip_zero_advantage or self.ref_model is not None:
            return torch.ones(adv.shape, dtype=torch.bool, device=adv.device)
        return adv != 0

    def _mini_batch_steps(
        self,
        n: int,
        parts: int,
        tokens_of: Callable[[torch.Tensor], float],
        mini_batch: Callable[[torch.Tensor, float], None],
        totals: dict[str, float],
        trained: torch.Tensor,
    ) -> int:
        """``update_epochs`` epochs over the ``n`` rows in ``parts`` mini-batches (shuffled when more than one,
        seeded by the update count so a resume agrees), one optimizer step each: ``mini_batch(rows, tokens)``
        accumulates the gradients of its ``trained`` rows, ``tokens`` counting all its rows (``tokens_of``). A
        mini-batch whose rows are all skipped still steps, with a zero gradient. Returns the steps made."""
        gen = torch.Generator().manual_seed(self.updates)
        trained = trained.cpu()
        opt_steps, planned = 0, self.settings.update_epochs * parts
        for _ in range(self.settings.update_epochs):
            order = torch.randperm(n, generator=gen) if parts > 1 else torch.arange(n)
            for rows in torch.tensor_split(order, parts):
                mb_tokens = tokens_of(rows)
                if mb_tokens == 0:
                    continue
                self.optimizer.zero_grad(set_to_none=True)
                kept, loss_before = rows[trained[rows]], totals["loss"]
                if kept.numel():
                    mini_batch(kept, mb_tokens)
                else:
                    for p in self.model.parameters():
                        if p.requires_grad:
                            p.grad = torch.zeros_like(p)
                self._optimizer_step(totals, totals["loss"] - loss_before, (opt_steps + 1, planned))
                opt_steps += 1
        return opt_steps

    def _finish_update(
        self,
        totals: dict[str, float],
        token_count: float,
        n: int,
        opt_steps: int,
        gap: tuple[float, float],
        trained: torch.Tensor,
        completion_ids: Sequence[Sequence[int]],
        is_stats: dict[str, float],
    ) -> dict[str, float]:
        s = self.settings
        lengths = [len(c) for c in completion_ids]
        self.optimizer.zero_grad(set_to_none=True)  # free the gradients' memory until the next update
        self.model.eval()
        self.updates += 1
        totals.update(self.shard.sum_floats({k: v for k, v in totals.items() if k != "grad_norm"}))
        seen = token_count * s.update_epochs  # every token is seen once per epoch
        grad_norm = totals["grad_norm"] / max(opt_steps, 1)
        kept = trained.cpu().tolist()
        return {
            "loss": totals["loss"] / seen,  # skipped rows add exactly 0 to the loss: over every token
            "clip_frac": totals["clip_tokens"] / seen,  # a skipped row clips nothing (0 * ratio): every token
            "grad_norm": grad_norm if math.isfinite(grad_norm) else float("nan"),
            # entropy and the sampler/trainer gap are of the rows that went through the passes
            "entropy": totals["entropy"] / totals["entropy_tokens"] if totals["entropy_tokens"] else float("nan"),
            "kl": totals["kl"] / seen,
            "tokens": int(token_count),
            "sequences": int(n),
            "optimizer_steps": opt_steps,
            "lr": float(self.optimizer.param_groups[0]["lr"]),
            "logprob_diff_mean": gap[0],
            "logprob_diff_max": gap[1],
            "skipped_rows": int(n - sum(kept)),  # advantage 0, left out of the forward and backward passes
            "skipped_tokens": int(sum(length for length, k in zip(lengths, kept, strict=True) if not k)),
            "diagnostic_rows": int(sum(kept)),  # the rows entropy, logprob_diff_* and is_* cover
            **is_stats,  # the rollout correction's ratio statistics (measured when off too), the prompt weighting
        }

    def _time(self, what: str, since: float) -> None:
        self.timings[what] = self.timings.get(what, 0.0) + time.perf_counter() - since

    def _optimizer_step(self, totals: dict[str, float], loss: float, step: tuple[int, int]) -> None:
        """Clip and step, unless the mini-batch's ``loss`` (summed over the processes) or the gradient norm is
        not finite: then the gradients are dropped and ``NonFiniteUpdateError`` names optimizer step ``step``
        (k, of K); the weights and the AdamW state stay as they were."""
        t0 = time.perf_counter()
        loss = self.shard.sum_floats({"loss": loss})["loss"]
        grad_norm = self.shard.clip_grad_norm_(self.model.parameters(), self.settings.max_grad_norm)
        try:
            check_optimizer_step(loss, float(grad_norm), *step, self.settings.lr)
        except NonFiniteUpdateError:
            self.optimizer.zero_grad(set_to_none=True)
            raise
        totals["grad_norm"] += float(grad_norm)
        self.optimizer.step()
        self._time("optimizer", t0)

    def _update_shared_prefix(
        self, prompt_ids, completion_ids, advantages, sampler_logprobs, prompts
    ) -> dict[str, float]:
        """``update`` with each group's prompt encoded once (``coba_tasks.engines.shared_prefix``). With one
        optimizer step, logp_old is the same forward's log-probabilities, detached (docs/method.md, section 18)."""
        s = self.settings
        n = len(prompt_ids)
        adv = torch.as_tensor(np.asarray(advantages, dtype=np.float32), device=self.device)
        token_count = float(sum(len(c) for c in completion_ids))
        if token_count == 0:
            raise ValueError("GRPO update: no completion tokens in the batch")
        parts = max(1, min(s.mini_batches, n))
        one_step = parts == 1 and s.update_epochs == 1
        self._sampler_needed(sampler_logprobs)
        sampler_rows = (
            [torch.tensor(list(map(float, lp)), dtype=torch.float64) for lp in sampler_logprobs]
            if s.corrects_rollouts
            else None
        )
        self.timings = {}
        trained = self._trained_rows(adv)
        kept_rows = torch.nonzero(trained).flatten().tolist()
        old_rows: list[torch.Tensor | None] = [None] * n  # the trainer's log p before the update, per row
        ref_rows: list[torch.Tensor | None] = [None] * n
        if not one_step:
            self.model.eval()  # dropout off; logp_old from the model before the update (of trained rows)
            self._grouped_logprobs(self.model, prompt_ids, completion_ids, old_rows, kept_rows)
        if self.ref_model is not None:
            self._grouped_logprobs(self.ref_model, prompt_ids, completion_ids, ref_rows, kept_rows)

        totals = self._begin_update()

        def mini_batch(rows: torch.Tensor, mb_tokens: float) -> None:
            def on_chunk(idx, logp, mask, all_logp):
                if one_step:
                    for i, r in enumerate(idx.tolist()):
                        old_rows[r] = logp[i][mask[i]].detach()
                    old = logp.detach()
                else:
                    old = padded_rows([old_rows[r] for r in idx.tolist()], logp)
                rc = None
                if sampler_rows is not None:  # the rollout correction's weights, from logp_old and the sampler's
                    theirs = padded_rows([sampler_rows[r] for r in idx.tolist()], logp)
                    rc = self._correction_weights(old, theirs, mask)
                ref = None if self.ref_model is None else padded_rows([ref_rows[r] for r in idx.tolist()], logp)
                loss = self._chunk_loss(totals, prompts, idx, logp, old, adv, mask.to(logp.dtype), rc, ref, mb_tokens)
                with torch.no_grad():  # H = -sum p log p, from the log-softmax this chunk computed anyway
                    lp = all_logp.detach()
                    totals["entropy"] += _exact_sum(-(lp.exp() * lp).sum(-1))  # per token, then summed exactly
                    totals["entropy_tokens"] += float(lp.shape[0])
                return loss

            self._shared_pass(self.model, group_by_prompt(prompt_ids, rows.tolist()), completion_ids, on_chunk, True)

        opt_steps = self._mini_batch_steps(n, parts, prompts.tokens, mini_batch, totals, trained)
        kept_old = [old_rows[r] for r in kept_rows]
        kept_sampler = None if sampler_logprobs is None else [sampler_logprobs[r] for r in kept_rows]
        gap = sampler_gap_rows(kept_old, kept_sampler, [completion_ids[r] for r in kept_rows])
        is_stats = self._ratio_stats(kept_old, kept_sampler) | prompts.figures(advantages)
        return self._finish_update(totals, token_count, n, opt_steps, gap, trained, completion_ids, is_stats)

    def _grouped_logprobs(
        self,
        model,
        prompt_ids: Sequence[Sequence[int]],
        completion_ids: Sequence[Sequence[int]],
        out: list,
        rows: Sequence[int] | None = None,
    ) -> None:
        """Each row's (or each of ``rows``') completion-token log-probabilities under ``model``, without
        gradients, into ``out``."""

        def keep(idx, logp, mask, _all_logp):
            for i, r in enumerate(idx.tolist()):
                out[r] = logp[i][mask[i]].detach()

        with torch.no_grad():
            self._shared_pass(model, group_by_prompt(prompt_ids, rows), completion_ids, keep, False)

    def _shared_pass(self, model, groups, completion_ids, on_chunk, grad: bool) -> None:
        """``shared_prefix_pass`` in this trainer's micro-batches, compute dtype and temperature."""
        s = self.settings
        kw = {"chunk": s.micro_batch_size, "autocast_dtype": self.compute_dtype, "temperature": s.temperature}
        shared_prefix_pass(model, groups, completion_ids, on_chunk, grad=grad, timings=self.timings, **kw)

    def _update_full_sequences(
        self, prompt_ids, completion_ids, advantages, sampler_logprobs, prompts
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
        self._sampler_needed(sampler_logprobs)
        trained = self._trained_rows(adv)
        kept = torch.nonzero(trained).flatten()
        with torch.no_grad():
            self.model.eval()  # dropout off; logp_old from the model before the update (of trained rows)
            t0 = time.perf_counter()
            logp_old = self._all_logprobs(self.model, ids, attn, kept)
            self._time("forward", t0)
            ref_logp = self._all_logprobs(self.ref_model, ids, attn, kept) if self.ref_model is not None else None
        kept_list = kept.tolist()
        kept_sampler = None if sampler_logprobs is None else [sampler_logprobs[r] for r in kept_list]
        gap = sampler_gap(logp_old[kept], mask[kept], kept_sampler, [completion_ids[r] for r in kept_list])
        kept_old = [row[m] for row, m in zip(logp_old[kept], mask[kept].bool(), strict=True)]
        is_stats = self._ratio_stats(kept_old, kept_sampler) | prompts.figures(advantages)
        rc_weights = None  # (B, T-1), fixed for the whole update: logp_old is the behaviour policy's
        if s.corrects_rollouts:
            rc_weights = self._correction_weights(logp_old, sampler_padded(sampler_logprobs, mask, logp_old), mask)

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
                rc = None if rc_weights is None else rc_weights[idx]
                ref = None if ref_logp is None else ref_logp[idx]
                loss = self._chunk_loss(totals, prompts, idx, logp, logp_old[idx], adv, mask[idx], rc, ref, mb_tokens)
                t0 = time.perf_counter()
                loss.backward()
                self._time("backward", t0)
                totals["entropy"] += _exact_sum(ent.detach()[mask[idx] > 0])
                totals["entropy_tokens"] += float(mask[idx].sum())

        opt_steps = self._mini_batch_steps(n, parts, prompts.tokens, mini_batch, totals, trained)
        return self._finish_update(totals, token_count, n, opt_steps, gap, trained, completion_ids, is_stats)

    # -- checkpoints ----------------------------------------------------------------------------
    def save_checkpoint(self, out_dir: str | Path, extra_state: dict[str, Any] | None = None) -> Path:
        """Weights (LoRA: the adapter), tokenizer, optimizer and trainer state (``checkpoint.write_checkpoint``)."""
        adapter = (self.peft_model, self.model_path, self.base_sha256) if self.peft_model is not None else None
        state = (*optimizer_to_tensors(self.optimizer), self.updates, extra_state)  # tensors, groups, updates, extra
        return write_checkpoint(out_dir, self.model, self.tokenizer, self.compute_dtype, *state, adapter=adapter)

    def engine_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The policy as the rollout engine takes it (``RolloutBackend.set_weights``): every tensor of the model
        once under its checkpoint name, in the compute dtype (LoRA: the adapters merged into the base), made one
        at a time; a float32 policy's own tensors, not copies."""
        from coba_tasks.engines.lora import merged_tensors

        return merged_tensors(self.model, self.compute_dtype)

    def load_checkpoint(self, ckpt_dir: str | Path) -> dict[str, Any]:
        """Restore weights, optimizer state and RNG from ``save_checkpoint`` output; returns the extra state.
        All or nothing (``coba_tasks.engines.checkpoint``: ``CheckpointError`` names the file and the tensors)."""
        ckpt = Path(ckpt_dir)
        if self.peft_model is not None:
            load_adapter_weights(self.peft_model, ckpt, (self.model_path, self.base_sha256))
        else:
            load_weights(self.model, ckpt)
        state = load_optimizer_state(self.optimizer, ckpt)
        self.updates = int(state["updates"])
        return state


def _exact_sum(values: torch.Tensor) -> float:
    """The exact sum of a 1-D tensor's values (``math.fsum``): a diagnostic summed over a chunk's tokens does
    not depend on the order or the grouping of the tokens, nor on how torch splits a reduction over threads
    (a resumed run's update table equals the uninterrupted run's bit for bit)."""
    return math.fsum(values.double().tolist())


# -- the rollout engine asleep while the update runs (``rollout.sleep_during_update``): on one GPU the engine's
# weights and KV cache and the training model share the memory, and the engine is idle during the update

MIB = 2**20


def cuda_memory() -> dict[str, float] | None:
    """Device memory now, in MiB: ``used`` (all processes, the vLLM engine's included: what ``nvidia-smi``
    shows), ``total``, and torch's ``allocated`` and ``reserved`` in this process (the trainer), plus
    ``peak_allocated`` since the last reset; None without CUDA. Reading them costs microseconds."""
    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return {
        "used": (total - free) / MIB,
        "total": total / MIB,
        "allocated": torch.cuda.memory_allocated() / MIB,
        "reserved": torch.cuda.memory_reserved() / MIB,
        "peak_allocated": torch.cuda.max_memory_allocated() / MIB,
    }


def _release_cached_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


@contextmanager
def engine_asleep(
    engine: Any,
    enabled: bool,
    memory: Callable[[], dict[str, float] | None] = cuda_memory,
    release: Callable[[], None] = _release_cached_memory,
    reset_peak: Callable[[], None] = _reset_peak,
) -> Iterator[dict[str, Any]]:
    """Put ``engine`` to sleep for the body when ``enabled``; wake it on the way out, also after an error (torch's
    cache of freed blocks given back first, or the engine could not take its memory back). Yields the record
    (empty when not enabled): ``sleep_s``, ``wake_s`` and the memory figures ``before_sleep``, ``asleep``,
    ``after_update`` (its ``peak_allocated`` is the update's peak) and ``awake``; the probes are replaceable."""
    record: dict[str, Any] = {}
    if not enabled:
        yield record
        return
    record["before_sleep"] = memory()
    t0 = time.perf_counter()
    engine.sleep()
    record["sleep_s"] = time.perf_counter() - t0
    reset_peak()
    record["asleep"] = memory()
    try:
        yield record
    finally:
        record["after_update"] = memory()
        release()
        t0 = time.perf_counter()
        engine.wake_up()
        record["wake_s"] = time.perf_counter() - t0
        record["awake"] = memory()
