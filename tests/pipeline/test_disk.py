"""The disk check before a run: one checkpoint's bytes from the parameter count (against checkpoints really
written), how many are on disk at once, and the one-line refusal when they cannot fit."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from coba_tasks.pipeline import disk
from coba_tasks.pipeline.config import Config, apply_overrides

PROMPTS = [[10, 11, 12], [13, 14], [15, 16, 17, 18], [10, 12]]
COMPLETIONS = [[20, 21, 2], [22, 2], [23], [24, 25, 26, 2]]
ADV = np.array([1.0, -1.0, 0.5, -0.5], dtype=np.float32)


def _cfg(model: Path, *overrides: str) -> Config:
    return apply_overrides(Config(), [f"model.path={model}", *overrides])


@pytest.mark.parametrize(
    "overrides",
    [(), ("model.dtype=bfloat16",), ("model.lora_rank=4", "model.lora_alpha=8")],
    ids=["full-float32", "full-bf16", "lora"],
)
def test_the_estimate_of_a_checkpoint_is_within_two_percent_of_one_written(random_checkpoints, tmp_path, overrides):
    from coba_tasks.engines.update import PolicyTrainer
    from coba_tasks.pipeline.policy import update_settings

    a, _ = random_checkpoints
    cfg = _cfg(a, *overrides)
    trainer = PolicyTrainer(a, update_settings(cfg, micro_batch_size=2))
    trainer.update(PROMPTS, COMPLETIONS, ADV)
    ckpt = trainer.save_checkpoint(tmp_path / "ckpt")
    written = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())
    estimate = disk.checkpoint_bytes(cfg)
    assert abs(estimate - written) <= 0.02 * written + disk.FIXED_BYTES, (estimate, written)


def test_checkpoints_on_disk_at_once(random_checkpoints):
    a, _ = random_checkpoints
    assert disk.checkpoints_at_once(_cfg(a, "run.steps=10"), first=0, existing=0) == 10  # keep all
    assert disk.checkpoints_at_once(_cfg(a, "run.steps=10", "run.keep_checkpoints=2"), 0, 0) == 3  # + the new one
    assert disk.checkpoints_at_once(_cfg(a, "run.steps=10", "run.keep_checkpoints=2"), 9, 2) == 3
    assert disk.checkpoints_at_once(_cfg(a, "run.steps=10"), first=4, existing=4) == 10


def test_a_run_that_cannot_fit_is_refused_in_one_line_with_the_numbers_and_the_keys(random_checkpoints, monkeypatch):
    a, _ = random_checkpoints
    cfg = _cfg(a, "run.steps=200")
    one = disk.checkpoint_bytes(cfg)
    monkeypatch.setattr(disk, "_free_bytes", lambda root: 50 * one)
    with pytest.raises(disk.DiskSpaceError) as err:
        disk.check_disk(cfg, Path("runs/big"))
    message = str(err.value)
    assert "\n" not in message and message.startswith("runs/big: the run's checkpoints need ")
    assert "(200 more of " in message and "run.keep_checkpoints keeps all" in message
    assert "set run.keep_checkpoints=49 or fewer, a larger run.checkpoint_every, or free the space" in message
    figures = disk.check_disk(_cfg(a, "run.steps=200", "run.keep_checkpoints=49"), Path("runs/big"))
    assert figures["checkpoints_at_once"] == 50 and figures["needed_gb"] <= figures["free_gb"]


def test_coba_run_refuses_before_writing_anything_when_the_checkpoints_cannot_fit(
    tmp_path, prefect_harness, random_checkpoints, monkeypatch, capsys
):
    from coba_tasks.commands.cli import main as cli_main

    a, _ = random_checkpoints
    monkeypatch.setattr(disk, "_free_bytes", lambda root: 1000)
    run_dir = tmp_path / "run"
    argv = ["run", "--config", "configs/tiny-test.yaml", "--run-dir", str(run_dir), "--set", f"model.path={a}"]
    assert cli_main(argv) == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
    assert f"error: {run_dir}: the run's checkpoints need " in line and "disk has 0.0 GB free" in line
    assert not run_dir.exists()  # nothing written


def test_a_resume_that_cannot_fit_names_the_space_not_settings_it_cannot_change(random_checkpoints, monkeypatch):
    """A continuing run's config is fixed by its hash: the refusal of a resume names the space to free (or a larger
    disk), never run.keep_checkpoints or run.checkpoint_every, which it cannot change."""
    a, _ = random_checkpoints
    cfg = _cfg(a, "run.steps=200")
    one = disk.checkpoint_bytes(cfg)
    monkeypatch.setattr(disk, "_free_bytes", lambda root: 50 * one)
    with pytest.raises(disk.DiskSpaceError) as err:
        disk.check_disk(cfg, Path("runs/big"), first=100, existing=100, resuming=True)
    message = str(err.value)
    assert "\n" not in message and "(100 more of " in message
    assert "set run." not in message and "a larger run.checkpoint_every" not in message
    assert f"free {(100 * one - 50 * one) / disk.GB:.1f} GB or more on that disk" in message
    assert "move the run directory to a larger disk and resume it there" in message
