"""The ``coba`` command line: help, the demo, errors as messages."""

import json

import pytest

from coba_tasks.cli import build_parser, main
from coba_tasks.demo import DemoConfig, simulate


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
    import coba_tasks.bench as bench

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
    assert "/nonexistent/model" in capsys.readouterr().err
