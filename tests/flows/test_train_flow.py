"""End to end: the coba-train flow through Prefect on a tiny config, with real vLLM on CPU.

The run trains the random tiny model on prompts scored by a reward it earns (tests/helpers_reward.py),
so its updates have something to learn from and move the weights (checked).
"""

from __future__ import annotations

import json
import math

import pytest
from helpers_reward import TEST_PROMPTS, assert_updates_moved, data_overrides, write_flat

from coba_tasks.pipeline.config import config_to_dict, load_config
from coba_tasks.pipeline.store import MANIFEST_FILE, STAGES, RunStore, Table


@pytest.mark.slow
def test_train_flow_writes_every_stage(tmp_path, prefect_harness, random_checkpoints, first_char_data):
    from flows.train import train_flow

    model, _ = random_checkpoints
    # a second held-out set: the same prompts worded otherwise, evaluated beside data.test
    reworded = write_flat(tmp_path / "reworded.parquet", [p.replace("=", " = ?") for p in TEST_PROMPTS])
    overrides = [f"model.path={model}", "data.train_prompts=6", "run.steps=3", *data_overrides(first_char_data)]
    cfg = load_config("configs/tiny-test.yaml", [*overrides, f"data.extra_tests=[{reworded}]"])
    run_dir = tmp_path / "run"
    summary = train_flow(run_dir=str(run_dir), config=config_to_dict(cfg))

    store = RunStore.open(run_dir)
    m, g = cfg.data.prompts_per_step, cfg.allocation.group_size
    for step in range(3):
        for name in (*STAGES, Table.HISTORY):
            assert store.is_done(step, name), (step, name)
            entry = store.manifest(step)[name]
            assert entry["rows"] == len(store.read_table(step, name)) and len(entry["sha256"]) == 64
        budget = store.read_table(step, Table.BUDGET)
        rollouts = store.read_table(step, Table.ROLLOUTS)
        rewards = store.read_table(step, Table.REWARDS)
        assert len(budget) == m and int(budget["budget"].sum()) == m * g
        assert budget["budget"].between(cfg.allocation.min_budget, cfg.allocation.max_budget).all()
        per_prompt = rollouts.groupby("prompt_id").size()
        assert per_prompt.to_dict() == dict(zip(budget["prompt_id"], budget["budget"], strict=True))
        assert (rollouts["weight_version"] == step).all()
        assert len(rewards) == len(rollouts) and set(rewards["verdict"]) <= {"correct", "wrong", "no_answer"}
        assert (rollouts["n_tokens"] == rollouts["token_ids"].apply(len)).all()
    # step t + 1 allocates its budget with the (alpha, beta) that step t's failure-rate stage computed,
    # and step 0 with the starting shape (kappa - 2, 2)
    first = store.read_table(0, Table.BUDGET)
    assert (first["alpha"] == cfg.allocation.kappa - 2).all() and (first["beta"] == 2.0).all()
    for step in range(2):
        cap = store.read_table(step, Table.CAPABILITY).iloc[0]
        nxt = store.read_table(step + 1, Table.BUDGET)
        assert (nxt["alpha"] == cap["alpha"]).all() and (nxt["beta"] == cap["beta"]).all(), step
    assert len({float(store.read_table(s, Table.CAPABILITY)["alpha"].iloc[0]) for s in range(3)}) > 1  # it moved
    # 6 prompts, 4 per step: step 2 revisits prompts seen at step 0, so its budget is not uniform by fallback
    assert store.read_table(0, Table.BUDGET)["fallback"].str.contains("unseen").all()
    assert not store.read_table(2, Table.BUDGET)["fallback"].str.contains("unseen").any()
    assert set(store.manifest(3)) == {Table.EVAL}  # after the last step only its evaluation (no step 3 to allocate)
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
    both = store.read_table(3, Table.EVAL)
    assert both["test_set"].value_counts().to_dict() == {
        "test": cfg.data.eval_prompts,
        "reworded": cfg.data.eval_prompts,
    }
    ev, other = both[both["test_set"] == "test"], both[both["test_set"] == "reworded"]
    assert ev["accuracy"].between(0, 1).all() and other["accuracy"].between(0, 1).all()
    assert ev["answered"].between(0, 1).all() and (ev["accuracy"] <= ev["answered"]).all()  # correct is answered
    assert saved["heldout_answered_after"] == pytest.approx(ev["answered"].mean())
    # the extra set: its own ids (flat files: a hash of each prompt), its own figures
    assert other["prompt_id"].str.startswith("reworded/").all() and not set(other["prompt_id"]) & set(ev["prompt_id"])
    extra = saved["heldout_test_sets"]["reworded"]
    assert extra["after"]["accuracy"] == pytest.approx(other["accuracy"].mean()) and extra["before"]["prompts"] == 10
    before = store.read_table(0, Table.EVAL)
    for name, rows in (("test", ev), ("reworded", other)):
        was = before[before["test_set"] == name].set_index("prompt_id")["accuracy"]
        diff = rows.set_index("prompt_id")["accuracy"] - was
        gain = saved["heldout_gain"][name]
        assert gain["gain"] == pytest.approx(diff.mean()) and gain["prompts"] == 10
        assert gain["se"] == pytest.approx(diff.std(ddof=1) / math.sqrt(10))
    timing = json.loads((run_dir / "steps/000001/timing.json").read_text())
    assert set(timing) == {"rollouts", "rewards", "capability", "budget", "update"}
    assert all(isinstance(v, float) and math.isfinite(v) and v >= 0 for v in timing.values()), timing
    # the report is drawn at the end
    report = run_dir / "report"
    assert (report / "index.html").is_file() and (report / "accuracy.png").stat().st_size > 5000
    assert not [c for c in store.read_table(0, Table.REWARDS).columns if c.endswith("_ms")]  # no timings in tables
    # what Prefect shows of the run, read back through its client (flows.view); then a retry of the finished run
    # (a resume): it computes and posts nothing and returns the run's summary
    flow_id = _flow_run_of(run_dir)
    assert train_flow(run_dir=str(run_dir), resume=True) == saved
    _check_prefect_view(run_dir, flow_id, cfg, store)
    # a run whose end was lost (no summary.json): its stages and evaluations are skipped, and say so
    (run_dir / "summary.json").unlink()
    train_flow(run_dir=str(run_dir), resume=True)
    _check_skipped(run_dir)
    _check_watch(run_dir, store)


def _check_watch(run_dir, store):
    """coba-eval-watch on the finished run: its newest checkpoint (3) was evaluated by the run itself, so the
    watch posts that table; a second watch does nothing; with checkpoint 3 gone the newest is 2, which the run
    did not evaluate: the watch evaluates it as the run does, on both held-out sets (a sample of 4 prompts of
    each), and writes nothing into the run."""
    import shutil

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from coba_tasks.readers.figures import heldout_rows
    from flows.eval import watch_flow
    from flows.view import run_scope

    first = watch_flow(run_dir=str(run_dir), return_state=True)  # its message: what it did
    assert first.message.startswith("checkpoints/000003: test avg@k ") and "steps/000003/eval.parquet" in first.message
    assert first.result()["rows"] == heldout_rows(store.read_table(3, Table.EVAL), 3)
    again = watch_flow(run_dir=str(run_dir), return_state=True)
    assert again.message == f"checkpoints/000003 of {run_dir} was evaluated by an earlier watch; nothing done"
    shutil.rmtree(store.checkpoint_dir(3))
    before = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*"))
    computed = watch_flow(run_dir=str(run_dir), eval_prompts=4, return_state=True)
    assert computed.message.endswith("(checkpoints/000002, evaluated now)"), computed.message
    rows = computed.result()["rows"]
    assert [(r["step"], r["test_set"], r["prompts"]) for r in rows] == [(2, "test", 4), (2, "reworded", 4)]
    assert all(0 <= r["avg_at_k"] <= 1 for r in rows)
    assert sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*")) == before  # nothing written in the run
    key = ArtifactFilter(key=ArtifactFilterKey(any_=[f"{run_scope(run_dir)}-watch"]))
    with get_client(sync_client=True) as client:
        versions = client.read_artifacts(artifact_filter=key)
    assert sorted(json.loads(a.data)[0]["step"] for a in versions) == [2, 3]


def _flow_run_of(run_dir):
    """The id of the newest flow run named after ``run_dir``."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
    from prefect.client.schemas.sorting import FlowRunSort

    from flows.view import run_title

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[run_title(run_dir, "coba", 0)])),
            sort=FlowRunSort.START_TIME_DESC,
        )
    assert runs, f"no flow run named {run_title(run_dir, 'coba', 0)}"
    return runs[0].id


def _check_prefect_view(run_dir, flow_id, cfg, store):
    import time

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterKey,
        FlowRunFilter,
        FlowRunFilterId,
        LogFilter,
        LogFilterFlowRunId,
    )
    from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter

    from coba_tasks.pipeline.config import config_hash
    from coba_tasks.readers.figures import heldout_rows, step_row
    from flows.view import run_scope

    scope = run_scope(run_dir)
    with get_client(sync_client=True) as client:
        # the flow run is named after the run (its directory, strategy and seed), not a random name, and tagged
        named = client.read_flow_run(flow_id)
        assert named.name.endswith("run (coba, seed 0)")
        assert {"strategy:coba", "seed:0", f"config:{config_hash(cfg)[:8]}"} <= set(named.tags), named.tags
        # named when Prefect created it: its first line already says so (no random name in any line of it)
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_id])))
        first_line = min(logs, key=lambda g: g.timestamp).message
        assert first_line == f"Beginning flow run {named.name!r} for flow 'coba-train'", first_line
        arts = client.read_artifacts(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_id])))
        # every key is scoped to the run: no run shares a collection with another
        keys = {a.key for a in arts if a.key}
        assert keys == {f"{scope}-{k}" for k in ("progress", "steps", "budget", "heldout", "report")}, keys
        by_key = {}
        for a in arts:
            by_key.setdefault(a.key, []).append(a)
        assert [a.data for a in by_key[f"{scope}-progress"]] == [100.0]  # updated in place, step by step
        (steps_table,) = by_key[f"{scope}-steps"]  # one artifact, updated after every step
        rows = json.loads(steps_table.data)
        assert rows == [step_row(store, s) for s in range(3)]  # one row per step, read from the tables
        assert {"pass_rate", "failure_rate", "alpha", "beta", "budget_min", "budget_mean", "budget_max"} <= set(rows[0])
        assert {"mixed_groups", "n_eff", "loss", "grad_norm", "seconds"} <= set(rows[0])
        assert len(by_key[f"{scope}-budget"]) == 3  # a version per step
        heldout = max(by_key[f"{scope}-heldout"], key=lambda a: a.created)  # a version per evaluation
        expected = [
            *heldout_rows(store.read_table(0, Table.EVAL), 0),
            *heldout_rows(store.read_table(3, Table.EVAL), 3),
        ]
        assert json.loads(heldout.data) == expected and {r["test_set"] for r in expected} == {"test", "reworded"}
        assert {"avg_at_k", "greedy", "pass_at_k", "k", "prompts"} <= set(expected[0])
        (report,) = by_key[f"{scope}-report"]
        assert report.data.count("](data:image/png;base64,") >= 5  # the plots inline: seen without a file server
        assert "file://" not in report.data
        # the retry: a new flow run of the same run, named after it, that ran no task and posted nothing
        later = _flow_run_of(run_dir)
        assert later != flow_id
        assert client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[later]))) == []
        first_tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_id])))
        wrote = {t.name: t.state.message for t in first_tasks}
        assert wrote["rollouts-step-1"].startswith("wrote steps/000001/rollouts.parquet (")
        every = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=sorted(keys))))
        assert sorted(a.flow_run_id for a in every) == [flow_id] * len(every)
        # events, for automations: a step event per step with its row, an evaluation event per evaluation
        resource = EventResourceFilter(id=[f"coba.run.{scope}"])
        for _ in range(60):  # the server stores events a moment after they arrive
            page = client.read_events(
                filter=EventFilter(event=EventNameFilter(prefix=["coba."]), resource=resource), limit=50
            )
            names = [e.event for e in page.events]
            if names.count("coba.step.finished") == 3 and names.count("coba.evaluation.finished") >= 2:
                break
            time.sleep(0.5)
    steps = sorted((e.payload for e in page.events if e.event == "coba.step.finished"), key=lambda p: p["step"])
    assert steps == rows
    evals = [e.payload for e in page.events if e.event == "coba.evaluation.finished"]
    assert sorted(p["step"] for p in evals) == [0, 3]  # each evaluation once: the retry emitted nothing
    assert "coba.run.no-signal" not in names  # every step of this run had a mixed group
    assert all(r["mixed_groups"] > 0 for r in rows)


def _check_skipped(run_dir):
    """The newest flow run of ``run_dir`` resumed a run whose end was lost: its evaluations were skipped, said in
    their tasks' states."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[_flow_run_of(run_dir)])))
    messages = {t.name: t.state.message for t in tasks}
    said = "already done: steps/000000/eval.parquet is in the step's manifest, not computed again"
    assert messages["eval-step-0"] == said
    assert messages["eval-step-3"].startswith("already done: steps/000003/eval.parquet")


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
    assert json.loads((store.root / MANIFEST_FILE).read_text())["entries"]["bad_rows"]["rows"] == 3


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
def test_keep_checkpoints_prunes_old_ones_and_a_rerun_past_a_pruned_one_replays_the_updates_before_it(
    tmp_path, prefect_harness, random_checkpoints, first_char_data
):
    from coba_tasks.pipeline.rerun import apply_rerun, plan_rerun
    from flows.train import train_flow

    model, _ = random_checkpoints
    # rollouts from transformers: the subject is the checkpoints, not the engine (an in-process vLLM engine's
    # start and close cost seconds a run)
    overrides = [f"model.path={model}", "data.train_prompts=6", "run.steps=3", "run.keep_checkpoints=1"]
    overrides.append("rollout.backend=transformers")
    cfg = load_config("configs/tiny-test.yaml", [*overrides, *data_overrides(first_char_data)])
    run_dir = tmp_path / "run"
    train_flow(run_dir=str(run_dir), config=config_to_dict(cfg))
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["000003"]
    store = RunStore.open(run_dir)
    tables = {s: dict(store.manifest(s)) for s in store.steps()}
    final = (store.checkpoint_dir(3) / "model.safetensors").read_bytes()
    # its update continues from checkpoints/000001, pruned: the resume replays the update of step 0 from the
    # base model, and the run ends as it did, every table and the last checkpoint bit for bit
    apply_rerun(store, plan_rerun(store, 1, Table.UPDATE))
    train_flow(run_dir=str(run_dir), resume=True)
    digests = {s: {n: e["sha256"] for n, e in store.manifest(s).items()} for s in store.steps()}
    assert digests == {s: {n: e["sha256"] for n, e in t.items()} for s, t in tables.items()}
    assert (store.checkpoint_dir(3) / "model.safetensors").read_bytes() == final
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["000003"]


def test_a_new_run_refuses_a_directory_that_holds_anything(tmp_path, random_checkpoints):
    """The Python API below the command line: resolve_run (before the run lock) and open_run (after it)."""
    from coba_tasks.pipeline import run
    from coba_tasks.pipeline.store import StoreError

    model, _ = random_checkpoints
    cfg = config_to_dict(load_config("configs/tiny-test.yaml", [f"model.path={model}"]))
    project = tmp_path / "project"
    project.mkdir()
    (project / "config.yaml").write_text("mine: true\n")
    with pytest.raises(StoreError, match=r"run directory .*project is not empty \(config\.yaml\) and holds no run"):
        run.resolve_run(config=cfg, run_dir=str(project))
    with pytest.raises(StoreError, match="is not empty"):
        run.open_run(project, load_config("configs/tiny-test.yaml", [f"model.path={model}"]), continuing=False)
    assert (project / "config.yaml").read_text() == "mine: true\n" and [p.name for p in project.iterdir()] == [
        "config.yaml"
    ]
    with pytest.raises(StoreError, match=r"run directory / is not empty"):
        run.resolve_run(config=cfg, run_dir="/")
    (tmp_path / "file").write_text("x")
    with pytest.raises(StoreError, match="exists and is not a directory"):
        run.resolve_run(config=cfg, run_dir=str(tmp_path / "file"))
    (tmp_path / "empty").mkdir()
    assert run.resolve_run(config=cfg, run_dir=str(tmp_path / "empty"))[2] is False  # an empty one is fine


@pytest.mark.slow
def test_the_train_flow_refuses_a_non_empty_run_dir_and_keeps_it(tmp_path, prefect_harness, random_checkpoints):
    """A coba-train deployment's run_dir parameter reaches the flow as it is: refused, nothing written there."""
    from coba_tasks.pipeline.store import StoreError
    from flows.train import train_flow

    model, _ = random_checkpoints
    cfg = config_to_dict(load_config("configs/tiny-test.yaml", [f"model.path={model}"]))
    project = tmp_path / "project"
    project.mkdir()
    (project / "notes.txt").write_text("keep me")
    with pytest.raises(StoreError, match="is not empty"):
        train_flow(run_dir=str(project), config=cfg)
    assert [p.name for p in project.iterdir()] == ["notes.txt"] and (project / "notes.txt").read_text() == "keep me"


def _opened(root, cfg):
    """A new run directory as open_run makes it (datasets checked, run.json written; no engine)."""
    from coba_tasks.pipeline import run

    try:
        return run.open_run(root, cfg, continuing=False)
    finally:
        run._RUNS.pop(str(root), None)


def test_a_continuing_run_refuses_inputs_that_changed(tmp_path, random_checkpoints, first_char_data):
    """run.json records the sha256 of data.train, data.test and model.path; a continuing run reads the last two
    again and refuses to go on when they changed, unless allowed (then it warns)."""
    import shutil

    from coba_tasks.engines.fileio import content_sha256
    from coba_tasks.pipeline import run
    from coba_tasks.pipeline.store import StoreError

    model = tmp_path / "model"
    shutil.copytree(random_checkpoints[0], model)
    test = tmp_path / "test.parquet"
    shutil.copy(first_char_data[1], test)
    cfg = load_config(
        "configs/tiny-test.yaml", [f"model.path={model}", f"data.train={first_char_data[0]}", f"data.test={test}"]
    )
    root = (tmp_path / "run").resolve()
    _opened(root, cfg)
    inputs = RunStore.open(root).run_info["inputs"]
    assert inputs["data.test"] == {"path": str(test), "sha256": content_sha256(test)}
    assert inputs["model.path"]["sha256"] == content_sha256(model) and set(inputs) == {
        "data.train",
        "data.test",
        "model.path",
    }
    warnings: list[str] = []
    try:
        run.open_run(root, cfg, continuing=True, warn=warnings.append)  # unchanged: goes on, says nothing
        assert warnings == []
        import pandas as pd

        frame = pd.read_parquet(test)
        frame.loc[0, "prompt"] = "99+1="  # one held-out prompt edited
        frame.to_parquet(test)
        with pytest.raises(StoreError, match=r"data\.test \(.*test\.parquet\) is not what the run started with"):
            run.open_run(root, cfg, continuing=True)
        run.open_run(root, cfg, continuing=True, warn=warnings.append, allow_changed_inputs=True)
        assert len(warnings) == 1 and "continuing as asked" in warnings[0]
        shutil.copy(first_char_data[1], test)  # restored: accepted again
        (model / "generation_config.json").write_text("{}")  # a file of the model changed
        with pytest.raises(StoreError, match=r"model\.path .* --allow-changed-inputs"):
            run.open_run(root, cfg, continuing=True)
    finally:
        run._RUNS.pop(str(root), None)


@pytest.mark.slow
def test_coba_resume_names_a_damaged_config_or_changed_input_in_one_line(
    tmp_path, capsys, prefect_harness, random_checkpoints, first_char_data
):
    import shutil

    from coba_tasks.commands.cli import main

    test = tmp_path / "test.parquet"
    shutil.copy(first_char_data[1], test)
    model, _ = random_checkpoints
    cfg = load_config(
        "configs/tiny-test.yaml", [f"model.path={model}", f"data.train={first_char_data[0]}", f"data.test={test}"]
    )
    root = (tmp_path / "run").resolve()
    _opened(root, cfg)
    test.write_bytes(test.read_bytes()[:-1] + b"\x00")  # the held-out file changed under the run
    assert main(["resume", "--run-dir", str(root)]) == 2
    err = capsys.readouterr().err
    assert "error: data.test" in err and "coba resume --allow-changed-inputs" in err and err.count("\n") == 1

    config = root / "config.yaml"
    config.write_text(config.read_text().replace("run:", "run: [", 1))  # a damaged YAML file
    assert main(["resume", "--run-dir", str(root)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {config}: damaged, not valid YAML at line ") and err.count("\n") == 1
    assert "Traceback" not in err
    config.write_text("run:\n  steps: zero\n")  # valid YAML, invalid config
    assert main(["resume", "--run-dir", str(root)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {config}: run.steps: expected an integer") and err.count("\n") == 1


def test_remote_code_needs_the_permission_of_the_process_that_runs_it(
    tmp_path, monkeypatch, capsys, random_checkpoints
):
    """model.trust_remote_code arriving in a flow's parameters is refused unless the worker's environment allows
    it; `coba resume` of a run whose config sets it asks for --trust-remote-code."""
    from coba_tasks.commands.cli import main
    from coba_tasks.pipeline import run
    from coba_tasks.pipeline.config_fields import ConfigError

    model, _ = random_checkpoints
    monkeypatch.delenv(run.REMOTE_CODE_ENV, raising=False)
    cfg = load_config("configs/tiny-test.yaml", [f"model.path={model}", "model.trust_remote_code=true"])
    with pytest.raises(ConfigError, match=r"model\.trust_remote_code = true: .*set COBA_ALLOW_REMOTE_CODE=1"):
        run.resolve_run(config=config_to_dict(cfg), run_dir=str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()
    monkeypatch.setenv(run.REMOTE_CODE_ENV, "1")  # a worker started with the permission
    assert run.resolve_run(config=config_to_dict(cfg), run_dir=str(tmp_path / "run"))[2] is False
    root = (tmp_path / "run").resolve()
    _opened(root, cfg)

    monkeypatch.delenv(run.REMOTE_CODE_ENV)
    assert main(["resume", "--run-dir", str(root)]) == 2
    err = capsys.readouterr().err
    assert "sets model.trust_remote_code" in err and "--trust-remote-code" in err and err.count("\n") == 1
    with pytest.raises(ConfigError, match="COBA_ALLOW_REMOTE_CODE"):  # the flow itself refuses it too
        run.resolve_run(run_dir=str(root), resume=True)

    import flows.train

    seen = {}

    def fake_flow(**kwargs):
        seen["env"] = run.os.environ.get(run.REMOTE_CODE_ENV)
        run.resolve_run(run_dir=kwargs["run_dir"], resume=True)  # what the flow does first: allowed now
        raise ValueError("stop here")

    monkeypatch.setattr(flows.train, "train_flow", fake_flow)
    assert main(["resume", "--run-dir", str(root), "--trust-remote-code"]) == 2
    assert seen["env"] == "1" and "stop here" in capsys.readouterr().err


@pytest.mark.slow
def test_released_mode_runs_through_a_run(tmp_path, prefect_harness, random_checkpoints, first_char_data):
    """allocation.mode=released end to end: every budget is the released code's allocation of its step's pass
    rates and (alpha, beta), with the released prompt groups."""
    import numpy as np

    from coba_tasks.pipeline.stages import section_allocation
    from flows.train import train_flow

    model, _ = random_checkpoints
    overrides = [f"model.path={model}", "data.train_prompts=6", "run.steps=3", "allocation.mode=released"]
    overrides.append("rollout.backend=transformers")  # the subject is the allocation, not the engine
    cfg = load_config("configs/tiny-test.yaml", [*overrides, *data_overrides(first_char_data)])
    run_dir = tmp_path / "run"
    train_flow(run_dir=str(run_dir), config=config_to_dict(cfg))
    store = RunStore.open(run_dir)
    assert store.read_config()["allocation"]["mode"] == "released"
    a = cfg.allocation
    assert a.mode == "released"
    revisited = 0
    for step in range(3):
        b = store.read_table(step, Table.BUDGET)
        est = b["pass_rate_est"].to_numpy(dtype=np.float64)
        plan = section_allocation(est, a, alpha=float(b["alpha"].iloc[0]), beta=float(b["beta"].iloc[0]))
        assert b["budget"].tolist() == plan.budgets.tolist(), step
        assert int(b["budget"].sum()) == len(b) * a.group_size
        if not np.isnan(est).all():  # a step with pass rates: the released code's groups, not the paper's "all"
            revisited += 1
            assert set(b["group"]) <= {"very_hard", "explore", "very_easy"} and "all" not in set(b["group"]), step
    assert revisited >= 1
    assert_updates_moved(store, model, 3)


@pytest.mark.slow
def test_a_run_with_the_rollout_correction_reports_its_ratios(
    tmp_path, prefect_harness, random_checkpoints, first_char_data
):
    """optim.rollout_correction=token with a mask threshold: the run trains and its update table has the ratio
    statistics; on CPU in float32 the sampler and the trainer agree to ~1e-5, so every ratio is ~1.

    The same run weighs each prompt the same (optim.prompt_weighting=equal; its weights multiply the rollout
    correction's): the setting reaches the update, and the update table says so: effective_prompts is the
    number of the step's prompts whose rewards are not all equal (each weighs 1/M; the others carry no
    gradient)."""
    from flows.train import train_flow

    model, _ = random_checkpoints
    overrides = [f"model.path={model}", "data.train_prompts=6", "run.steps=2", *data_overrides(first_char_data)]
    extra = ["optim.rollout_correction=token", "optim.rollout_correction_cap=2.0", "optim.rollout_mask_threshold=5"]
    cfg = load_config("configs/tiny-test.yaml", [*overrides, *extra, "optim.prompt_weighting=equal"])
    run_dir = tmp_path / "run"
    train_flow(run_dir=str(run_dir), config=config_to_dict(cfg))
    store = RunStore.open(run_dir)
    for step in range(2):
        update = store.read_table(step, Table.UPDATE).iloc[0]
        assert abs(update["is_ratio_mean"] - 1) < 1e-3 and update["is_ratio_max"] < 1.01, step
        assert update["is_clipped_frac"] == 0.0 and update["is_masked_frac"] == 0.0, step
        assert math.isfinite(update["loss"]) and update["grad_norm"] > 0, step
        rewards = store.read_table(step, Table.REWARDS)
        mixed = int((rewards.groupby("prompt_id")["reward"].nunique() > 1).sum())
        assert update["prompt_weighting"] == "equal" and mixed > 0, step
        assert update["effective_prompts"] == pytest.approx(mixed, rel=1e-12), step


def test_the_step_line_warns_when_no_group_has_been_mixed_for_several_steps():
    from flows.train import step_line

    figures = {
        "rollouts": {"rollouts": 64},
        "rewards": {"correct": 0, "wrong": 64, "no_answer": 0, "timeout": 0, "error": 0},
        "capability": {"S": 0.0, "F": 1.0, "alpha": 9.0, "beta": 2.0},
        "budget": {"min": 4, "max": 4, "mean": 4.0},
        "update": {"loss": 0.0, "grad_norm": 0.0},
    }
    plain = step_line(0, 2, figures, {}, 10.0, no_signal=1)
    assert plain.endswith("; no group mixed (1 step in a row)")
    warned = step_line(1, 2, figures, {}, 10.0, no_signal=2)
    assert "no group has had a non-zero advantage for 2 steps in a row" in warned
    assert "nothing is learned" in warned and "data.difficulties" in warned
    assert "no group" not in step_line(1, 2, figures, {}, 10.0)
    assert "; budgets 4-4 (mean 4.0); " in plain
    # allocation.estimator=pilot: the budgets are the step's own, allocated after a pilot of k each
    assert "; budgets 4-4 (mean 4.0, a pilot of 2 each); " in step_line(0, 2, figures, {}, 10.0, pilot=2)
    counts = {"rollouts_generated": 128, "rollouts_trained": 96, "rollouts_generated_total": 1408}
    assert "; 1,408 rollouts so far;" in step_line(0, 40, figures, {}, 10.0, counts=counts)
    ended_by_rollouts = step_line(10, 40, figures, {}, 10.0, counts={**counts, "rollout_budget": 1536})
    assert (
        ended_by_rollouts.startswith("step 10 (11 of at most 40): ")
        and "; 1,408 of the run's 1,536 rollouts so far;" in ended_by_rollouts
    )


@pytest.mark.slow
def test_a_run_that_can_learn_nothing_says_so(tmp_path, prefect_harness, random_checkpoints, monkeypatch):
    """The random tiny model never answers arithmetic: every group scores 0, every advantage is 0. The step
    lines say so (a warning from the second such step on, naming what to change) and so does the summary."""
    import logging

    import flows.train as train

    lines: list[tuple[int, str]] = []

    class Recording(logging.LoggerAdapter):
        def log(self, level, msg, *args, **kwargs):
            lines.append((level, str(msg)))

    real = train.get_run_logger
    monkeypatch.setattr(train, "get_run_logger", lambda: Recording(real().logger, {}))
    model, _ = random_checkpoints
    overrides = [f"model.path={model}", "data.train_prompts=8", "data.eval_prompts=2", "run.steps=2"]
    cfg = load_config("configs/tiny-test.yaml", [*overrides, "rollout.backend=transformers"])  # not the engine's
    summary = train.train_flow(run_dir=str(tmp_path / "run"), config=config_to_dict(cfg))

    assert summary["steps_without_signal"] == [0, 1]
    steps = [(level, text) for level, text in lines if text.startswith("step ")]
    assert [level for level, _ in steps] == [logging.INFO, logging.WARNING]
    assert steps[0][1].endswith("; no group mixed (1 step in a row)")
    assert "no group has had a non-zero advantage for 2 steps in a row" in steps[1][1]
    from coba_tasks.readers.figures import run_summary
    from coba_tasks.readers.text import summary_rows

    assert dict(summary_rows(run_summary(tmp_path / "run")))["no signal"].startswith("steps 0-1 (2 of 2, 2 in a row)")


def test_a_stage_past_its_timeout_fails_the_flow_run_instead_of_hanging(tmp_path, prefect_harness, random_checkpoints):
    """run.eval_timeout_s: the held-out evaluation before step 0 given 0.05 s fails (after its one retry), and
    so does the flow run, with nothing written for that evaluation; every long task carries its limit."""
    from prefect.task_engine import TaskRunTimeoutError

    from coba_tasks.pipeline.evaluation import evaluate_step
    from coba_tasks.pipeline.stages import limited, stage_tasks
    from flows.train import train_flow

    model, _ = random_checkpoints
    cfg = load_config(
        "configs/tiny-test.yaml", [f"model.path={model}", "run.eval_timeout_s=0.05", "run.update_timeout_s=0"]
    )
    limits = {name: t.timeout_seconds for name, t in stage_tasks(cfg).items()}
    sampling = {"round": 21600.0, "rollouts": 21600.0}  # every stage that samples
    assert limits == {name: sampling.get(name) for name in Table if name not in (Table.HISTORY, Table.EVAL)}
    assert limited(evaluate_step, cfg).timeout_seconds == 0.05 and evaluate_step.timeout_seconds is None
    run_dir = tmp_path / "run"
    with pytest.raises(TaskRunTimeoutError):
        train_flow(run_dir=str(run_dir), config=config_to_dict(cfg))
    assert not RunStore.open(run_dir).is_done(0, Table.EVAL)
    # the failure is an event of the run (automations/run-failed.yaml tells someone): its error, how to go on
    import time

    from prefect.client.orchestration import get_client
    from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter

    from flows.view import FAILED_EVENT, run_scope

    found = EventFilter(
        event=EventNameFilter(name=[FAILED_EVENT]), resource=EventResourceFilter(id=[f"coba.run.{run_scope(run_dir)}"])
    )
    for _ in range(60):  # the server stores events a moment after they arrive
        with get_client(sync_client=True) as client:
            events = client.read_events(filter=found, limit=10).events
        if events:
            break
        time.sleep(0.5)
    (event,) = events
    assert event.payload["error"].startswith("TaskRunTimeoutError: ")
    assert event.payload["resume"] == f"coba resume --run-dir {run_dir.resolve()}"
