"""What the commands print: the libraries' chatter down to errors unless asked for, restored afterwards."""

from __future__ import annotations

import os
import warnings

from coba_tasks.commands.cli import build_parser
from coba_tasks.commands.console import QUIET_ENV, quiet_libraries, verbose_requested


def test_quiet_sets_what_the_user_did_not_and_restores_the_environment(monkeypatch):
    for key in QUIET_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "INFO")  # the user's own choice wins
    with quiet_libraries() as applied:
        assert os.environ["VLLM_LOGGING_LEVEL"] == "INFO" and "VLLM_LOGGING_LEVEL" not in applied
        assert os.environ["PREFECT_LOGGING_LOGGERS_PREFECT_TASK_RUNS_LEVEL"] == "WARNING"
        assert os.environ["PREFECT_LOGGING_LOGGERS_PREFECT_FLOW_RUNS_LEVEL"] == "INFO"  # the progress lines stay
        with warnings.catch_warnings(record=True) as seen:
            warnings.warn_explicit("old", FutureWarning, "x.py", 1, module="vllm.triton_utils.dispatcher")
            warnings.warn_explicit("ours", FutureWarning, "x.py", 1, module="coba_tasks.pipeline.run")
        assert [str(w.message) for w in seen] == ["ours"]
    assert os.environ["VLLM_LOGGING_LEVEL"] == "INFO"
    assert not [k for k in QUIET_ENV if k != "VLLM_LOGGING_LEVEL" and k in os.environ]
    with quiet_libraries(enabled=False) as applied:
        assert applied == {} and "TORCH_CPP_LOG_LEVEL" not in os.environ


def test_verbose_flag_and_variable(monkeypatch):
    monkeypatch.delenv("COBA_VERBOSE", raising=False)
    parser = build_parser()
    for command in (["run"], ["resume", "--run-dir", "x"], ["compare"]):
        assert parser.parse_args([*command, "--verbose"]).verbose is True
        assert parser.parse_args(command).verbose is False
    assert not verbose_requested() and verbose_requested(True)
    monkeypatch.setenv("COBA_VERBOSE", "1")
    assert verbose_requested()
