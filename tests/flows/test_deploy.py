"""End to end on a real Prefect server: prefect.yaml's deployments, a process worker, a training run.

The commands of docs/workers.md, run as subprocesses: ``prefect server start`` (temporary
PREFECT_HOME, a free port), ``prefect work-pool create coba-process --type process``, ``prefect
deploy --all`` from the project directory, ``prefect worker start --pool coba-process`` (started in
another directory: the deployments' pull step moves each flow run to the project), then
``prefect deployment run`` of coba-train on a tiny config (by config_path, then as a JSON object
of its sections, the typed ``config`` parameter) and coba-eval on the first run's last checkpoint.
The server requires Prefect's API authentication (``PREFECT_SERVER_API_AUTH_STRING``) and every
client sends it (``PREFECT_API_AUTH_STRING``); a request without it is refused (401). Everything
the runs write lands in tmp_path. The server's, the worker's and every
command's output go to files in tmp_path; their tails are printed when something fails.
"""

from __future__ import annotations

import base64
import json
import os
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pandas as pd
import pytest
import yaml
from prefect_procs import (
    PREFECT,
    PROJECT,
    Processes,
    flow_run_id,
    flow_run_logs,
    free_port,
    prefect_env,
    start_server,
    wait_final,
    wait_healthy,
)

from coba_tasks.pipeline.store import STAGES, RunStore, Table
from flows.view import run_scope, run_title

GPU_DEPLOYMENT = "coba-train/coba-train-gpu"
WATCH_DEPLOYMENT = "coba-eval-watch/coba-eval-watch"
DEPLOYMENTS = (
    "coba-train/coba-train",
    GPU_DEPLOYMENT,
    "coba-bootstrap/coba-bootstrap",
    "coba-eval/coba-eval",
    WATCH_DEPLOYMENT,
)
AUTOMATION = "automations/no-signal.yaml"
JOB_ENV = {"PREFECT_LOGGING_EXTRA_LOGGERS": "coba_tasks", "VLLM_CPU_KVCACHE_SPACE": "1"}
SECRET = "sk-deploy-0123"  # the first line of a file a deployment's caller names as its config


def artifact_keys(client, run_id: uuid.UUID) -> set[str]:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    artifacts = client.read_artifacts(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])))
    return {a.key for a in artifacts if a.key}


def run_deployment(procs: Processes, deployment: str, **params: object) -> uuid.UUID:
    """``prefect deployment run DEPLOYMENT --param key=value ...``; the new flow run's id."""
    args = [f"{k}={json.dumps(v) if isinstance(v, dict | list) else v}" for k, v in params.items()]
    out = procs.run(
        f"run-{deployment.split('/')[0]}",
        [*PREFECT, "deployment", "run", deployment, *(x for a in args for x in ("--param", a))],
        PROJECT,
    )
    return flow_run_id(out)


def write_tiny_config(tmp_path: Path, model: Path) -> Path:
    """configs/tiny-test.yaml with the random model, 6 training prompts, 2 steps, absolute data paths."""
    cfg = yaml.safe_load((PROJECT / "configs" / "tiny-test.yaml").read_text())
    cfg.setdefault("model", {})["path"] = str(model)
    cfg.setdefault("run", {})["steps"] = 2
    cfg.setdefault("data", {}).update(
        train=str(PROJECT / "data" / "arith_train.parquet"),
        test=str(PROJECT / "data" / "arith_test.parquet"),
        train_prompts=6,
    )
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.slow
def test_deployments_run_on_a_process_worker(tmp_path: Path, random_checkpoints) -> None:
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    t_start = time.monotonic()
    model, _ = random_checkpoints  # made by conftest.make_random_checkpoint (seed 0)
    config_path = write_tiny_config(tmp_path, model)
    run_dir, eval_out = tmp_path / "run", tmp_path / "eval.parquet"
    worker_dir = tmp_path / "worker-cwd"
    worker_dir.mkdir()
    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    # a team server with Prefect's API authentication (docs/workers.md): the server takes the auth string,
    # every client (deploy, the worker, this test) sends it
    auth = "coba:test-secret"
    # the worker's flow runs may use this test's directory and the model's, besides the project (docs/workers.md)
    roots = os.pathsep.join([str(tmp_path), str(model.parent)])
    env = prefect_env(
        tmp_path / "prefect-home",
        url,
        PREFECT_SERVER_API_AUTH_STRING=auth,
        PREFECT_API_AUTH_STRING=auth,
        COBA_DEPLOYMENT_ROOTS=roots,
    )
    del env["PREFECT_LOGGING_EXTRA_LOGGERS"]  # a worker set up from docs/workers.md: prefect.yaml gives it
    procs = Processes(tmp_path, env)
    try:
        server = start_server(procs, "server", port, env, cwd=tmp_path)
        wait_healthy(url, server)
        t_server = time.monotonic()
        for header in (None, "Basic " + base64.b64encode(b"coba:wrong").decode()):  # no or wrong credentials
            request = urllib.request.Request(f"{url}/deployments/filter", data=b"{}", method="POST")
            request.add_header("Content-Type", "application/json")
            if header:
                request.add_header("Authorization", header)
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(request, timeout=10)
            assert refused.value.code == 401
        procs.run("work-pool-create", [*PREFECT, "work-pool", "create", "coba-process", "--type", "process"], PROJECT)
        procs.run("gpu-pool-create", [*PREFECT, "work-pool", "create", "coba-gpu", "--type", "process"], PROJECT)
        procs.run("deploy", [*PREFECT, "deploy", "--all", "--no-prompt"], PROJECT)
        t_deploy = time.monotonic()
        worker = procs.start("worker", [*PREFECT, "worker", "start", "--pool", "coba-process"], cwd=worker_dir)

        with temporary_settings(updates={PREFECT_API_URL: url, PREFECT_API_AUTH_STRING: auth}):
            from prefect.client.orchestration import get_client

            with get_client(sync_client=True) as client:
                for name in DEPLOYMENTS:
                    d = client.read_deployment_by_name(name)
                    pool = "coba-gpu" if name == GPU_DEPLOYMENT else "coba-process"
                    assert d.work_pool_name == pool, name
                    if name == WATCH_DEPLOYMENT:  # one schedule, every 30 minutes, off until a user turns it on
                        (schedule,) = d.schedules
                        assert not schedule.active and schedule.schedule.interval.total_seconds() == 1800
                    else:
                        assert not d.schedules, name
                    assert d.pull_steps == [
                        {"prefect.deployments.steps.set_working_directory": {"directory": str(PROJECT)}}
                    ], (name, d.pull_steps)
                    # the environment the flow runs need, from prefect.yaml (the worker's has neither)
                    assert d.job_variables == {"env": JOB_ENV}, (name, d.job_variables)
                # the GPU pool's training deployment runs one flow run at a time, a second one queued
                gpu = client.read_deployment_by_name(GPU_DEPLOYMENT)
                assert gpu.global_concurrency_limit is not None and gpu.global_concurrency_limit.limit == 1
                assert gpu.concurrency_options is not None
                assert gpu.concurrency_options.collision_strategy == "ENQUEUE"

                train_id = run_deployment(
                    procs, "coba-train/coba-train", config_path=config_path, run_name="deploy-test", run_dir=run_dir
                )
                run = wait_final(client, train_id, worker)
                assert run.state.is_completed(), f"coba-train ended {run.state_name}: {run.state.message}"
                t_train = time.monotonic()

                store = RunStore.open(run_dir)
                cfg = store.read_config()
                assert cfg["run"]["name"] == "deploy-test"
                m, g = cfg["data"]["prompts_per_step"], cfg["allocation"]["group_size"]
                for step in range(2):
                    manifest = store.manifest(step)
                    for name in (*STAGES, Table.HISTORY):
                        assert name in manifest, (step, name)
                        assert (run_dir / "steps" / f"{step:06d}" / f"{name}.parquet").is_file()
                        assert manifest[name]["rows"] == len(store.read_table(step, name))
                    budget = store.read_table(step, Table.BUDGET)
                    assert len(budget) == m and int(budget["budget"].sum()) == m * g
                    assert len(store.read_table(step, Table.ROLLOUTS)) == m * g
                assert store.is_done(0, Table.EVAL) and store.is_done(2, Table.EVAL)  # held-out, before and after
                assert (run_dir / "summary.json").is_file()
                assert (store.checkpoint_dir(2) / "config.json").is_file()
                assert not (PROJECT / "runs" / "deploy-test").exists()

                keys = artifact_keys(client, train_id)  # scoped to the run, named after it
                scope = run_scope(run_dir)
                assert {f"{scope}-{k}" for k in ("progress", "steps", "budget", "heldout", "report")} == keys, keys
                assert run.name == run_title(run_dir, "coba", 0), run.name

                # the config as a JSON object (the typed `config` parameter, validated by Prefect before the
                # flow starts), no config_path of its own: keys left out take config.py's defaults
                whole = yaml.safe_load(config_path.read_text())
                whole["run"].update(name="deploy-json", steps=1)
                whole["rollout"]["backend"] = "transformers"  # vLLM on a worker is the run above's
                json_dir = tmp_path / "run-json"
                # submitted together with the evaluation and the refused runs below, which the worker runs at once
                json_id = run_deployment(procs, "coba-train/coba-train", config=whole, run_dir=json_dir)
                eval_id = run_deployment(
                    procs,
                    "coba-eval/coba-eval",
                    model_path=store.checkpoint_dir(2),
                    settings={"eval_prompts": 10, "backend": "transformers"},
                    out_path=eval_out,
                )
                # what a caller of the API may not reach (docs/workers.md, "Who can reach the API"): a path
                # outside the project and the worker's roots, a file's text, a reward file the worker does not
                # allow; each flow run fails before it reads or writes anything, naming the parameter or key
                secret = tmp_path / "secret.env"
                secret.write_text(f"API_KEY={SECRET}\n")
                reward = tmp_path / "reward.py"
                reward.write_text("def compute_score(*args, **kwargs):\n    return 1.0\n")
                elsewhere = tmp_path.parent / f"{tmp_path.name}-elsewhere.parquet"
                checkpoint = store.checkpoint_dir(2)
                cases = [
                    ("config_path = /etc", "coba-train/coba-train", {"config_path": "/etc/passwd"}),
                    (f"config_path {secret}: ", "coba-train/coba-train", {"config_path": secret}),
                    (
                        "verify.reward_function = ",
                        "coba-train/coba-train",
                        {"config_path": config_path, "overrides": [f"verify.reward_function={reward}"]},
                    ),
                    ("out_path = ", "coba-eval/coba-eval", {"model_path": checkpoint, "out_path": elsewhere}),
                ]
                refused = {}  # submitted through the API (a `prefect deployment run` process each costs seconds)
                for i, (fragment, name, params) in enumerate(cases):
                    run_dir_param = {"run_dir": tmp_path / f"r{i}"} if name.startswith("coba-train") else {}
                    parameters = {
                        k: v if isinstance(v, list) else str(v) for k, v in {**params, **run_dir_param}.items()
                    }
                    deployment = client.read_deployment_by_name(name)
                    refused[client.create_flow_run_from_deployment(deployment.id, parameters=parameters).id] = fragment
                run = wait_final(client, json_id, worker)
                assert run.state.is_completed(), f"coba-train (config) ended {run.state_name}: {run.state.message}"
                json_cfg = RunStore.open(json_dir).read_config()
                assert json_cfg["run"]["name"] == "deploy-json" and json_cfg["run"]["steps"] == 1
                assert json_cfg["data"]["train_prompts"] == 6 and json_cfg["optim"]["lr"] == 1e-4  # file; default
                assert (json_dir / "summary.json").is_file()

                run = wait_final(client, eval_id, worker)
                assert run.state.is_completed(), f"coba-eval ended {run.state_name}: {run.state.message}"
                table = pd.read_parquet(eval_out)
                assert len(table) == 10 and (table["weight_version"] == 2).all()
                assert table["accuracy"].between(0, 1).all()
                assert artifact_keys(client, eval_id) == {"eval-run-step-000002"}

                for refused_id, fragment in refused.items():
                    run = wait_final(client, refused_id, worker)
                    assert run.state.is_failed(), f"{fragment!r}: ended {run.state_name}"
                    logs = flow_run_logs(client, refused_id, expect=fragment)
                    assert fragment in logs, logs[-2000:]
                    assert SECRET not in logs and "root:x:" not in logs, logs[-2000:]
                    assert "outside the project" in logs or "COBA_ALLOW_REWARD_FILES=1" in logs or "not shown" in logs
                assert not elsewhere.exists() and not any((tmp_path / f"r{i}").exists() for i in range(len(cases)))

                # the shipped automation on the no-signal event, created as docs/workers.md does, cancels a
                # run that learns nothing: this config's run has no mixed group at steps 0 and 1, so the event
                # comes at step 1 and the run (6 steps) is cancelled by the worker before it ends
                procs.run("automation", [*PREFECT, "automation", "create", "--from-file", AUTOMATION], PROJECT)
                (auto,) = client.read_automations_by_name("coba-rl cancels a run without signal")
                assert auto.enabled and auto.trigger.expect == {"coba.run.no-signal"}
                assert [a.type for a in auto.actions] == ["cancel-flow-run"]
                quiet_dir = tmp_path / "run-quiet"
                quiet_id = run_deployment(
                    procs,
                    "coba-train/coba-train",
                    config_path=config_path,
                    run_dir=quiet_dir,
                    overrides=["run.steps=6"],
                )
                run = wait_final(client, quiet_id, worker)
                assert run.state.is_cancelled(), f"the run without signal ended {run.state_name}: {run.state.message}"
                assert not (quiet_dir / "summary.json").exists() and RunStore.open(quiet_dir).is_done(1, Table.UPDATE)
        t_end = time.monotonic()
        print(
            f"server up {t_server - t_start:.0f} s, pool + deploy {t_deploy - t_server:.0f} s, "
            f"coba-train run {t_train - t_deploy:.0f} s, the other runs together {t_end - t_train:.0f} s"
        )
    except BaseException:
        print(procs.tails())
        raise
    finally:
        t_stop = time.monotonic()
        procs.stop_all()
        print(f"worker and server stopped in {time.monotonic() - t_stop:.0f} s")
