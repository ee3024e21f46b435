"""``coba bench update``: the GRPO update against a plain transformers loop, on the same rollouts.

What it measures, in one run (the machine's load changes between runs, so only the ratios of one
run are comparable):

- the machine's float32 matrix-multiply rate (``torch.mm`` of 2048 x 2048), the ceiling;
- a plain update as one would write it with transformers: every ``prompt + completion`` as a full
  sequence, micro-batches of ``--micro-batch`` sequences, logits over the whole sequence, the same
  clipped token-mean GRPO loss on the completion tokens, one AdamW step;
- the project's update (``PolicyTrainer.update``): each group's prompt encoded once, the output
  projection only at completion tokens, logp_old from the same forward when there is one optimizer
  step (``coba_tasks.engines.shared_prefix``), and the rows whose advantage is 0 left out of the
  passes (``skipped_row_share``);
- the project's update with LoRA (``--lora-rank``, default 16; 0 leaves it out): only the adapters
  train, so the backward computes no weight gradient of the base and AdamW steps the adapters only;
- their agreement: the loss and every gradient of the plain loop and the project's full update, from
  the same weights, before any step (``max_rel_grad_diff``: the largest gradient difference over the
  largest gradient);
- the project's updates broken down: forward, backward, optimizer, checkpoint save and its size, and
  (with ``--reload``) the rollout engine's weight reload from it (LoRA: writing the merged weights, then
  the reload).

The rollouts are a run's step (``--run-dir``, ``--step``: its rollouts, rewards and prompts) or, by
default, synthetic groups shaped like a CoBA step: ``--groups`` group sizes, prompts of
``--prompt-tokens`` and completions of ``--completion-tokens`` random tokens (the speed of a forward
and backward does not depend on which tokens they are) and binary rewards drawn at a pass rate per
group, so some groups are all right or all wrong (advantage 0), as in a real step. ``--json`` prints
the figures as one JSON line.

    coba bench update                                     # SmolLM2, 64 completions in 7 groups of 2-20
    coba bench update --model models/arith-tiny --json
    coba bench update --run-dir runs/smollm2-arith --step 3 --reload
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import torch

from coba_tasks.bench.timing import available_cpus, timed

DEFAULT_MODEL = "models/smollm2-135m-instruct"
DEFAULT_GROUPS = (2, 4, 6, 8, 10, 14, 20)  # 64 completions: CoBA's budgets are uneven


def matmul_gflops(size: int = 2048, repeats: int = 10) -> float:
    """float32 GFLOP/s of ``torch.mm`` on ``size`` x ``size`` matrices (best of three timings)."""
    import torch

    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b  # warm-up
    best = math.inf
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(repeats):
            a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * size**3 * repeats / best / 1e9


def synthetic_batch(
    groups: Sequence[int], prompt_tokens: int, completion_tokens: int, vocab: int, seed: int = 0
) -> tuple[list[list[int]], list[list[int]], np.ndarray]:
    """(prompt ids, completion ids, advantages) of ``groups`` GRPO groups of random tokens; one prompt per
    group, completions of ``completion_tokens`` tokens, advantages of mixed sign."""
    import numpy as np
    import torch

    g = torch.Generator().manual_seed(seed)
    prompts, completions = [], []
    for size in groups:
        prompt = torch.randint(5, vocab, (prompt_tokens,), generator=g).tolist()
        for _ in range(size):
            prompts.append(prompt)
            completions.append(torch.randint(5, vocab, (completion_tokens,), generator=g).tolist())
    from coba_tasks.core.grpo import group_advantages

    rng = np.random.default_rng(seed)
    rates = np.linspace(0.0, 1.0, len(groups)) if len(groups) > 1 else np.array([0.5])  # easy to hard
    rewards = np.concatenate([rng.random(size) < rate for size, rate in zip(groups, rates, strict=True)])
    ids = np.repeat(np.arange(len(groups)), groups)
    advantages = group_advantages(torch.tensor(rewards, dtype=torch.float64), torch.as_tensor(ids)).numpy()
    return prompts, completions, advantages


def run_batch(run_dir: str, step: int) -> tuple[list[list[int]], list[list[int]], np.ndarray]:
    """What the update of ``step`` of the run in ``run_dir`` trains on (its rollouts, rewards, prompts)."""
    from coba_tasks.pipeline import update_batch
    from coba_tasks.pipeline.store import RunStore, Table

    store = RunStore.open(run_dir)
    rollouts, rewards = store.read_table(step, Table.ROLLOUTS), store.read_table(step, Table.REWARDS)
    prompt_ids, completion_ids, _ = update_batch.update_sequences(rollouts, store.read_run_table("prompts"))
    return prompt_ids, completion_ids, update_batch.advantages_for(rollouts, rewards)


class PlainUpdate:
    """The plain loop: full sequences, logits everywhere, the GRPO loss on completion tokens, AdamW."""

    def __init__(self, model: torch.nn.Module, micro_batch: int, lr: float, pad_id: int) -> None:
        import torch

        self.model, self.micro_batch, self.pad_id = model, micro_batch, pad_id
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr)

    def loss_backward(self, prompts: list[list[int]], completions: list[list[int]], adv: np.ndarray) -> float:
        """Forward and backward over every micro-batch (gradients accumulate); the batch's loss."""
        import torch

        from coba_tasks.core.grpo import policy_loss
        from coba_tasks.engines.update import pad_sequences

        token_count = float(sum(len(c) for c in completions))
        advantages = torch.as_tensor(adv, dtype=torch.float32)
        total = 0.0
        for start in range(0, len(prompts), self.micro_batch):
            rows = slice(start, start + self.micro_batch)
            ids, attn, comp = pad_sequences(prompts[rows], completions[rows], self.pad_id)
            logits = self.model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()  # (B, T-1, V)
            logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # (B, T-1)
            loss, _ = policy_loss(logp, logp.detach(), advantages[rows], comp[:, 1:], token_count=token_count)
            loss.backward()
            total += float(loss.detach())
        return total

    def step(self, prompts: list[list[int]], completions: list[list[int]], adv: np.ndarray) -> float:
        import torch

        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss_backward(prompts, completions, adv)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        return loss


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}


def _agreement(model_path: str, prompts, completions, adv, settings: Any) -> dict[str, float]:
    """Loss and gradients of the plain loop and of the project's update from the same weights."""
    from coba_tasks.engines.update import PolicyTrainer

    unclipped = dataclasses.replace(settings, max_grad_norm=math.inf)  # the gradients as computed, not clipped
    trainer = PolicyTrainer(model_path, unclipped, seed=0)
    plain = PlainUpdate(trainer.model, settings.micro_batch_size, 0.0, trainer.pad_id)
    trainer.model.train()
    trainer.model.zero_grad(set_to_none=True)
    plain_loss = plain.loss_backward(prompts, completions, adv)
    reference = _grads(trainer.model)
    trainer.model.zero_grad(set_to_none=True)
    captured: dict[str, Any] = {}
    step = trainer.optimizer.step
    trainer.optimizer.step = lambda *a, **k: captured.update(grads=_grads(trainer.model))  # no step: compare only
    try:
        ours = trainer.update(prompts, completions, adv)
    finally:
        trainer.optimizer.step = step
    grads = captured["grads"]
    scale = max(float(g.abs().max()) for g in reference.values())
    diff = max(float((grads[k] - reference[k]).abs().max()) for k in reference)
    norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in reference.values()))
    return {
        "loss_plain": plain_loss,
        "loss_project": ours["loss"],
        "loss_abs_diff": abs(plain_loss - ours["loss"]),
        "grad_max_abs_diff": diff,
        "grad_max_abs": scale,
        "grad_max_rel_diff": diff / scale if scale > 0 else 0.0,
        "grad_norm_plain": norm,
        "grad_norm_project": float(ours["grad_norm"]),
    }


def bench_update(
    model_path: str = DEFAULT_MODEL,
    run_dir: str | None = None,
    step: int = 0,
    groups: Sequence[int] = DEFAULT_GROUPS,
    prompt_tokens: int = 46,
    completion_tokens: int = 32,
    micro_batch: int = 16,
    repeats: int = 2,
    reload: bool = False,
    threads: int = 0,
    lora_rank: int = 16,
    progress: Callable[[str], None] = lambda s: None,
) -> dict[str, Any]:
    """The figures (see the module docstring), as a dict."""
    import torch
    from transformers import AutoConfig

    from coba_tasks.engines.update import PolicyTrainer
    from coba_tasks.pipeline.policy import update_settings

    if not (Path(model_path) / "config.json").is_file():
        raise ValueError(f"{model_path} is not a Hugging Face model directory (make smollm2 builds the default one)")
    config = AutoConfig.from_pretrained(model_path)
    if run_dir:
        prompts, completions, adv = run_batch(run_dir, step)
    else:
        prompts, completions, adv = synthetic_batch(groups, prompt_tokens, completion_tokens, config.vocab_size)
    completion_count = sum(len(c) for c in completions)
    all_tokens = sum(len(p) + len(c) for p, c in zip(prompts, completions, strict=True))
    settings = update_settings(lr=1e-6, micro_batch_size=micro_batch, threads=threads or available_cpus())
    progress("agreement: loss and gradients of both updates from the same weights")
    agreement = _agreement(model_path, prompts, completions, adv, settings)

    trainer = PolicyTrainer(model_path, settings, seed=0)  # sets the thread count the rest runs with
    lora = None
    if lora_rank > 0:  # the full update's settings, with adapters (lr as the documented LoRA default: 10x)
        lora = PolicyTrainer(model_path, dataclasses.replace(settings, lora_rank=lora_rank, lr=1e-5), seed=0)
    progress(f"float32 matrix-multiply rate on {torch.get_num_threads()} threads")
    gflops = matmul_gflops()
    kinds = "plain loop, the project's update" + (f" and its LoRA update (rank {lora_rank})" if lora else "")
    progress(f"timing: {kinds}, alternated, {repeats} each")
    plain = PlainUpdate(trainer.model, micro_batch, 1e-6, trainer.pad_id)
    params = sum(p.numel() for p in trainer.model.parameters())
    plain_s, ours_s, lora_s, breakdowns, lora_breakdowns = [], [], [], [], []
    metrics: dict[str, Any] = {}
    for _ in range(repeats):
        trainer.model.train()
        plain_s.append(timed(plain.step, prompts, completions, adv)[1])
        metrics, seconds = timed(trainer.update, prompts, completions, adv)
        ours_s.append(seconds)
        breakdowns.append(dict(trainer.timings))
        if lora is not None:
            lora_s.append(timed(lora.update, prompts, completions, adv)[1])
            lora_breakdowns.append(dict(lora.timings))
    with tempfile.TemporaryDirectory(prefix="coba-bench-update-") as tmp:
        progress("checkpoint save")
        saved = _save_and_reload(trainer, model_path, Path(tmp) / "full", reload, progress)
        if lora is not None:
            lora_saved = _save_and_reload(lora, model_path, Path(tmp) / "lora", reload, progress)
    plain_med, ours_med = statistics.median(plain_s), statistics.median(ours_s)
    flops_plain = 6 * params * all_tokens  # forward + backward of every token of every full sequence
    lora_result = None
    if lora is not None:
        lora_med = statistics.median(lora_s)
        lora_result = {
            "rank": lora_rank,
            "trainable_parameters": sum(p.numel() for p in lora.model.parameters() if p.requires_grad),
            "seconds": lora_med,
            "completion_tokens_per_s": completion_count / lora_med,
            "runs_s": lora_s,
            "breakdown_s": _breakdown(lora_breakdowns, lora_saved),
            "checkpoint_mb": lora_saved[1],
        }
    skipped = int(metrics.get("skipped_rows", 0))
    return {
        "speedup_vs_plain": plain_med / ours_med,
        "max_rel_grad_diff": agreement["grad_max_rel_diff"],
        "lora_speedup_vs_full": ours_med / lora_result["seconds"] if lora_result else None,
        "skipped_row_share": skipped / len(completions),
        "benchmark": "update",
        "model": model_path,
        "parameters": params,
        "rollouts": {
            "source": f"{run_dir} step {step}" if run_dir else "synthetic",
            "completions": len(completions),
            "groups": len({tuple(p) for p in prompts}),
            "completion_tokens": completion_count,
            "prompt_tokens_per_completion": all_tokens / len(completions) - completion_count / len(completions),
        },
        "threads": torch.get_num_threads(),
        "matmul_gflops": gflops,
        "plain": {
            "seconds": plain_med,
            "completion_tokens_per_s": completion_count / plain_med,
            "share_of_matmul_rate": flops_plain / plain_med / 1e9 / gflops,
            "runs_s": plain_s,
        },
        "project": {
            "seconds": ours_med,
            "completion_tokens_per_s": completion_count / ours_med,
            "share_of_matmul_rate": flops_plain / ours_med / 1e9 / gflops,  # the plain loop's FLOPs per second
            "runs_s": ours_s,
            "skipped_rows": skipped,
            "skipped_tokens": int(metrics.get("skipped_tokens", 0)),
            "breakdown_s": _breakdown(breakdowns, saved),
            "checkpoint_mb": saved[1],
        },
        "lora": lora_result,
        "speedup": plain_med / ours_med,
        "agreement": agreement,
    }


def _breakdown(breakdowns: list[dict[str, float]], saved: tuple[float, float, float | None]) -> dict[str, Any]:
    """The medians of the updates' forward, backward and optimizer seconds, then ``_save_and_reload``'s seconds."""
    medians = {k: statistics.median(b.get(k, 0.0) for b in breakdowns) for k in ("forward", "backward", "optimizer")}
    return {**medians, "checkpoint_save": saved[0], "weight_reload": saved[2]}


def _save_and_reload(
    trainer: Any, model_path: str, out: Path, reload: bool, progress: Callable[[str], None]
) -> tuple[float, float, float | None]:
    """(checkpoint save seconds, its size in MB, weight reload seconds or None): the reload hands the
    engine the trainer's weights in memory (with LoRA, merged first)."""
    ckpt, save_s = timed(trainer.save_checkpoint, out)
    size_mb = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file()) / 1e6
    if not reload:
        return save_s, size_mb, None
    progress(f"weight reload into a vLLM engine ({out.name})")
    from coba_tasks.engines.rollout import make_backend

    engine = make_backend("vllm", model_path, dtype="float32", max_model_len=256, seed=0)
    try:
        t0 = time.perf_counter()
        engine.set_weights(trainer.engine_weights, version=1)  # from memory, as after each update
        return save_s, size_mb, time.perf_counter() - t0
    finally:
        engine.close()


def format_update(r: dict[str, Any]) -> str:
    """The figures as text."""
    ro, pl, pr, ag, lo = r["rollouts"], r["plain"], r["project"], r["agreement"], r["lora"]
    b = pr["breakdown_s"]

    def reload_of(seconds: float | None) -> str:
        return f"{seconds:.2f} s" if seconds is not None else "not measured (--reload)"

    reload = reload_of(b["weight_reload"])
    lora_lines = []
    if lo is not None:
        lb = lo["breakdown_s"]
        lora_lines = [
            f"  project update, LoRA rank {lo['rank']} {lo['seconds']:7.2f} s  {lo['completion_tokens_per_s']:7.1f} "
            f"completion tokens/s  ({lo['trainable_parameters'] / 1e6:.2f} M trainable); "
            f"{r['lora_speedup_vs_full']:.2f}x the full update (goal >= 1.4x)",
            f"  LoRA breakdown: forward {lb['forward']:.2f} s, backward {lb['backward']:.2f} s, optimizer "
            f"{lb['optimizer']:.2f} s, checkpoint save {lb['checkpoint_save']:.2f} s ({lo['checkpoint_mb']:.1f} MB), "
            f"merged weights + reload {reload_of(lb['weight_reload'])}",
        ]
    return "\n".join(
        [
            f"GRPO update benchmark: {r['model']} ({r['parameters'] / 1e6:.1f} M parameters), {r['threads']} threads",
            f"rollouts: {ro['source']}: {ro['completions']} completions in {ro['groups']} groups, "
            f"{ro['completion_tokens']} completion tokens, {ro['prompt_tokens_per_completion']:.0f} prompt tokens each",
            f"float32 matmul: {r['matmul_gflops']:.0f} GFLOP/s",
            f"  plain loop (full sequences)   {pl['seconds']:7.2f} s  {pl['completion_tokens_per_s']:7.1f} completion "
            f"tokens/s  ({pl['share_of_matmul_rate']:.0%} of the matmul rate)",
            f"  project update                {pr['seconds']:7.2f} s  {pr['completion_tokens_per_s']:7.1f} completion "
            f"tokens/s  ({pr['share_of_matmul_rate']:.0%} of the matmul rate in the plain loop's FLOPs)",
            f"  speedup: {r['speedup']:.2f}x the plain loop (goal >= 3x); rows with advantage 0 left out: "
            f"{pr['skipped_rows']} of {ro['completions']} ({r['skipped_row_share']:.0%})",
            f"  breakdown: forward {b['forward']:.2f} s, backward {b['backward']:.2f} s, optimizer "
            f"{b['optimizer']:.2f} s, checkpoint save {b['checkpoint_save']:.2f} s ({pr['checkpoint_mb']:.0f} MB), "
            f"weight reload {reload}",
            *lora_lines,
            f"agreement (same weights, before a step): loss {ag['loss_plain']:.6g} vs {ag['loss_project']:.6g}, "
            f"gradients max |diff| {ag['grad_max_abs_diff']:.2e} ({ag['grad_max_rel_diff']:.1e} of the largest), "
            f"norm {ag['grad_norm_plain']:.6g} vs {ag['grad_norm_project']:.6g}",
        ]
    )
