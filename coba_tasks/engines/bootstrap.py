"""Warm up the default model: supervised training of the tiny Llama on the arithmetic task (docs/design.md,
"Components").

RL from verifiable rewards needs a policy that already solves some problems: a group whose rollouts all fail
has no gradient. ``train_sft`` trains by next-token prediction on ``prompt + answer + </s>`` (loss on the
answer tokens only) for a fixed number of steps; the target is an overall greedy accuracy between 0.2 and
0.6, high on the easiest level and near zero on the hardest, in a few minutes on 2 cores. The seed fixes the
initial weights and the order of the examples. The flow in ``flows/bootstrap.py`` wraps these.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from coba_tasks.engines.fileio import (
    OutputDirError,
    atomic_write,
    check_output_dir,
    files_of,
    new_temporary_dir,
    publish_dir,
    read_json_record,
)
from coba_tasks.engines.model import TinyLlamaSpec, build_char_tokenizer, build_tiny_llama, save_hf
from coba_tasks.engines.update import pad_sequences

Log = Callable[[str], None]
METRICS_FILE = "bootstrap.json"
# What a bootstrap wrote before bootstrap.json listed its files (a model made by an older version).
WRITTEN_BEFORE_RECORD = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
)


@dataclass(frozen=True)
class BootstrapConfig:
    """Settings of the warm-up run (defaults: under 5 minutes on 2 idle CPU cores)."""

    spec: TinyLlamaSpec = field(default_factory=TinyLlamaSpec)
    steps: int = 4500  # optimizer steps
    batch_size: int = 128  # sequences per step
    lr: float = 3e-3  # peak AdamW learning rate (linear warm-up, cosine decay to 10 %)
    warmup_steps: int = 100
    weight_decay: float = 0.01
    seed: int = 0
    # torch CPU threads; 0 = every core this process may use (2 idle cores: 1.4x faster than 1 thread). The
    # thread count changes the order of float sums: the same seed and thread count give the same model.
    threads: int = 0
    eval_batch_size: int = 128
    max_answer_tokens: int = 10  # greedy decoding budget at evaluation
    # the probability that a drawn example's answer is a near miss (off by 1 or 10: a slipped digit or carry)
    label_noise: float = 0.0
    # the probability that a drawn example's target is GIVE_UP ("?", no answer: reward 0)
    give_up: float = 0.25

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "eval_batch_size", "max_answer_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"bootstrap {name} must be >= 1, got {getattr(self, name)}")
        if self.threads < 0:
            raise ValueError(f"bootstrap threads must be >= 0 (0 = every core), got {self.threads}")
        if not self.lr > 0:
            raise ValueError(f"bootstrap lr must be > 0, got {self.lr}")
        if not 0.0 <= self.label_noise < 1.0:
            raise ValueError(f"bootstrap label_noise must be in [0, 1), got {self.label_noise}")
        if not 0.0 <= self.give_up < 1.0:
            raise ValueError(f"bootstrap give_up must be in [0, 1), got {self.give_up}")


def encode_examples(tokenizer, prompts: Sequence[str], answers: Sequence[str]) -> list[tuple[list[int], int]]:
    """(token ids of prompt + answer + </s>, number of prompt tokens) per example."""
    eos = tokenizer.eos_token_id
    out = []
    for p, a in zip(prompts, answers, strict=True):
        p_ids = tokenizer(p, add_special_tokens=False).input_ids
        a_ids = tokenizer(a, add_special_tokens=False).input_ids
        out.append((p_ids + a_ids + [eos], len(p_ids)))
    return out


NEAR_MISSES = (-10, -1, 1, 10)  # offsets of the noisy teacher's wrong answers
GIVE_UP = "?"  # the target of a problem the teacher leaves unanswered
GAVE_UP = len(NEAR_MISSES) + 1  # draw_batch's variant index of GIVE_UP


def near_miss_answers(answers: Sequence[str], offset: int) -> list[str]:
    """Each integer answer moved by ``offset`` (the noisy teacher's wrong answers)."""
    out = []
    for a in answers:
        try:
            out.append(str(int(a) + offset))
        except ValueError:
            raise ValueError(f"label_noise needs integer answers, got {a!r}") from None
    return out


def draw_batch(rng: np.random.Generator, weights: np.ndarray, cfg: BootstrapConfig) -> tuple[np.ndarray, np.ndarray]:
    """One step's example indices (drawn with ``weights``) and each one's target: 0 the true answer, k in 1..4
    the near miss ``NEAR_MISSES[k - 1]``, ``GAVE_UP`` no answer (where the answer is not a near miss). The
    generator draws only what the options need, so a clean warm-up is the same as before they existed."""
    rows = rng.choice(len(weights), size=cfg.batch_size, p=weights)
    variant = np.zeros(cfg.batch_size, dtype=np.int64)
    if cfg.label_noise > 0:
        noisy = rng.random(cfg.batch_size) < cfg.label_noise
        variant = np.where(noisy, rng.integers(1, len(NEAR_MISSES) + 1, size=cfg.batch_size), 0)
    if cfg.give_up > 0:
        gave_up = rng.random(cfg.batch_size) < cfg.give_up
        variant = np.where(gave_up & (variant == 0), GAVE_UP, variant)
    return rows, variant


def collate(batch: Sequence[tuple[list[int], int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (input_ids, attention_mask, labels), each (B, T); labels -100 off the answer."""
    input_ids, mask, answer = pad_sequences([ids[:n] for ids, n in batch], [ids[n:] for ids, n in batch], pad_id)
    labels = torch.where(answer.bool(), input_ids, torch.full_like(input_ids, -100))
    return input_ids, mask, labels


def level_balanced_weights(train: pd.DataFrame) -> np.ndarray:
    """Sampling probability per example, equal in total for every difficulty level (the easiest level has few
    distinct problems, and is seen as often as the others); uniform without a ``difficulty`` column."""
    n = len(train)
    if "difficulty" not in train or n == 0:
        return np.full(n, 1.0 / max(n, 1))
    level = train["difficulty"].to_numpy()
    counts = pd.Series(level).value_counts()
    w = 1.0 / counts.reindex(level).to_numpy(dtype=np.float64)
    return w / w.sum()


def lr_at(step: int, cfg: BootstrapConfig) -> float:
    """Linear warm-up then cosine decay to 10 % of the peak."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))


def torch_threads(cfg: BootstrapConfig) -> int:
    """The thread count ``cfg.threads`` asks for (0: the cores this process may run on)."""
    return cfg.threads or len(os.sched_getaffinity(0))


def init_model(out_dir: str | Path, cfg: BootstrapConfig) -> Path:
    """Build the tokenizer and the randomly initialised model; save them in HF layout."""
    tok = build_char_tokenizer()
    return save_hf(build_tiny_llama(tok, cfg.spec, seed=cfg.seed), tok, out_dir)


def train_sft(
    init_dir: str | Path, train: pd.DataFrame, out_dir: str | Path, cfg: BootstrapConfig, log: Log = print
) -> dict:
    """Supervised warm-up of the checkpoint at ``init_dir`` on ``train`` (prompt_text, ground_truth), each step
    ``batch_size`` examples drawn with replacement (``level_balanced_weights``, seeded with ``cfg.seed``). Saves
    the model in HF layout at ``out_dir``; returns training figures."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(torch_threads(cfg))
    torch.manual_seed(cfg.seed)
    tok = AutoTokenizer.from_pretrained(init_dir)
    model = AutoModelForCausalLM.from_pretrained(init_dir, dtype=torch.float32)
    model.train()
    prompts, answers = train["prompt_text"].tolist(), train["ground_truth"].tolist()
    examples = encode_examples(tok, prompts, answers)
    rng = np.random.default_rng(cfg.seed)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}]
    groups.append({"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0})
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.98))
    weights = level_balanced_weights(train)
    if cfg.label_noise == 0 and cfg.give_up == 0:
        all_ids, all_mask, all_labels = collate(examples, tok.pad_token_id)  # (N, T) each, built once
    else:  # (V, N, T): variant 0 the true answers, one per near-miss offset (GAVE_UP - 1), GIVE_UP
        # an option that is off keeps its slots (the variant indices are fixed) filled with the true answers
        noisy = cfg.label_noise > 0
        variants = [examples]
        variants += [
            encode_examples(tok, prompts, near_miss_answers(answers, d)) if noisy else examples for d in NEAR_MISSES
        ]
        variants.append(encode_examples(tok, prompts, [GIVE_UP] * len(answers)))
        all_ids, all_mask, all_labels = (
            t.view(len(variants), len(examples), -1)
            for t in collate([e for v in variants for e in v], tok.pad_token_id)
        )
    lengths = all_mask.sum(dim=-1)
    t0 = time.perf_counter()
    tokens = 0
    losses: list[float] = []
    every = max(1, cfg.steps // 20)
    for step in range(cfg.steps):
        rows, variant = draw_batch(rng, weights, cfg)
        idx = torch.from_numpy(rows)
        if cfg.label_noise > 0 or cfg.give_up > 0:
            idx = (torch.from_numpy(variant), idx)
        width = int(lengths[idx].max())
        input_ids, mask, labels = all_ids[idx][:, :width], all_mask[idx][:, :width], all_labels[idx][:, :width]
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        tokens += int(mask.sum())
        losses.append(loss.item())
        if (step + 1) % every == 0 or step + 1 == cfg.steps:
            elapsed = time.perf_counter() - t0
            eta = elapsed / (step + 1) * (cfg.steps - step - 1)
            log(
                f"bootstrap step {step + 1}/{cfg.steps}  loss {np.mean(losses[-every:]):.3f}  "
                f"lr {lr_at(step, cfg):.2e}  {tokens / elapsed:,.0f} tok/s  eta {eta:.0f} s"
            )
    model.eval()
    save_hf(model, tok, out_dir)
    return {
        "train_seconds": time.perf_counter() - t0,
        "train_tokens": tokens,
        "final_loss": float(np.mean(losses[-every:])),
        "examples": len(examples),
    }


@torch.no_grad()
def greedy_answers(model, tokenizer, prompts: Sequence[str], max_new_tokens: int, batch_size: int) -> list[str]:
    """Greedy completions (text up to </s>) for ``prompts``, batched with left padding."""
    tokenizer.padding_side = "left"
    out: list[str] = []
    for start in range(0, len(prompts), batch_size):
        chunk = list(prompts[start : start + batch_size])
        enc = tokenizer(chunk, return_tensors="pt", padding=True, add_special_tokens=False)
        gen = model.generate(
            **enc,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        out += tokenizer.batch_decode(gen[:, enc.input_ids.shape[1] :], skip_special_tokens=True)
    return out


def evaluate_greedy(model_dir: str | Path, test: pd.DataFrame, cfg: BootstrapConfig) -> dict:
    """Greedy held-out accuracy, overall and by ``difficulty``, scored by the registered verifiers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from coba_tasks.engines.verify import score

    torch.set_num_threads(torch_threads(cfg))
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    t0 = time.perf_counter()
    answers = greedy_answers(model, tok, test["prompt_text"].tolist(), cfg.max_answer_tokens, cfg.eval_batch_size)
    rewards = np.array(
        [score(a, g, s).reward for a, g, s in zip(answers, test["ground_truth"], test["data_source"], strict=True)]
    )
    by_level = (
        pd.Series(rewards).groupby(test["difficulty"].to_numpy()).mean().sort_index()
        if "difficulty" in test
        else pd.Series(dtype=float)
    )
    return {
        "accuracy": float(rewards.mean()),
        "accuracy_by_difficulty": {str(int(k)): float(v) for k, v in by_level.items()},
        "eval_seconds": time.perf_counter() - t0,
        "n_eval": len(test),
    }


def write_metrics(model_dir: str | Path, cfg: BootstrapConfig, figures: dict) -> Path:
    """``bootstrap.json`` beside the model: config, seed, the measured figures and the files written
    (relative path -> bytes: what a later ``--force`` may replace, and nothing else)."""
    path = Path(model_dir) / METRICS_FILE
    record = {"config": asdict(cfg), **figures, "files": files_of(model_dir)}
    atomic_write(path, lambda f: f.write(json.dumps(record, indent=2).encode("utf-8")))
    return path


def check_output(out: str | Path, force: bool) -> None:
    """Refuse an output directory a bootstrap must not write: a file, a directory holding anything a
    bootstrap did not write (``--force`` included), or a bootstrapped model without ``force``."""
    if check_output_dir(out, METRICS_FILE, "coba bootstrap model", WRITTEN_BEFORE_RECORD) and not force:
        raise OutputDirError(
            f"{out} already holds a bootstrapped model ({METRICS_FILE}); pass --force (the flow's force=True) "
            "to rebuild it"
        )


@contextmanager
def build_area(out: str | Path, force: bool) -> Iterator[Path]:
    """A new temporary directory beside ``out`` to build in, removed afterwards (whatever happens);
    ``out`` is checked first (``check_output``), so a refused directory costs no training."""
    check_output(out, force)
    work = new_temporary_dir(out)
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


def publish(model_dir: str | Path, out: str | Path) -> list[str]:
    """Move the finished ``model_dir`` (with its ``bootstrap.json``) to ``out``: the model appears only
    when complete; a previous bootstrap there loses only the files its record lists. Returns the paths
    of anything else found there (kept aside), normally none."""
    return publish_dir(Path(model_dir), Path(out), METRICS_FILE, WRITTEN_BEFORE_RECORD)


def stale_bootstrap_note(model_dir: str | Path) -> str | None:
    """A note when ``model_dir`` was bootstrapped with another teacher than today's default, else None:
    ``make demo-tiny`` keeps an existing model, and one warmed up before the teacher gave up on some problems
    leaves RL almost nothing to learn."""
    record = read_json_record(Path(model_dir) / METRICS_FILE)
    if record is None:
        return None  # not a bootstrapped model: the user's own checkpoint
    saved = record.get("config", {})
    used, default = float(saved.get("give_up", 0.0)), BootstrapConfig().give_up
    if used == default:
        return None
    return (
        f"note: {model_dir} was bootstrapped with give_up {used:g}, the default is now {default:g}; "
        f"`coba bootstrap --out {model_dir} --force` rebuilds it with the default teacher"
    )
