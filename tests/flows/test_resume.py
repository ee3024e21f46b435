"""Resume and rerun: a run killed inside each stage in turn, resumed, equals an uninterrupted run.

The killed runs are separate processes (``coba run`` / ``coba resume``) that SIGKILL themselves
inside a named stage (``COBA_KILL_AT=<step>:<stage>``, after the stage's work is done and before
its table is recorded); they talk to the session's Prefect test server.

The runs train the random tiny model on prompts scored by a reward it earns (tests/helpers_reward.py):
every update moves the weights (checked), so a resume that lost the optimizer state or loaded the wrong
checkpoint ends with other weights than the uninterrupted run. Subprocesses run through
``python_with_first_char`` so that they score those prompts too.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch
from helpers_reward import assert_updates_moved, data_overrides, python_with_first_char
from safetensors.torch import load_file

from coba_tasks.commands.cli import main as cli_main
from coba_tasks.pipeline import update_batch
from coba_tasks.pipeline.config import config_to_dict, load_config
from coba_tasks.pipeline.rerun import apply_rerun, plan_rerun
from coba_tasks.pipeline.store import STAGES, RunStore, StoreError, Table

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3
TABLES = (*STAGES, Table.HISTORY, Table.EVAL)


def _overrides(model: Path, data: tuple[Path, Path], backend: str = "vllm") -> list[str]:
    """``data``: the ``first_char_data`` fixture's (train, test) files."""
    base = [f"model.path={model}", "data.train_prompts=6", f"run.steps={STEPS}", "run.eval_every=1"]
    return [*base, f"rollout.backend={backend}", *data_overrides(data)]


def _all_tables(store: RunStore) -> dict[tuple[int, str], pd.DataFrame]:
    out = {}
    for step in store.steps():
        for name in store.manifest(step):
            out[(step, name)] = store.read_table(step, name)
    for name in ("prompts", "history"):
        out[(-1, name)] = store.read_run_table(name)
    return out


def _checkpoints(store: RunStore) -> list[int]:
    root = store.root / "checkpoints"
    return sorted(int(p.name) for p in root.iterdir() if p.is_dir() and p.name.isdigit()) if root.is_dir() else []


def _assert_same_run(a: RunStore, b: RunStore, base_model: Path) -> None:
    """The same tables, and every checkpoint of ``a`` in ``b`` with the same weights and trainer state (``b``
    may hold more: the one a stop wrote)."""
    ta, tb = _all_tables(a), _all_tables(b)
    assert sorted(ta) == sorted(tb)
    for key in ta:
        pd.testing.assert_frame_equal(ta[key], tb[key], check_exact=True, obj=str(key))
    assert _checkpoints(a) and set(_checkpoints(a)) <= set(_checkpoints(b))
    for step in _checkpoints(a):  # the weights after every update checkpointed, bit for bit
        wa = load_file(str(a.checkpoint_dir(step) / "model.safetensors"))
        wb = load_file(str(b.checkpoint_dir(step) / "model.safetensors"))
        assert wa.keys() == wb.keys() and all(bool((wa[k] == wb[k]).all()) for k in wa), step
    _assert_same_trainer_state(a, b, _checkpoints(a))
    for store in (a, b):  # and they are trained weights, not copies of the base model
        assert_updates_moved(store, base_model, STEPS)


def _assert_same_trainer_state(a: RunStore, b: RunStore, steps: int | list[int] = STEPS) -> None:
    """Every checkpoint's AdamW moments and step counts and trainer state, bit for bit.

    Not the saved torch RNG state (``rng.torch``): the in-process engine's sampled rollouts advance the
    global torch generator, so it depends on which stages this process ran (a resumed run skips the ones
    done); nothing in the update draws from it (its shuffle has a generator of its own)."""
    for step in range(1, steps + 1) if isinstance(steps, int) else steps:
        da, db = a.checkpoint_dir(step), b.checkpoint_dir(step)
        oa, ob = (load_file(str(d / "trainer/optimizer.safetensors")) for d in (da, db))
        assert oa.keys() == ob.keys(), step
        assert all(torch.equal(oa[k], ob[k]) for k in oa if k != "rng.torch"), step
        sa, sb = (json.loads((d / "trainer/trainer_state.json").read_text()) for d in (da, db))
        assert sa == sb and sa["updates"] == step, step


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, prefect_harness, random_checkpoints, first_char_data) -> RunStore:
    """An uninterrupted 3-step run (in this process)."""
    from flows.train import train_flow

    model, _ = random_checkpoints
    cfg = load_config(ROOT / "configs/tiny-test.yaml", _overrides(model, first_char_data))
    run_dir = tmp_path_factory.mktemp("baseline") / "run"
    train_flow(run_dir=str(run_dir), config=config_to_dict(cfg))
    return RunStore.open(run_dir)


def _failed_run(run_dir: Path, cfg: dict, at: str, fail: Path) -> tuple[Any, RunStore]:
    """A new run of ``cfg`` that fails at ``at`` (``"<step>:<stage>"``, through ``COBA_FAIL_FILE``, whose file
    ``fail`` stays for the caller to remove or keep): its final state, checked failed, and its store."""
    from coba_tasks.pipeline.faults import FAIL_FILE_ENV
    from flows.train import train_flow

    fail.write_text(at)
    os.environ[FAIL_FILE_ENV] = str(fail)
    try:
        state = train_flow(run_dir=str(run_dir), config=cfg, return_state=True)
    finally:
        del os.environ[FAIL_FILE_ENV]
    assert state.is_failed()
    return state, RunStore.open(run_dir)


def _coba(args: list[str], kill_at: str | None, log: Path) -> int:
    from prefect.settings import PREFECT_API_URL

    env = dict(os.environ, PREFECT_API_URL=str(PREFECT_API_URL.value()), PYTHONPATH=str(ROOT))
    env.pop("COBA_KILL_AT", None)
    for key in ("VLLM_LOGGING_LEVEL", "VLLM_LOGGING_STREAM"):  # set by this process's own engine: as a user's shell
        env.pop(key, None)
    if kill_at:
        env["COBA_KILL_AT"] = kill_at
    with open(log, "ab") as out:
        proc = subprocess.run(
            python_with_first_char("coba_tasks.commands.cli", *args),
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=out,
            timeout=600,
        )
    return proc.returncode


CHATTER = (  # what the libraries print at start-up and per task, which `coba` turns down (commands/console.py)
    "Task run '",  # Prefect's line per task ("Finished in state Completed()"); the flow's own stay
    "RotaryEmbedding",  # vLLM's at every weight load
    "Loading weights",
    "FutureWarning",
    "NUMA binding",
    "Triton",
)


@pytest.mark.slow
def test_killed_in_each_stage_then_resumed_equals_uninterrupted(
    tmp_path, prefect_harness, random_checkpoints, first_char_data, capsys
):
    """A checkpoint every 2 updates (of 3): each resume loads the newest at or below its step (none before step
    2: the base model) and replays the updates after it from the tables. Then a run stopped with SIGTERM in the
    rollouts of step 1: it finishes the stage, writes the policy it holds as checkpoints/000001, says how to
    continue, and its resume ends as the uninterrupted run.
    Rollouts from transformers: the `coba` processes each start the rollout engine, and vLLM's import
    and start cost about 15 s a process on 2 cores. A resume with a vLLM engine (a new engine loaded from the
    checkpoint samples what the engine updated in place did) is checked by the other tests here (``baseline``)."""
    model, _ = random_checkpoints
    run_dir = tmp_path / "run"
    log = tmp_path / "coba.log"
    every = [*_overrides(model, first_char_data, "transformers"), "run.checkpoint_every=2"]
    settings = [a for o in every for a in ("--set", o)]
    reference = tmp_path / "uninterrupted"
    argv = ["run", "--config", "configs/tiny-test.yaml", "--run-dir", str(reference), *settings]
    assert _coba(argv, None, tmp_path / "uninterrupted.log") == 0, (tmp_path / "uninterrupted.log").read_text()[-3000:]
    start = ["run", "--config", "configs/tiny-test.yaml", "--run-dir", str(run_dir), *settings]
    resume = ["resume", "--run-dir", str(run_dir)]
    kills = [f"1:{Table.EVAL}"]  # eval(1) on the weights after update(0), never checkpointed: replayed
    kills += [f"1:{s}" for s in STAGES]  # each stage of step 1, in the order they run
    kills.append(f"2:{Table.EVAL}")  # between update(1) and eval(2): the resume must evaluate the weights of 2
    store = RunStore(run_dir)
    for i, kill in enumerate(kills):
        rc = _coba(start if i == 0 else resume, kill, log)
        assert rc == -signal.SIGKILL, (kill, rc, log.read_text()[-3000:])
        step, stage = kill.split(":")
        assert not store.is_done(int(step), stage), kill  # killed before its table was recorded
    assert not (run_dir / "summary.json").exists()
    rc = _coba(resume, None, log)
    assert rc == 0, log.read_text()[-3000:]
    assert _checkpoints(RunStore.open(reference)) == [2, 3]  # every 2nd update and the last
    assert "the policy after 1 updates: the update of step 0 replayed from the tables" in log.read_text()
    _assert_same_run(RunStore.open(reference), RunStore.open(run_dir), model)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS
    # what the user read: one line per step and the evaluations, not the libraries' start-up chatter
    text = log.read_text()
    assert f"step {STEPS - 1} ({STEPS} of {STEPS}): pass rate " in text and "held-out accuracy after training: " in text
    for chatter in CHATTER:
        assert chatter not in text, chatter
    # a finished run: resume says so and changes nothing (in this process: it reads the run and stops)
    tables = _all_tables(store)
    capsys.readouterr()
    assert cli_main(resume) == 0 and "nothing to resume" in capsys.readouterr().out
    after = _all_tables(store)
    assert after.keys() == tables.keys()
    for key in tables:
        pd.testing.assert_frame_equal(after[key], tables[key], check_exact=True, obj=str(key))

    # stopped on purpose: SIGTERM inside the rollouts of step 1 (the policy after 1 update, not checkpointed)
    stopped = tmp_path / "stopped"
    stop_log = tmp_path / "stopped.log"
    argv = ["run", "--config", "configs/tiny-test.yaml", "--run-dir", str(stopped), *settings]
    assert _coba(argv, f"1:{Table.ROLLOUTS}:TERM", stop_log) == 128 + signal.SIGTERM, stop_log.read_text()[-3000:]
    said = stop_log.read_text()
    assert "SIGTERM: the run stops after the stage it is in, with a checkpoint" in said
    # counted as the directories and tasks count (steps/000001, rollouts-step-1), with how far into the run it is
    line = (
        "stopped by SIGTERM after the rollouts stage of step 1 (2 of 3); checkpoints/000001 holds the policy after "
        "1 update"
    )
    assert f"{line}; continue with: coba resume --run-dir {stopped}" in said
    store = RunStore.open(stopped)
    assert store.is_done(1, Table.ROLLOUTS) and not store.is_done(1, Table.REWARDS)  # the stage finished
    assert _checkpoints(store) == [1]
    assert _coba(["resume", "--run-dir", str(stopped)], None, stop_log) == 0, stop_log.read_text()[-3000:]
    _assert_same_run(RunStore.open(reference), RunStore.open(stopped), model)


@pytest.mark.slow
def test_rerun_lists_then_removes_then_recomputes(tmp_path, baseline, random_checkpoints, capsys):
    from flows.train import train_flow

    model, _ = random_checkpoints
    run_dir = tmp_path / "run"
    shutil.copytree(baseline.root, run_dir)
    store = RunStore.open(run_dir)
    before = _all_tables(store)

    assert cli_main(["rerun", "--run-dir", str(run_dir), "--step", "1", "--stage", "rewards"]) == 0
    out = capsys.readouterr().out
    assert "steps/000001/rewards.parquet" in out and "steps/000002/update.parquet" in out
    assert "steps/000001/rollouts.parquet" not in out and "nothing removed" in out
    assert _all_tables(store).keys() == before.keys()  # without --yes nothing is touched

    args = ["rerun", "--run-dir", str(run_dir), "--step", "1", "--stage", "rewards"]
    assert cli_main([*args, "--yes", "--no-resume"]) == 0
    assert store.is_done(1, Table.ROLLOUTS) and store.is_done(1, Table.BUDGET) and store.is_done(1, Table.EVAL)
    assert not store.is_done(1, Table.REWARDS) and not store.is_done(2, Table.BUDGET)
    assert not store.checkpoint_dir(2).exists() and store.checkpoint_dir(1).exists()
    assert not store.is_done(2, Table.EVAL)
    assert not (run_dir / "summary.json").exists()

    train_flow(run_dir=str(run_dir), resume=True)
    after = _all_tables(store)
    assert after.keys() == before.keys()
    for key in before:
        pd.testing.assert_frame_equal(before[key], after[key], check_exact=True, obj=str(key))
    _assert_same_run(baseline, store, model)  # checkpoints 2 and 3 recomputed from checkpoint 1: the same

    # a truncated table found on resume: --repair recomputes from it and the run is whole again
    from coba_tasks.pipeline.rerun import damaged_tables, plan_repair

    path = store.table_path(1, Table.REWARDS)
    path.write_bytes(path.read_bytes()[:100])
    assert [(s, n) for s, n, _ in damaged_tables(store)] == [(1, "rewards")]
    apply_rerun(store, plan_repair(store))  # what `coba resume --repair` does before resuming
    train_flow(run_dir=str(run_dir), resume=True)
    assert damaged_tables(store) == []
    repaired = _all_tables(store)
    for key in before:
        pd.testing.assert_frame_equal(before[key], repaired[key], check_exact=True, obj=str(key))
    _assert_same_run(baseline, store, model)


@pytest.mark.slow
def test_an_evaluation_recomputed_later_measures_the_weights_of_its_step(
    tmp_path, baseline, random_checkpoints, first_char_data
):
    """eval(0) rerun on a finished run measured the final weights (the engine the resume starts holds them) and
    recorded them as before training; eval(1), removed with --no-resume, was never computed again; a failure
    between update(1) and eval(2) left eval(2) out for good. Each is now computed on the weights after its
    step's updates (loaded from the base model or its checkpoint) and equals the uninterrupted run's table."""
    from flows.train import train_flow

    model, _ = random_checkpoints
    run_dir = tmp_path / "run"
    shutil.copytree(baseline.root, run_dir)
    store = RunStore.open(run_dir)
    assert cli_main(["rerun", "--run-dir", str(run_dir), "--step", "0", "--stage", "eval", "--yes"]) == 0
    args = ["rerun", "--run-dir", str(run_dir), "--step", "1", "--stage", "eval", "--yes", "--no-resume"]
    assert cli_main(args) == 0 and not store.is_done(1, Table.EVAL)
    train_flow(run_dir=str(run_dir), resume=True)
    for step in range(STEPS + 1):
        table = store.read_table(step, Table.EVAL)
        assert set(table["weight_version"]) == {step}
        pd.testing.assert_frame_equal(table, baseline.read_table(step, Table.EVAL), check_exact=True, obj=str(step))
    _assert_same_run(baseline, store, model)

    # a failure inside eval(2) (after update(1), before its table): the run stops; its resume evaluates step 2
    cfg = config_to_dict(load_config(ROOT / "configs/tiny-test.yaml", _overrides(model, first_char_data)))
    failed_dir, fail = tmp_path / "failed", tmp_path / "fail-at"
    _, failed = _failed_run(failed_dir, cfg, f"2:{Table.EVAL}", fail)
    assert failed.is_done(1, Table.UPDATE) and not failed.is_done(2, Table.EVAL)
    fail.unlink()
    train_flow(run_dir=str(failed_dir), resume=True)
    _assert_same_run(baseline, failed, model)


@pytest.mark.slow
def test_a_partial_checkpoint_is_passed_over_and_written_again_by_the_replay(
    tmp_path, baseline, random_checkpoints, caplog
):
    """Half of checkpoints/000002's tensors gone: the resume never trains on from a policy that is half the base
    model. It names the file, starts from checkpoints/000001, replays the update of step 1 from its tables
    (which gives its recorded figures), writes checkpoints/000002 again, and the run ends as the uninterrupted
    one did, checkpoints included."""
    import logging

    from safetensors.torch import save_file

    model, _ = random_checkpoints
    run_dir = tmp_path / "run"
    shutil.copytree(baseline.root, run_dir)
    store = RunStore.open(run_dir)
    apply_rerun(store, plan_rerun(store, 2, Table.UPDATE))  # stopped after step 1: resumes from checkpoint 2
    weights = store.checkpoint_dir(2) / "model.safetensors"
    tensors = load_file(str(weights))
    save_file({k: tensors[k] for k in sorted(tensors)[: len(tensors) // 2]}, str(weights))

    caplog.set_level(logging.WARNING, logger="coba_tasks")
    assert cli_main(["resume", "--run-dir", str(run_dir)]) == 0
    (warning,) = [r.getMessage() for r in caplog.records if "passed over" in r.getMessage()]
    assert f"{weights}: " in warning and "bytes, checkpoint.json says" in warning  # half the tensors: shorter
    _assert_same_run(baseline, store, model)


def _nudged_optimizer_steps(monkeypatch) -> None:
    """From now on every AdamW step first moves every 211th element of each gradient one ulp up: a machine whose
    kernels round a few elements otherwise. The figures an update records are computed before its optimizer step
    (its loss, its clipped gradient's norm) and stay as they were; the weights after it do not."""
    real = torch.optim.AdamW.step

    def step(self, *args, **kwargs):
        with torch.no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        g = p.grad.view(-1)[::211]
                        g.copy_(torch.nextafter(g, torch.full_like(g, float("inf"))))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", step)


@pytest.mark.slow
def test_a_replay_that_does_not_repeat_the_update_stops_the_resume_with_the_way_out(
    tmp_path, prefect_harness, random_checkpoints, first_char_data, monkeypatch
):
    """A checkpoint only at the last update, a run failed in step 2: its resume replays the updates of steps 0
    and 1 from the base model. On a machine where an update does not repeat bit for bit the first replay stops the
    resume in one line naming the step, both figures as plain numbers and the rerun that trains on from there (and
    what it deletes); nothing of step 2 is computed. Two such machines: one whose weights come out a few ulps off
    while every recorded figure is the same (the weights digest sees it: before it, that resume went on from
    weights that were not the run's), one whose loss is off in its 9th digit."""
    from coba_tasks.pipeline.policy import ReplayError
    from flows.train import train_flow

    model, _ = random_checkpoints
    overrides = [*_overrides(model, first_char_data), "run.checkpoint_every=3"]
    cfg = config_to_dict(load_config(ROOT / "configs/tiny-test.yaml", overrides))
    run_dir, fail = tmp_path / "run", tmp_path / "fail-at"
    _, store = _failed_run(run_dir, cfg, f"2:{Table.BUDGET}", fail)
    fail.unlink()
    assert store.is_done(1, Table.UPDATE) and _checkpoints(store) == []
    assert len(store.read_table(0, Table.UPDATE)["params_digest"].iloc[0]) == 16

    with monkeypatch.context() as m:
        _nudged_optimizer_steps(m)
        with pytest.raises(ReplayError, match=r"\(params_digest differs\)") as info:
            train_flow(run_dir=str(run_dir), resume=True)
    message = str(info.value)
    assert message.startswith("step 0: the update replayed from the base model gave weights ")
    stored = store.read_table(0, Table.UPDATE).iloc[0]
    # the same figures both sides, as plain numbers: only the weights differ
    assert f"loss {float(stored['loss'])!r}, grad norm {float(stored['grad_norm'])!r} where" in message
    assert "np.float64" not in message and "\n" not in message
    assert not store.is_done(2, Table.BUDGET) and _checkpoints(store) == []

    real = update_batch.update_row

    def off(step, metrics, rolled, scored):
        return real(step, {**metrics, "loss": metrics["loss"] * (1 + 1e-9)}, rolled, scored)

    monkeypatch.setattr(update_batch, "update_row", off)
    pattern = (
        r"^step 0: the update replayed from the base model gave weights [0-9a-f]{16}, loss .* where update\.parquet "
        r"holds weights [0-9a-f]{16}, loss .* \(loss differs\): this machine does not repeat the update bit for bit "
        r"\(another CPU, torch build or GPU kernels\); continue the run on the machine that trained it, or train again "
        r"from step 0 with `coba rerun --run-dir .* --step 0 --stage update --yes` \(it deletes the tables from its "
        r"update stage of step 0 on\)$"
    )
    with pytest.raises(ReplayError, match=pattern):
        train_flow(run_dir=str(run_dir), resume=True)
    assert not store.is_done(2, Table.BUDGET) and _checkpoints(store) == []


@pytest.mark.slow
def test_an_evaluation_recomputed_where_updates_do_not_repeat_costs_nothing_of_the_run(
    tmp_path, prefect_harness, random_checkpoints, first_char_data, monkeypatch, capsys, caplog
):
    """A 4-step run with a checkpoint every 3 updates, whose update of step 1 ran an operation without a
    deterministic kernel: that update's checkpoint is written, and every one after it (checkpoints 2, 3, 4; said
    once). Its evaluation after step 1 is recomputed (`coba rerun --stage eval`) on a machine where updates do not
    repeat bit for bit: the rerun says first where the resume takes its weights from; the replay of update 0 from
    the base model fails, so that evaluation is left missing with a warning, and the resume goes on from
    checkpoints/000004 (never a replay past it): it ends with exit 0, its summary, and every checkpoint as it was.
    Before, it replayed every update to the end, stopped with ReplayError, and the rerun it advised deleted the
    final checkpoint. Back on a machine that repeats the updates, a resume computes that evaluation as it was."""
    import logging

    from coba_tasks.engines.update import PolicyTrainer
    from flows.train import train_flow

    model, _ = random_checkpoints
    overrides = [*_overrides(model, first_char_data), "run.steps=4", "run.checkpoint_every=3"]
    cfg = config_to_dict(load_config(ROOT / "configs/tiny-test.yaml", overrides))
    real_update = PolicyTrainer.update

    def update(self, *args, **kwargs):
        out = real_update(self, *args, **kwargs)
        if self.updates == 2:  # the update of step 1
            self.not_repeatable = ["index_add_cuda_ does not have a deterministic implementation, but you set ..."]
        return out

    run_dir = tmp_path / "run"
    caplog.set_level(logging.WARNING)
    with monkeypatch.context() as m:
        m.setattr(PolicyTrainer, "update", update)
        train_flow(run_dir=str(run_dir), config=cfg)
    store = RunStore.open(run_dir)
    said = [r.getMessage() for r in caplog.records if "without a deterministic kernel" in r.getMessage()]
    assert said == [
        "the update of step 1 ran an operation without a deterministic kernel (index_add_cuda_ does not have a "
        "deterministic implementation, but you set ...): from now on every update is written as a checkpoint, never "
        "replayed"
    ]
    assert _checkpoints(store) == [2, 3, 4]
    finals = {k: (store.checkpoint_dir(k) / "model.safetensors").read_bytes() for k in (2, 3, 4)}
    eval1 = store.read_table(1, Table.EVAL)

    capsys.readouterr()
    args = ["rerun", "--run-dir", str(run_dir), "--step", "1", "--stage", "eval", "--yes", "--no-resume"]
    assert cli_main(args) == 0
    out = capsys.readouterr().out
    assert (
        "the resume computes the evaluation after 1 update from the base model (replaying 1 update from their " in out
    )
    assert "computes the end of the run (the policy after its last update) from checkpoints/000004 (no replay)" in out
    assert out.index("the resume computes") < out.index("removed 1 table(s)")  # said before anything was removed

    caplog.clear()
    with monkeypatch.context() as m:
        _nudged_optimizer_steps(m)
        summary = train_flow(run_dir=str(run_dir), resume=True)
    assert summary["steps"] == 4 and (run_dir / "summary.json").is_file()
    (missing,) = [r.getMessage() for r in caplog.records if "left missing" in r.getMessage()]
    assert missing.startswith("held-out evaluation after 1 update left missing: step 0: the update replayed from ")
    assert not store.is_done(1, Table.EVAL)
    assert _checkpoints(store) == [2, 3, 4]
    assert all((store.checkpoint_dir(k) / "model.safetensors").read_bytes() == finals[k] for k in finals)

    train_flow(run_dir=str(run_dir), resume=True)  # updates repeat here: the evaluation is computed as it was
    pd.testing.assert_frame_equal(store.read_table(1, Table.EVAL), eval1, check_exact=True)
    assert _checkpoints(store) == [2, 3, 4]


@pytest.mark.slow
def test_a_run_stopped_at_an_epoch_boundary_resumes_the_remaining_steps(
    tmp_path, prefect_harness, random_checkpoints, first_char_data
):
    """8 prompts, 4 per step: epoch 0 is steps 0-1, and step 2 starts epoch 1 with a new order. A run stopped
    there (step 1 and the allocation for step 2 done, nothing of step 2) resumes, runs steps 2 and 3, and ends
    equal to an uninterrupted run (a resume that lost its place in the epoch would run no step, or others)."""
    from helpers_reward import TRAIN_PROMPTS, write_flat

    from flows.train import train_flow

    model, _ = random_checkpoints
    train = write_flat(tmp_path / "train.parquet", [*TRAIN_PROMPTS, "9+9=", "2*6="], [1, 2, 3, 1, 2, 3, 1, 2])
    steps = 4
    overrides = [f"model.path={model}", f"data.train={train}", f"data.test={first_char_data[1]}", f"run.steps={steps}"]
    cfg = config_to_dict(load_config(ROOT / "configs/tiny-test.yaml", overrides))
    straight = tmp_path / "straight"  # `coba run` in a process of its own, rollouts from vLLM: what a user reads
    log = tmp_path / "coba.log"
    run = ["run", "--config", "configs/tiny-test.yaml", "--run-dir", str(straight)]
    assert _coba([*run, *(a for o in overrides for a in ("--set", o))], None, log) == 0, log.read_text()[-3000:]
    text = log.read_text()
    assert f"step {steps - 1} ({steps} of {steps}): pass rate " in text and "held-out accuracy after training: " in text
    for chatter in CHATTER:  # vLLM's start-up and reloads included
        assert chatter not in text, chatter

    run_dir = tmp_path / "stopped"
    _, store = _failed_run(run_dir, cfg, "2:rollouts", tmp_path / "fail-at")
    assert store.is_done(1, Table.UPDATE) and store.is_done(2, Table.BUDGET) and not store.is_done(2, Table.ROLLOUTS)
    epoch0 = [*store.read_table(0, Table.BUDGET)["prompt_id"], *store.read_table(1, Table.BUDGET)["prompt_id"]]
    assert len(set(epoch0)) == 8  # steps 0-1 were exactly one pass over the pool
    summary = train_flow(run_dir=str(run_dir), resume=True)
    assert summary["steps"] == steps and summary["total_rollouts"] == steps * 16
    ref = RunStore.open(straight)
    assert store.steps() == ref.steps() == list(range(steps + 1))
    for step in ref.steps():
        assert store.manifest(step).keys() == ref.manifest(step).keys(), step
        for name in ref.manifest(step):
            pd.testing.assert_frame_equal(
                store.read_table(step, name), ref.read_table(step, name), obj=f"{step}/{name}", check_exact=True
            )
    for step in range(1, steps + 1):
        wa = load_file(str(store.checkpoint_dir(step) / "model.safetensors"))
        wb = load_file(str(ref.checkpoint_dir(step) / "model.safetensors"))
        assert all(torch.equal(wa[k], wb[k]) for k in wb), step
    _assert_same_trainer_state(store, ref, steps)
    assert_updates_moved(store, model, steps)


@pytest.mark.slow
def test_a_pilot_run_keeps_b_total_and_resumes_between_its_waves_exactly(
    tmp_path, prefect_harness, random_checkpoints, first_char_data
):
    """allocation.estimator=pilot, 2 steps: each step samples its pilot as round 0 (k rollouts per prompt) and
    allocates its own budget on it, then samples the rest as round 1. Every step's rollouts number B_total, each
    group holds its pilot's rollouts (the same rows and rewards) beside a second round of other seeds, and every
    budget is within its bounds. A run that fails after step 1's pilot is recorded (in the allocation, before the
    second round) and is resumed equals the uninterrupted run table for table and weight for weight, without
    sampling its pilot again; one begun by a build whose pilot had tables of its own is refused in one line."""
    from coba_tasks.pipeline.run import check_layout
    from coba_tasks.readers.views import show_table
    from flows.train import train_flow

    model, _ = random_checkpoints
    steps, key = 2, ["prompt_id", "sample_idx"]
    overrides = [*_overrides(model, first_char_data, "transformers"), f"run.steps={steps}", "run.eval_every=0"]
    cfg = load_config(ROOT / "configs/tiny-test.yaml", [*overrides, "allocation.estimator=pilot"])
    a, m, k = cfg.allocation, cfg.data.prompts_per_step, cfg.allocation.pilot_rollouts
    train_flow(run_dir=str(tmp_path / "straight"), config=config_to_dict(cfg))
    ref = RunStore.open(tmp_path / "straight")
    for step in range(steps):
        budget, rounds = ref.read_table(step, Table.BUDGET), ref.read_table(step, Table.ROUND)
        rollouts, rewards = ref.read_table(step, Table.ROLLOUTS), ref.read_table(step, Table.REWARDS)
        assert int(budget["budget"].sum()) == len(rollouts) == len(rewards) == m * a.group_size, step
        assert budget["budget"].between(a.min_budget, a.max_budget).all() and (budget["pilot_rollouts"] == k).all()
        assert (budget["estimator"] == "pilot").all() and budget["pass_rate_est"].notna().all()
        sizes = dict(zip(budget["prompt_id"], budget["budget"], strict=True))
        assert rollouts.groupby("prompt_id").size().to_dict() == sizes and "used" not in rollouts
        assert rewards[key].equals(rollouts[key])
        # the pilot's k per prompt are round 0 and the first k of its group, row for row, with their rewards
        pilot = rounds[rounds["round"] == 0].reset_index(drop=True)
        assert len(pilot) == m * k and (pilot["weight_version"] == step).all() and set(rounds["round"]) == {0, 1}
        first = rollouts["sample_idx"] < k
        assert (rollouts["round"] == (~first).astype(int)).all()
        pd.testing.assert_frame_equal(rollouts[first].reset_index(drop=True), pilot, check_exact=True)
        round_rewards = ref.read_table(step, Table.ROUND_REWARDS)
        pd.testing.assert_frame_equal(
            rewards[first.to_numpy()].reset_index(drop=True),
            round_rewards[round_rewards["round"] == 0].reset_index(drop=True),
            check_exact=True,
        )
        assert set(rollouts.loc[~first, "seed"]).isdisjoint(pilot["seed"])  # the second round: seeds of its own
    # step 0: the prior (s = 2 at pbar 0.5) decayed by half, plus the pilot's k: each estimate rests on 3
    assert (ref.read_table(0, Table.BUDGET)["estimate_rollouts"] == 1.0 + k).all()
    assert not ref.is_done(steps, Table.BUDGET)  # each step allocates its own: none for a step after the last
    assert "allocated by step 1 after its pilot" in show_table(ref.root, 1, "budget")

    run_dir, fail = tmp_path / "stopped", tmp_path / "fail-at"
    _, store = _failed_run(run_dir, config_to_dict(cfg), "1:budget", fail)
    assert store.is_done(1, Table.ROUND_REWARDS) and not store.is_done(1, Table.BUDGET)
    assert not store.is_done(1, Table.ROLLOUTS)
    recorded = store.read_table(1, Table.ROUND)
    summary = train_flow(run_dir=str(run_dir), resume=True)
    assert summary["steps"] == steps and summary["total_rollouts"] == steps * m * a.group_size
    rounds = store.read_table(1, Table.ROUND)  # written again with round 1 added, round 0 as recorded
    pd.testing.assert_frame_equal(rounds[rounds["round"] == 0], recorded, check_exact=True)
    ours, theirs = _all_tables(store), _all_tables(ref)
    assert sorted(ours) == sorted(theirs)
    for name in ours:
        pd.testing.assert_frame_equal(ours[name], theirs[name], check_exact=True, obj=str(name))
    for step in range(1, steps + 1):
        wa = load_file(str(store.checkpoint_dir(step) / "model.safetensors"))
        wb = load_file(str(ref.checkpoint_dir(step) / "model.safetensors"))
        assert wa.keys() == wb.keys() and all(torch.equal(wa[n], wb[n]) for n in wb), step
    _assert_same_trainer_state(store, ref, steps)
    assert_updates_moved(store, model, steps)
    # a pilot run of the earlier layout (its pilot in pilot.parquet): refused, naming the build that continues it
    store.write_table(1, "pilot", pd.DataFrame({"x": [1]}))
    with pytest.raises(StoreError, match=r"step 1 holds pilot\.parquet: .* continue it with that build"):
        check_layout(store)


def _fake_run(root: Path, steps: int = 3, eval_every: int = 0, fsdp: bool = False) -> RunStore:
    """A run directory with every table of ``steps`` steps (tiny frames) and whole checkpoints (a file each,
    listed in its checkpoint.json); ``fsdp``: its updates ran under FSDP (each from the previous checkpoint)."""
    from coba_tasks.engines.checkpoint import write_checkpoint_manifest

    store = RunStore(root)
    config = {"run": {"steps": steps, "eval_every": eval_every}}
    store.create({**config, "optim": {"fsdp_processes": 2}} if fsdp else config, "h", {})
    df = pd.DataFrame({"x": [1]})
    store.write_table(0, Table.EVAL, df)
    for t in range(steps):
        for name in (Table.BUDGET, *STEP_REST):
            store.write_table(t, name, df)
        if eval_every and (t + 1) % eval_every == 0 and t + 1 < steps:
            store.write_table(t + 1, Table.EVAL, df)
        ckpt = store.checkpoint_dir(t + 1)
        ckpt.mkdir(parents=True)
        (ckpt / "model.safetensors").write_bytes(b"weights")
        write_checkpoint_manifest(ckpt)
    store.write_table(steps, Table.EVAL, df)
    store.write_json("summary.json", {"steps": steps})
    return store


def _everything(store: RunStore) -> tuple:
    """Every manifest entry, every file under the run and its bytes: equal only if nothing was removed."""
    files = {p.relative_to(store.root).as_posix(): p.read_bytes() for p in store.root.rglob("*") if p.is_file()}
    return {s: dict(store.manifest(s)) for s in store.steps()}, files


def test_a_rerun_whose_checkpoint_was_pruned_removes_nothing_and_names_what_is_possible(tmp_path, capsys):
    """An FSDP run (each update starts from the previous checkpoint: nothing to replay from): run.keep_checkpoints
    pruned checkpoints/000001 and 000003 (of 6): a repair of a table of step 3, whose resume continues from
    checkpoints/000003, removed every later table and the kept checkpoints before it found that one gone. Now
    it refuses before removing anything, and names the rerun that is possible: from step 2, the newest
    checkpoint kept at or below 3; that rerun goes through."""
    from coba_tasks.pipeline.rerun import check_plan, needed_checkpoints, plan_repair

    store = _fake_run(tmp_path / "r", steps=6, fsdp=True)
    for k in (1, 3):
        shutil.rmtree(store.checkpoint_dir(k))
    path = store.table_path(3, Table.REWARDS)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    before = _everything(store)
    assert needed_checkpoints(store, plan_repair(store)) == [3]
    assert cli_main(["resume", "--run-dir", str(store.root), "--repair"]) == 2
    assert _everything(store) == before  # every table, checkpoint, summary.json still there, unchanged
    (err,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert "needs checkpoints/000003" in err and "nothing was removed" in err
    assert f"coba rerun --run-dir {store.root} --step 2 --stage budget --yes" in err
    argv = ["rerun", "--run-dir", str(store.root), "--step", "3", "--stage", "update", "--yes", "--no-resume"]
    assert cli_main(argv) == 2 and _everything(store) == before  # rerun: the same refusal
    capsys.readouterr()
    check_plan(store, plan_rerun(store, 2, Table.BUDGET))  # what the refusal offers: possible
    argv = ["rerun", "--run-dir", str(store.root), "--step", "2", "--stage", "budget", "--yes", "--no-resume"]
    assert cli_main(argv) == 0
    assert not store.is_done(2, Table.BUDGET) and store.is_done(1, Table.UPDATE) and store.checkpoint_dir(2).is_dir()


def test_a_rerun_needs_the_checkpoints_of_the_evaluations_it_must_recompute(tmp_path, capsys):
    """An FSDP run: an evaluation is computed on the weights of its step: rerunning eval(2) needs
    checkpoints/000002, and a rerun whose resume must first recompute a due evaluation that is missing needs
    that step's checkpoint; with it pruned, nothing is removed and the refusal offers the start (no checkpoint
    kept below). A run trained in one process needs none: its resume replays the updates after the newest."""
    from coba_tasks.pipeline.rerun import needed_checkpoints

    plain = _fake_run(tmp_path / "plain", steps=4, eval_every=2)
    assert needed_checkpoints(plain, plan_rerun(plain, 2, Table.EVAL)) == []
    store = _fake_run(tmp_path / "r", steps=4, eval_every=2, fsdp=True)
    assert needed_checkpoints(store, plan_rerun(store, 2, Table.EVAL)) == [2, 4]  # eval(2), then the finished run
    assert needed_checkpoints(store, plan_rerun(store, 0, Table.EVAL)) == [4]  # eval(0): the base model
    assert needed_checkpoints(store, plan_rerun(store, 3, Table.ROLLOUTS)) == [3]
    for k in (1, 2):
        shutil.rmtree(store.checkpoint_dir(k))
    before = _everything(store)
    argv = ["rerun", "--run-dir", str(store.root), "--step", "2", "--stage", "eval", "--yes", "--no-resume"]
    assert cli_main(argv) == 2 and _everything(store) == before
    (err,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert "needs checkpoints/000002" in err and "--step 0 --stage budget --yes" in err
    store.invalidate(2, Table.EVAL)  # a kill between update(1) and eval(2) left it out
    assert needed_checkpoints(store, plan_rerun(store, 3, Table.ROLLOUTS)) == [2, 3]
    before = _everything(store)
    argv = ["rerun", "--run-dir", str(store.root), "--step", "3", "--stage", "rollouts", "--yes", "--no-resume"]
    assert cli_main(argv) == 2 and _everything(store) == before


def test_plan_rerun_orders_outputs_as_computed(tmp_path):
    store = _fake_run(tmp_path / "r")
    plan = plan_rerun(store, 1, Table.CAPABILITY)
    assert plan.tables == [
        (1, "capability"),
        (1, "history"),
        (1, "update"),
        (2, "budget"),
        (2, "rollouts"),
        (2, "rewards"),
        (2, "capability"),
        (2, "history"),
        (2, "update"),
        (3, "eval"),
    ]
    assert [p.name for p in plan.checkpoints] == ["000002", "000003"]
    assert [p.name for p in plan.files] == ["summary.json"]
    # the budget of step 2 is its first stage: it invalidates step 2 from there, nothing of step 1
    plan = plan_rerun(store, 2, Table.BUDGET)
    assert plan.tables[:2] == [(2, "budget"), (2, "rollouts")] and not [t for t in plan.tables if t[0] < 2]
    # budget(0) invalidates every step but not the evaluation of the starting model
    plan = plan_rerun(store, 0, Table.BUDGET)
    assert (0, "eval") not in plan.tables and (0, "rollouts") in plan.tables and len(plan.checkpoints) == 3
    # a held-out evaluation is read by nothing
    assert plan_rerun(store, 3, Table.EVAL).tables == [(3, "eval")]


def test_plan_rerun_orders_a_pilot_runs_outputs_as_computed(tmp_path):
    """allocation.estimator=pilot: step t samples its pilot as round 0 (with the weights of update(t - 1)), then
    allocates its own budget on it and samples round 1; a rerun of any of its rounds, its budget, rollouts or
    rewards redoes the step from its start (round 1 follows from the budget, the budget from round 0)."""
    store = RunStore(tmp_path / "r")
    store.create({"run": {"steps": 2}, "allocation": {"estimator": "pilot"}}, "h", {})
    df = pd.DataFrame({"x": [1]})
    store.write_table(0, Table.EVAL, df)
    for t in range(2):
        for name in (Table.ROUND, Table.ROUND_REWARDS, Table.BUDGET, *STEP_REST):
            store.write_table(t, name, df)
        store.checkpoint_dir(t + 1).mkdir(parents=True)
    store.write_table(2, Table.EVAL, df)
    step1 = [(1, n) for n in ("budget", "round", "round_rewards", "rollouts", "rewards", "capability", "history")]
    assert plan_rerun(store, 0, Table.UPDATE).tables == [(0, "update"), *step1, (1, "update"), (2, "eval")]
    for stage in (Table.BUDGET, Table.ROUND, Table.ROUND_REWARDS, Table.ROLLOUTS, Table.REWARDS):
        assert plan_rerun(store, 1, stage).tables == [*step1, (1, "update"), (2, "eval")], stage
    first = plan_rerun(store, 0, Table.CAPABILITY).tables
    assert first[0] == (0, "capability") and (0, "round") not in first and (0, "eval") not in first
    with pytest.raises(ValueError, match=r"done there: budget, round, round_rewards, rollouts"):
        plan_rerun(store, 1, Table.EVAL)


STEP_REST = (Table.ROLLOUTS, Table.REWARDS, Table.CAPABILITY, Table.HISTORY, Table.UPDATE)


def test_apply_rerun_removes_exactly_the_plan(tmp_path):
    store = _fake_run(tmp_path / "r")
    plan = plan_rerun(store, 2, Table.UPDATE)
    apply_rerun(store, plan)
    assert not store.is_done(2, Table.UPDATE) and not store.is_done(3, Table.EVAL)
    assert store.is_done(2, Table.CAPABILITY) and store.is_done(2, Table.BUDGET)  # before update(2): kept
    assert not store.checkpoint_dir(3).exists() and store.checkpoint_dir(2).exists()
    assert not (store.root / "summary.json").exists()
    assert not (store.step_dir(2) / "update.parquet").exists()


def test_rerun_refuses_a_checkpoints_link_out_of_the_run_before_removing_anything(tmp_path, capsys):
    """checkpoints/ a symlink out of the run: `coba rerun --yes` refuses with one line naming the link and the
    fix, and every table, checkpoint and summary.json is still there (the rule of prune and inspect --sql)."""
    store = _fake_run(tmp_path / "r")
    elsewhere = tmp_path / "big-disk"
    shutil.move(store.root / "checkpoints", elsewhere)
    (store.root / "checkpoints").symlink_to(elsewhere)
    manifests = {s: dict(store.manifest(s)) for s in store.steps()}
    argv = ["rerun", "--run-dir", str(store.root), "--step", "1", "--stage", "update", "--yes", "--no-resume"]
    assert cli_main(argv) == 2
    assert {s: dict(store.manifest(s)) for s in store.steps()} == manifests
    assert sorted(p.name for p in elsewhere.iterdir()) == ["000001", "000002", "000003"]
    assert (store.root / "summary.json").is_file()
    (err,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert "outside the run directory" in err and "replace the link by the real" in err


def test_rerun_refuses_a_step_directory_linked_out_of_the_run_before_removing_anything(tmp_path, capsys):
    """steps/000002 a symlink to a directory elsewhere: `coba rerun` deleted its tables through the link (the
    docs said it refuses). It refuses in one line, and every table, here and there, is still recorded."""
    store = _fake_run(tmp_path / "r")
    elsewhere = tmp_path / "other-disk" / "000002"
    elsewhere.parent.mkdir()
    shutil.move(store.step_dir(2), elsewhere)
    store.step_dir(2).symlink_to(elsewhere)
    before = {s: dict(store.manifest(s)) for s in store.steps()}
    files = sorted(p.name for p in elsewhere.iterdir())
    for argv in (
        ["rerun", "--run-dir", str(store.root), "--step", "1", "--stage", "rewards", "--yes", "--no-resume"],
        ["rerun", "--run-dir", str(store.root), "--step", "2", "--stage", "update", "--yes", "--no-resume"],
    ):
        assert cli_main(argv) == 2
        assert {s: dict(store.manifest(s)) for s in store.steps()} == before
        assert sorted(p.name for p in elsewhere.iterdir()) == files
        (err,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
        assert "outside the run directory" in err
    with pytest.raises(StoreError, match="outside the run directory"):
        store.write_table(2, Table.REWARDS, pd.DataFrame({"x": [2]}))
    assert store.read_table(2, Table.REWARDS)["x"].tolist() == [1]


def test_plan_rerun_errors(tmp_path):
    store = _fake_run(tmp_path / "r", steps=1)
    with pytest.raises(ValueError, match="not done at step 4"):
        plan_rerun(store, 4, Table.REWARDS)
    with pytest.raises(ValueError, match="unknown stage 'loss'"):
        plan_rerun(store, 0, "loss")


def test_resume_refuses_other_schema_version(tmp_path, capsys):
    store = _fake_run(tmp_path / "r", steps=1)
    info = json.loads((store.root / "run.json").read_text())
    info["schema_version"] = 0
    (store.root / "run.json").write_text(json.dumps(info))
    assert cli_main(["resume", "--run-dir", str(store.root)]) == 2
    err = capsys.readouterr().err
    assert "schema version 0" in err and "this build reads version" in err and "Traceback" not in err
    assert cli_main(["rerun", "--run-dir", str(tmp_path / "missing"), "--step", "0", "--stage", "rewards"]) == 2
    assert "no run here" in capsys.readouterr().err


@pytest.mark.slow
def test_failed_flow_run_retried_with_prefect_reruns_only_what_failed(
    tmp_path, baseline, random_checkpoints, first_char_data
):
    """A stage fails (after its task retry); `prefect flow-run retry` finishes the run without redoing done stages."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    model, _ = random_checkpoints
    cfg = load_config(ROOT / "configs/tiny-test.yaml", _overrides(model, first_char_data))
    run_dir = tmp_path / "run"
    fail = tmp_path / "fail-at"
    state, store = _failed_run(run_dir, config_to_dict(cfg), "1:rewards", fail)
    assert store.is_done(1, Table.ROLLOUTS) and not store.is_done(1, Table.REWARDS)
    written = {(s, n): e["written_at"] for s in store.steps() for n, e in store.manifest(s).items()}

    fail.unlink()  # the failure goes away; retry the same flow run
    flow_run_id = state.state_details.flow_run_id
    env = dict(os.environ, PREFECT_API_URL=str(PREFECT_API_URL.value()), PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        python_with_first_char(
            "prefect", "flow-run", "retry", str(flow_run_id), "--entrypoint", "flows/train.py:train_flow"
        ),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with get_client(sync_client=True) as client:
        assert client.read_flow_run(flow_run_id).state.is_completed()
    for key, when in written.items():  # what was done before the failure was not recomputed
        assert store.manifest(key[0])[key[1]]["written_at"] == when, key
    _assert_same_run(baseline, store, model)


def test_damaged_tables_are_found_and_repair_plans_from_the_first(tmp_path, capsys):
    from coba_tasks.pipeline.rerun import damaged_tables, plan_repair

    store = _fake_run(tmp_path / "r")
    assert damaged_tables(store) == [] and plan_repair(store) is None
    path = store.table_path(2, Table.REWARDS)
    path.write_bytes(path.read_bytes()[:-7])  # truncated
    altered = store.table_path(1, Table.HISTORY)
    data = bytearray(altered.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte flipped, same size
    altered.write_bytes(bytes(data))
    found = damaged_tables(store)
    assert [(s, n) for s, n, _ in found] == [(1, "history"), (2, "rewards")]
    assert "does not match the manifest" in found[0][2] and "truncated" in found[1][2]
    plan = plan_repair(store)  # a damaged history is recomputed by its step's capability stage
    assert plan.tables[0] == (1, "capability") and (2, "rewards") in plan.tables and (1, "rewards") not in plan.tables

    assert cli_main(["resume", "--run-dir", str(store.root)]) == 2
    err = capsys.readouterr().err
    assert "2 damaged table(s), the first at step 1 (history)" in err and "coba resume --repair" in err


def test_a_finished_run_missing_an_evaluation_is_not_complete_and_coba_resume_goes_on(tmp_path, capsys, monkeypatch):
    """A run whose summary is written but one of its held-out evaluations is missing (left so where its weights
    could not be rebuilt) is not finished: a flow run of it computes that evaluation instead of returning at once,
    and `coba resume` does not say "nothing to resume". Complete, both leave it alone."""
    from coba_tasks.pipeline.evaluation import run_complete
    from coba_tasks.pipeline.run import read_run_config

    store = _fake_run(tmp_path / "run", steps=3, eval_every=1)
    cfg = read_run_config(store)
    monkeypatch.setattr("coba_tasks.commands.train_cmd._print_summary", lambda summary: None)  # a fake summary
    assert run_complete(store, cfg)
    assert cli_main(["resume", "--run-dir", str(store.root)]) == 0
    assert "all 3 steps and their evaluations are done; nothing to resume" in capsys.readouterr().out
    store.invalidate(2, Table.EVAL)  # the evaluation after 2 updates, left missing
    assert not run_complete(store, cfg)
    started: list[str] = []
    monkeypatch.setattr("flows.train.train_flow", lambda **kw: started.append(kw["run_dir"]) or {"steps": 3})
    monkeypatch.setattr("coba_tasks.commands.prefect_env.start_local_server", lambda: None)
    code = cli_main(["resume", "--run-dir", str(store.root), "--allow-changed-inputs"])  # a fake run: no inputs
    out = capsys.readouterr()
    assert code == 0 and "nothing to resume" not in out.out and started == [str(store.root)], out
