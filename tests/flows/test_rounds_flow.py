"""Steps sampled in rounds, end to end on the tiny model (transformers rollouts): DAPO's dynamic sampling and
Reinforce-Ada write every round's rollouts and rewards, decide each round from the tables of the rounds before
it, train on what their rule keeps; a run killed inside or between rounds and resumed ends as the uninterrupted
one, bit for bit; a rerun of a step's rollouts redoes its rounds."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from helpers_reward import data_overrides, python_with_first_char

from coba_tasks.pipeline.config import config_to_dict, load_config
from coba_tasks.pipeline.rerun import apply_rerun, plan_rerun
from coba_tasks.pipeline.rounds import ROUND, USED, ada_next, ada_used, dynamic_next, dynamic_used
from coba_tasks.pipeline.stages import batch_for_step
from coba_tasks.pipeline.store import RunStore, Table

ROOT = Path(__file__).resolve().parents[2]
STEPS = 2
ROUND_KEYS = {
    "dynamic": ["allocation.strategy=dynamic", "allocation.gen_batch_size=2"],
    "ada": ["allocation.strategy=ada", "allocation.round_repeat=2"],  # 2 a round: a group of 4 takes 2 rounds
}


def _overrides(model: Path, data, strategy: str) -> list[str]:
    base = [f"model.path={model}", "data.train_prompts=6", f"run.steps={STEPS}", "rollout.backend=transformers"]
    return [*base, *data_overrides(data), *ROUND_KEYS[strategy]]


def _all_tables(store: RunStore) -> dict[tuple[int, str], pd.DataFrame]:
    out = {(s, n): store.read_table(s, n) for s in store.steps() for n in store.manifest(s)}
    return out | {(-1, n): store.read_run_table(n) for n in ("prompts", "history")}


def _check_rounds(store: RunStore, cfg, strategy: str) -> list[int]:
    """Every step: its rollouts and rewards are its rounds', each round decided as the rule decides from the
    rounds before it, the update trained on exactly what the rule keeps; (rounds, rollouts generated) per step."""
    alloc, m, n = cfg.allocation, cfg.data.prompts_per_step, cfg.allocation.group_size
    ids = store.read_run_table("prompts")["prompt_id"].tolist()
    counts, first = [], 0
    for step in range(STEPS):
        rolled, scored = store.read_table(step, Table.ROLLOUTS), store.read_table(step, Table.REWARDS)
        pd.testing.assert_frame_equal(rolled.drop(columns=USED), store.read_table(step, Table.ROUND))
        pd.testing.assert_frame_equal(scored, store.read_table(step, Table.ROUND_REWARDS))
        rounds = int(rolled[ROUND].max()) + 1
        batch = store.read_table(step, Table.BUDGET)["prompt_id"].tolist()
        for r in range(rounds):
            prompts = list(dict.fromkeys(rolled.loc[rolled[ROUND] == r, "prompt_id"]))
            before = scored[scored[ROUND] < r]
            if strategy == "dynamic":
                assert r == 0 or dynamic_next(before, alloc, m, len(ids), step)
                assert prompts == batch_for_step(ids, first + r, 2, cfg.run.seed), (step, r)
            else:
                assert prompts == (batch if r == 0 else ada_next(before, batch, alloc)), (step, r)
        if strategy == "dynamic":
            assert not dynamic_next(scored, alloc, m, len(ids), step)  # no round after the last
            assert int(store.read_table(step, Table.BUDGET)["gen_batch"].iloc[0]) == first
            used = dynamic_used(rolled, scored, alloc.filter_metric, m)
        else:
            assert ada_next(scored, batch, alloc) == []
            used = ada_used(scored, batch, alloc)
        assert (rolled[USED].to_numpy() == used).all() and int(used.sum()) == m * n
        update = store.read_table(step, Table.UPDATE).iloc[0]
        assert update["rollouts"] == update["sequences"] == m * n <= len(rolled)
        counts.append((rounds, len(rolled)))
        first += rounds
    return counts


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["dynamic", "ada"])
def test_a_run_sampled_in_rounds_decides_each_round_from_the_ones_before(
    tmp_path, prefect_harness, random_checkpoints, first_char_data, strategy
):
    from flows.train import train_flow

    model, _ = random_checkpoints
    cfg = load_config(ROOT / "configs/tiny-test.yaml", _overrides(model, first_char_data, strategy))
    run_dir = tmp_path / "run"
    train_flow(run_dir=str(run_dir), config=config_to_dict(cfg))
    store = RunStore.open(run_dir)
    rounds = _check_rounds(store, cfg, strategy)
    assert all(r >= 2 for r, _ in rounds)  # each step sampled more than once: there was something to decide
    m, n = cfg.data.prompts_per_step, cfg.allocation.group_size
    assert any(generated > m * n for _, generated in rounds)  # and generated more than its update trained on
    assert set(store.manifest(0)) >= {Table.ROUND, Table.ROUND_REWARDS, Table.ROLLOUTS, Table.REWARDS}
    # one row per prompt and visit: every prompt the step sampled, its rounds, generated, trained on, solved
    from coba_tasks.readers.mechanisms import prompt_visits
    from coba_tasks.readers.tables import load_run

    visits = prompt_visits(load_run(run_dir))
    for step in range(STEPS):
        rolled, scored = store.read_table(step, Table.ROLLOUTS), store.read_table(step, Table.REWARDS)
        mine = visits[visits["step"] == step].set_index("prompt_id")
        assert set(mine.index) == set(rolled["prompt_id"])
        assert mine["generated"].to_dict() == rolled.groupby("prompt_id").size().to_dict()
        assert mine["trained"].to_dict() == rolled.groupby("prompt_id")[USED].sum().to_dict()
        correct = (scored["verdict"] == "correct").groupby(scored["prompt_id"]).sum()
        assert mine["successes"].to_dict() == correct.to_dict()
        assert mine["rounds"].to_dict() == rolled.groupby("prompt_id")[ROUND].nunique().to_dict()
        budget = set(store.read_table(step, Table.BUDGET)["prompt_id"])
        assert mine["budget"].notna().to_dict() == {p: p in budget for p in mine.index}

    # a rerun of a step's rollouts redoes its rounds; its resume writes them again as they were
    before = _all_tables(store)
    plan = plan_rerun(store, 1, Table.ROLLOUTS)
    assert (1, Table.ROUND) in plan.tables and (1, Table.ROUND_REWARDS) in plan.tables
    apply_rerun(store, plan)
    assert not store.is_done(1, Table.ROUND)
    train_flow(run_dir=str(run_dir), resume=True)
    after = _all_tables(store)
    assert after.keys() == before.keys()
    for key in before:
        pd.testing.assert_frame_equal(after[key], before[key], check_exact=True, obj=str(key))


def _coba(args: list[str], kill_at: str | None, log: Path) -> int:
    from prefect.settings import PREFECT_API_URL

    env = dict(os.environ, PREFECT_API_URL=str(PREFECT_API_URL.value()), PYTHONPATH=str(ROOT))
    env.pop("COBA_KILL_AT", None)
    if kill_at:
        env["COBA_KILL_AT"] = kill_at
    with open(log, "ab") as out:
        argv = python_with_first_char("coba_tasks.commands.cli", *args)
        return subprocess.run(argv, cwd=ROOT, env=env, stdout=out, stderr=out, timeout=600).returncode


@pytest.mark.slow
def test_a_run_killed_inside_and_between_rounds_resumes_as_the_uninterrupted_one(
    tmp_path, prefect_harness, random_checkpoints, first_char_data
):
    """Reinforce-Ada, killed while its second round of step 1 is sampled, then while that round is scored (each
    after the work, before the table is recorded), then resumed: every table and the last checkpoint's weights
    equal the uninterrupted run's, bit for bit."""
    from safetensors.torch import load_file

    model, _ = random_checkpoints
    settings = [a for o in _overrides(model, first_char_data, "ada") for a in ("--set", o)]
    start = ["run", "--config", "configs/tiny-test.yaml", *settings]
    log = tmp_path / "coba.log"
    reference, run_dir = tmp_path / "uninterrupted", tmp_path / "run"
    assert _coba([*start, "--run-dir", str(reference)], None, log) == 0, log.read_text()[-3000:]
    assert _coba([*start, "--run-dir", str(run_dir)], "1:round.1", log) == -signal.SIGKILL, log.read_text()[-3000:]
    store = RunStore.open(run_dir)
    for table in (Table.ROUND, Table.ROUND_REWARDS):  # step 1's first round, sampled and scored: no more
        assert set(store.read_table(1, table)[ROUND]) == {0}
    resume = ["resume", "--run-dir", str(run_dir)]
    assert _coba(resume, "1:round_rewards.1", log) == -signal.SIGKILL, log.read_text()[-3000:]
    assert set(store.read_table(1, Table.ROUND)[ROUND]) == {0, 1}
    assert set(store.read_table(1, Table.ROUND_REWARDS)[ROUND]) == {0}
    assert _coba(resume, None, log) == 0, log.read_text()[-3000:]
    ref = RunStore.open(reference)
    a, b = _all_tables(ref), _all_tables(store)
    assert a.keys() == b.keys()
    for key in a:
        pd.testing.assert_frame_equal(a[key], b[key], check_exact=True, obj=str(key))
    wa, wb = (load_file(str(s.checkpoint_dir(STEPS) / "model.safetensors")) for s in (ref, store))
    assert wa.keys() == wb.keys() and all(np.array_equal(wa[k].numpy(), wb[k].numpy()) for k in wa)


@pytest.mark.slow
def test_a_run_with_a_rollout_budget_ends_when_its_rollouts_reach_it(
    tmp_path, prefect_harness, random_checkpoints, first_char_data, capsys
):
    """DAPO's dynamic sampling spends a varying number of rollouts a step: with run.rollout_budget 40 the run ends
    after the step whose rollouts reach 40 (run.steps 20 only the most), is evaluated after each step that
    crosses a multiple of run.eval_every_rollouts 20 and at its end, and a resume finds it done."""
    from coba_tasks.commands.cli import main as cli_main
    from coba_tasks.pipeline.progress import rollouts_generated
    from flows.train import train_flow

    model, _ = random_checkpoints
    more = ["run.steps=20", "run.eval_every=0", "run.rollout_budget=40", "run.eval_every_rollouts=20"]
    cfg = load_config(ROOT / "configs/tiny-test.yaml", [*_overrides(model, first_char_data, "dynamic"), *more])
    run_dir = tmp_path / "run"
    summary = train_flow(run_dir=str(run_dir), config=config_to_dict(cfg))
    store = RunStore.open(run_dir)
    counts = rollouts_generated(store, 20)
    totals = np.cumsum(counts).tolist()
    assert totals[-1] >= 40 > totals[-2] and summary["steps"] == len(counts) < 20
    crossed = [s + 1 for s, (a, b) in enumerate(zip([0, *totals[:-1]], totals, strict=True)) if b // 20 > a // 20]
    assert [s for s in store.steps() if store.is_done(s, Table.EVAL)] == sorted({0, *crossed, len(counts)})
    assert not store.is_done(len(counts), Table.BUDGET)  # no step after the last
    capsys.readouterr()
    assert cli_main(["resume", "--run-dir", str(run_dir)]) == 0
    assert f"all {len(counts)} steps and their evaluations are done; nothing to resume" in capsys.readouterr().out
