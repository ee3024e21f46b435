"""LoRA through the training flow: adapter checkpoints, merged weights for vLLM, resume, rerun, coba-eval.

The runs train the random tiny model (vLLM on CPU) on prompts scored by a reward it earns
(tests/helpers_reward.py), so every update moves the adapters.
"""

from __future__ import annotations

import os

import pandas as pd
import pytest
import torch
from helpers_reward import data_overrides
from safetensors.torch import load_file

from coba_tasks.commands.cli import main as cli_main
from coba_tasks.engines.lora import ADAPTER_FILE, is_adapter_checkpoint
from coba_tasks.pipeline.config import config_to_dict, load_config
from coba_tasks.pipeline.config_fields import ConfigError
from coba_tasks.pipeline.store import RunStore, Table

STEPS = 3


def _config(model, data, *extra):
    overrides = [f"model.path={model}", "data.train_prompts=6", f"run.steps={STEPS}", "model.lora_rank=4"]
    overrides += ["model.lora_alpha=8", "optim.lr=1e-2", *data_overrides(data), *extra]
    return config_to_dict(load_config("configs/tiny-test.yaml", overrides))


def _adapters(store: RunStore) -> list[dict[str, torch.Tensor]]:
    return [load_file(str(store.checkpoint_dir(s) / ADAPTER_FILE)) for s in range(1, STEPS + 1)]


def _assert_same_run(store: RunStore, ref: RunStore, adapters: list[dict[str, torch.Tensor]]) -> None:
    for step in ref.steps():
        for name in ref.manifest(step):
            pd.testing.assert_frame_equal(
                store.read_table(step, name), ref.read_table(step, name), obj=f"{step}/{name}", check_exact=True
            )
    for x, y in zip(_adapters(store), adapters, strict=True):
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.mark.slow
def test_a_lora_run_trains_adapters_resumes_and_evaluates(
    tmp_path, prefect_harness, random_checkpoints, first_char_data
):
    from coba_tasks.pipeline.evaluation import eval_settings, evaluate_model
    from coba_tasks.pipeline.faults import FAIL_FILE_ENV
    from flows.train import train_flow

    model, _ = random_checkpoints
    cfg = _config(model, first_char_data)
    straight = tmp_path / "straight"
    summary = train_flow(run_dir=str(straight), config=cfg)
    ref = RunStore.open(straight)
    base_size = (model / "model.safetensors").stat().st_size
    for step in range(1, STEPS + 1):
        ckpt = ref.checkpoint_dir(step)
        assert is_adapter_checkpoint(ckpt) and not (ckpt / "model.safetensors").exists()
        size = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())
        assert size < base_size / 2, (step, size, base_size)  # the adapter and its AdamW state only
    adapters = _adapters(ref)
    for before, after in zip([None, *adapters], adapters, strict=False):  # every update moved the adapter
        b_keys = [k for k in after if ".lora_B." in k]
        assert any(float(after[k].abs().sum()) > 0 for k in b_keys)
        if before is not None:
            assert any(not torch.equal(before[k], after[k]) for k in after)
    # vLLM took the merged weights from memory: no model file outside the checkpoints (the adapters)
    assert [p.relative_to(straight) for p in straight.rglob("*.safetensors") if "checkpoints" not in p.parts] == []
    for step in range(STEPS):  # vLLM sampled the merged weights; the trainer computes W x + s B A x: rounding
        gap = float(ref.read_table(step, Table.UPDATE)["logprob_diff_max"].iloc[0])
        assert gap < 1e-3, (step, gap)
    assert summary["logprob_gap_max"] < 1e-3

    # stopped inside step 1 (after its rollouts were computed) and resumed: the same run, adapter for adapter
    run_dir = tmp_path / "stopped"
    fail = tmp_path / "fail-at"
    fail.write_text("1:rewards")
    os.environ[FAIL_FILE_ENV] = str(fail)
    try:
        assert train_flow(run_dir=str(run_dir), config=cfg, return_state=True).is_failed()
    finally:
        del os.environ[FAIL_FILE_ENV]
    train_flow(run_dir=str(run_dir), resume=True)
    store = RunStore.open(run_dir)
    _assert_same_run(store, ref, adapters)

    # step 1's update rerun: checkpoints 2 and 3 recomputed from checkpoint 1's adapter and AdamW state
    args = ["rerun", "--run-dir", str(run_dir), "--step", "1", "--stage", "update", "--yes", "--no-resume"]
    assert cli_main(args) == 0
    assert not store.checkpoint_dir(2).exists() and store.checkpoint_dir(1).exists()
    train_flow(run_dir=str(run_dir), resume=True)
    _assert_same_run(store, ref, adapters)

    # coba-eval of a LoRA checkpoint: the adapter merged into its base for the engine
    settings = eval_settings(test_path=str(first_char_data[1]), max_tokens=8, backend="transformers", eval_prompts=10)
    table = evaluate_model(str(ref.checkpoint_dir(STEPS)), settings)
    assert len(table) == 10 and (table["weight_version"] == STEPS).all()
    final = ref.read_table(STEPS, Table.EVAL)
    assert sorted(table["prompt_id"]) == sorted(final["prompt_id"])


def test_lora_with_fsdp_is_refused_in_one_line(random_checkpoints, first_char_data):
    model, _ = random_checkpoints
    with pytest.raises(
        ConfigError, match=r"model\.lora_rank = 4 with optim\.fsdp_processes = 2: LoRA with FSDP is not"
    ):
        load_config(None, [f"model.path={model}", "model.lora_rank=4", "optim.fsdp_processes=2"])
    with pytest.raises(ConfigError, match=r"model\.lora_rank = -1: must be >= 0"):
        load_config(None, ["model.lora_rank=-1"])
