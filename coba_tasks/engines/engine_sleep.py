"""The rollout engine asleep while the GRPO update runs (``rollout.sleep_during_update``).

On one GPU the rollout engine (vLLM: weights plus a KV cache sized by ``gpu_memory_utilization``)
and the training model (weights, gradients, AdamW moments, activations) share the memory. The
engine is idle during the update, so the training step puts it to sleep before the update and
wakes it after, before the new weights are loaded into it:

    with engine_asleep(engine, enabled=cfg.rollout.sleep_during_update) as record:
        metrics = trainer.update(...)
    engine.load_weights(ckpt, version)       # awake again here
    if record:
        store.write_step_json(7, "engine_sleep", record)

``record`` holds the seconds that sleeping and waking took and, where CUDA is available, the
device memory at each point (``cuda_memory``): used by every process (total minus free, what
``nvidia-smi`` shows; the vLLM engine is another process on a GPU) and allocated by torch in this
process (the trainer). Reading them costs microseconds; without CUDA the memory entries are null.
Before waking, torch's cache of freed blocks (the update's activations) is given back to the
device, or the engine could not take its memory back.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

MIB = 2**20


def cuda_memory() -> dict[str, float] | None:
    """Device memory now, in MiB: ``used`` (all processes), ``total``, and torch's ``allocated`` and
    ``reserved`` in this process, plus ``peak_allocated`` since the last reset; None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return {
        "used": (total - free) / MIB,
        "total": total / MIB,
        "allocated": torch.cuda.memory_allocated() / MIB,
        "reserved": torch.cuda.memory_reserved() / MIB,
        "peak_allocated": torch.cuda.max_memory_allocated() / MIB,
    }


def _release_cached_memory() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _reset_peak() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


@contextmanager
def engine_asleep(
    engine: Any,
    enabled: bool,
    memory: Callable[[], dict[str, float] | None] = cuda_memory,
    release: Callable[[], None] = _release_cached_memory,
    reset_peak: Callable[[], None] = _reset_peak,
) -> Iterator[dict[str, Any]]:
    """Put ``engine`` to sleep for the body when ``enabled``; wake it on the way out, also after an error.

    Yields the record (empty when not enabled): ``sleep_s``, ``wake_s`` and the memory figures
    ``before_sleep``, ``asleep`` (the body starts), ``after_update`` (the body ended: its
    ``peak_allocated`` is the update's peak) and ``awake``. ``memory``, ``release`` and
    ``reset_peak`` are the CUDA probes, replaceable in tests.
    """
    record: dict[str, Any] = {}
    if not enabled:
        yield record
        return
    record["before_sleep"] = memory()
    t0 = time.perf_counter()
    engine.sleep()
    record["sleep_s"] = time.perf_counter() - t0
    reset_peak()
    record["asleep"] = memory()
    try:
        yield record
    finally:
        record["after_update"] = memory()
        release()
        t0 = time.perf_counter()
        engine.wake_up()
        record["wake_s"] = time.perf_counter() - t0
        record["awake"] = memory()
