"""The GRPO update stage: padding, parameter change, micro-batch invariance, exact resume."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from coba_tasks.engines.update import PolicyTrainer, UpdateSettings, pad_sequences
from coba_tasks.pipeline.policy import update_settings

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
        captured.extend(p.grad.clone() for p in trainer.model.parameters() if p.requires_grad)
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
    trainer = PolicyTrainer(a, update_settings(lr=1e-2, micro_batch_size=3))
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
    one = PolicyTrainer(a, update_settings(lr=1e-2, micro_batch_size=64))
    many = PolicyTrainer(a, update_settings(lr=1e-2, micro_batch_size=1))
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
    s = update_settings(lr=1e-2, micro_batch_size=2)
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
    trainer = PolicyTrainer(a, update_settings(lr=1e-2, kl_coef=0.1))
    metrics = trainer.update(PROMPTS, COMPLETIONS, ADV)
    assert metrics["kl"] == pytest.approx(0.0, abs=1e-7)  # the policy starts equal to the reference
    assert trainer.update(PROMPTS, COMPLETIONS, ADV)["kl"] > 0


def test_empty_batch_is_refused(random_checkpoints):
    a, _ = random_checkpoints
    trainer = PolicyTrainer(a, update_settings())
    with pytest.raises(ValueError, match="empty batch"):
        trainer.update([], [], np.array([]))


def test_update_moves_probability_towards_positive_advantages(random_checkpoints):
    a, _ = random_checkpoints
    trainer = PolicyTrainer(a, update_settings(lr=3e-3, micro_batch_size=4))
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
    s = update_settings(lr=1e-6, micro_batch_size=2, dtype="bfloat16")
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
    from coba_tasks.engines.update import warmup_lr

    assert [warmup_lr(1e-3, 4, k) for k in range(6)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])
    assert warmup_lr(1e-3, 0, 0) == 1e-3 and warmup_lr(1e-3, 1, 0) == 1e-3


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_a_decaying_schedule_is_the_warmup_then_transformers_schedule_of_that_name(schedule):
    """After the warm-up the rate of update k is what transformers' scheduler of that name gives at its step k
    (stepped as a trainer steps it, once per update), down to 0 at run.steps; the warm-up is the constant
    schedule's, so a run's first updates do not change with the schedule."""
    from transformers import get_scheduler

    from coba_tasks.engines.update import scheduled_lr

    settings = update_settings(lr=1e-3, lr_warmup_steps=3, lr_schedule=schedule, lr_schedule_steps=10)
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-3)
    theirs = get_scheduler(schedule, optimizer, num_warmup_steps=3, num_training_steps=10)
    rates = []
    for _ in range(10):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        theirs.step()
    ours = [scheduled_lr(settings, k) for k in range(10)]
    assert ours[:3] == pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3]) and ours[3:] == pytest.approx(rates[3:])
    assert ours[3] > ours[6] > ours[9] > 0 == pytest.approx(scheduled_lr(settings, 10))
    constant = update_settings(lr=1e-3, lr_warmup_steps=3, lr_schedule_steps=10)
    assert [scheduled_lr(constant, k) for k in range(12)] == pytest.approx([*ours[:3], *[1e-3] * 9])
    assert update_settings().lr_schedule == "constant"  # the default: every run made before the key is unchanged


def test_update_follows_the_warmup_and_resumes_on_it(random_checkpoints, tmp_path):
    """Each update steps at the warm-up's rate for its update count; a reloaded trainer continues the schedule."""
    a, _ = random_checkpoints
    settings = update_settings(lr=1e-2, lr_warmup_steps=3, micro_batch_size=4)
    trainer = PolicyTrainer(a, settings)
    rates = [trainer.update(PROMPTS, COMPLETIONS, ADV)["lr"] for _ in range(2)]
    assert rates == pytest.approx([1e-2 / 3, 2e-2 / 3])
    trainer.save_checkpoint(tmp_path / "ckpt")
    resumed = PolicyTrainer(a, settings)
    resumed.load_checkpoint(tmp_path / "ckpt")
    rates = [resumed.update(PROMPTS, COMPLETIONS, ADV)["lr"] for _ in range(2)]
    assert rates == pytest.approx([1e-2, 1e-2])
    # a smaller first step than without warm-up: the weights move less
    plain = PolicyTrainer(a, update_settings(lr=1e-2, micro_batch_size=4))
    warm = PolicyTrainer(a, settings)
    start = params(plain)
    plain.update(PROMPTS, COMPLETIONS, ADV)
    warm.update(PROMPTS, COMPLETIONS, ADV)
    moved = {
        name: sum(float((p[k] - start[k]).abs().max()) for k in start)
        for name, p in (("plain", params(plain)), ("warm", params(warm)))
    }
    assert 0 < moved["warm"] < moved["plain"]


@pytest.mark.parametrize("tied", [False, True])
def test_a_checkpoint_loads_all_or_nothing(random_checkpoints, tmp_path, tied):
    """Half of the weights gone: CheckpointError naming the file and the tensors, and the trainer untouched."""
    from safetensors.torch import load_file as load_torch
    from safetensors.torch import save_file

    from coba_tasks.engines.checkpoint import CheckpointError

    a = _tied_checkpoint(tmp_path / "tied") if tied else random_checkpoints[0]
    s = update_settings(lr=1e-2, micro_batch_size=2)
    trainer = PolicyTrainer(a, s)
    trainer.update(PROMPTS, COMPLETIONS, ADV)
    ckpt = trainer.save_checkpoint(tmp_path / "ckpt")
    PolicyTrainer(a, s).load_checkpoint(ckpt)  # whole (tied: the head is stored once and still counts)

    weights = load_torch(str(ckpt / "model.safetensors"))
    names = sorted(weights)
    save_file({k: weights[k] for k in names[: len(names) // 2]}, str(ckpt / "model.safetensors"))
    fresh = PolicyTrainer(a, s)
    before = params(fresh)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: does not hold the policy's weights: \d+ \("):
        fresh.load_checkpoint(ckpt)
    assert all(torch.equal(v, before[k]) for k, v in params(fresh).items())  # nothing of it was loaded

    save_file(weights, str(ckpt / "model.safetensors"))  # weights whole again, AdamW state half gone
    state = load_torch(str(ckpt / "trainer" / "optimizer.safetensors"))
    kept = {k: v for k, v in state.items() if not k.startswith("state.1.")}
    save_file(kept, str(ckpt / "trainer" / "optimizer.safetensors"))
    with pytest.raises(CheckpointError, match=r"optimizer\.safetensors: not this policy's AdamW state"):
        PolicyTrainer(a, s).load_checkpoint(ckpt)


def test_checkpoint_manifest_names_the_damaged_file(random_checkpoints, tmp_path):
    from coba_tasks.engines.checkpoint import CHECKPOINT_MANIFEST, CheckpointError, verify_checkpoint

    trainer = PolicyTrainer(random_checkpoints[0], update_settings(lr=1e-2, micro_batch_size=2))
    ckpt = trainer.save_checkpoint(tmp_path / "ckpt")
    listed = json.loads((ckpt / CHECKPOINT_MANIFEST).read_text())["files"]
    assert {"model.safetensors", "trainer/optimizer.safetensors", "trainer/trainer_state.json"} <= set(listed)
    assert all(len(e["sha256"]) == 64 and e["bytes"] > 0 for e in listed.values())
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # written beside, renamed: no temporary left
    verify_checkpoint(ckpt)

    optimizer = ckpt / "trainer" / "optimizer.safetensors"
    data = bytearray(optimizer.read_bytes())
    data[-3] ^= 0xFF  # one byte of a moment flipped, same size
    optimizer.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"trainer/optimizer\.safetensors: sha256 differs"):
        verify_checkpoint(ckpt)
    optimizer.write_bytes(bytes(data[:100]))
    with pytest.raises(CheckpointError, match=r"optimizer\.safetensors: 100 bytes, checkpoint\.json says"):
        verify_checkpoint(ckpt)
    optimizer.unlink()
    with pytest.raises(CheckpointError, match=r"listed in checkpoint\.json but missing"):
        verify_checkpoint(ckpt)
    (ckpt / CHECKPOINT_MANIFEST).unlink()
    with pytest.raises(CheckpointError, match=r"checkpoint\.json is missing: the checkpoint was not written whole"):
        verify_checkpoint(ckpt)

    # saving again over a partial checkpoint (an update that did not finish) replaces it whole
    again = trainer.save_checkpoint(ckpt)
    verify_checkpoint(again)


# ragged groups (sizes 3, 2, 4, 2), two of them all-equal (advantage 0 everywhere), one completion with a 0
# advantage inside a mixed group (its reward equals its group's mean)
RAGGED_PROMPTS = [[10, 11, 12]] * 3 + [[13, 14]] * 2 + [[15, 16, 17, 18]] * 4 + [[10, 12]] * 2
RAGGED_COMPLETIONS = [
    [20, 21, 2],
    [22, 2],
    [23],
    [24, 25],
    [26, 2],
    [27, 28, 29, 2],
    [30],
    [31, 2],
    [32, 33],
    [34],
    [35, 36],
]
RAGGED_ADV = np.array([1.2, -0.6, -0.6, 0, 0, 1.0, 0.0, -1.0, 0.0, 0, 0], dtype=np.float32)


@pytest.mark.parametrize("shared_prefix", [True, False])
def test_a_kl_term_keeps_every_row_in_the_passes(random_checkpoints, shared_prefix):
    """With a KL term a row whose advantage is 0 still has a gradient (its KL to the reference): nothing is
    skipped. Without one, exactly the rows whose advantage is 0 are."""
    a, _ = random_checkpoints
    zero_rows = int((RAGGED_ADV == 0).sum())
    for kl_coef, skipped in ((0.1, 0), (0.0, zero_rows)):
        s = update_settings(lr=1e-3, micro_batch_size=4, kl_coef=kl_coef, shared_prefix=shared_prefix)
        metrics = PolicyTrainer(a, s).update(RAGGED_PROMPTS, RAGGED_COMPLETIONS, RAGGED_ADV)
        assert metrics["skipped_rows"] == skipped, kl_coef
        assert metrics["diagnostic_rows"] == len(RAGGED_ADV) - skipped, kl_coef
    assert zero_rows > 0


@pytest.mark.parametrize("shared_prefix", [True, False])
@pytest.mark.parametrize(("mini_batches", "epochs"), [(1, 1), (3, 2)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_skipping_zero_advantage_rows_changes_no_gradient(
    random_checkpoints, shared_prefix, mini_batches, epochs, dtype
):
    """Rows with advantage 0 left out of the passes: the gradient of every optimizer step within 1e-6 relative
    of the update that runs them, the same loss and clip fraction (their tokens stay in the token mean), the
    same weights after; groups whose rows are all skipped are not encoded at all.

    In float64 every step is compared (two updates, so AdamW's moments carry over). In float32 only the first
    step is: the rows go through the passes in other batches, so the sums round differently (about 1e-7), and
    AdamW's later steps, normalised by each weight's gradient size, magnify that into other weights."""
    a, _ = random_checkpoints
    runs = {}
    for skip in (False, True):
        s = update_settings(
            lr=1e-2,
            micro_batch_size=2,
            mini_batches=mini_batches,
            update_epochs=epochs,
            weight_decay=0.1,
            shared_prefix=shared_prefix,
            skip_zero_advantage=skip,
        )
        trainer = PolicyTrainer(a, s)
        trainer.model.to(dtype)  # the optimizer holds the same parameters, now in dtype
        rows_seen: list[int] = []
        trainer.model.model.register_forward_pre_hook(
            lambda _m, args, kwargs, seen=rows_seen: seen.append(int(kwargs["input_ids"].shape[0])), with_kwargs=True
        )
        grads = grads_at_optimizer_step(trainer)
        m1 = trainer.update(RAGGED_PROMPTS, RAGGED_COMPLETIONS, RAGGED_ADV)
        m2 = trainer.update(RAGGED_PROMPTS, RAGGED_COMPLETIONS, -RAGGED_ADV)  # moments from the first update
        runs[skip] = (grads, m1, m2, params(trainer), sum(rows_seen))
    (g_full, f1, f2, w_full, rows_full), (g_skip, k1, k2, w_skip, rows_skip) = runs[False], runs[True]
    n_params = len(w_full)
    steps = 2 * mini_batches * epochs
    assert len(g_full) == len(g_skip) == steps * n_params
    for step in range(steps if dtype == torch.float64 else 1):  # the whole gradient of each optimizer step
        full = torch.cat([g.flatten() for g in g_full[step * n_params : (step + 1) * n_params]]).double()
        skip = torch.cat([g.flatten() for g in g_skip[step * n_params : (step + 1) * n_params]]).double()
        assert float((full - skip).norm()) <= 1e-6 * float(full.norm()), step
    tol = {"rel": 1e-6, "abs": 1e-9} if dtype == torch.float64 else {"rel": 1e-4, "abs": 1e-6}
    for full, skip in ((f1, k1), (f2, k2)):
        assert skip["loss"] == pytest.approx(full["loss"], **tol)
        assert skip["clip_frac"] == pytest.approx(full["clip_frac"], abs=1e-9 if dtype == torch.float64 else 0.05)
        assert skip["tokens"] == full["tokens"] and skip["optimizer_steps"] == full["optimizer_steps"]
        assert full["skipped_rows"] == 0 and skip["skipped_rows"] == 6 and skip["diagnostic_rows"] == 5
        zero = [len(c) for c, v in zip(RAGGED_COMPLETIONS, RAGGED_ADV, strict=True) if v == 0]
        assert skip["skipped_tokens"] == sum(zero)
    if dtype == torch.float64:
        assert all(torch.allclose(w_full[k], w_skip[k], rtol=1e-9, atol=1e-12) for k in w_full)
    assert rows_skip < rows_full  # the skipped rows were not run (nor the prompts of the all-equal groups)
    if shared_prefix and (mini_batches, epochs) == (1, 1):
        # one pass each update: the 2 prompts of groups with a trained row, then their 5 trained completions
        # (chunks of 2: 2 + 2 + 1 rows); without skipping 4 prompts and 11 completions
        assert (rows_full, rows_skip) == (2 * (4 + 11), 2 * (2 + 5))


LORA = {"lora_rank": 4, "lora_alpha": 8.0}


@pytest.mark.parametrize("tied", [False, True])
def test_lora_trains_the_adapter_only_and_resumes_exactly(random_checkpoints, tmp_path, tied):
    from safetensors.torch import load_file as load_torch

    from coba_tasks.engines.lora import ADAPTER_CONFIG, ADAPTER_FILE, base_model_of

    a = _tied_checkpoint(tmp_path / "tied") if tied else random_checkpoints[0]
    s = update_settings(lr=1e-2, micro_batch_size=2, **LORA)
    straight = PolicyTrainer(a, s)
    base = {k: v.clone() for k, v in straight.model.state_dict().items() if ".lora_" not in k}
    trainable = [n for n, p in straight.model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)
    assert {id(p) for g in straight.optimizer.param_groups for p in g["params"]} == {
        id(p) for p in straight.model.parameters() if p.requires_grad
    }
    straight.update(PROMPTS, COMPLETIONS, ADV)
    after = straight.model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in base.items())  # the base weights are frozen
    assert any(float(after[n].abs().sum()) > 0 for n in trainable if ".lora_B." in n)  # B moved off 0
    ckpt = straight.save_checkpoint(tmp_path / "ckpt", extra_state={"step": 0})
    straight.update(PROMPTS, COMPLETIONS, -ADV)

    names = {p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file()}
    assert {ADAPTER_FILE, ADAPTER_CONFIG, "trainer/optimizer.safetensors", "checkpoint.json"} <= names
    assert not [n for n in names if n.endswith("model.safetensors") and n != ADAPTER_FILE]  # no whole model
    assert base_model_of(ckpt) == a.resolve()
    moments = load_torch(str(ckpt / "trainer/optimizer.safetensors"))
    assert sum(v.numel() for k, v in moments.items() if k.endswith("exp_avg")) == sum(
        p.numel() for p in straight.model.parameters() if p.requires_grad
    )  # the adapter's AdamW state only

    resumed = PolicyTrainer(a, s)
    resumed.load_checkpoint(ckpt)
    resumed.update(PROMPTS, COMPLETIONS, -ADV)
    p1, p2 = params(straight), params(resumed)
    assert all(torch.equal(p1[k], p2[k]) for k in p1)


def test_lora_merged_weights_give_the_trainers_log_probabilities(random_checkpoints, tmp_path):
    """What the rollout engine takes: a plain model's tensors, W + (alpha / r) B A, equal to the trainer's LoRA
    forward within float32 rounding; a tied tensor once, under the name a checkpoint stores it by."""
    from transformers import AutoModelForCausalLM

    a = _tied_checkpoint(tmp_path / "tied")
    trainer = PolicyTrainer(a, update_settings(lr=5e-2, micro_batch_size=2, **LORA))
    trainer.update(PROMPTS, COMPLETIONS, ADV)
    weights = dict(trainer.engine_weights())
    merged = AutoModelForCausalLM.from_pretrained(a, dtype=torch.float32).eval()
    assert set(merged.state_dict()) - set(weights) == {"lm_head.weight"} and set(weights) <= set(merged.state_dict())
    merged.load_state_dict(weights, strict=False)
    assert merged.lm_head.weight is merged.model.embed_tokens.weight
    ids = torch.tensor([PROMPTS[2] + COMPLETIONS[3]])
    trainer.model.eval()
    with torch.no_grad():
        ours = trainer.model(input_ids=ids).logits
        theirs = merged(input_ids=ids).logits
        plain = AutoModelForCausalLM.from_pretrained(a, dtype=torch.float32)(input_ids=ids).logits
    assert torch.allclose(ours, theirs, atol=1e-5) and not torch.allclose(ours, plain, atol=1e-3)


def test_a_float32_policy_goes_to_the_engine_as_its_own_tensors_and_a_bfloat16_one_as_the_checkpoints(
    random_checkpoints, tmp_path
):
    """Full fine-tuning: in float32 the engine is handed the trainer's parameters themselves (no copy of the
    model); in bfloat16 the values the checkpoint gives the engine, bit for bit."""
    from safetensors.torch import load_file as load_torch

    a, _ = random_checkpoints
    trainer = PolicyTrainer(a, update_settings(lr=5e-2, micro_batch_size=2))
    trainer.update(PROMPTS, COMPLETIONS, ADV)
    params = dict(trainer.model.named_parameters())
    handed = dict(trainer.engine_weights())
    assert handed.keys() <= params.keys() and all(handed[k].data_ptr() == params[k].data_ptr() for k in handed)
    low = PolicyTrainer(a, update_settings(lr=5e-2, micro_batch_size=2, dtype="bfloat16"))
    low.update(PROMPTS, COMPLETIONS, ADV)
    stored = load_torch(str(low.save_checkpoint(tmp_path / "ckpt") / "model.safetensors"))
    handed = dict(low.engine_weights())
    assert handed.keys() == stored.keys() and all(torch.equal(handed[k], stored[k]) for k in stored)


def test_a_partial_adapter_is_refused(random_checkpoints, tmp_path):
    from safetensors.torch import load_file as load_torch
    from safetensors.torch import save_file

    from coba_tasks.engines.checkpoint import CheckpointError
    from coba_tasks.engines.lora import ADAPTER_FILE

    a, _ = random_checkpoints
    s = update_settings(lr=1e-2, micro_batch_size=2, **LORA)
    trainer = PolicyTrainer(a, s)
    trainer.update(PROMPTS, COMPLETIONS, ADV)
    ckpt = trainer.save_checkpoint(tmp_path / "ckpt")
    tensors = load_torch(str(ckpt / ADAPTER_FILE))
    save_file(dict(list(tensors.items())[: len(tensors) // 2]), str(ckpt / ADAPTER_FILE))
    with pytest.raises(
        CheckpointError, match=r"adapter_model\.safetensors: .*not this policy's adapter \(\d+ tensors missing"
    ):
        PolicyTrainer(a, s).load_checkpoint(ckpt)
    full = PolicyTrainer(a, update_settings(lr=1e-2))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: cannot read the policy weights"):
        full.load_checkpoint(ckpt)  # an adapter checkpoint is not a full one


@pytest.mark.parametrize("gradient_checkpointing", [False, True])
def test_lora_update_paths_agree(random_checkpoints, gradient_checkpointing):
    """The shared-prefix update and the full-sequence one (also with gradient checkpointing, which needs the
    frozen embeddings' output to ask for gradients) give the same LoRA gradients."""
    a, _ = random_checkpoints
    grads = {}
    for shared in (True, False):
        s = update_settings(
            lr=1e-2, micro_batch_size=2, shared_prefix=shared, gradient_checkpointing=gradient_checkpointing, **LORA
        )
        trainer = PolicyTrainer(a, s)
        captured = grads_at_optimizer_step(trainer)
        trainer.update(PROMPTS, COMPLETIONS, ADV)
        grads[shared] = [g for g in captured if g is not None]
    assert len(grads[True]) == len(grads[False]) > 0
    assert any(float(g.abs().sum()) > 0 for g in grads[False])
    assert all(torch.allclose(x, y, rtol=1e-4, atol=1e-7) for x, y in zip(grads[True], grads[False], strict=True))


@pytest.mark.parametrize("shared_prefix", [True, False])
def test_an_update_whose_every_row_is_skipped_steps_with_a_zero_gradient(random_checkpoints, shared_prefix):
    """All rewards equal (a random model on arithmetic): nothing goes through the passes, the gap has no token
    to compare (NaN), and AdamW still makes its step, as the update that computes the rows would."""
    import math

    a, _ = random_checkpoints
    runs = {}
    for skip in (False, True):
        s = update_settings(
            lr=1e-2, micro_batch_size=2, weight_decay=0.1, shared_prefix=shared_prefix, skip_zero_advantage=skip
        )
        trainer = PolicyTrainer(a, s)
        trainer.update(PROMPTS, COMPLETIONS, ADV)  # moments, so that a zero-gradient step moves the weights
        before = params(trainer)
        zeros = np.zeros(len(PROMPTS), dtype=np.float32)
        metrics = trainer.update(PROMPTS, COMPLETIONS, zeros, [[-1.0] * len(c) for c in COMPLETIONS])
        runs[skip] = (metrics, before, params(trainer))
    (full, _, w_full), (skip, before, w_skip) = runs[False], runs[True]
    assert skip["skipped_rows"] == len(PROMPTS) and skip["diagnostic_rows"] == 0 and skip["optimizer_steps"] == 1
    assert math.isnan(skip["logprob_diff_mean"]) and math.isnan(skip["entropy"]) and skip["loss"] == 0.0
    assert full["loss"] == pytest.approx(0.0, abs=1e-12) and full["skipped_rows"] == 0
    assert any(not torch.equal(before[k], w_skip[k]) for k in before)  # momentum and weight decay moved them
    assert all(torch.allclose(w_full[k], w_skip[k], rtol=1e-5, atol=1e-7) for k in w_full)


# ---------------------------------------------------------------------------------------------
# Rollout correction (truncated importance sampling between the sampler and the trainer)
# ---------------------------------------------------------------------------------------------


def trainer_logprobs(trainer: PolicyTrainer, prompts, completions) -> list[list[float]]:
    """The trainer's own log p of each completion token, one list per row (what an exact sampler records)."""
    ids, attn, comp = pad_sequences(prompts, completions, trainer.pad_id)
    with torch.no_grad():
        logp, _ = trainer._logprobs(trainer.model, ids, attn)
    m = comp[:, 1:].bool()
    return [logp[i][m[i]].double().tolist() for i in range(len(prompts))]


def first_step(a, settings: UpdateSettings, prompts, completions, adv, sampler):
    trainer = PolicyTrainer(a, settings)
    grads = grads_at_optimizer_step(trainer)
    metrics = trainer.update(prompts, completions, adv, sampler)
    n = sum(1 for p in trainer.model.parameters() if p.requires_grad)
    return torch.cat([g.flatten() for g in grads[:n]]).double(), metrics


@pytest.mark.parametrize("shared_prefix", [True, False])
def test_rollout_correction_off_ignores_the_sampler_figures(random_checkpoints, shared_prefix):
    """Off (the default), the sampler's log-probabilities change no weight: the same parameters bit for bit
    with and without them, and the ratio statistics are measured (nothing clipped or masked)."""
    a, _ = random_checkpoints
    s = update_settings(lr=1e-2, micro_batch_size=3, shared_prefix=shared_prefix)
    assert s.rollout_correction == "none"
    probe = PolicyTrainer(a, s)
    shifted = [[x - 0.5 for x in row] for row in trainer_logprobs(probe, PROMPTS, COMPLETIONS)]
    runs = []
    for sampler in (None, shifted):
        trainer = PolicyTrainer(a, s)
        m = trainer.update(PROMPTS, COMPLETIONS, ADV, sampler)
        runs.append((params(trainer), m))
    (p0, m0), (p1, m1) = runs
    assert all(torch.equal(p0[k], p1[k]) for k in p0) and m0["loss"] == m1["loss"]
    assert math.isnan(m0["is_ratio_mean"]) and m0["is_clipped_frac"] == 0.0 and m0["is_masked_frac"] == 0.0
    assert m1["is_ratio_mean"] == pytest.approx(math.exp(0.5), rel=1e-4)
    assert m1["is_clipped_frac"] == 0.0 and m1["is_masked_frac"] == 0.0


@pytest.mark.parametrize("shared_prefix", [True, False])
def test_rollout_correction_weights_the_gradient_by_the_ratio(random_checkpoints, shared_prefix):
    """A sampler whose log p is off by a known amount: at the first step (rho = 1) the loss is linear in the
    weights, so the corrected gradient is the uncorrected one times the weight. Token level: every token
    log-ratio 0.3, weight e^0.3. Sequence level: each row's tokens sum to log 1.5, weight 1.5. The cap
    truncates (C = 1.2); a mask threshold below the ratio drops every token (zero gradient). Rows with
    advantage 0 skipped or not: the same gradient."""
    a, _ = random_checkpoints
    base = {"lr": 1e-2, "micro_batch_size": 4, "max_grad_norm": 1e9, "shared_prefix": shared_prefix}
    probe = PolicyTrainer(a, update_settings(**base))
    exact = trainer_logprobs(probe, RAGGED_PROMPTS, RAGGED_COMPLETIONS)
    per_token = [[x - 0.3 for x in row] for row in exact]
    per_row = [[x - math.log(1.5) / len(row) for x in row] for row in exact]
    batch = (RAGGED_PROMPTS, RAGGED_COMPLETIONS, RAGGED_ADV)
    plain, m_plain = first_step(a, update_settings(**base), *batch, per_token)
    assert m_plain["is_ratio_mean"] == pytest.approx(math.exp(0.3), rel=1e-4)
    cases = [
        ("token", 2.0, 0.0, per_token, math.exp(0.3)),
        ("token", 1.2, 0.0, per_token, 1.2),
        ("sequence", 2.0, 0.0, per_row, 1.5),
        ("sequence", 1.2, 0.0, per_row, 1.2),
        ("token", 2.0, 1.2, per_token, 0.0),
        ("sequence", 2.0, 1.4, per_row, 0.0),
    ]
    for level, cap, tau, sampler, factor in cases:
        for skip in (True, False):
            s = update_settings(
                **base,
                rollout_correction=level,
                rollout_correction_cap=cap,
                rollout_mask_threshold=tau,
                skip_zero_advantage=skip,
            )
            g, m = first_step(a, s, *batch, sampler)
            case = (level, cap, tau, skip)
            assert float((g - factor * plain).norm()) <= 1e-4 * float(plain.norm()), case
            assert m["loss"] == pytest.approx(factor * m_plain["loss"], rel=1e-4, abs=1e-9), case
            ratio = math.exp(0.3) if level == "token" else 1.5
            assert m["is_ratio_mean"] == pytest.approx(ratio, rel=1e-4), case
            assert m["is_ratio_max"] == pytest.approx(ratio, rel=1e-4), case
            assert m["is_clipped_frac"] == (1.0 if cap < ratio and tau == 0 else 0.0), case
            assert m["is_masked_frac"] == (1.0 if tau else 0.0), case
            assert m["tokens"] == m_plain["tokens"], case  # masked tokens stay in the token-mean normaliser


def test_rollout_correction_needs_the_sampler_figures(random_checkpoints):
    a, _ = random_checkpoints
    trainer = PolicyTrainer(a, update_settings(rollout_correction="token"))
    with pytest.raises(ValueError, match=r"optim\.rollout_correction = token needs the sampler's logprobs"):
        trainer.update(PROMPTS, COMPLETIONS, ADV)
    for bad in ({"rollout_correction": "tokens"}, {"rollout_correction_cap": 0.0}, {"rollout_mask_threshold": 0.5}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            update_settings(**bad)


def test_the_update_has_no_defaults_of_its_own_the_configs_are_the_only_ones():
    """UpdateSettings once held a second set of defaults, and model.lora_alpha was 16 there and 32 in the config:
    `coba bench update` and scripts/bench_lora.py measured a LoRA scale no run uses. Now every key but the
    thread count must be given, and update_settings() (the config's defaults) is what tests and benchmarks change."""
    import dataclasses

    from coba_tasks.pipeline.config import Config

    defaulted = [
        f.name
        for f in dataclasses.fields(UpdateSettings)
        if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
    ]
    assert defaulted == ["threads"]  # not a config key
    cfg, s = Config(), update_settings()
    assert s.lora_alpha == cfg.model.lora_alpha == 32.0 and s.lr == cfg.optim.lr and s.dtype == cfg.model.dtype
    changed = update_settings(lora_rank=4, lr=1e-3)
    assert (changed.lora_rank, changed.lr, changed.lora_alpha) == (4, 1e-3, 32.0)
    with pytest.raises(TypeError):
        UpdateSettings(lr=1e-3)  # a key left out is an error, never a default
