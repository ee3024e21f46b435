"""After training: ``coba eval`` (avg@k, greedy, pass@k, the per-prompt table) and ``coba export`` (a model
plain transformers and vLLM load, whose log-probabilities are the trainer's)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import make_random_checkpoint
from helpers_reward import TEST_PROMPTS, write_flat

from coba_tasks.commands.cli import main as cli_main
from coba_tasks.core.passk import pass_at_k
from coba_tasks.engines.export import EXPORT_RECORD, export_checkpoint
from coba_tasks.engines.update import PolicyTrainer
from coba_tasks.pipeline.policy import update_settings

PROMPTS = [[10, 11, 12], [13, 14], [15, 16, 17, 18], [10, 12]]
COMPLETIONS = [[20, 21, 2], [22, 2], [23], [24, 25, 26, 2]]
ADV = np.array([1.0, -1.0, 0.5, -0.5], dtype=np.float32)
CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"


# ---------------------------------------------------------------------------------------------
# coba eval


@pytest.mark.slow
def test_coba_eval_reports_avg_greedy_and_unbiased_pass_at_k_and_writes_the_table(
    tmp_path, random_checkpoints, prefect_harness, capsys
):
    model, _ = random_checkpoints
    test = write_flat(tmp_path / "test.parquet", TEST_PROMPTS, difficulty=[0, 1] * 5)
    out = tmp_path / "evals" / "table.parquet"
    args = ["eval", "--model", str(model), "--dataset", str(test), "--samples", "4", "--temperature", "1.0"]
    args += ["--max-tokens", "4", "--prompts", "0", "--out", str(out), "--json"]
    assert cli_main(args) == 0
    figures = json.loads(capsys.readouterr().out)
    table = pd.read_parquet(out)
    assert len(table) == figures["prompts"] == len(TEST_PROMPTS)
    assert (table["samples"] == 4).all() and table["solved"].between(0, 4).all()
    assert np.allclose(table["solved"] / 4, table["accuracy"])
    # pass@k from the table's counts, by the estimator's definition; pass@1 is avg@4
    assert list(figures["pass_at_k"]) == ["1", "2", "3", "4"]
    for k in range(1, 5):
        want = np.mean([pass_at_k(4, int(c), k) for c in table["solved"]])
        assert figures["pass_at_k"][str(k)] == pytest.approx(want, abs=1e-12)
    assert figures["pass_at_k"]["1"] == pytest.approx(figures["accuracy"])
    assert 0 < figures["accuracy"] < figures["pass_at_k"]["4"] <= 1  # the first-char reward: mixed groups
    assert figures["greedy"] == pytest.approx(table["accuracy_greedy"].mean())
    assert set(figures["by_difficulty"]) == {"0", "1"}
    assert list(figures["by_data_source"]) == ["test-first-char"]
    assert figures["settings"]["samples"] == 4 and figures["settings_from"] == "the defaults"

    # an existing --out is refused before anything runs, and the table stays as it was
    before = out.read_bytes()
    assert cli_main(args) == 2
    assert "already exists" in capsys.readouterr().err and out.read_bytes() == before

    # the levels a run keeps (data.difficulties), here chosen on the command line
    assert cli_main([*args[:-3], "--difficulties", "1", "--json"]) == 0
    level_one = json.loads(capsys.readouterr().out)
    assert level_one["prompts"] == 5 and list(level_one["by_difficulty"]) == ["1"]

    # the text form: the same figures, one line each
    assert cli_main([*args[:-3], "--no-greedy"]) == 0
    text = capsys.readouterr().out
    assert f"avg@4      {figures['accuracy']:.3f}" in text and "pass@k     @1 " in text and "greedy" not in text


@pytest.mark.slow
def test_a_census_samples_the_runs_training_pool_as_the_run_samples_and_scores_it(
    tmp_path, random_checkpoints, prefect_harness, first_char_data, capsys, monkeypatch
):
    """``coba eval --census RUN_DIR``: every prompt of the run's pool (prompts.parquet) ``--samples`` times at the
    run's training sampling (its temperature), scored by the run's reward file (allowed by the command itself),
    counted by how many completions each solved."""
    from helpers_reward import data_overrides, write_first_char_reward_file

    from coba_tasks.pipeline.config import config_to_dict, load_config
    from flows.train import train_flow

    model, _ = random_checkpoints
    reward = write_first_char_reward_file(tmp_path)
    overrides = [f"model.path={model}", "data.train_prompts=6", "run.steps=1", "rollout.backend=transformers"]
    overrides += [*data_overrides(first_char_data), f"verify.reward_function={reward}", "rollout.temperature=0.9"]
    cfg = load_config("configs/tiny-test.yaml", overrides)
    run_dir = tmp_path / "run"
    monkeypatch.setenv("COBA_ALLOW_REWARD_FILES", "1")  # as `coba run` allows its own
    train_flow(run_dir=str(run_dir), config=config_to_dict(cfg))
    monkeypatch.delenv("COBA_ALLOW_REWARD_FILES")  # the census allows the run's itself
    out = tmp_path / "census.parquet"
    ckpt = str(run_dir / "checkpoints" / "000001")
    args = ["eval", "--model", ckpt, "--census", str(run_dir), "--samples", "8", "--out", str(out), "--json"]
    assert cli_main(args) == 0
    counts = json.loads(capsys.readouterr().out)
    table = pd.read_parquet(out)
    pool = pd.read_parquet(run_dir / "prompts.parquet")
    assert table["prompt_id"].tolist() == pool["prompt_id"].tolist() and (table["samples"] == 8).all()
    assert counts["never"] + counts["sometimes"] + counts["always"] == 6 and counts["sometimes"] > 0  # scored
    assert sum(counts["by_solved"].values()) == 6 and (table["solved"] > 0).any()
    assert (table["weight_version"] == 1).all()
    assert cli_main(["eval", "--model", ckpt, "--census", str(run_dir), "--samples", "8"]) == 0
    text = capsys.readouterr().out
    assert "training pool: 6 prompts x 8 samples (temperature 0.9, top-p 1.0" in text and "sometimes" in text
    assert cli_main(["eval", "--model", ckpt]) == 2  # neither --dataset nor --census
    assert "give --dataset (held-out prompts) or --census RUN_DIR" in capsys.readouterr().err


def test_coba_eval_refuses_a_model_that_is_not_one_in_one_line(tmp_path, capsys):
    test = write_flat(tmp_path / "test.parquet", TEST_PROMPTS)
    assert cli_main(["eval", "--model", str(tmp_path), "--dataset", str(test)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: model_path") and "no config.json" in err and "\n" not in err


# ---------------------------------------------------------------------------------------------
# coba export


def _trained(tmp_path, lora_rank: int) -> tuple[PolicyTrainer, object]:
    """A trainer one update past a tiny random base (with a chat template and a generation config), and its
    checkpoint."""
    base = make_random_checkpoint(tmp_path / "base", 0)
    config = json.loads((base / "tokenizer_config.json").read_text())
    (base / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    (base / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "max_new_tokens": 7}))
    settings = update_settings(lr=1e-2, micro_batch_size=2, lora_rank=lora_rank, lora_alpha=8.0)
    trainer = PolicyTrainer(base, settings)
    trainer.update(PROMPTS, COMPLETIONS, ADV)
    return trainer, trainer.save_checkpoint(tmp_path / "checkpoints" / "000001")


def _plain_logprobs(model_dir) -> list[torch.Tensor]:
    """Completion-token log-probabilities of the exported model, with transformers alone."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p, c in zip(PROMPTS, COMPLETIONS, strict=True):
            ids = torch.tensor([p + c])
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
            out.append(logp[torch.arange(len(p) - 1, len(p) + len(c) - 1), torch.tensor(c)])
    return out


@pytest.mark.parametrize("lora_rank", [0, 4], ids=["full", "lora"])
def test_an_export_loads_in_plain_transformers_with_the_trainers_log_probabilities(tmp_path, lora_rank, capsys):
    from transformers import AutoTokenizer, GenerationConfig

    trainer, ckpt = _trained(tmp_path, lora_rank)
    trained: list = [None] * len(PROMPTS)
    trainer._grouped_logprobs(trainer.model, PROMPTS, COMPLETIONS, trained)  # what the trainer's loss uses
    out = tmp_path / "exported"
    assert cli_main(["export", "--checkpoint", str(ckpt), "--out", str(out)]) == 0
    assert str(out) in capsys.readouterr().out

    for got, want in zip(_plain_logprobs(out), trained, strict=True):
        assert torch.allclose(got, want.float(), atol=1e-5), (got - want).abs().max()
    files = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", EXPORT_RECORD, "generation_config.json"} <= files
    assert not any("optimizer" in f or "trainer_state" in f or "adapter" in f or "manifest" in f for f in files)
    assert AutoTokenizer.from_pretrained(out).chat_template == CHAT_TEMPLATE
    assert GenerationConfig.from_pretrained(out).max_new_tokens == 7  # the base model's own
    record = json.loads((out / EXPORT_RECORD).read_text())
    assert record["lora_merged"] == bool(lora_rank) and record["checkpoint"] == str(ckpt.resolve())

    # never over an existing directory, never inside the checkpoint
    assert cli_main(["export", "--checkpoint", str(ckpt), "--out", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err
    with pytest.raises(ValueError, match="inside the checkpoint"):
        export_checkpoint(ckpt, ckpt / "model")


def test_a_lora_export_refuses_another_base_and_leaves_nothing(tmp_path):
    from coba_tasks.engines.lora import AdapterBaseError

    _, ckpt = _trained(tmp_path, 4)
    shutil.rmtree(tmp_path / "base")
    make_random_checkpoint(tmp_path / "base", 1)  # another model at the base's path
    with pytest.raises(AdapterBaseError, match="is not the one the LoRA adapter"):
        export_checkpoint(ckpt, tmp_path / "exported")
    assert not (tmp_path / "exported").exists() and not list(tmp_path.glob(".exported*"))


@pytest.mark.slow
def test_vllm_loads_an_export_and_samples_with_its_log_probabilities(tmp_path):
    from coba_tasks.engines.rollout import RolloutRequest, SamplingConfig, make_backend

    _, ckpt = _trained(tmp_path, 4)
    out = export_checkpoint(ckpt, tmp_path / "exported")
    engine = make_backend("vllm", str(out), dtype="float32", max_model_len=64, seed=0)
    try:
        request = RolloutRequest("p", tuple(PROMPTS[0]), 2, 0)
        rows = engine.generate([request], SamplingConfig(temperature=1.0, max_tokens=6))
    finally:
        engine.close()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    for row in rows:
        ids = torch.tensor([list(PROMPTS[0]) + list(row.token_ids)])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, :-1], dim=-1)
        n = len(PROMPTS[0])
        want = logp[torch.arange(n - 1, n - 1 + len(row.token_ids)), torch.tensor(row.token_ids)]
        assert torch.allclose(torch.tensor(row.logprobs, dtype=torch.float32), want, atol=1e-3)


def test_several_samples_without_a_temperature_are_sampled_at_1_and_say_so(tmp_path):
    """`coba eval --model DIR --dataset FILE --samples 4` on a model directory was refused ("samples > 1 needs
    temperature > 0"): the default evaluation is greedy. Samples asked for without a temperature are drawn at
    1.0, and where the settings came from says so; a temperature given is kept, and greedy stays one sample."""
    import argparse

    from coba_tasks.commands.eval_cmd import eval_settings_for

    test = write_flat(tmp_path / "test.parquet", TEST_PROMPTS)
    keys = ("samples", "temperature", "top_p", "max_tokens", "prompts", "difficulties", "seed", "backend", "config")

    def settings(**given):
        args = argparse.Namespace(model=str(tmp_path), dataset=str(test), no_greedy=False, **dict.fromkeys(keys))
        return eval_settings_for(argparse.Namespace(**{**vars(args), **given}))

    s, source = settings(samples=4)
    assert (s.samples, s.temperature) == (4, 1.0) and "temperature 1.0, since --samples 4" in source
    s, source = settings(samples=4, temperature=0.7)
    assert (s.samples, s.temperature) == (4, 0.7) and "since" not in source
    s, _ = settings()
    assert (s.samples, s.temperature) == (1, 0.0)


def test_an_export_never_removes_another_exports_work_in_progress(tmp_path):
    """Each export built in `.<out>.export.tmp` and began by deleting it: a second export to the same --out
    deleted the first's half-written model. Each builds in a directory of its own now."""
    _, ckpt = _trained(tmp_path, 0)
    theirs = tmp_path / ".exported.export.tmp"  # another export's, still writing
    theirs.mkdir()
    (theirs / "model.safetensors").write_bytes(b"half written")
    export_checkpoint(ckpt, tmp_path / "exported")
    assert (theirs / "model.safetensors").read_bytes() == b"half written"
    assert (tmp_path / "exported" / "model.safetensors").is_file()
