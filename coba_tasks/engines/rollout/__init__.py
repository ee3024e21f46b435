"""Rollout engines: sample B_i completions for each prompt, with seeds that make a rerun exact.

``base`` holds what every backend shares (requests, rows, the interface, the registry, seeds); the
backends are ``vllm_backend`` (``vllm``), ``ray_backend`` (``vllm-ray``) and ``hf_backend``
(``transformers``), imported when first used; ``vllm_worker`` is what vLLM's worker runs on top of vLLM.
"""

from coba_tasks.engines.rollout.base import (
    TRANSPORT_BACKENDS,
    WEIGHT_TRANSPORTS,
    Rollout,
    RolloutBackend,
    RolloutRequest,
    SamplingConfig,
    backend_class,
    backends,
    engine_in_process,
    make_backend,
    register_backend,
    rollout_seed,
    sleep_unavailable,
    weight_transport_refusal,
)

__all__ = [
    "TRANSPORT_BACKENDS",
    "WEIGHT_TRANSPORTS",
    "Rollout",
    "RolloutBackend",
    "RolloutRequest",
    "SamplingConfig",
    "backend_class",
    "backends",
    "engine_in_process",
    "make_backend",
    "register_backend",
    "rollout_seed",
    "sleep_unavailable",
    "weight_transport_refusal",
]
