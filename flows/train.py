"""The training flow: per step, the stages budget -> rollouts -> rewards -> capability -> update, as Prefect
tasks over the run directory's Parquet tables.

    coba run                                      # configs/demo.yaml, runs/<run.name>
    coba run --config configs/tiny-test.yaml --run-dir runs/t --steps 2 --set optim.lr=3e-5

This module only composes. ``run_step`` calls the stage tasks of ``coba_tasks.pipeline.stages`` in the order
the run directory's contract gives (``store.step_stages``; a step sampled in rounds, the pilot estimator's
included, a round at a time); each task's body is that stage's work (skipped when its table is done). Tasks
pass the run directory and a step number: the long-lived resources of a run (the rollout engine, the
verifier pool, the policy's weights) live in the flow process and are looked up by directory
(``coba_tasks.pipeline.run``); which weights the trainer and the engine hold is the policy's
(``coba_tasks.pipeline.policy``), never the flow's.
What the flow shows of a step (its progress line, its artifacts, the trackers, summary.json) is read back
from the tables by ``coba_tasks.readers``.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger

from coba_tasks.pipeline import deployment, progress, run
from coba_tasks.pipeline.config import Config
from coba_tasks.pipeline.evaluation import due_evaluations, eval_plan, evaluate_step, run_complete, run_eval_steps
from coba_tasks.pipeline.policy import Advanced, ReplayError, RunStopped
from coba_tasks.pipeline.runlock import RunLock
from coba_tasks.pipeline.stages import limited, step_tasks, write_step_timing
from coba_tasks.pipeline.store import SUMMARY_FILE, Table
from coba_tasks.pipeline.tables import after_updates, step_label
from coba_tasks.readers import trackers
from coba_tasks.readers.figures import (
    NO_SIGNAL_FIX,
    NO_SIGNAL_STEPS,
    eval_figures,
    generated_counts,
    no_signal_streak,
    step_figures,
)
from coba_tasks.readers.figures import summary_json as make_summary_json
from flows.gpu import gpu_slot
from flows.view import RunView, flow_run_title, run_failed


def run_step(run_dir: str, step: int, view: RunView | None = None) -> None:
    """One training step: its stage tasks in order, then its progress line and, with a ``view``, its artifacts
    and events (``flows.view``).

    The training flow calls this inline: a subflow per step cost about 1.1 s of orchestration per
    step on the embedded server (measured: 1.31 s -> 0.19 s per step on the demo config).
    """
    res, t0 = run.resources(run_dir), time.perf_counter()
    seconds_before = dict(res.stage_seconds)
    for stage_task, r in step_tasks(res, step):  # a step sampled in rounds: the round pair again while it asks
        stage_task(run_dir, step, r)
        where = f" (round {r})" if stage_task.name in (Table.ROUND, Table.ROUND_REWARDS) else ""
        res.policy.stop(f"the {stage_task.name} stage{where} of {step_label(step, res.cfg.run.steps)}")  # when asked
    seconds = write_step_timing(res, step, seconds_before)
    figures = step_figures(res.store, step)
    k = res.cfg.allocation.pilot_rollouts if res.cfg.allocation.piloted else 0
    quiet = no_signal_streak(res.store, step)  # steps in a row whose every group scored alike
    elapsed = time.perf_counter() - t0
    counts = generated_counts(res.store, step)
    if counts and res.cfg.run.rollout_budget:
        counts["rollout_budget"] = res.cfg.run.rollout_budget  # the run ends at this many: said beside the total
    line = step_line(step, res.cfg.run.steps, figures, seconds, elapsed, no_signal=quiet, pilot=k, counts=counts)
    log = get_run_logger()
    (log.warning if quiet >= NO_SIGNAL_STEPS else log.info)(line)
    if view is not None:
        view.step_done(step, figures, quiet)


def step_line(
    step: int,
    steps: int,
    figures: dict[str, dict],
    seconds: dict[str, float],
    elapsed: float,
    no_signal: int = 0,
    pilot: int = 0,
    counts: dict[str, int] | None = None,
) -> str:
    """The step's progress line: pass rate, failure rate and Beta shape, its budgets, the update, time.

    ``figures``: the stage figures of the step (``budget``, ``rollouts``, ``rewards``, ``capability``,
    ``update``); ``seconds``: the step's seconds per stage; ``elapsed``: the step's wall seconds;
    ``no_signal``: how many steps in a row, ending at this one, had no mixed group (every advantage 0): from
    ``NO_SIGNAL_STEPS`` on, the line says that nothing is learned and what to change. ``pilot``: the pilot's
    rollouts per prompt under ``allocation.estimator = pilot``. ``counts``: ``readers.figures.generated_counts``
    (what the update trained on, when it is not all the step generated, and the run's rollouts so far), with
    ``rollout_budget`` under ``run.rollout_budget``: the run's end, said as the total to reach (``steps`` is then
    the most steps).

    >>> print(step_line(2, 10, {
    ...     "rollouts": {"rollouts": 128},
    ...     "rewards": {"correct": 40, "wrong": 80, "no_answer": 8, "timeout": 0, "error": 0},
    ...     "capability": {"S": 0.31, "F": 0.69, "alpha": 8.2, "beta": 2.8},
    ...     "budget": {"min": 2, "max": 24, "mean": 8.0},
    ...     "update": {"loss": -0.0123, "grad_norm": 0.52},
    ... }, {"rollouts": 21.7, "rewards": 0.4, "update": 25.1}, 49.6,
    ... counts={"rollouts_generated": 128, "rollouts_trained": 96, "rollouts_generated_total": 384}))
    step 2 (3 of 10): pass rate 0.31 (mean over prompts; 40/128 rollouts correct, 8 unanswered); F 0.69 -> alpha 8.20 \
beta 2.80; budgets 2-24 (mean 8.0); loss -0.0123, grad norm 0.52 on 96 of them; 384 rollouts so far; 50 s \
(rollouts 22 s, update 25 s)
    """
    verdicts, cap, budget, upd = figures["rewards"], figures["capability"], figures["budget"], figures["update"]
    other = {k: v for k, v in verdicts.items() if k not in ("correct", "wrong") and v}
    notes = ([f"{other.pop('no_answer')} unanswered"] if "no_answer" in other else []) + [
        f"{v} {k}" for k, v in other.items()
    ]
    parts = ", ".join(f"{k} {v:.0f} s" for k, v in seconds.items() if k in ("rollouts", "update"))
    most = bool(counts and counts.get("rollout_budget"))  # the run ends at its rollouts
    return (
        f"{step_label(step, steps, most)}: pass rate {cap['S']:.2f} (mean over prompts; {verdicts['correct']}/"
        f"{figures['rollouts']['rollouts']} rollouts correct"
        + "".join(f", {x}" for x in notes)
        + f"); F {cap['F']:.2f} -> alpha {cap['alpha']:.2f} beta "
        f"{cap['beta']:.2f}; budgets {budget['min']}-{budget['max']} (mean "
        f"{budget['mean']:.1f}{f', a pilot of {pilot} each' if pilot else ''}); loss "
        f"{upd['loss']:+.4f}, grad norm {upd['grad_norm']:.2f}{_counts_text(counts)}; {elapsed:.0f} s ({parts})"
        + _no_signal_text(no_signal)
    )


def _counts_text(counts: dict[str, int] | None) -> str:
    if not counts:
        return ""
    trained, generated = counts["rollouts_trained"], counts["rollouts_generated"]
    part = f" on {trained} of them" if trained != generated else ""
    budget = counts.get("rollout_budget")
    of = f" of the run's {budget:,}" if budget else ""
    return f"{part}; {counts['rollouts_generated_total']:,}{of} rollouts so far"


def _no_signal_text(steps: int) -> str:
    if steps >= NO_SIGNAL_STEPS:
        return (
            f"; no group has had a non-zero advantage for {steps} steps in a row (every group's rollouts scored "
            f"alike): nothing is learned; {NO_SIGNAL_FIX}"
        )
    return f"; no group mixed ({steps} step{'s' if steps > 1 else ''} in a row)" if steps else ""


@flow(name="coba-train", flow_run_name=flow_run_title)
def train_flow(
    config: Config | None = None,
    config_path: str | None = None,
    run_dir: str | None = None,
    resume: bool = False,
    allow_changed_inputs: bool = False,
    run_name: str | None = None,
    overrides: list[str] | None = None,
) -> dict[str, Any]:
    """A whole training run: held-out eval before, ``run.steps`` training steps, eval every ``eval_every``, eval after.

    Stages already done (in their step's manifest) are not recomputed, so the flow run can be retried or resumed
    after a crash and ends with the same tables as an uninterrupted run; a finished run is not trained, evaluated
    or posted again. Started from a deployment, every path stays inside the project or its worker's roots and
    ``config_path``'s text is never quoted in an error (``coba_tasks.pipeline.deployment``); a reward file runs only
    where the process allows it. The flow run is named after the run when Prefect creates it (``flow_run_title``).

    Args:
        config: The run's config, section by section (keys left out take their defaults); instead of config_path.
        config_path: A YAML config file of the project (default configs/demo.yaml), used when config is empty.
        run_dir: The run directory (default runs/<run.name>); a directory holding a run of the same config
            continues it.
        resume: Continue the run in run_dir with its own config (config, config_path and overrides are not read).
        allow_changed_inputs: Let a continuing run go on although data.test, model.path or the reward file
            changed since it started.
        run_name: Sets run.name (the default run directory runs/<run.name>).
        overrides: Config changes as section.key=value strings, as `coba run --set` (e.g. optim.lr=3e-6).
    """
    log = get_run_logger()
    from_api = deployment.started_by_deployment()
    cfg, root, continuing = run.resolve_run(config_path, run_name, run_dir, overrides, config, resume, from_api)
    t_start = time.perf_counter()
    existed = root.exists()  # a new run's directory is missing or empty here (resolve_run checked)
    lock = RunLock(root)
    lock.acquire()  # one writer per run directory (a dead holder's lock is taken over)
    try:
        res = run.open_run(root, cfg, continuing, warn=log.warning, allow_changed_inputs=allow_changed_inputs)
    except BaseException:
        lock.release()
        if not continuing and not existed:  # a failed start leaves nothing behind
            run.remove_empty_run_dir(root)
        raise
    directory = str(res.store.root)
    trk, slot = None, ExitStack()
    try:
        if run_complete(res.store, cfg):  # finished: a retry computes nothing, posts nothing again
            log.info(
                f"{root} is a finished run (every step and evaluation done, its {SUMMARY_FILE} written): nothing "
                f"to compute or post; `coba inspect --run-dir {root}` shows it, `coba rerun` recomputes a stage"
            )
            return res.store.read_json(SUMMARY_FILE)
        slot.enter_context(gpu_slot())  # CUDA: the GPU's one slot (coba-gpu), held until the engine is gone
        trk = trackers.open_trackers(directory, cfg, warn=log.warning)  # run.trackers, continued on a resume
        first = progress.first_step_not_done(res.store, progress.run_length(res.store, cfg))
        due = due_evaluations(res, first)  # a kill, a rerun or a repair left these
        res.policy.start(upto=min([first, *due]))  # the newest checkpoint the evaluations and the steps start from
        if first > 0:
            log.info(f"continuing {root} at {step_label(first, cfg.run.steps)}: stages already done are skipped")
        view = RunView(res, first)  # the flow run named after the run; its artifacts and events
        log.info(f"held-out evaluation before training: {eval_plan(res)}")
        _held_out(res, view, 0, "before training")
        for version in due:
            try:
                _say_advanced(res.policy.advance(version), version)
            except ReplayError as exc:  # the weights of that step cannot be rebuilt here: the run goes on without it
                log.warning(f"held-out evaluation {after_updates(version)} left missing: {exc}")
                continue
            _held_out(res, view, version, f"{after_updates(version)} (recomputed)")
        _say_advanced(res.policy.advance(first), first)  # from the newest whole checkpoint at or below it
        trk.log_new()  # each tracker logs the steps whose tables are complete and it has not logged
        run.step_boundary(res, first)  # between steps: a watcher of the run (coba compare's forks) is called
        with run.stop_on_signals(res, log.warning):  # Ctrl-C, SIGTERM: stop after the stage, with a checkpoint
            step = first
            while step < progress.run_length(res.store, cfg):  # run.steps, or fewer once run.rollout_budget is spent
                # Prefect's own cost per step: the step's wall time minus the time spent inside the stage
                # bodies (the same code a plain function call would run), measured in this run
                t0, inside0 = time.perf_counter(), sum(res.stage_seconds.values())
                run_step(directory, step, view)
                wall = time.perf_counter() - t0
                res.step_walls.append((wall, wall - (sum(res.stage_seconds.values()) - inside0)))
                step += 1
                if step in run_eval_steps(res.store, cfg) and step < progress.run_length(res.store, cfg):
                    _held_out(res, view, step, after_updates(step))
                trk.log_new()
                run.step_boundary(res, step)
                res.policy.stop(step_label(step - 1, cfg.run.steps))
        log.info(f"held-out evaluation after training: {eval_plan(res)}")
        _held_out(res, view, progress.run_length(res.store, cfg), "after training")
        trk.log_new()
        summary = make_summary_json(res.store.root, time.perf_counter() - t_start, res.stage_seconds, res.step_walls)
        res.store.write_json(SUMMARY_FILE, summary)
        _post_report(res.store.root, view)
        return summary
    except Exception as exc:  # a failed run says so as an event, for an automation to tell someone
        if not isinstance(exc, RunStopped):
            run_failed(res.store.root, cfg, exc)
        raise
    finally:
        if trk is not None:
            trk.close()
        run.close_run(res)
        slot.close()
        lock.release()


def _held_out(res: run.RunResources, view: RunView, step: int, when: str) -> None:
    """The held-out evaluation of the weights after ``step`` updates (its task), its artifact and event, its line."""
    limited(evaluate_step, res.cfg)(str(res.store.root), step)  # with run.eval_timeout_s
    view.evaluation_done(step)
    get_run_logger().info(f"held-out accuracy {when}: {_eval_text(res, step)}")


def _say_advanced(done: Advanced, version: int) -> None:
    line = done.line(version)
    if line:
        get_run_logger().info(line)


def _eval_text(res: run.RunResources, step: int) -> str:
    """The evaluation of the weights after ``step`` updates in one line: avg@k (greedy, pass@k) by level, and
    each extra held-out set's avg@k."""
    figures = eval_figures(res.store.read_table(step, Table.EVAL))
    levels = " ".join(f"L{k} {v:.2f}" for k, v in figures["by_difficulty"].items())
    text = f"{figures['accuracy']:.3f}" + (
        f" (greedy {figures['greedy']:.3f})" if figures["greedy"] == figures["greedy"] else ""
    )
    k = max(figures["pass_at_k"], key=int, default="1")
    text += f"; pass@{k} {figures['pass_at_k'][k]:.3f}" if k != "1" else ""
    text += f"; by level {levels}" if levels else ""
    for name, f in (figures.get("test_sets") or {}).items():
        text += f"; {name} {f['accuracy']:.3f}"
    return text


def _post_report(root: Path, view: RunView) -> None:
    """Draw the run's report (PNG plots + index.html) and post it as a Prefect artifact, its plots inline.

    A plotting failure is logged, never allowed to fail a finished run: `coba report` redraws it.
    """
    from coba_tasks.readers.report import report_artifacts_markdown, write_report

    try:
        html = write_report(root)
    except Exception as exc:  # the run is done; the report can be redrawn
        get_run_logger().warning(f"report not drawn ({exc}); draw it with: coba report --run-dir {root}")
        return
    view.report(html, report_artifacts_markdown(root))
