"""One GPU, one user at a time, across the flows that put a model on it: a slot of Prefect's global concurrency
limit ``coba-gpu`` (docs/workers.md, "One GPU at a time"), held by a training run for as long as its engine and
trainer live and by ``coba-eval-watch`` for the span of an evaluation. A run on a machine without CUDA takes no
slot; where the server has no such limit (``prefect gcl create coba-gpu --limit 1`` makes it), nothing waits.

    with gpu_slot():                    # a training run: waits until the GPU is free
        ...
    with gpu_slot(wait_s=10):           # a watch: TimeoutError when the GPU stays busy
        ...
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

GPU_LIMIT = "coba-gpu"  # the global concurrency limit's name: its limit is the GPUs a host's runs share


def uses_gpu() -> bool:
    """Whether this process puts its models on a GPU (torch sees CUDA)."""
    import torch

    return torch.cuda.is_available()


def gpu_slot(wait_s: float | None = None) -> AbstractContextManager[object]:
    """A slot of ``GPU_LIMIT`` for the ``with`` block (none without CUDA): waited for as long as it takes, or
    ``wait_s`` seconds, then ``TimeoutError``. The slot is a lease Prefect renews while the block runs, and frees
    when it ends or the process dies."""
    if not uses_gpu():
        return nullcontext()
    from prefect.concurrency.sync import concurrency

    return concurrency(GPU_LIMIT, occupy=1, timeout_seconds=wait_s, strict=False)
