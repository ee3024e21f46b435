"""Tests for coba_tasks/pipeline/fork.py: which runs share their first steps, where they part, and the forked
run directory (on runs laid out by ``helpers_fork.fake_run``; the forked run trained on is compared with one
trained from its start in tests/commands/test_compare.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
from helpers_fork import fake_run

from coba_tasks.engines.rollout import Rollout, RolloutBackend, SamplingConfig
from coba_tasks.pipeline import fork, stages
from coba_tasks.pipeline.config import apply_overrides, config_hash, load_config
from coba_tasks.pipeline.config_sections import AllocationConfig
from coba_tasks.pipeline.progress import first_step_not_done
from coba_tasks.pipeline.store import Table

ROOT = Path(__file__).resolve().parents[2]
STRATEGIES = {
    "uniform": ["allocation.strategy=uniform"],
    "coba": ["allocation.strategy=coba"],
    "coba-reversed": ["allocation.strategy=coba", "allocation.schedule=reversed"],
}


def _cfg(*overrides: str, steps: int = 3):
    """configs/tiny-test.yaml with a pool of 8 prompts, 4 a step: steps 0 and 1 see only unseen prompts."""
    base = ["data.train_prompts=8", f"run.steps={steps}", "run.eval_every=1"]
    return load_config(ROOT / "configs/tiny-test.yaml", [*base, *overrides])


def test_runs_share_a_prefix_when_their_configs_differ_only_in_allocation_keys():
    uniform = _cfg(*STRATEGIES["uniform"], "run.name=uniform-seed0")
    for name in ("coba", "coba-reversed"):
        other = _cfg(*STRATEGIES[name], f"run.name={name}-seed0")
        assert fork.shares_prefix(uniform, other) and fork.shares_prefix(other, uniform)
    reversed_ = _cfg(*STRATEGIES["coba-reversed"], "run.name=x")
    assert fork.differing_keys(uniform, reversed_) == ["allocation.schedule", "allocation.strategy", "run.name"]
    # the update reads optim keys, the rollouts the seed: runs that differ there share nothing
    for other in ("optim.prompt_weighting=equal", "run.seed=1", "optim.lr=0.001", "rollout.temperature=0.5"):
        assert not fork.shares_prefix(uniform, _cfg(*STRATEGIES["coba"], other)), other
    # the posterior acts through the budget stage alone; a pilot samples inside each step: it shares nothing
    posterior = _cfg(*STRATEGIES["coba"], "allocation.estimator=posterior", "allocation.posterior_decay=0.8")
    assert fork.shares_prefix(uniform, posterior)
    pilot = _cfg(*STRATEGIES["coba"], "allocation.estimator=pilot")
    assert not fork.shares_prefix(uniform, pilot) and not fork.shares_prefix(pilot, pilot)


def test_every_allocation_key_is_known_to_act_through_the_allocation_stages_alone():
    """A key added to the allocation section is not shared until ALLOCATION_KEYS lists it: list it only when no
    stage but capability, history and budget reads it (an estimator that samples inside the rollouts stage
    does not belong there)."""
    assert set(fork.ALLOCATION_KEYS) == set(AllocationConfig.model_fields)


class _Recording(RolloutBackend):
    def __init__(self) -> None:
        super().__init__()
        self.requests: list = []

    def load_weights(self, path, version) -> None:
        return None

    def set_weights(self, source, version) -> None:
        return None

    def close(self) -> None:
        return None

    def generate(self, requests, sampling):
        self.requests.append(list(requests))
        return [Rollout(r.prompt_id, j, "x", (5,), 1, "stop", r.seed, 0) for r in requests for j in range(r.n)]


def test_the_rollouts_stage_reads_only_the_prompt_ids_and_budgets_of_a_budget_table():
    """What fork_point compares of two budget tables (ROLLOUT_INPUTS) is all the rollouts stage reads."""
    prompts = pd.DataFrame({"prompt_id": ["a", "b"], "prompt_token_ids": [[1, 2], [3]], "prompt_rendered": ["a", "b"]})
    budget = pd.DataFrame({"prompt_id": ["b", "a"], "budget": [3, 2]})
    records = {"strategy": ["coba"] * 2, "value": [0.1, 0.2], "alpha": 5.5, "fallback": ""}
    engines, tables = [], []
    for table in (
        budget,
        budget.assign(**records),
        budget.assign(**{**records, "strategy": "uniform", "value": [0.9, 0.0]}),
    ):
        engines.append(_Recording())
        tables.append(stages.rollout_table(table, prompts, engines[-1], SamplingConfig(), run_seed=3, step=2))
    assert engines[0].requests == engines[1].requests == engines[2].requests
    pd.testing.assert_frame_equal(tables[0], tables[2])
    assert list(budget.columns) == list(fork.ROLLOUT_INPUTS)


def test_the_fork_point_is_the_first_step_whose_allocation_differs(tmp_path):
    uniform = fake_run(tmp_path / "uniform", _cfg(*STRATEGIES["uniform"]), steps=3)
    point = fork.fork_point(uniform, _cfg(*STRATEGIES["coba"], "run.name=coba"))
    assert point is not None and point.step == 2  # steps 0 and 1 visit unseen prompts: uniform whatever the strategy
    assert sorted(point.budgets) == [0, 1, 2]
    assert (point.budgets[0]["strategy"] == "coba").all() and point.budgets[1]["fallback"].str.contains("unseen").all()
    theirs = uniform.read_table(2, Table.BUDGET)
    assert point.budgets[2]["budget"].tolist() != theirs["budget"].tolist()
    assert point.budgets[2]["budget"].sum() == theirs["budget"].sum() == 4 * 4
    # a run that allocates as the source does all the way shares every step
    same = fork.fork_point(uniform, _cfg(*STRATEGIES["uniform"], "run.name=another", "allocation.tau=3"))
    assert same is not None and same.step == 3
    # kappa acts in the capability stage: the capability of step 0 differs, so step 0 does
    assert fork.fork_point(uniform, _cfg(*STRATEGIES["uniform"], "allocation.kappa=5")).step == 0
    # another B_total: the first budget differs
    assert fork.fork_point(uniform, _cfg(*STRATEGIES["uniform"], "allocation.group_size=3")).step == 0
    with pytest.raises(fork.ForkError, match=r"differ in optim\.lr"):
        fork.fork_point(uniform, _cfg(*STRATEGIES["coba"], "optim.lr=0.001"))


def test_the_fork_point_waits_for_the_tables_that_decide_it(tmp_path):
    """A source before the capability of step 1 does not decide it yet; once the tables of steps 0 and 1 are
    there, the point before step 2 is known whether or not the source has allocated step 2 itself (what its
    budget stage will write is computed, as it will be)."""
    cfg = _cfg(*STRATEGIES["uniform"])
    one = fake_run(tmp_path / "one", cfg, steps=1)
    assert fork.fork_point(one, _cfg(*STRATEGIES["coba"])) is None
    two = fake_run(tmp_path / "two", cfg, steps=2)
    assert not two.is_done(2, Table.BUDGET)
    point = fork.fork_point(two, _cfg(*STRATEGIES["coba"]))
    assert point is not None and point.step == 2 and sorted(point.budgets) == [0, 1, 2]
    same = fork.fork_point(two, _cfg(*STRATEGIES["uniform"], "run.name=another", "allocation.tau=3"))
    assert same is None  # it allocates step 2 as the source: undecided until step 2's tables are there


def test_a_forked_run_holds_the_shared_steps_as_written_and_its_own_budgets(tmp_path):
    source = fake_run(tmp_path / "uniform-seed0", _cfg(*STRATEGIES["uniform"]), steps=3)  # gone past the fork
    cfg = _cfg(*STRATEGIES["coba"], "run.name=coba-seed0")
    point = fork.fork_point(source, cfg)
    forked = fork.fork_run(source, tmp_path / "coba-seed0", cfg, point)
    assert forked.config_hash == config_hash(cfg) and forked.read_config()["allocation"]["strategy"] == "coba"
    assert first_step_not_done(forked, 3) == 2
    for step in (0, 1):
        assert list(forked.manifest(step)) == list(source.manifest(step))
        for name, entry in forked.manifest(step).items():
            assert entry["config_hash"] == config_hash(cfg)
            if name != Table.BUDGET:  # the same bytes
                assert entry["sha256"] == source.manifest(step)[name]["sha256"], (step, name)
        timing = "timing.json"
        assert (forked.step_dir(step) / timing).read_bytes() == (source.step_dir(step) / timing).read_bytes()
    for step in (0, 1, 2):  # its own allocation's records
        pd.testing.assert_frame_equal(forked.read_table(step, Table.BUDGET), point.budgets[step])
    assert set(forked.manifest(2)) == {Table.BUDGET, Table.EVAL}  # of step 2 only its budget and evaluation
    assert forked.manifest(2)[Table.EVAL]["sha256"] == source.manifest(2)[Table.EVAL]["sha256"]
    assert forked.steps() == [0, 1, 2] and not (forked.step_dir(2) / "timing.json").exists()
    assert forked.read_run_table("history").equals(source.read_table(1, Table.HISTORY))
    assert forked.read_run_table("prompts").equals(source.read_run_table("prompts"))
    for k in (1, 2):  # the checkpoints are the source's files (hard links); 3 is not shared
        theirs = source.checkpoint_dir(k) / "model.safetensors"
        assert (forked.checkpoint_dir(k) / "model.safetensors").stat().st_ino == theirs.stat().st_ino
    assert not forked.checkpoint_dir(3).exists()
    record = json.loads((forked.root / fork.FORK_FILE).read_text())
    assert record == {"from": str(source.root.resolve()), "config_hash": source.config_hash, "step": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["coba-seed0", "uniform-seed0"]  # no temporary left


def test_a_fork_without_its_checkpoint_or_onto_a_run_leaves_nothing(tmp_path):
    source = fake_run(tmp_path / "uniform-seed0", _cfg(*STRATEGIES["uniform"]), steps=3)
    cfg = _cfg(*STRATEGIES["coba"])
    point = fork.fork_point(source, cfg)
    shutil.rmtree(source.checkpoint_dir(2))  # pruned (run.keep_checkpoints)
    fsdp = apply_overrides(cfg, ["optim.fsdp_processes=2", "model.lora_rank=0"])  # FSDP continues from it
    with pytest.raises(fork.ForkError, match=r"checkpoints/000002 is missing"):
        fork.fork_run(source, tmp_path / "coba-seed0", fsdp, point)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["uniform-seed0"]
    # in one process the fork's resume replays the update of step 1 from checkpoints/000001
    replayed = fork.fork_run(source, tmp_path / "replayed", cfg, point)
    assert replayed.checkpoint_dir(1).is_dir() and not replayed.checkpoint_dir(2).exists()
    shutil.rmtree(replayed.root)
    (tmp_path / "coba-seed0").mkdir()
    with pytest.raises(fork.ForkError, match="exists"):
        fork.fork_run(source, tmp_path / "coba-seed0", cfg, fork.fork_point(source, _cfg("run.name=x")))
    # a fork before step 0 (another B_total) needs no checkpoint: it shares the evaluation before training
    other = _cfg("allocation.group_size=3")
    zero = fork.fork_run(source, tmp_path / "g3", other, fork.fork_point(source, other))
    assert zero.steps() == [0] and set(zero.manifest(0)) == {Table.BUDGET, Table.EVAL}
    assert zero.read_table(0, Table.BUDGET)["budget"].tolist() == [3] * 4 and not zero.checkpoint_dir(1).exists()
    assert zero.read_run_table("history").empty and first_step_not_done(zero, 3) == 0


def test_a_fork_never_removes_another_forks_work_in_progress(tmp_path):
    """A fork built in `.<run>.fork.tmp` and began by deleting it: two forks to one directory deleted each
    other's work. Each builds in a directory of its own now."""
    source = fake_run(tmp_path / "uniform-seed0", _cfg(*STRATEGIES["uniform"]), steps=3)
    theirs = tmp_path / ".coba-seed0.fork.tmp"
    theirs.mkdir()
    (theirs / "run.json").write_text("{}")
    cfg = _cfg(*STRATEGIES["coba"], "run.name=coba-seed0")
    fork.fork_run(source, tmp_path / "coba-seed0", cfg, fork.fork_point(source, cfg))
    assert (theirs / "run.json").read_text() == "{}" and (tmp_path / "coba-seed0" / "run.json").is_file()
