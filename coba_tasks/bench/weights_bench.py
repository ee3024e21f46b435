"""``coba bench weights``: the policy to the rollout engine after an update, through a file (how every step did
it before) against from memory (how a step does it now), and the checkpoint a step writes.

For each model, one trainer after one GRPO update beside one in-process vLLM engine on the same model, in one
process (only the ratios of one run are comparable: the machine's load changes between runs):

- **through a file**: with LoRA the merged weights written to a directory, full fine-tuning the checkpoint
  (weights, AdamW moments; the engine read it), then vLLM's in-place reload from it;
- **from memory**: ``engine.set_weights(trainer.engine_weights)``, what the update stage now does;
- **the checkpoint** (``trainer.save_checkpoint``): what a step that keeps one writes (LoRA: the adapter and
  its AdamW state; full: weights and AdamW moments);
- **the weights digest** (``trainer.params_digest``) every update records for the replay check, beside one
  update of the bench's batch;

each as the median seconds of ``--repeats``, the bytes written, and the growth of the process's peak resident
memory during it (Linux: ``VmHWM``, reset before each). The models: SmolLM2-135M (``--smollm2``, when it is
there: ``make smollm2``) with LoRA and with full fine-tuning, and a randomly initialised model of Qwen2.5-0.5B's
shape (hidden 896, 24 layers, vocabulary 151,936, tied embeddings) with both, float32 on CPU.

    coba bench weights                      # SmolLM2 and the 0.5B shape, LoRA and full
    coba bench weights --skip-0.5b --json   # SmolLM2 only
"""

from __future__ import annotations

import gc
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from coba_tasks.bench.timing import median_time, timed

DEFAULT_SMOLLM2 = "models/smollm2-135m-instruct"
QWEN_05B_SHAPE = {  # Qwen2.5-0.5B's shape (its config.json)
    "vocab_size": 151_936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "tie_word_embeddings": True,
}
LORA_RANK = 16


def _peak_rss_growth(fn: Callable[[], Any]) -> tuple[Any, float | None]:
    """``fn()`` and how far the process's peak resident memory rose above its resident memory before, in GB
    (Linux: ``/proc/self/status`` VmHWM after writing 5 to ``clear_refs``; None elsewhere)."""

    def status(key: str) -> float:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return float(line.split()[1]) / 2**20  # kB -> GB
        raise KeyError(key)

    try:
        Path("/proc/self/clear_refs").write_text("5")  # peak RSS := RSS now
        before = status("VmRSS")
    except OSError:
        return fn(), None
    out = fn()
    return out, max(0.0, status("VmHWM") - before)


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def build_random_qwen(out: Path) -> Path:
    """A randomly initialised model of Qwen2.5-0.5B's shape, float32, with the character tokenizer (the engine
    is given token ids; the tokenizer is only loaded)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from coba_tasks.engines.model import build_char_tokenizer, save_hf, seeded_model

    tok = build_char_tokenizer()
    special = {k: getattr(tok, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    config = Qwen2Config(**QWEN_05B_SHAPE, max_position_embeddings=4096, rope_theta=1e6, **special)
    return save_hf(seeded_model(Qwen2ForCausalLM, config, tok, seed=0), tok, out)


def bench_case(engine: Any, model: Path, lora_rank: int, scratch: Path, repeats: int) -> dict[str, Any]:
    """The three ways of one trainer (LoRA of ``lora_rank``, 0: full fine-tuning) after one update."""
    from coba_tasks.bench.update_bench import synthetic_batch
    from coba_tasks.engines.lora import save_merged
    from coba_tasks.engines.update import PolicyTrainer
    from coba_tasks.pipeline.policy import update_settings

    settings = update_settings(lr=1e-5, micro_batch_size=4, lora_rank=lora_rank, lora_alpha=2 * lora_rank)
    trainer = PolicyTrainer(model, settings)
    vocab = trainer.model.config.vocab_size
    prompts, completions, adv = synthetic_batch((2, 2), 16, 8, vocab)
    trainer.update(prompts, completions, adv)  # the optimizer holds its state, as after any step
    params = sum(p.numel() for p in trainer.model.parameters())
    target = scratch / "engine_reads"

    def through_file() -> int:
        shutil.rmtree(target, ignore_errors=True)
        if lora_rank:
            save_merged(trainer.model, target, trainer.compute_dtype)
        else:
            trainer.save_checkpoint(target)
        engine.load_weights(target, version=1)
        return _dir_bytes(target)

    def from_memory() -> None:
        engine.set_weights(trainer.engine_weights, version=1)

    def checkpoint() -> int:
        shutil.rmtree(scratch / "ckpt", ignore_errors=True)
        return _dir_bytes(trainer.save_checkpoint(scratch / "ckpt"))

    row: dict[str, Any] = {"lora_rank": lora_rank, "parameters": params}
    for name, fn in (("file", through_file), ("memory", from_memory), ("checkpoint", checkpoint)):
        (seconds, written), peak = _peak_rss_growth(lambda fn=fn: median_time(fn, repeats))
        row[f"{name}_s"] = seconds
        row[f"{name}_bytes"] = int(written or 0)
        row[f"{name}_peak_gb"] = peak
    row["memory_over_file"] = row["memory_s"] / row["file_s"]
    # what every update adds for the replay check: the digest of the trained weights, against one update here
    _, row["update_s"] = timed(trainer.update, prompts, completions, adv)
    row["digest_s"], _ = median_time(trainer.params_digest, repeats)
    row["trained_parameters"] = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    return row


def bench_weights(
    smollm2: str | None = DEFAULT_SMOLLM2,
    qwen_05b: bool = True,
    repeats: int = 3,
    progress: Callable[[str], None] = lambda msg: None,
) -> dict[str, Any]:
    """The figures of every (model, LoRA or full) case; see the module docstring."""
    import torch

    from coba_tasks.engines.rollout import make_backend

    cases: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="coba-bench-weights-") as tmp:
        scratch = Path(tmp)
        models: list[tuple[str, Path]] = []
        if smollm2 and (Path(smollm2) / "config.json").is_file():
            models.append(("SmolLM2-135M", Path(smollm2)))
        if qwen_05b:
            progress("building a random model of Qwen2.5-0.5B's shape")
            models.append(("Qwen2.5-0.5B shape", build_random_qwen(scratch / "qwen-0.5b")))
        if not models:
            raise ValueError(f"no model to time: {smollm2} is not a model directory (make smollm2) and 0.5B is off")
        for label, path in models:
            progress(f"{label}: starting a vLLM engine")
            engine = make_backend("vllm", path, dtype="float32", max_model_len=64, seed=0)
            try:
                for rank in (LORA_RANK, 0):
                    progress(f"{label}, {f'LoRA rank {rank}' if rank else 'full fine-tuning'}")
                    cases.append({"model": label, **bench_case(engine, path, rank, scratch, repeats)})
                    gc.collect()  # the case's trainer
            finally:
                engine.close()
                gc.collect()
    return {"repeats": repeats, "torch_threads": torch.get_num_threads(), "cases": cases}


def format_weights(result: dict[str, Any]) -> str:
    """The figures as a table."""

    def gb(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    lines = [
        f"policy to the rollout engine after an update (median of {result['repeats']}; "
        f"{result['torch_threads']} torch threads); peak = growth of peak resident memory, GB",
        f"{'model':<20} {'update':<8} {'file s':>8} {'MB':>8} {'peak':>6} {'memory s':>9} {'peak':>6} "
        f"{'ratio':>6} {'ckpt s':>8} {'MB':>8} {'peak':>6}",
    ]
    for c in result["cases"]:
        kind = f"LoRA {c['lora_rank']}" if c["lora_rank"] else "full"
        lines.append(
            f"{c['model']:<20} {kind:<8} {c['file_s']:>8.3f} {c['file_bytes'] / 1e6:>8.1f} {gb(c['file_peak_gb']):>6} "
            f"{c['memory_s']:>9.3f} {gb(c['memory_peak_gb']):>6} {c['memory_over_file']:>6.3f} "
            f"{c['checkpoint_s']:>8.3f} {c['checkpoint_bytes'] / 1e6:>8.1f} {gb(c['checkpoint_peak_gb']):>6}"
        )
    lines.append("file: what the engine read before (LoRA: merged weights; full: the checkpoint) written + reloaded; ")
    lines.append("memory: set_weights, no bytes written; ratio: memory s / file s (goal <= 0.10); ckpt: one checkpoint")
    lines.append("")
    lines.append(f"{'model':<20} {'update':<8} {'trained':>11} {'digest s':>9} {'update s':>9} {'ratio':>6}")
    for c in result["cases"]:
        kind = f"LoRA {c['lora_rank']}" if c["lora_rank"] else "full"
        lines.append(
            f"{c['model']:<20} {kind:<8} {c['trained_parameters']:>11,} {c['digest_s']:>9.3f} {c['update_s']:>9.3f} "
            f"{c['digest_s'] / c['update_s']:>6.3f}"
        )
    lines.append("digest: the trained weights' digest each update records (the replay check); update: one update of")
    lines.append("the bench's small batch (a run's updates are longer: compare with its update stage's seconds)")
    return "\n".join(lines)
