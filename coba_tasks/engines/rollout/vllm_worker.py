"""What the vLLM rollout engine's worker does on top of vLLM: reload new policy weights in place, right.

vLLM mixes the methods of ``WeightReload`` into its worker class (``VLLMBackend`` in ``vllm_backend``
starts the engine with ``worker_extension_cls="coba_tasks.engines.rollout.vllm_worker.WeightReload"``),
and the backend calls them by name with ``llm.collective_rpc("coba_reload_weights", kwargs={"weights_path": ...})``.
By name, so it works with every vLLM executor (in-process, multiprocess, Ray) and nothing is pickled.

Why not vLLM's own ``reload_weights`` alone: with tied input/output embeddings (SmolLM2, Qwen2.5 up to
3B, most small models) the output projection holds the embedding's parameter and has no tensor of its
own in the checkpoint. vLLM's layer-wise reload processes a layer only when its tensors arrive, so the
output projection is never processed again. On CPU that processing packs the weight into a separate
copy for the matrix-multiply kernels (oneDNN or the packed GEMM), so after a reload the head kept
multiplying by the *old* embedding (measured with SmolLM2-135M: greedy first tokens differed from
transformers' on the same checkpoint for 2 of 3 prompts, log-probability gaps of about 0.5). On CUDA
the head reads the shared parameter directly and processing an unquantized embedding does nothing,
so the step below is a no-op there. The fix does not untie the user's model: after vLLM's reload,
every layer whose weight parameter is shared with another layer is processed again.
"""

from __future__ import annotations

from typing import Any

import torch


def shared_weight_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The layers (with a quantization method) whose ``weight`` parameter another such layer also holds.

    Parameters are matched by identity, not by address: layers whose weight was dropped after packing
    hold empty tensors that share an address without being tied.
    """
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


class WeightReload:
    """Methods added to vLLM's worker (``self`` is the worker)."""

    def coba_reload_weights(self: Any, weights_path: str) -> list[str]:
        """vLLM's in-place reload from a checkpoint directory, then the tied layers processed again."""
        from vllm.config import set_current_vllm_config

        self.reload_weights(weights_path=weights_path)
        with set_current_vllm_config(self.vllm_config):
            return reprocess_shared_weights(self.model_runner.get_model())
