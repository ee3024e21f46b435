"""A run's checkpoint as a standalone Hugging Face model directory (``coba export``).

It holds what plain transformers and vLLM load, with no coba-rl code: the weights (a LoRA adapter merged into
its base, checked to be the one it was trained on), the tokenizer, the source model's
``generation_config.json``, and ``coba_export.json`` naming where it came from; nothing of the training
state. Built beside ``out`` and renamed into place when whole; an existing ``out`` is never replaced.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from coba_tasks.engines.checkpoint import CHECKPOINT_MANIFEST, verify_checkpoint
from coba_tasks.engines.fileio import new_temporary_dir
from coba_tasks.engines.lora import base_model_of, is_adapter_checkpoint, merge_adapter_checkpoint

EXPORT_RECORD = "coba_export.json"
GENERATION_CONFIG = "generation_config.json"
DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def export_checkpoint(checkpoint: str | Path, out: str | Path, dtype: str = "auto") -> Path:
    """Write the model of ``checkpoint`` (full, LoRA, or any model directory) to ``out``; ``dtype`` ``auto``
    keeps the stored one (a merged LoRA model is float32). ValueError (one line) for a missing or damaged
    checkpoint, an adapter on another base, or an ``out`` that exists or lies inside the checkpoint."""
    src, dest = Path(checkpoint), Path(out)
    _check(src, dest, dtype)
    if (src / CHECKPOINT_MANIFEST).is_file():
        verify_checkpoint(src)  # every file as the trainer wrote it
    tmp = new_temporary_dir(dest)  # a name of its own: a second export to the same --out keeps its work
    try:
        if is_adapter_checkpoint(src):
            base = base_model_of(src)
            merge_adapter_checkpoint(src, tmp, DTYPES[dtype] or torch.float32)
        else:
            base = src
            _resave(src, tmp, DTYPES[dtype])
        if (base / GENERATION_CONFIG).is_file():  # the source model's sampling defaults and stop tokens
            shutil.copyfile(base / GENERATION_CONFIG, tmp / GENERATION_CONFIG)
        record = {"checkpoint": str(src.resolve()), "base_model": str(base.resolve()), "lora_merged": base != src}
        (tmp / EXPORT_RECORD).write_text(json.dumps(record, indent=2) + "\n")
        if dest.exists():  # appeared while exporting
            raise ValueError(f"--out {dest} appeared while exporting; nothing was replaced: choose another --out")
        tmp.rename(dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def _check(src: Path, dest: Path, dtype: str) -> None:
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if not (src / "config.json").is_file() and not is_adapter_checkpoint(src):
        raise ValueError(
            f"{src} is not a model directory (no config.json) nor a LoRA checkpoint (no adapter_config.json): "
            "give a run's checkpoint, e.g. runs/demo/checkpoints/000010"
        )
    if dest.exists():
        raise ValueError(f"--out {dest} already exists; nothing was written: choose a new directory")
    if dest.resolve().is_relative_to(src.resolve()):
        raise ValueError(f"--out {dest} is inside the checkpoint {src}: choose a directory outside it")


def _resave(src: Path, out: Path, dtype: torch.dtype | None) -> None:
    """A whole model's weights and tokenizer, loaded and saved again by transformers (no remote code)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype or "auto", trust_remote_code=False)
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(src, trust_remote_code=False).save_pretrained(out)
