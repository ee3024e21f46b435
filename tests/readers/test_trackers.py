"""Experiment trackers (coba_tasks.readers.trackers) from a hand-made run directory's tables, read back
with each library's own reader: TensorBoard's EventAccumulator, MLflow's MlflowClient, and the records of
wandb's offline run files (its protobuf Record messages; wandb has no offline reader of its own)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pandas as pd
import pytest

from coba_tasks.engines.checkpoint import write_checkpoint_manifest
from coba_tasks.pipeline.config import Config, apply_overrides, config_hash, config_to_dict
from coba_tasks.pipeline.store import RunStore, Table
from coba_tasks.readers import trackers

STEPS = 4


def _cfg(names: str, steps: int = STEPS) -> Config:
    return apply_overrides(Config(), [f"run.trackers={names}", f"run.steps={steps}", "run.eval_every=2"])


def _run(root: Path, cfg: Config) -> RunStore:
    store = RunStore(root)
    store.create(config_to_dict(cfg), config_hash(cfg), {})
    store.write_table(0, Table.BUDGET, pd.DataFrame({"prompt_id": ["a", "b"], "budget": [2, 6]}))
    _eval(store, 0)
    return store


def _eval(store: RunStore, k: int) -> None:
    store.write_table(
        k,
        Table.EVAL,
        pd.DataFrame({"prompt_id": ["x", "y"], "accuracy": [0.1 * k, 1.0], "difficulty": [1, 2], "answered": 1.0}),
    )


def _step(store: RunStore, s: int, evaluate: bool, shift: float = 0.0) -> None:
    """The tables of training step ``s`` (and the evaluation after it); ``shift`` moves its loss."""
    ids, idx = ["a", "a", "b", "b"], [0, 1, 0, 1]
    store.write_table(
        s,
        Table.ROLLOUTS,
        pd.DataFrame({"prompt_id": ids, "sample_idx": idx, "completion": list("wxyz"), "n_tokens": [3, 1, 2, 2]}),
    )
    rewards = pd.DataFrame({"prompt_id": ids, "sample_idx": idx, "reward": [1.0, 0.0, 0.0, 0.0], "verdict": "wrong"})
    store.write_table(s, Table.REWARDS, rewards)
    cap = {"S": 0.25, "F": 0.75, "alpha": 6.0 + s, "beta": 2.0, "alpha_used": 6.0, "beta_used": 2.0}
    store.write_table(s, Table.CAPABILITY, pd.DataFrame([{"step": s, **cap, "zero_variance_groups": 0.5}]))
    store.write_table(s + 1, Table.BUDGET, pd.DataFrame({"prompt_id": ["a", "b"], "budget": [3, 5]}))
    upd = {
        "loss": -0.5 + s + shift,
        "grad_norm": 1.5,
        "clip_frac": 0.1,
        "entropy": 2.0,
        "kl": 0.0,
        "lr": 1e-5,
        "tokens": 40,
    }
    store.write_table(s, Table.UPDATE, pd.DataFrame([{"step": s, **upd, "logprob_diff_mean": 0.01}]))
    store.write_json(f"steps/{s:06d}/timing.json", {"rollouts": 1.0, "update": 2.0})
    ckpt = store.checkpoint_dir(s + 1)  # what the update writes (a rerun checks that its resume finds it)
    ckpt.mkdir(parents=True, exist_ok=True)
    (ckpt / "model.safetensors").write_bytes(b"weights")
    write_checkpoint_manifest(ckpt)
    if evaluate:
        _eval(store, s + 1)


def test_step_metrics_and_samples_from_the_tables(tmp_path):
    cfg = _cfg("")
    store = _run(tmp_path / "run", cfg)
    _step(store, 0, evaluate=False)
    t = trackers.load_run(store.root)
    evals = {0, 2, STEPS}  # eval_steps(STEPS, 2)
    assert trackers.step_complete(t, 0, STEPS, evals) and trackers.step_complete(t, 1, STEPS, evals)
    assert not trackers.step_complete(t, 2, STEPS, evals)  # no update of step 1
    m = trackers.step_metrics(t, 1)
    assert m["train/pass_rate"] == 0.25 and m["train/F"] == 0.75 and m["train/reward_mean"] == 0.25
    assert (m["capability/alpha"], m["capability/beta"]) == (6.0, 2.0)
    assert (m["budget/min"], m["budget/max"], m["budget/mean"], m["budget/zero_variance_share"]) == (2, 6, 4, 0.5)
    assert (m["update/loss"], m["update/grad_norm"]) == (-0.5, 1.5)
    assert (m["update/clip_frac"], m["update/entropy"]) == (0.1, 2.0)
    assert m["update/sampler_trainer_gap"] == 0.01 and m["time/update_seconds"] == 2.0 and m["time/step_seconds"] == 3
    assert "heldout/accuracy" not in m
    # the step's mechanisms (readers.mechanisms): a mixed, b not; no verdict correct, so pass@2 0; no estimate
    # (not logged); N_eff from the rollouts' tokens (the update table has none): one mixed prompt, 1.0
    assert (m["mechanisms/prompts"], m["mechanisms/mixed_groups"], m["mechanisms/estimated"]) == (2, 1, 0)
    assert m["mechanisms/train_pass_at_2"] == 0.0 and m["mechanisms/effective_prompts"] == 1.0
    assert "mechanisms/estimate_mae" not in m
    m0 = trackers.step_metrics(t, 0)
    assert m0["heldout/accuracy"] == 0.5 and m0["heldout/accuracy_L2"] == 1.0 and "update/loss" not in m0
    samples = trackers.step_samples(t, 1)
    assert samples[["prompt_id", "completion", "reward"]].to_dict("records") == [
        {"prompt_id": "a", "completion": "w", "reward": 1.0},
        {"prompt_id": "b", "completion": "y", "reward": 0.0},
    ]
    assert trackers.step_samples(t, 0) is None
    assert (samples["prompt"] == "").all()  # no prompts table: no text, and no error
    # a run's prompts table holds the user's text as prompt_text (chat files have no plain prompt column)
    store.write_run_table("prompts", pd.DataFrame({"prompt_id": ["a", "b"], "prompt_text": ["Compute 1+1.", "2-1"]}))
    samples = trackers.step_samples(trackers.load_run(store.root), 1)
    assert samples["prompt"].tolist() == ["Compute 1+1.", "2-1"]
    params = trackers.flat_config(cfg)
    assert params["run.steps"] == STEPS and params["optim.lr"] == cfg.optim.lr


def _tensorboard_steps(directory: Path) -> dict[str, list[int]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {tag: [e.step for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _wandb_history(directory: Path) -> list[dict]:
    """The history rows of every offline run in ``directory`` (wandb's .wandb files: a LevelDB-style log of
    Record protobufs in 32 KiB blocks after a 7-byte header)."""

    return [row for path in sorted(directory.glob("wandb/offline-run-*")) for row in _wandb_history_of(path)]


def _wandb_history_of(run: Path) -> list[dict]:
    """The history rows of one offline run directory."""
    from wandb.proto import wandb_internal_pb2

    rows = []
    for path in sorted(run.glob("run-*.wandb")):
        data = path.read_bytes()
        assert data[:4] == b":W&B"
        pos, record = 7, b""
        while pos + 7 <= len(data):
            if (pos % 32768) + 7 > 32768:  # a block's tail too short for a header is padding
                pos += 32768 - pos % 32768
                continue
            _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
            if kind == 0 and length == 0:
                pos += 32768 - pos % 32768
                continue
            record += data[pos + 7 : pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):  # FULL or LAST
                rec = wandb_internal_pb2.Record()
                rec.ParseFromString(record)
                record = b""
                if rec.WhichOneof("record_type") == "history":
                    rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
    return rows


def test_trackers_log_each_step_once_across_a_resume(tmp_path):
    pytest.importorskip("tensorboard")
    pytest.importorskip("mlflow")
    wandb = pytest.importorskip("wandb")
    cfg = _cfg("tensorboard,mlflow,wandb")
    store = _run(tmp_path / "run", cfg)
    trk = trackers.open_trackers(store.root, cfg)
    assert trk.log_new() == [0]  # the evaluation before training
    for s in range(2):
        _step(store, s, evaluate=s == 1)
        assert trk.log_new() == [s + 1]
    assert trk.log_new() == []
    trk.close()  # stopped after 2 steps
    state = json.loads((store.root / trackers.STATE_FILE).read_text())
    assert {n: e["last_step"] for n, e in state.items()} == {"tensorboard": 2, "mlflow": 2, "wandb": 2}

    for s in range(2, STEPS):  # steps done while the trackers were not looking (a crash after the tables)
        _step(store, s, evaluate=s == STEPS - 1)
    trk = trackers.open_trackers(store.root, cfg)  # resumed: the same tracker runs, only the new steps
    assert trk.log_new() == [3, 4]
    trk.close()
    assert json.loads((store.root / trackers.STATE_FILE).read_text())["mlflow"]["run_id"] == state["mlflow"]["run_id"]

    tb = _tensorboard_steps(store.root / "trackers" / "tensorboard")
    assert tb["update/loss"] == [1, 2, 3, 4] and tb["heldout/accuracy"] == [0, 2, 4]
    assert tb["budget/zero_variance_share"] == [1, 2, 3, 4] and tb["train/pass_rate"] == [1, 2, 3, 4]

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=trackers.store_uri(store.root / "trackers" / "mlflow"))
    run_id = state["mlflow"]["run_id"]
    loss = client.get_metric_history(run_id, "update/loss")
    assert [(m.step, m.value) for m in loss] == [(1, -0.5), (2, 0.5), (3, 1.5), (4, 2.5)]
    assert [m.step for m in client.get_metric_history(run_id, "heldout/accuracy")] == [0, 2, 4]
    run = client.get_run(run_id)
    assert run.data.params["run.steps"] == str(STEPS) and run.info.status == "FINISHED"
    assert "samples/step_000001.json" in {a.path for a in client.list_artifacts(run_id, "samples")}

    history = _wandb_history(store.root / "trackers")
    assert [r["_step"] for r in history] == [0, 1, 2, 3, 4]  # two offline runs of one id, no step twice
    assert [r["update/loss"] for r in history if "update/loss" in r] == [-0.5, 0.5, 1.5, 2.5]
    assert all(r["samples/_type"] == "table-file" and r["samples/nrows"] == 2 for r in history[1:])
    ids = {p.name.rsplit("-", 1)[-1] for p in (store.root / "trackers" / "wandb").glob("offline-run-*")}
    assert ids == {state["wandb"]["run_id"]}
    assert wandb.run is None


def test_a_rerun_step_is_logged_again_with_its_new_figures(tmp_path):
    """After a rerun recomputes steps, every tracker shows the recomputed figures: TensorBoard rewinds its
    run to the first stale step, MLflow and W&B (which cannot rewind a run) log the whole run again into a
    new tracker run and the earlier one is left as it was, marked superseded (MLflow tag)."""
    pytest.importorskip("tensorboard")
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    from coba_tasks.pipeline.rerun import apply_rerun, plan_rerun

    cfg = _cfg("tensorboard,mlflow,wandb")
    store = _run(tmp_path / "run", cfg)
    trk = trackers.open_trackers(store.root, cfg)
    for s in range(STEPS):
        _step(store, s, evaluate=s in (1, STEPS - 1))
    assert trk.log_new() == [0, 1, 2, 3, 4]
    trk.close()
    before = json.loads((store.root / trackers.STATE_FILE).read_text())

    apply_rerun(store, plan_rerun(store, 2, Table.REWARDS))  # what `coba rerun --step 2 --stage rewards` removes
    warnings: list[str] = []
    trk = trackers.open_trackers(store.root, cfg, warn=warnings.append)  # the resume after the rerun
    for s in (2, 3):
        _step(store, s, evaluate=s == STEPS - 1, shift=10.0)
    trk.log_new()
    trk.close()
    after = json.loads((store.root / trackers.STATE_FILE).read_text())
    assert {n: e["last_step"] for n, e in after.items()} == {"tensorboard": 4, "mlflow": 4, "wandb": 4}
    assert any("mlflow" in w and "from step 3" in w for w in warnings)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(store.root / "trackers" / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("update/loss")] == [(1, -0.5), (2, 0.5), (3, 11.5), (4, 12.5)]

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=trackers.store_uri(store.root / "trackers" / "mlflow"))
    old, new = before["mlflow"]["run_id"], after["mlflow"]["run_id"]
    assert old != new
    assert [(m.step, m.value) for m in client.get_metric_history(new, "update/loss")] == [
        (1, -0.5),
        (2, 0.5),
        (3, 11.5),
        (4, 12.5),
    ]
    assert [m.step for m in client.get_metric_history(new, "heldout/accuracy")] == [0, 2, 4]
    assert [m.value for m in client.get_metric_history(old, "update/loss")] == [-0.5, 0.5, 1.5, 2.5]
    assert client.get_run(old).data.tags["coba.superseded_by"] == new

    assert after["wandb"]["run_id"] != before["wandb"]["run_id"]
    runs = sorted((store.root / "trackers" / "wandb").glob("offline-run-*"))
    assert {p.name.rsplit("-", 1)[-1] for p in runs} == {before["wandb"]["run_id"], after["wandb"]["run_id"]}
    newest = next(p for p in runs if p.name.endswith(after["wandb"]["run_id"]))
    history = _wandb_history_of(newest)
    assert [r["_step"] for r in history] == [0, 1, 2, 3, 4]
    assert [r["update/loss"] for r in history if "update/loss" in r] == [-0.5, 0.5, 11.5, 12.5]
