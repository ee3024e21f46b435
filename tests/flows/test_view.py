"""flows.view on a synthetic run directory (no model): the no-signal event, the step table, the keys' scope.

A run with a real engine is read back through Prefect in tests/flows/test_train_flow.py; here a run whose
every group scores alike, which a tiny real run cannot be made to give on purpose.
"""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from coba_tasks.pipeline.config import load_config
from coba_tasks.pipeline.store import RunStore, Table
from coba_tasks.readers.figures import step_figures

PROMPTS = ["a", "b", "c"]
GROUP = 2


def _write_step(store: RunStore, step: int, rewards: list[float]) -> None:
    n = len(PROMPTS) * GROUP
    store.write_table(
        step,
        Table.BUDGET,
        pd.DataFrame(
            {
                "prompt_id": PROMPTS,
                "pass_rate_est": [np.nan, 0.5, 0.25],
                "budget": np.full(len(PROMPTS), GROUP, dtype=np.int64),
                "value": 0.0,
                "marginal_gain": 0.0,
            }
        ),
    )
    store.write_table(
        step,
        Table.ROLLOUTS,
        pd.DataFrame({"prompt_id": np.repeat(PROMPTS, GROUP), "sample_idx": np.tile(range(GROUP), 3), "n_tokens": 1}),
    )
    verdicts = ["correct" if r else "wrong" for r in rewards]
    frame = {"prompt_id": np.repeat(PROMPTS, GROUP), "reward": rewards, "verdict": verdicts}
    store.write_table(step, Table.REWARDS, pd.DataFrame(frame))
    s = float(np.mean(rewards))
    cap = {"S": s, "F": 1 - s, "alpha": 8.0, "beta": 2.0, "alpha_used": 8.0, "beta_used": 2.0}
    store.write_table(step, Table.CAPABILITY, pd.DataFrame([cap]))
    update = {"loss": 0.0, "grad_norm": 0.0, "effective_prompts": 0.0, "rollouts": n}
    store.write_table(step, Table.UPDATE, pd.DataFrame([update]))
    store.write_step_json(step, "timing", {"rollouts": 1.5, "update": 0.5})


def test_a_run_without_signal_raises_its_event_once_and_every_step_is_a_row(tmp_path, prefect_harness):
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter

    from flows.view import NO_SIGNAL_EVENT, STEP_EVENT, RunView, run_scope

    store = RunStore(tmp_path / "quiet")
    store.create(config_dict={}, config_hash="abc", versions={})
    res = SimpleNamespace(store=store, cfg=load_config("configs/tiny-test.yaml", ["run.steps=3"]))
    all_wrong = [0.0] * (len(PROMPTS) * GROUP)

    @flow
    def three_steps() -> str:
        view = RunView(res, first=0)
        for step in range(3):  # no group is mixed: 1, 2, 3 steps in a row without signal
            _write_step(store, step, all_wrong)
            view.step_done(step, step_figures(store, step), no_signal=step + 1)
        return view.scope

    scope = three_steps()
    assert scope == run_scope(store.root)
    with get_client(sync_client=True) as client:
        for _ in range(60):  # the server stores events a moment after they arrive
            page = client.read_events(
                filter=EventFilter(
                    event=EventNameFilter(prefix=["coba."]), resource=EventResourceFilter(id=[f"coba.run.{scope}"])
                ),
                limit=50,
            )
            if len(page.events) == 4:
                break
            time.sleep(0.5)
        key = ArtifactFilter(key=ArtifactFilterKey(any_=[f"{scope}-steps"]))
        (steps_artifact,) = client.read_artifacts(artifact_filter=key)  # one artifact, updated in place
    names = sorted(e.event for e in page.events)
    assert names == [NO_SIGNAL_EVENT, STEP_EVENT, STEP_EVENT, STEP_EVENT]
    (quiet,) = [e for e in page.events if e.event == NO_SIGNAL_EVENT]
    assert quiet.payload == {"step": 1, "steps_without_signal": 2}  # once, when the streak reaches 2
    assert dict(quiet.resource)["prefect.resource.name"].endswith("quiet (coba, seed 0)")
    rows = json.loads(steps_artifact.data)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[0]["mixed_groups"] == 0 and rows[0]["prompts"] == 3 and rows[0]["pass_rate"] == 0.0
    assert rows[0]["seconds"] == pytest.approx(2.0) and rows[0]["budget_mean"] == GROUP


def test_run_scope_tells_two_runs_of_one_name_apart(tmp_path):
    from flows.view import run_scope

    a, b = run_scope(tmp_path / "x" / "demo"), run_scope(tmp_path / "y" / "demo")
    assert a != b and a.startswith("demo-") and b.startswith("demo-")
    assert run_scope(tmp_path / "x" / "demo") == a  # the same run, the same keys


def test_a_runs_texts_reach_its_artifacts_as_written(tmp_path, prefect_harness):
    """The run directory's name (in every description) and a held-out set's name (a table cell) reached the
    artifacts as markdown, which the Prefect UI renders (descriptions and table cells alike): a remote image, a
    link, code. Now each renders as written; the event's rows keep the name as it is."""
    import html

    from markdown_it import MarkdownIt
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from flows.view import RunView, RunWatch, run_scope, run_title

    root = tmp_path / "r ![i](http:x.png) [a](b) `c`"
    store = RunStore(root)
    store.create(config_dict={}, config_hash="abc", versions={})
    name = "set ![i](http:y.png) | [a](b) _u_"
    table = pd.DataFrame(
        {"prompt_id": ["0", "1"], "test_set": ["test", name], "difficulty": [1, 1], "accuracy": [1.0, 0.0]}
    )
    store.write_table(0, Table.EVAL, table)
    res = SimpleNamespace(store=store, cfg=load_config("configs/tiny-test.yaml"))

    @flow
    def post() -> list:
        RunView(res, first=0).evaluation_done(0)
        return RunWatch(root, res.cfg).post(2, table, "checkpoints/000002, evaluated now")

    assert [r["test_set"] for r in post()] == ["test", name]  # the event's rows: the name as it is
    scope = run_scope(root)
    title = html.escape(run_title(root, res.cfg.allocation.strategy, res.cfg.run.seed))
    markdown = MarkdownIt("commonmark").enable("table")
    with get_client(sync_client=True) as client:
        for kind in ("progress", "heldout", "watch"):
            key = ArtifactFilter(key=ArtifactFilterKey(any_=[f"{scope}-{kind}"]))
            (artifact,) = client.read_artifacts(artifact_filter=key)
            assert markdown.render(artifact.description).startswith(f"<p>{title}: "), (kind, artifact.description)
            if kind != "progress":
                cells = [row["test_set"] for row in json.loads(artifact.data)]
                assert [markdown.renderInline(c) for c in cells] == ["test", html.escape(name)], (kind, cells)
