"""Rollout engines: sample B_i completions for each prompt, with seeds that make a rerun exact.

Backends sit behind a registry (``register_backend``, ``make_backend(name, ...)``):

- ``vllm``: one ``vllm.LLM`` engine kept for the whole run. After a GRPO update the new
  checkpoint is loaded in place with ``collective_rpc("reload_weights", kwargs={"weights_path":
  ...})`` (vLLM 0.32), which takes a fraction of a second instead of a new engine's start. Each
  prompt gets its own ``SamplingParams(n=B_i, seed=...)``: per-prompt group sizes are native.
  On CPU the engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one executor) unless
  the caller set that variable: it starts in seconds rather than minutes on 2 cores.
- ``transformers``: ``model.generate`` with the same interface, for machines where vLLM cannot
  run (and as the reference in tests). Per prompt, a ``torch.Generator``-free fork of the global
  RNG seeded with the prompt's seed, so results do not depend on batch order.

Seeds derive from (run seed, step, prompt id) through ``rollout_seed``: the same step of the same
run gives the same rollouts whatever else happened in between (a rerun reproduces them).

Every returned row carries ``weight_version`` (the step of the checkpoint that produced it).
"""

from __future__ import annotations

import hashlib
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SEED_MASK = 0x7FFF_FFFF  # vLLM and torch both take a 31-bit seed


def rollout_seed(run_seed: int, step: int, prompt_id: str) -> int:
    """Seed of one prompt's group at one step: a stable hash of (run seed, step, prompt id)."""
    digest = hashlib.blake2b(f"{run_seed}:{step}:{prompt_id}".encode(), digest_size=8).digest()
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
    """One prompt's group: ``n`` completions of ``prompt`` (already rendered text) with ``seed``."""

    prompt_id: str
    prompt: str
    n: int
    seed: int


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


class RolloutBackend(ABC):
    """A rollout engine: ``generate`` groups, ``load_weights`` after an update, ``close`` at the end."""

    name: str = ""

    def __init__(self) -> None:
        self.weight_version = 0
        self.model_path = ""

    @abstractmethod
    def generate(self, requests: Sequence[RolloutRequest], sampling: SamplingConfig) -> list[Rollout]:
        """All completions of all requests, grouped by request, ``sample_idx`` 0..n-1 within a group."""

    @abstractmethod
    def load_weights(self, path: str | Path, version: int) -> None:
        """Replace the policy weights by the checkpoint at ``path`` (HF layout); rows then carry ``version``."""

    @abstractmethod
    def close(self) -> None:
        """Release the engine."""

    def __enter__(self) -> RolloutBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_BACKENDS: dict[str, Callable[..., RolloutBackend]] = {}


def register_backend(name: str) -> Callable[[type[RolloutBackend]], type[RolloutBackend]]:
    """Class decorator: register a rollout backend under ``name``."""

    def wrap(cls: type[RolloutBackend]) -> type[RolloutBackend]:
        if name in _BACKENDS:
            raise ValueError(f"rollout backend {name!r} is already registered")
        cls.name = name
        _BACKENDS[name] = cls
        return cls

    return wrap


def backends() -> list[str]:
    """Names of the registered rollout backends."""
    return sorted(_BACKENDS)


def make_backend(name: str, model_path: str | Path, **options: Any) -> RolloutBackend:
    """Start the backend ``name`` on the HF checkpoint at ``model_path``."""
    if name not in _BACKENDS:
        raise ValueError(f"unknown rollout backend {name!r}; valid backends: {', '.join(backends())}")
    path = Path(model_path)
    if not (path / "config.json").is_file():
        raise ValueError(f"model path {str(path)!r} is not a Hugging Face model directory (no config.json)")
    return _BACKENDS[name](path, **options)


def _check_requests(requests: Sequence[RolloutRequest]) -> None:
    for r in requests:
        if r.n < 1:
            raise ValueError(f"prompt {r.prompt_id}: group size must be >= 1, got {r.n}")
        if not r.prompt:
            raise ValueError(f"prompt {r.prompt_id}: empty prompt")


@register_backend("vllm")
class VLLMBackend(RolloutBackend):
    """vLLM engine kept for the whole run; weights reloaded in place after each update."""

    def __init__(
        self,
        model_path: Path,
        *,
        dtype: str = "auto",
        max_model_len: int | None = None,
        seed: int = 0,
        gpu_memory_utilization: float = 0.5,
        enforce_eager: bool | None = None,
        trust_remote_code: bool = False,
        in_process: bool | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        import torch

        on_cpu = not torch.cuda.is_available()
        if in_process is None:
            in_process = on_cpu
        if in_process:
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        # vLLM logs to stdout at INFO by default: keep stdout for our output (set these to override)
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        from vllm import LLM

        kwargs: dict[str, Any] = {
            "model": str(model_path),
            "dtype": dtype,
            "seed": seed,
            "trust_remote_code": trust_remote_code,
            "enforce_eager": on_cpu if enforce_eager is None else enforce_eager,
        }
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        if in_process:
            kwargs["distributed_executor_backend"] = "uni"
        if not on_cpu:
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        kwargs.update(extra or {})
        self._llm = LLM(**kwargs)
        self.model_path = str(model_path)

    def generate(self, requests: Sequence[RolloutRequest], sampling: SamplingConfig) -> list[Rollout]:
        from vllm import SamplingParams

        _check_requests(requests)
        prompts: list[str] = []
        params: list[Any] = []
        owners: list[int] = []
        for i, r in enumerate(requests):
            if sampling.temperature == 0.0:  # vLLM's greedy sampling takes n = 1: repeat the prompt
                prompts += [r.prompt] * r.n
                params += [SamplingParams(n=1, temperature=0.0, max_tokens=sampling.max_tokens)] * r.n
                owners += [i] * r.n
            else:
                prompts.append(r.prompt)
                params.append(
                    SamplingParams(
                        n=r.n,
                        temperature=sampling.temperature,
                        top_p=sampling.top_p,
                        max_tokens=sampling.max_tokens,
                        seed=r.seed,
                    )
                )
                owners.append(i)
        outputs = self._llm.generate(prompts, params, use_tqdm=False)
        groups: list[list[Any]] = [[] for _ in requests]
        for owner, out in zip(owners, outputs, strict=True):
            groups[owner].extend(out.outputs)
        rows = []
        for r, completions in zip(requests, groups, strict=True):
            if len(completions) != r.n:
                raise RuntimeError(f"prompt {r.prompt_id}: asked vLLM for {r.n} completions, got {len(completions)}")
            for j, c in enumerate(completions):
                ids = tuple(int(t) for t in c.token_ids)
                rows.append(
                    Rollout(
                        prompt_id=r.prompt_id,
                        sample_idx=j,
                        completion=c.text,
                        token_ids=ids,
                        n_tokens=len(ids),
                        finish_reason="length" if c.finish_reason == "length" else "stop",
                        seed=r.seed,
                        weight_version=self.weight_version,
                    )
                )
        return rows

    def load_weights(self, path: str | Path, version: int) -> None:
        self._llm.collective_rpc("reload_weights", kwargs={"weights_path": str(path)})
        self.weight_version = int(version)

    def close(self) -> None:
        llm = getattr(self, "_llm", None)
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            shutdown = getattr(engine, "shutdown", None)
            if callable(shutdown):
                shutdown()
            self._llm = None


@register_backend("transformers")
class TransformersBackend(RolloutBackend):
    """``model.generate`` on CPU or GPU: the fallback where vLLM cannot run."""

    def __init__(
        self,
        model_path: Path,
        *,
        dtype: str = "float32",
        device: str | None = None,
        trust_remote_code: bool = False,
        batch_prompts: int = 1,
        **_: Any,
    ) -> None:
        super().__init__()
        import torch
        from transformers import AutoTokenizer

        self._torch = torch
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.dtype = getattr(torch, dtype) if dtype != "auto" else torch.float32
        self.trust_remote_code = trust_remote_code
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        self._load(model_path)

    def _load(self, path: str | Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(
            path, dtype=self.dtype, trust_remote_code=self.trust_remote_code
        ).to(self.device)
        self.model.eval()
        self.model_path = str(path)

    def generate(self, requests: Sequence[RolloutRequest], sampling: SamplingConfig) -> list[Rollout]:
        torch = self._torch
        _check_requests(requests)
        eos = self.tokenizer.eos_token_id
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else eos
        rows: list[Rollout] = []
        for r in requests:
            ids = self.tokenizer(r.prompt, return_tensors="pt", add_special_tokens=False).input_ids.to(self.device)
            greedy = sampling.temperature == 0.0
            gen_kwargs: dict[str, Any] = {
                "max_new_tokens": sampling.max_tokens,
                "do_sample": not greedy,
                "num_return_sequences": r.n,
                "pad_token_id": pad,
                "eos_token_id": eos,
            }
            if not greedy:
                gen_kwargs.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=0)
            with torch.random.fork_rng(devices=[] if self.device == "cpu" else None), torch.no_grad():
                torch.manual_seed(r.seed)
                out = self.model.generate(ids, attention_mask=torch.ones_like(ids), **gen_kwargs)
            for j, seq in enumerate(out[:, ids.shape[1] :].tolist()):
                finish = "length"
                if eos in seq:
                    seq = seq[: seq.index(eos) + 1]
                    finish = "stop"
                text_ids = [t for t in seq if t not in (eos, pad)]
                rows.append(
                    Rollout(
                        prompt_id=r.prompt_id,
                        sample_idx=j,
                        completion=self.tokenizer.decode(text_ids, skip_special_tokens=True),
                        token_ids=tuple(seq),
                        n_tokens=len(seq),
                        finish_reason=finish,
                        seed=r.seed,
                        weight_version=self.weight_version,
                    )
                )
        return rows

    def load_weights(self, path: str | Path, version: int) -> None:
        self._load(path)
        self.weight_version = int(version)

    def close(self) -> None:
        self.model = None
