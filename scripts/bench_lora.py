"""How the rollout engine should sample a LoRA policy: merged weights or vLLM's adapters (a one-time question).

Two ways for vLLM to sample the policy ``W + (alpha / r) B A`` after a LoRA update, timed on the same
prompts, group sizes and seeds from one adapter checkpoint (``--checkpoint``, a LoRA run's
``checkpoints/NNNNNN``; without one, an adapter is trained for one update on synthetic groups):

- **merged**: write the merged weights (``PolicyTrainer.write_rollout_weights``), reload them in place
  into an engine of the base model, generate (what a run does after every LoRA update);
- **vLLM LoRA**: an engine of the base model started with ``enable_lora``, the adapter loaded as a new
  ``LoRARequest`` (what each new version would need), generate with it.

For each: the per-update cost (write + reload, or adapter load), generation tokens per second, and the
sampler/trainer gap, |sampler log p - trainer log p| of every sampled token against the trainer's own
LoRA forward at the same temperature (how exact the engine is about the policy being trained).

The answer (the run keeps the merged weights) and its figures are in docs/benchmarks.md. This was
``coba bench lora`` until commit c361a60; run it from the repository root with coba-rl's venv:

    .venv/bin/python scripts/bench_lora.py
    .venv/bin/python scripts/bench_lora.py --checkpoint runs/smollm2-lora/checkpoints/000002 --json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from coba_tasks.bench.timing import timed
from coba_tasks.commands.bench_cmd import print_figures, print_progress


def bench_lora(
    checkpoint: str | None,
    model_path: str,
    test_path: str,
    prompts: int = 32,
    group_size: int = 8,
    max_tokens: int = 48,
    lora_rank: int = 16,
    progress: Callable[[str], None] = lambda s: None,
) -> dict[str, Any]:
    """The figures (see the module docstring); seconds and tokens per second."""
    import numpy as np
    from transformers import AutoTokenizer

    from coba_tasks.engines.lora import base_model_of
    from coba_tasks.engines.rollout import RolloutRequest, SamplingConfig, make_backend, rollout_seed
    from coba_tasks.engines.update import PolicyTrainer, sampler_gap_rows
    from coba_tasks.pipeline.data import load_dataset
    from coba_tasks.pipeline.data_prompts import render_prompts
    from coba_tasks.pipeline.run import update_settings

    with tempfile.TemporaryDirectory(prefix="coba-bench-lora-") as tmp:
        work = Path(tmp)
        if checkpoint is None:  # an adapter trained one step on synthetic groups, so B != 0
            from coba_tasks.bench.update_bench import synthetic_batch

            progress("training a LoRA adapter for one update (no --checkpoint)")
            trainer = PolicyTrainer(model_path, update_settings(lr=1e-3, lora_rank=lora_rank))
            vocab = trainer.model.config.vocab_size
            trainer.update(*synthetic_batch([4, 4, 4, 4], 20, 16, vocab))
            checkpoint = str(trainer.save_checkpoint(work / "ckpt"))
        base = str(base_model_of(checkpoint))
        rank = json.loads((Path(checkpoint) / "adapter_config.json").read_text())["r"]
        trainer = PolicyTrainer(base, update_settings(lora_rank=rank))
        trainer.load_checkpoint(checkpoint)
        df, _ = render_prompts(load_dataset(test_path).head(prompts), AutoTokenizer.from_pretrained(base))
        requests = [
            RolloutRequest(pid, tuple(ids), group_size, rollout_seed(0, 0, pid), prompt=text)
            for pid, ids, text in zip(df["prompt_id"], df["prompt_token_ids"], df["prompt_rendered"], strict=True)
        ]
        sampling = SamplingConfig(temperature=1.0, max_tokens=max_tokens)
        by_id = {r.prompt_id: r.prompt_token_ids for r in requests}

        def gap(rows: list[Any]) -> tuple[float, float]:
            old: list[Any] = [None] * len(rows)
            trainer._grouped_logprobs(
                trainer.model, [by_id[r.prompt_id] for r in rows], [r.token_ids for r in rows], old
            )
            return sampler_gap_rows(old, [r.logprobs for r in rows], [r.token_ids for r in rows])

        out: dict[str, Any] = {"benchmark": "lora", "checkpoint": checkpoint, "base": base, "rank": rank}
        out["prompts"], out["group_size"], out["max_tokens"] = len(requests), group_size, max_tokens

        progress("merged: engine on the base model, merged weights written and reloaded, generate")
        engine = make_backend("vllm", base, dtype="float32", max_model_len=512, seed=0)
        try:
            engine.generate(requests[:2], sampling)  # warm-up
            # the merged weights are written inside the timed call: a LoRA update's reload includes them
            _, update_s = timed(lambda: engine.load_weights(trainer.write_rollout_weights(work / "merged"), version=1))
            rows, gen_s = timed(engine.generate, requests, sampling)
        finally:
            engine.close()
        tokens = sum(r.n_tokens for r in rows)
        out["merged"] = {"per_update_s": update_s, "generate_s": gen_s, "tokens_per_s": tokens / gen_s}
        out["merged"]["gap_mean"], out["merged"]["gap_max"] = gap(rows)

        progress("vLLM LoRA: engine on the base model with enable_lora, the adapter as a LoRARequest, generate")
        from vllm import SamplingParams
        from vllm.lora.request import LoRARequest

        engine = make_backend(
            "vllm", base, dtype="float32", max_model_len=512, seed=0, extra={"enable_lora": True, "max_lora_rank": rank}
        )
        try:
            llm = engine._llm
            params = [
                SamplingParams(n=r.n, temperature=1.0, max_tokens=max_tokens, seed=r.seed, logprobs=0) for r in requests
            ]
            token_prompts = [{"prompt_token_ids": list(r.prompt_token_ids)} for r in requests]
            llm.generate(token_prompts[:2], params[:2], use_tqdm=False)  # warm-up without the adapter
            _, update_s = timed(lambda: llm.llm_engine.add_lora(LoRARequest("policy-1", 1, checkpoint)))
            outputs, gen_s = timed(
                lambda: llm.generate(
                    token_prompts, params, use_tqdm=False, lora_request=LoRARequest("policy-1", 1, checkpoint)
                )
            )
        finally:
            engine.close()
        lora_rows = [
            engine._row(r, j, c) for r, o in zip(requests, outputs, strict=True) for j, c in enumerate(o.outputs)
        ]
        tokens = sum(r.n_tokens for r in lora_rows)
        out["vllm_lora"] = {"per_update_s": update_s, "generate_s": gen_s, "tokens_per_s": tokens / gen_s}
        out["vllm_lora"]["gap_mean"], out["vllm_lora"]["gap_max"] = gap(lora_rows)
    out["vllm_lora_over_merged_tokens_per_s"] = out["vllm_lora"]["tokens_per_s"] / out["merged"]["tokens_per_s"]
    out["same_completions"] = float(np.mean([a.token_ids == b.token_ids for a, b in zip(rows, lora_rows, strict=True)]))
    return out


def format_lora(r: dict[str, Any]) -> str:
    lines = [
        f"LoRA policy sampling: {r['checkpoint']} (rank {r['rank']}) on {r['base']}; "
        f"{r['prompts']} prompts x {r['group_size']}, at most {r['max_tokens']} tokens"
    ]
    for name, label in (("merged", "merged weights + reload"), ("vllm_lora", "vLLM LoRA adapter   ")):
        f = r[name]
        lines.append(
            f"  {label}  per update {f['per_update_s']:6.2f} s   generate {f['generate_s']:6.1f} s "
            f"({f['tokens_per_s']:6.1f} tokens/s)   sampler/trainer gap mean {f['gap_mean']:.1e}, "
            f"max {f['gap_max']:.1e}"
        )
    lines.append(
        f"  vLLM LoRA / merged tokens per second: {r['vllm_lora_over_merged_tokens_per_s']:.2f}; "
        f"completions equal: {r['same_completions']:.0%}"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the options, run the benchmark, print its figures (or one JSON line); 0."""
    parser = argparse.ArgumentParser(
        prog="scripts/bench_lora.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--checkpoint", default=None, help="a LoRA checkpoint (default: one update on synthetic groups)"
    )
    parser.add_argument("--model", default="models/smollm2-135m-instruct", help="base model without --checkpoint")
    parser.add_argument("--test", default="data/arith_chat_test.parquet", help="prompts (veRL Parquet)")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--lora-rank", type=int, default=16, help="rank without --checkpoint")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON line")
    args = parser.parse_args(argv)
    result = bench_lora(
        args.checkpoint,
        args.model,
        args.test,
        args.prompts,
        args.n,
        args.max_tokens,
        args.lora_rank,
        progress=print_progress,
    )
    return print_figures(result, args.json, format_lora, indent=None)


if __name__ == "__main__":
    sys.exit(main())
