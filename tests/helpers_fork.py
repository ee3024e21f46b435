"""Run directories laid out as the training flow writes them, without a model: for the tests of forked runs.

``fake_run`` writes what the flow writes, in its order (budget of step 0, the evaluation before training,
then per step rollouts, rewards, history and capability, the next budget, the update, a checkpoint, the
step's timing and the next evaluation), with the allocation stages' own functions and made-up rollouts:
prompt ``p<j>`` solves ``j % 4`` of its rollouts, so the pass rates differ and CoBA-RL's allocation of seen
prompts departs from the uniform one.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from coba_tasks.engines.checkpoint import write_checkpoint_manifest
from coba_tasks.pipeline import prompt_history, stages
from coba_tasks.pipeline.config import Config, config_hash, config_to_dict
from coba_tasks.pipeline.run import RunResources
from coba_tasks.pipeline.store import RunStore, Table

PROMPTS = 8


def fake_run(root: Path, cfg: Config, steps: int) -> RunStore:
    """A run of ``cfg`` in ``root`` with ``steps`` steps done (each with its checkpoint and evaluation)."""
    store = RunStore(root)
    store.create(config_to_dict(cfg), config_hash(cfg), {"coba-rl": "test"}, inputs={})
    prompts = pd.DataFrame(
        {"prompt_id": [f"p{j}" for j in range(PROMPTS)], "prompt": [f"{j}+1=" for j in range(PROMPTS)]}
    )
    store.write_run_table("prompts", prompts)
    store.write_run_table("history", prompt_history.empty_history())
    res = RunResources(cfg=cfg, store=store, prompts=prompts, test=pd.DataFrame())
    store.write_table(0, Table.EVAL, pd.DataFrame({"prompt_id": ["e0"], "accuracy": [0.25]}))
    history = prompt_history.empty_history()
    for t in range(steps):
        budget = stages.budget_for(res, t, history, stages.tracker_before(res, t))  # the step's first stage
        store.write_table(t, Table.BUDGET, budget)
        rows = [(pid, i) for pid, n in zip(budget["prompt_id"], budget["budget"], strict=True) for i in range(int(n))]
        ids, samples = [r[0] for r in rows], [r[1] for r in rows]
        store.write_table(t, Table.ROLLOUTS, pd.DataFrame({"prompt_id": ids, "sample_idx": samples}))
        solved = [i < int(pid[1:]) % 4 for pid, i in rows]
        rewards = pd.DataFrame(
            {
                "prompt_id": ids,
                "sample_idx": samples,
                "reward": [float(s) for s in solved],
                "verdict": ["correct" if s else "wrong" for s in solved],
            }
        )
        store.write_table(t, Table.REWARDS, rewards)
        capability, history = stages.capability_and_history(res, t)
        store.write_table(t, Table.HISTORY, history)
        store.write_run_table("history", history)
        store.write_table(t, Table.CAPABILITY, capability)
        store.write_table(t, Table.UPDATE, pd.DataFrame({"step": [t], "loss": [0.5 - t]}))
        ckpt = store.checkpoint_dir(t + 1)
        ckpt.mkdir(parents=True)
        (ckpt / "model.safetensors").write_bytes(f"weights after {t + 1} updates".encode())
        write_checkpoint_manifest(ckpt)
        store.write_step_json(t, "timing", {"rollouts": 1.5 + t, "update": 2.5})
        store.write_table(t + 1, Table.EVAL, pd.DataFrame({"prompt_id": ["e0"], "accuracy": [0.25 + t / 8]}))
    return store
