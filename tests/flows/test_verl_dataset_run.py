"""A one-step training run on the tiny model from a veRL GSM8K file as veRL's preprocessing writes it.

The prompts keep veRL's instruction (about 90 characters: a tiny model with a longer context), the
rows are scored by veRL's flexible GSM8K scorer (``verify.gsm8k_answer=flexible``), and the run's
rewards table must say what that scorer says of each completion.
"""

from __future__ import annotations

import pytest
from verl_files import write_verl_gsm8k

from coba_tasks.engines.verify import gsm8k_flexible_verifier
from coba_tasks.pipeline.config import load_config
from coba_tasks.pipeline.store import RunStore, Table


@pytest.fixture(scope="module")
def long_context_model(tmp_path_factory):
    from coba_tasks.engines.model import TinyLlamaSpec, build_char_tokenizer, build_tiny_llama, save_hf

    tok = build_char_tokenizer()
    spec = TinyLlamaSpec(hidden_size=64, intermediate_size=128, max_position_embeddings=160)
    return save_hf(build_tiny_llama(tok, spec, seed=0), tok, tmp_path_factory.mktemp("ckpt") / "m")


@pytest.mark.slow
def test_a_training_step_from_a_verl_gsm8k_file(tmp_path, long_context_model):
    from coba_tasks.pipeline import run
    from coba_tasks.pipeline import stages as stage_step

    train = write_verl_gsm8k(tmp_path / "train.parquet", [("1+2?", "3"), ("4+4?", "8"), ("9-5?", "4"), ("2*3?", "6")])
    test = write_verl_gsm8k(tmp_path / "test.parquet", [("5+1?", "6"), ("7-2?", "5")], split="test")
    overrides = [
        f"model.path={long_context_model}",
        f"data.train={train}",
        f"data.test={test}",
        "data.eval_prompts=2",
        "verify.gsm8k_answer=flexible",
        "run.steps=1",
        "rollout.max_model_len=160",
        "rollout.backend=transformers",  # the subject is the dataset, not the engine
    ]
    cfg = load_config("configs/tiny-test.yaml", overrides)
    root = (tmp_path / "run").resolve()
    assert run.verifier_pool(cfg).gsm8k_answer == "flexible"  # the pool a run builds (not started)
    res = run.open_run(root, cfg, continuing=False)
    try:
        assert res.policy.start() == 0
        for stage_task, r in stage_step.step_tasks(res, 0):  # one step, without Prefect
            stage_task.fn(str(root), 0, r)
    finally:
        run.close_run(res)

    store = RunStore.open(root)
    rollouts = store.read_table(0, Table.ROLLOUTS)
    rewards = store.read_table(0, Table.REWARDS)
    assert len(rewards) == len(rollouts) > 0
    truth = dict(zip(res.prompts["prompt_id"], res.prompts["ground_truth"], strict=True))
    assert set(truth) == {"0", "1", "2", "3"}  # veRL's extra_info.index
    for completion, pid, verdict in zip(rollouts["completion"], rewards["prompt_id"], rewards["verdict"], strict=True):
        assert verdict == gsm8k_flexible_verifier(completion, truth[pid]).verdict.value
