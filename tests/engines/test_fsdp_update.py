"""The FSDP update (coba_tasks.engines.fsdp_update): two gloo processes on the CPU give the single-process update.

The reference is ``PolicyTrainer`` in this process on the same batch from the same state. Weights are
compared relative to the update's own size: Adam's step is ~lr * g / (|g| + eps), so a gradient summed
in another order moves a weight whose g is near 0 by a little more or less than in one process.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from coba_tasks.core.grpo import group_advantages
from coba_tasks.engines.fsdp_update import FSDPUpdateError, fsdp_update, read_batch, read_group_ids, write_batch
from coba_tasks.engines.update import DataShard, PolicyTrainer
from coba_tasks.pipeline.config import HASH_NEUTRAL_DEFAULTS, apply_overrides, config_hash, load_config
from coba_tasks.pipeline.config_fields import ConfigError
from coba_tasks.pipeline.policy import update_settings

# Ragged groups (sizes 2, 3 and 4: 9 rollouts), rewards with variance in every group
GROUP_SIZES = (2, 3, 4)
REWARDS = (1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0)
# micro-batches of 2 and 2 mini-batches over 2 ranks: shares of 3 and 2 rows, so rank 1 runs idle passes;
# 2 epochs (4 optimizer steps) and a KL term (the reference model is sharded too)
SETTINGS = update_settings(lr=1e-3, micro_batch_size=2, mini_batches=2, update_epochs=2, kl_coef=0.05)
REL_TOL = 1e-3  # max |w_fsdp - w_single| <= REL_TOL * max |w_single - w_before|


def ragged_batch(seed: int) -> tuple[list[list[int]], list[list[int]], np.ndarray]:
    """A step's rollouts: one prompt per group, completions of 1 to 8 tokens ending in </s> (id 2)."""
    rng = np.random.default_rng(seed)
    prompts, completions, groups = [], [], []
    for g, size in enumerate(GROUP_SIZES):
        prompt = rng.integers(4, 100, size=int(rng.integers(2, 6))).tolist()
        for _ in range(size):
            prompts.append(prompt)
            completions.append([*rng.integers(4, 100, size=int(rng.integers(0, 8))).tolist(), 2])
            groups.append(g)
    adv = group_advantages(torch.tensor(REWARDS), torch.tensor(groups)).numpy()
    return prompts, completions, adv


def weights(trainer: PolicyTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b)
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def listing(d) -> list[str]:
    return sorted(p.relative_to(d).as_posix() for p in d.rglob("*"))


def test_shards_cover_each_row_once_with_the_same_number_of_passes():
    for n in range(1, 12):
        for world in (1, 2, 3):
            for size in (1, 2, 5):
                seen, counts = [], set()
                for rank in range(world):
                    shard = DataShard()
                    shard.rank, shard.world = rank, world
                    mine = shard.mine(torch.arange(n))
                    passes = shard.micro_batches(n, size)
                    counts.add(len(passes))
                    assert all(b.stop - b.start <= size for b in passes)
                    seen += [int(i) for b in passes for i in mine[b]]
                assert sorted(seen) == list(range(n)) and len(counts) == 1, (n, world, size)
    assert DataShard().micro_batches(5, 2) == [slice(0, 2), slice(2, 4), slice(4, 5)]  # one process: as before


def test_batch_file_round_trips(tmp_path):
    prompts, completions, adv = ragged_batch(0)
    p, c, a, lp = read_batch(write_batch(tmp_path / "b.parquet", prompts, completions, adv))
    assert p == prompts and c == completions and np.array_equal(a, adv.astype(np.float64)) and lp is None
    logprobs = [[-0.5 - k for k in range(len(x))] for x in completions]
    *_, lp = read_batch(write_batch(tmp_path / "c.parquet", prompts, completions, adv, logprobs))
    assert lp == logprobs
    # each rollout's prompt, for optim.prompt_weighting: kept when given, None when not
    assert read_group_ids(tmp_path / "b.parquet") is None
    groups = np.repeat(np.arange(len(GROUP_SIZES)), GROUP_SIZES)[::-1]
    path = write_batch(tmp_path / "d.parquet", prompts, completions, adv, group_ids=groups)
    assert np.array_equal(read_group_ids(path), groups) and read_batch(path)[0] == prompts


def test_fsdp_processes_is_checked_and_hash_neutral_at_its_default():
    cfg = load_config("configs/demo-tiny.yaml")  # full fine-tuning (the demo's LoRA refuses FSDP)
    assert cfg.optim.fsdp_processes == 1 and ("optim", "fsdp_processes") in HASH_NEUTRAL_DEFAULTS
    with pytest.raises(ConfigError, match=r"optim\.fsdp_processes = 0: must be >= 1"):
        apply_overrides(cfg, ["optim.fsdp_processes=0"])
    with pytest.raises(ConfigError, match=r"optim\.fsdp_processes: expected an integer, got 1\.5"):
        apply_overrides(cfg, ["optim.fsdp_processes=1.5"])
    assert config_hash(apply_overrides(cfg, ["optim.fsdp_processes=1"])) == config_hash(cfg)
    # the training flow runs the update over N > 1 processes (tests/test_fsdp_flow.py): another run
    two = apply_overrides(cfg, ["optim.fsdp_processes=2"])
    assert two.optim.fsdp_processes == 2 and config_hash(two) != config_hash(cfg)


@pytest.mark.slow
def test_two_fsdp_processes_give_the_single_process_update_and_checkpoint(random_checkpoints, tmp_path):
    a, _ = random_checkpoints
    first, second, third = ragged_batch(0), ragged_batch(1), ragged_batch(2)
    single = PolicyTrainer(a, SETTINGS)
    single.update(*first)  # the FSDP run resumes from here: AdamW moments to shard, update count 1
    start = single.save_checkpoint(tmp_path / "start", extra_state={"step": 0})
    before = weights(single)
    expected_metrics = single.update(*second)
    expected = weights(single)
    reference = single.save_checkpoint(tmp_path / "single", extra_state={"step": 1})

    out = tmp_path / "fsdp"
    metrics = fsdp_update(a, out, *second, SETTINGS, 2, checkpoint=start, extra_state={"step": 1}, timeout_s=300)

    # the same update: weights within REL_TOL of the update's size, the same metrics
    got = load_file(str(out / "model.safetensors"))
    step_size, diff = max_diff(expected, before), max_diff(got, expected)
    print(f"\nupdate size {step_size:.3e}, FSDP vs single-process max abs weight difference {diff:.3e}")
    assert step_size > 0 and diff <= REL_TOL * step_size
    assert set(metrics) == set(expected_metrics)
    for key in ("tokens", "sequences", "optimizer_steps", "lr"):
        assert metrics[key] == expected_metrics[key], key
    for key in ("loss", "kl", "entropy", "clip_frac"):
        assert metrics[key] == pytest.approx(expected_metrics[key], rel=1e-5, abs=1e-6), key
    assert metrics["grad_norm"] == pytest.approx(expected_metrics["grad_norm"], rel=1e-5)
    assert expected_metrics["kl"] > 0 and expected_metrics["optimizer_steps"] == 4

    # the same checkpoint layout: files, config, trainer state, AdamW state
    assert listing(out) == listing(reference)
    assert json.loads((out / "config.json").read_text()) == json.loads((reference / "config.json").read_text())
    state, ref_state = (json.loads((d / "trainer" / "trainer_state.json").read_text()) for d in (out, reference))
    assert state == ref_state and state["updates"] == 2 and state["step"] == 1
    opt, ref_opt = (load_file(str(d / "trainer" / "optimizer.safetensors")) for d in (out, reference))
    assert set(opt) == set(ref_opt)
    for k in opt:
        assert opt[k].shape == ref_opt[k].shape and opt[k].dtype == ref_opt[k].dtype, k
        if k.endswith(".step") or k == "rng.torch":
            assert torch.equal(opt[k], ref_opt[k]), k
        else:  # moments: compared relative to their own scale
            scale = float(ref_opt[k].abs().max()) or 1.0
            assert float((opt[k] - ref_opt[k]).abs().max()) <= 1e-3 * scale, k

    # transformers loads it; a single-process run resumes from it and continues as from its own checkpoint
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert all(torch.equal(v, got[k]) for k, v in hf.state_dict().items())
    resumed = PolicyTrainer(a, SETTINGS)
    assert resumed.load_checkpoint(out)["step"] == 1 and resumed.updates == 2
    assert all(torch.equal(v, got[k]) for k, v in weights(resumed).items())
    m_resumed, m_single = resumed.update(*third), single.update(*third)
    assert m_resumed["loss"] == pytest.approx(m_single["loss"], abs=1e-5)
    assert max_diff(weights(resumed), weights(single)) <= REL_TOL * step_size + diff


@pytest.mark.slow
def test_fsdp_update_from_the_base_model_weighs_each_prompt_the_same(random_checkpoints, tmp_path):
    """Step 0: no checkpoint to continue from (fresh AdamW state), no KL, optim.prompt_weighting=equal over 2
    ranks and 2 mini-batches: the group ids travel in the batch file and every rank weighs its rows with the
    whole step's weights and each mini-batch's normaliser, so the update is the single-process one (group 2's
    four rollouts are two prompts here, which its prompt tokens alone would not say: the update that groups by
    prompt tokens has another loss and gradient norm).

    AdamW's first step is lr * g / (|g| + eps): where |g| is near eps, a gradient that differs in its
    last bits (summed over ranks in another order) moves the weight measurably differently. Measured
    with eps 1e-8: gradients within 4e-7 of the largest one, weights within 1.4e-3 of the update's
    size (all of it at weights with |g| ~ 1e-8); with eps 1e-6, 4e-4. eps 1e-5 keeps that amplification
    out of the check.
    """
    a, _ = random_checkpoints
    s = update_settings(lr=1e-3, micro_batch_size=2, mini_batches=2, eps=1e-5, prompt_weighting="equal")
    batch = ragged_batch(4)
    groups = np.array([0, 0, 1, 1, 1, 2, 2, 3, 3])
    single = PolicyTrainer(a, s)
    before = weights(single)
    expected_metrics = single.update(*batch, None, groups)
    expected = weights(single)
    by_prompt = PolicyTrainer(a, s).update(*batch)  # no group ids: group 2's rollouts are one prompt's
    metrics = fsdp_update(a, tmp_path / "fsdp", *batch, s, 2, extra_state={"step": 0}, timeout_s=300, group_ids=groups)
    got = load_file(str(tmp_path / "fsdp" / "model.safetensors"))
    step_size, diff = max_diff(expected, before), max_diff(got, expected)
    assert diff <= REL_TOL * step_size
    assert metrics["loss"] == pytest.approx(expected_metrics["loss"], rel=1e-5, abs=1e-6)
    assert metrics["grad_norm"] == pytest.approx(expected_metrics["grad_norm"], rel=1e-5)
    assert metrics["prompt_weighting"] == "equal" and metrics["optimizer_steps"] == 2
    assert metrics["tokens"] == expected_metrics["tokens"]
    assert metrics["effective_prompts"] == pytest.approx(4.0, rel=1e-12) == expected_metrics["effective_prompts"]
    assert by_prompt["effective_prompts"] == pytest.approx(3.0, rel=1e-12)
    assert by_prompt["grad_norm"] != pytest.approx(expected_metrics["grad_norm"], rel=1e-3)


def test_a_failed_job_says_why(tmp_path, monkeypatch):
    import coba_tasks.engines.fsdp_update as module

    def failing_job(cmd, stdout, **kwargs):
        assert cmd[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3"]
        stdout.write("".join(f"line {i}\n" for i in range(100)) + "OSError: no-model is not a model directory\n")
        return subprocess.CompletedProcess(cmd, 1)

    monkeypatch.setattr(module.subprocess, "run", failing_job)
    with pytest.raises(FSDPUpdateError, match=r"(?s)3 processes failed \(exit status 1\).*no-model is not a model"):
        fsdp_update(tmp_path / "no-model", tmp_path / "out", [[5]], [[6, 2]], np.zeros(1), update_settings(), 3)
    with pytest.raises(ValueError, match="processes must be >= 1"):
        fsdp_update(tmp_path / "no-model", tmp_path / "out", [[5]], [[6, 2]], np.zeros(1), update_settings(), 0)


def _fake_job(ranks_done: range, rc: int):
    """A torchrun job, as subprocess.run sees it, whose ranks in ``ranks_done`` finished (their done files)
    and wrote the metrics, and which then exited with ``rc``."""
    from coba_tasks.engines.fsdp_update import DONE_FILE

    def job(cmd, stdout, **kwargs):
        tmp = Path(cmd[cmd.index("--metrics") + 1]).parent
        (tmp / "metrics.json").write_text(json.dumps({"loss": 0.25}))
        for r in ranks_done:
            (tmp / DONE_FILE.format(rank=r)).touch()
        stdout.write("terminate called without an active exception\n")
        return subprocess.CompletedProcess(cmd, rc)

    return job


def test_a_rank_that_aborts_at_exit_after_the_work_is_whole_keeps_the_update(tmp_path, monkeypatch, caplog):
    """Seen once on 2 busy cores: rank 1 aborted while its process shut down (gloo's threads), after the
    checkpoint and metrics were written and both ranks had passed the last barrier. The update is whole:
    kept, with a warning. A rank that did not finish still fails the update."""
    import coba_tasks.engines.fsdp_update as module

    args = (tmp_path / "model", tmp_path / "out", [[5]], [[6, 2]], np.zeros(1), update_settings(), 2)
    monkeypatch.setattr(module.subprocess, "run", _fake_job(range(2), -6))
    with caplog.at_level("WARNING", logger=module.__name__):
        assert fsdp_update(*args) == {"loss": 0.25}
    assert "exited with status -6 while its processes shut down" in caplog.text
    assert "terminate called without an active exception" in caplog.text
    monkeypatch.setattr(module.subprocess, "run", _fake_job(range(1), -6))  # rank 1 never finished
    with pytest.raises(FSDPUpdateError, match=r"2 processes failed \(exit status -6\)"):
        fsdp_update(*args)


@pytest.mark.slow
def test_one_fsdp_process_gives_the_single_process_update(tied_checkpoints, tmp_path):
    """One rank (the device check's FSDP check): a sharded policy runs the full-sequence update, as ranks of
    more processes do. It took the shared-prefix pass before, whose submodule calls FSDP does not gather
    ("aten.embedding.default got mixed torch.Tensor and DTensor"), and the job failed."""
    a, _ = tied_checkpoints
    s = update_settings(lr=1e-3, micro_batch_size=2, eps=1e-5)
    batch = ragged_batch(5)
    single = PolicyTrainer(a, s)
    before = weights(single)
    expected_metrics = single.update(*batch)
    expected = weights(single)
    metrics = fsdp_update(a, tmp_path / "fsdp", *batch, s, 1, extra_state={"step": 0}, timeout_s=300)
    got = load_file(str(tmp_path / "fsdp" / "model.safetensors"))
    got = {k: got.get(k, got.get("model.embed_tokens.weight")) for k in expected}  # tied: stored once
    assert max_diff(got, expected) <= REL_TOL * max_diff(expected, before)
    assert metrics["grad_norm"] == pytest.approx(expected_metrics["grad_norm"], rel=1e-5)
    assert metrics["loss"] == pytest.approx(expected_metrics["loss"], rel=1e-5, abs=1e-6)
