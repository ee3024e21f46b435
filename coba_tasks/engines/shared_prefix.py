"""The GRPO update's forward and backward with each group's prompt encoded once (shared prefix;
docs/method.md, section 19).

Per group: the prompt runs through the decoder once (up to ``chunk`` groups' prompts together, padded),
keeping its key/value cache and its last hidden state; the completions run in chunks on top of those
caches, attending to the prompt exactly as in ``prompt + completion``; the output projection and the
log-softmax run only where a completion token is predicted. The cache and last hidden state enter each
chunk as leaf tensors whose gradients sum over the chunks; one backward through the prompt's forward then
carries them into the weights, so memory is bounded by one chunk plus the prompt.

Works for Hugging Face decoder-only models whose logits are ``lm_head(final hidden state)`` and whose
decoder takes ``past_key_values`` (``supports_shared_prefix`` says why not otherwise).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

# What a chunk hands its caller: the rows (indices into the caller's batch), their completion tokens'
# log-probabilities (n, C) and mask (n, C), and the whole log-softmax at those tokens (T, V), T = mask.sum().
ChunkFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor | None]


@dataclass(frozen=True)
class Group:
    """One prompt and the rows (indices into the caller's batch) of its completions."""

    prompt: tuple[int, ...]
    rows: tuple[int, ...]


def group_by_prompt(prompt_ids: Sequence[Sequence[int]], rows: Sequence[int] | None = None) -> list[Group]:
    """The rows of a batch grouped by identical prompt token ids, in order of first appearance.

    >>> [(g.prompt, g.rows) for g in group_by_prompt([[1, 2], [3], [1, 2], [3], [1, 2]])]
    [((1, 2), (0, 2, 4)), ((3,), (1, 3))]
    """
    order = list(range(len(prompt_ids))) if rows is None else [int(r) for r in rows]
    groups: dict[tuple[int, ...], list[int]] = {}
    for r in order:
        groups.setdefault(tuple(int(t) for t in prompt_ids[r]), []).append(r)
    return [Group(prompt, tuple(rs)) for prompt, rs in groups.items()]


def supports_shared_prefix(model: torch.nn.Module) -> str | None:
    """None when the shared-prefix pass fits ``model``; else why not (the trainer then uses full sequences)."""
    config = getattr(model, "config", None)
    if getattr(model, "is_gradient_checkpointing", False):
        return "gradient checkpointing turns the key/value cache off"
    if config is None or not getattr(config, "is_decoder", True) or getattr(config, "is_encoder_decoder", False):
        return "not a decoder-only model"
    for name in ("final_logit_softcapping", "logit_scale", "output_multiplier"):
        if getattr(config, name, None) not in (None, 1, 1.0):
            return f"its logits are not the output projection of the last hidden state ({name})"
    if model.get_output_embeddings() is None or getattr(model, "base_model", model) is model:
        return "no separate decoder and output projection"
    return None


def shared_prefix_pass(
    model: torch.nn.Module,
    groups: Sequence[Group],
    completions: Sequence[Sequence[int]],
    on_chunk: ChunkFn,
    *,
    chunk: int,
    grad: bool,
    autocast_dtype: torch.dtype = torch.float32,
    timings: dict[str, float] | None = None,
    temperature: float = 1.0,
) -> None:
    """Run the groups' completions on their prompts, each prompt encoded once, in blocks of at most ``chunk``
    prompts and chunks of at most ``chunk`` completions (each row attending to its own group's prompt, its
    positions continuing from the prompt's real length).

    ``on_chunk`` gets what ``ChunkFn`` says, of log_softmax(logits / ``temperature``); with ``grad`` it
    returns the chunk's loss (or None), backpropagated into the weights (``.grad`` accumulates). ``timings``
    accumulates the seconds spent in ``forward`` and ``backward``.
    """
    for start in range(0, len(groups), chunk):
        block = groups[start : start + chunk]
        _block(model, block, completions, on_chunk, chunk, grad, autocast_dtype, timings, temperature)


def _block(model, groups, completions, on_chunk, chunk, grad, autocast_dtype, timings, temperature) -> None:
    clock = timings if timings is not None else {}

    def timed(what: str, since: float) -> None:
        clock[what] = clock.get(what, 0.0) + time.perf_counter() - since

    device = next(model.parameters()).device
    body, head = model.base_model, model.get_output_embeddings()
    mixed = autocast_dtype != torch.float32

    def autocast():
        return torch.autocast(device_type=device.type, dtype=autocast_dtype, enabled=mixed)

    # 1. the block's prompts, right-padded, in one forward: (G, P) tokens, each group's real length
    t0 = time.perf_counter()
    p_len = torch.tensor([len(g.prompt) for g in groups], device=device)  # (G,)
    width_p = int(p_len.max())
    prompt_ids = torch.zeros((len(groups), width_p), dtype=torch.long, device=device)
    prompt_mask = torch.zeros((len(groups), width_p), dtype=torch.long, device=device)
    for i, g in enumerate(groups):
        prompt_ids[i, : len(g.prompt)] = torch.tensor(g.prompt, dtype=torch.long, device=device)
        prompt_mask[i, : len(g.prompt)] = 1
    with torch.set_grad_enabled(grad), autocast():
        out = body(input_ids=prompt_ids, attention_mask=prompt_mask, use_cache=True)
    cache = out.past_key_values
    kv = [t for layer in cache.layers for t in (layer.keys, layer.values)]  # 2 per layer, (G, heads, P, d)
    last = out.last_hidden_state[torch.arange(len(groups), device=device), p_len - 1].unsqueeze(1)  # (G, 1, H)
    leaves = [t.detach().requires_grad_(grad) for t in (*kv, last)]
    n_layers = len(cache.layers)
    timed("forward", t0)

    # 2. every completion of the block, longest first (little padding per chunk)
    owner = {r: i for i, g in enumerate(groups) for r in g.rows}
    order = sorted(owner, key=lambda r: -len(completions[r]))
    for start in range(0, len(order), chunk):
        t0 = time.perf_counter()
        rows = order[start : start + chunk]
        lengths = [len(completions[r]) for r in rows]
        n, width = len(rows), max(lengths)
        if width == 0:  # empty completions predict nothing
            continue
        g_idx = torch.tensor([owner[r] for r in rows], device=device)  # (n,) each row's group in the block
        ids = torch.zeros((n, width), dtype=torch.long, device=device)
        mask = torch.zeros((n, width), dtype=torch.bool, device=device)
        for i, r in enumerate(rows):
            ids[i, : lengths[i]] = torch.tensor(completions[r], dtype=torch.long, device=device)
            mask[i, : lengths[i]] = True
        attention = torch.cat([prompt_mask[g_idx], mask.long()], dim=1)  # (n, P + C): padded prompt slots off
        positions = p_len[g_idx, None] + torch.arange(width, device=device)  # (n, C): after the real prompt
        past = type(cache)()
        for layer in range(n_layers):
            past.update(leaves[2 * layer].index_select(0, g_idx), leaves[2 * layer + 1].index_select(0, g_idx), layer)
        with torch.set_grad_enabled(grad), autocast():
            hidden = body(
                input_ids=ids, attention_mask=attention, position_ids=positions, past_key_values=past, use_cache=True
            ).last_hidden_state  # (n, C, H)
            # token k of a completion is predicted by its prompt's last position (k = 0) or by token k - 1
            before = torch.cat([leaves[-1].index_select(0, g_idx), hidden[:, :-1]], dim=1)  # (n, C, H)
            logits = head(before[mask])  # (T, V): the output projection at real tokens only
            logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # float32 (float64 stays)
            if temperature != 1.0:  # the distribution the rollouts were sampled from
                logits = logits / temperature
        all_logp = torch.log_softmax(logits, dim=-1)  # (T, V)
        token_logp = all_logp.gather(-1, ids[mask].unsqueeze(-1)).squeeze(-1)  # (T,)
        logp = torch.zeros((n, width), dtype=token_logp.dtype, device=device).masked_scatter(mask, token_logp)
        loss = on_chunk(torch.tensor(rows, device=device), logp, mask, all_logp)
        timed("forward", t0)
        if grad and loss is not None:
            t0 = time.perf_counter()
            loss.backward()
            timed("backward", t0)
    # 3. the prompts' share of the gradient: what the chunks left on the cache, through the prompt forward
    if grad:
        t0 = time.perf_counter()
        pairs = [(t, leaf.grad) for t, leaf in zip((*kv, last), leaves, strict=True) if leaf.grad is not None]
        if pairs:
            torch.autograd.backward([t for t, _ in pairs], grad_tensors=[g for _, g in pairs])
        timed("backward", t0)
