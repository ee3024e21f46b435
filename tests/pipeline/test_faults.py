"""Faults (issue 7): a rollout engine that dies mid-step, and a table write that fails (disk full,
no permission). Verifier hangs and crashes are tested in test_verify.py.

- Engine death: ``VLLMBackend`` starts a new engine with the last loaded weights and the step's
  rollouts come out the same (seeds are per request).
- Failed write: nothing is visible under the final name, no temporary is left, the manifest does
  not list the table, and a later write (or ``resume``) succeeds with the same tables.

The runs here train on prompts scored by a reward the random tiny model earns (tests/helpers_reward.py),
so every update moves the weights and a resumed run's weights are compared with trained ones.
"""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import pandas as pd
import pytest
from char_prompts import char_ids
from helpers_reward import assert_updates_moved
from scripts_loader import load_script

from coba_tasks.engines import fileio
from coba_tasks.engines.rollout import RolloutRequest, SamplingConfig, make_backend, rollout_seed
from coba_tasks.pipeline import store as store_module
from coba_tasks.pipeline.store import RunStore, Table

test_resume = load_script("tests/flows/test_resume.py")  # its helpers, whatever test directories pytest was given

PROMPTS = ["37+58=", "1+2=", "99*9=", "(4-7)*3=", "12+"]
SAMPLE = SamplingConfig(temperature=1.0, max_tokens=8)


def _requests(sizes: list[int]) -> list[RolloutRequest]:
    return [
        RolloutRequest(f"p{i}", char_ids(p), n=k, seed=rollout_seed(7, 0, f"p{i}"), prompt=p)
        for i, (p, k) in enumerate(zip(PROMPTS, sizes, strict=True))
    ]


# --------------------------------------------------------------------------- rollout engine death


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _tensors_of(checkpoint):
    """A ``set_weights`` source: the tensors of a checkpoint directory, read into memory."""
    from safetensors.torch import load_file

    return lambda: load_file(str(checkpoint / "model.safetensors")).items()


@pytest.mark.slow
def test_dead_engine_is_replaced_with_the_last_weights_and_same_rollouts(random_checkpoints, caplog):
    """In-process (the CPU default) the engine core lives in this process: its death shows as
    vLLM's ``EngineDeadError`` from ``generate``, simulated here."""
    from vllm.v1.engine.exceptions import EngineDeadError

    caplog.set_level(logging.WARNING, logger="coba_tasks.engines.rollout")
    a, b = random_checkpoints
    reqs = _requests([3, 5, 2, 4, 1])
    engine = make_backend("vllm", a, dtype="float32", max_model_len=64, seed=0)
    try:
        from_a = engine.generate(reqs, SAMPLE)
        engine.load_weights(b, version=3)
        first = engine.generate(reqs, SAMPLE)
        assert [r.token_ids for r in first] != [r.token_ids for r in from_a]  # the weights matter

        dead = engine._llm

        def engine_dead(*args, **kwargs):
            raise EngineDeadError()

        dead.generate = engine_dead
        again = engine.generate(reqs, SAMPLE)
        assert engine.restarts == 1 and engine._llm is not dead
        assert "rollout engine died (generate raised EngineDeadError" in caplog.text
        assert "started a new engine" in caplog.text and str(b) in caplog.text
        assert again == first  # same completions, token ids, seeds, and weight version 3
        assert {r.weight_version for r in again} == {3}

        # Found dead (vLLM's liveness flag) when the next update's weights are handed over from memory: a new
        # engine takes those weights.
        engine.engine_dead = lambda: True
        engine.set_weights(_tensors_of(a), version=5)
        del engine.engine_dead
        assert engine.restarts == 2 and "found dead before load" in caplog.text
        after_load = engine.generate(reqs, SAMPLE)
        assert [r.token_ids for r in after_load] == [r.token_ids for r in from_a]
        assert {r.weight_version for r in after_load} == {5}

        # Dead in generate after weights from memory: the new engine asks the source for them again.
        engine._llm.generate = engine_dead
        assert engine.generate(reqs, SAMPLE) == after_load
        assert engine.restarts == 3 and "started a new engine on the trainer's weights" in caplog.text
    finally:
        engine.close()


@pytest.mark.slow
@pytest.mark.skipif(  # CI runs it (CI=true): the engine's death out of process is the GPU default
    not os.environ.get("COBA_TEST_ENGINE_PROCESS") and not os.environ.get("CI") and not _cuda(),
    reason="on CPU two out-of-process engine starts take 2-3 min; CI runs it; set COBA_TEST_ENGINE_PROCESS=1 to run",
)
def test_engine_core_process_killed_mid_step_is_replaced(random_checkpoints, caplog, monkeypatch):
    """Out of process (the GPU default): SIGKILL the engine-core process while ``generate`` waits
    for its first output; vLLM's monitor marks the engine dead, generate raises, a new engine runs it.
    Two engine starts in child processes: about a minute each on a loaded 2-core machine."""
    import psutil
    import vllm.envs

    # An in-process engine started earlier in this process (VLLMBackend's CPU default) set this
    # variable and froze vLLM's environment cache: undo both for the engine-core process here.
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    vllm.envs.disable_envs_cache()
    caplog.set_level(logging.WARNING, logger="coba_tasks.engines.rollout")
    a, b = random_checkpoints
    reqs = _requests([4, 8, 4, 8, 4])
    engine = make_backend("vllm", a, dtype="float32", max_model_len=64, seed=0, in_process=False)
    try:
        assert engine.weight_transport == ("ipc" if _cuda() else "bytes")
        engine.set_weights(_tensors_of(b), version=2)  # from memory, across the process boundary
        greedy = SamplingConfig(temperature=0.0, max_tokens=8)
        expected = make_backend("transformers", b).generate(reqs, greedy)
        assert [r.token_ids for r in engine.generate(reqs, greedy)] == [r.token_ids for r in expected]
        first = engine.generate(reqs, SAMPLE)
        client = engine._llm.llm_engine.engine_core
        cores = [psutil.Process(p.pid) for p in client.resources.engine_manager.processes]
        assert cores and not engine.engine_dead()
        real_get_output = client.get_output

        def kill_then_wait(*args, **kwargs):  # requests are sent: the engine dies mid-step
            for core in cores:
                for proc in [*core.children(recursive=True), core]:
                    proc.kill()
            client.get_output = real_get_output
            return real_get_output(*args, **kwargs)

        client.get_output = kill_then_wait
        again = engine.generate(reqs, SAMPLE)
        assert engine.restarts == 1
        assert "rollout engine died" in caplog.text and "on the trainer's weights" in caplog.text
        assert again == first
        assert all(not c.is_running() or c.status() == psutil.STATUS_ZOMBIE for c in cores)
    finally:
        engine.close()


# --------------------------------------------------------------------------- failed writes


def _tmp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.endswith(".tmp")]


def _new_store(root: Path) -> RunStore:
    store = RunStore(root)
    store.create({"run": {"steps": 1}}, "h", {})
    return store


DF = pd.DataFrame({"prompt_id": ["a", "b", "c"], "reward": [1.0, 0.0, 1.0]})


def _disk_full_after(n_bytes: int):
    """A pq.write_table stand-in: writes ``n_bytes`` of the real table, then fails as a full disk does."""
    import io

    import pyarrow.parquet as pq

    real = pq.write_table

    def write_table(table, where, **kwargs):
        buf = io.BytesIO()
        real(table, buf, **kwargs)
        where.write(buf.getvalue()[:n_bytes])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    return write_table


def test_disk_full_mid_write_leaves_no_file_no_temporary_no_entry(tmp_path, monkeypatch):
    store = _new_store(tmp_path / "run")
    store.write_table(1, Table.ROLLOUTS, DF)
    monkeypatch.setattr(store_module.pq, "write_table", _disk_full_after(100))
    with pytest.raises(OSError, match="No space left on device") as info:
        store.write_table(1, Table.REWARDS, DF)
    assert info.value.errno == errno.ENOSPC
    assert any("rewards.parquet" in note for note in getattr(info.value, "__notes__", []))
    assert not store.table_path(1, Table.REWARDS).exists()
    assert _tmp_files(store.root) == []
    assert Table.REWARDS not in store.manifest(1) and not store.is_done(1, Table.REWARDS)
    assert store.is_done(1, Table.ROLLOUTS)  # what was done before is untouched
    monkeypatch.undo()  # space freed
    store.write_table(1, Table.REWARDS, DF)
    pd.testing.assert_frame_equal(store.read_table(1, Table.REWARDS), DF)


def test_disk_full_while_rewriting_a_done_table_leaves_it_not_done_then_rewrite_succeeds(tmp_path, monkeypatch):
    store = _new_store(tmp_path / "run")
    store.write_table(1, Table.REWARDS, DF)
    old_bytes = store.table_path(1, Table.REWARDS).read_bytes()
    monkeypatch.setattr(store_module.pq, "write_table", _disk_full_after(10))
    with pytest.raises(OSError):
        store.write_table(1, Table.REWARDS, DF.assign(reward=0.0))
    # the old file is whole (never half-overwritten) but no longer listed: the stage reads as not done
    assert store.table_path(1, Table.REWARDS).read_bytes() == old_bytes
    assert not store.is_done(1, Table.REWARDS) and _tmp_files(store.root) == []
    monkeypatch.undo()
    store.write_table(1, Table.REWARDS, DF.assign(reward=0.0))
    assert store.read_table(1, Table.REWARDS)["reward"].tolist() == [0.0] * 3


def test_disk_full_when_writing_the_manifest_leaves_the_table_not_done(tmp_path, monkeypatch):
    store = _new_store(tmp_path / "run")
    real = fileio.atomic_write

    def full_on_manifest(path, write):
        if Path(path).name == store_module.MANIFEST_FILE:

            def partial(f):
                f.write(b'{"schema_version": 1, "entr')
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

            return real(path, partial)
        return real(path, write)

    monkeypatch.setattr(store_module, "atomic_write", full_on_manifest)
    with pytest.raises(OSError):
        store.write_table(1, Table.REWARDS, DF)
    assert not store.is_done(1, Table.REWARDS) and store.manifest(1) == {}
    assert _tmp_files(store.root) == []
    monkeypatch.undo()
    store.write_table(1, Table.REWARDS, DF)  # the untracked file from the failed attempt is replaced
    pd.testing.assert_frame_equal(store.read_table(1, Table.REWARDS), DF)


def test_permission_denied_at_rename_leaves_nothing(tmp_path, monkeypatch):
    """A directory that turned read-only (a remount, an operator): the rename is refused. Runs as root too."""
    store = _new_store(tmp_path / "run")
    real_replace = os.replace

    def refuse(src, dst, *args, **kwargs):
        if str(dst).endswith("rewards.parquet"):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(dst))
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(fileio.os, "replace", refuse)
    with pytest.raises(PermissionError):
        store.write_table(1, Table.REWARDS, DF)
    assert not store.table_path(1, Table.REWARDS).exists() and _tmp_files(store.root) == []
    assert not store.is_done(1, Table.REWARDS)
    monkeypatch.undo()
    store.write_table(1, Table.REWARDS, DF)
    assert store.is_done(1, Table.REWARDS)


def _check_read_only_step_directory(root: Path) -> None:
    """A write into a step directory the process may not write fails, leaving nothing and no manifest entry."""
    store = _new_store(root)
    store.write_table(1, Table.ROLLOUTS, DF)
    step_dir = store.step_dir(1)
    step_dir.chmod(0o555)
    try:
        with pytest.raises(PermissionError):
            store.write_table(1, Table.REWARDS, DF)
        assert not store.table_path(1, Table.REWARDS).exists() and _tmp_files(store.root) == []
        assert list(store.manifest(1)) == [Table.ROLLOUTS]
    finally:
        step_dir.chmod(0o755)
    store.write_table(1, Table.REWARDS, DF)
    assert store.is_done(1, Table.REWARDS)


def _drop_file_capabilities() -> None:
    """In a child before exec: drop the capabilities that let root ignore file permissions (CAP_DAC_OVERRIDE,
    CAP_DAC_READ_SEARCH, CAP_FOWNER) from its bounding set, so the program it runs as root cannot take them."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2, 3):
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), f"prctl(PR_CAPBSET_DROP, {cap})")


@pytest.mark.skipif(os.name != "posix", reason="POSIX permissions")
def test_read_only_step_directory(tmp_path):
    """Root writes into read-only directories, and CI runs as root: there the check runs in a child process
    without the capabilities that override file permissions, so the kernel really refuses the write."""
    if os.geteuid() != 0:
        _check_read_only_step_directory(tmp_path / "run")
        return
    import subprocess
    import sys

    code = (
        "import sys; from pathlib import Path; sys.path[:0] = sys.argv[2:]; import test_faults; "
        "test_faults._check_read_only_step_directory(Path(sys.argv[1])); print('checked')"
    )
    here = Path(__file__).resolve().parent
    paths = [str(here), str(here.parent), str(here.parent / "flows"), str(here.parents[1])]
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "run"), *paths],
        preexec_fn=_drop_file_capabilities,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("checked"), proc.stderr[-3000:]


def test_temporaries_left_by_a_killed_writer_are_ignored_then_removed(tmp_path):
    store = _new_store(tmp_path / "run")
    step_dir = store.step_dir(1)
    step_dir.mkdir(parents=True)
    stale = [step_dir / ".rewards.parquet.0badc0de.tmp", step_dir / "._manifest.json.0badc0de.tmp"]
    for p in stale:
        p.write_bytes(b"PAR1 half a file")  # what a SIGKILL mid-write leaves
    assert not store.is_done(1, Table.REWARDS) and store.manifest(1) == {}
    other = step_dir / ".rollouts.parquet.0badc0de.tmp"  # another table's: not this write's business
    other.write_bytes(b"x")
    store.write_table(1, Table.REWARDS, DF)
    assert not any(p.exists() for p in stale) and other.exists()
    pd.testing.assert_frame_equal(store.read_table(1, Table.REWARDS), DF)


# --------------------------------------------------------------------------- a full disk inside a run

SHORT_RUN = ["run.steps=2", "run.eval_every=0"]  # after test_resume's overrides: 2 steps, eval before/after


def _short_config(model: Path, data: tuple[Path, Path]) -> dict:
    from coba_tasks.pipeline.config import config_to_dict, load_config

    # rollouts from transformers: the subject is the table writes, not the engine (whose deaths are above)
    overrides = [*test_resume._overrides(model, data, "transformers"), *SHORT_RUN]
    return config_to_dict(load_config(test_resume.ROOT / "configs/tiny-test.yaml", overrides))


@pytest.fixture(scope="module")
def short_baseline(tmp_path_factory, prefect_harness, random_checkpoints, first_char_data) -> RunStore:
    """An uninterrupted 2-step run (in this process)."""
    from flows.train import train_flow

    run_dir = tmp_path_factory.mktemp("baseline") / "run"
    train_flow(run_dir=str(run_dir), config=_short_config(random_checkpoints[0], first_char_data))
    return RunStore.open(run_dir)


def _assert_same_tables_and_weights(a: RunStore, b: RunStore, base_model: Path) -> None:
    from safetensors.torch import load_file

    ta, tb = test_resume._all_tables(a), test_resume._all_tables(b)
    assert sorted(ta) == sorted(tb)
    for key in ta:
        pd.testing.assert_frame_equal(ta[key], tb[key], check_exact=True, obj=str(key))
    for step in (1, 2):
        wa = load_file(str(a.checkpoint_dir(step) / "model.safetensors"))
        wb = load_file(str(b.checkpoint_dir(step) / "model.safetensors"))
        assert wa.keys() == wb.keys() and all(bool((wa[k] == wb[k]).all()) for k in wa), step
    test_resume._assert_same_trainer_state(a, b, 2)
    for store in (a, b):  # trained weights, not copies of the base model
        assert_updates_moved(store, base_model, 2)


@pytest.mark.slow
def test_disk_full_in_a_run_then_resume_equals_uninterrupted(
    tmp_path, short_baseline, random_checkpoints, first_char_data, monkeypatch
):
    """The rewards table of step 1 cannot be written (its task retry fails too): the run fails with
    ENOSPC; once space is freed, ``resume`` ends with the tables of an uninterrupted run."""
    from flows.train import train_flow

    run_dir = tmp_path / "run"
    target = run_dir / "steps" / "000001" / "rewards.parquet"
    real = fileio.atomic_write
    attempts = []

    def full_disk(path, write):
        if Path(path) == target:
            attempts.append(path)
            return real(path, lambda f: (f.write(b"PAR1" * 64), _raise_enospc()))
        return real(path, write)

    # every Parquet table goes through fileio.write_parquet, which writes with fileio.atomic_write
    monkeypatch.setattr(fileio, "atomic_write", full_disk)
    config = _short_config(random_checkpoints[0], first_char_data)
    state = train_flow(run_dir=str(run_dir), config=config, return_state=True)
    assert state.is_failed()
    assert len(attempts) == 2  # the task and its retry
    store = RunStore.open(run_dir)
    assert store.is_done(1, Table.ROLLOUTS) and not store.is_done(1, Table.REWARDS)
    assert not target.exists() and _tmp_files(run_dir) == []

    monkeypatch.undo()  # space freed
    train_flow(run_dir=str(run_dir), resume=True)
    _assert_same_tables_and_weights(short_baseline, store, random_checkpoints[0])
    assert _tmp_files(run_dir) == []


def _raise_enospc() -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
