"""``coba bench``: the benchmark group, the parsers and handlers of its benchmarks (allocate, rollout, verify,
update, stages, weights; each with ``--json``).

The measurements and their wording are in the package ``coba_tasks.bench`` (``solvers_bench``:
allocate; ``engines_bench``: rollout, verify; ``update_bench``; ``stages_bench``); a handler runs one,
with its progress on stderr, and prints its figures (text, or JSON with ``--json``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from coba_tasks.commands.args import add_command, option, positive_int

JSON_OPTION = option("--json", action="store_true", help="print the figures as JSON")


def print_progress(msg: str) -> None:
    """A benchmark's progress line on stderr: ``[bench] msg ...``."""
    print(f"[bench] {msg} ...", file=sys.stderr, flush=True)


def print_figures(
    result: dict[str, Any], as_json: bool, formatter: Callable[[Any], str], indent: int | None = 2
) -> int:
    """Print a benchmark's figures, as JSON (``--json``; ``indent=None``: one line) or worded by ``formatter``; 0."""
    print(json.dumps(result, indent=indent) if as_json else formatter(result))
    return 0


def group_sizes(value: str) -> list[int]:
    """An argparse type: comma-separated group sizes, each >= 1 (``coba bench update --groups``)."""
    try:
        sizes = [int(x) for x in value.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated group sizes, e.g. 2,4,8; got {value!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"group sizes must be >= 1, got {value!r}")
    return sizes


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``coba bench`` and every benchmark under it; returns the group's parser."""
    bench = add_command(
        subparsers,
        "bench",
        help="benchmarks (print figures measured in one run)",
        description="Benchmarks. They print figures and ratios measured in one run; they assert nothing.",
        examples=["coba bench allocate", "coba bench allocate --json"],
    )
    bench_sub = bench.add_subparsers(dest="bench", metavar="BENCHMARK")
    bench_sub.required = True

    add_command(
        bench_sub,
        "allocate",
        help="heap vs threshold vs DP allocation, and a scale sweep",
        description="Time the CoBA solvers at the paper's Table 4 setting (M = 512, B_total = 8192, bounds "
        "[2, 128]) against a plain Python heap, then sweep M over 512, 4096, 65536 and 1,000,000 "
        "(B_total = 16 M). The heap and the DP run where their time, predicted from the last size measured, "
        "is under 60 s.",
        examples=["coba bench allocate", "coba bench allocate --quick --json"],
        options=[
            JSON_OPTION,
            option("--quick", action="store_true", help="fewer repeats, sweep only to M = 65536"),
            option("--seed", type=int, default=0, help="seed of the random pass rates (default 0)"),
        ],
        func=cmd_bench_allocate,
    )
    add_command(
        bench_sub,
        "rollout",
        help="tokens per second of the vLLM and transformers rollout backends",
        description="Generate the same prompts, group sizes and seeds with each backend and print tokens per second.",
        examples=["coba bench rollout", "coba bench rollout --backends vllm --prompts 200 --n 16"],
        options=[
            option("--model", default="models/arith-tiny", help="HF model directory (default models/arith-tiny)"),
            option("--test", default="data/arith_test.parquet", help="prompts to use (veRL Parquet)"),
            option("--prompts", type=positive_int, default=100, help="number of prompts (default 100)"),
            option("--n", type=positive_int, default=8, help="samples per prompt (default 8)"),
            option("--max-tokens", type=positive_int, default=12, help="max new tokens (default 12)"),
            option("--backends", default="vllm,transformers", help="comma-separated (default vllm,transformers)"),
            JSON_OPTION,
        ],
        func=cmd_bench_rollout,
    )
    add_command(
        bench_sub,
        "verify",
        help="verifier items per second (arith in-process, math-verify in worker processes)",
        description="Score synthetic arith and math items through the verifier pool and print items per second.",
        examples=["coba bench verify", "coba bench verify --math 1000 --workers 2 --json"],
        options=[
            option("--arith", type=positive_int, default=20_000, help="arith items (default 20000)"),
            option("--math", type=positive_int, default=300, help="math items (default 300)"),
            option("--workers", type=positive_int, default=2, help="worker processes (default 2)"),
            JSON_OPTION,
        ],
        func=cmd_bench_verify,
    )
    _add_update(bench_sub)
    _add_stages(bench_sub)
    _add_weights(bench_sub)
    return bench


def _add_update(bench_sub: Any) -> None:
    from coba_tasks.bench import update_bench  # its docstring is the description; its defaults are the options

    model = update_bench.DEFAULT_MODEL
    add_command(
        bench_sub,
        "update",
        help="the GRPO update against a plain transformers loop on the same rollouts (speed and agreement)",
        description=(update_bench.__doc__ or "").split("\n\n")[1],
        examples=[
            "coba bench update",
            "coba bench update --model models/arith-tiny --json",
            "coba bench update --run-dir runs/smollm2-arith --step 3 --reload",
        ],
        options=[
            option("--model", default=model, help=f"Hugging Face model directory (default {model})"),
            option("--run-dir", default=None, help="take the rollouts of a run's step instead of synthetic ones"),
            option("--step", type=int, default=0, help="the run's step (with --run-dir; default 0)"),
            option(
                "--groups",
                type=group_sizes,
                default=list(update_bench.DEFAULT_GROUPS),
                help="synthetic group sizes (2,4,...)",
            ),
            option("--prompt-tokens", type=positive_int, default=46, help="synthetic prompt length (default 46)"),
            option(
                "--completion-tokens", type=positive_int, default=32, help="synthetic completion length (default 32)"
            ),
            option("--micro-batch", type=positive_int, default=16, help="sequences per forward/backward (default 16)"),
            option("--repeats", type=positive_int, default=2, help="timed updates of each kind (default 2)"),
            option("--reload", action="store_true", help="also time the weight reload into a vLLM engine"),
            option("--threads", type=int, default=0, help="torch threads (default 0: every core, as a run has)"),
            option(
                "--lora-rank", type=int, default=16, help="rank of the LoRA update timed beside (default 16; 0: none)"
            ),
            JSON_OPTION,
        ],
        func=cmd_bench_update,
    )


def _add_stages(bench_sub: Any) -> None:
    add_command(
        bench_sub,
        "stages",
        help="where a training step's time goes: rollout stage vs bare vLLM, Prefect's share, Parquet, verifier, "
        "update",
        description="Run a few training steps through the Prefect training flow on a temporary run directory "
        "(the seconds of each stage and Prefect's own time per step), then time the rollout stage against a bare "
        "vllm.LLM.generate with the same prompts, budgets and seeds, the Parquet write and read of each of the "
        "step's tables, the verifier and the GRPO update. Prints the figures and the ratios with their goals "
        "(rollout stage / bare vLLM <= 1.10, Prefect <= 10% of a step); asserts nothing.",
        examples=[
            "coba bench stages",
            "coba bench stages --steps 5 --json > stages.json",
            "coba bench stages --config configs/tiny-test.yaml --set data.prompts_per_step=8",
        ],
        options=[
            option(
                "--config",
                default="configs/demo-tiny.yaml",
                help="YAML config (default: the tiny model, configs/demo-tiny.yaml)",
            ),
            option(
                "--set",
                action="append",
                default=[],
                metavar="KEY=VALUE",
                help="override a config key, e.g. --set data.prompts_per_step=64 (repeatable)",
            ),
            option("--steps", type=positive_int, default=3, help="training steps of the run (default 3)"),
            JSON_OPTION,
        ],
        func=cmd_bench_stages,
    )


def _add_weights(bench_sub: Any) -> None:
    from coba_tasks.bench import weights_bench  # its docstring is the description

    add_command(
        bench_sub,
        "weights",
        help="the policy to the rollout engine after an update: through a file vs from memory; a checkpoint",
        description=(weights_bench.__doc__ or "").split("\n\n")[1],
        examples=["coba bench weights", "coba bench weights --skip-0.5b --json"],
        options=[
            option(
                "--smollm2",
                default=weights_bench.DEFAULT_SMOLLM2,
                help=f"SmolLM2 model directory, timed when it exists (default {weights_bench.DEFAULT_SMOLLM2})",
            ),
            option(
                "--skip-0.5b",
                dest="skip_05b",
                action="store_true",
                help="leave out the random model of Qwen2.5-0.5B's shape",
            ),
            option("--repeats", type=positive_int, default=3, help="timed calls of each way (default 3)"),
            JSON_OPTION,
        ],
        func=cmd_bench_weights,
    )


def cmd_bench_allocate(args: argparse.Namespace) -> int:
    """Run ``coba bench allocate``: progress on stderr, the figures (text or JSON) on stdout."""
    from coba_tasks.bench.solvers_bench import bench_allocate, format_allocate

    result = bench_allocate(seed=args.seed, quick=args.quick, progress=print_progress)
    return print_figures(result, args.json, format_allocate)


def cmd_bench_rollout(args: argparse.Namespace) -> int:
    """Run ``coba bench rollout`` on --model (which must exist)."""
    from coba_tasks.bench.engines_bench import bench_rollout, format_rollout

    if not (Path(args.model) / "config.json").is_file():
        raise ValueError(f"model {args.model} not found: run `coba bootstrap` first or pass --model DIR")
    result = bench_rollout(
        args.model,
        args.test,
        prompts=args.prompts,
        group_size=args.n,
        max_tokens=args.max_tokens,
        backends=tuple(args.backends.split(",")),
        progress=print_progress,
    )
    return print_figures(result, args.json, format_rollout)


def cmd_bench_verify(args: argparse.Namespace) -> int:
    """Run ``coba bench verify``."""
    from coba_tasks.bench.engines_bench import bench_verify, format_verify

    result = bench_verify(arith_items=args.arith, math_items=args.math, workers=args.workers)
    return print_figures(result, args.json, format_verify)


def cmd_bench_update(args: argparse.Namespace) -> int:
    """``coba bench update``: run the benchmark, print the figures (or one JSON line); 0."""
    from coba_tasks.bench.update_bench import bench_update, format_update

    names = ("run_dir", "step", "groups", "prompt_tokens", "completion_tokens", "micro_batch", "repeats", "reload")
    given = {name: getattr(args, name) for name in (*names, "threads", "lora_rank")}
    result = bench_update(args.model, progress=print_progress, **given)
    return print_figures(result, args.json, format_update, indent=None)


def cmd_bench_stages(args: argparse.Namespace) -> int:
    """``coba bench stages``: run the benchmark, print the report (or JSON); 0."""
    from coba_tasks.bench.stages_bench import bench_stages, format_stages
    from coba_tasks.commands.prefect_env import configure_prefect, start_local_server

    configure_prefect()
    start_local_server()
    from flows.train import train_flow

    def train(cfg: Any, run_dir: str) -> dict:
        return train_flow(config=cfg, run_dir=run_dir)

    result = bench_stages(train, args.config, list(args.set or []), steps=args.steps, progress=print_progress)
    return print_figures(result, args.json, format_stages)


def cmd_bench_weights(args: argparse.Namespace) -> int:
    """``coba bench weights``: run the benchmark, print the table (or JSON); 0."""
    from coba_tasks.bench.weights_bench import bench_weights, format_weights

    result = bench_weights(args.smollm2, not args.skip_05b, args.repeats, progress=print_progress)
    return print_figures(result, args.json, format_weights)
