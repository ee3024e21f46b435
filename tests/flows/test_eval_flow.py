"""The coba-eval flow checks its prompts as a training run does, before an engine starts."""

from __future__ import annotations

import pandas as pd
import pytest

from coba_tasks.pipeline import evaluation
from coba_tasks.pipeline.data import DatasetError
from coba_tasks.pipeline.evaluation import EvalSettings, eval_settings


def _flat(path, prompts, answers=None, source="arith"):
    answers = answers or ["1"] * len(prompts)
    pd.DataFrame({"prompt": prompts, "answer": answers, "data_source": source}).to_parquet(path)
    return path


def _evaluate(model, test, **changes):
    from coba_tasks.pipeline.evaluation import evaluate_model

    settings = eval_settings(test_path=str(test), backend="transformers", **changes)
    return evaluate_model(str(model), settings)  # the task's body, without Prefect


def test_an_over_long_prompt_is_refused_before_the_engine_starts(tmp_path, random_checkpoints, monkeypatch):

    model, _ = random_checkpoints
    started = []
    monkeypatch.setattr(evaluation, "make_backend", lambda *a, **k: started.append(a))
    test = _flat(tmp_path / "t.parquet", ["1+1=", "9" * 900])
    with pytest.raises(DatasetError) as info:
        _evaluate(model, test)
    assert str(info.value) == (
        f"{test}: row 1, column prompt: prompt is 900 tokens; with rollout.max_tokens 12 it exceeds the context of "
        "64 tokens (max_model_len)"
    )
    with pytest.raises(DatasetError, match=r"context of 64 tokens \(the model's max_position_embeddings"):
        _evaluate(model, test, max_model_len=0)  # the model's own context
    assert started == []


def test_ground_truths_and_sources_are_checked_before_the_engine_starts(tmp_path, random_checkpoints, monkeypatch):

    model, _ = random_checkpoints
    monkeypatch.setattr(evaluation, "make_backend", lambda *a, **k: pytest.fail("the engine started"))
    bad = _flat(tmp_path / "bad.parquet", ["1+1=", "2+2="], answers=["2", "four"])
    with pytest.raises(DatasetError, match=r"row 1, column answer: arith: ground truth 'four' is not an integer"):
        _evaluate(model, bad)
    unknown = _flat(tmp_path / "u.parquet", ["1+1="], source="nobody")
    with pytest.raises(DatasetError, match=r"data_source 'nobody' \(rows 0\) has no verifier"):
        _evaluate(model, unknown)


def test_bad_settings_are_one_line_naming_the_field():
    with pytest.raises(ValueError, match=r"^eval settings: max_model_len must exceed max_tokens \(12\)"):
        eval_settings(max_model_len=10)
    with pytest.raises(ValueError, match=r"^eval settings: unknown_sources: Input should be 'error' or 'math' \(got"):
        eval_settings(unknown_sources="skip")
    with pytest.raises(ValueError, match=r"^eval settings: backend: unknown backend 'tpu'; valid backends: .*vllm"):
        eval_settings(backend="tpu")
    with pytest.raises(ValueError, match=r"samples > 1 needs temperature > 0"):
        eval_settings(samples=4)
    with pytest.raises(ValueError, match=r"temperature: Input should be a finite number \(got nan\)"):
        eval_settings(temperature=float("nan"))
    with pytest.raises(ValueError, match=r"^eval settings: sampels: Extra inputs are not permitted \(got 4\)$"):
        eval_settings({"sampels": 4})
    for message in (str(e) for e in _errors(eval_settings, [{"samples": 0}, {"top_p": 0}, {"dtype": "int4"}])):
        assert "\n" not in message, message


def _errors(fn, calls):
    out = []
    for kwargs in calls:
        with pytest.raises(ValueError) as info:
            fn(kwargs)
        out.append(info.value)
    return out


def test_a_run_config_gives_the_settings_of_its_evaluations():
    from coba_tasks.pipeline.config import load_config

    cfg = load_config("configs/demo.yaml")
    s = EvalSettings.from_config(cfg)
    assert (s.test_path, s.samples, s.temperature, s.top_p) == (
        cfg.data.test,
        cfg.run.eval_samples,
        cfg.run.eval_temperature,
        cfg.run.eval_top_p,
    )
    assert (s.max_tokens, s.max_model_len, s.eval_prompts, s.prompt_format) == (
        cfg.rollout.max_tokens,
        cfg.rollout.max_model_len,
        cfg.data.eval_prompts,
        cfg.data.prompt_format,
    )


def test_coba_eval_scores_gsm8k_rows_as_the_run_config_says(tmp_path, random_checkpoints, monkeypatch):
    """verify.gsm8k_answer reaches the evaluation's verifier pool (veRL's strict scorer when asked)."""
    from coba_tasks.pipeline import evaluation
    from coba_tasks.pipeline.config import load_config

    model, _ = random_checkpoints
    pools = []

    class Stop(Exception):
        pass

    class Engine:
        def close(self):
            pass

    def pool(**kwargs):
        pools.append(kwargs)
        raise Stop

    monkeypatch.setattr(evaluation, "make_backend", lambda *a, **k: Engine())
    monkeypatch.setattr(evaluation, "VerifierPool", pool)
    test = _flat(tmp_path / "g.parquet", ["1+1=", "2+2="], answers=["2", "4"], source="openai/gsm8k")
    cfg = load_config(None, ["verify.gsm8k_answer=strict", f"data.test={test}", "data.difficulties=[]"])
    settings = EvalSettings.from_config(cfg).model_copy(update={"backend": "transformers", "max_model_len": 0})
    assert settings.gsm8k_answer == "strict"
    with pytest.raises(Stop):
        evaluation.evaluate_model(str(model), settings)
    with pytest.raises(Stop):
        _evaluate(model, test)  # the default: math-verify, as a run's default
    assert [p["gsm8k_answer"] for p in pools] == ["strict", "math"]


def test_out_path_that_is_an_input_is_refused_even_with_overwrite(tmp_path, random_checkpoints):
    """The test file or a file of the model, under any name (a symlink), is never out_path; an existing file
    only with overwrite; a directory never. One line naming out_path, the input and the way out."""
    from coba_tasks.pipeline.evaluation import check_eval_inputs

    model, _ = random_checkpoints
    test = _flat(tmp_path / "t.parquet", ["1+1="], answers=["2"])
    settings = eval_settings(test_path=str(test))
    via_link = tmp_path / "link.parquet"
    via_link.symlink_to(test)
    for out, what in ((test, "test_path"), (via_link, "test_path"), (model / "config.json", "model")):
        for overwrite in (False, True):
            with pytest.raises(ValueError, match=rf"^out_path {out} is an input of this evaluation \({what} ") as info:
                check_eval_inputs(str(model), settings, str(out), overwrite)
            assert "\n" not in str(info.value) and "choose another out_path" in str(info.value)
    other = _flat(tmp_path / "other.parquet", ["3+3="])
    with pytest.raises(ValueError, match=r"^out_path .*other\.parquet already exists; .*pass overwrite=True"):
        check_eval_inputs(str(model), settings, str(other))
    # overwrite replaces an earlier evaluation's table, never another file (a dataset, a text file)
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    for path in (other, notes):
        with pytest.raises(ValueError, match=r"exists and is not an evaluation table .*choose another out_path"):
            check_eval_inputs(str(model), settings, str(path), overwrite=True)
    earlier = tmp_path / "earlier.parquet"
    pd.DataFrame({"prompt_id": ["0"], "accuracy": [1.0], "weight_version": [0]}).to_parquet(earlier)
    check_eval_inputs(str(model), settings, str(earlier), overwrite=True)
    check_eval_inputs(str(model), settings, str(tmp_path / "new.parquet"))
    with pytest.raises(ValueError, match=r"^out_path .* is a directory"):
        check_eval_inputs(str(model), settings, str(tmp_path), overwrite=True)


@pytest.mark.slow
def test_the_flow_refuses_an_existing_out_path_before_evaluating_and_replaces_it_when_asked(
    tmp_path, random_checkpoints, prefect_harness, monkeypatch
):
    """A 50-row dataset given as out_path stays as it was, and no evaluation ran, with overwrite=True (the
    deployment's parameter) too: overwrite replaces an earlier evaluation's table only; a test file as
    out_path is refused with overwrite too."""
    from flows.eval import eval_flow

    model, _ = random_checkpoints
    evaluated = []

    def fake_evaluate(model_path, settings, progress=False):
        evaluated.append(model_path)
        return pd.DataFrame({"prompt_id": ["0"], "difficulty": [1], "accuracy": [1.0], "weight_version": [0]})

    monkeypatch.setattr(evaluation, "evaluate_model", fake_evaluate)
    test = _flat(tmp_path / "t.parquet", ["1+1=", "2+2="], answers=["2", "4"])
    dataset = _flat(tmp_path / "train.parquet", [f"{i}+1=" for i in range(50)])
    settings = {"test_path": str(test), "backend": "transformers"}
    before = {p: p.read_bytes() for p in (test, dataset)}
    with pytest.raises(ValueError, match=r"^out_path .*train\.parquet already exists"):
        eval_flow(str(model), settings, out_path=str(dataset))
    with pytest.raises(ValueError, match=r"is an input of this evaluation \(test_path"):
        eval_flow(str(model), settings, out_path=str(test), overwrite=True)
    assert evaluated == [] and {p: p.read_bytes() for p in (test, dataset)} == before

    with pytest.raises(ValueError, match=r"train\.parquet exists and is not an evaluation table"):
        eval_flow(str(model), settings, out_path=str(dataset), overwrite=True)
    assert evaluated == [] and {p: p.read_bytes() for p in (test, dataset)} == before

    eval_flow(str(model), settings, out_path=str(tmp_path / "new.parquet"))  # a new file needs no overwrite
    eval_flow(str(model), settings, out_path=str(tmp_path / "new.parquet"), overwrite=True)  # its own table again
    assert len(pd.read_parquet(tmp_path / "new.parquet")) == 1 and len(evaluated) == 2
