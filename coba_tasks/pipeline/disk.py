"""Whether a run's checkpoints fit on its disk, checked before step 0 and on a resume (docs/real_models.md,
"Disk"): the bytes of one checkpoint from the model's parameter count, times the checkpoints on disk at once,
against the free space of the run directory's file system.

A checkpoint holds, per parameter it trains: full fine-tuning, the float32 weights and AdamW's two float32
moments (12 bytes), with ``model.dtype: bfloat16`` also the bf16 weights the checkpoint gives an engine
(14 bytes); LoRA, the float32 adapter and its moments (12 bytes per adapter parameter). Beside them, the
model directory's other files (tokenizer, config). Counted on the model built on PyTorch's meta device:
nothing is allocated or read but its config.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from coba_tasks.pipeline.config import Config

ADAMW_BYTES = 8  # two float32 moments per trained parameter
FIXED_BYTES = 64 * 1024  # the RNG state, the JSON files, the safetensors headers: tens of kB at most
GB = 1e9


class DiskSpaceError(ValueError):
    """A run whose checkpoints cannot fit on the free space of its disk."""


def parameter_counts(cfg: Config) -> tuple[int, int]:
    """(parameters of ``model.path``, parameters of its LoRA adapters: 0 without ``model.lora_rank``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    m = cfg.model
    config = AutoConfig.from_pretrained(m.path, trust_remote_code=m.trust_remote_code, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=m.trust_remote_code)
    total = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())  # tied: once
    if m.lora_rank == 0:
        return total, 0
    from coba_tasks.engines.lora import add_lora

    peft_model = add_lora(model, m.lora_rank, m.lora_alpha, m.lora_target_modules)
    return total, sum(p.numel() for p in peft_model.parameters() if p.requires_grad)


def checkpoint_bytes(cfg: Config, counts: tuple[int, int] | None = None) -> int:
    """The bytes of one checkpoint of the run ``cfg`` (the module docstring's arithmetic)."""
    total, lora = counts if counts is not None else parameter_counts(cfg)
    if lora:
        per_param, trained = 4 + ADAMW_BYTES, lora
    else:
        per_param, trained = 4 + ADAMW_BYTES + (0 if cfg.model.dtype in ("auto", "float32") else 2), total
    model_dir = Path(cfg.model.path)
    others = sum(p.stat().st_size for p in model_dir.iterdir() if p.is_file() and p.suffix != ".safetensors")
    return per_param * trained + others + FIXED_BYTES


def checkpoints_at_once(cfg: Config, first: int, existing: int) -> int:
    """How many checkpoints a run continuing at step ``first`` with ``existing`` on disk holds at most at once:
    those it keeps (``run.keep_checkpoints``, 0: all) plus the one written before the oldest is deleted."""
    r = cfg.run
    every = getattr(r, "checkpoint_every", 1)
    written = sum(1 for v in range(first + 1, r.steps + 1) if v % every == 0 or v == r.steps)
    if r.keep_checkpoints == 0:
        return existing + written
    return min(existing + written, max(existing, r.keep_checkpoints + 1))


def _free_bytes(root: Path) -> int:
    where = root
    while not where.exists():  # a new run's directory: the disk it will be made on
        where = where.parent
    return shutil.disk_usage(where).free


def check_disk(cfg: Config, root: Path, first: int = 0, existing: int = 0, resuming: bool = False) -> dict[str, float]:
    """Refuse (``DiskSpaceError``, one line with the numbers and what to change: a new run's keys, or for a run
    ``resuming`` the space, its settings being fixed) a run whose checkpoints from step ``first`` on cannot fit
    beside the ``existing`` ones on the free space of ``root``'s disk; the figures otherwise (GB)."""
    one = checkpoint_bytes(cfg)
    at_once = checkpoints_at_once(cfg, first, existing)
    needed = max(0, at_once - existing) * one
    free = _free_bytes(Path(root))
    figures = {
        "checkpoint_gb": one / GB,
        "checkpoints_at_once": at_once,
        "needed_gb": needed / GB,
        "free_gb": free / GB,
    }
    if needed > free:
        keep = cfg.run.keep_checkpoints
        kept = "all" if keep == 0 else f"the newest {keep}"
        fits = max(1, int(free // one) - 1)
        way_out = (
            f"free {(needed - free) / GB:.1f} GB or more on that disk (a continuing run keeps the settings it started "
            "with), or move the run directory to a larger disk and resume it there"
            if resuming
            else f"set run.keep_checkpoints={fits} or fewer, a larger run.checkpoint_every, or free the space"
        )
        raise DiskSpaceError(
            f"{root}: the run's checkpoints need {needed / GB:.1f} GB ({at_once - existing} more of "
            f"{one / GB:.2f} GB each: run.keep_checkpoints keeps {kept}, written every "
            f"{getattr(cfg.run, 'checkpoint_every', 1)} step(s)) and its disk has {free / GB:.1f} GB free; {way_out}"
        )
    return figures
