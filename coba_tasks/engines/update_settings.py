"""What the GRPO update is told (``UpdateSettings``, built from the run config's model and optim sections),
its learning-rate schedule and its optimizer; ``coba_tasks.engines.update`` runs the update with them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from coba_tasks.core.grpo import PromptWeighting, RolloutCorrection


@dataclass(frozen=True)
class UpdateSettings:
    """What the update needs from the run's config: its ``optim`` keys, the model's dtype, LoRA and loading keys,
    and the rollouts' temperature. No key has a default here: the config's are the only ones
    (``coba_tasks.pipeline.run.update_settings`` builds this from a config, with changes for a test or a
    benchmark), so what a benchmark or a test measures is what a run with the same keys computes."""

    lr: float
    lr_warmup_steps: int  # linear warm-up over this many updates (training steps); 0 = none
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
    # the rollouts' sampling temperature: every log-probability (logp, logp_old, the reference's, the entropy)
    # is of log_softmax(logits / temperature), the distribution the tokens were sampled from
    temperature: float
    # leave rows whose advantage is exactly 0 out of the forward and backward passes when nothing else needs
    # their gradient (no KL term): their loss and gradient are exactly 0; their tokens stay in the token mean
    skip_zero_advantage: bool
    # LoRA (coba_tasks.engines.lora): rank 0 = full fine-tuning; else adapters of this rank on the target modules
    lora_rank: int
    lora_alpha: float
    lora_target_modules: str | tuple[str, ...]
    # rollout correction (truncated importance sampling, coba_tasks.core.grpo.rollout_correction_weights):
    # none | token | sequence; the cap C of the weight; tau > 1 drops ratios outside [1/tau, tau], 0 = none
    rollout_correction: str
    rollout_correction_cap: float
    rollout_mask_threshold: float
    # how the loss weighs the step's prompts (coba_tasks.core.grpo.prompt_loss_weights): tokens = the token mean
    # (a prompt weighs its completion tokens), equal = each prompt's group weighs the same
    prompt_weighting: str
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
        """Whether the loss is weighted by the rollout correction."""
        return self.rollout_correction != RolloutCorrection.NONE


def warmup_lr(lr: float, warmup_steps: int, update: int) -> float:
    """The learning rate of update ``update`` (from 0): linear warm-up ``lr * (update + 1) / warmup_steps``
    for the first ``warmup_steps`` updates, then ``lr`` (veRL's constant schedule with warm-up).

    AdamW's first steps move every weight by about the learning rate whatever its gradient's noise; a
    warm-up keeps those steps small while the moment estimates settle."""
    if warmup_steps <= 0:
        return lr
    return lr * min(1.0, (update + 1) / warmup_steps)


def make_optimizer(model: torch.nn.Module, settings: UpdateSettings) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (two groups: ndim >= 2 decayed, the rest not)."""
    trained = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters only
    decay = [p for p in trained if p.ndim >= 2]
    rest = [p for p in trained if p.ndim < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": settings.weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=settings.lr,
        betas=settings.betas,
        eps=settings.eps,
    )
