"""verify.max_error_share: a step whose completions mostly could not be scored stops the run.

A reward file that raises on every call (or a verifier that times out on every item) would otherwise give
a step of ``error`` verdicts: reward 0, pass rate 0, a budget moved on no evidence, and a run that ends
Completed. ``stages.check_error_share`` is the check the rewards stage makes before its table is written.
"""

from __future__ import annotations

import pandas as pd
import pytest

from coba_tasks.pipeline import stages
from coba_tasks.pipeline.config import HASH_NEUTRAL_DEFAULTS, config_hash, load_config
from coba_tasks.pipeline.config_fields import ConfigError

RAISED = "rf.py:compute_score: KeyError: 'answer' (rf.py line 2)"
KILLED = "rf.py:compute_score: no verdict within 1 s; worker killed"


def _rewards(verdicts: list[str], details: list[str | None]) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "prompt_id": [f"p{i // 2}" for i in range(len(verdicts))],
            "sample_idx": [i % 2 for i in range(len(verdicts))],
            "reward": 0.0,
            "verdict": verdicts,
            "detail": details,
        }
    )


def test_a_step_above_max_error_share_stops_with_one_line_naming_the_first_error_and_the_key():
    table = _rewards(["correct", "timeout", "error", "error"], ["", KILLED, RAISED, "later"])
    stages.check_error_share(table, 3, 0.75)  # 3 of 4 = 0.75: not above
    with pytest.raises(stages.ScoringError) as info:
        stages.check_error_share(table, 3, 0.5)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("step 3: 3 of 4 rollouts scored error or timeout (75%), above verify.max_error_share")
    assert f"the first error: {RAISED}" in message  # the first `error` row's detail column
    assert "verify.max_error_share" in message.split("the first error:")[1]  # the key to change, after the cause
    assert isinstance(info.value, ValueError)  # the commands print it as one line, not a traceback


def test_timeouts_count_and_their_detail_is_shown_when_nothing_raised():
    table = _rewards(["timeout", "timeout", "wrong", "timeout"], [KILLED, KILLED, "", KILLED])
    with pytest.raises(stages.ScoringError, match=r"^step 0: 3 of 4 rollouts .*the first timeout: rf\.py:"):
        stages.check_error_share(table, 0, 0.5)


def test_no_stop_at_or_below_the_share_nor_with_1_nor_on_an_empty_step():
    stages.check_error_share(_rewards(["error", "wrong"], [RAISED, ""]), 0, 0.5)  # 0.5 is not above 0.5
    stages.check_error_share(_rewards(["error"] * 4, [RAISED] * 4), 0, 1.0)  # 1 = never stop
    stages.check_error_share(_rewards(["correct", "wrong", "no_answer", "wrong"], [""] * 4), 0, 0.0)
    stages.check_error_share(_rewards([], []), 0, 0.0)


def test_max_error_share_key_default_bounds_and_hash():
    cfg = load_config("configs/tiny-test.yaml")
    assert cfg.verify.max_error_share == 0.5
    assert HASH_NEUTRAL_DEFAULTS[("verify", "max_error_share")] == 0.5  # existing runs keep their hash
    assert config_hash(load_config("configs/tiny-test.yaml", ["verify.max_error_share=0.5"])) == config_hash(cfg)
    assert load_config("configs/tiny-test.yaml", ["verify.max_error_share=1"]).verify.max_error_share == 1.0
    for bad in ("-0.1", "1.5"):
        with pytest.raises(ConfigError, match=r"verify\.max_error_share"):
            load_config("configs/tiny-test.yaml", [f"verify.max_error_share={bad}"])
