"""A LoRA checkpoint records its base model's content hash; merging, evaluation and resume refuse another base.

An adapter is a difference to one base model: merged into another (the base rebuilt at the same path with
another seed) it is no longer the trained policy, and every check of the files would still pass.
"""

from __future__ import annotations

import json
import logging
import re
import shutil

import numpy as np
import pytest
from conftest import make_random_checkpoint

from coba_tasks.engines.checkpoint import verify_checkpoint
from coba_tasks.engines.fileio import content_sha256
from coba_tasks.engines.lora import ADAPTER_BASE_FILE, AdapterBaseError, merge_adapter_checkpoint
from coba_tasks.engines.update import PolicyTrainer
from coba_tasks.pipeline.policy import update_settings

PROMPTS = [[10, 11, 12], [13, 14], [15, 16, 17, 18], [10, 12]]
COMPLETIONS = [[20, 21, 2], [22, 2], [23], [24, 25, 26, 2]]
ADV = np.array([1.0, -1.0, 0.5, -0.5], dtype=np.float32)
LORA = update_settings(lr=1e-2, micro_batch_size=2, lora_rank=4, lora_alpha=8.0)


@pytest.fixture
def adapter(tmp_path):
    """(base, checkpoint, the base's sha256): an adapter trained one update on a base of its own."""
    base = make_random_checkpoint(tmp_path / "base", 0)
    trainer = PolicyTrainer(base, LORA)
    trainer.update(PROMPTS, COMPLETIONS, ADV)
    return base, trainer.save_checkpoint(tmp_path / "ckpt"), content_sha256(base)


def rebuilt(base):
    """The base model rebuilt in place with another seed: the same path, the same file names, other weights."""
    shutil.rmtree(base)
    make_random_checkpoint(base, 1)
    return content_sha256(base)


def mismatch(base, then: str, now: str) -> str:
    """The refusal's pattern: the base path, both hashes' first 12 hex digits, and the fix."""
    where = re.escape(str(base.resolve()))
    hashes = rf"\(sha256 {now[:12]}\.\.\., .* records {then[:12]}\.\.\.\)"
    return rf"^the base model {where} is not the one .* {hashes}: restore"


def test_the_checkpoint_records_the_base_models_content_hash(adapter):
    base, ckpt, sha = adapter
    record = json.loads((ckpt / ADAPTER_BASE_FILE).read_text())
    assert record == {"base_model": str(base.resolve()), "sha256": sha}
    verify_checkpoint(ckpt)  # listed in the manifest like every file of the checkpoint


def test_merging_into_another_base_is_refused(adapter, tmp_path):
    base, ckpt, sha = adapter
    merge_adapter_checkpoint(ckpt, tmp_path / "merged")  # the base it was trained on: merged
    now = rebuilt(base)
    with pytest.raises(AdapterBaseError, match=mismatch(base, sha, now)) as info:
        merge_adapter_checkpoint(ckpt, tmp_path / "merged-again")
    assert "\n" not in str(info.value)
    assert not (tmp_path / "merged-again").exists()


def test_evaluating_on_another_base_is_refused_before_an_engine_starts(adapter, tmp_path):
    from coba_tasks.pipeline.evaluation import EvalSettings, check_eval_inputs

    base, ckpt, sha = adapter
    test = tmp_path / "test.parquet"
    test.write_bytes(b"")  # present: the check of the model comes first
    check_eval_inputs(str(ckpt), EvalSettings(test_path=str(test)))
    now = rebuilt(base)
    with pytest.raises(AdapterBaseError, match=mismatch(base, sha, now)):
        check_eval_inputs(str(ckpt), EvalSettings(test_path=str(test)))


def test_resuming_on_another_base_is_refused(adapter):
    base, ckpt, sha = adapter
    now = rebuilt(base)
    trainer = PolicyTrainer(base, LORA)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    with pytest.raises(AdapterBaseError, match=mismatch(base, sha, now)):
        trainer.load_checkpoint(ckpt)
    assert all(v.equal(before[k]) for k, v in trainer.model.state_dict().items())  # nothing loaded
    assert trainer.updates == 0


def test_an_old_checkpoint_without_the_hash_is_accepted_with_a_warning(adapter, tmp_path, caplog):
    base, ckpt, _ = adapter
    (ckpt / ADAPTER_BASE_FILE).unlink()
    with caplog.at_level(logging.WARNING, logger="coba_tasks.engines.lora"):
        merge_adapter_checkpoint(ckpt, tmp_path / "merged")
        PolicyTrainer(base, LORA).load_checkpoint(ckpt)
    warned = [r.getMessage() for r in caplog.records if ADAPTER_BASE_FILE in r.getMessage()]
    assert len(warned) == 2 and all(str(base.resolve()) in w for w in warned)


def test_an_adapter_checkpoint_is_the_same_bytes_whatever_the_processs_hash_seed(tmp_path):
    """peft writes the adapter's target modules from a set, in the process's string-hash order: two identical runs
    wrote adapter_config.json (and so checkpoint.json) with other bytes. coba writes them sorted."""
    import subprocess
    import sys

    base = make_random_checkpoint(tmp_path / "base", 0)
    script = (
        "import sys; from coba_tasks.engines.update import PolicyTrainer; from coba_tasks.pipeline.policy import "
        "update_settings; s = update_settings(lora_rank=4, lora_alpha=8.0); "
        "PolicyTrainer(sys.argv[1], s).save_checkpoint(sys.argv[2])"
    )
    written = []
    for seed in ("1", "2", "3"):
        out = tmp_path / f"ckpt-{seed}"
        env = {**__import__("os").environ, "PYTHONHASHSEED": seed}
        subprocess.run([sys.executable, "-c", script, str(base), str(out)], check=True, env=env, timeout=300)
        written.append((out / "adapter_config.json").read_bytes())
    targets = json.loads(written[0])["target_modules"]
    assert targets == sorted(targets) and len(targets) > 2
    assert all(w == written[0] for w in written)
