"""End to end: the coba-train flow through Prefect on a tiny config, with real vLLM on CPU.

The run trains the random tiny model on prompts scored by a reward it earns (tests/helpers_reward.py),
so its updates have something to learn from and move the weights (checked).
"""

from __future__ import annotations

import json
import math

import pytest
from helpers_reward import assert_updates_moved, data_overrides

from coba_tasks.pipeline.config import config_to_dict, load_config
from coba_tasks.pipeline.store import STEP_STAGES, RunStore, Stage


@pytest.mark.slow
def test_train_flow_writes_every_stage(tmp_path, prefect_harness, random_checkpoints, first_char_data):
    from flows.train import train_flow

    model, _ = random_checkpoints
    overrides = [f"model.path={model}", "data.train_prompts=6", "run.steps=3", *data_overrides(first_char_data)]
    cfg = load_config("configs/tiny-test.yaml", overrides)
    run_dir = tmp_path / "run"
    summary = train_flow(run_dir=str(run_dir), config=config_to_dict(cfg))

    store = RunStore.open(run_dir)
    m, g = cfg.data.prompts_per_step, cfg.allocation.group_size
    for step in range(3):
        for name in (*STEP_STAGES, Stage.HISTORY):
            assert store.is_done(step, name), (step, name)
            entry = store.manifest(step)[name]
            assert entry["rows"] == len(store.read_table(step, name)) and len(entry["sha256"]) == 64
        budget = store.read_table(step, Stage.BUDGET)
        rollouts = store.read_table(step, Stage.ROLLOUTS)
        rewards = store.read_table(step, Stage.REWARDS)
        assert len(budget) == m and int(budget["budget"].sum()) == m * g
        assert budget["budget"].between(cfg.allocation.min_budget, cfg.allocation.max_budget).all()
        per_prompt = rollouts.groupby("prompt_id").size()
        assert per_prompt.to_dict() == dict(zip(budget["prompt_id"], budget["budget"], strict=True))
        assert (rollouts["weight_version"] == step).all()
        assert len(rewards) == len(rollouts) and set(rewards["verdict"]) <= {"correct", "wrong", "no_answer"}
        assert (rollouts["n_tokens"] == rollouts["token_ids"].apply(len)).all()
    # 6 prompts, 4 per step: step 2 revisits prompts seen at step 0, so its budget is not uniform by fallback
    assert store.read_table(0, Stage.BUDGET)["fallback"].str.contains("unseen").all()
    assert not store.read_table(2, Stage.BUDGET)["fallback"].str.contains("unseen").any()
    assert store.is_done(3, Stage.BUDGET)  # the allocation for the step after the last
    assert_updates_moved(store, model, 3)  # every update had a gradient and changed the weights

    from transformers import AutoModelForCausalLM

    ckpt = store.checkpoint_dir(3)
    AutoModelForCausalLM.from_pretrained(ckpt)  # the last checkpoint loads as an HF model
    assert not list(run_dir.rglob("*.bin")) and not list(run_dir.rglob("*.pkl"))
    # safe loading: a run directory holds Parquet, JSON, YAML, safetensors and the report only
    allowed = {".parquet", ".json", ".yaml", ".safetensors", ".png", ".html"}
    files = [f for f in run_dir.rglob("*") if f.is_file()]
    assert {f.suffix for f in files} <= allowed, sorted({f.suffix for f in files} - allowed)
    magic = {".parquet": b"PAR1", ".png": b"\x89PNG"}
    for f in files:  # and each file is what its name says: nothing pickled behind a harmless suffix
        head = f.read_bytes()[:16]
        if f.suffix == ".safetensors":
            assert head[8:9] == b"{", f  # u64 header length, then the JSON header
        elif f.suffix in magic:
            assert head.startswith(magic[f.suffix]), f
        else:
            f.read_text(encoding="utf-8")  # JSON, YAML, HTML: text

    saved = json.loads((run_dir / "summary.json").read_text())
    for key in (
        "steps",
        "strategy",
        "heldout_accuracy_before",
        "heldout_accuracy_after",
        "total_rollouts",
        "wall_seconds",
        "stage_seconds",
    ):
        assert key in saved
    assert saved["steps"] == 3 and saved["total_rollouts"] == 3 * m * g
    assert saved == json.loads(json.dumps(summary))
    assert set(saved["stage_seconds"]) >= {"rollouts", "rewards", "capability", "budget", "update"}
    # timings are reported, not judged: each is a finite, non-negative number of seconds
    timings = [saved["wall_seconds"], saved["step_seconds_mean"], saved["prefect_overhead_seconds_per_step"]]
    for seconds in [*timings, *saved["stage_seconds"].values()]:
        assert isinstance(seconds, float) and math.isfinite(seconds) and seconds >= 0, saved
    ev = store.read_table(3, Stage.EVAL)  # greedy evaluation: its greedy column is the same figures
    assert ev["accuracy_greedy"].tolist() == ev["accuracy"].tolist() and len(ev) == cfg.data.eval_prompts
    assert saved["heldout_greedy_after"] == saved["heldout_accuracy_after"]
    assert ev["answered"].between(0, 1).all() and (ev["accuracy"] <= ev["answered"]).all()  # correct is answered
    assert saved["heldout_answered_after"] == pytest.approx(ev["answered"].mean())
    timing = json.loads((run_dir / "steps/000001/timing.json").read_text())
    assert set(timing) == {"rollouts", "rewards", "capability", "budget", "update"}
    assert all(isinstance(v, float) and math.isfinite(v) and v >= 0 for v in timing.values()), timing
    # the report is drawn at the end and posted as artifacts
    report = run_dir / "report"
    assert (report / "index.html").is_file() and (report / "accuracy.png").stat().st_size > 5000
    assert not [c for c in store.read_table(0, Stage.REWARDS).columns if c.endswith("_ms")]  # no timings in tables
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        keys = ["coba-report", "coba-report-page", "step-000002", "budget-step-000003"]
        found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=keys)))
        images = [a for a in client.read_artifacts() if a.type == "image" and str(report) in str(a.data)]
    assert {a.key for a in found} == set(keys)
    assert len(images) >= 5


def _flat(path, prompts):
    import pandas as pd

    pd.DataFrame({"prompt": prompts, "answer": [str(k) for k in range(len(prompts))]}).to_parquet(path)
    return path


def test_skipped_rows_are_listed_in_bad_rows_parquet(tmp_path, capsys, random_checkpoints):
    """data.on_bad_rows=skip: the run starts without the bad rows and lists them (no engine needed)."""
    from coba_tasks.pipeline import run

    model, _ = random_checkpoints  # 64 positions, one token per character
    train = _flat(tmp_path / "train.parquet", ["1+1=", "9" * 900, " ", "2+2=", "1+1=", "3+3="])
    cfg = load_config(
        "configs/tiny-test.yaml",
        [f"model.path={model}", f"data.train={train}", "data.on_bad_rows=skip", "rollout.max_model_len=0"],
    )
    root = (tmp_path / "run").resolve()
    try:
        res = run.open_run(root, cfg, continuing=False)
    finally:
        run._RUNS.pop(str(root), None)
    assert res.prompts["prompt_text"].tolist() == ["1+1=", "2+2=", "3+3="]
    store = RunStore.open(root)
    assert store.read_run_table("prompts")["prompt_text"].tolist() == ["1+1=", "2+2=", "3+3="]
    bad = store.read_run_table("bad_rows")  # through the store: in the run-level manifest, hashed
    assert bad[["key", "file", "row", "column"]].values.tolist() == [
        ["data.train", str(train), 1, "prompt"],
        ["data.train", str(train), 2, "prompt"],
        ["data.train", str(train), 4, "prompt"],
    ]
    assert bad["message"].tolist()[0].startswith("prompt is 900 tokens; with rollout.max_tokens 8 it exceeds")
    assert "prompt is empty" in bad["message"][1] and "duplicates row 0" in bad["message"][2]
    assert f"skipped 3 bad rows of {train} (see bad_rows.parquet)" in capsys.readouterr().err
    assert store.run_manifest()["bad_rows"]["rows"] == 3


@pytest.mark.slow
def test_refused_dataset_leaves_no_run_directory(tmp_path, prefect_harness, random_checkpoints):
    """A prompt longer than the context stops the flow before anything is written; no run directory stays."""
    from coba_tasks.pipeline.data import DatasetError
    from flows.train import train_flow

    model, _ = random_checkpoints
    train = _flat(tmp_path / "train.parquet", ["1+1=", "9" * 900])
    cfg = load_config("configs/tiny-test.yaml", [f"model.path={model}", f"data.train={train}"])
    run_dir = tmp_path / "run"
    with pytest.raises(DatasetError, match=r"row 1, column prompt: prompt is 900 tokens"):
        train_flow(run_dir=str(run_dir), config=config_to_dict(cfg))
    assert not run_dir.exists()


@pytest.mark.slow
def test_keep_checkpoints_prunes_old_ones_and_a_resume_that_needs_one_says_so(
    tmp_path, prefect_harness, random_checkpoints, first_char_data
):
    from coba_tasks.pipeline.rerun import apply_rerun, plan_rerun
    from coba_tasks.pipeline.store import StoreError
    from flows.train import train_flow

    model, _ = random_checkpoints
    overrides = [f"model.path={model}", "data.train_prompts=6", "run.steps=3", "run.keep_checkpoints=1"]
    cfg = load_config("configs/tiny-test.yaml", [*overrides, *data_overrides(first_char_data)])
    run_dir = tmp_path / "run"
    train_flow(run_dir=str(run_dir), config=config_to_dict(cfg))
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["000003"]
    store = RunStore.open(run_dir)
    apply_rerun(store, plan_rerun(store, 1, Stage.UPDATE))  # its update continues from checkpoints/000001
    state = train_flow(run_dir=str(run_dir), resume=True, return_state=True)
    assert state.is_failed()
    with pytest.raises(StoreError, match=r"checkpoints/000001 is missing: step 1 continues from it"):
        state.result()
