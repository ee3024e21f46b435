"""What a deployment's parameters may reach on a worker (coba_tasks.pipeline.deployment).

A deployment's parameters come from whoever reaches the Prefect API. A flow started from a deployment
keeps every path it receives inside the project (or the roots the worker names in COBA_DEPLOYMENT_ROOTS),
runs a reward file only where the worker's environment allows it (COBA_ALLOW_REWARD_FILES=1, as
COBA_ALLOW_REMOTE_CODE for a model's own code), and never quotes the text of a file it was pointed at in
an error. ``coba run`` (the user's own command) and the Python API are not limited to the project.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

from coba_tasks.pipeline import deployment, run
from coba_tasks.pipeline.config import PROJECT_ROOT, config_to_dict, load_config
from coba_tasks.pipeline.config_fields import ConfigError

REWARD = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n"
SECRET = "sk-SECRET-0123"


@pytest.fixture
def roots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, random_checkpoints) -> Path:
    """A worker that names ``tmp_path/root`` and the tests' model directory as roots besides the project."""
    root = tmp_path / "root"
    root.mkdir()
    model, _ = random_checkpoints
    monkeypatch.setenv(deployment.ROOTS_ENV, os.pathsep.join([str(root), str(model.parent)]))
    monkeypatch.delenv(deployment.REWARD_FILES_ENV, raising=False)
    return root


def _config(model: Path, *overrides: str) -> dict:
    return config_to_dict(load_config("configs/tiny-test.yaml", [f"model.path={model}", *overrides]))


def test_a_flow_runs_a_reward_file_only_where_its_process_allows_it(tmp_path, monkeypatch, random_checkpoints):
    """As model.trust_remote_code: a config that names a reward file is refused by the flow (a deployment's
    parameters, or the Python API) unless COBA_ALLOW_REWARD_FILES=1 in its environment; a new run and a
    resumed one alike."""
    monkeypatch.delenv(deployment.REWARD_FILES_ENV, raising=False)
    model, _ = random_checkpoints
    reward = tmp_path / "r.py"
    reward.write_text(REWARD)
    cfg = _config(model, f"verify.reward_function={reward}")
    with pytest.raises(ConfigError) as info:
        run.resolve_run(config=cfg, run_dir=str(tmp_path / "run"))
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"verify.reward_function = {reward}: this process does not run")
    assert "COBA_ALLOW_REWARD_FILES=1" in message
    assert not (tmp_path / "run").exists()

    monkeypatch.setenv(deployment.REWARD_FILES_ENV, "1")
    built, root, continuing = run.resolve_run(config=cfg, run_dir=str(tmp_path / "run"))
    assert not continuing and built.verify.reward_function == str(reward)
    run.close_run(run.open_run(root, built, continuing=False))
    monkeypatch.delenv(deployment.REWARD_FILES_ENV)
    with pytest.raises(ConfigError, match=r"^verify\.reward_function = .*COBA_ALLOW_REWARD_FILES=1"):
        run.resolve_run(run_dir=str(root), resume=True)


def test_a_deployment_keeps_every_path_inside_the_project_or_the_roots_its_worker_names(tmp_path, roots, monkeypatch):
    model = Path(os.environ[deployment.ROOTS_ENV].split(os.pathsep)[1]) / "a"
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(PROJECT_ROOT / "data" / "arith_train.parquet", outside / "train.parquet")
    (outside / "c.yaml").write_text("run:\n  steps: 1\n")
    (roots / "c.yaml").write_text(f"model:\n  path: {model}\n")
    (roots / "escape").symlink_to(outside)  # inside by its name, outside once resolved
    reward = roots / "r.py"
    reward.write_text(REWARD)
    monkeypatch.setenv(deployment.REWARD_FILES_ENV, "1")

    def refused(key: str, **kwargs) -> str:
        with pytest.raises(ConfigError) as info:
            run.resolve_run(deployment=True, **kwargs)
        message = str(info.value)
        assert "\n" not in message and message.startswith(f"{key} = "), message
        assert "outside the project" in message and deployment.ROOTS_ENV in message, message
        return message

    refused("config_path", config_path=str(outside / "c.yaml"), run_dir=str(roots / "run"))
    refused("config_path", config_path="/etc/passwd", run_dir=str(roots / "run"))
    refused("run_dir", config=_config(model), run_dir=str(outside / "run"))
    refused("run_dir", config=_config(model), run_dir="/")
    refused("run_dir", run_dir=str(outside), resume=True)  # before looking for a run there
    refused("data.train", config=_config(model, f"data.train={outside / 'train.parquet'}"), run_dir=str(roots / "r1"))
    escaped = roots / "escape" / "train.parquet"
    refused("data.test", config=_config(model, f"data.test={escaped}"), run_dir=str(roots / "r2"))
    message = refused("model.path", config=_config(outside), run_dir=str(roots / "run"))
    assert str(PROJECT_ROOT) in message and str(roots) in message  # where it may point
    refused("verify.reward_function", config=_config(model, f"verify.reward_function={outside / 'r.py'}"), run_dir=".")
    refused("run_dir", config_path=str(roots / "c.yaml"), run_dir=str(roots / "escape" / "run"))
    assert not (outside / "run").exists() and not (roots / "run").exists()

    # inside: the project's own files, the worker's roots; a relative path is from the project (the flow's cwd)
    cfg, root, continuing = run.resolve_run(
        config_path=str(roots / "c.yaml"),
        run_dir=str(roots / "run"),
        overrides=[f"verify.reward_function={reward}"],
        deployment=True,
    )
    assert root == (roots / "run").resolve() and not continuing and cfg.data.train == "data/arith_train.parquet"
    # the user's own command and the Python API are not limited to the project
    assert run.resolve_run(config=_config(model), run_dir=str(outside / "run"))[1] == (outside / "run").resolve()


@pytest.mark.parametrize(
    ("text", "where"),
    [
        (f"API_KEY={SECRET}\n", "expected a mapping of sections"),
        (f"{SECRET}: 1\n", "unknown section"),
        (f"run:\n  {SECRET}: 1\n", "unknown key of run"),
        (f"run:\n  steps: {SECRET}\n", "run.steps"),
        (f"run:\n  name: {SECRET}/x\n", "run.name"),
        (f"run: !{SECRET} x\n", ":1:6: invalid YAML"),
        (f"run:\n  name: [{SECRET}\n", ":3:1: invalid YAML"),
        (f"run:\n  name: '{SECRET}\n", "invalid YAML"),
        (b"\xff" + SECRET.encode(), "not UTF-8 text"),
    ],
)
def test_a_config_path_from_a_deployment_is_never_quoted_in_its_errors(tmp_path, roots, text, where):
    """The first line of a file (a key, a password) is not repeated in the error a deployment's caller reads,
    nor in an exception chained to it (its traceback goes to the flow run's logs)."""
    path = roots / "secret.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ConfigError) as info:
        run.resolve_run(config_path=str(path), run_dir=str(roots / "run"), deployment=True)
    message = str(info.value)
    assert SECRET not in message and "\n" not in message
    assert message.startswith(f"config_path {path}") and where in message, message
    assert "not shown" in message
    assert info.value.__cause__ is None and (info.value.__context__ is None or info.value.__suppress_context__)
    # the same file given by the user's own command is quoted as before (their file, their terminal)
    if "steps" in where:
        with pytest.raises(ConfigError, match=SECRET):
            run.resolve_run(config_path=str(path), run_dir=str(roots / "run"))


def test_a_deployments_own_overrides_are_quoted(tmp_path, roots):
    """What the caller sent (an override) is theirs to read back; only the file's text is withheld."""
    (roots / "c.yaml").write_text("run:\n  steps: 1\n")
    with pytest.raises(ConfigError, match=r"run\.steps: expected an integer, got 'many'"):
        run.resolve_run(
            config_path=str(roots / "c.yaml"), run_dir=str(roots / "run"), overrides=["run.steps=many"], deployment=True
        )


def test_paths_of_the_eval_and_bootstrap_flows(tmp_path, roots):
    """The checks the coba-eval and coba-bootstrap flows make of their parameters under a deployment."""
    model = Path(os.environ[deployment.ROOTS_ENV].split(os.pathsep)[1]) / "a"
    deployment.check_deployment_paths(
        {"model_path": model, "settings.test_path": "data/arith_test.parquet", "out_path": roots / "e.parquet"}
    )
    deployment.check_deployment_paths({"out_path": None})  # not given: nothing to check
    for key, value in (("out_path", tmp_path / "e.parquet"), ("out_dir", "../elsewhere"), ("train_path", "/etc")):
        with pytest.raises(ConfigError, match=rf"^{key} = {value}[ :].*outside the project"):
            deployment.check_deployment_paths({"model_path": model, key: value})


def test_a_deployments_outputs_stay_out_of_the_projects_own_files(tmp_path, roots):
    """coba-eval's out_path with overwrite=True passed both checks for flows/train.py, .git/HEAD, the venv and
    the shipped data: a deployment now writes only under the project's runs/ or a root its worker names."""
    for own in ("flows/train.py", ".git/HEAD", ".venv/bin/python", "data/arith_test.parquet", "pyproject.toml"):
        with pytest.raises(ConfigError, match=rf"^out_path = {own}[ :].*writes its outputs only under"):
            deployment.check_deployment_outputs({"out_path": own})
    with pytest.raises(ConfigError, match=r"writes its outputs only under"):
        deployment.check_deployment_outputs({"out_path": "runs/../flows/x.parquet"})
    deployment.check_deployment_outputs(
        {"out_path": PROJECT_ROOT / "runs" / "evals" / "e.parquet", "b": roots / "e.parquet", "c": None}
    )


def test_a_deployment_asks_no_more_of_its_worker_than_the_caps_it_allows(tmp_path, roots, monkeypatch):
    """verify.workers = 2000 (every process started at once), a million steps, 10,000 samples a held-out
    prompt: refused for a deployment's flow run before anything starts, in one line naming the key, the cap
    and the worker's variable that raises it; the user's own commands are not capped."""
    model = Path(os.environ[deployment.ROOTS_ENV].split(os.pathsep)[1]) / "a"
    run_dir = str(roots / "run")
    for key, value in (("verify.workers", 2000), ("run.steps", 1_000_000), ("run.eval_samples", 10_000)):
        config = _config(model, f"{key}={value}", "run.eval_temperature=1.0")
        with pytest.raises(ConfigError, match=rf"^{key} = {value}: above the cap of \d+ .*COBA_DEPLOYMENT_CAPS="):
            run.resolve_run(config=config, run_dir=run_dir, deployment=True)
        assert run.resolve_run(config=config, run_dir=run_dir)[2] is False  # `coba run`'s: not capped
    monkeypatch.setenv(deployment.CAPS_ENV, "verify.workers=4000, run.steps=2000000")
    assert run.resolve_run(config=_config(model, "verify.workers=2000"), run_dir=run_dir, deployment=True)[2] is False
    monkeypatch.setenv(deployment.CAPS_ENV, "verify.workers=lots")
    with pytest.raises(ConfigError, match=r"^COBA_DEPLOYMENT_CAPS: 'verify.workers=lots' is not <key>=<whole number>"):
        run.resolve_run(config=_config(model), run_dir=run_dir, deployment=True)
    assert not (roots / "run").exists()


TIMEOUTS = ("run.rollouts_timeout_s", "run.update_timeout_s", "run.eval_timeout_s")


def test_a_deployment_cannot_hold_its_worker_with_passes_ranks_lengths_or_timeouts(tmp_path, roots, monkeypatch):
    """optim.update_epochs, optim.mini_batches, model.lora_rank, rollout.max_model_len and verify.timeout_s went
    uncapped, and a task's timeout could be switched off (0 = none) or set to years: a deployment's flow run
    could hold the only coba-gpu slot for ever. Each is capped as verify.workers is; a timeout of 0 is refused
    to a deployment whatever the caps; the user's own commands are neither capped nor refused."""
    model = Path(os.environ[deployment.ROOTS_ENV].split(os.pathsep)[1]) / "a"
    run_dir = str(roots / "run")
    asks = (
        ("optim.update_epochs", 1000),
        ("optim.mini_batches", 100_000),
        ("model.lora_rank", 100_000),
        ("rollout.max_model_len", 10_000_000),
        ("verify.timeout_s", 1e6),
        *((key, 1e9) for key in TIMEOUTS),
    )
    for key, value in asks:
        config = _config(model, f"{key}={value}")
        with pytest.raises(ConfigError) as info:
            run.resolve_run(config=config, run_dir=run_dir, deployment=True)
        message = str(info.value)
        assert re.match(rf"{re.escape(key)} = [\d.e+]+: above the cap of \d+ ", message), message
        assert "\n" not in message
        assert f"{deployment.CAPS_ENV}={key}=<n>" in message
        assert run.resolve_run(config=config, run_dir=run_dir)[2] is False  # `coba run`'s: not capped
    for key in TIMEOUTS:
        config = _config(model, f"{key}=0")
        with pytest.raises(ConfigError) as info:
            run.resolve_run(config=config, run_dir=run_dir, deployment=True)
        message = str(info.value)
        assert message.startswith(f"{key} = 0.0: a deployment's flow run may not switch") and "\n" not in message
        assert run.resolve_run(config=config, run_dir=run_dir)[2] is False
    # a worker that can take more says so; a timeout stays on however high its cap
    monkeypatch.setenv(deployment.CAPS_ENV, "run.update_timeout_s=2000000000,optim.update_epochs=1000")
    config = _config(model, "run.update_timeout_s=1e9", "optim.update_epochs=1000")
    assert run.resolve_run(config=config, run_dir=run_dir, deployment=True)[2] is False
    with pytest.raises(ConfigError, match=r"^run\.update_timeout_s = 0\.0: a deployment's flow run may not switch"):
        run.resolve_run(config=_config(model, "run.update_timeout_s=0"), run_dir=run_dir, deployment=True)
    monkeypatch.setenv(deployment.CAPS_ENV, "run.eval_timeout_s=0")
    with pytest.raises(ConfigError, match=r"^COBA_DEPLOYMENT_CAPS: 'run\.eval_timeout_s=0': .*cannot be switched off"):
        run.resolve_run(config=_config(model), run_dir=run_dir, deployment=True)
    monkeypatch.delenv(deployment.CAPS_ENV)
    assert run.resolve_run(config=_config(model), run_dir=run_dir, deployment=True)[2] is False  # the defaults pass
    for path in sorted((PROJECT_ROOT / "configs").glob("*.yaml")):  # and every shipped config (the GPU ones too)
        deployment.check_deployment_limits(deployment.config_limits(load_config(path)))
    assert not (roots / "run").exists()


def test_a_deployments_run_directory_stays_out_of_the_projects_own_files(tmp_path, roots):
    """A coba-train deployment's run_dir was checked as an input (anywhere in the project): a run could be made
    inside .git/, .venv/, coba_tasks/ or data/. It is an output, as coba-eval's out_path: under the project's
    runs/ or a root its worker names, for a new run and a resumed one, before anything is read or written."""
    model = Path(os.environ[deployment.ROOTS_ENV].split(os.pathsep)[1]) / "a"
    for own in (".git/coba-run", ".venv/run", "coba_tasks/run", "data/run", "runs/../flows"):
        with pytest.raises(ConfigError) as info:
            run.resolve_run(config=_config(model), run_dir=own, deployment=True)
        message = str(info.value)
        assert "\n" not in message and message.startswith(f"run_dir = {own}"), message
        assert "writes its outputs only under" in message and deployment.ROOTS_ENV in message, message
        with pytest.raises(ConfigError, match=rf"^run_dir = {re.escape(own)}[ :].*writes its outputs only under"):
            run.resolve_run(run_dir=own, resume=True, deployment=True)
    assert not any((PROJECT_ROOT / p).exists() for p in (".git/coba-run", ".venv/run", "coba_tasks/run", "data/run"))
    # runs/<run_name> and the worker's roots are where a deployment's runs go; `coba run` goes anywhere
    root = run.resolve_run(config=_config(model), run_name="deployment-test", deployment=True)[1]
    assert root == (PROJECT_ROOT / "runs" / "deployment-test").resolve()
    root = run.resolve_run(config=_config(model), run_dir=str(roots / "run"), deployment=True)[1]
    assert root == (roots / "run").resolve()
    assert run.resolve_run(config=_config(model), run_dir="data/run")[1] == (PROJECT_ROOT / "data" / "run")


@pytest.mark.slow
def test_the_flows_check_their_parameters_under_a_deployment_only(tmp_path, roots, prefect_harness, monkeypatch):
    """started_by_deployment() is False in a flow called here, so nothing is limited; made True (as in a flow
    run a worker picked up from a deployment), each flow refuses a path outside before any work."""
    from prefect import flow

    from flows.bootstrap import bootstrap_flow
    from flows.eval import eval_flow
    from flows.train import train_flow

    @flow
    def probe() -> bool:
        return deployment.started_by_deployment()

    assert probe() is False and deployment.started_by_deployment() is False
    monkeypatch.setattr(deployment, "started_by_deployment", lambda: True)
    outside = tmp_path / "outside"
    model = Path(os.environ[deployment.ROOTS_ENV].split(os.pathsep)[1]) / "a"
    with pytest.raises(ConfigError, match=r"^out_path = .*outside the project"):
        eval_flow(str(model), out_path=str(outside / "e.parquet"))
    with pytest.raises(ConfigError, match=r"^run\.eval_samples = 1000: above the cap"):
        eval_flow(str(model), settings={"samples": 1000, "temperature": 1.0})
    with pytest.raises(ConfigError, match=r"^rollout\.max_model_len = 10000000: above the cap"):
        eval_flow(str(model), settings={"max_model_len": 10_000_000})
    code = (PROJECT_ROOT / "flows" / "train.py").read_bytes()
    with pytest.raises(ConfigError, match=r"^out_path = flows/train\.py[ :].*a deployment writes its outputs only"):
        eval_flow(str(model), out_path="flows/train.py", overwrite=True)
    assert (PROJECT_ROOT / "flows" / "train.py").read_bytes() == code
    with pytest.raises(ConfigError, match=r"^model_path = .*outside the project"):
        eval_flow(str(outside))
    with pytest.raises(ConfigError, match=r"^settings\.test_path = .*outside the project"):
        eval_flow(str(model), settings={"test_path": str(outside / "t.parquet")})
    with pytest.raises(ConfigError, match=r"^out_dir = .*outside the project"):
        bootstrap_flow(out_dir=str(outside / "m"))
    with pytest.raises(ConfigError, match=r"^train_path = .*outside the project"):
        bootstrap_flow(out_dir=str(roots / "m"), train_path=str(outside / "t.parquet"))
    with pytest.raises(ConfigError, match=r"^config_path = .*outside the project"):
        train_flow(config_path="/etc/passwd", run_dir=str(roots / "run"))
    with pytest.raises(ConfigError, match=r"^run_dir = .*outside the project"):
        train_flow(config=_config(model), run_dir=str(outside / "run"))
    assert not outside.exists() and not (roots / "m").exists() and not (roots / "run").exists()
