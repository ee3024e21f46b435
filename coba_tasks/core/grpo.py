"""GRPO math for groups of different sizes (docs/method.md): advantages, clipped loss, KL.

CoBA-RL gives each prompt its own number of rollouts B_i, so a batch holds groups of different
sizes. Everything here groups by prompt id (an int64 tensor next to the rewards), never by
reshaping to a fixed group size, so ragged, unsorted and non-contiguous groups just work.

The equations, how they deviate from PPO (no value function, clip-higher, token-mean, no KL by default)
and why: docs/method.md sections 14-18 ("Rollout correction", "Prompt weighting"). ``std_i`` is the unbiased
sample std, an all-equal group gets A = 0 exactly, and a group of size 1 is an error (B_low >= 2 rules it
out). Micro-batches: pass the *whole* batch's token count as ``token_count`` to each and their losses sum
to the full-batch loss, so their accumulated gradients equal the full-batch gradient.

Shapes: B sequences, T tokens (padded), V vocabulary. Everything is torch in, torch out: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from enum import StrEnum

import torch

from coba_tasks.core.values import effective_number

LOG_RATIO_MAX = 20.0  # |log ratio| is clamped before exp so a stray token cannot overflow
ADV_EPS = 1e-6
# |reward| <= 1e30 keeps a group's statistics finite in float64 (max ~1.8e308): its sum stays below n * 1e30
# and its squared deviations' sum below n * 4e60, finite for any group under 1e247 rollouts, i.e. any budget;
# without a bound, rewards near 1e308 overflow the sum (NaN advantages) and rewards above ~1e154 the variance
# (an inf std: every advantage silently 0). No verifier's reward comes near it (0/1, a score).
REWARD_BOUND = 1e30


class RewardScaleError(ValueError):
    """A reward beyond +/- ``REWARD_BOUND`` (or not finite): the group statistics would overflow."""


def unbounded_rewards(rewards: torch.Tensor) -> torch.Tensor:
    """Indices, ascending, of the rewards that are NaN, infinite or beyond +/- ``REWARD_BOUND``."""
    return torch.nonzero(~(rewards.to(torch.float64).abs() <= REWARD_BOUND)).flatten()


def reward_scale_message(where: str, reward: float) -> str:
    """The one line that refuses ``reward`` of ``where`` (a prompt, a group)."""
    return (
        f"{where}: reward {reward:g} is beyond +/- {REWARD_BOUND:g}, where the GRPO group mean and variance "
        "overflow; scale the reward function's rewards (e.g. to [0, 1])"
    )


# --- Advantages


def _shapes(*tensors: torch.Tensor) -> str:
    return ", ".join(str(tuple(t.shape)) for t in tensors)


def _check_groups(rewards: torch.Tensor, group_ids: torch.Tensor) -> None:
    if rewards.ndim != 1 or group_ids.ndim != 1 or rewards.shape != group_ids.shape:
        raise ValueError(
            f"rewards and group_ids must be 1-D of the same length, got {tuple(rewards.shape)} and "
            f"{tuple(group_ids.shape)}"
        )
    if group_ids.dtype.is_floating_point or group_ids.dtype == torch.bool or group_ids.is_complex():
        raise ValueError(f"group_ids must be an integer tensor (prompt index), got {group_ids.dtype}")


def _group_range(r: torch.Tensor, inv: torch.Tensor, n_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group (``inv`` from ``torch.unique``): the smallest and the largest of the float64 rewards ``r``."""
    zeros = torch.zeros(n_groups, dtype=torch.float64, device=r.device)
    lo, hi = (zeros.scatter_reduce(0, inv, r, reduce=op, include_self=False) for op in ("amin", "amax"))
    return lo, hi


def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = ADV_EPS) -> torch.Tensor:
    """GRPO advantages A_ij = (r_ij - mean_i) / (std_i + eps) of (N,) rewards grouped by (N,) int
    ``group_ids`` (any sizes, order or ids). Computed in float64, returned in the rewards' float dtype (the
    default dtype for integer rewards); std_i is the unbiased sample std (as veRL); an all-equal group gets
    exactly 0. ValueError for a group of a single rollout, RewardScaleError for a reward that is not finite
    or beyond +/- ``REWARD_BOUND``, each naming the group id.

    >>> r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    >>> g = torch.tensor([7, 7, 3, 7, 3, 9, 9])
    >>> group_advantages(r, g).round(decimals=4)
    tensor([ 0.5773, -1.1547, -0.7071,  0.5773,  0.7071,  0.0000,  0.0000])
    """
    _check_groups(rewards, group_ids)
    out_dtype = rewards.dtype if rewards.dtype.is_floating_point else torch.get_default_dtype()
    if rewards.numel() == 0:
        return torch.zeros(0, dtype=out_dtype, device=rewards.device)
    r = rewards.to(torch.float64)  # (N,)
    bad = unbounded_rewards(r)
    if bad.numel():
        first = int(bad[0])
        raise RewardScaleError(reward_scale_message(f"group id {int(group_ids[first])}", float(r[first])))
    uniq, inv, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)  # (G,), (N,), (G,)
    if bool((counts < 2).any()):
        bad = uniq[counts < 2].tolist()
        raise ValueError(f"group id(s) {bad} have a single rollout; GRPO needs at least 2 per group (B_low >= 2)")
    n_groups = uniq.numel()
    zeros = torch.zeros(n_groups, dtype=torch.float64, device=r.device)
    cnt = counts.to(torch.float64)  # (G,)
    mean = zeros.index_add(0, inv, r) / cnt  # (G,)
    dev = r - mean[inv]  # (N,) two-pass: centre first, then square (stable)
    var = zeros.index_add(0, inv, dev * dev) / (cnt - 1.0)  # (G,) unbiased
    std = var.sqrt()
    lo, hi = _group_range(r, inv, n_groups)  # (G,), (G,)
    adv = dev / (std[inv] + eps)  # (N,)
    # All-equal group: mean_i may differ from r_ij by a rounding error, so zero it explicitly.
    adv = torch.where((lo == hi)[inv], torch.zeros_like(adv), adv)
    return adv.to(out_dtype)


def zero_variance_share(rewards: torch.Tensor, group_ids: torch.Tensor) -> float:
    """Share of groups whose rewards are all equal (they carry no GRPO gradient); 0.0 for no groups.

    >>> zero_variance_share(torch.tensor([1, 1, 0, 1, 0, 0]), torch.tensor([5, 5, 2, 2, 8, 8]))
    0.6666666666666666
    """
    _check_groups(rewards, group_ids)
    if rewards.numel() == 0:
        return 0.0
    r = rewards.to(torch.float64)
    uniq, inv = torch.unique(group_ids, return_inverse=True)
    lo, hi = _group_range(r, inv, uniq.numel())
    return float((lo == hi).to(torch.float64).mean())


# --- Token-level helpers


def masked_mean(x: torch.Tensor, mask: torch.Tensor, count: float | int | torch.Tensor | None = None) -> torch.Tensor:
    """sum(x over mask) / count; ``count`` defaults to the number of unmasked entries.

    Masked entries are dropped with ``where`` (not multiplied by 0), so inf/NaN there do not leak.
    An all-masked input with the default count gives 0. An explicit ``count`` must be > 0.

    >>> masked_mean(torch.tensor([1.0, 2.0, 9.0]), torch.tensor([True, True, False]))
    tensor(1.5000)
    """
    mask = mask.bool()
    total = torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum()
    if count is None:
        return total / mask.sum().clamp(min=1).to(x.dtype)
    if float(count) <= 0:
        raise ValueError(f"count must be > 0, got {float(count)}")
    return total / count


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log p(tokens | logits): (B, T, V) logits and (B, T) token ids -> (B, T), in float32 or wider.

    No shift: ``logits[:, t]`` must already be the distribution of ``tokens[:, t]`` (for a causal
    LM, pass ``logits[:, :-1]`` with ``input_ids[:, 1:]``).

    Memory: ``log_softmax`` materialises a second (B, T, V) tensor, in float32 (bf16 logits are
    upcast, which adds a float32 copy too). With V ~ 150k that is 0.6 MB per token, so callers
    should bound B * T with micro-batches (or chunk over T) rather than call this on a full batch.
    """
    if logits.ndim != 3 or tokens.shape != logits.shape[:2]:
        raise ValueError(
            f"need logits (B, T, V) and tokens (B, T), got {tuple(logits.shape)} and {tuple(tokens.shape)}"
        )
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    logp = torch.log_softmax(logits, dim=-1)  # (B, T, V)
    return logp.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)  # (B, T)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) in nats: (B, T, V) -> (B, T). H = logsumexp(l) - sum softmax(l) * l."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    p = torch.softmax(logits, dim=-1)  # (B, T, V)
    return torch.logsumexp(logits, dim=-1) - (p * logits).sum(dim=-1)


# --- Losses


class KLKind(StrEnum):
    """Per-token estimators of KL(pi || ref) from tokens sampled from pi (Schulman, "Approximating KL")."""

    K1 = "k1"  # log pi - log ref: unbiased, high variance, can be negative
    K2 = "k2"  # 0.5 (log pi - log ref)^2: biased, non-negative
    K3 = "k3"  # ref/pi - 1 - log(ref/pi): unbiased, non-negative, low variance ("low_var_kl")


# Each estimator takes x = log(ref / pi) = ref_logp - logp, clamped to +/- LOG_RATIO_MAX.
_KL_ESTIMATORS: dict[KLKind, Callable[[torch.Tensor], torch.Tensor]] = {
    KLKind.K1: lambda x: -x,
    KLKind.K2: lambda x: 0.5 * x.square(),
    KLKind.K3: lambda x: torch.expm1(x) - x,  # exp(x) - 1 - x, accurate near x = 0
}


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || ref), (B, T) -> (B, T), zero where ``mask`` is 0.

    ``logp`` are the current policy's log-probs of the sampled tokens (gradients flow through it),
    ``ref_logp`` the reference model's (treated as constant). Aggregate with ``masked_mean`` and
    the same ``token_count`` as the policy loss. ``kind``: one of ``KLKind`` ("k1", "k2", "k3").
    """
    try:
        fn = _KL_ESTIMATORS[KLKind(kind)]
    except ValueError:
        raise ValueError(f"unknown KL estimator {kind!r}; choose one of {[k.value for k in KLKind]}") from None
    if logp.shape != ref_logp.shape or logp.shape != mask.shape:
        raise ValueError(f"logp, ref_logp and mask must have one shape, got {_shapes(logp, ref_logp, mask)}")
    log_ratio = (ref_logp.detach() - logp).clamp(-LOG_RATIO_MAX, LOG_RATIO_MAX)  # (B, T) log(ref / pi)
    kl = fn(log_ratio)
    return torch.where(mask.bool(), kl, torch.zeros((), dtype=kl.dtype, device=kl.device))


class RolloutCorrection(StrEnum):
    """The level of the truncated importance-sampling correction between the sampler and the trainer."""

    NONE = "none"  # no weight (the default)
    TOKEN = "token"  # per-token ratio pi_old(token) / pi_sampler(token)
    SEQUENCE = "sequence"  # the product of a completion's token ratios, one weight per sequence


def rollout_correction_weights(
    logp_old: torch.Tensor,
    logp_sampler: torch.Tensor,
    mask: torch.Tensor,
    level: str = "token",
    cap: float = 2.0,
    mask_threshold: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Truncated importance-sampling weights of the sampled tokens, (B, T) -> (weights, ratio, dropped).

    ``logp_old`` is the trainer's (``policy_loss``'s), ``logp_sampler`` the rollout engine's, both constant.
    ``level`` ``"sequence"`` gives every token its row's ratio (exp of the summed log-ratio); ``"none"`` is
    refused. ``weights`` = min(ratio, ``cap``), 0 where dropped and off the mask; ``mask_threshold`` tau (0:
    none, else > 1) drops a token (or row) whose ratio is outside [1/tau, tau]. ``ratio`` is before truncation,
    1 off the mask. All without gradients; the log-ratio is clamped to +/- LOG_RATIO_MAX before ``exp``.
    """
    kind = RolloutCorrection(level)
    if kind is RolloutCorrection.NONE:
        raise ValueError("rollout_correction_weights needs level token or sequence, got none")
    if logp_old.shape != logp_sampler.shape or logp_old.shape != mask.shape or logp_old.ndim != 2:
        raise ValueError(
            f"logp_old, logp_sampler and mask must all be (B, T), got {_shapes(logp_old, logp_sampler, mask)}"
        )
    if not cap > 0:
        raise ValueError(f"the rollout correction's cap must be > 0, got {cap}")
    if not (mask_threshold == 0 or mask_threshold > 1):
        raise ValueError(f"the rollout correction's mask threshold must be 0 (none) or > 1, got {mask_threshold}")
    with torch.no_grad():
        m = mask.bool()
        zero = torch.zeros((), dtype=logp_old.dtype, device=logp_old.device)
        log_ratio = torch.where(m, logp_old.detach() - logp_sampler.detach().to(logp_old.dtype), zero)  # (B, T)
        if kind is RolloutCorrection.SEQUENCE:
            log_ratio = torch.where(m, log_ratio.sum(dim=-1, keepdim=True), zero)  # (B, T) the row's sum
        ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_MAX, LOG_RATIO_MAX))  # (B, T), 1 off the mask
        dropped = torch.zeros_like(m)
        if mask_threshold > 0:
            dropped = m & ((ratio > mask_threshold) | (ratio < 1.0 / mask_threshold))
        weights = torch.where(m & ~dropped, ratio.clamp(max=cap), zero)
    return weights, ratio, dropped


def rollout_correction_stats(
    ratio: torch.Tensor, dropped: torch.Tensor, mask: torch.Tensor, cap: float | None
) -> dict[str, float]:
    """The update's ratio statistics over the completion tokens (``rollout_correction_weights``' outputs).

    ``is_ratio_mean`` and ``is_ratio_max`` of the ratio before truncation (at sequence level each token
    carries its row's ratio, so a long row weighs more), ``is_clipped_frac`` the share of tokens kept
    with a ratio above ``cap`` (their weight is C), ``is_masked_frac`` the share dropped. ``cap`` None
    (no correction applied): clipped and masked shares 0. NaN ratios and 0 shares without tokens.
    Sums are exact (``math.fsum``), so the figures do not depend on how the rows were batched.
    """
    m = mask.bool()
    n = int(m.sum())
    if n == 0:
        nan = float("nan")
        return {"is_ratio_mean": nan, "is_ratio_max": nan, "is_clipped_frac": 0.0, "is_masked_frac": 0.0}
    r = ratio.detach()[m].double().cpu()
    d = dropped.bool()[m].cpu()
    clipped = 0 if cap is None else int(((r > cap) & ~d).sum())
    return {
        "is_ratio_mean": math.fsum(r.tolist()) / n,
        "is_ratio_max": float(r.max()),
        "is_clipped_frac": clipped / n,
        "is_masked_frac": 0.0 if cap is None else int(d.sum()) / n,
    }


class PromptWeighting(StrEnum):
    """How the loss weighs a step's prompts (``optim.prompt_weighting``; ``prompt_loss_weights``)."""

    TOKENS = "tokens"  # every completion token the same (the token mean): a prompt weighs its token count
    EQUAL = "equal"  # every prompt's group the same: extra rollouts lower its gradient's variance, not raise its weight


def prompt_loss_weights(group_ids: torch.Tensor, lengths: torch.Tensor, weighting: str = "tokens") -> torch.Tensor:
    """Each row's token weight c_r in the loss ``sum_r c_r sum_t L_rt / sum_r c_r T_r``, (n,) float64, no gradient.

    ``lengths`` are the rows' completion tokens T_r. ``"tokens"``: c_r = 1, the token mean. ``"equal"``:
    c_r = N / (M * T_i), N = sum_r T_r, T_i the tokens of row r's group and M the number of groups with at
    least one token (a group without any gets 0); docs/method.md, "Prompt weighting". With every T_i equal,
    c_r = 1 exactly: both weightings give the same loss bit for bit.

    >>> prompt_loss_weights(torch.tensor([0, 0, 1, 1]), torch.tensor([3, 5, 1, 3]), "equal")
    tensor([0.7500, 0.7500, 1.5000, 1.5000], dtype=torch.float64)
    """
    kind = PromptWeighting(weighting)
    if group_ids.ndim != 1 or lengths.shape != group_ids.shape:
        raise ValueError(
            f"group_ids and lengths must be 1-D of the same length, got {tuple(group_ids.shape)} and "
            f"{tuple(lengths.shape)}"
        )
    t = lengths.detach().to(torch.float64)  # (n,)
    if bool((t < 0).any()):
        raise ValueError("lengths must be >= 0")
    if kind is PromptWeighting.TOKENS or t.numel() == 0:
        return torch.ones_like(t)
    uniq, inv = torch.unique(group_ids, return_inverse=True)  # (G,), (n,)
    per_group = torch.zeros(uniq.numel(), dtype=torch.float64, device=t.device).index_add(0, inv, t)  # (G,) T_i
    m = float((per_group > 0).sum())
    t_i = per_group[inv]  # (n,) T_i of each row's group
    safe = torch.where(t_i > 0, t_i, torch.ones_like(t_i))
    return torch.where(t_i > 0, float(t.sum()) / (m * safe), torch.zeros_like(t_i))


def effective_prompts(
    group_ids: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor, advantages: torch.Tensor
) -> float:
    """N_eff = (sum_i W_i)^2 / sum_i W_i^2, the effective number of prompts of a loss, over the prompts that
    carry a gradient (at least one rollout with a non-zero advantage).

    W_i = sum_{r in i} c_r T_r is prompt i's total weight in the loss (``weights`` = c_r, ``prompt_loss_weights``;
    ``lengths`` = T_r). 0.0 when no prompt carries a gradient.

    >>> effective_prompts(torch.tensor([0, 0, 1, 1, 2, 2]), torch.tensor([6, 6, 1, 1, 4, 4]),
    ...                   torch.ones(6), torch.tensor([1.0, -1.0, 0.5, -0.5, 0.0, 0.0]))
    1.3243243243243243
    """
    if not (group_ids.shape == lengths.shape == weights.shape == advantages.shape) or group_ids.ndim != 1:
        raise ValueError(
            "group_ids, lengths, weights and advantages must be 1-D of one length, got "
            f"{[tuple(x.shape) for x in (group_ids, lengths, weights, advantages)]}"
        )
    uniq, inv = torch.unique(group_ids, return_inverse=True)
    zeros = torch.zeros(uniq.numel(), dtype=torch.float64, device=group_ids.device)
    w = zeros.index_add(0, inv, weights.detach().to(torch.float64) * lengths.detach().to(torch.float64))  # (G,)
    moves = zeros.index_add(0, inv, (advantages.detach() != 0).to(torch.float64)) > 0  # (G,) carries a gradient
    return effective_number(w[moves].cpu().numpy())


def policy_loss(
    logp_new: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    token_count: float | int | torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped-surrogate GRPO loss with clip-higher and token-mean aggregation: (loss, stats).

    Gradients flow through ``logp_new`` only; ``logp_old`` is the trainer's (not the sampler's), before this
    update; ``advantages`` (B,) one per sequence. ``token_count``: the normaliser, None for this call's
    unmasked tokens; with gradient accumulation the *whole* batch's, all micro-batches and ranks.
    ``weights`` (B, T): the rollout correction's, multiplying L_t; a weight-0 token still counts in
    ``token_count``. ``loss`` is 0 with no unmasked token. ``stats``, over this call's unmasked tokens (NaN
    if none): ``clip_frac`` (share where the clipped branch is strictly larger: zero gradient),
    ``approx_kl`` (k3 of KL(pi_old || pi_new)), ``approx_kl_k1``, ``ratio_mean``, ``ratio_max``, and
    ``n_tokens`` to weight micro-batches.
    """
    if logp_new.ndim != 2 or logp_new.shape != logp_old.shape or logp_new.shape != mask.shape:
        raise ValueError(f"logp_new, logp_old and mask must all be (B, T), got {_shapes(logp_new, logp_old, mask)}")
    if advantages.shape != logp_new.shape[:1]:
        raise ValueError(f"advantages must be (B,) = ({logp_new.shape[0]},), got {tuple(advantages.shape)}")
    if not (0.0 <= clip_low < 1.0 and clip_high >= 0.0):
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got clip_low={clip_low}, clip_high={clip_high}")

    mask = mask.bool()
    log_ratio = (logp_new - logp_old.detach()).clamp(-LOG_RATIO_MAX, LOG_RATIO_MAX)  # (B, T)
    ratio = torch.exp(log_ratio)  # (B, T)
    adv = advantages.detach().to(ratio.dtype).unsqueeze(-1)  # (B, 1), broadcast over tokens
    surr = -adv * ratio  # (B, T)
    surr_clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)  # (B, T)
    per_token = torch.maximum(surr, surr_clipped)  # (B, T) pessimistic bound
    if weights is not None:
        if weights.shape != per_token.shape:
            raise ValueError(f"weights must be (B, T) = {tuple(per_token.shape)}, got {tuple(weights.shape)}")
        per_token = per_token * weights.detach().to(per_token.dtype)  # truncated importance sampling
    loss = masked_mean(per_token, mask, token_count)

    with torch.no_grad():
        n = int(mask.sum())
        if n == 0:
            stats = dict.fromkeys(("clip_frac", "approx_kl", "approx_kl_k1", "ratio_mean", "ratio_max"), float("nan"))
        else:
            lr, r = log_ratio.detach(), ratio.detach()
            stats = {
                "clip_frac": float(masked_mean((surr_clipped > surr).to(r.dtype), mask)),
                "approx_kl": float(masked_mean(torch.expm1(lr) - lr, mask)),
                "approx_kl_k1": float(masked_mean(-lr, mask)),
                "ratio_mean": float(masked_mean(r, mask)),
                "ratio_max": float(r[mask].max()),
            }
        stats["n_tokens"] = float(n)
    return loss, stats
