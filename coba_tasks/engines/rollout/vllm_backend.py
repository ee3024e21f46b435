"""The ``vllm`` rollout backend: one vLLM engine kept for the whole run, weights reloaded in place after
each update (``vllm_worker``), a fraction of a second instead of a new engine's start.

After an update the policy goes to the engine from memory (``set_weights``), by the way that fits where the
engine runs (``weight_transport``): in the trainer's process the trainer's tensors themselves; in its own
process on the trainer's GPU, vLLM's CUDA IPC weight transfer (the engine maps the trainer's GPU memory);
elsewhere the tensors' bytes in one message. docs/real_models.md, "Weights to the engine".

Each prompt is a token prompt with its own ``SamplingParams(n=B_i, seed=..., logprobs=0)``; rows carry the
sampler's log p after the temperature. Top-p < 1 goes through ``nucleus`` (``sort_free_top_p = False``:
vLLM's own). On CPU the engine runs in-process unless the caller set ``VLLM_ENABLE_V1_MULTIPROCESSING``.
An engine whose engine-core process died is replaced by a new one with the same arguments and the last
weights, and the call runs again, once (seeds are per request: the same rows). ``sleep()`` (CUDA only)
offloads the weights and drops the KV cache while the update runs; ``generate`` and ``load_weights`` wake it.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import logging
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coba_tasks.engines.rollout.base import (
    WEIGHT_TRANSPORTS,
    Rollout,
    RolloutBackend,
    RolloutRequest,
    SamplingConfig,
    engine_in_process,
    register_backend,
    weight_transport_refusal,
)
from coba_tasks.engines.rollout.vllm_worker import wire_tensor

if TYPE_CHECKING:
    from coba_tasks.engines.rollout.base import WeightsSource

logger = logging.getLogger(__name__)

# vLLM's worker gets the methods of this class (LLM(worker_extension_cls=...)); the reload goes through it
WORKER_EXTENSION = "coba_tasks.engines.rollout.vllm_worker.WeightReload"
RELOAD_METHOD = "coba_reload_weights"
TENSORS_METHOD = "coba_load_tensors"
TRANSPORTS = WEIGHT_TRANSPORTS  # set_weights: see the module docstring


@register_backend("vllm")
class VLLMBackend(RolloutBackend):
    """vLLM engine kept for the whole run; weights reloaded in place after each update."""

    sort_free_top_p = True  # False: vLLM's own top-p (a sort of the vocabulary per sequence and step)

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
        sleep_mode: bool = False,
        tensor_parallel_size: int = 1,
        weight_transport: str = "auto",
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        import torch

        on_cpu = not torch.cuda.is_available()
        if sleep_mode and on_cpu:
            raise ValueError(f"sleep_mode=True: {self.sleep_unavailable()}")
        tp = tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be an int >= 1, got {tp!r}")
        if tp > 1 and (on_cpu or in_process):  # vLLM's CPU build and its "uni" executor run one worker
            where = "without CUDA" if on_cpu else "with in_process=True (one worker)"
            raise ValueError(f"tensor_parallel_size={tp}: vLLM cannot split an engine {where}")
        in_process = engine_in_process(in_process, on_cpu)
        if in_process:
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        # vLLM logs to stdout at INFO by default: keep stdout for our output (set these to override)
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        from vllm import LLM

        from coba_tasks.engines.rollout.nucleus import PROCESSOR as NUCLEUS_PROCESSOR

        kwargs: dict[str, Any] = {
            "model": str(model_path),
            "dtype": dtype,
            "seed": seed,
            "trust_remote_code": trust_remote_code,
            "enforce_eager": on_cpu if enforce_eager is None else enforce_eager,
            "logprobs_mode": "processed_logprobs",  # after temperature and top-p, as the trainer computes them
            "use_tqdm_on_load": False,  # no progress bar at every engine start
            "worker_extension_cls": WORKER_EXTENSION,  # the in-place reload (vllm_worker)
            "logits_processors": [NUCLEUS_PROCESSOR],  # top-p without sorting the vocabulary
            "tensor_parallel_size": tp,  # GPUs this engine is split over (vLLM's own worker processes)
        }
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        if on_cpu:
            # vLLM 0.32 on CPU: a seeded request whose prefill is split into chunks crashes the engine ("CPU
            # Generator does not use offset": only CUDA generators can rewind the discarded sample of a partial
            # prefill) or makes a group's tokens depend on the chunking (docs/design.md, "Other decisions")
            kwargs["enable_chunked_prefill"] = False
        if in_process:
            kwargs["distributed_executor_backend"] = "uni"
        if on_cpu and kwargs["enforce_eager"]:
            # Eager means eager: vLLM still compiles its sampler's rank of each sampled token (2-4 s at the first
            # generate on 2 cores, for a figure coba never reads; the same eager). torch.compile is off in this
            # process from here on (coba compiles nothing else).
            import torch._dynamo

            torch._dynamo.config.disable = True
        if not on_cpu:
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        if sleep_mode:
            kwargs["enable_sleep_mode"] = True
        # how set_weights reaches the engine: its tensors by reference in this process, CUDA IPC to an engine
        # of its own on this GPU (vLLM's weight transfer, set up at the engine's start), else their bytes
        self.weight_transport = _transport(weight_transport, in_process, on_cpu, tp)
        if self.weight_transport == "ipc":
            kwargs["weight_transfer_config"] = {"backend": "ipc"}
        kwargs.update(extra or {})
        skip_logprob_token_text()
        self._asleep = False
        self._llm_kwargs = kwargs  # to start an identical engine if this one dies
        self._weights_path: str | None = None  # the last checkpoint given to load_weights
        self._weights_source: WeightsSource | None = None  # the last weights given to set_weights
        self._ipc_sender: Any = None  # vLLM's trainer side of the IPC transfer, made at the first set_weights
        self.restarts = 0  # engines started to replace a dead one
        self._closed = False
        self._llm = LLM(**kwargs)
        self.model_path = str(model_path)

    def generate(self, requests: Sequence[RolloutRequest], sampling: SamplingConfig) -> list[Rollout]:
        return self.generate_many([(requests, sampling)])[0]

    def generate_many(
        self, batches: Sequence[tuple[Sequence[RolloutRequest], SamplingConfig]], progress: bool = False
    ) -> list[list[Rollout]]:
        """Every batch's requests in one engine call (each with its own sampling parameters and seed, so a
        group's completions are those it would get alone); rows per batch, in order."""
        from vllm import SamplingParams

        from coba_tasks.engines.rollout.nucleus import EXTRA_KEY as NUCLEUS_KEY

        flat: list[tuple[RolloutRequest, SamplingConfig]] = []
        spans: list[tuple[int, int]] = []
        for requests, sampling in batches:
            self.check_requests(requests)
            spans.append((len(flat), len(flat) + len(requests)))
            flat += [(r, sampling) for r in requests]
        if not flat:
            return [[] for _ in batches]
        if self._asleep:  # a sleeping engine's scheduler is paused: generate would wait for ever
            self.wake_up()
        prompts: list[dict[str, list[int]]] = []  # vLLM token prompts: the engine tokenizes nothing
        params: list[Any] = []
        owners: list[int] = []
        for i, (r, sampling) in enumerate(flat):
            tokens = {"prompt_token_ids": list(r.prompt_token_ids)}
            # logprobs=0: the log-probability of each sampled token (processed_logprobs)
            if sampling.temperature == 0.0:  # vLLM's greedy sampling takes n = 1: repeat the prompt
                prompts += [tokens] * r.n
                greedy = SamplingParams(
                    n=1, temperature=0.0, max_tokens=sampling.max_tokens, logprobs=0, flat_logprobs=True
                )
                params += [greedy] * r.n
                owners += [i] * r.n
            else:
                prompts.append(tokens)
                nucleus = self.sort_free_top_p and sampling.top_p < 1.0
                params.append(
                    SamplingParams(
                        n=r.n,
                        temperature=sampling.temperature,
                        top_p=1.0 if nucleus else sampling.top_p,
                        extra_args={NUCLEUS_KEY: sampling.top_p} if nucleus else None,
                        max_tokens=sampling.max_tokens,
                        seed=r.seed,
                        logprobs=0,
                        flat_logprobs=True,  # a few lists per completion, not a dict and an object per token
                    )
                )
                owners.append(i)
        outputs = self._call_engine(lambda llm: llm.generate(prompts, params, use_tqdm=progress), "generate")
        groups: list[list[Any]] = [[] for _ in flat]
        for owner, out in zip(owners, outputs, strict=True):
            groups[owner].extend(out.outputs)
        per_request: list[list[Rollout]] = []
        for (r, _), completions in zip(flat, groups, strict=True):
            if len(completions) != r.n:
                raise RuntimeError(f"prompt {r.prompt_id}: asked vLLM for {r.n} completions, got {len(completions)}")
            per_request.append([self._row(r, j, c) for j, c in enumerate(completions)])
        return [[row for rows in per_request[first:last] for row in rows] for first, last in spans]

    def _row(self, r: RolloutRequest, j: int, c: Any) -> Rollout:  # c: a vLLM CompletionOutput
        ids = tuple(int(t) for t in c.token_ids)
        return Rollout(
            prompt_id=r.prompt_id,
            sample_idx=j,
            completion=c.text,
            token_ids=ids,
            n_tokens=len(ids),
            finish_reason="length" if c.finish_reason == "length" else "stop",
            seed=r.seed,
            weight_version=self.weight_version,
            logprobs=_sampled_logprobs(ids, c.logprobs),
        )

    def load_weights(self, path: str | Path, version: int) -> None:
        if self._asleep:
            self.wake_up()

        def reload(llm: Any) -> None:
            llm.collective_rpc(RELOAD_METHOD, kwargs={"weights_path": str(path)})
            llm.reset_prefix_cache()  # see _push

        self._call_engine(reload, "load")
        self._weights_path, self._weights_source = str(path), None
        self.weight_version = int(version)

    def set_weights(self, source: WeightsSource, version: int) -> None:
        if self._asleep:
            self.wake_up()
        self._call_engine(lambda llm: self._push(llm, source), "load")
        self._weights_path, self._weights_source = None, source
        self.weight_version = int(version)

    def _push(self, llm: Any, source: WeightsSource) -> None:
        """The tensors of ``source()`` into the engine ``llm`` (``weight_transport``), its prefix cache reset."""
        if self.weight_transport == "reference":  # made one at a time as the worker loads them
            llm.collective_rpc(TENSORS_METHOD, kwargs={"weights": source()})
        elif self.weight_transport == "bytes":
            wire = [(name, *wire_tensor(tensor)) for name, tensor in source()]
            llm.collective_rpc(TENSORS_METHOD, kwargs={"weights": wire})
        else:
            self._ipc_send(llm, source)
        # the prefix cache keeps KV blocks computed with the old weights, and a prompt that fills a whole
        # block would reuse them (seen on CPU with 32-token blocks: rollouts off the new policy)
        llm.reset_prefix_cache()

    def _ipc_send(self, llm: Any, source: WeightsSource) -> None:
        """vLLM's CUDA IPC weight transfer: the engine's worker maps each tensor of the trainer's GPU memory
        and loads it (vLLM's layer-wise reload), one update of the engine per call."""
        from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

        class Pairs(WeightSource):  # the pairs of one call, as vLLM's trainer side reads them
            def __init__(self, pairs: list[tuple[str, Any]]) -> None:
                self.pairs = pairs

            def metadata(self) -> list[ParamMeta]:
                return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.pairs]

            def __iter__(self) -> Any:
                return iter(self.pairs)

        pairs = Pairs(list(source()))
        if self._ipc_sender is None or self._ipc_sender.client.llm is not llm:  # a new engine: a new handshake
            sender = WeightTransferTrainerFactory.trainer_init(
                IPCTrainerInitInfo(rank=0), client=_EngineClient(llm), source=pairs
            )
            self._ipc_sender = sender
        self._ipc_sender.source = pairs
        try:
            self._ipc_sender.send_weights()
        finally:
            self._ipc_sender.source = None  # the trainer's tensors are not held between updates

    def close(self) -> None:
        shutdown = getattr(getattr(getattr(self, "_llm", None), "llm_engine", None), "shutdown", None)
        if callable(shutdown):
            shutdown()
        self._llm, self._closed = None, True

    # -- sleep during the update

    @classmethod
    def sleep_unavailable(cls) -> str | None:
        import torch

        if not torch.cuda.is_available():
            return "vLLM's sleep mode needs a CUDA GPU and torch sees none here (vLLM's CPU platform refuses it)"
        return None

    def sleep(self, level: int = 1) -> None:
        """Level 1: weights offloaded to CPU memory, KV cache dropped (the engine needs ``sleep_mode=True``)."""
        if not self._llm_kwargs.get("enable_sleep_mode"):
            raise RuntimeError("this vLLM engine was started without sleep_mode=True: it cannot sleep")
        if not self._asleep:
            self._call_engine(lambda llm: llm.sleep(level=level), "sleep")
            self._asleep = True

    def wake_up(self) -> None:
        if self._asleep:
            self._call_engine(lambda llm: llm.wake_up(), "wake up")
            self._asleep = False

    # -- engine death

    def _engine_client(self) -> Any:
        return getattr(getattr(self._llm, "llm_engine", None), "engine_core", None)

    def engine_dead(self) -> bool:
        """Whether vLLM flags the engine as dead (its engine-core process exited); False in-process,
        where the engine core lives in this process and a failure shows as ``EngineDeadError``."""
        return bool(getattr(getattr(self._engine_client(), "resources", None), "engine_dead", False))

    def _call_engine(self, call: Callable[[Any], Any], what: str) -> Any:
        """``call(llm)``; if the engine is dead (before or during the call), start a new one and call again, once."""
        if self._closed:
            raise RuntimeError("the vLLM rollout engine is closed")
        if self._llm is None:  # an earlier restart failed half-way
            self._restart(f"no engine before {what}: starting the engine again failed earlier")
        elif self.engine_dead():
            self._restart(f"found dead before {what}")
        else:
            try:
                with _EngineDeathWatch(self._engine_client()):
                    return call(self._llm)
            except Exception as exc:
                if not (_is_engine_dead_error(exc) or self.engine_dead()):
                    raise
                why = f"{what} raised {type(exc).__name__}: {exc}"
            # restart outside the except block: the traceback would keep the old engine alive
            self._restart(why)
        return call(self._llm)

    def _restart(self, why: str) -> None:
        """Replace a dead engine by a new one with the same arguments and the last loaded weights."""
        from vllm import LLM

        old, self._llm = self._llm, None
        try:
            old.llm_engine.shutdown()
        except Exception:  # already dead: release what can be released, go on
            logger.debug("shutting down the dead rollout engine failed", exc_info=True)
        del old
        gc.collect()
        self._llm = LLM(**self._llm_kwargs)
        self._asleep = False  # a new engine starts awake
        if self._weights_path is not None:
            self._llm.collective_rpc(RELOAD_METHOD, kwargs={"weights_path": self._weights_path})
        elif self._weights_source is not None:  # the policy as the trainer holds it now (see set_weights)
            self._push(self._llm, self._weights_source)
        self.restarts += 1
        where = self._weights_path or ("the trainer's weights" if self._weights_source else self.model_path)
        logger.warning(
            "rollout engine died (%s); started a new engine on %s (weight version %d)", why, where, self.weight_version
        )


def _transport(asked: str, in_process: bool, on_cpu: bool, tp: int) -> str:
    """The weight transport of an engine (``auto``: the first its place allows of reference, ipc and bytes); a
    transport it cannot use (``weight_transport_refusal``, the config's rule too) is a one-line ValueError."""
    if asked == "auto":
        return next(t for t in TRANSPORTS if weight_transport_refusal(t, in_process, on_cpu, tp) is None)
    if asked not in TRANSPORTS:
        raise ValueError(f"weight_transport must be one of auto, {', '.join(TRANSPORTS)}; got {asked!r}")
    why = weight_transport_refusal(asked, in_process, on_cpu, tp)
    if why is not None:
        raise ValueError(f"weight_transport={asked}: {why}; use weight_transport=auto")
    return asked


class _EngineClient:
    """vLLM's weight-sync client protocol over an offline ``LLM``: each call the worker method of its name."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.collective_rpc("start_weight_update")

    def update_weights(self, update_info: Any) -> None:
        self.llm.collective_rpc("update_weights", kwargs={"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.collective_rpc("finish_weight_update")


def skip_logprob_token_text() -> bool:
    """Have vLLM's output processor in this process keep only what coba reads of each sampled token's
    log-probability: the token's text is left undecoded (its ``decoded_token`` None; the completions' own text is
    decoded as before), and a request asking for the sampled token's log-probability alone (``logprobs=0``, flat
    lists, no text) has each step's figures appended in one go instead of position by position. Decoding every
    such token cost the rollout stage about a fifth of a generate call of the tiny model, the per-position
    appends about a tenth (docs/benchmarks.md, "Pipeline benchmarks"); the lists are those vLLM builds. Done
    once per process; False where this vLLM's ``LogprobsProcessor`` has another shape (it then does what it
    always did, and nothing else changes)."""
    import numpy as np

    try:
        from vllm.logprobs import FlatLogprobs
        from vllm.v1.engine.logprobs import LogprobsProcessor
    except ImportError:
        return False
    if getattr(LogprobsProcessor, "_coba_skips_token_text", False):
        return True
    original = getattr(LogprobsProcessor.from_new_request, "__func__", None)
    update = getattr(LogprobsProcessor, "_update_sample_logprobs", None)
    if original is None or update is None or "tokenizer" not in inspect.signature(original).parameters:
        return False

    def from_new_request(cls: Any, tokenizer: Any, request: Any) -> Any:
        return original(cls, tokenizer=None, request=request)

    def update_sample_logprobs(self: Any, logprobs_lists: Any) -> None:
        flat = self.logprobs
        token_ids, logprobs, ranks = logprobs_lists[:3]
        if self.tokenizer is not None or self.num_logprobs != 0 or type(flat) is not FlatLogprobs:
            return update(self, logprobs_lists)
        if not all(isinstance(a, np.ndarray) for a in (token_ids, logprobs, ranks)) or logprobs.ndim != 2:
            return update(self, logprobs_lists)
        # logprobs=0: one entry per position, the sampled token's (column 0; a column past it belongs to
        # another request of the batch asking for more, which vLLM's own loop cuts off the same way)
        values = logprobs[:, 0].tolist()
        start = len(flat.logprobs)
        flat.start_indices.extend(range(start, start + len(values)))
        flat.end_indices.extend(range(start + 1, start + len(values) + 1))
        flat.token_ids.extend(token_ids[:, 0].tolist())
        flat.logprobs.extend(values)
        flat.ranks.extend(ranks.tolist())
        flat.decoded_tokens.extend([None] * len(values))
        for value in values:  # one addition per position, in order, as vLLM sums them
            self.cumulative_logprob += value
        return None

    LogprobsProcessor._coba_decodes_token_text = classmethod(original)  # vLLM's own (tests compare against them)
    LogprobsProcessor._coba_appends_by_position = update
    LogprobsProcessor.from_new_request = classmethod(from_new_request)
    LogprobsProcessor._update_sample_logprobs = update_sample_logprobs
    LogprobsProcessor._coba_skips_token_text = True
    return True


def _sampled_logprobs(token_ids: Sequence[int], logprobs: Any) -> tuple[float, ...]:
    """The log p of each sampled token: from vLLM's flat lists (``flat_logprobs``: with ``logprobs=0`` one entry
    per position, the sampled token's), else from its per-position ``{token id: Logprob}`` dicts."""
    if logprobs is None or len(logprobs) != len(token_ids):
        raise RuntimeError(
            f"vLLM returned {0 if logprobs is None else len(logprobs)} logprobs for {len(token_ids)} tokens"
        )
    flat = getattr(logprobs, "logprobs", None)
    if flat is not None and logprobs.token_ids == list(token_ids):  # one per position, each the sampled token's
        return tuple(flat)
    return tuple(float(position[t].logprob) for t, position in zip(token_ids, logprobs, strict=True))


def _engine_dead_error_class() -> type[Exception]:
    try:
        from vllm.v1.engine.exceptions import EngineDeadError
    except ImportError:  # another vLLM layout: the liveness flag alone tells a death
        return RuntimeError
    return EngineDeadError


def _is_engine_dead_error(exc: BaseException) -> bool:
    cls = _engine_dead_error_class()
    return cls is not RuntimeError and isinstance(exc, cls)


class _EngineDeathWatch:
    """While a call to a multiprocess vLLM engine runs, wake the caller if the engine core dies: vLLM 0.32
    flags the engine dead, but a caller already waiting for outputs or for a ``collective_rpc`` waits for ever
    (measured: SIGKILL of the engine core during ``generate`` hung it for minutes). This thread polls the flag
    and hands every waiter an ``EngineDeadError``. A no-op for an in-process engine."""

    def __init__(self, client: Any, interval_s: float = 0.2) -> None:
        self.client = client
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> _EngineDeathWatch:
        resources = getattr(self.client, "resources", None)
        if resources is not None and hasattr(resources, "engine_dead"):
            self._thread = threading.Thread(
                target=self._watch, args=(resources,), daemon=True, name="coba-engine-watch"
            )
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _watch(self, resources: Any) -> None:
        while not self._stop.wait(self.interval_s):
            if not resources.engine_dead:
                continue
            dead = _engine_dead_error_class()
            queue = getattr(self.client, "outputs_queue", None)
            if queue is not None:
                queue.put_nowait(dead())
            for future in list(getattr(self.client, "utility_results", {}).values()):
                with contextlib.suppress(Exception):  # done meanwhile
                    future.set_exception(dead())
            return
