"""The training flow logs to experiment trackers (run.trackers): a tiny run stopped after 2 steps and resumed
logs every step once to TensorBoard and MLflow, read back with their own readers, in the same tracker run."""

from __future__ import annotations

import json
import os

import pytest
from helpers_reward import data_overrides

from coba_tasks.pipeline.config import config_to_dict, load_config
from coba_tasks.readers.trackers import STATE_FILE, store_uri

STEPS = 3


@pytest.mark.slow
def test_a_resumed_run_continues_its_tracker_runs_without_logging_a_step_twice(
    tmp_path, prefect_harness, random_checkpoints, first_char_data
):
    pytest.importorskip("tensorboard")
    pytest.importorskip("mlflow")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from coba_tasks.pipeline.faults import FAIL_FILE_ENV
    from flows.train import train_flow

    model, _ = random_checkpoints
    overrides = [f"model.path={model}", "data.train_prompts=6", f"run.steps={STEPS}", "run.eval_every=2"]
    overrides += [*data_overrides(first_char_data), "run.trackers=tensorboard,mlflow"]
    overrides.append("rollout.backend=transformers")  # the subject is the trackers, not the engine
    cfg = config_to_dict(load_config("configs/tiny-test.yaml", overrides))
    run_dir = tmp_path / "run"
    fail = tmp_path / "fail-at"
    fail.write_text("2:rollouts")  # stops after 2 steps (and the evaluation after step 2)
    os.environ[FAIL_FILE_ENV] = str(fail)
    try:
        assert train_flow(run_dir=str(run_dir), config=cfg, return_state=True).is_failed()
    finally:
        del os.environ[FAIL_FILE_ENV]
    state = json.loads((run_dir / STATE_FILE).read_text())
    assert state["tensorboard"]["last_step"] == 2 and state["mlflow"]["last_step"] == 2
    train_flow(run_dir=str(run_dir), resume=True)
    resumed = json.loads((run_dir / STATE_FILE).read_text())
    assert resumed["mlflow"]["run_id"] == state["mlflow"]["run_id"] and resumed["tensorboard"]["last_step"] == STEPS

    acc = EventAccumulator(str(run_dir / "trackers" / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("update/loss")] == [1, 2, 3]
    assert [e.step for e in acc.Scalars("heldout/accuracy")] == [0, 2, 3]
    for tag in ("train/pass_rate", "capability/alpha", "budget/mean", "update/grad_norm", "time/update_seconds"):
        assert [e.step for e in acc.Scalars(tag)] == [1, 2, 3], tag
    assert {"config", "samples"} <= {t.split("/")[0] for t in acc.Tags()["tensors"]}

    from mlflow.tracking import MlflowClient

    from coba_tasks.pipeline.store import RunStore, Table

    client = MlflowClient(tracking_uri=store_uri(run_dir / "trackers" / "mlflow"))
    loss = client.get_metric_history(state["mlflow"]["run_id"], "update/loss")
    store = RunStore.open(run_dir)
    assert [(m.step, m.value) for m in loss] == [
        (k, pytest.approx(float(store.read_table(k - 1, Table.UPDATE)["loss"].iloc[0]))) for k in (1, 2, 3)
    ]
    assert [m.step for m in client.get_metric_history(state["mlflow"]["run_id"], "heldout/accuracy")] == [0, 2, 3]
    assert client.get_run(state["mlflow"]["run_id"]).data.params["run.trackers"] == '["tensorboard", "mlflow"]'
