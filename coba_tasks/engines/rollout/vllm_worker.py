"""What the vLLM rollout engine's worker does on top of vLLM: reload new policy weights in place, right.

vLLM mixes ``WeightReload``'s methods into its worker class (``worker_extension_cls``), and the backend calls
them by name (``llm.collective_rpc("coba_load_tensors", ...)``): every executor, nothing pickled. The policy
comes from memory after an update (``coba_load_tensors``: the trainer's tensors themselves when the engine runs
in the trainer's process, their bytes from another process) or from a checkpoint directory
(``coba_reload_weights``: a resume, an evaluation of a checkpoint).

Why not vLLM's ``reload_weights`` alone: a tied output projection has no tensor of its own in the checkpoint,
so vLLM's layer-wise reload never processes it again; on CPU that processing packs the weight into a copy for
the matrix-multiply kernels, so the head kept multiplying by the *old* embedding (SmolLM2-135M: greedy first
tokens differed from transformers' for 2 of 3 prompts). On CUDA it is a no-op. The fix does not untie the
model: after vLLM's reload, every layer whose weight is shared with another is processed again.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


def shared_weight_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The layers (with a quantization method) whose ``weight`` parameter another such layer also holds, matched
    by identity: layers whose weight was dropped after packing hold empty tensors that share an address."""
    holders: dict[int, list[tuple[str, torch.nn.Module]]] = {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.nn.Parameter) and weight.numel() > 0 and hasattr(module, "quant_method"):
            holders.setdefault(id(weight), []).append((name, module))
    return [layer for group in holders.values() if len(group) > 1 for layer in group]


def reprocess_shared_weights(model: torch.nn.Module) -> list[str]:
    """Run the post-load processing of every tied layer again (see the module docstring); their names."""
    layers = shared_weight_layers(model)
    for _, module in layers:
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)
    return [name for name, _ in layers]


def wire_tensor(tensor: torch.Tensor) -> tuple[str, list[int], bytes]:
    """A tensor as (dtype, shape, bytes): what ``coba_load_tensors`` takes from another process (vLLM's
    messages carry bytes as they are; a tensor would arrive as vLLM's own encoding of it)."""
    flat = tensor.detach().to("cpu").contiguous()
    return str(flat.dtype).removeprefix("torch."), list(flat.shape), flat.view(-1).view(torch.uint8).numpy().tobytes()


def _from_wire(dtype: str, shape: list[int], data: bytes) -> torch.Tensor:
    if not data:
        return torch.empty(shape, dtype=getattr(torch, dtype))
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(getattr(torch, dtype)).reshape(shape)


class WeightReload:
    """Methods added to vLLM's worker (``self`` is the worker)."""

    def coba_reload_weights(self: Any, weights_path: str) -> list[str]:
        """vLLM's in-place reload from a checkpoint directory, then the tied layers processed again."""
        from vllm.config import set_current_vllm_config

        self.reload_weights(weights_path=weights_path)
        with set_current_vllm_config(self.vllm_config):
            return reprocess_shared_weights(self.model_runner.get_model())

    def coba_load_tensors(self: Any, weights: Iterable[tuple[Any, ...]]) -> list[str]:
        """vLLM's in-place reload from weights held in memory, every tensor of the model under its checkpoint
        name: ``(name, tensor)`` pairs (the engine in this process), or ``(name, dtype, shape, bytes)`` from
        ``wire_tensor`` (from another process); then the tied layers processed again."""
        from vllm.config import set_current_vllm_config

        named = ((w[0], w[1] if len(w) == 2 else _from_wire(*w[1:])) for w in weights)
        self.reload_weights(weights_iterator=named)
        with set_current_vllm_config(self.vllm_config):
            return reprocess_shared_weights(self.model_runner.get_model())
