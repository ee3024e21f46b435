"""coba report: plots and the HTML page of a small synthetic run directory (no model, no Prefect)."""

from __future__ import annotations

import argparse
import html
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from coba_tasks.commands.report import add_report_parser
from coba_tasks.pipeline.store import RunStore
from coba_tasks.readers import report
from coba_tasks.readers.report import (
    ARTIFACT_FILES,
    PLOT_FILES,
    STAGE_TIME_PNG,
    build_report,
    report_artifacts_markdown,
    write_report,
)
from coba_tasks.readers.text import markdown_text

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PROMPTS = [f"p{i}" for i in range(12)]
DIFFICULTY = {p: i % 3 for i, p in enumerate(PROMPTS)}
GROUP = 4  # rollouts per prompt in the synthetic steps
# Held-out accuracy at steps 0 and 3: per-prompt accuracies chosen so the means are distinctive numbers.
EVAL_ACC = {0: [0.25, 0.5, 0.0, 0.5, 0.25, 0.375, 0.0, 0.625], 3: [0.5, 0.75, 0.25, 0.5, 0.5, 0.625, 0.25, 0.875]}
ACC_BEFORE, ACC_AFTER = float(np.mean(EVAL_ACC[0])), float(np.mean(EVAL_ACC[3]))  # 0.3125, 0.53125


def _budget(step: int) -> pd.DataFrame:
    rng = np.random.default_rng(step)
    seen = step > 0
    est = rng.uniform(0, 1, len(PROMPTS)) if seen else np.full(len(PROMPTS), np.nan)
    if seen:
        est[:3] = np.nan  # a few prompts not seen yet
    budget = rng.integers(2, 17, len(PROMPTS)) if seen else np.full(len(PROMPTS), GROUP)
    return pd.DataFrame(
        {
            "prompt_id": PROMPTS,
            "pass_rate_est": est,
            "budget": budget.astype(np.int64),
            "value": np.nan,
            "marginal_gain": np.nan,
            "group": "all",
            "alpha": 9.0 - step,
            "beta": 2.0 + step,
            "tau": np.nan,
            "strategy": "coba",
            "fallback": "" if seen else "every prompt unseen: uniform allocation",
        }
    )


def _rewards(step: int) -> pd.DataFrame:
    rows = []
    verdicts = ["correct", "wrong", "no_answer", "timeout", "error"]
    for i, p in enumerate(PROMPTS):
        for k in range(GROUP):
            v = verdicts[(i + k + step) % len(verdicts)] if k < 2 else ("correct" if (i + step) % 2 else "wrong")
            rows.append(
                {
                    "prompt_id": p,
                    "sample_idx": k,
                    "reward": float(v == "correct"),
                    "verdict": v,
                    "extracted_answer": "1",
                }
            )
    return pd.DataFrame(rows)


def _rollouts(step: int, completion: str = "1") -> pd.DataFrame:
    n = len(PROMPTS) * GROUP
    return pd.DataFrame(
        {
            "prompt_id": np.repeat(PROMPTS, GROUP),
            "sample_idx": np.tile(np.arange(GROUP), len(PROMPTS)),
            "completion": [completion] * n,
            "n_tokens": np.ones(n, dtype=np.int64),
            "finish_reason": ["stop"] * n,
            "seed": np.arange(n, dtype=np.int64),
            "weight_version": step,
        }
    )


def _capability(step: int, rewards: pd.DataFrame) -> pd.DataFrame:
    s = float(rewards.groupby("prompt_id")["reward"].mean().mean())
    counts = rewards["verdict"].value_counts()
    row = {
        "step": step, "S": s, "F": 1 - s, "Fbar": 1 - s, "Ftil": 1 - s,
        "alpha_used": 9.0 - step, "beta_used": 2.0 + step, "alpha": 8.0 - step, "beta": 3.0 + step,
        "prompts": len(PROMPTS), "rollouts": len(rewards), "zero_variance_groups": 0.0,
        **{f"verdict_{v}": int(counts.get(v, 0)) for v in ("correct", "wrong", "no_answer", "timeout", "error")},
        "tracker_state": "{}",
    }  # fmt: skip
    return pd.DataFrame([row])


def _eval(step: int) -> pd.DataFrame:
    acc = EVAL_ACC[step]
    return pd.DataFrame(
        {
            "prompt_id": [f"e{i}" for i in range(len(acc))],
            "difficulty": [i % 3 for i in range(len(acc))],
            "accuracy": acc,
            "weight_version": step,
        }
    )


def _update(step: int) -> pd.DataFrame:
    return pd.DataFrame(
        [
            {
                "step": step,
                "loss": 0.1,
                "clip_frac": 0.0,
                "grad_norm": 1.0,
                "entropy": 0.5,
                "kl": 0.0,
                "tokens": 48,
                "sequences": 48,
                "lr": 1e-4,
                "zero_variance_groups": 0.0,
                "rollouts": 48,
                "logprob_diff_mean": 1e-3 * (step + 1),
                "logprob_diff_max": 0.0125 * (step + 1),
            }
        ]
    )


def make_run(
    root: Path, steps: int = 3, finished: bool = True, half_step: str | None = None, completion: str = "1"
) -> RunStore:
    """A synthetic run: steps 0..steps-1 done, budget for step `steps`, eval at 0 and 3.

    half_step: None, "budget" (the next step has only its budget) or "rewards" (it also has
    rollouts and rewards, but no capability yet). completion: the text of every rollout.
    """
    store = RunStore(root)
    store.create(
        config_dict={"run": {"steps": steps}, "allocation": {"strategy": "coba"}}, config_hash="abc", versions={}
    )
    prompts = pd.DataFrame(
        {
            "prompt_id": PROMPTS,
            "difficulty": [DIFFICULTY[p] for p in PROMPTS],
            "prompt_text": [f"Q{p}?" for p in PROMPTS],  # the column a run's prompts table has
        }
    )
    store.write_run_table("prompts", prompts)
    store.write_table(0, "eval", _eval(0))
    for t in range(steps):
        store.write_table(t, "budget", _budget(t))
        store.write_table(t, "rollouts", _rollouts(t, completion))
        rewards = _rewards(t)
        store.write_table(t, "rewards", rewards)
        store.write_table(t, "capability", _capability(t, rewards))
        store.write_table(t, "update", _update(t))
    store.write_table(steps, "budget", _budget(steps))
    if steps == 3:
        store.write_table(3, "eval", _eval(3))
    if half_step == "rewards":
        store.write_table(steps, "rollouts", _rollouts(steps))
        store.write_table(steps, "rewards", _rewards(steps))
    if finished:
        store.write_json(
            "summary.json",
            {
                "steps": steps,
                "strategy": "coba",
                "total_rollouts": steps * len(PROMPTS) * GROUP,
                "heldout_accuracy_before": ACC_BEFORE,
                "heldout_accuracy_after": ACC_AFTER,
                "wall_seconds": 12.5,
                "stage_seconds": {
                    "rollouts": 4.0,
                    "rewards": 0.5,
                    "capability": 0.25,
                    "budget": 0.25,
                    "update": 6.0,
                    "eval": 1.0,
                },
            },
        )
    return store


def _check_png(path: Path) -> None:
    import matplotlib.image as mpimg

    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path.name} is not a PNG"
    assert len(data) > 5_000, f"{path.name} is suspiciously small ({len(data)} bytes)"
    img = mpimg.imread(path)
    assert img.ndim == 3 and img.shape[2] in (3, 4)
    assert img.shape[1] >= 600 and img.shape[0] >= 150, f"{path.name}: {img.shape}"
    assert float(img[..., :3].std()) > 0.01, f"{path.name} is blank"


def _img_srcs(page: str) -> list[str]:
    return re.findall(r'<img src="([^"]+)"', page)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("run") / "finished"
    make_run(root)
    files = build_report(root)
    return root, files


def test_finished_run_writes_every_png_and_the_page(finished_run):
    root, files = finished_run
    out = root / "report"
    assert files.html == out / "index.html" and files.html.is_file()
    assert [p.name for p in files.pngs] == list(PLOT_FILES)
    assert files.skipped == {}
    for name in PLOT_FILES:
        _check_png(out / name)
    assert not list(out.glob(".*.tmp")), "atomic_write left a temporary file"

    page = files.html.read_text(encoding="utf-8")
    assert sorted(_img_srcs(page)) == sorted(PLOT_FILES)  # relative src, one per PNG
    assert f"{ACC_BEFORE:.3f} -&gt; {ACC_AFTER:.3f}" in page  # 0.312 -> 0.531: the rows of `coba inspect`
    assert "144 rollouts" in page  # total rollouts: 3 steps x 12 prompts x 4
    assert "coba" in page and "3/3 steps done" in page
    # the sampler/trainer gap of the update tables: mean 2e-3 over the 3 steps, largest token 0.0375
    assert "train/rollout log-prob gap" in page and "mean over steps 2.00e-03, largest token 3.75e-02" in page
    assert str(root.resolve()) in page


def test_write_report_returns_the_html_path_and_scatter_steps_can_be_chosen(tmp_path):
    root = tmp_path / "run"
    make_run(root, finished=False)
    html_path = write_report(root, steps_for_scatter=[0, 2])
    assert html_path == root / "report" / "index.html"
    assert "Steps shown: 0, 2." in html_path.read_text(encoding="utf-8")
    with pytest.raises(ValueError, match=r"step\(s\) 7 have no budget table \(steps with one: 0-3\)"):
        write_report(root, steps_for_scatter=[7])


def test_without_summary_stage_time_is_skipped_and_the_page_says_why(tmp_path):
    root = tmp_path / "run"
    make_run(root, finished=False)
    (root / "report").mkdir()
    (root / "report" / STAGE_TIME_PNG).write_bytes(b"stale")  # from an earlier report: must not survive
    files = build_report(root)
    out = root / "report"
    assert not (out / STAGE_TIME_PNG).exists()
    assert STAGE_TIME_PNG in files.skipped and "summary.json not found" in files.skipped[STAGE_TIME_PNG]
    page = files.html.read_text(encoding="utf-8")
    assert STAGE_TIME_PNG not in _img_srcs(page)
    assert f"<code>{STAGE_TIME_PNG}</code> not drawn: summary.json not found" in page
    for src in _img_srcs(page):
        _check_png(out / src)
    # The headline figures come from the tables when there is no summary.
    assert f"{ACC_BEFORE:.3f} -&gt; {ACC_AFTER:.3f}  (step 0 -&gt; step 3" in page
    assert "not finished (running or stopped)" in page


@pytest.mark.parametrize("half_step", ["budget", "rewards"])
def test_half_finished_run_still_reports(tmp_path, half_step):
    root = tmp_path / "run"
    store = make_run(root, steps=2, finished=False, half_step=half_step)
    # A table being written: the file exists but the manifest has no entry, so it is not done.
    (store.step_dir(2) / "capability.parquet").write_bytes(b"not parquet yet")
    files = build_report(root)
    for p in files.pngs:
        _check_png(p)
    page = files.html.read_text(encoding="utf-8")
    assert "2/2 steps done" in page and f"{ACC_BEFORE:.3f} -&gt; {ACC_BEFORE:.3f}" in page
    assert "(step 0 -&gt; step 0; evaluated at 0)" in page  # only step 0 was evaluated
    verdict_steps = report._load(root).verdicts_by_step()[0].index.tolist()
    assert verdict_steps == ([0, 1, 2] if half_step == "rewards" else [0, 1])  # verdicts from rewards.parquet


def test_not_a_run_raises_a_clear_value_error(tmp_path):
    with pytest.raises(ValueError, match="no such run directory"):
        write_report(tmp_path / "missing")
    (tmp_path / "plain").mkdir()
    with pytest.raises(ValueError, match=r"no run here \(run.json is missing\)"):
        write_report(tmp_path / "plain")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        write_report(tmp_path / "file")


def test_a_run_without_finished_steps_raises(tmp_path):
    store = RunStore(tmp_path / "fresh")
    store.create(config_dict={"run": {"steps": 3}}, config_hash="abc", versions={})
    store.write_table(0, "budget", _budget(0))
    with pytest.raises(ValueError, match="no steps done yet"):
        write_report(store.root)
    assert not (store.root / "report" / "index.html").exists()


def test_markdown_lists_headline_figures_and_pngs(finished_run):
    root, files = finished_run
    md = report_artifacts_markdown(root)
    assert "| held-out acc | 0.312 -> 0.531  (step 0 -> step 3; evaluated at 0, 3) |" in md
    assert "144 rollouts |" in md and "| run | finished, " in md
    for p in files.pngs:  # each path shown as written (the run directory's name is the user's: not markdown)
        assert f"- {markdown_text(p)}\n" in md


def test_markdown_shows_the_run_directory_as_written(finished_run, tmp_path):
    """A run directory whose name is markdown (an image, a link, code, a cell) reached the report artifact as
    markdown; rendered now, its name is text and the only images are the plots, inline."""
    import shutil

    from markdown_it import MarkdownIt

    root = shutil.copytree(finished_run[0], tmp_path / "r ![i](http:x.png) [a](b) `c` | *s*")
    page = MarkdownIt("commonmark").enable("table").render(report_artifacts_markdown(root))
    assert f"<h3>coba-rl report: {html.escape(str(root))}</h3>" in page
    srcs = _img_srcs(page)
    assert len(srcs) == len(ARTIFACT_FILES) and all(s.startswith("data:image/png;base64,") for s in srcs)
    assert "<a " not in page and "<code>" not in page and "<em>" not in page
    assert f"<li>page: {html.escape(str(root / 'report' / 'index.html'))}</li>" in page


def test_cli_subcommand(finished_run, capsys):
    root, _ = finished_run
    parser = argparse.ArgumentParser(prog="coba")
    sub = parser.add_subparsers(dest="command")
    rep = add_report_parser(sub)
    assert "examples:" in rep.format_help() and "--steps 0,8,16" in rep.format_help()

    args = parser.parse_args(["report", "--run-dir", str(root), "--steps", "1,3"])
    assert args.steps == [1, 3]
    assert args.func(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == str(root / "report" / "index.html")
    assert {Path(x).name for x in lines[1:]} == set(PLOT_FILES)
    assert "Steps shown: 1, 3." in (root / "report" / "index.html").read_text(encoding="utf-8")

    with pytest.raises(SystemExit):
        parser.parse_args(["report", "--run-dir", str(root), "--steps", "1,x"])
    capsys.readouterr()
    with pytest.raises(SystemExit):
        parser.parse_args(["report"])  # --run-dir is required


def test_steps_where_no_group_was_mixed_are_counted_and_shown(tmp_path):
    """A step whose every group scored alike (zero_variance_groups 1.0) taught nothing: the summary lists
    those steps, the longest run of them in a row, and a row says what to change."""
    from coba_tasks.readers.figures import NO_SIGNAL_STEPS, no_signal_streak, run_summary
    from coba_tasks.readers.text import summary_rows

    store = make_run(tmp_path / "run", steps=3)
    for t in (1, 2):  # steps 1 and 2: every group all-equal
        cap = store.read_table(t, "capability").assign(zero_variance_groups=1.0)
        store.write_table(t, "capability", cap)
    s = run_summary(store.root)
    assert s["no_signal"] == {"steps": [1, 2], "longest": 2}
    assert (no_signal_streak(store, 0), no_signal_streak(store, 1), no_signal_streak(store, 2)) == (0, 1, 2)
    rows = dict(summary_rows(s))
    assert NO_SIGNAL_STEPS == 2
    assert rows["no signal"].startswith("steps 1-2 (2 of 3, 2 in a row): every group's rollouts scored alike")
    assert "data.difficulties" in rows["no signal"] and "coba inspect" in rows["no signal"]
    clean = run_summary(make_run(tmp_path / "clean", steps=3).root)
    assert clean["no_signal"] == {"steps": [], "longest": 0} and "no signal" not in dict(summary_rows(clean))


def test_the_page_shows_what_came_back_escaped_with_budgets_estimates_and_the_sql_for_the_rest(tmp_path):
    from markupsafe import escape as markup_escape

    from coba_tasks.readers.samples import COMPLETIONS_SHOWN, PROMPTS_SHOWN, samples_sql
    from coba_tasks.readers.sql import run_sql

    hostile = '</pre><script>alert("x")</script><img src=x onerror=alert(1)> & 2+2=4'
    store = make_run(tmp_path / "run", completion=hostile)
    page = write_report(store.root).read_text()
    heading = '<h2 id="what-came-back">Training rollouts that came back</h2>'
    came_back = page[page.index(heading) : page.index("<h2>Paths</h2>")]
    # evaluations at steps 0 and 3: the rollouts of step 0, and of step 2 (no training step 3 was run)
    assert "<h3>Step 0: the training rollouts of the policy after 0 updates</h3>" in came_back
    assert (
        "<h3>Step 2: the training rollouts of the policy after 2 updates, the nearest to the held-out evaluation "
        "after 3 updates (no training step follows it)</h3>" in came_back
    )
    assert "<script>" not in page and "onerror=alert(1)>" not in page
    assert came_back.count(str(markup_escape(hostile))) == 2 * PROMPTS_SHOWN * COMPLETIONS_SHOWN
    budget = _budget(2).sort_values(["budget", "prompt_id"], ascending=[False, True], kind="stable")
    top = budget.iloc[0]
    est = "never seen (no estimate)" if np.isnan(top["pass_rate_est"]) else f"{top['pass_rate_est']:.2f}"
    line = f"<code>{top['prompt_id']}</code>: budget {top['budget']} rollouts, pass-rate estimate used {est}"
    assert line in came_back
    assert f"Q{top['prompt_id']}?" in came_back and "correct, reward 1" in came_back
    # the query the page gives lists every completion of the step
    assert html_escape(samples_sql(2)) in came_back
    rest = run_sql(store.root, samples_sql(2))
    assert len(rest) == len(PROMPTS) * GROUP and set(rest["completion"]) == {hostile}


def html_escape(text: str) -> str:
    return html.escape(text)


def test_a_report_dir_linked_out_of_the_run_is_refused_and_what_it_points_to_is_untouched(tmp_path, capsys):
    """report/ a symlink to a directory elsewhere: `coba report` wrote its PNGs there and deleted a stale one
    through the link. Refused in one line now, the directory as it was."""
    from coba_tasks.commands.cli import main

    store = make_run(tmp_path / "run")
    elsewhere = tmp_path / "photos"
    elsewhere.mkdir()
    (elsewhere / "accuracy.png").write_bytes(b"my picture")
    (elsewhere / "stage_time.png").write_bytes(b"another")
    (store.root / "report").symlink_to(elsewhere)
    assert main(["report", "--run-dir", str(store.root)]) == 2
    assert sorted(p.name for p in elsewhere.iterdir()) == ["accuracy.png", "stage_time.png"]
    assert (elsewhere / "accuracy.png").read_bytes() == b"my picture"
    (err,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert "outside the run directory" in err and "replace the link by the real" in err


def test_the_page_shows_held_out_completions_the_evaluation_kept_escaped(tmp_path):
    """The newest evaluation kept each prompt's first sampled and greedy completion: per difficulty level the page
    shows a prompt whose sampled completion was correct and one whose was not, with its text, escaped; runs whose
    evaluations kept none say so. The training rollouts are headed as training rollouts."""
    from markupsafe import escape as markup_escape

    hostile = '</pre><script>alert("held out")</script>'
    store = make_run(tmp_path / "run")
    page = write_report(store.root).read_text()
    assert "No held-out evaluation kept its completions" in page
    table = store.read_table(3, "eval")
    n = len(table)
    verdicts = ["correct" if i % 2 else "wrong" for i in range(n)]
    table = table.assign(
        prompt_text=[f"held-out question {i}" for i in range(n)],
        sample_completion=[f"{hostile} sampled {i}" for i in range(n)],
        sample_verdict=verdicts,
        greedy_completion=[f"greedy {i}" for i in range(n)],
        greedy_verdict="wrong",
    )
    store.write_table(3, "eval", table)
    page = write_report(store.root).read_text()
    part = page[page.index('<h2 id="held-out">Held-out completions</h2>') : page.index('<h2 id="what-came-back">')]
    assert "The evaluation of the weights after 3 updates" in part and "and its greedy one" in part
    levels = sorted(set(table["difficulty"]))
    shown = [i for i in range(n) if f"sampled {i}</pre>" in part]
    assert len(shown) == 2 * len(levels)  # per level one solved, one not
    assert sorted(verdicts[i] for i in shown) == ["correct"] * len(levels) + ["wrong"] * len(levels)
    assert str(markup_escape(hostile)) in part and "<script>" not in page
    assert all(f"held-out question {i}" in part and f"greedy {i}" in part for i in shown)
    assert '<h2 id="what-came-back">Training rollouts that came back</h2>' in page
