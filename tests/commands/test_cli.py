"""The ``coba`` command line: help, the demo, errors as messages."""

import json

import pandas as pd
import pytest

from coba_tasks.commands.cli import build_parser, main
from coba_tasks.commands.demo import DemoConfig, simulate
from coba_tasks.pipeline.config import PROJECT_ROOT

DATA = PROJECT_ROOT / "data"
TINY_DEMO = PROJECT_ROOT / "configs" / "demo-tiny.yaml"  # the tiny task: these tests use its data and sizes


def test_help_has_examples(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "examples:" in out and "coba bench allocate" in out
    for sub in (["demo", "--help"], ["bench", "allocate", "--help"]):
        with pytest.raises(SystemExit):
            main(sub)
        assert "examples:" in capsys.readouterr().out


LIBRARIES = ("torch", "transformers", "peft", "vllm", "prefect", "pandas", "numpy", "scipy", "pyarrow", "matplotlib")


def test_the_parser_and_every_help_load_no_library_of_the_work():
    """``coba --help`` and each command's help answer at once: building the parser imports none of the libraries
    the commands run on (torch alone cost about 10 s of CPU there), only the command's handler does."""
    import subprocess
    import sys

    helps = [["--help"], *([name, "--help"] for name in build_parser()._subparsers._group_actions[0].choices)]
    code = (
        "import sys, contextlib, io\n"
        "from coba_tasks.commands.cli import main\n"
        f"for argv in {helps!r}:\n"
        "    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        "        main(argv)\n"
        f"print(sorted(m for m in {LIBRARIES!r} if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=PROJECT_ROOT)
    assert len(helps) > 10 and out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr


def test_bad_argument_is_a_message(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--steps", "0"])
    assert exc.value.code == 2
    assert "must be a positive integer" in capsys.readouterr().err


def test_demo_shows_exploit_then_explore(capsys):
    assert main(["demo", "--steps", "12"]) == 0
    out = capsys.readouterr().out
    assert "exploit" in out and "explore" in out
    lines = [ln.split() for ln in out.splitlines() if ln.strip()[:1].isdigit()]
    assert len(lines) == 12


def test_demo_figures():
    rows = simulate(DemoConfig(steps=12, prompts=100), emit=lambda s: None)["steps"]
    assert rows[0]["budget_by_level"] == [16.0] * 5  # first step: uniform
    early = rows[1]["budget_by_level"]
    late = rows[-1]["budget_by_level"]
    assert early[0] == max(early)  # exploit: the easiest level gets the most
    assert late[4] > late[0]  # explore: hard prompts get more than easy ones
    assert rows[-1]["alpha"] < rows[1]["alpha"]  # alpha falls as the failure rate falls


def test_bench_json(capsys, monkeypatch):
    import coba_tasks.bench.solvers_bench as bench

    monkeypatch.setattr(bench, "SWEEP_M", (512,))
    assert main(["bench", "allocate", "--quick", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["benchmark"] == "allocate" and result["sweep"][0]["M"] == 512


def test_parser_requires_a_command():
    with pytest.raises(SystemExit):
        build_parser().parse_args([])


def test_run_refuses_bad_input_before_writing(tmp_path, capsys, random_checkpoints):
    model, _ = random_checkpoints
    bad = tmp_path / "bad.parquet"
    bad.write_text("not parquet")
    run_dir = tmp_path / "run"
    rc = main(["run", "--dataset", str(bad), "--run-dir", str(run_dir), "--set", f"model.path={model}"])
    assert rc == 2 and not run_dir.exists()
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "bad.parquet" in err and "Traceback" not in err
    rc = main(["run", "--run-dir", str(run_dir), "--set", "optim.lrr=1"])
    assert rc == 2 and not run_dir.exists()
    assert "optim.lrr" in capsys.readouterr().err
    rc = main(["run", "--run-dir", str(run_dir), "--set", "model.path=/nonexistent/model"])
    assert rc == 2 and not run_dir.exists()
    err = capsys.readouterr().err
    assert "model.path: /nonexistent/model" in err and err.count("\n") == 1


def test_run_refuses_a_run_dir_that_is_not_empty(tmp_path, capsys, random_checkpoints):
    model, _ = random_checkpoints
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("mine\n")
    rc = main(["run", "--run-dir", str(run_dir), "--set", f"model.path={model}"])
    err = capsys.readouterr().err
    assert rc == 2 and "already exists; pick another --run-dir" in err and err.count("\n") == 1
    assert [p.name for p in run_dir.iterdir()] == ["config.yaml"] and (run_dir / "config.yaml").read_text() == "mine\n"


@pytest.mark.parametrize("under", ["", "sub"])
def test_a_run_dir_that_is_a_file_is_refused_in_one_line_and_left_as_it_was(
    tmp_path, capsys, random_checkpoints, under
):
    model, _ = random_checkpoints
    mine = tmp_path / "notes.txt"
    mine.write_text("mine\n")
    rc = main(["run", "--run-dir", str(mine / under), "--set", f"model.path={model}"])
    err = capsys.readouterr().err
    assert rc == 2 and f"{mine} is a file, not a directory" in err and err.count("\n") == 1, err
    assert mine.read_text() == "mine\n"


@pytest.mark.parametrize(
    ("overrides", "key", "fragment"),
    [
        (["optim.lrr=1"], "optim.lrr", "valid keys of optim"),
        (["optim.lr=fast"], "optim.lr", "expected a number"),
        (["run.steps=2.5"], "run.steps", "expected an integer"),
        (["allocation.min_budget=1"], "allocation.min_budget", "must be >= 2"),
        (["allocation.max_budget=1"], "allocation.max_budget", "must be >= allocation.min_budget (2)"),
        (["allocation.group_size=200"], "allocation.group_size", "(needs 256 <= B_total <= 16384)"),
        (["allocation.group_size=1"], "allocation.group_size", "set group_size between 2 and 128"),
        (["run.name=../escape"], "run.name", "one path component"),
        (["run.name=/tmp/escape"], "run.name", "one path component"),
        (["run.name=a/b"], "run.name", "one path component"),
        (["data.on_bad_rows=ignore"], "data.on_bad_rows", "must be error"),
        (
            [
                f"data.train={DATA / 'arith_train.parquet'}",
                f"data.test={DATA / 'arith_test.parquet'}",
                "model.path=/no/m",
            ],
            "model.path",
            "model.path: /no/m does not exist",
        ),
    ],
)
def test_run_with_a_bad_config_is_one_line_naming_the_key(tmp_path, monkeypatch, capsys, overrides, key, fragment):
    monkeypatch.chdir(tmp_path)  # runs/<name> would be created here
    args = ["run", "--config", str(TINY_DEMO)] + [a for o in overrides for a in ("--set", o)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert key in err and fragment in err and "Traceback" not in err
    assert not (tmp_path / "runs").exists() and not any(tmp_path.iterdir())


def _flat(path, prompts):
    pd.DataFrame({"prompt": prompts, "answer": [str(k) for k in range(len(prompts))]}).to_parquet(path)
    return path


def test_run_refuses_a_prompt_longer_than_the_context(tmp_path, capsys, random_checkpoints):
    model, _ = random_checkpoints  # max_position_embeddings 64, one token per character
    train = _flat(tmp_path / "long.parquet", ["1+1=", "9" * 900, "2+2="])
    run_dir = tmp_path / "run"
    common = ["run", "--config", str(TINY_DEMO), "--dataset", str(train), "--run-dir", str(run_dir)]
    common += ["--set", f"model.path={model}"]
    assert main([*common, "--set", "rollout.max_model_len=0"]) == 2
    err = capsys.readouterr().err
    assert f"{train}: row 1, column prompt: prompt is 900 tokens; with rollout.max_tokens 12 it exceeds" in err
    assert "context of 64 tokens (the model's max_position_embeddings" in err
    assert "Traceback" not in err and not run_dir.exists()
    assert main([*common, "--set", "rollout.max_model_len=40"]) == 2
    assert "context of 40 tokens (rollout.max_model_len)" in capsys.readouterr().err and not run_dir.exists()


def test_run_with_skip_still_refuses_a_dataset_with_no_good_row(tmp_path, capsys, random_checkpoints):
    model, _ = random_checkpoints
    train = _flat(tmp_path / "bad.parquet", ["9" * 900, " "])
    run_dir = tmp_path / "run"
    args = ["run", "--config", str(TINY_DEMO), "--dataset", str(train), "--run-dir", str(run_dir)]
    args += ["--set", f"model.path={model}"]
    assert main([*args, "--set", "data.on_bad_rows=skip"]) == 2
    err = capsys.readouterr().err
    assert "every one of the 2 rows is bad" in err and f"{train}: row 1, column prompt: prompt is empty" in err
    assert not run_dir.exists()


def test_setup_server_needs_a_server_and_a_sane_crash_after(capsys, monkeypatch):
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    assert main(["setup-server"]) == 2
    assert "no Prefect server: pass --api-url" in capsys.readouterr().err
    # checked before any connection is made (nothing listens on this port)
    assert main(["setup-server", "--api-url", "http://127.0.0.1:9/api", "--crash-after", "30"]) == 2
    assert "--crash-after must be longer than a heartbeat interval (at least 30 s), got 30" in capsys.readouterr().err


def test_bootstrap_if_missing_builds_only_the_default_tiny_model(tmp_path, capsys):
    """A mistyped model.path with --bootstrap-if-missing is refused in one line naming the path: a fresh tiny
    model is built only at the default path (models/arith-tiny), never under the name of a missing model."""
    typo = tmp_path / "models" / "smollm2-135m-instrct"
    run_dir = tmp_path / "run"
    rc = main(["run", "--bootstrap-if-missing", "--run-dir", str(run_dir), "--set", f"model.path={typo}"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1
    assert f"model.path {typo} is missing" in err and "only the default tiny model (models/arith-tiny)" in err
    assert not typo.exists() and not (tmp_path / "models").exists() and not run_dir.exists()
