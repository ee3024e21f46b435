"""The update with each group's prompt encoded once: the same log-probabilities, loss and gradients as
full ``prompt + completion`` sequences, on the tiny model with tied embeddings (whose output projection
is its input embedding: the prompt's and the completions' gradients meet in one matrix)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from coba_tasks.engines.shared_prefix import group_by_prompt, shared_prefix_pass, supports_shared_prefix
from coba_tasks.engines.update import PolicyTrainer
from coba_tasks.pipeline.policy import update_settings


def ragged_groups(seed: int, vocab: int = 90) -> tuple[list[list[int]], list[list[int]], np.ndarray]:
    """Rows of 4 prompts (3-11 tokens) in shuffled order, completions of 1-8 tokens, advantages."""
    g = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(4, vocab, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist() for _ in range(4)
    ]
    owner = [int(torch.randint(0, 4, (1,), generator=g)) for _ in range(15)]
    completions = [
        torch.randint(4, vocab, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist() for _ in owner
    ]
    return [prompts[o] for o in owner], completions, np.random.default_rng(seed).standard_normal(len(owner))


def full_sequence_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logp = model(input_ids=ids).logits[0, :-1].log_softmax(-1)  # (T-1, V)
    return logp[torch.arange(len(prompt) - 1, ids.shape[1] - 1), ids[0, len(prompt) :]]


@pytest.mark.parametrize("chunk", [1, 2, 16])
def test_completion_logprobs_equal_full_sequences(tied_checkpoints, chunk):
    model = AutoModelForCausalLM.from_pretrained(tied_checkpoints[0], dtype=torch.float32).eval()
    assert supports_shared_prefix(model) is None
    prompts, completions, _ = ragged_groups(0)
    got: dict[int, torch.Tensor] = {}

    def keep(rows, logp, mask, all_logp):
        assert all_logp.shape == (int(mask.sum()), model.config.vocab_size)  # the log-softmax at real tokens
        torch.testing.assert_close(torch.logsumexp(all_logp, -1), torch.zeros(all_logp.shape[0]), rtol=0, atol=1e-5)
        for i, r in enumerate(rows.tolist()):
            got[r] = logp[i][mask[i]]

    groups = group_by_prompt(prompts)
    assert sorted(r for g in groups for r in g.rows) == list(range(len(prompts))) and len(groups) <= 4
    shared_prefix_pass(model, groups, completions, keep, chunk=chunk, grad=False)
    for r, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        torch.testing.assert_close(got[r], full_sequence_logprobs(model, p, c), rtol=0, atol=2e-6)


def _updated(model_path, settings, batches):
    trainer = PolicyTrainer(model_path, settings, seed=0)
    metrics = [trainer.update(*b) for b in batches]
    return trainer, metrics, {k: v.detach().clone() for k, v in trainer.model.named_parameters()}


@pytest.mark.parametrize(
    ("mini_batches", "epochs", "kl_coef"),
    [(1, 1, 0.0), (2, 2, 0.0), (1, 1, 0.1)],
    ids=["one-step", "mini-batches-and-epochs", "kl"],
)
def test_update_equals_the_full_sequence_update(tied_checkpoints, mini_batches, epochs, kl_coef):
    settings = update_settings(
        lr=1e-3, micro_batch_size=3, mini_batches=mini_batches, update_epochs=epochs, kl_coef=kl_coef, eps=1e-5
    )
    batches = []
    for seed in (0, 1):
        prompts, completions, adv = ragged_groups(seed)
        batches.append((prompts, completions, adv, [[-1.0] * len(c) for c in completions]))
    full, full_metrics, full_weights = _updated(
        tied_checkpoints[0], dataclasses.replace(settings, shared_prefix=False), batches
    )
    shared, shared_metrics, shared_weights = _updated(tied_checkpoints[0], settings, batches)
    assert full.shared_prefix_unavailable() == "optim.shared_prefix is false"
    assert shared.shared_prefix_unavailable() is None
    base = AutoModelForCausalLM.from_pretrained(tied_checkpoints[0], dtype=torch.float32).state_dict()
    for a, b in zip(full_metrics, shared_metrics, strict=True):
        assert a.keys() == b.keys()
        for key in ("loss", "grad_norm", "entropy", "kl", "clip_frac", "logprob_diff_mean", "logprob_diff_max"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
        assert (a["tokens"], a["sequences"], a["optimizer_steps"]) == (
            b["tokens"],
            b["sequences"],
            b["optimizer_steps"],
        )
        assert a["grad_norm"] > 0
    moved = max(float((full_weights[k] - base[k]).abs().max()) for k in full_weights)
    apart = max(float((full_weights[k] - shared_weights[k]).abs().max()) for k in full_weights)
    assert moved > 1e-4 and apart < 1e-3 * moved, (moved, apart)
    if epochs > 1:
        assert shared_metrics[0]["clip_frac"] > 0  # a second pass over the rollouts: the clip acts


def test_gradient_checkpointing_falls_back_to_full_sequences(tied_checkpoints):
    trainer = PolicyTrainer(tied_checkpoints[0], update_settings(gradient_checkpointing=True), seed=0)
    assert trainer.shared_prefix_unavailable() == "gradient checkpointing turns the key/value cache off"
    prompts, completions, adv = ragged_groups(2)
    metrics = trainer.update(prompts, completions, adv)
    assert metrics["grad_norm"] > 0 and set(trainer.timings) == {"forward", "backward", "optimizer"}


def test_gradients_are_bit_identical_when_repeated_on_two_threads():
    """The same pass repeated gives the same gradients, bit for bit, with 2 threads (a resumed run must
    equal an uninterrupted one). Each row's prompt cache is gathered with ``index_select``: the backward
    of advanced indexing (``cache[rows]``) accumulates the rows of a group with parallel atomic adds on
    the CPU, whose order, and so the last bits of the sums, changed from one call to the next (seen on
    SmolLM2's shape: grouped-query attention, tied embeddings, prompts of unequal lengths)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        tie_word_embeddings=True,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=2,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=256,
    )
    model = LlamaForCausalLM(config).float()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(4, 64, (n,), generator=g).tolist() for n in (51, 55, 51, 48)]
    rows = [prompts[i] for i in (0, 0, 1, 1, 1, 1, 1, 1, 2, 2, 3, 3, 3, 3, 3, 3)]
    completions = [
        torch.randint(4, 64, (int(torch.randint(2, 13, (1,), generator=g)),), generator=g).tolist() for _ in rows
    ]
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        grads = []
        for _ in range(24):
            model.zero_grad(set_to_none=True)
            shared_prefix_pass(
                model, group_by_prompt(rows), completions, lambda r, logp, m, a: logp.sum(), chunk=8, grad=True
            )
            grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    finally:
        torch.set_num_threads(before)
    differing = [sorted(n for n in grads[0] if not torch.equal(grads[0][n], other[n])) for other in grads[1:]]
    assert not any(differing), differing
