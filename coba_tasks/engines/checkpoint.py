"""Checkpoint serialisation: the policy's weights, its AdamW state and the trainer state on disk, and back.

One layout (docs/design.md, "Checkpoints"), two writers (``PolicyTrainer.save_checkpoint`` and rank 0 of an
FSDP update), readers that never train (a resume, a rerun, ``coba-eval``). No pickle anywhere; written in a
temporary sibling and renamed into place when whole, ``checkpoint.json`` (every file's size and sha256,
``verify_checkpoint``) last; loaded all or nothing (``CheckpointError``).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file, save_model

from coba_tasks.engines.fileio import new_temporary_dir, sha256_file

# Kept in a subdirectory: vLLM's reload reads every *.safetensors file beside the model.
OPTIMIZER_FILE = "trainer/optimizer.safetensors"
MASTER_FILE = "trainer/master.safetensors"  # float32 weights, when model.safetensors is in a lower precision
TRAINER_STATE_FILE = "trainer/trainer_state.json"
CHECKPOINT_MANIFEST = "checkpoint.json"  # every file's size and sha256, written last (verify_checkpoint)


class CheckpointError(ValueError):
    """A checkpoint that is missing, partial or damaged; the message names the file."""


def write_checkpoint(
    out_dir: str | Path,
    model: torch.nn.Module,
    tokenizer: Any,
    compute_dtype: torch.dtype,
    optimizer_tensors: dict[str, torch.Tensor],
    param_groups: list[dict],
    updates: int,
    extra_state: dict[str, Any] | None = None,
    rng_state: torch.Tensor | None = None,
    adapter: tuple[Any, str, str] | None = None,
) -> Path:
    """Write a checkpoint: ``model`` (plain, unsharded, float32) and ``tokenizer`` in HF layout, the optimizer
    tensors (``optimizer_to_tensors``) plus the torch RNG state (this process's unless ``rng_state``), and the
    trainer state. With ``adapter`` (``(peft_model, base_model_path, base_model_sha256)``: LoRA) the adapter
    instead of the weights. A tensor holding NaN or inf is refused (``CheckpointError``) before anything is
    written: the last guard behind the update's own check."""
    final = Path(out_dir)
    refuse_non_finite(final, {**model.state_dict(), **optimizer_tensors})
    out = _fresh_temporary(final)  # built beside its place, renamed when whole: never half a checkpoint there
    try:
        _write_model(out, model, tokenizer, compute_dtype, adapter)
        tensors = dict(optimizer_tensors)
        tensors["rng.torch"] = torch.get_rng_state() if rng_state is None else rng_state
        (out / OPTIMIZER_FILE).parent.mkdir(exist_ok=True)
        save_file(tensors, str(out / OPTIMIZER_FILE))
        state = {"updates": updates, "param_groups": param_groups, **(extra_state or {})}
        (out / TRAINER_STATE_FILE).write_text(json.dumps(state, indent=2))
        write_checkpoint_manifest(out)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    if final.exists():  # a checkpoint of an update that did not finish (its stage is recomputed): replaced
        shutil.rmtree(final)
    out.rename(final)
    return final


def refuse_non_finite(out: Path, tensors: dict[str, torch.Tensor]) -> None:
    """``CheckpointError`` naming the first floating-point tensor of ``tensors`` with a NaN or inf value."""
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            count = int((~torch.isfinite(tensor)).sum())
            raise CheckpointError(
                f"{out}: not written: {name} holds {count} non-finite value(s) (NaN or inf), which a checkpoint "
                "never holds; the update diverged: start a new run with a lower optim.lr"
            )


def _write_model(
    out: Path, model: torch.nn.Module, tokenizer: Any, compute_dtype: torch.dtype, adapter: tuple[Any, str, str] | None
) -> None:
    """The policy's weights (or its LoRA adapter) and the tokenizer, in Hugging Face layout."""
    if adapter is not None:  # LoRA: the adapter (float32) and its base model's path, not the whole model
        from coba_tasks.engines.lora import save_adapter

        peft_model, base_path, base_hash = adapter
        save_adapter(peft_model, out, base_path, base_hash)
    elif compute_dtype == torch.float32:
        model.save_pretrained(out, safe_serialization=True)
    else:  # the engine's weights in the compute dtype; the float32 master weights for a resume
        cast: dict[int, torch.Tensor] = {}  # one copy per storage: tied weights stay tied (written once)
        low = {k: cast.setdefault(v.data_ptr(), v.to(compute_dtype)) for k, v in model.state_dict().items()}
        model.save_pretrained(out, state_dict=low, safe_serialization=True)
        (out / MASTER_FILE).parent.mkdir(exist_ok=True)
        save_model(model, str(out / MASTER_FILE))
    tokenizer.save_pretrained(out)


def _fresh_temporary(final: Path) -> Path:
    """A new empty ``.<name>.<hex>.tmp`` beside ``final``; temporaries of killed writers of it go first
    (one writer per run directory: the run lock)."""
    for stale in final.parent.glob(f".{final.name}.*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)
    return new_temporary_dir(final)


# -- loading ---------------------------------------------------------------------------------------


def load_weights(model: torch.nn.Module, ckpt: Path) -> None:
    """Load the policy's float32 weights (``trainer/master.safetensors`` if there, else ``model.safetensors``)
    into ``model``. All or nothing: every parameter of the model must be in the file and nothing else
    (tied embeddings, stored once, count as both); otherwise ``CheckpointError``, before anything is loaded."""
    from safetensors.torch import load_model

    master = ckpt / MASTER_FILE
    weights = master if master.is_file() else ckpt / "model.safetensors"
    try:
        with safe_open(str(weights), framework="pt") as f:
            stored = set(f.keys())
    except (OSError, RuntimeError, ValueError) as exc:  # missing, or not a safetensors file
        raise CheckpointError(f"{weights}: cannot read the policy weights ({exc})") from exc
    names_by_storage: dict[int, list[str]] = {}  # tied weights share one storage and are stored once
    for name, tensor in model.state_dict().items():
        names_by_storage.setdefault(tensor.data_ptr(), []).append(name)
    missing = [names[0] for names in names_by_storage.values() if not stored.intersection(names)]
    unexpected = sorted(stored - {n for names in names_by_storage.values() for n in names})
    if missing or unexpected:  # checked before anything is loaded: nothing of a partial checkpoint is used
        raise CheckpointError(
            f"{weights}: does not hold the policy's weights: {_some(missing)} missing, {_some(unexpected)} unexpected"
        )
    try:
        load_model(model, str(weights), strict=True)
    except (OSError, RuntimeError, ValueError) as exc:  # e.g. a tensor of another shape
        raise CheckpointError(f"{weights}: cannot load the policy weights ({exc})") from exc


def load_adapter_weights(peft_model: Any, ckpt: Path, base: tuple[str, str]) -> None:
    """Load a LoRA checkpoint's adapter into ``peft_model``, whose base model is ``base`` (path, content sha256);
    ``CheckpointError`` if it holds none or it does not fit, ``AdapterBaseError`` if it was trained on another
    base (``check_adapter_base``)."""
    from coba_tasks.engines.lora import ADAPTER_FILE, check_adapter_base, is_adapter_checkpoint, load_adapter

    if not is_adapter_checkpoint(ckpt):
        raise CheckpointError(f"{ckpt}: holds no LoRA adapter (model.lora_rank > 0 needs one; a full checkpoint?)")
    check_adapter_base(ckpt, base)
    try:
        load_adapter(peft_model, ckpt)
    except (OSError, RuntimeError, ValueError) as exc:
        raise CheckpointError(f"{ckpt / ADAPTER_FILE}: {exc}") from exc


def load_optimizer_state(optimizer: torch.optim.Optimizer, ckpt: Path) -> dict[str, Any]:
    """Restore ``optimizer`` and this process's torch RNG from a checkpoint; returns the trainer state
    (``updates``, ``param_groups``, the extra state). ``CheckpointError`` names the file when it does not fit."""
    state = json.loads((ckpt / TRAINER_STATE_FILE).read_text())
    tensors = load_file(str(ckpt / OPTIMIZER_FILE))
    rng = tensors.pop("rng.torch", None)
    if rng is None:
        raise CheckpointError(f"{ckpt / OPTIMIZER_FILE}: has no rng.torch (the torch RNG state)")
    try:
        optimizer_from_tensors(optimizer, tensors, state["param_groups"])
    except (KeyError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"{ckpt / OPTIMIZER_FILE}: not this policy's AdamW state ({exc})") from exc
    torch.set_rng_state(rng)
    return state


def _some(names: Sequence[str], shown: int = 3) -> str:
    names = sorted(names)
    if not names:
        return "none"
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return f"{len(names)} ({', '.join(names[:shown])}{more})"


# -- the checkpoint manifest ------------------------------------------------------------------------


def write_checkpoint_manifest(ckpt: Path) -> Path:
    """``checkpoint.json``: every file of the checkpoint (relative path -> bytes and sha256), written last."""
    files = {
        p.relative_to(ckpt).as_posix(): {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
        for p in sorted(ckpt.rglob("*"))
        if p.is_file() and p.name != CHECKPOINT_MANIFEST
    }
    path = ckpt / CHECKPOINT_MANIFEST
    path.write_text(json.dumps({"format": 1, "files": files}, indent=2) + "\n")
    return path


def verify_checkpoint(ckpt_dir: str | Path) -> None:
    """Check every file of a checkpoint against its ``checkpoint.json`` (present, size, sha256);
    ``CheckpointError`` names the first file that is not as written."""
    ckpt = Path(ckpt_dir)
    if not ckpt.is_dir():
        raise CheckpointError(f"checkpoint {ckpt} is missing")
    manifest = ckpt / CHECKPOINT_MANIFEST
    try:
        files = json.loads(manifest.read_text())["files"]
        if not isinstance(files, dict) or not files:
            raise ValueError("no files listed")
    except FileNotFoundError:
        raise CheckpointError(
            f"{manifest} is missing: the checkpoint was not written whole (or by a coba-rl without checkpoint "
            "manifests), so it cannot be trusted"
        ) from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{manifest}: unreadable ({exc})") from exc
    for name, entry in files.items():
        parts = Path(name).parts
        if not parts or Path(name).is_absolute() or ".." in parts:  # a manifest never points outside
            raise CheckpointError(f"{manifest}: lists {name!r}, not a path inside the checkpoint")
        path = ckpt / name
        if not path.is_file():
            raise CheckpointError(f"{path}: listed in {CHECKPOINT_MANIFEST} but missing")
        size = path.stat().st_size
        if size != entry.get("bytes"):
            raise CheckpointError(f"{path}: {size} bytes, {CHECKPOINT_MANIFEST} says {entry.get('bytes')} (truncated?)")
        if sha256_file(path) != entry.get("sha256"):
            raise CheckpointError(f"{path}: sha256 differs from {CHECKPOINT_MANIFEST}'s (the file was altered)")


# -- the optimizer state as tensors -----------------------------------------------------------------


def optimizer_to_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """An optimizer's state_dict as named tensors (safetensors) and JSON-safe param groups (FSDP gathers its own:
    ``fsdp_update.full_state``)."""
    sd = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    for idx, st in sd["state"].items():
        for key, value in st.items():
            t = value if torch.is_tensor(value) else torch.tensor(value)
            tensors[f"state.{idx}.{key}"] = t.detach().cpu().contiguous()
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in sd["param_groups"]]
    return tensors, groups


def optimizer_from_tensors(
    optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], groups: list[dict]
) -> None:
    """Inverse of ``optimizer_to_tensors``. All or nothing: once the optimizer has stepped, every
    parameter must have the same state tensors (AdamW: step, exp_avg, exp_avg_sq); ValueError otherwise."""
    state: dict[int, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        _, idx, key = name.split(".", 2)
        state.setdefault(int(idx), {})[key] = t
    params = sorted(i for g in groups for i in g["params"])
    if state:
        keys = set().union(*(set(v) for v in state.values()))
        partial = [i for i in params if set(state.get(i, {})) != keys]
        unknown = sorted(set(state) - set(params))
        if partial or unknown:
            extra = f"; state for unknown parameters {unknown[:3]}" if unknown else ""
            lack = f"{len(partial)} of {len(params)} parameters lack some of their state"
            raise ValueError(f"{lack} ({', '.join(sorted(keys))}){extra}")
    restored = [{k: (tuple(v) if k == "betas" else v) for k, v in g.items()} for g in groups]
    optimizer.load_state_dict({"state": state, "param_groups": restored})
