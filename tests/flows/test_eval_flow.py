"""The coba-eval flow checks its prompts as a training run does, before an engine starts."""

from __future__ import annotations

from pathlib import Path

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


# --- coba-eval-watch: a run's checkpoint scored as the run scores it, only the checkpoint it evaluates hashed


def _run_config(tmp_path, model, overrides=()):
    """tiny-test's config on ``model`` and flat arithmetic files, with ``overrides``."""
    from coba_tasks.pipeline.config import load_config

    train = _flat(tmp_path / "train.parquet", ["12+7=", "3*4=", "40-9=", "5+5="], answers=["19", "12", "31", "10"])
    test = _flat(tmp_path / "test.parquet", ["2+2=", "9-3=", "6*2=", "1+8="], answers=["4", "6", "12", "9"])
    base = [f"model.path={model}", f"data.train={train}", f"data.test={test}", "data.difficulties=[]"]
    return load_config("configs/tiny-test.yaml", [*base, "rollout.backend=transformers", *overrides])


def _watched_run(tmp_path, model, overrides=()):
    """A run directory as ``coba run`` starts it (config.yaml, run.json with its inputs' sha256), no step done."""
    from coba_tasks.pipeline.config import config_hash, config_to_dict
    from coba_tasks.pipeline.run import run_inputs
    from coba_tasks.pipeline.store import RunStore

    cfg = _run_config(tmp_path, model, overrides)
    store = RunStore(tmp_path / "run")
    store.create(config_to_dict(cfg), config_hash(cfg), versions={}, inputs=run_inputs(cfg))
    return store, cfg


def _checkpoint(store, step, model):
    """``checkpoints/<step>``: a copy of ``model``, whole (its checkpoint.json written last, as an update does)."""
    import shutil

    from coba_tasks.engines.checkpoint import write_checkpoint_manifest

    ckpt = store.checkpoint_dir(step)
    shutil.copytree(model, ckpt)
    write_checkpoint_manifest(ckpt)
    return ckpt


def _watch_versions(root):
    """The steps of every version of the run's ``<scope>-watch`` artifact, oldest first."""
    import json

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from flows.view import run_scope

    key = ArtifactFilter(key=ArtifactFilterKey(any_=[f"{run_scope(root)}-watch"]))
    with get_client(sync_client=True) as client:
        versions = client.read_artifacts(artifact_filter=key)
    return [json.loads(a.data)[0]["step"] for a in sorted(versions, key=lambda a: a.created)]


@pytest.mark.slow
def test_the_watch_scores_a_checkpoint_as_the_run_scores_it(tmp_path, random_checkpoints, prefect_harness, monkeypatch):
    """A run scored by a reward file (the first character, which the random model earns; the built-in arith
    verifier scores the same completions otherwise) with an extra held-out set: the watch's evaluation of a
    checkpoint holding the weights of step 0 is the run's own evaluation of step 0, set by set (it was the
    built-in verifiers' figure, of data.test alone)."""
    from helpers_reward import write_first_char_reward_file

    from coba_tasks.pipeline import run
    from coba_tasks.pipeline.store import Table
    from coba_tasks.readers.figures import heldout_rows
    from flows.eval import watch_flow

    model, _ = random_checkpoints
    monkeypatch.setenv("COBA_ALLOW_REWARD_FILES", "1")
    reward = write_first_char_reward_file(tmp_path)
    reworded = _flat(tmp_path / "reworded.parquet", ["2 + 2 = ?", "9 - 3 = ?", "6 * 2 = ?"], answers=["4", "6", "12"])
    overrides = [f"verify.reward_function={reward}", f"data.extra_tests=[{reworded}]"]
    overrides += ["run.eval_samples=4", "run.eval_temperature=1.0"]
    root = (tmp_path / "run").resolve()
    res = run.open_run(root, _run_config(tmp_path, model, overrides), continuing=False)
    try:  # the run's own held-out evaluation of the weights after 0 updates (the stage task's body)
        res.start(str(model), 0)
        evaluation.evaluate_step.fn(str(root), 0)
    finally:
        run.close_run(res)
    store = res.store
    ran = store.read_table(0, Table.EVAL)
    _checkpoint(store, 2, model)  # the same weights, as a checkpoint the run did not evaluate

    state = watch_flow(run_dir=str(store.root), return_state=True)
    assert state.message.endswith("(checkpoints/000002, evaluated now)"), state.message
    rows = state.result()["rows"]
    assert rows == heldout_rows(ran, 2)
    assert [r["test_set"] for r in rows] == ["test", "reworded"] and [r["prompts"] for r in rows] == [4, 3]
    assert any(r["avg_at_k"] > 0 for r in rows)  # the reward file's scores (the arith verifier's would be 0)


def test_the_watch_refuses_in_one_line_what_it_cannot_score_as_the_run(
    tmp_path, random_checkpoints, prefect_harness, monkeypatch
):
    """A reward file this worker may not run, or a held-out file (data.test, data.extra_tests) or reward file
    that is not the one the run started with: refused in one line naming it, before an engine starts, and
    nothing posted (the watch evaluated with the built-in verifiers on whatever the files held)."""
    from helpers_reward import write_first_char_reward_file

    from coba_tasks.pipeline.config_fields import ConfigError
    from coba_tasks.pipeline.store import StoreError
    from flows.eval import watch_flow

    model, _ = random_checkpoints
    monkeypatch.setattr(evaluation, "make_backend", lambda *a, **k: pytest.fail("the engine started"))
    reward = write_first_char_reward_file(tmp_path)
    extra = _flat(tmp_path / "extra.parquet", ["3+3="], answers=["6"])
    store, cfg = _watched_run(tmp_path, model, [f"verify.reward_function={reward}", f"data.extra_tests=[{extra}]"])
    _checkpoint(store, 1, model)

    monkeypatch.delenv("COBA_ALLOW_REWARD_FILES", raising=False)
    with pytest.raises(ConfigError, match=r"^verify.reward_function = .*set COBA_ALLOW_REWARD_FILES=1") as info:
        watch_flow(run_dir=str(store.root))
    assert "\n" not in str(info.value)
    monkeypatch.setenv("COBA_ALLOW_REWARD_FILES", "1")
    for key, path in (("data.test", cfg.data.test), ("data.extra_tests[0]", extra), ("verify.reward_function", reward)):
        kept = Path(path).read_bytes()
        Path(path).write_bytes(kept + b" ")
        with pytest.raises(StoreError) as info:
            watch_flow(run_dir=str(store.root))
        message = str(info.value)
        assert message.startswith(f"coba-eval-watch: {key} ({path}) is not the file run {store.root} started with")
        assert "\n" not in message and "nothing evaluated" in message, message
        Path(path).write_bytes(kept)
    assert _watch_versions(store.root) == []


def test_the_watch_hashes_only_the_checkpoint_it_evaluates(tmp_path, random_checkpoints, prefect_harness, monkeypatch):
    """Checkpoints 1-3 whole, 4 partial (no checkpoint.json yet): the watch hashes the files of 3 alone, newest
    first (4 fails before any hashing); a second watch hashes nothing (3 is its newest posted); a checkpoint
    the run evaluated itself is read from its table, unhashed. It hashed every checkpoint on every watch."""
    from coba_tasks.engines import checkpoint
    from coba_tasks.pipeline.store import Table
    from flows.eval import watch_flow

    model, _ = random_checkpoints
    store, _ = _watched_run(tmp_path, model)
    for step in (1, 2, 3):
        _checkpoint(store, step, model)
    store.checkpoint_dir(4).mkdir()
    (store.checkpoint_dir(4) / "model.safetensors").write_bytes(b"half")
    hashed, evaluated = [], []
    real = checkpoint.sha256_file
    monkeypatch.setattr(checkpoint, "sha256_file", lambda p: hashed.append(Path(p).parent.name) or real(p))

    def table(step):
        return pd.DataFrame({"prompt_id": ["0"], "difficulty": [1], "accuracy": [0.5], "weight_version": [step]})

    def scored(store_, cfg, step, eval_prompts=0):
        evaluated.append(step)
        return table(step)

    monkeypatch.setattr(evaluation, "evaluate_run_checkpoint", scored)
    first = watch_flow(run_dir=str(store.root), return_state=True)
    assert first.message.endswith("(checkpoints/000003, evaluated now)") and evaluated == [3]
    assert set(hashed) == {"000003"} and len(hashed) == len(list(store.checkpoint_dir(3).iterdir())) - 1
    hashed.clear()
    again = watch_flow(run_dir=str(store.root), return_state=True)
    assert again.message == f"checkpoints/000003 of {store.root} was evaluated by an earlier watch; nothing done"
    assert hashed == [] and evaluated == [3]
    _checkpoint(store, 5, model)
    hashed.clear()
    store.write_table(5, Table.EVAL, table(5))  # the run's own evaluation of step 5
    read = watch_flow(run_dir=str(store.root), return_state=True)
    assert "steps/000005/eval.parquet" in read.message and hashed == []
    assert _watch_versions(store.root) == [3, 5]


# --- The artifacts show paths and dataset texts as written

MARKDOWN = "![pixel](https://evil.example/p.png) [click](https://evil.example) | `x` <b>b</b>\n# h *e* _u_"


def rendered(markdown):
    """HTML of ``markdown`` as the Prefect UI renders an artifact (CommonMark with tables); its tags' names."""
    import re

    from markdown_it import MarkdownIt

    page = MarkdownIt("commonmark").enable("table").render(markdown)
    return page, set(re.findall(r"</?([a-z0-9]+)", page))


@pytest.mark.slow
def test_the_eval_artifact_shows_paths_and_data_sources_as_written(
    tmp_path, random_checkpoints, prefect_harness, monkeypatch
):
    """A data_source, the model's and the test file's paths reached the coba-eval artifact as markdown: a remote
    image, a link, HTML, a heading and a broken table in the Prefect UI. Rendered, each is text, as written, and
    the table keeps two cells a row."""
    import html
    import shutil

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from flows.eval import artifact_key, eval_flow

    model, _ = random_checkpoints
    shown = shutil.copytree(model, tmp_path / "m ![i](http:y.png) [a](b) |x| `c`")
    test = _flat(tmp_path / "t <b> |[a](b)| *s*.parquet", ["1+1="], answers=["2"])
    table = pd.DataFrame(
        {"prompt_id": ["0", "1"], "difficulty": [1, 1], "accuracy": [1.0, 0.0], "weight_version": [0, 0]}
        | {"data_source": ["arith", MARKDOWN]}
    )
    monkeypatch.setattr(evaluation, "evaluate_model", lambda *a, **k: table)
    eval_flow(str(shown), {"test_path": str(test), "backend": "transformers"})
    key = ArtifactFilter(key=ArtifactFilterKey(any_=[artifact_key(shown)]))
    with get_client(sync_client=True) as client:
        (artifact,) = client.read_artifacts(artifact_filter=key)
    page, tags = rendered(artifact.data)
    assert tags == {"h1", "table", "thead", "tbody", "tr", "th", "td"}, page
    assert page.count("<h1>") == 1 and page.count("<td>") == 2 * page.count("<tr>") - 2  # two cells a row
    assert f"<h1>Held-out evaluation of {html.escape(str(shown))}</h1>" in page
    for text in (str(test), f"accuracy, {MARKDOWN.replace(chr(10), ' ')}"):
        assert f"<td>{html.escape(text)}</td>" in page, text
    about, tags = rendered(artifact.description)
    assert tags == {"p"} and html.escape(str(shown)) in about, about
