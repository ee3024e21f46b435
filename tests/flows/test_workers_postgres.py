"""Prefect on PostgreSQL with several process workers, under load and faults (docs/workers.md).

One module-scoped cluster serves the tests, in order: a PostgreSQL cluster of its own (``initdb`` in a
temporary directory, a free loopback port, ``pg_trgm``), ``prefect server start`` on it, ``coba
setup-server`` (the ``coba-process`` and ``coba-gpu`` pools and the automation that crashes silent flow runs), ``prefect
deploy --all`` and two ``prefect worker start --pool coba-process --limit 2`` workers, whose flow runs
send a heartbeat every 30 s. Every run is the tiny config (random tiny model, 4 steps, the transformers
rollout backend: these tests are about orchestration; the vLLM path on a worker is test_deploy.py's)
on prompts scored by a reward the random model earns (tests/helpers_reward.py, loaded into the
workers' processes by a ``sitecustomize`` module), so every update moves the weights. The reference is
the same config run alone with ``coba run`` on the embedded server: every run below must end with the
same tables (and weights) as that one.

1. Load: four coba-train deployment runs submitted at once, two per worker.
2. A worker and its flow-run process SIGKILLed in the middle of a step; the flow run stays Running
   until the automation sets it Crashed; a new deployment run with the same run_name computes only
   the stages that were not done; ``prefect flow-run retry`` of the crashed one then changes nothing.
3. Two deployment runs on one run_name at once: the second is refused by the run lock.
4. The server and the database stopped and started again while a run is in progress.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import pytest
import yaml
from helpers_reward import TESTS_DIR, assert_updates_moved, python_with_first_char
from prefect_procs import (
    COBA,
    PREFECT,
    PROJECT,
    Postgres,
    Processes,
    flow_run_logs,
    free_port,
    pid_of_flow_run,
    postgres_bindir,
    prefect_env,
    process_tree,
    start_server,
    wait_final,
    wait_healthy,
)

from coba_tasks.pipeline.store import STAGES, RunStore, Table

pytestmark = pytest.mark.slow

STEPS = 4
HEARTBEAT_S = 30  # the shortest heartbeat Prefect 3.7.7 allows
CRASH_AFTER_S = 60  # coba setup-server --crash-after
RUN_TIMEOUT_S = 240


@dataclass
class Cluster:
    root: Path
    pg: Postgres
    procs: Processes
    url: str
    port: int
    env: dict[str, str]  # the CLI's and the server's environment
    worker_env: dict[str, str]  # the workers' (and so their flow runs') environment
    config: Path
    solo: Path  # the reference run, `coba run` alone
    base_model: Path  # the model every run starts from
    server: subprocess.Popen | None = None
    workers: dict[str, subprocess.Popen] = field(default_factory=dict)

    def start_server(self) -> None:
        self.server = start_server(self.procs, "server", self.port, self.env, cwd=self.root)
        wait_healthy(self.url, self.server)

    def start_worker(self, name: str) -> subprocess.Popen:
        cwd = self.root / f"{name}-cwd"
        cwd.mkdir(exist_ok=True)
        args = [*PREFECT, "worker", "start", "--pool", "coba-process", "--name", name, "--limit", "2"]
        self.workers[name] = self.procs.start(name, args, cwd=cwd, env=self.worker_env)
        return self.workers[name]

    def live_workers(self) -> list[subprocess.Popen]:
        return [w for w in self.workers.values() if w.poll() is None]

    def client(self):
        from prefect.client.orchestration import get_client
        from prefect.settings import PREFECT_API_URL, temporary_settings

        class _Client:  # get_client inside temporary_settings, as a context manager
            def __enter__(s):
                s.settings = temporary_settings(updates={PREFECT_API_URL: self.url})
                s.settings.__enter__()
                s.client = get_client(sync_client=True)
                return s.client.__enter__()

            def __exit__(s, *exc):
                s.client.__exit__(*exc)
                s.settings.__exit__(*exc)

        return _Client()

    def submit(self, client, run_name: str, env: dict[str, str] | None = None) -> uuid.UUID:
        """A coba-train deployment run of the tiny config into root/<run_name> (``env``: extra variables of
        its process, a job variable of the process work pool); its flow run id."""
        deployment = client.read_deployment_by_name("coba-train/coba-train")
        run = client.create_flow_run_from_deployment(
            deployment.id,
            parameters={
                "config_path": str(self.config),
                "run_name": run_name,
                "run_dir": str(self.root / run_name),
            },
            job_variables={"env": env} if env else None,
        )
        return run.id

    def wait(self, client, run_id: uuid.UUID):
        return wait_final(client, run_id, self.live_workers(), timeout_s=RUN_TIMEOUT_S)


def tiny_config(path: Path, model: Path, data: tuple[Path, Path]) -> Path:
    cfg = yaml.safe_load((PROJECT / "configs" / "tiny-test.yaml").read_text())
    cfg["model"] = {"path": str(model)}
    cfg["run"]["steps"] = STEPS
    cfg["data"].update(train=str(data[0]), test=str(data[1]), train_prompts=6)
    cfg["rollout"]["backend"] = "transformers"
    path.write_text(yaml.safe_dump(cfg))
    return path


def write_sitecustomize(directory: Path) -> Path:
    """A module every Python process with ``directory`` on PYTHONPATH imports at start: the test verifier."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sitecustomize.py").write_text(
        f"import sys\nsys.path.append({str(TESTS_DIR)!r})\nimport helpers_reward  # noqa: F401\n"
    )
    return directory


def tree_usage(pid: int) -> tuple[float, float]:
    """(resident MiB, CPU seconds) of ``pid`` and its descendants, ended ones included in the CPU time."""
    rss_kib, ticks = 0, 0
    try:  # the CPU time of children that ended and were reaped (a database's closed connections)
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks += int(stat[13]) + int(stat[14])
    except OSError:
        pass
    for p in process_tree(pid):
        try:
            status = Path(f"/proc/{p}/status").read_text()
            stat = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        rss_kib += next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0)
        ticks += int(stat[11]) + int(stat[12])
    return rss_kib / 1024, ticks / os.sysconf("SC_CLK_TCK")


def worker_flow_runs(log: Path) -> set[uuid.UUID]:
    """The flow runs a worker started, from its log: submitted and not aborted."""
    text = log.read_text(errors="replace")
    pattern = r"{} flow run '([0-9a-f-]{{36}})'"
    submitted = set(re.findall(pattern.format("submitting"), text))
    aborted = set(re.findall(pattern.format("Aborted submission of"), text))
    return {uuid.UUID(i) for i in submitted - aborted}


def postmaster_pid(pg: Postgres) -> int:
    return int((pg.data / "postmaster.pid").read_text().split()[0])


def manifest_snapshot(run_dir: Path) -> dict[tuple[int, str], tuple]:
    """(step, table) -> (sha256, written_at, inode, mtime_ns) of every done table of the run."""
    store = RunStore.open(run_dir)
    snap = {}
    for step in store.steps():
        for name, entry in store.manifest(step).items():
            st = os.stat(store.table_path(step, name))
            snap[(step, name)] = (entry["sha256"], entry["written_at"], st.st_ino, st.st_mtime_ns)
    return snap


def assert_same_run(run_dir: Path, reference: Path, base_model: Path) -> None:
    """``run_dir`` is complete and holds the same tables and checkpoints as ``reference``, whose every update
    moved the weights away from ``base_model``; no leftovers."""
    import torch
    from safetensors.torch import load_file

    a, b = RunStore.open(run_dir), RunStore.open(reference)
    assert a.steps() == b.steps() == list(range(STEPS + 1)), (a.steps(), b.steps())
    for step in b.steps():
        ma, mb = a.manifest(step), b.manifest(step)
        assert ma.keys() == mb.keys(), (run_dir.name, step, sorted(ma), sorted(mb))
        for name in mb:
            assert a.damage(step, name) is None, (run_dir.name, step, name, a.damage(step, name))
            pd.testing.assert_frame_equal(
                a.read_table(step, name), b.read_table(step, name), obj=f"{step}/{name}", check_exact=True
            )
    for step in range(STEPS):
        assert set(STAGES) <= set(a.manifest(step)) | {Table.BUDGET}, (step, sorted(a.manifest(step)))
    for name in ("prompts", "history"):
        pd.testing.assert_frame_equal(a.read_run_table(name), b.read_run_table(name), obj=name, check_exact=True)
    for step in range(1, STEPS + 1):  # every checkpoint bit for bit: weights, AdamW state, trainer state
        ca, cb = a.checkpoint_dir(step), b.checkpoint_dir(step)
        wa, wb = (load_file(str(c / "model.safetensors")) for c in (ca, cb))
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wb), f"weights {step} differ"
        oa, ob = (load_file(str(c / "trainer" / "optimizer.safetensors")) for c in (ca, cb))
        # not the saved torch RNG state: it depends on which stages a process ran (tests/flows/test_resume.py)
        assert oa.keys() == ob.keys() and all(torch.equal(oa[k], ob[k]) for k in ob if k != "rng.torch"), step
        assert (ca / "trainer" / "trainer_state.json").read_text() == (
            cb / "trainer" / "trainer_state.json"
        ).read_text()
    assert_updates_moved(a, base_model, STEPS)  # trained weights: a comparison of two copies of the base proves nothing
    assert (run_dir / "summary.json").is_file()
    assert not (run_dir / ".lock").exists(), "the run lock was not released"
    assert not [p for p in run_dir.rglob("*") if p.name.endswith(".tmp")], "temporary files left behind"


REQUIRE_ENV = "COBA_REQUIRE_POSTGRES"  # .ci/run sets it: in CI these tests fail instead of skipping


def unavailable(why: str) -> None:
    """Skip these tests on a machine without PostgreSQL, but fail where they are required (CI)."""
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{why}; {REQUIRE_ENV}=1 requires these tests to run", pytrace=False)
    pytest.skip(why)


def test_missing_postgres_fails_where_it_is_required(monkeypatch):
    monkeypatch.setenv(REQUIRE_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match="COBA_REQUIRE_POSTGRES=1 requires these tests to run"):
        unavailable("PostgreSQL is not installed")
    monkeypatch.delenv(REQUIRE_ENV)
    with pytest.raises(pytest.skip.Exception, match="PostgreSQL is not installed"):
        unavailable("PostgreSQL is not installed")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, random_checkpoints, first_char_data):
    bindir = postgres_bindir()
    if bindir is None:
        unavailable("PostgreSQL is not installed and `make test` could not install it (apt-get install postgresql)")
    root = tmp_path_factory.mktemp("workers")
    config = tiny_config(root / "tiny.yaml", random_checkpoints[0], first_char_data)
    # the reference run, alone, on the embedded server: started first, it runs while the cluster starts
    solo = root / "solo"
    solo_env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    # it starts its embedded server while PostgreSQL, the cluster's server and two workers start beside it (and
    # the suite's other workers run): a first start of minutes, which coba waits for (docs/operations.md)
    solo_env.update(PREFECT_HOME=str(root / "solo-prefect-home"), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    solo_log = open(root / "solo.log", "wb")  # noqa: SIM115 - closed below
    solo_proc = subprocess.Popen(
        python_with_first_char("coba_tasks.commands.cli", "run", "--config", str(config), "--run-dir", str(solo)),
        cwd=PROJECT,
        env=solo_env,
        stdout=solo_log,
        stderr=subprocess.STDOUT,
    )
    try:
        pg = Postgres(bindir)
    except KeyError:  # root without a postgres user: nobody the server agrees to run as
        unavailable("running as root and there is no postgres user to own the PostgreSQL cluster")
    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = prefect_env(root / "prefect-home", url, PREFECT_API_DATABASE_CONNECTION_URL=pg.url)
    site = write_sitecustomize(root / "site")
    data_dirs = (root, random_checkpoints[0].parent, first_char_data[0].parent)  # where the flow runs' paths are
    worker_env = {
        **env,
        "COBA_DEPLOYMENT_ROOTS": os.pathsep.join(map(str, data_dirs)),  # besides the project (docs/workers.md)
        "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(HEARTBEAT_S),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])),
    }
    procs = Processes(root, env)
    c = Cluster(root, pg, procs, url, port, env, worker_env, config, solo, random_checkpoints[0])
    try:
        t0 = time.monotonic()
        pg.init()
        t_pg = time.monotonic()
        c.start_server()
        t_server = time.monotonic()
        procs.run("setup-server", [*COBA, "setup-server", "--crash-after", str(CRASH_AFTER_S)], PROJECT)
        procs.run("deploy", [*PREFECT, "deploy", "--all", "--no-prompt"], PROJECT)
        c.start_worker("worker-a")
        c.start_worker("worker-b")
        print(
            f"\npostgres initdb + start {t_pg - t0:.1f} s, prefect server on it {t_server - t_pg:.1f} s, "
            f"setup-server + deploy {time.monotonic() - t_server:.1f} s"
        )
        assert solo_proc.wait(timeout=600) == 0, (root / "solo.log").read_text()[-3000:]
        solo_log.close()
        yield c
    except BaseException:
        print(procs.tails())
        print((root / "solo.log").read_text(errors="replace")[-3000:])
        raise
    finally:
        solo_proc.kill()
        procs.stop_all()
        pg.close()


def test_four_runs_on_two_workers_equal_solo_runs(cluster: Cluster) -> None:
    server_before = tree_usage(cluster.server.pid)
    pg_before = tree_usage(postmaster_pid(cluster.pg))
    db_before = cluster.pg.database_bytes()
    with cluster.client() as client:
        t0 = time.monotonic()
        ids = {f"load-{i}": cluster.submit(client, f"load-{i}") for i in range(4)}
        runs = {name: cluster.wait(client, run_id) for name, run_id in ids.items()}
        wall = time.monotonic() - t0
        for name, run in runs.items():
            assert run.state.is_completed(), f"{name} ended {run.state_name}: {run.state.message}"
        task_runs = client.read_task_runs()
    for name in ids:
        assert_same_run(cluster.root / name, cluster.solo, cluster.base_model)
    # each worker ran two (--limit 2): the runs were spread, not queued behind one worker. A worker may
    # also try a flow run the other one took first; the server refuses it ("Aborted submission").
    ran = {w: worker_flow_runs(cluster.root / f"{w}.log") for w in ("worker-a", "worker-b")}
    assert ran["worker-a"] | ran["worker-b"] == set(ids.values()), ran
    assert len(ran["worker-a"]) == len(ran["worker-b"]) == 2, ran
    server_after, pg_after = tree_usage(cluster.server.pid), tree_usage(postmaster_pid(cluster.pg))
    db_after = cluster.pg.database_bytes()
    print(
        f"\n4 runs x {STEPS} steps on 2 workers: {wall:.0f} s wall; {len(task_runs)} task runs on the server; "
        f"server {server_after[0]:.0f} MiB resident, {server_after[1] - server_before[1]:.1f} CPU s; "
        f"postgres {pg_after[0]:.0f} MiB resident, {pg_after[1] - pg_before[1]:.1f} CPU s; "
        f"database {db_before / 2**20:.1f} -> {db_after / 2**20:.1f} MiB"
    )


def _stop_in_a_step(client, runs: dict[str, tuple[uuid.UUID, Path]]) -> dict[str, tuple[int, int]]:
    """Wait until each flow run (name -> (flow run id, run directory)) is inside a step (the step's rollouts
    done, its update not) and SIGSTOP its process there; name -> (step, pid). The runs are watched together,
    so one that is not yet stopped is never left unobserved while another is waited for; a run whose step
    ends between two looks is stopped in its next one (steps 1 .. STEPS - 2)."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    pids: dict[str, int | None] = {}
    stopped: dict[str, tuple[int, int]] = {}
    while len(stopped) < len(runs):
        for name, (run_id, run_dir) in runs.items():
            if name in stopped:
                continue
            assert time.monotonic() < deadline, f"{name} did not reach a step: {client.read_flow_run(run_id).state}"
            pid = pids[name] = pids.get(name) or pid_of_flow_run(run_id)
            if pid is None or not (run_dir / "run.json").exists():
                continue
            store = RunStore.open(run_dir)
            step = next((s for s in range(1, STEPS - 1) if not store.is_done(s, Table.UPDATE)), None)
            if step is None:
                raise AssertionError(f"{name}: every step ended between two looks; could not stop it inside one")
            if not store.is_done(step, Table.ROLLOUTS):
                continue
            os.kill(pid, signal.SIGSTOP)
            if store.is_done(step, Table.UPDATE):
                os.kill(pid, signal.SIGCONT)
                continue
            stopped[name] = (step, pid)
        time.sleep(0.01)
    return stopped


def test_worker_killed_mid_step_is_recovered(cluster: Cluster) -> None:
    name = "killed"
    run_dir = cluster.root / name
    with cluster.client() as client:
        first = cluster.submit(client, name)
        step, pid = _stop_in_a_step(client, {name: (first, run_dir)})[name]
        worker = next(
            n for n, w in cluster.workers.items() if w.poll() is None and w.pid in process_tree_of_ancestors(pid)
        )
        # SIGKILL the worker and everything under it (the flow-run process and its children)
        for p in process_tree(cluster.workers[worker].pid):
            os.kill(p, signal.SIGKILL)
        cluster.workers[worker].wait(10)
        t_kill = time.monotonic()
        before = manifest_snapshot(run_dir)
        done_in_step = {n for (s, n) in before if s == step}
        assert Table.ROLLOUTS in done_in_step and Table.UPDATE not in done_in_step, done_in_step
        time.sleep(3)
        assert client.read_flow_run(first).state.is_running(), "Prefect noticed the kill by itself"
        cluster.start_worker(f"{worker}-2")  # the team starts a worker again

        # recover the way a user would: the same deployment, the same run_name
        second = cluster.submit(client, name)
        run = cluster.wait(client, second)
        assert run.state.is_completed(), f"the recovery ended {run.state_name}: {run.state.message}"
        expect = f"continuing {run_dir} at step {step} ({step + 1} of {STEPS}): stages already done are skipped"
        logs = flow_run_logs(client, second, expect=expect)
        assert expect in logs, logs
        after = manifest_snapshot(run_dir)
        kept = {k: after[k] for k in before}
        assert kept == before, "a table done before the kill was written again"
        computed = set(after) - set(before)
        assert (step, Table.UPDATE) in computed and all(s >= step for s, _ in computed), sorted(computed)
        assert_same_run(run_dir, cluster.solo, cluster.base_model)

        # Prefect's view: Running until the heartbeats stop long enough for the automation
        while not client.read_flow_run(first).state.is_final():
            assert time.monotonic() - t_kill < CRASH_AFTER_S + 2 * HEARTBEAT_S + 60, "never set Crashed"
            time.sleep(2)
        crashed = client.read_flow_run(first)
        crashed_after = time.monotonic() - t_kill
        assert crashed.state.is_crashed(), crashed.state
        assert "no heartbeat" in (crashed.state.message or ""), crashed.state.message

        # a retry of the crashed flow run finds everything done and changes nothing
        cluster.procs.run("retry", [*PREFECT, "flow-run", "retry", str(first)], PROJECT)
        run = cluster.wait(client, first)
        assert run.state.is_completed(), f"the retry ended {run.state_name}: {run.state.message}"
        assert manifest_snapshot(run_dir) == after
    print(
        f"\nkilled in step {step} ({step + 1} of {STEPS}; {len(before)} tables done, {len(computed)} computed by the "
        "recovery); "
        f"Prefect set the flow run Crashed {crashed_after:.0f} s after the kill"
    )


def process_tree_of_ancestors(pid: int) -> list[int]:
    """``pid`` and its ancestors, from /proc."""
    chain = [pid]
    while chain[-1] > 1:
        try:
            chain.append(int(Path(f"/proc/{chain[-1]}/stat").read_text().rsplit(")", 1)[1].split()[1]))
        except OSError:
            break
    return chain


def test_second_run_on_one_run_name_is_refused(cluster: Cluster) -> None:
    name = "twice"
    run_dir = cluster.root / name
    with cluster.client() as client:
        first = cluster.submit(client, name)
        # the first is held inside a step (SIGSTOP: alive, holding the run's lock) for as long as the second
        # takes to start: a short run could otherwise end before the second's process is up
        _, pid = _stop_in_a_step(client, {name: (first, run_dir)})[name]
        assert (run_dir / ".lock").exists()
        try:
            second = cluster.submit(client, name)
            refused = cluster.wait(client, second)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert refused.state.is_failed(), f"the second run ended {refused.state_name}"
        logs = flow_run_logs(client, second, expect=f"{run_dir} is in use by process")
        assert f"{run_dir} is in use by process" in logs, logs
        print("\n" + next(line for line in logs.splitlines() if "is in use by process" in line))
        run = cluster.wait(client, first)
        assert run.state.is_completed(), f"the first ended {run.state_name}: {run.state.message}"
    assert_same_run(run_dir, cluster.solo, cluster.base_model)


def test_setup_server_again_replaces_its_automation(cluster: Cluster) -> None:
    from coba_tasks.commands.server_setup import AUTOMATION_NAME, setup_server

    done = setup_server(cluster.url, crash_after_s=CRASH_AFTER_S)
    assert (done["pool"], done["automation"]) == ("exists", "replaced"), done
    with cluster.client() as client:
        automations = client.read_automations_by_name(name=AUTOMATION_NAME)
        assert [str(a.id) for a in automations] == [done["automation_id"]]
        assert automations[0].trigger.within.total_seconds() == CRASH_AFTER_S
        assert client.read_work_pool("coba-process").type == "process"
        assert client.read_work_pool("coba-gpu").type == "process"  # prefect.yaml's GPU deployment needs it
    assert done["gpu_pool"] == "exists"


def test_server_and_database_restart_mid_run(cluster: Cluster) -> None:
    """Two runs inside a step when the server and the database go down for 15 s: one with Prefect's
    default client retries (5, waiting 2 + 4 + 8 + 16 + 32 s) rides the outage out; one whose client
    gives up after one retry loses its flow run, and the same deployment run again finishes it. Both
    end with the reference tables."""
    patient, impatient = "restart", "restart-no-retries"
    with cluster.client() as client:
        ids = {
            patient: cluster.submit(client, patient),
            impatient: cluster.submit(client, impatient, env={"PREFECT_CLIENT_MAX_RETRIES": "1"}),
        }
        stopped = _stop_in_a_step(client, {name: (ids[name], cluster.root / name) for name in ids})
    # the runs go on while the server and the database are down
    cluster.procs.stop(cluster.server)
    cluster.pg.stop("fast")
    for _, pid in stopped.values():
        os.kill(pid, signal.SIGCONT)
    down_s = 15
    time.sleep(down_s)
    cluster.pg.start()
    t_up = time.monotonic()
    cluster.start_server()
    with cluster.client() as client:
        done = cluster.wait(client, ids[patient])
        assert done.state.is_completed(), f"{patient} ended {done.state_name}: {done.state.message}"
        lost = cluster.wait(client, ids[impatient])
        assert not lost.state.is_completed(), "the run without client retries went through the outage"
        lost_after = time.monotonic() - t_up
        # what a user does: the same deployment run again; the run directory continues
        again = cluster.wait(client, cluster.submit(client, impatient))
        assert again.state.is_completed(), f"the rerun ended {again.state_name}: {again.state.message}"
    for name in ids:
        assert_same_run(cluster.root / name, cluster.solo, cluster.base_model)
    print(
        f"\nserver and database down {down_s} s (from steps {', '.join(str(s + 1) for s, _ in stopped.values())}): "
        f"with client retries the flow run ended {done.state_name}; with one retry it ended {lost.state_name} "
        f"({lost.state.message!r}), {lost_after:.0f} s after the server was back; its rerun completed"
    )
