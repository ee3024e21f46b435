"""LoRA for the policy update, with peft: the adapter, its checkpoints, and merged weights for the engine.

With ``model.lora_rank`` > 0 every targeted linear layer ``W`` gets a trainable ``B @ A`` of rank r, scaled by
``alpha / r``. A checkpoint holds the adapter in peft's own layout (naming ``model.path`` by its absolute
path) and ``adapter_base.json``, that base's content hash, checked before the adapter is put on a base again.
The engine samples from the merged weights ``W + (alpha / r) * B @ A`` (``merged_tensors``, handed to it in
memory after each update; ``merge_adapter_checkpoint`` for ``coba-eval``); why merged: docs/benchmarks.md.

``MergedLoraLinear`` computes the layer as one product with the merged weight, ``x (W + s B A)^T``, instead
of peft's ``x W^T + s (x A^T) B^T`` (docs/benchmarks.md), making the merge again in the backward rather
than keeping it. A layer it does not cover (dropout, DoRA, several adapters, a trainable base bias) runs
peft's forward. The trainer and the engine multiply by the same merged weights (``merged_weight``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from peft.tuners.lora.layer import Linear as PeftLoraLinear

from coba_tasks.engines.fileio import content_sha256, new_temporary_dir

ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_NAME = "default"  # peft's name of the one adapter
ADAPTER_BASE_FILE = "adapter_base.json"  # the base model's absolute path and content sha256


class AdapterBaseError(ValueError):
    """A LoRA checkpoint met with a base model other than the one it was trained on."""


logger = logging.getLogger(__name__)
_BASE_HASHES: dict[tuple[str, tuple[tuple[str, int, int], ...]], str] = {}  # see base_sha256


def parse_targets(targets: str | Sequence[str]) -> str | list[str]:
    """``all-linear`` (peft: every linear layer but the output projection) or a list of module names;
    a comma-separated string becomes a list."""
    if isinstance(targets, str):
        names = [t.strip() for t in targets.split(",") if t.strip()]
        return "all-linear" if names == ["all-linear"] else names
    return list(targets)


def add_lora(model: torch.nn.Module, rank: int, alpha: float, targets: str | Sequence[str]) -> Any:
    """The ``PeftModel`` of ``model`` with LoRA adapters of ``rank`` on ``targets``; its ``get_base_model()`` is
    ``model`` with the adapters in place, only they requiring gradients. B starts at 0 (the policy is the base
    until the first update); A is drawn from torch's global generator (seeded)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=int(rank),
        lora_alpha=float(alpha),
        target_modules=parse_targets(targets),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    config._register_custom_module({torch.nn.Linear: MergedLoraLinear})  # peft's hook for a layer class of one's own
    try:
        return get_peft_model(model, config)
    except ValueError as exc:  # e.g. a target that names no module of this model
        raise ValueError(f"model.lora_target_modules: {exc}") from exc


def _fast_path(layer: Any) -> bool:
    """Whether ``layer``'s forward is ``x (W + s B A)^T + b`` with only A and B trained: one adapter, no
    dropout, no DoRA or LoRA bias, an ``nn.Linear`` base in its own layout, nothing merged in place."""
    if layer.disable_adapters or layer.merged or list(layer.active_adapters) != [ADAPTER_NAME]:
        return False
    base = layer.get_base_layer()
    return (
        type(base) is torch.nn.Linear
        and ADAPTER_NAME in layer.lora_A
        and ADAPTER_NAME not in getattr(layer, "lora_variant", {})
        and isinstance(layer.lora_dropout[ADAPTER_NAME], torch.nn.Identity)
        and layer.lora_B[ADAPTER_NAME].bias is None
        and not layer.fan_in_fan_out
        and not base.weight.requires_grad
        and (base.bias is None or not base.bias.requires_grad)
        and base.weight.dtype == layer.lora_A[ADAPTER_NAME].weight.dtype
    )


def merged_weight(layer: Any) -> torch.Tensor:
    """``W + s B A`` of a LoRA layer: what the trainer's fast path multiplies by and the engine samples with."""
    weight = layer.get_base_layer().weight
    if not _fast_path(layer):
        return weight.detach() + layer.get_delta_weight(ADAPTER_NAME).detach().to(weight.dtype)
    a, b = layer.lora_A[ADAPTER_NAME].weight, layer.lora_B[ADAPTER_NAME].weight
    with torch.no_grad():
        return torch.addmm(weight, b, a, alpha=layer.scaling[ADAPTER_NAME])


class _MergedLora(torch.autograd.Function):
    """``y = x (W + s B A)^T + b``, with gradients for x, A and B (W and b are frozen)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight, bias, a, b, scaling: float) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, weight, a, b)
        ctx.scaling = scaling
        return F.linear(x, torch.addmm(weight, b, a, alpha=scaling), bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # type: ignore[override]
        x, weight, a, b = ctx.saved_tensors
        s = ctx.scaling
        # the backward runs outside autocast: its products are made in grad's dtype (the forward's, under
        # autocast), and each input gets its gradient in its own dtype (float32 adapters under bf16 autocast)
        dtype = grad.dtype
        grad2, x2 = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1]).to(dtype)
        wc, ac, bc = weight.to(dtype), a.to(dtype), b.to(dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:  # the input gradient through the merged weight, made again here
            grad_x = (grad2 @ torch.addmm(wc, bc, ac, alpha=s)).view(x.shape).to(x.dtype)
        grad_a = torch.mm((grad2 @ bc).t(), x2).mul_(s).to(a.dtype)  # s (g B)^T x
        grad_b = torch.mm(grad2.t(), x2 @ ac.t()).mul_(s).to(b.dtype)  # s g^T (x A^T)
        return grad_x, None, None, grad_a, grad_b, None


class MergedLoraLinear(PeftLoraLinear):
    """peft's LoRA ``Linear`` whose forward, on the fast path, is one product with the merged weight
    (the module docstring says why); peft's forward otherwise."""

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args or kwargs or not _fast_path(self):
            return super().forward(x, *args, **kwargs)
        base = self.get_base_layer()
        a, b = self.lora_A[ADAPTER_NAME].weight, self.lora_B[ADAPTER_NAME].weight
        return _MergedLora.apply(x, base.weight, base.bias, a, b, self.scaling[ADAPTER_NAME])


def merged_tensors(model: torch.nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The plain model's tensors (its own key names) of a ``PeftModel``'s base model with every LoRA layer merged,
    ``W + s B A``, in ``dtype`` (default: the weights' own), made one at a time: each storage once (a tied tensor
    under its first name, as a checkpoint stores it); a tensor already in ``dtype`` is the model's own."""
    from peft.tuners.lora import LoraLayer

    lora_layers = {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}
    seen: set[int] = set()
    for key, value in model.state_dict().items():
        if ".lora_" in key or value.data_ptr() in seen:
            continue
        seen.add(value.data_ptr())
        owner, sep, leaf = key.rpartition(".base_layer.")
        merged = sep and leaf == "weight" and owner in lora_layers
        tensor = merged_weight(lora_layers[owner]) if merged else value.detach()
        yield key.replace(".base_layer.", "."), tensor if dtype is None else tensor.to(dtype)


def merged_state_dict(model: torch.nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """``merged_tensors`` as a state dict."""
    return dict(merged_tensors(model, dtype))


def save_merged(model: torch.nn.Module, out_dir: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """Write the merged weights as a Hugging Face model directory (config and ``model.safetensors`` in
    ``dtype``) at ``out_dir``, whole or not at all: built beside it and renamed into place."""
    out = Path(out_dir)
    tmp = new_temporary_dir(out)
    try:
        model.save_pretrained(tmp, state_dict=merged_state_dict(model, dtype), safe_serialization=True)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def save_adapter(peft_model: Any, out_dir: Path, base_model_path: str | Path, base_model_sha256: str) -> None:
    """peft's adapter files in ``out_dir``, naming the base model by its absolute path, and
    ``adapter_base.json``: that path and the base's content hash (``base_sha256`` of the base as loaded)."""
    base = str(Path(base_model_path).resolve())
    config = peft_model.peft_config[ADAPTER_NAME]
    config.base_model_name_or_path = base
    peft_model.save_pretrained(out_dir, safe_serialization=True)
    (Path(out_dir) / "README.md").unlink(missing_ok=True)  # peft's model-card template: nothing of the run
    # peft writes the target modules from a set, in this process's string-hash order: sorted, the same bytes each run
    path = Path(out_dir) / ADAPTER_CONFIG
    written = json.loads(path.read_text(encoding="utf-8"))
    if isinstance(written.get("target_modules"), list):
        written["target_modules"] = sorted(written["target_modules"])
        path.write_text(json.dumps(written, indent=2), encoding="utf-8")
    (Path(out_dir) / ADAPTER_BASE_FILE).write_text(json.dumps({"base_model": base, "sha256": base_model_sha256}))


def base_sha256(path: str | Path) -> str:
    """``content_sha256`` of a base model directory, computed once per process for as long as none of its
    files changes size or modification time (a base model can be gigabytes; a run checks it at every load)."""
    root = Path(path).resolve()
    stats = []
    for folder, _, names in os.walk(root):
        for name in names:
            st = (Path(folder) / name).stat()
            stats.append((os.path.relpath(Path(folder) / name, root), st.st_size, st.st_mtime_ns))
    key = (str(root), tuple(sorted(stats)))
    if key not in _BASE_HASHES:
        _BASE_HASHES[key] = content_sha256(root)
    return _BASE_HASHES[key]


def check_adapter_base(ckpt_dir: str | Path, base: tuple[str | Path, str] | None = None) -> None:
    """``AdapterBaseError`` (one line) when the adapter of ``ckpt_dir`` is about to be put on a base model other
    than the one it was trained on. ``base``: that base's (path, content sha256); by default the base the
    checkpoint names, hashed now. A checkpoint without ``adapter_base.json`` (older) passes with a warning."""
    ckpt = Path(ckpt_dir)
    path = Path(base[0]).resolve() if base is not None else base_model_of(ckpt).resolve()
    if not (path / "config.json").is_file():
        raise AdapterBaseError(f"{ckpt / ADAPTER_CONFIG} names the base model {path}, which is not a model directory")
    record = ckpt / ADAPTER_BASE_FILE
    if not record.is_file():
        logger.warning(
            f"{ckpt}: no {ADAPTER_BASE_FILE} (a checkpoint written before the base model's hash was recorded): its "
            f"adapter is put on the base model at {path} unchecked"
        )
        return
    try:
        then = str(json.loads(record.read_text())["sha256"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise AdapterBaseError(f"{record}: unreadable ({exc})") from exc
    now = base[1] if base is not None else base_sha256(path)
    if now != then:
        raise AdapterBaseError(
            f"the base model {path} is not the one the LoRA adapter of {ckpt} was trained on (sha256 {now[:12]}..., "
            f"its {ADAPTER_BASE_FILE} records {then[:12]}...): restore that base model at {path}, or train a new "
            "adapter on this one; merged into another base, the adapter is not the trained policy"
        )


def load_adapter(peft_model: Any, ckpt_dir: Path) -> None:
    """Load the adapter of a checkpoint, all or nothing: the file must hold exactly this model's LoRA
    tensors (ValueError naming what is missing or unexpected, before anything is loaded)."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict
    from safetensors.torch import load_file

    path = ckpt_dir / ADAPTER_FILE
    tensors = load_file(str(path))
    expected = get_peft_model_state_dict(peft_model)
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    wrong = [k for k in expected if k in tensors and tensors[k].shape != expected[k].shape]
    if missing or unexpected or wrong:
        raise ValueError(
            f"{path}: not this policy's adapter ({len(missing)} tensors missing, {len(unexpected)} unexpected, "
            f"{len(wrong)} of another shape; e.g. {(missing + unexpected + wrong)[:2]})"
        )
    set_peft_model_state_dict(peft_model, tensors)


def is_adapter_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` holds a LoRA adapter (peft's ``adapter_config.json``) rather than a whole model."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


def base_model_of(path: str | Path) -> Path:
    """The base model an adapter checkpoint was trained on (its ``adapter_config.json``)."""
    config = json.loads((Path(path) / ADAPTER_CONFIG).read_text())
    return Path(config["base_model_name_or_path"])


def merge_adapter_checkpoint(ckpt_dir: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """A whole model directory at ``out_dir``: the adapter checkpoint at ``ckpt_dir`` merged into its base
    model, with the checkpoint's tokenizer (for an engine that needs whole weights: ``coba-eval``). A base
    that is not the one the adapter was trained on is refused (``check_adapter_base``)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt = Path(ckpt_dir)
    base = base_model_of(ckpt)
    check_adapter_base(ckpt)  # the base it was trained on, or AdapterBaseError
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(model, ckpt)
    out = save_merged(peft_model.get_base_model(), out_dir, dtype)
    AutoTokenizer.from_pretrained(ckpt if (ckpt / "tokenizer_config.json").is_file() else base).save_pretrained(out)
    return out
