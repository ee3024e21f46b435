"""Rollouts spread over several vLLM engines through Ray: the ``vllm-ray`` backend (docs/scale_out.md).

A step's requests are sharded by budget (``shard_by_budget``), each request whole on one engine. Each engine
is a Ray actor holding a ``VLLMBackend`` on the same checkpoint, so the rows are those one ``VLLMBackend``
would return, put back in request order.

A running cluster is joined when ``ray_address`` (or ``RAY_ADDRESS``) names it or this process already
called ``ray.init``; otherwise a local Ray instance is started (and shut down on ``close``). Each actor takes
``cpus_per_engine`` CPUs and, where the cluster has GPUs, ``gpus_per_engine`` GPUs (default: vLLM's
``tensor_parallel_size``). ``model_path`` and the paths given to ``load_weights`` are made absolute and opened
by the actors: on several hosts they must name the same files on every host. ``set_weights`` puts the
policy's tensors (in CPU memory) in Ray's object store once; every actor reads them from there. An actor
process that died is replaced at the next call that reaches it, with the last weights, and its share runs
again, once (Ray's own actor restart would come back with the first weights).
"""

from __future__ import annotations

import contextlib
import heapq
import logging
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coba_tasks.engines.rollout.base import Rollout, RolloutBackend, RolloutRequest, SamplingConfig, register_backend

if TYPE_CHECKING:
    from coba_tasks.engines.rollout.base import WeightsSource
from coba_tasks.engines.rollout.vllm_backend import VLLMBackend

logger = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 60.0  # how long close() waits for an engine to shut down before killing its actor


def shard_indices(requests: Sequence[RolloutRequest], n_shards: int) -> list[list[int]]:
    """Indices of ``requests`` per shard, each list in request order (see ``shard_by_budget``)."""
    if isinstance(n_shards, bool) or not isinstance(n_shards, int) or n_shards < 1:
        raise ValueError(f"n_shards must be an int >= 1, got {n_shards!r}")
    for r in requests:
        if r.n < 1:
            raise ValueError(f"prompt {r.prompt_id}: group size must be >= 1, got {r.n}")
    # ties broken by the request's own fields: the shards do not depend on the order the requests came in
    order = sorted(range(len(requests)), key=lambda i: (-requests[i].n, requests[i].prompt_id, requests[i].seed))
    heap = [(0, k) for k in range(n_shards)]  # (rollouts so far, shard): the least loaded, then the lowest index
    shards: list[list[int]] = [[] for _ in range(n_shards)]
    for i in order:
        load, k = heapq.heappop(heap)
        shards[k].append(i)
        heapq.heappush(heap, (load + requests[i].n, k))
    return [sorted(s) for s in shards]


def shard_by_budget(requests: Sequence[RolloutRequest], n_shards: int) -> list[list[RolloutRequest]]:
    """Split ``requests`` into ``n_shards`` lists with about equal total budget (sum of ``n``): largest budget
    first onto the shard with the fewest rollouts so far (LPT), each request whole, totals within the largest
    budget of each other, deterministic; input order kept within a shard (which may be empty).

    >>> reqs = [RolloutRequest(f"p{i}", (5, 76, 5, 84), n, i) for i, n in enumerate([8, 2, 5, 5, 4])]
    >>> [[r.prompt_id for r in s] for s in shard_by_budget(reqs, 2)]
    [['p0', 'p4'], ['p1', 'p2', 'p3']]
    >>> [sum(r.n for r in s) for s in shard_by_budget(reqs, 2)]
    [12, 12]
    """
    return [[requests[i] for i in s] for s in shard_indices(requests, n_shards)]


class _EngineActor:
    """The body of one Ray actor: a ``VLLMBackend`` and the calls the driver makes on it."""

    def __init__(self, model_path: str, options: dict[str, Any]) -> None:
        self.backend = VLLMBackend(Path(model_path), **options)

    def ready(self) -> int:
        return os.getpid()

    def generate(self, requests: list[RolloutRequest], sampling: SamplingConfig, version: int) -> list[Rollout]:
        self.backend.weight_version = int(version)  # the driver's version: rows carry it
        return self.backend.generate(requests, sampling)

    def load_weights(self, path: str, version: int) -> None:
        self.backend.load_weights(path, version)

    def set_weights(self, pairs: list[tuple[str, Any]], version: int) -> None:  # Ray resolved the object
        self.backend.set_weights(lambda: pairs, version)

    def sleep(self) -> None:
        self.backend.sleep()

    def wake_up(self) -> None:
        self.backend.wake_up()

    def close(self) -> None:
        self.backend.close()


@register_backend("vllm-ray")
class RayVLLMBackend(RolloutBackend):
    """``engines`` vLLM engines as Ray actors; requests sharded by budget, rows merged in request order."""

    def __init__(
        self,
        model_path: Path,
        *,
        engines: int = 2,
        cpus_per_engine: float = 1.0,
        gpus_per_engine: float | None = None,
        ray_address: str | None = None,
        extra: dict[str, Any] | None = None,
        **vllm_options: Any,
    ) -> None:
        super().__init__()
        if isinstance(engines, bool) or not isinstance(engines, int) or engines < 1:
            raise ValueError(f"engines must be an int >= 1, got {engines!r}")
        if cpus_per_engine < 0 or (gpus_per_engine is not None and gpus_per_engine < 0):
            raise ValueError("cpus_per_engine and gpus_per_engine must be >= 0")
        import ray

        self._ray = ray
        self._started_ray = False
        self._actors: list[Any] = []
        self.engines = engines  # vLLM engines (Ray actors)
        self._closed = False
        self._weights_path: str | None = None
        self._weights_ref: Any = None  # the object-store copy of the last set_weights
        self.restarts = 0  # actors started to replace a dead one
        self.engine_pids: list[int] = []  # the actors' process ids (they tell the engines apart)
        self.model_path = str(Path(model_path).resolve())  # the actors' working directory is not ours
        self._options = {**vllm_options, "extra": dict(extra or {})}
        address = ray_address or os.environ.get("RAY_ADDRESS") or None
        if not ray.is_initialized():
            if address:
                ray.init(address=address, log_to_driver=False)
            else:
                ray.init(
                    address="local",
                    num_cpus=max(os.cpu_count() or 1, math.ceil(engines * cpus_per_engine)),
                    include_dashboard=False,
                    log_to_driver=False,
                )
            self._started_ray = True
        try:
            if gpus_per_engine is None:
                has_gpus = ray.cluster_resources().get("GPU", 0) > 0
                tp = self._options["extra"].get("tensor_parallel_size", vllm_options.get("tensor_parallel_size", 1))
                gpus_per_engine = float(tp) if has_gpus else 0.0
            env = {
                "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
            }
            self._actor_cls = ray.remote(_EngineActor).options(
                num_cpus=cpus_per_engine,
                num_gpus=gpus_per_engine,
                max_restarts=0,  # a restarted actor would come back with the first weights: see _restart_actor
                runtime_env={"env_vars": env},
            )
            self._actors = [self._spawn() for _ in range(engines)]
            self.engine_pids = ray.get([a.ready.remote() for a in self._actors])  # engine start errors surface here
        except BaseException:
            self.close()
            raise

    def _spawn(self) -> Any:
        return self._actor_cls.remote(self.model_path, self._options)

    # -- the RolloutBackend interface

    def generate(self, requests: Sequence[RolloutRequest], sampling: SamplingConfig) -> list[Rollout]:
        self._check_open()
        self.check_requests(requests)
        shards = shard_indices(requests, self.engines)
        calls = {k: ([requests[i] for i in idx], sampling, self.weight_version) for k, idx in enumerate(shards) if idx}
        results = self._call("generate", calls)
        groups: list[list[Rollout]] = [[] for _ in requests]
        for k, rows in results.items():
            pos = 0
            for i in shards[k]:
                r = requests[i]
                group = rows[pos : pos + r.n]
                if [(g.prompt_id, g.sample_idx) for g in group] != [(r.prompt_id, j) for j in range(r.n)]:
                    raise RuntimeError(f"prompt {r.prompt_id}: engine {k} returned rows out of order or too few")
                groups[i] = group
                pos += r.n
            if pos != len(rows):
                raise RuntimeError(f"engine {k} returned {len(rows)} rows for {pos} rollouts")
        return [row for group in groups for row in group]

    def load_weights(self, path: str | Path, version: int) -> None:
        path = str(Path(path).resolve())
        self._call("load_weights", {k: (path, int(version)) for k in range(self.engines)})
        self._weights_path, self._weights_ref = path, None
        self.weight_version = int(version)

    def set_weights(self, source: WeightsSource, version: int) -> None:
        ref = self._ray.put([(name, tensor.detach().to("cpu")) for name, tensor in source()])
        self._call("set_weights", {k: (ref, int(version)) for k in range(self.engines)})
        self._weights_path, self._weights_ref = None, ref
        self.weight_version = int(version)

    def sleep(self) -> None:
        self._call("sleep", {k: () for k in range(self.engines)})

    def wake_up(self) -> None:
        self._call("wake_up", {k: () for k in range(self.engines)})

    @classmethod
    def sleep_unavailable(cls) -> str | None:
        return VLLMBackend.sleep_unavailable()

    def close(self) -> None:
        ray = self._ray
        actors, self._actors = self._actors, []
        if actors:
            refs = [a.close.remote() for a in actors]
            with contextlib.suppress(Exception):  # a dead or hung engine: the kill below ends it
                ray.get(refs, timeout=CLOSE_TIMEOUT_S)
            for a in actors:
                with contextlib.suppress(Exception):
                    ray.kill(a, no_restart=True)
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
        self._started_ray = False
        self._closed = True

    # -- calls on the actors

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the vllm-ray rollout backend is closed")

    def _call(self, method: str, args: dict[int, tuple[Any, ...]]) -> dict[int, Any]:
        """``method(*args[k])`` on actor k for every k, all at once; an actor found dead is replaced
        (with the last loaded weights) and its call made again, once."""
        self._check_open()
        from ray.exceptions import RayActorError

        ray = self._ray
        refs = {k: getattr(self._actors[k], method).remote(*a) for k, a in args.items()}
        out: dict[int, Any] = {}
        dead: dict[int, str] = {}
        for k, ref in refs.items():
            try:
                out[k] = ray.get(ref)
            except RayActorError as exc:
                dead[k] = f"{method} raised {type(exc).__name__}"
        for k, why in dead.items():
            self._restart_actor(k, why)
        retries = {k: getattr(self._actors[k], method).remote(*args[k]) for k in dead}
        for k, ref in retries.items():
            out[k] = ray.get(ref)
        return out

    def _restart_actor(self, k: int, why: str) -> None:
        ray = self._ray
        with contextlib.suppress(Exception):
            ray.kill(self._actors[k], no_restart=True)
        actor = self._spawn()
        self._actors[k] = actor
        self.engine_pids[k] = ray.get(actor.ready.remote())
        if self._weights_path is not None:
            ray.get(actor.load_weights.remote(self._weights_path, self.weight_version))
        elif self._weights_ref is not None:
            ray.get(actor.set_weights.remote(self._weights_ref, self.weight_version))
        self.restarts += 1
        logger.warning(
            "rollout engine %d's Ray actor died (%s); started a new one on %s (weight version %d)",
            k,
            why,
            self._weights_path or self.model_path,
            self.weight_version,
        )
