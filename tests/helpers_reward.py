"""A reward the random tiny model earns, so that the GRPO updates of a test run move the weights.

The random tiny character model of ``conftest.make_random_checkpoint`` never answers arithmetic: every
reward is 0, every advantage 0, and AdamW leaves every weight as it was, so two runs compared weight by
weight would be two copies of the starting model. A prompt whose ``data_source`` is ``FIRST_CHAR`` is
scored by ``first_char_verifier`` instead: reward 1 when the completion starts with a lowercase letter or
a digit, about 38 % of the random model's samples, so most groups hold both rewards and every update
moves the policy (toward those characters).

- ``write_flat`` / ``write_first_char_data``: flat Parquet files (``prompt``, ``answer``,
  ``data_source``) scored by it; the fixture ``first_char_data`` (conftest.py) writes one train/test pair
  per session.
- ``assert_updates_moved``: each update of a run had a gradient and changed the weights.
- ``write_first_char_reward_file``: the same reward as a reward file (``verify.reward_function``), for
  processes this module is not imported in.
- ``python_with_first_char``: the argv of ``python -m MODULE ARGS`` in a process that has the verifier
  (``coba run`` / ``coba resume`` / ``prefect flow-run retry`` as subprocesses score these prompts too).

Importing this module registers the verifier, once per process: the registry refuses a second function
under a name, so a second copy of this module (imported under another name) leaves the first in place.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from coba_tasks.engines.verify import Verdict, VerdictKind, register_verifier, registered_verifiers
from coba_tasks.pipeline.store import Table

FIRST_CHAR = "test-first-char"
TESTS_DIR = Path(__file__).resolve().parent

# 6 training prompts (the tests' data.train_prompts) and 10 held-out ones (configs/tiny-test.yaml's
# data.eval_prompts), three difficulty levels each as in the arithmetic files
TRAIN_PROMPTS = ("12+7=", "3*4=", "40-9=", "5+5=", "81-6=", "7*7=")
TEST_PROMPTS = ("2+2=", "9-3=", "6*2=", "1+8=", "33+4=", "8*3=", "70-5=", "4*9=", "15+6=", "2*8=")


def first_char_verifier(completion: str, ground_truth: str) -> Verdict:
    """Reward 1 when the completion starts with a lowercase letter or a digit (the ground truth is unused)."""
    head = completion[:1]
    good = head.isascii() and (head.islower() or head.isdigit())
    return Verdict.of(VerdictKind.CORRECT if good else VerdictKind.WRONG, head)


if FIRST_CHAR not in registered_verifiers():
    register_verifier(FIRST_CHAR, in_process=True)(first_char_verifier)


FIRST_CHAR_REWARD_FILE = """\
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    head = solution_str[:1]
    return 1.0 if head.isascii() and (head.islower() or head.isdigit()) else 0.0
"""


def write_first_char_reward_file(root: Path) -> Path:
    """``first_char_verifier`` as a reward file (``verify.reward_function``), for runs in processes that do not
    import this module (``coba compare`` trains each run in a spawned process): it scores every prompt."""
    path = root / "first_char_reward.py"
    path.write_text(FIRST_CHAR_REWARD_FILE)
    return path


def write_flat(path: Path, prompts: Sequence[str], difficulty: Sequence[int] | None = None) -> Path:
    """A flat Parquet dataset of ``prompts`` scored by ``first_char_verifier`` (answer "0", unused)."""
    columns = {"prompt": list(prompts), "answer": "0", "data_source": FIRST_CHAR}
    if difficulty is not None:
        columns["difficulty"] = list(difficulty)
    pd.DataFrame(columns).to_parquet(path)
    return path


def write_first_char_data(root: Path) -> tuple[Path, Path]:
    """(train, test) flat Parquet files in ``root``: ``TRAIN_PROMPTS`` and ``TEST_PROMPTS``."""
    levels = [1 + i % 3 for i in range(max(len(TRAIN_PROMPTS), len(TEST_PROMPTS)))]
    train = write_flat(root / "first_char_train.parquet", TRAIN_PROMPTS, levels[: len(TRAIN_PROMPTS)])
    test = write_flat(root / "first_char_test.parquet", TEST_PROMPTS, levels[: len(TEST_PROMPTS)])
    return train, test


def data_overrides(data: tuple[Path, Path]) -> list[str]:
    """Config overrides that train and evaluate on ``data`` (the ``first_char_data`` fixture)."""
    train, test = data
    return [f"data.train={train}", f"data.test={test}"]


def assert_updates_moved(store, base_model: Path, steps: int) -> None:
    """Every update of the first ``steps`` steps of ``store`` (a ``RunStore``) did something: a positive
    ``grad_norm`` in its update.parquet, and each checkpoint's weights (``run.checkpoint_every`` may leave
    steps without one) differ from the base model's and from the previous checkpoint's (so a comparison of
    these weights compares trained ones)."""
    import torch
    from safetensors.torch import load_file

    base = load_file(str(Path(base_model) / "model.safetensors"))
    previous = base
    for step in range(steps):
        grad_norm = float(store.read_table(step, Table.UPDATE)["grad_norm"].iloc[0])
        assert grad_norm > 0, (step, grad_norm)
        if not store.checkpoint_dir(step + 1).is_dir():
            continue
        weights = load_file(str(store.checkpoint_dir(step + 1) / "model.safetensors"))
        assert weights.keys() == base.keys(), step
        assert any(not torch.equal(weights[k], base[k]) for k in weights), f"checkpoint {step + 1} is the base model"
        assert any(not torch.equal(weights[k], previous[k]) for k in weights), f"update {step} moved nothing"
        previous = weights


def python_with_first_char(module: str, *args: str) -> list[str]:
    """The argv of ``python -m module args`` in a process that imports this module (the verifier) first."""
    code = (
        f"import runpy, sys; sys.path.append({str(TESTS_DIR)!r}); import helpers_reward; "
        f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)"
    )
    return [sys.executable, "-c", code, *args]
