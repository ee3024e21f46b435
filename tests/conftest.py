"""Shared fixtures: tiny random checkpoints in HF layout (built, never downloaded)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


def make_random_checkpoint(out: Path, seed: int) -> Path:
    from coba_tasks.model import TinyLlamaSpec, build_char_tokenizer, build_tiny_llama, save_hf

    tok = build_char_tokenizer()
    spec = TinyLlamaSpec(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2)
    return save_hf(build_tiny_llama(tok, spec, seed=seed), tok, out)


@pytest.fixture(scope="session")
def random_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two tiny random Llama checkpoints (seeds 0 and 1) with the character tokenizer."""
    root = tmp_path_factory.mktemp("ckpt")
    return make_random_checkpoint(root / "a", 0), make_random_checkpoint(root / "b", 1)


@pytest.fixture(scope="session")
def prefect_harness(tmp_path_factory: pytest.TempPathFactory):
    """One Prefect test server for the whole session, with a temporary PREFECT_HOME."""
    home = tmp_path_factory.mktemp("prefect-home")
    os.environ["PREFECT_HOME"] = str(home)
    os.environ.pop("PREFECT_API_URL", None)
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=90):
        yield home
