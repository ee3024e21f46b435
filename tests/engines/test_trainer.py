"""The GRPO update stage: padding, parameter change, micro-batch invariance, exact resume."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from coba_tasks.engines.trainer import PolicyTrainer, UpdateSettings, pad_sequences

PROMPTS = [[10, 11, 12], [13, 14], [15, 16, 17, 18], [10, 12]]
COMPLETIONS = [[20, 21, 2], [22, 2], [23], [24, 25, 26, 2]]
ADV = np.array([1.0, -1.0, 0.5, -0.5], dtype=np.float32)


def params(trainer: PolicyTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def grads_at_optimizer_step(trainer: PolicyTrainer) -> list[torch.Tensor]:
    """The gradients the optimizer steps with (the update frees them afterwards), filled in as it runs."""
    captured: list[torch.Tensor] = []
    step = trainer.optimizer.step

    def capture(*args, **kwargs):
        captured.extend(p.grad.clone() for p in trainer.model.parameters())
        return step(*args, **kwargs)

    trainer.optimizer.step = capture
    return captured


def test_pad_sequences_marks_completion_tokens():
    ids, attn, comp = pad_sequences([[1, 2], [3]], [[4, 5], [6, 7, 8]], pad_id=0)
    assert ids.tolist() == [[1, 2, 4, 5], [3, 6, 7, 8]]
    assert attn.tolist() == [[1, 1, 1, 1], [1, 1, 1, 1]]
    assert comp.tolist() == [[0, 0, 1, 1], [0, 1, 1, 1]]
    ids, attn, comp = pad_sequences([[1]], [[4]], pad_id=9)
    assert ids.tolist() == [[1, 4]] and comp.tolist() == [[0, 1]]


def test_update_changes_parameters_and_reports_metrics(random_checkpoints):
    a, _ = random_checkpoints
    trainer = PolicyTrainer(a, UpdateSettings(lr=1e-2, micro_batch_size=3))
    before = params(trainer)
    metrics = trainer.update(PROMPTS, COMPLETIONS, ADV)
    after = params(trainer)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert metrics["tokens"] == sum(len(c) for c in COMPLETIONS)
    assert metrics["sequences"] == 4 and metrics["lr"] == pytest.approx(1e-2)
    assert np.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0 and metrics["entropy"] > 0
    # first update: ratio = 1 everywhere, so the loss is minus the token-weighted mean advantage
    lengths = np.array([len(c) for c in COMPLETIONS])
    assert metrics["loss"] == pytest.approx(-(ADV * lengths).sum() / lengths.sum(), abs=1e-5)
    assert metrics["clip_frac"] == 0.0


def test_micro_batches_give_the_same_update(random_checkpoints):
    a, _ = random_checkpoints
    one = PolicyTrainer(a, UpdateSettings(lr=1e-2, micro_batch_size=64))
    many = PolicyTrainer(a, UpdateSettings(lr=1e-2, micro_batch_size=1))
    g1, g2 = grads_at_optimizer_step(one), grads_at_optimizer_step(many)
    m1 = one.update(PROMPTS, COMPLETIONS, ADV)
    m2 = many.update(PROMPTS, COMPLETIONS, ADV)
    assert m1["loss"] == pytest.approx(m2["loss"], abs=1e-6)
    assert m1["grad_norm"] == pytest.approx(m2["grad_norm"], rel=1e-4)
    # the accumulated gradients agree (Adam's first step is ~lr * sign(g): compare gradients, not weights)
    assert all(p.grad is None for p in one.model.parameters())  # freed after the update
    assert all(torch.allclose(x, y, rtol=1e-4, atol=1e-7) for x, y in zip(g1, g2, strict=True))


def test_checkpoint_resume_continues_exactly(random_checkpoints, tmp_path):
    a, _ = random_checkpoints
    s = UpdateSettings(lr=1e-2, micro_batch_size=2)
    straight = PolicyTrainer(a, s)
    straight.update(PROMPTS, COMPLETIONS, ADV)
    ckpt = straight.save_checkpoint(tmp_path / "ckpt", extra_state={"step": 0, "capability": {"x": 1}})
    straight.update(PROMPTS, COMPLETIONS, -ADV)

    resumed = PolicyTrainer(a, s)
    extra = resumed.load_checkpoint(ckpt)
    assert extra["step"] == 0 and extra["capability"] == {"x": 1} and resumed.updates == 1
    resumed.update(PROMPTS, COMPLETIONS, -ADV)
    p1, p2 = params(straight), params(resumed)
    assert all(torch.equal(p1[k], p2[k]) for k in p1)

    # the checkpoint is HF layout + safetensors + JSON: nothing pickled
    names = {p.name for p in ckpt.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "trainer"} <= names
    assert list(ckpt.glob("*.safetensors")) == [ckpt / "model.safetensors"]  # vLLM reloads every one here
    assert not [n for n in names if n.endswith((".bin", ".pt", ".pkl"))]
    assert any(k.startswith("state.") for k in load_file(str(ckpt / "trainer" / "optimizer.safetensors")))
    json.loads((ckpt / "trainer" / "trainer_state.json").read_text())


def test_kl_term_is_zero_at_the_reference(random_checkpoints):
    a, _ = random_checkpoints
    trainer = PolicyTrainer(a, UpdateSettings(lr=1e-2, kl_coef=0.1))
    metrics = trainer.update(PROMPTS, COMPLETIONS, ADV)
    assert metrics["kl"] == pytest.approx(0.0, abs=1e-7)  # the policy starts equal to the reference
    assert trainer.update(PROMPTS, COMPLETIONS, ADV)["kl"] > 0


def test_empty_batch_is_refused(random_checkpoints):
    a, _ = random_checkpoints
    trainer = PolicyTrainer(a, UpdateSettings())
    with pytest.raises(ValueError, match="empty batch"):
        trainer.update([], [], np.array([]))


def test_update_moves_probability_towards_positive_advantages(random_checkpoints):
    a, _ = random_checkpoints
    trainer = PolicyTrainer(a, UpdateSettings(lr=3e-3, micro_batch_size=4))
    prompts = [[10, 11, 12]] * 4
    completions = [[20, 21, 2], [22, 23, 2], [24, 25, 2], [26, 27, 2]]
    adv = np.array([1.0, 1.0, -1.0, -1.0], dtype=np.float32)

    def seq_logp() -> np.ndarray:
        ids, attn, comp = pad_sequences(prompts, completions, trainer.pad_id)
        with torch.no_grad():
            logp, _ = trainer._logprobs(trainer.model, ids, attn)
        return (logp * comp[:, 1:]).sum(dim=1).numpy()

    before = seq_logp()
    for _ in range(5):
        trainer.update(prompts, completions, adv)
    delta = seq_logp() - before
    assert delta[0] > 0 and delta[1] > 0 and delta[2] < 0 and delta[3] < 0


def _tied_checkpoint(out):
    from transformers import LlamaConfig, LlamaForCausalLM

    from coba_tasks.engines.model import build_char_tokenizer, save_hf

    tok = build_char_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    return save_hf(LlamaForCausalLM(config), tok, out)


@pytest.mark.parametrize("tied", [False, True])
def test_bfloat16_trains_with_float32_master_weights_and_resumes_exactly(random_checkpoints, tmp_path, tied):
    a = _tied_checkpoint(tmp_path / "tied") if tied else random_checkpoints[0]
    s = UpdateSettings(lr=1e-6, micro_batch_size=2, dtype="bfloat16")
    straight = PolicyTrainer(a, s)
    assert {p.dtype for p in straight.model.parameters()} == {torch.float32}
    before = params(straight)
    straight.update(PROMPTS, COMPLETIONS, ADV)
    after = params(straight)
    # at lr 1e-6 pure bfloat16 weights would barely move (steps below half an ulp); float32 ones all do
    moved = sum(int((before[k] != after[k]).sum()) for k in before) / sum(v.numel() for v in before.values())
    assert moved > 0.9
    ckpt = straight.save_checkpoint(tmp_path / "ckpt", extra_state={"step": 0})
    straight.update(PROMPTS, COMPLETIONS, -ADV)

    from safetensors.torch import load_file as load_torch

    engine_weights = load_torch(str(ckpt / "model.safetensors"))  # what the rollout engine reloads
    assert {t.dtype for t in engine_weights.values()} == {torch.bfloat16}
    assert ("lm_head.weight" in engine_weights) != tied  # a tied head is not written twice
    assert list(ckpt.glob("*.safetensors")) == [ckpt / "model.safetensors"]
    resumed = PolicyTrainer(a, s)
    resumed.load_checkpoint(ckpt)  # the float32 master weights, not the bfloat16 copy
    assert all(torch.equal(v, after[k]) for k, v in params(resumed).items())
    resumed.update(PROMPTS, COMPLETIONS, -ADV)
    p1, p2 = params(straight), params(resumed)
    assert all(torch.equal(p1[k], p2[k]) for k in p1)
    if tied:
        assert resumed.model.lm_head.weight is resumed.model.model.embed_tokens.weight


def test_warmup_lr_is_linear_then_constant():
    from coba_tasks.engines.trainer import warmup_lr

    assert [warmup_lr(1e-3, 4, k) for k in range(6)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])
    assert warmup_lr(1e-3, 0, 0) == 1e-3 and warmup_lr(1e-3, 1, 0) == 1e-3


def test_update_follows_the_warmup_and_resumes_on_it(random_checkpoints, tmp_path):
    """Each update steps at the warm-up's rate for its update count; a reloaded trainer continues the schedule."""
    a, _ = random_checkpoints
    settings = UpdateSettings(lr=1e-2, lr_warmup_steps=3, micro_batch_size=4)
    trainer = PolicyTrainer(a, settings)
    rates = [trainer.update(PROMPTS, COMPLETIONS, ADV)["lr"] for _ in range(2)]
    assert rates == pytest.approx([1e-2 / 3, 2e-2 / 3])
    trainer.save_checkpoint(tmp_path / "ckpt")
    resumed = PolicyTrainer(a, settings)
    resumed.load_checkpoint(tmp_path / "ckpt")
    rates = [resumed.update(PROMPTS, COMPLETIONS, ADV)["lr"] for _ in range(2)]
    assert rates == pytest.approx([1e-2, 1e-2])
    # a smaller first step than without warm-up: the weights move less
    plain = PolicyTrainer(a, UpdateSettings(lr=1e-2, micro_batch_size=4))
    warm = PolicyTrainer(a, settings)
    start = params(plain)
    plain.update(PROMPTS, COMPLETIONS, ADV)
    warm.update(PROMPTS, COMPLETIONS, ADV)
    moved = {
        name: sum(float((p[k] - start[k]).abs().max()) for k in start)
        for name, p in (("plain", params(plain)), ("warm", params(warm)))
    }
    assert 0 < moved["warm"] < moved["plain"]
