"""Top-p (nucleus) sampling for vLLM without sorting the vocabulary (docs/method.md, "Log-probabilities of
the distribution sampled").

vLLM's PyTorch top-p (its CPU build's) sorts the whole vocabulary of every sequence at every step: for
SmolLM2 (49,152 tokens) and 480 sequences about a second a step. ``NucleusLogitsProcessor`` searches the
``NUCLEUS_K`` most probable tokens instead (``torch.topk``, about 30x cheaper) and falls back to vLLM's sort
for a row whose ``NUCLEUS_K`` tokens hold less than ``p``, so every row gets vLLM's nucleus: a token is kept
when the tokens ranked above it hold less than ``p`` of the probability, at least one is kept.

A request at top-p < 1 passes vLLM ``top_p=1.0`` and its ``p`` as ``extra_args["coba_top_p"]``. The
processor is argmax-invariant, so vLLM applies it where it would its own top-p: after the temperature,
before the draw and the ``processed_logprobs`` it records.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.interface import MoveDirectionality
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

if TYPE_CHECKING:
    from vllm.config import VllmConfig

EXTRA_KEY = "coba_top_p"  # SamplingParams.extra_args key carrying the request's top-p
NUCLEUS_K = 256  # tokens searched for the nucleus before the full sort (see mask_outside_nucleus)
PROCESSOR = "coba_tasks.engines.rollout.nucleus:NucleusLogitsProcessor"  # what the engine loads


def request_top_p(extra_args: dict[str, Any] | None) -> float:
    """The top-p a request asked this processor for (1.0: none)."""
    p = (extra_args or {}).get(EXTRA_KEY, 1.0)
    if not isinstance(p, int | float) or isinstance(p, bool) or not 0.0 < p <= 1.0:
        raise ValueError(f"extra_args[{EXTRA_KEY!r}] must be a number in (0, 1], got {p!r}")
    return float(p)


def mask_outside_nucleus(logits: torch.Tensor, p: torch.Tensor, k: int = NUCLEUS_K) -> torch.Tensor:
    """``logits`` (rows x vocabulary) with every token outside row i's top-``p[i]`` nucleus set to -inf,
    in place; returns ``logits``. A row is searched among its ``k`` largest logits; where those hold less
    than ``p`` of the row's probability the nucleus reaches beyond them and vLLM's full sort decides."""
    if logits.shape[0] == 0:
        return logits
    k = min(k, logits.shape[-1])
    top = logits.topk(k, dim=-1)  # descending
    probs = (top.values.float() - torch.logsumexp(logits.float(), dim=-1, keepdim=True)).exp()
    mass = probs.cumsum(dim=-1)
    keep = (mass - probs) < p.unsqueeze(1)  # the tokens ranked above it hold less than p
    keep[:, 0] = True
    covered = mass[:, -1] >= p  # the first token left out lies among the k: nothing beyond them is kept
    out = torch.full_like(logits, float("-inf"))
    out.scatter_(1, top.indices, top.values.masked_fill(~keep, float("-inf")))
    if not bool(covered.all()):
        rest = (~covered).nonzero().flatten()
        out[rest] = apply_top_k_top_p_pytorch(logits[rest].clone(), None, p[rest], allow_cpu_sync=True)
    logits.copy_(out)
    return logits


class NucleusLogitsProcessor(LogitsProcessor):
    """vLLM logits processor: the top-p nucleus of the requests whose ``extra_args`` name one."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        self.top_p = torch.ones(vllm_config.scheduler_config.max_num_seqs, dtype=torch.float32)

    def is_argmax_invariant(self) -> bool:
        return True  # greedy rows are never masked: vLLM applies it to sampled rows, after the temperature

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.top_p[index] = 1.0
        for index, params, _, _ in batch_update.added:
            self.top_p[index] = request_top_p(getattr(params, "extra_args", None))
        for a, b, direction in batch_update.moved:
            if direction == MoveDirectionality.SWAP:
                self.top_p[a], self.top_p[b] = self.top_p[b].clone(), self.top_p[a].clone()
            else:
                self.top_p[b] = self.top_p[a]
                self.top_p[a] = 1.0

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        p = self.top_p[: logits.shape[0]].to(logits.device)
        rows = (p < 1.0).nonzero().flatten()
        if rows.numel() == 0:
            return logits
        logits[rows] = mask_outside_nucleus(logits[rows], p[rows])
        return logits
