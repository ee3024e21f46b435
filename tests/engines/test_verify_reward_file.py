"""Tests for coba_tasks.engines.reward_file: a veRL-style reward file (``verify.reward_function``) scored
in the verifier pool, the pass threshold with fractional scores, and the load errors.

The reward files are written by the tests, as a user would write them for veRL's
``custom_reward_function``: module-level functions with veRL's signature, nothing imported from coba.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from coba_tasks.engines.reward_file import RewardFileError, RewardFunction, split_spec
from coba_tasks.engines.verify import VerdictKind
from coba_tasks.engines.verify_pool import VerifierPool

CORRECT, WRONG, NO_ANSWER, TIMEOUT, ERROR = (k.value for k in VerdictKind)

# A reward file written for veRL: compute_score (the default name), a dict return, one that raises on some
# items, one that sleeps past the pool's limit, a fractional one. Line numbers matter to one test.
VERL_REWARD = textwrap.dedent(
    """\
    import os
    import time


    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        return 1.0 if solution_str.strip() == ground_truth else 0.0


    def with_extras(data_source, solution_str, ground_truth, extra_info=None):
        acc = solution_str.strip() == ground_truth
        return {
            "score": 1.0 if acc else -0.5,
            "acc": acc,
            "pred": solution_str.strip(),
            "split": (extra_info or {}).get("split"),
            "source": data_source,
            "tokens": [1, 2],
            "pid": os.getpid(),
            "reward": "a key named like a column",
        }


    def flaky(data_source, solution_str, ground_truth, extra_info=None):
        if "boom" in solution_str:
            raise ValueError("cannot grade\\nthis completion")
        return 1.0


    def slow(data_source, solution_str, ground_truth, extra_info=None):
        if "slow" in solution_str:
            time.sleep(60)
        return 1.0


    def partial_credit(data_source, solution_str, ground_truth, extra_info=None):
        return float(solution_str)


    def bad_returns(data_source, solution_str, ground_truth, extra_info=None):
        return {"none": None, "nan": float("nan"), "text": "x", "dict": {"acc": 1}}[solution_str]


    NOT_A_FUNCTION = 3
    """
)


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("rewards") / "verl_reward.py"
    path.write_text(VERL_REWARD)
    return path


def _rf(path: Path, name: str = "compute_score", threshold: float = 1.0) -> RewardFunction:
    return RewardFunction.from_spec(f"{path}:{name}", pass_threshold=threshold)


def test_spec_names_the_function_or_defaults_to_compute_score(tmp_path: Path) -> None:
    assert split_spec("r.py") == ("r.py", "compute_score")
    assert split_spec(" dir/r.py:my_score ") == ("dir/r.py", "my_score")
    for bad in ("r", "r.txt:score", "r.py:not-a-name", ":score", "r.py:"):
        with pytest.raises(RewardFileError, match=r"verify\.reward_function = .*path/to/file\.py"):
            split_spec(bad)
    rf = RewardFunction.from_spec("sub/r.py", root=tmp_path)
    assert rf.path == str(tmp_path / "sub" / "r.py") and rf.name == "compute_score" and rf.label == "r.py:compute_score"


def test_float_return_scored_in_the_workers_in_order(reward_file: Path) -> None:
    items = [("42", "42", "anything"), (" 42 ", "42", "math"), ("41", "42", "arith"), ("", "42", "x")]
    with VerifierPool(workers=2, timeout_s=10.0, reward_function=_rf(reward_file)) as pool:
        verdicts = pool.score(items)
        assert pool.worker_pids  # even arith rows go to the workers: the reward file scores every row
    assert [v.verdict.value for v in verdicts] == [CORRECT, CORRECT, WRONG, WRONG]
    assert [v.reward for v in verdicts] == [1.0, 1.0, 0.0, 0.0]


def test_dict_return_extra_keys_become_columns_and_extra_info_is_the_rows(reward_file: Path) -> None:
    from coba_tasks.pipeline import stages

    prompts = pd.DataFrame(
        {
            "prompt_id": ["a", "b"],
            "ground_truth": ["7", "8"],
            "data_source": ["openai/gsm8k", "mine"],
            "extra_info": [json.dumps({"split": "train", "index": 0}), "{}"],
        }
    )
    rollouts = pd.DataFrame({"prompt_id": ["a", "a", "b"], "sample_idx": [0, 1, 0], "completion": ["7", "6", "8"]})
    with VerifierPool(workers=1, timeout_s=10.0, reward_function=_rf(reward_file, "with_extras")) as pool:
        table = stages.reward_table(rollouts, prompts, pool)
    assert table["verdict"].tolist() == [CORRECT, WRONG, CORRECT]
    assert table["reward"].tolist() == [1.0, -0.5, 1.0]  # the raw score, negative too
    assert table["acc"].tolist() == [True, False, True]
    assert table["pred"].tolist() == ["7", "6", "8"]
    assert table["split"].tolist() == ["train", "train", None]  # the row's own extra_info
    assert table["source"].tolist() == ["openai/gsm8k", "openai/gsm8k", "mine"]
    assert table["tokens"].tolist() == ["[1, 2]"] * 3  # a list: its JSON text
    assert table["extra_reward"].tolist() == ["a key named like a column"] * 3
    assert os.getpid() not in set(table["pid"])  # scored in a worker process, not here
    # the table is written as Parquet like any stage table
    back = pd.read_parquet(_roundtrip(table))
    assert back["acc"].tolist() == [True, False, True] and back["reward"].tolist() == [1.0, -0.5, 1.0]


def _roundtrip(table: pd.DataFrame) -> Path:
    import tempfile

    path = Path(tempfile.mkdtemp()) / "rewards.parquet"
    table.to_parquet(path)
    return path


def test_a_raise_is_an_error_with_the_exceptions_last_line_and_the_batch_goes_on(reward_file: Path) -> None:
    items = [("fine", "1", "s"), ("boom!", "1", "s"), ("fine again", "1", "s")]
    with VerifierPool(workers=1, timeout_s=10.0, reward_function=_rf(reward_file, "flaky")) as pool:
        verdicts = pool.score(items)
        assert pool.restarts == 0  # the worker lived on
    assert [v.verdict.value for v in verdicts] == [CORRECT, ERROR, CORRECT]
    assert verdicts[1].reward == 0.0
    line = VERL_REWARD.splitlines().index('        raise ValueError("cannot grade\\nthis completion")') + 1
    assert (
        verdicts[1].detail
        == f"verl_reward.py:flaky: ValueError: cannot grade this completion (verl_reward.py line {line})"
    )


def test_a_function_that_sleeps_past_the_limit_is_a_timeout(reward_file: Path) -> None:
    items = [("quick", "1", "s"), ("slow", "1", "s"), ("quick", "1", "s")]
    with VerifierPool(workers=1, timeout_s=1.0, reward_function=_rf(reward_file, "slow")) as pool:
        verdicts = pool.score(items)
        assert pool.restarts == 1  # the stuck worker was killed and replaced; the new one imported the file
    assert [v.verdict.value for v in verdicts] == [CORRECT, TIMEOUT, CORRECT]
    assert "no verdict within 1 s" in verdicts[1].detail and verdicts[1].reward == 0.0


def test_returns_that_are_not_a_reward_are_errors(reward_file: Path) -> None:
    with VerifierPool(workers=1, timeout_s=10.0, reward_function=_rf(reward_file, "bad_returns")) as pool:
        verdicts = pool.score([(x, "1", "s") for x in ("none", "nan", "text", "dict")])
    assert [v.verdict.value for v in verdicts] == [ERROR] * 4
    assert "returned NoneType None, not a number" in verdicts[0].detail
    assert "not a finite number" in verdicts[1].detail
    assert "returned str 'x'" in verdicts[2].detail
    assert "a dict without a 'score' key (keys: 'acc')" in verdicts[3].detail


def test_pass_threshold_with_fractional_scores_pass_rates_and_raw_advantages(reward_file: Path) -> None:
    """A score >= verify.pass_threshold is solved: the pass rate counts solved rollouts (not the mean score),
    and the GRPO advantage is computed from the raw scores."""
    from coba_tasks.core.capability import CapabilityTracker
    from coba_tasks.pipeline import prompt_history, stages, update_batch

    prompts = pd.DataFrame({"prompt_id": ["p", "q"], "ground_truth": ["", ""], "data_source": ["s", "s"]})
    scores = ["0.25", "0.5", "0.75", "1.0", "0.1", "0.2"]
    rollouts = pd.DataFrame(
        {"prompt_id": ["p"] * 4 + ["q"] * 2, "sample_idx": [0, 1, 2, 3, 0, 1], "completion": scores}
    )
    with VerifierPool(workers=1, timeout_s=10.0, reward_function=_rf(reward_file, "partial_credit", 0.5)) as pool:
        rewards = stages.reward_table(rollouts, prompts, pool)
    assert rewards["reward"].tolist() == [0.25, 0.5, 0.75, 1.0, 0.1, 0.2]
    assert rewards["verdict"].tolist() == [WRONG, CORRECT, CORRECT, CORRECT, WRONG, WRONG]
    assert prompt_history.pass_rates(rewards).to_dict() == {"p": 0.75, "q": 0.0}
    cap, _ = stages.capability_table(0, rewards, CapabilityTracker())
    assert cap["S"].iloc[0] == pytest.approx(0.375) and cap["zero_variance_groups"].iloc[0] == 0.0
    history = prompt_history.update_history(prompt_history.empty_history(), rewards, 0, 1)
    assert dict(zip(history["prompt_id"], history["pass_rates"], strict=True)) == {"p": [0.75], "q": [0.0]}
    adv = update_batch.advantages_for(rollouts, rewards)
    p = np.array([0.25, 0.5, 0.75, 1.0])
    assert adv[:4] == pytest.approx((p - p.mean()) / (p.std(ddof=1) + 1e-6))  # raw scores, not 0/1
    assert adv[4] < 0 < adv[5]  # a group with no solved rollout still has an advantage
    # the built-in 0/1 verdicts: the pass rate is the share of reward 1, as before
    binary = pd.DataFrame(
        {"prompt_id": ["a"] * 4, "reward": [1.0, 0.0, 1.0, 1.0], "verdict": [CORRECT, WRONG, CORRECT, CORRECT]}
    )
    assert prompt_history.pass_rates(binary)["a"] == (binary["reward"] == 1.0).mean() == 0.75


@pytest.mark.parametrize(
    ("source", "name", "message"),
    [
        (None, "compute_score", r"verify\.reward_function: .*missing\.py does not exist; point verify"),
        ("def compute_score(:\n", "compute_score", r"does not import: SyntaxError: .* \(broken\.py line 1\)"),
        ("import no_such_module_here\n", "compute_score", r"does not import: ModuleNotFoundError: No module named"),
        (
            "x = 1\ndef other(a, b, c, d=None):\n    return 0\n",
            "compute_score",
            r"has no 'compute_score' \(it defines other\)",
        ),
        ("NOT_A_FUNCTION = 3\n", "NOT_A_FUNCTION", r"NOT_A_FUNCTION is a int, not a function"),
    ],
)
def test_load_errors_are_one_line_naming_the_path(tmp_path: Path, source: str | None, name: str, message: str) -> None:
    path = tmp_path / ("missing.py" if source is None else "broken.py")
    if source is not None:
        path.write_text(source)
    with pytest.raises(RewardFileError, match=message) as info:
        _rf(path, name).load()
    assert "\n" not in str(info.value) and str(path) in str(info.value)


def test_a_worker_that_cannot_load_the_file_scores_error_with_the_reason(tmp_path: Path) -> None:
    path = tmp_path / "gone.py"
    with VerifierPool(workers=1, timeout_s=10.0, reward_function=_rf(path)) as pool:
        (verdict,) = pool.score([("1", "1", "s")])
    assert verdict.verdict.value == ERROR and "gone.py does not exist" in verdict.detail


def test_the_config_check_loads_the_file_in_a_verifier_worker_before_a_run(tmp_path: Path, reward_file: Path) -> None:
    """verify.reward_function is checked where a run's datasets are (coba run, the flow's start), before
    anything is written, by importing it in a verifier worker (never in this process: its top-level code
    runs under verify.timeout_s there); the pool of a run carries it with verify.pass_threshold."""
    from coba_tasks.pipeline.config import load_config
    from coba_tasks.pipeline.data import reward_function
    from coba_tasks.pipeline.run import verifier_pool

    cfg = load_config(
        "configs/tiny-test.yaml", [f"verify.reward_function={reward_file}:with_extras", "verify.pass_threshold=0.5"]
    )
    rf = reward_function(cfg)
    assert rf == RewardFunction(str(reward_file), "with_extras", 0.5)
    assert _module_of(reward_file) not in sys.modules  # imported by a worker, not here
    pool = verifier_pool(cfg)
    assert pool.reward_function == rf and pool.worker_pids == []  # not started
    missing = load_config("configs/tiny-test.yaml", [f"verify.reward_function={tmp_path / 'nope.py'}"])
    with pytest.raises(RewardFileError, match=r"^verify\.reward_function: .*nope\.py does not exist"):
        reward_function(missing)
    with pytest.raises(RewardFileError, match=r"has no 'score_it'"):
        verifier_pool(load_config("configs/tiny-test.yaml", [f"verify.reward_function={reward_file}:score_it"]))
    assert reward_function(load_config("configs/tiny-test.yaml")) is None  # the built-in verifiers


def test_the_reward_file_of_docs_operations_works_unchanged(tmp_path: Path) -> None:
    """The example of docs/operations.md ("Your own reward"), as written there, through the pool."""
    from coba_tasks.pipeline.config import PROJECT_ROOT

    text = (PROJECT_ROOT / "docs" / "operations.md").read_text()
    section = text.split("### Your own reward (a veRL reward file)", 1)[1].split("\n## ", 1)[0]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    path = tmp_path / "gsm8k_reward.py"
    path.write_text(code)
    items = [("so #### 1,234.", "1234", "openai/gsm8k"), ("#### 7", "8", "openai/gsm8k"), ("eight", "8", "x")]
    with VerifierPool(workers=1, timeout_s=10.0, reward_function=_rf(path)) as pool:
        verdicts = pool.score(items)
    assert [(v.reward, v.verdict.value) for v in verdicts] == [(1.0, CORRECT), (0.1, WRONG), (0.0, WRONG)]
    assert [dict(v.extra) for v in verdicts] == [
        {"formatted": True, "pred": "1234"},
        {"formatted": True, "pred": "7"},
        {"formatted": False, "pred": ""},
    ]


# A reward file whose top-level code outlasts verify.timeout_s: it never finishes importing in time. It sleeps
# 60 s: a check that waited for it (or for the pool's 120 s start-up limit) instead of stopping at
# verify.timeout_s = 1 s takes far longer than the bounds below, which leave room for a loaded machine's
# process start-up (two test workers on 2 cores: 6.6 s once)
SLOW_IMPORT = (
    "import time\n\ntime.sleep(60)\n\n\n"
    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n"
)


def _module_of(path: Path) -> str:
    """The module name a reward file is imported under (``reward_file._import_function``)."""
    return "coba_reward_" + hashlib.sha256(str(path).encode()).hexdigest()[:16]


def test_a_reward_file_whose_import_outlasts_the_limit_is_refused_in_one_line_within_about_the_limit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, random_checkpoints
) -> None:
    """The load check of a run (and `coba run`, which makes it before anything starts) imports the file in a
    verifier worker under verify.timeout_s: a top-level sleep past it is one line, in about the limit."""
    from coba_tasks.commands.cli import main
    from coba_tasks.pipeline.config import load_config
    from coba_tasks.pipeline.data import reward_function

    path = tmp_path / "slow_import.py"
    path.write_text(SLOW_IMPORT)
    refused = rf"^verify\.reward_function: {path} did not import within 1 s \(verify\.timeout_s\)"
    cfg = load_config("configs/tiny-test.yaml", [f"verify.reward_function={path}", "verify.timeout_s=1"])
    t0 = time.monotonic()
    with pytest.raises(RewardFileError, match=refused) as info:
        reward_function(cfg)
    assert time.monotonic() - t0 < 20.0 and "\n" not in str(info.value)
    assert _module_of(path) not in sys.modules  # the file's code never ran in this process

    from coba_tasks.pipeline.deployment import REWARD_FILES_ENV

    monkeypatch.delenv(REWARD_FILES_ENV, raising=False)  # (monkeypatch removes what coba run sets, afterwards)
    model, _ = random_checkpoints
    run_dir = tmp_path / "run"
    args = ["run", "--config", "configs/tiny-test.yaml", "--run-dir", str(run_dir), "--set", f"model.path={model}"]
    t0 = time.monotonic()
    rc = main([*args, "--set", f"verify.reward_function={path}", "--set", "verify.timeout_s=1"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and err.startswith(f"error: verify.reward_function: {path} did not import")
    assert time.monotonic() - t0 < 30.0 and not run_dir.exists()
    assert os.environ.get(REWARD_FILES_ENV) == "1"  # the user's own command allows its reward file


def test_a_pool_whose_worker_cannot_import_the_file_in_time_stops_in_one_line(tmp_path: Path) -> None:
    """The workers of a run's pool import the file under the same limit: a batch stops at once with one line,
    rather than waiting for the workers' start-up limit (120 s) or scoring with a half-imported module."""
    path = tmp_path / "slow_import.py"
    path.write_text(SLOW_IMPORT)
    t0 = time.monotonic()
    with VerifierPool(workers=2, timeout_s=1.0, reward_function=_rf(path)) as pool:
        with pytest.raises(RewardFileError, match=rf"^verify\.reward_function: {path} did not import within 1 s"):
            pool.score([("1", "1", "s")])
        assert pool.worker_pids == []  # every worker stopped
    assert time.monotonic() - t0 < 20.0


@pytest.mark.skipif(not Path("/proc/self/oom_score_adj").is_file(), reason="oom_score_adj is Linux's")
@pytest.mark.parametrize("with_reward_file", [True, False])
def test_verifier_workers_are_the_kernels_first_choice_when_memory_runs_out(
    reward_file: Path, with_reward_file: bool
) -> None:
    """A reward file (or a verifier) that eats memory is what the OOM killer takes, not the trainer."""
    own = Path("/proc/self/oom_score_adj").read_text()
    rf = _rf(reward_file) if with_reward_file else None
    with VerifierPool(workers=1, timeout_s=10.0, reward_function=rf, warmup=False) as pool:
        pool.start()
        (pid,) = pool.worker_pids
        assert Path(f"/proc/{pid}/oom_score_adj").read_text().strip() == "1000"
    assert Path("/proc/self/oom_score_adj").read_text() == own  # this process (the trainer's) is left as it was
