"""The coba-eval flow checks its prompts as a training run does, before an engine starts."""

from __future__ import annotations

import pandas as pd
import pytest

from coba_tasks.pipeline.data import DatasetError


def _flat(path, prompts, answers=None, source="arith"):
    answers = answers or ["1"] * len(prompts)
    pd.DataFrame({"prompt": prompts, "answer": answers, "data_source": source}).to_parquet(path)
    return path


def _evaluate(model, test, **overrides):
    from flows.eval import evaluate_model

    args = dict(samples=1, temperature=0.0, max_tokens=12, backend="transformers", eval_prompts=0, seed=0)
    args.update(dtype="float32", max_model_len=64)
    args.update(overrides)
    return evaluate_model.fn(str(model), str(test), **args)  # the task's body, without Prefect


def test_an_over_long_prompt_is_refused_before_the_engine_starts(tmp_path, random_checkpoints, monkeypatch):
    import flows.eval

    model, _ = random_checkpoints
    started = []
    monkeypatch.setattr(flows.eval, "make_backend", lambda *a, **k: started.append(a))
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
    import flows.eval

    model, _ = random_checkpoints
    monkeypatch.setattr(flows.eval, "make_backend", lambda *a, **k: pytest.fail("the engine started"))
    bad = _flat(tmp_path / "bad.parquet", ["1+1=", "2+2="], answers=["2", "four"])
    with pytest.raises(DatasetError, match=r"row 1, column answer: arith: ground truth 'four' is not an integer"):
        _evaluate(model, bad)
    unknown = _flat(tmp_path / "u.parquet", ["1+1="], source="nobody")
    with pytest.raises(DatasetError, match=r"data_source 'nobody' \(rows 0\) has no verifier"):
        _evaluate(model, unknown)


def test_bad_parameters_are_one_line(random_checkpoints, tmp_path):
    from flows.eval import _check_parameters

    model, _ = random_checkpoints
    test = _flat(tmp_path / "t.parquet", ["1+1="])
    with pytest.raises(ValueError, match=r"max_model_len must exceed max_tokens \(12\)"):
        _check_parameters(str(model), str(test), 1, 0.0, 12, "vllm", 0, max_model_len=10)
    with pytest.raises(ValueError, match="unknown_sources must be one of error, math"):
        _check_parameters(str(model), str(test), 1, 0.0, 12, "vllm", 0, unknown_sources="skip")
