"""A peer run: TRL's GRPOTrainer (fixed group size) on coba-rl's tiny model and arithmetic task, or (``--chat``)
on SmolLM2-135M-Instruct with chat prompts and the math-verify reward (scripts/peer_smollm2.py runs that one
beside coba-rl).

Runs in its own virtualenv (TRL is not a coba-rl dependency), see docs/trl_peer.md:

    /tmp/venv-trl/bin/python scripts/trl_peer.py --steps 24

Same setting as configs/demo-tiny.yaml with uniform budgets: a training pool of 1024 prompts sampled
from data/arith_train.parquet with the run seed (as flows/train.py does), 128 prompts x G=16 =
2048 completions per optimizer step, temperature 1.0, 12 new tokens, AdamW lr 1e-4 (constant),
grad-norm clip 1.0, no KL, token-mean ("dapo") loss, ratio clipped to [1 - 0.2, 1 + 0.28], one
optimizer step per generation batch. TRL generates with transformers (no vLLM).

Prints one JSON line: TRL version, steps, rollouts per step, mean seconds per optimizer step
(the first step excluded as warm-up), greedy held-out accuracy before and after (overall and by
difficulty after), and the training reward per step.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(ROOT / "models" / "arith-tiny"))
    p.add_argument("--train", default=str(ROOT / "data" / "arith_train.parquet"))
    p.add_argument("--test", default=str(ROOT / "data" / "arith_test.parquet"))
    p.add_argument("--out", default="/tmp/trl-peer-out", help="where the trained model is saved")
    p.add_argument("--steps", type=int, default=24, help="optimizer steps")
    p.add_argument("--prompts-per-step", type=int, default=128, help="M")
    p.add_argument("--group-size", type=int, default=16, help="G (num_generations)")
    p.add_argument("--micro-batch", type=int, default=256, help="completions per forward/backward")
    p.add_argument("--train-prompts", type=int, default=1024, help="training pool size; 0 = whole train split")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--max-new-tokens", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: as coba-rl's trainer)")
    p.add_argument("--eval-batch", type=int, default=250)
    p.add_argument("--skip-eval-before", action="store_true")
    p.add_argument(
        "--chat",
        action="store_true",
        help="conversational prompts (the veRL messages; TRL applies the chat template, as coba-rl does) and the "
        "math-verify reward of coba-rl's verifier pool (\\boxed{} answers): the SmolLM2 setting",
    )
    p.add_argument("--vllm", action="store_true", help="TRL's vLLM generation (colocate mode) instead of transformers")
    a = p.parse_args(argv)
    if a.micro_batch <= 0 or (a.prompts_per_step * a.group_size) % a.micro_batch:
        p.error(f"--micro-batch must divide prompts_per_step * group_size = {a.prompts_per_step * a.group_size}")
    return a


def load_split(path: str, chat: bool = False):
    """veRL Parquet -> DataFrame with prompt (the user message as plain text, or with ``chat`` the whole
    message list), ground_truth (str), difficulty (int)."""
    import pandas as pd

    raw = pd.read_parquet(path)
    prompts = (
        [[{"role": m["role"], "content": m["content"]} for m in list(msgs)] for msgs in raw["prompt"]]
        if chat
        else [list(m)[-1]["content"] for m in raw["prompt"]]  # the user message, no chat template
    )
    return pd.DataFrame(
        {
            "prompt": prompts,
            "ground_truth": [str(r["ground_truth"]) for r in raw["reward_model"]],
            "difficulty": [int(e["difficulty"]) for e in raw["extra_info"]],
        }
    )


_POOL = None


def math_reward(completions: list, ground_truth: list[str], **_) -> list[float]:
    """coba-rl's math verifier (math-verify, in its worker processes with the same 5-s limit): 1.0 when the
    completion's answer equals the ground truth."""
    global _POOL
    if _POOL is None:
        sys.path.insert(0, str(ROOT))
        from coba_tasks.engines.verify_pool import VerifierPool

        _POOL = VerifierPool(workers=2, timeout_s=5.0)
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]  # conversational: a message
    verdicts = _POOL.score([(t, g, "math") for t, g in zip(texts, ground_truth, strict=True)])
    return [v.reward for v in verdicts]


def exact_reward(completions: list[str], ground_truth: list[str], **_) -> list[float]:
    """1.0 when the completion (TRL decodes up to </s>, special tokens skipped) stripped equals the answer."""
    return [1.0 if c.strip() == g.strip() else 0.0 for c, g in zip(completions, ground_truth, strict=True)]


def greedy_accuracy(model, tokenizer, test, max_new_tokens: int, batch_size: int) -> dict:
    """Greedy held-out accuracy, overall and by difficulty (coba's bootstrap eval: its left-padded batches)."""
    from coba_tasks.engines.bootstrap import greedy_answers

    model.eval()
    answers = greedy_answers(model, tokenizer, test["prompt"].tolist(), max_new_tokens, batch_size)
    correct = [float(a.strip() == g.strip()) for a, g in zip(answers, test["ground_truth"], strict=True)]
    df = test.assign(correct=correct)
    by = df.groupby("difficulty")["correct"].mean()
    return {
        "accuracy": round(float(df["correct"].mean()), 4),
        "by_difficulty": {int(k): round(float(v), 4) for k, v in by.items()},
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("WANDB_DISABLED", "true")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))

    import torch

    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)

    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    train = load_split(args.train, args.chat)
    if args.train_prompts and args.train_prompts < len(train):
        # the same pool as coba-rl's data.train_prompts: DataFrame.sample(n, random_state=run.seed)
        train = train.sample(args.train_prompts, random_state=args.seed).reset_index(drop=True)
    test = load_split(args.test)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)

    before = None
    if not args.skip_eval_before and not args.chat:  # --chat: coba-rl's own evaluation scores the saved model
        t0 = time.perf_counter()
        before = greedy_accuracy(model, tokenizer, test, args.max_new_tokens, args.eval_batch)
        print(
            f"[trl-peer] held-out greedy before: {before} ({time.perf_counter() - t0:.1f} s)",
            file=sys.stderr,
            flush=True,
        )

    rollouts = args.prompts_per_step * args.group_size
    grad_accum = rollouts // args.micro_batch
    # TRL counts per_device_train_batch_size in completions. One optimizer step consumes
    # per_device_train_batch_size * gradient_accumulation_steps = 2048 completions; with
    # steps_per_generation left unset it defaults to gradient_accumulation_steps, so
    # generation_batch_size = 2048 = 128 prompts x 16, generated once per optimizer step, and
    # num_iterations = 1 uses each generation batch for exactly one optimizer step (on-policy).
    config = GRPOConfig(
        output_dir=args.out,
        max_steps=args.steps,
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=grad_accum,
        num_generations=args.group_size,
        num_iterations=1,
        max_completion_length=args.max_new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim="adamw_torch",
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=0.0,
        loss_type="dapo",
        epsilon=0.2,
        epsilon_high=0.28,
        scale_rewards="group",
        use_vllm=args.vllm,
        **({"vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.3} if args.vllm else {}),
        bf16=False,
        fp16=False,
        use_cpu=True,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        seed=args.seed,
        data_seed=args.seed,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    assert config.generation_batch_size == rollouts and config.steps_per_generation == grad_accum, (
        config.generation_batch_size,
        config.steps_per_generation,
    )

    class StepTimer(TrainerCallback):
        """Wall and process-CPU seconds per optimizer step (the CPU figure is less sensitive to other jobs)."""

        def __init__(self) -> None:
            self.t_begin = (0.0, 0.0)
            self.ends: list[tuple[float, float]] = []

        def on_train_begin(self, *a, **k):
            self.t_begin = (time.perf_counter(), time.process_time())

        def on_step_end(self, *a, **k):
            self.ends.append((time.perf_counter(), time.process_time()))
            prev = self.ends[-2] if len(self.ends) > 1 else self.t_begin
            wall, cpu = self.ends[-1][0] - prev[0], self.ends[-1][1] - prev[1]
            gen = gen_times[-1] if gen_times else (0.0, 0.0)
            print(
                f"[trl-peer] step {len(self.ends)}: {wall:.2f} s wall, {cpu:.2f} s CPU"
                f" (generation {gen[0]:.2f} s wall, {gen[1]:.2f} s CPU)",
                file=sys.stderr,
                flush=True,
            )

        def on_log(self, args, state, control, logs=None, **k):
            print(f"[trl-peer] log {logs}", file=sys.stderr, flush=True)

    gen_times: list[tuple[float, float]] = []  # (wall, CPU) of each transformers generate batch
    timer = StepTimer()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=math_reward if args.chat else exact_reward,
        args=config,
        train_dataset=Dataset.from_pandas(train[["prompt", "ground_truth"]], preserve_index=False),
        processing_class=tokenizer,
        callbacks=[timer],
    )
    trainer.remove_callback(PrinterCallback)  # keep stdout to the one JSON line; logs go to stderr
    generate = trainer._generate_single_turn

    def timed_generate(*a, **k):
        w, c = time.perf_counter(), time.process_time()
        out = generate(*a, **k)
        gen_times.append((time.perf_counter() - w, time.process_time() - c))
        return out

    trainer._generate_single_turn = timed_generate
    trainer.train()
    trainer.save_model(args.out)
    tokenizer.save_pretrained(args.out)

    marks = [timer.t_begin, *timer.ends]
    durations = [b[0] - a[0] for a, b in itertools.pairwise(marks)]
    cpu = [b[1] - a[1] for a, b in itertools.pairwise(marks)]

    def steady_mean(xs: list[float]) -> float:
        xs = xs[1:] if len(xs) > 1 else xs  # the first step is warm-up
        return round(sum(xs) / len(xs), 3)

    rewards = [round(h["reward"], 4) for h in trainer.state.log_history if "reward" in h]
    # the share of groups whose rewards are all equal, per step (TRL trains on their rows too)
    zero_std = [round(h["frac_reward_zero_std"], 4) for h in trainer.state.log_history if "frac_reward_zero_std" in h]

    after = {"accuracy": None, "by_difficulty": None}
    if not args.chat:
        t0 = time.perf_counter()
        after = greedy_accuracy(trainer.model, tokenizer, test, args.max_new_tokens, args.eval_batch)
        print(
            f"[trl-peer] held-out greedy after: {after} ({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True
        )

    result = {
        "trl_version": trl.__version__,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "threads": args.threads,
        "steps": len(durations),
        "prompts_per_step": args.prompts_per_step,
        "group_size": args.group_size,
        "rollouts_per_step": rollouts,
        "seconds_per_step": steady_mean(durations),
        "cpu_seconds_per_step": steady_mean(cpu),
        "generation_seconds_per_step": steady_mean([g[0] for g in gen_times]),
        "generation_cpu_seconds_per_step": steady_mean([g[1] for g in gen_times]),
        "seconds_first_step": round(durations[0], 3),
        "seconds_per_step_all": [round(d, 2) for d in durations],
        "cpu_seconds_per_step_all": [round(d, 2) for d in cpu],
        "train_reward_per_step": rewards,
        "zero_std_group_share_per_step": zero_std,
        "generation": "vllm (colocate)" if args.vllm else "transformers generate",
        "accuracy_before": before["accuracy"] if before else None,
        "accuracy_by_difficulty_before": before["by_difficulty"] if before else None,
        "accuracy_after": after["accuracy"],
        "accuracy_by_difficulty_after": after["by_difficulty"],
        "out": args.out,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
