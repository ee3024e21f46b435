"""The rollout engines' common ground: requests, rows, the backend interface, the registry and seeds.

A backend samples ``n`` completions for each prompt and returns one ``Rollout`` row per completion, with the
sampler's log-probability of every token and the weight version that produced it. Backends are registered
by name (``make_backend``; the built-in ones imported when first used). Seeds derive from (run seed, step,
prompt id) through ``rollout_seed``: the same step of the same run gives the same rollouts whatever else
happened in between.
"""

from __future__ import annotations

import hashlib
import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

# the policy's tensors under their checkpoint names, made when called (``RolloutBackend.set_weights``)
WeightsSource = Callable[[], Iterable[tuple[str, "torch.Tensor"]]]

SEED_MASK = 0x7FFF_FFFF  # vLLM and torch both take a 31-bit seed


def rollout_seed(run_seed: int, step: int, prompt_id: str, wave: int = 0) -> int:
    """Seed of one prompt's group at one step: a stable hash of (run seed, step, prompt id). A group sampled in
    rounds (dynamic, ada, the pilot estimator's pilot and then the rest) seeds its round ``wave`` > 0
    with that number hashed too, so two rounds never share a seed; wave 0 is every other group's seed.

    >>> rollout_seed(0, 3, "p1") == rollout_seed(0, 3, "p1", wave=0) != rollout_seed(0, 3, "p1", wave=1)
    True
    """
    key = f"{run_seed}:{step}:{prompt_id}" + (f":wave{wave}" if wave else "")
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & SEED_MASK


@dataclass(frozen=True)
class SamplingConfig:
    """How completions are sampled."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 16

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"sampling temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"sampling max_tokens must be >= 1, got {self.max_tokens}")


@dataclass(frozen=True)
class RolloutRequest:
    """One prompt's group: ``n`` completions of ``prompt_token_ids`` (rendered and tokenized once by
    ``coba_tasks.pipeline.data.render_prompts``) with ``seed``; ``prompt`` is the text, for logs and errors."""

    prompt_id: str
    prompt_token_ids: tuple[int, ...]
    n: int
    seed: int
    prompt: str = ""

    def __post_init__(self) -> None:
        ids = self.prompt_token_ids
        if isinstance(ids, str | bytes) or not all(isinstance(t, int | np.integer) for t in ids):
            raise TypeError(
                f"prompt {self.prompt_id}: prompt_token_ids must be a sequence of token ids (ints), got {ids!r:.80};"
                " tokenize the prompt first (coba_tasks.pipeline.data.render_prompts)"
            )
        object.__setattr__(self, "prompt_token_ids", tuple(int(t) for t in ids))


@dataclass(frozen=True)
class Rollout:
    """One completion (a row of rollouts.parquet)."""

    prompt_id: str
    sample_idx: int
    completion: str
    token_ids: tuple[int, ...]
    n_tokens: int
    finish_reason: str  # "stop" (end of sequence or a stop string) or "length"
    seed: int
    weight_version: int
    logprobs: tuple[float, ...] = ()  # the sampler's log p of each completion token, of the distribution sampled


class RolloutBackend(ABC):
    """A rollout engine: ``generate`` groups, ``load_weights`` after an update, ``close`` at the end."""

    name: str = ""

    def __init__(self) -> None:
        self.weight_version = 0
        self.model_path = ""

    @abstractmethod
    def generate(self, requests: Sequence[RolloutRequest], sampling: SamplingConfig) -> list[Rollout]:
        """All completions of all requests, grouped by request, ``sample_idx`` 0..n-1 within a group."""

    def generate_many(
        self, batches: Sequence[tuple[Sequence[RolloutRequest], SamplingConfig]], progress: bool = False
    ) -> list[list[Rollout]]:
        """``generate`` of each (requests, sampling) batch, in order; a backend may run them as one batch
        (vLLM: one engine call). ``progress``: a progress bar on stderr where the backend has one."""
        return [self.generate(requests, sampling) for requests, sampling in batches]

    @abstractmethod
    def load_weights(self, path: str | Path, version: int) -> None:
        """Replace the policy weights by the checkpoint at ``path`` (HF layout); rows then carry ``version``."""

    @abstractmethod
    def set_weights(self, source: WeightsSource, version: int) -> None:
        """Replace the policy weights by the tensors ``source()`` yields, held in memory (the trainer's, after an
        update: every tensor of the model once, under its checkpoint name); rows then carry ``version``. The
        engine may call ``source`` again (a restarted engine takes the policy as the trainer holds it then)."""

    @abstractmethod
    def close(self) -> None: ...

    def sleep(self) -> None:
        """Free the engine's accelerator memory until ``wake_up`` (while the update runs); no-op by default."""
        return None

    def wake_up(self) -> None:
        return None

    @classmethod
    def sleep_unavailable(cls) -> str | None:
        """Why ``sleep`` cannot work on this machine, or None when it can (or is a harmless no-op)."""
        return None

    @staticmethod
    def check_requests(requests: Sequence[RolloutRequest]) -> None:  # what each backend's generate does first
        check_requests(requests)

    def __enter__(self) -> RolloutBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# Built-in backends by "module:Class", imported on first use: importing this module stays cheap (no vLLM,
# no Ray) and no backend module imports another to register it. register_backend adds classes directly.
_BACKENDS: dict[str, str | type[RolloutBackend]] = {
    "vllm": "coba_tasks.engines.rollout.vllm_backend:VLLMBackend",
    "vllm-ray": "coba_tasks.engines.rollout.ray_backend:RayVLLMBackend",
    "transformers": "coba_tasks.engines.rollout.hf_backend:TransformersBackend",
}


def register_backend(name: str) -> Callable[[type[RolloutBackend]], type[RolloutBackend]]:
    """Class decorator: register a rollout backend under ``name`` (a built-in's module registers itself
    under the name the table above gives it)."""

    def wrap(cls: type[RolloutBackend]) -> type[RolloutBackend]:
        known = _BACKENDS.get(name)
        if known is not None and known != f"{cls.__module__}:{cls.__qualname__}" and known is not cls:
            raise ValueError(f"rollout backend {name!r} is already registered")
        cls.name = name
        _BACKENDS[name] = cls
        return cls

    return wrap


def backends() -> list[str]:
    return sorted(_BACKENDS)


def backend_class(name: str) -> type[RolloutBackend]:
    """The class of backend ``name`` (its module is imported on first use)."""
    if name not in _BACKENDS:
        raise ValueError(f"unknown rollout backend {name!r}; valid backends: {', '.join(backends())}")
    entry = _BACKENDS[name]
    if isinstance(entry, str):
        module, _, qualname = entry.partition(":")
        entry = getattr(importlib.import_module(module), qualname)
        _BACKENDS[name] = entry
    return entry


def sleep_unavailable(name: str) -> str | None:
    """Why backend ``name`` cannot sleep during the update on this machine; None when it can."""
    cls = backend_class(name)
    return cls.sleep_unavailable() if isinstance(cls, type) and issubclass(cls, RolloutBackend) else None


# How set_weights reaches a vLLM engine (rollout.weight_transport; ``auto`` picks the one its place allows):
# the trainer's tensors by reference in this process, CUDA IPC to an engine process on the GPU, else their bytes
WEIGHT_TRANSPORTS = ("reference", "ipc", "bytes")
TRANSPORT_BACKENDS = ("vllm", "vllm-ray")  # the backends whose engines take one (the transformers one: none)


def engine_in_process(in_process: bool | None, on_cpu: bool) -> bool:
    """Whether a vLLM engine runs in this process: ``rollout.in_process``, or (None) on a machine without CUDA."""
    return on_cpu if in_process is None else in_process


def weight_transport_refusal(asked: str, in_process: bool, on_cpu: bool, tp: int) -> str | None:
    """Why a vLLM engine in this process or not (``in_process``), on a machine without CUDA or with it
    (``on_cpu``), split over ``tp`` GPUs cannot take its weights by ``asked`` (one of ``WEIGHT_TRANSPORTS``);
    None when it can, and for ``auto``. The one rule: the engine applies it when it starts (``vllm_backend``),
    the config before a run starts (``RolloutConfig`` for every machine, ``check_platform`` for this one)."""
    if asked == "reference" and not in_process:
        return "the engine runs in a process of its own (rollout.in_process), out of reach of the trainer's tensors"
    if asked == "ipc" and (in_process or on_cpu or tp != 1):
        return (
            "CUDA IPC needs an engine in a process of its own (rollout.in_process) with one worker "
            "(rollout.tensor_parallel_size 1) on the GPU"
        )
    if asked == "bytes" and in_process:
        return "the engine runs in this process (rollout.in_process), where the trainer's tensors go by reference"
    return None


def make_backend(name: str, model_path: str | Path, **options: Any) -> RolloutBackend:
    """Start the backend ``name`` on the HF checkpoint at ``model_path``."""
    cls = backend_class(name)
    path = Path(model_path)
    if not (path / "config.json").is_file():
        raise ValueError(f"model path {str(path)!r} is not a Hugging Face model directory (no config.json)")
    return cls(path, **options)


def check_requests(requests: Sequence[RolloutRequest]) -> None:
    """Refuse a group of fewer than one completion or a prompt without tokens."""
    for r in requests:
        if r.n < 1:
            raise ValueError(f"prompt {r.prompt_id}: group size must be >= 1, got {r.n}")
        if not r.prompt_token_ids:
            raise ValueError(f"prompt {r.prompt_id}: empty prompt (no token ids)")
