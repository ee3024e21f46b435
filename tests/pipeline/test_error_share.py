"""verify.max_error_share: a step whose completions mostly could not be scored stops the run.

A reward file that raises on every call (or a verifier that times out on every item) would otherwise give
a step of ``error`` verdicts: reward 0, pass rate 0, a budget moved on no evidence, and a run that ends
Completed. ``stages.check_error_share`` is the check the rewards stage makes before its table is written.
"""

from __future__ import annotations

import pandas as pd
import pytest

from coba_tasks.pipeline import evaluation, stages
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
    stages.check_error_share(table, "step 3", 0.75)  # 3 of 4 = 0.75: not above
    with pytest.raises(stages.ScoringError) as info:
        stages.check_error_share(table, "step 3", 0.5)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("step 3: 3 of 4 completions scored error or timeout (75%), above verify.max_error_share")
    assert f"the first error: {RAISED}" in message  # the first `error` row's detail column
    assert "verify.max_error_share" in message.split("the first error:")[1]  # the key to change, after the cause
    assert isinstance(info.value, ValueError)  # the commands print it as one line, not a traceback


def test_timeouts_count_and_their_detail_is_shown_when_nothing_raised():
    table = _rewards(["timeout", "timeout", "wrong", "timeout"], [KILLED, KILLED, "", KILLED])
    with pytest.raises(stages.ScoringError, match=r"^step 0: 3 of 4 completions .*the first timeout: rf\.py:"):
        stages.check_error_share(table, "step 0", 0.5)


def test_no_stop_at_or_below_the_share_nor_with_1_nor_on_an_empty_step():
    stages.check_error_share(_rewards(["error", "wrong"], [RAISED, ""]), "step 0", 0.5)  # 0.5 is not above 0.5
    stages.check_error_share(_rewards(["error"] * 4, [RAISED] * 4), "step 0", 1.0)  # 1 = never stop
    stages.check_error_share(_rewards(["correct", "wrong", "no_answer", "wrong"], [""] * 4), "step 0", 0.0)
    stages.check_error_share(_rewards([], []), "step 0", 0.0)


def test_max_error_share_key_default_bounds_and_hash():
    cfg = load_config("configs/tiny-test.yaml")
    assert cfg.verify.max_error_share == 0.5
    assert HASH_NEUTRAL_DEFAULTS[("verify", "max_error_share")] == 0.5  # existing runs keep their hash
    assert config_hash(load_config("configs/tiny-test.yaml", ["verify.max_error_share=0.5"])) == config_hash(cfg)
    assert load_config("configs/tiny-test.yaml", ["verify.max_error_share=1"]).verify.max_error_share == 1.0
    for bad in ("-0.1", "1.5"):
        with pytest.raises(ConfigError, match=r"verify\.max_error_share"):
            load_config("configs/tiny-test.yaml", [f"verify.max_error_share={bad}"])


class _Engine:
    """Answers "4" to every sample."""

    weight_version = 2

    def generate_many(self, batches, progress=False):
        from coba_tasks.engines.rollout import Rollout

        return [
            [Rollout(r.prompt_id, j, "4", (5,), 1, "stop", r.seed, 2) for r in b for j in range(r.n)]
            for b, _ in batches
        ]


class _Pool:
    """Scores a completion of a prompt whose ground truth is "x" as an error, "t" as a timeout, else correct."""

    reward_function = None

    def score(self, items):
        from coba_tasks.engines.verify import Verdict, VerdictKind

        kinds = {"x": VerdictKind.ERROR, "t": VerdictKind.TIMEOUT}
        return [
            Verdict(0.0, kinds[truth], "", f"cannot score {truth}")
            if truth in kinds
            else Verdict(1.0, VerdictKind.CORRECT)
            for _, truth, _ in items
        ]


def _held_out(truths: dict[str, list[str]]) -> pd.DataFrame:
    rows = [(f"{name}-{i}", name, truth) for name, ts in truths.items() for i, truth in enumerate(ts)]
    ids, sets, gts = zip(*rows, strict=True)
    return pd.DataFrame(
        {
            "prompt_id": ids,
            "test_set": sets,
            "ground_truth": gts,
            "data_source": "arith",
            "prompt_token_ids": [[5, 6]] * len(ids),
            "prompt_rendered": "1+3=",
        }
    )


def test_a_held_out_set_that_cannot_be_scored_stops_the_evaluation_instead_of_reading_as_accuracy_0():
    """A verifier (or reward file) that errors on every held-out row gave accuracy 0 and answered 1.0 with exit
    0. The evaluation applies verify.max_error_share to each held-out set and keeps each prompt's error and
    timeout counts."""
    test = _held_out({"test": ["4", "4", "x", "t"], "reworded": ["x", "x", "x", "4"]})
    table = evaluation.evaluate(test, _Engine(), _Pool(), 2, 1.0, 8, seed=0, greedy=True, max_error_share=1.0)
    assert table["errors"].tolist() == [0, 0, 3, 0, 3, 3, 3, 0]  # 2 samples + greedy per prompt
    assert table["timeouts"].tolist() == [0, 0, 0, 3, 0, 0, 0, 0]
    # test: 6 of 12 completions unscored (not above 0.5); reworded: 9 of 12 (above)
    with pytest.raises(stages.ScoringError, match=r"^held-out evaluation at step 2 \(reworded\): 9 of 12 completions"):
        evaluation.evaluate(
            test,
            _Engine(),
            _Pool(),
            2,
            1.0,
            8,
            seed=0,
            greedy=True,
            max_error_share=0.5,
            where="held-out evaluation at step 2",
        )
    table = evaluation.evaluate(
        test[test["test_set"] == "test"], _Engine(), _Pool(), 2, 1.0, 8, seed=0, max_error_share=0.5
    )
    assert table["accuracy"].tolist() == [1.0, 1.0, 0.0, 0.0]


class _Numbered(_Engine):
    """Answers the sample's number: "0", "1", ... for the sampled completions, "g" for the greedy one."""

    def generate_many(self, batches, progress=False):
        from coba_tasks.engines.rollout import Rollout

        return [
            [
                Rollout(r.prompt_id, j, "g" if s.temperature == 0 else str(j), (5,), 1, "stop", r.seed, 2)
                for r in b
                for j in range(r.n)
            ]
            for b, s in batches
        ]


def test_an_evaluation_keeps_each_prompts_first_sampled_and_greedy_completion_with_its_verdict():
    """What came back is kept in the eval table: the user's text, each prompt's first sampled completion and its
    greedy one, each with its verdict (the report shows them); without greedy decoding no greedy columns."""
    test = _held_out({"test": ["4", "x"]}).assign(prompt_text=["what is 1+3?", "what is x?"])
    table = evaluation.evaluate(test, _Numbered(), _Pool(), 3, 1.0, 8, seed=0, greedy=True)
    assert table["prompt_text"].tolist() == ["what is 1+3?", "what is x?"]
    assert table["sample_completion"].tolist() == ["0", "0"] and table["greedy_completion"].tolist() == ["g", "g"]
    assert table["sample_verdict"].tolist() == ["correct", "error"] == table["greedy_verdict"].tolist()
    sampled_only = evaluation.evaluate(test, _Numbered(), _Pool(), 3, 1.0, 8, seed=0)
    assert "greedy_completion" not in sampled_only and sampled_only["sample_completion"].tolist() == ["0", "0"]
