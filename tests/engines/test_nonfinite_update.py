"""A non-finite update is never stepped, and a checkpoint never holds a non-finite tensor.

A NaN or inf loss or gradient norm (a diverging learning rate, advantages that overflowed) would turn
every weight into NaN at the optimizer step, or step with a gradient clipped to nothing; the update stops
before the optimizer steps instead, with the cause in one line, and the weights and AdamW state stay as
they were. ``write_checkpoint`` refuses a non-finite tensor whoever calls it (the last guard).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from coba_tasks.engines.checkpoint import CheckpointError, optimizer_to_tensors, write_checkpoint
from coba_tasks.engines.fsdp_update import fsdp_update
from coba_tasks.engines.update import NonFiniteUpdateError, PolicyTrainer
from coba_tasks.pipeline.policy import update_settings

PROMPTS = [[10, 11, 12], [13, 14], [15, 16, 17, 18], [10, 12]]
COMPLETIONS = [[20, 21, 2], [22, 2], [23], [24, 25, 26, 2]]
ADV = np.array([1.0, -1.0, 0.5, -0.5], dtype=np.float32)


def snapshot(trainer: PolicyTrainer) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The trainer's weights and its AdamW state tensors, copied."""
    weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    tensors, _ = optimizer_to_tensors(trainer.optimizer)
    return weights, {k: v.clone() for k, v in tensors.items()}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k].isnan(), b[k].isnan()) and torch.equal(a[k].nan_to_num(), b[k].nan_to_num()), k


def trained_once(path, shared_prefix: bool) -> PolicyTrainer:
    """A trainer after one good update: AdamW holds moments that a bad step would spoil."""
    trainer = PolicyTrainer(path, update_settings(lr=1e-2, micro_batch_size=2, shared_prefix=shared_prefix))
    trainer.update(PROMPTS, COMPLETIONS, ADV)
    return trainer


@pytest.mark.parametrize("shared_prefix", [True, False])
def test_a_nan_loss_steps_nothing(random_checkpoints, shared_prefix):
    """A weight gone NaN (a diverged run) gives a NaN loss: refused before the optimizer step."""
    trainer = trained_once(random_checkpoints[0], shared_prefix)
    with torch.no_grad():
        trainer.model.lm_head.weight[5, 0] = float("nan")
    weights, moments = snapshot(trainer)
    with pytest.raises(
        NonFiniteUpdateError, match=r"^the GRPO update's loss is nan at optimizer step 1 of 1: .*optim\.lr"
    ):
        trainer.update(PROMPTS, COMPLETIONS, ADV)
    after_weights, after_moments = snapshot(trainer)
    assert_same(after_weights, weights)
    assert_same(after_moments, moments)
    assert trainer.updates == 1


@pytest.mark.parametrize("shared_prefix", [True, False])
def test_an_infinite_gradient_norm_steps_nothing(random_checkpoints, shared_prefix):
    """Advantages of 1e36 give a finite loss and a gradient norm that overflows float32: refused, not
    stepped with a gradient clipped to zero."""
    trainer = trained_once(random_checkpoints[0], shared_prefix)
    weights, moments = snapshot(trainer)
    with pytest.raises(NonFiniteUpdateError, match=r"gradient norm is (inf|nan) at optimizer step 1 of 1"):
        trainer.update(PROMPTS, COMPLETIONS, ADV * 1e36)
    after_weights, after_moments = snapshot(trainer)
    assert_same(after_weights, weights)
    assert_same(after_moments, moments)


def test_a_non_finite_advantage_is_refused_before_any_pass(random_checkpoints):
    trainer = trained_once(random_checkpoints[0], True)
    weights, moments = snapshot(trainer)
    with pytest.raises(NonFiniteUpdateError, match=r"advantage of rollout 2 is nan"):
        trainer.update(PROMPTS, COMPLETIONS, np.array([1.0, -1.0, np.nan, 0.0]))
    assert_same(snapshot(trainer)[0], weights)
    assert_same(snapshot(trainer)[1], moments)


def test_a_checkpoint_with_a_non_finite_tensor_is_refused(random_checkpoints, tmp_path):
    """The writer refuses NaN or inf in the weights or the AdamW state; nothing is written, and a checkpoint
    already at that place stays as it was."""
    trainer = trained_once(random_checkpoints[0], True)
    good = trainer.save_checkpoint(tmp_path / "ckpt")
    files = {p.name: p.read_bytes() for p in good.rglob("*") if p.is_file()}
    with torch.no_grad():
        trainer.model.lm_head.weight[3, 1] = float("inf")
    with pytest.raises(CheckpointError, match=r"lm_head\.weight holds 1 non-finite value"):
        trainer.save_checkpoint(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match=r"lm_head\.weight"):
        trainer.save_checkpoint(tmp_path / "other")
    assert {p.name: p.read_bytes() for p in good.rglob("*") if p.is_file()} == files
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary left either

    with torch.no_grad():
        trainer.model.lm_head.weight[3, 1] = 0.0
    tensors, groups = optimizer_to_tensors(trainer.optimizer)
    name = next(k for k in tensors if k.endswith("exp_avg"))
    tensors[name] = torch.full_like(tensors[name], float("nan"))
    with pytest.raises(CheckpointError, match=rf"{name} holds \d+ non-finite value"):
        write_checkpoint(tmp_path / "other", trainer.model, trainer.tokenizer, torch.float32, tensors, groups, 1)
    assert not (tmp_path / "other").exists()


@pytest.mark.slow
def test_an_fsdp_update_with_an_infinite_gradient_norm_stops_in_one_line(random_checkpoints, tmp_path):
    """The FSDP ranks share the check (the gradient norm is the global one): the caller gets the cause in
    one line, and no checkpoint is written."""
    a, _ = random_checkpoints
    with pytest.raises(NonFiniteUpdateError) as info:
        fsdp_update(a, tmp_path / "out", PROMPTS, COMPLETIONS, ADV * 1e36, update_settings(lr=1e-2), 2, timeout_s=300)
    message = str(info.value)
    assert "\n" not in message and "gradient norm is" in message and "optimizer step 1 of 1" in message
    assert not (tmp_path / "out").exists()
