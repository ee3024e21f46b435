"""The GRPO update in several processes: the policy sharded with FSDP2, the rollouts split across ranks
(``optim.fsdp_processes`` > 1; docs/scale_out.md, "Multi-GPU update (FSDP2)", gives the command line).

``fsdp_update`` runs one torchrun job; each rank builds the single-process ``PolicyTrainer`` (and restores
``--checkpoint``), shards it (``shard_trainer``), runs ``PolicyTrainer.update`` unchanged with a
``DistributedShard``, and rank 0 writes ``PolicyTrainer.save_checkpoint``'s layout. Every rank loads the
full float32 model before sharding it (one full copy per rank, for a moment), and rank 0 one more on the
CPU to write the checkpoint. Past the last barrier each rank writes its ``rank-<r>.done``: a job that exits
non-zero after every rank wrote one (a rank aborting while its process shuts down, seen on CPU) keeps its
checkpoint and metrics, with a warning; any other failure raises.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from coba_tasks.engines.checkpoint import write_checkpoint
from coba_tasks.engines.update import DataShard, NonFiniteUpdateError, PolicyTrainer, UpdateSettings, make_optimizer

PROJECT_ROOT = Path(__file__).resolve().parents[2]  # coba_tasks/<layer>/this file
LOG_TAIL_LINES = 60
STOPPED_FILE = "stopped.txt"  # beside --metrics: why rank 0 stopped the update (NonFiniteUpdateError), one line
# beside --metrics, one per rank: the rank passed the last barrier, so every rank's part was written
DONE_FILE = "rank-{rank}.done"

logger = logging.getLogger(__name__)
COLLECTIVE_TIMEOUT = timedelta(hours=1)  # the other ranks wait at a barrier while rank 0 writes the checkpoint


class FSDPUpdateError(RuntimeError):
    """The torchrun job of an FSDP update failed (the message ends with its last output lines)."""


# -- inside each rank -------------------------------------------------------------------------------


class DistributedShard(DataShard):
    """One rank's share of each mini-batch, and the collectives ``PolicyTrainer.update`` needs."""

    distributed = True

    def __init__(self, rank: int, world: int, device: torch.device) -> None:
        self.rank, self.world, self.device = rank, world, device

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t)
        return t

    def sum_floats(self, values: dict[str, float]) -> dict[str, float]:
        t = torch.tensor(list(values.values()), dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return dict(zip(values, t.tolist(), strict=True))

    def clip_grad_norm_(self, params: Iterable[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        params = list(params)
        total = _full(torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None], 2.0))
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total


def shard_module(model: torch.nn.Module, mesh) -> None:
    """FSDP2 on each decoder layer (the classes in the HF model's ``_no_split_modules``), then the root;
    gradients are summed across ranks (not averaged): the loss is already divided by the global tokens."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    layer_classes = set(getattr(model, "_no_split_modules", None) or ())
    for module in [m for m in model.modules() if type(m).__name__ in layer_classes]:
        fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no AVG or PREMUL_SUM


def shard_trainer(trainer: PolicyTrainer, mesh) -> None:
    """Shard ``trainer``'s policy (and KL reference) in place; rebuild AdamW over the sharded parameters with the
    current moments (e.g. from ``load_checkpoint``, whole on every rank) sharded like their parameters
    (``torch.distributed.checkpoint.state_dict``: the state by parameter name, whole in, sharded out)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    # unsharded: every tensor as it is. A fresh optimizer (no checkpoint) is not asked: the library would fill
    # its state by a step with zero gradients, and AdamW's step count would then be one ahead.
    whole = get_optimizer_state_dict(trainer.model, trainer.optimizer) if trainer.optimizer.state else None
    shard_module(trainer.model, mesh)
    if trainer.ref_model is not None:
        shard_module(trainer.ref_model, mesh)
    trainer.optimizer = make_optimizer(trainer.model, trainer.settings)
    if whole is not None:
        options = StateDictOptions(full_state_dict=True)
        set_optimizer_state_dict(trainer.model, trainer.optimizer, optim_state_dict=whole, options=options)
    trainer.shard = DistributedShard(dist.get_rank(), dist.get_world_size(), torch.device(mesh.device_type))


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (a collective: each rank holds its part; a norm, its partial norm)."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def full_state(trainer: PolicyTrainer) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], list[dict]]:
    """The sharded trainer's whole weights and AdamW state on rank 0's CPU (empty elsewhere), gathered by
    ``torch.distributed.checkpoint.state_dict`` (a collective: every rank calls it): the model's state dict, and
    the optimizer's as ``optimizer_to_tensors`` writes it (``state.<index>.<key>``, the index a parameter's place
    in the param groups) with its param groups."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights, optim = get_state_dict(trainer.model, trainer.optimizer, options=options)
    if dist.get_rank() != 0:
        return {}, {}, []
    index = {name: i for i, name in enumerate(n for g in optim["param_groups"] for n in g["params"])}
    tensors = {
        f"state.{index[name]}.{key}": (value if torch.is_tensor(value) else torch.tensor(value)).contiguous()
        for name, state in optim["state"].items()
        for key, value in state.items()
    }
    groups = [
        {k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()}
        | {"params": [index[n] for n in g["params"]]}
        for g in optim["param_groups"]
    ]
    return weights, tensors, groups


def save_sharded_checkpoint(
    trainer: PolicyTrainer, out_dir: str | Path, model_path: str | Path, extra_state: dict[str, Any] | None
) -> None:
    """``PolicyTrainer.save_checkpoint``'s layout from a sharded trainer: every rank takes part in the
    gathers, rank 0 writes (through a plain copy of the model loaded on the CPU from ``model_path``)."""
    from torch.distributed.fsdp import FSDPModule
    from transformers import AutoModelForCausalLM

    for module in trainer.model.modules():  # the registered parameters are the sharded ones (DTensors)
        if isinstance(module, FSDPModule):
            module.reshard()
    weights, tensors, groups = full_state(trainer)
    if dist.get_rank() == 0:
        rng = torch.get_rng_state()
        with torch.random.fork_rng(devices=[]):
            plain = AutoModelForCausalLM.from_pretrained(
                model_path, dtype=torch.float32, trust_remote_code=trainer.settings.trust_remote_code
            )
        plain.load_state_dict(weights, strict=True)
        write_checkpoint(
            out_dir, plain, trainer.tokenizer, trainer.compute_dtype, tensors, groups, trainer.updates, extra_state, rng
        )
    dist.barrier()


def run_rank(
    model_path: str,
    rollouts: str,
    settings: UpdateSettings,
    out: str,
    metrics_path: str,
    seed: int = 0,
    checkpoint: str | None = None,
    extra_state: dict[str, Any] | None = None,
) -> dict[str, float]:
    """One rank of the torchrun job."""
    from torch.distributed.device_mesh import init_device_mesh

    cuda = torch.cuda.is_available()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if cuda:
        if world > torch.cuda.device_count():
            raise RuntimeError(
                f"optim.fsdp_processes = {world} but this machine has {torch.cuda.device_count()} GPU(s)"
            )
        local = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=local, timeout=COLLECTIVE_TIMEOUT)
    else:
        dist.init_process_group("gloo", timeout=COLLECTIVE_TIMEOUT)
    rank = dist.get_rank()
    try:
        trainer = PolicyTrainer(model_path, settings, seed=seed)
        if checkpoint:
            trainer.load_checkpoint(checkpoint)
        shard_trainer(trainer, init_device_mesh("cuda" if cuda else "cpu", (dist.get_world_size(),)))
        prompt_ids, completion_ids, advantages, sampler_logprobs = read_batch(rollouts)
        groups = read_group_ids(rollouts)
        try:  # every rank stops at the same step (the figures checked are summed or global)
            metrics = trainer.update(prompt_ids, completion_ids, advantages, sampler_logprobs, groups)
        except NonFiniteUpdateError as exc:
            if dist.get_rank() == 0:  # the caller's one line, not a traceback in the job's log
                (Path(metrics_path).parent / STOPPED_FILE).write_text(str(exc))
            raise
        save_sharded_checkpoint(trainer, out, model_path, extra_state)
        if dist.get_rank() == 0:
            Path(metrics_path).write_text(json.dumps(metrics, indent=2))
        dist.barrier()  # past it, every rank's part is written: rank 0's checkpoint and metrics included
        (Path(metrics_path).parent / DONE_FILE.format(rank=rank)).touch()
        return metrics
    finally:
        dist.destroy_process_group()


# -- the batch file -----------------------------------------------------------------------------------


def write_batch(
    path: str | Path,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    advantages: np.ndarray | torch.Tensor,
    sampler_logprobs: Sequence[Sequence[float]] | None = None,
    group_ids: Sequence[int] | np.ndarray | None = None,
) -> Path:
    """One step's update batch as Parquet: prompt_ids, completion_ids (lists of int64), advantage (float64),
    the sampler's per-token logprobs (lists of float64) and each rollout's prompt (group_id, int64) when given."""
    import pyarrow as pa

    from coba_tasks.engines.fileio import write_parquet

    adv = np.asarray(advantages, dtype=np.float64)
    if not len(prompt_ids) == len(completion_ids) == len(adv):
        raise ValueError(f"{len(prompt_ids)} prompts, {len(completion_ids)} completions, {len(adv)} advantages")
    columns = {
        "prompt_ids": pa.array([list(map(int, p)) for p in prompt_ids], type=pa.list_(pa.int64())),
        "completion_ids": pa.array([list(map(int, c)) for c in completion_ids], type=pa.list_(pa.int64())),
        "advantage": pa.array(adv, type=pa.float64()),
    }
    if sampler_logprobs is not None:
        logprobs = [list(map(float, x)) for x in sampler_logprobs]
        columns["sampler_logprobs"] = pa.array(logprobs, type=pa.list_(pa.float64()))
    if group_ids is not None:
        columns["group_id"] = pa.array(np.asarray(group_ids, dtype=np.int64), type=pa.int64())
    return write_parquet(pa.table(columns), path)


def read_batch(path: str | Path) -> tuple[list[list[int]], list[list[int]], np.ndarray, list[list[float]] | None]:
    """Inverse of ``write_batch``."""
    import pyarrow.parquet as pq

    table = pq.read_table(str(path))
    logprobs = table.column("sampler_logprobs").to_pylist() if "sampler_logprobs" in table.column_names else None
    return (
        table.column("prompt_ids").to_pylist(),
        table.column("completion_ids").to_pylist(),
        table.column("advantage").to_numpy(),
        logprobs,
    )


def read_group_ids(path: str | Path) -> np.ndarray | None:
    """The batch's group_id column (each rollout's prompt, for optim.prompt_weighting), None without one."""
    import pyarrow.parquet as pq

    table = pq.read_table(str(path))
    return table.column("group_id").to_numpy() if "group_id" in table.column_names else None


# -- the caller's side ------------------------------------------------------------------------------


def fsdp_update(
    model_path: str | Path,
    out_dir: str | Path,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    advantages: np.ndarray | torch.Tensor,
    settings: UpdateSettings,
    processes: int,
    *,
    checkpoint: str | Path | None = None,
    seed: int = 0,
    extra_state: dict[str, Any] | None = None,
    timeout_s: float | None = None,
    sampler_logprobs: Sequence[Sequence[float]] | None = None,
    group_ids: Sequence[int] | np.ndarray | None = None,
) -> dict[str, float]:
    """``PolicyTrainer(model_path, settings, seed)``, ``load_checkpoint(checkpoint)`` (when given), ``update`` and
    ``save_checkpoint(out_dir, extra_state)`` in ``processes`` FSDP ranks; returns the update's metrics.
    ``NonFiniteUpdateError`` (one line) when the update stopped on a non-finite loss or gradient norm,
    ``FSDPUpdateError`` with the job's last output lines if it fails otherwise."""
    if processes < 1:
        raise ValueError(f"processes must be >= 1, got {processes}")
    with tempfile.TemporaryDirectory(prefix="coba-fsdp-") as tmp:
        t = Path(tmp)
        write_batch(t / "batch.parquet", prompt_ids, completion_ids, advantages, sampler_logprobs, group_ids)
        (t / "settings.json").write_text(json.dumps(dataclasses.asdict(settings)))
        (t / "extra.json").write_text(json.dumps(extra_state or {}))
        args = {"--model": model_path, "--rollouts": t / "batch.parquet", "--settings": t / "settings.json"}
        args |= {"--seed": seed, "--out": out_dir, "--metrics": t / "metrics.json", "--extra-state": t / "extra.json"}
        if checkpoint is not None:
            args["--checkpoint"] = checkpoint
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}"]
        cmd += ["-m", "coba_tasks.engines.fsdp_update", *(str(x) for kv in args.items() for x in kv)]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PROJECT_ROOT), env.get("PYTHONPATH", "")) if p)
        env.setdefault("OMP_NUM_THREADS", str(settings.threads))
        with open(t / "torchrun.log", "w") as log:
            try:
                rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
            except subprocess.TimeoutExpired:
                rc = None
        if rc != 0 and (t / STOPPED_FILE).is_file():
            raise NonFiniteUpdateError((t / STOPPED_FILE).read_text())
        if rc not in (0, None) and _every_rank_done(t, processes):
            # seen on CPU: "terminate called without an active exception" (gloo's threads at exit)
            last = (t / "torchrun.log").read_text(errors="replace").strip().splitlines()[-1:]
            logger.warning(
                "FSDP update: every rank finished its part, then the job exited with status "
                "%s while its processes shut down (%s); the checkpoint and the metrics are whole and kept",
                rc,
                last[0] if last else "no output",
            )
            rc = 0
        if rc != 0:
            tail = "\n".join((t / "torchrun.log").read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:])
            why = f"timed out after {timeout_s} s" if rc is None else f"exit status {rc}"
            raise FSDPUpdateError(f"FSDP update in {processes} processes failed ({why}); its last lines:\n{tail}")
        return json.loads((t / "metrics.json").read_text())


def _every_rank_done(tmp: Path, processes: int) -> bool:
    """Every rank of the job wrote its ``DONE_FILE`` and rank 0 its metrics (the job's work is whole)."""
    done = all((tmp / DONE_FILE.format(rank=r)).is_file() for r in range(processes))
    return done and (tmp / "metrics.json").is_file()


def _settings_from_json(path: str) -> UpdateSettings:
    raw = json.loads(Path(path).read_text())
    raw["betas"] = tuple(raw["betas"])
    return UpdateSettings(**raw)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="One GRPO update as an FSDP rank (run under torchrun).")
    ap.add_argument("--model", required=True, help="the base model directory (config.model.path)")
    ap.add_argument("--checkpoint", help="the previous step's checkpoint to continue from (none: a fresh start)")
    ap.add_argument("--rollouts", required=True, help="Parquet file written by write_batch")
    ap.add_argument("--settings", required=True, help="JSON of UpdateSettings")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True, help="the checkpoint directory to write")
    ap.add_argument("--metrics", required=True, help="JSON file for the update's metrics (rank 0)")
    ap.add_argument("--extra-state", help="JSON file of extra trainer state stored in the checkpoint")
    a = ap.parse_args(argv)
    extra = json.loads(Path(a.extra_state).read_text()) if a.extra_state else None
    run_rank(a.model, a.rollouts, _settings_from_json(a.settings), a.out, a.metrics, a.seed, a.checkpoint, extra)


if __name__ == "__main__":
    main()
